"""Noise levels the way ComfyUI computes them: the model's 1000-entry sigma table, the mapping
between a sigma and the UNet's timestep, and the sigma schedules ComfyUI names (`normal`,
`karras`, `exponential`, `sgm_uniform`, `simple`, `ddim_uniform`, `beta`, `kl_optimal`).

A sigma σ is the noise level of x = x₀ + σ·ε (k-diffusion's view); a DDPM timestep t has
σ_t = √((1-ᾱ_t)/ᾱ_t). ComfyUI feeds the UNet the index of the table entry nearest to σ (in log
space): it does not interpolate, and neither do we, so that a sampler sees the same timesteps.
The formulas follow Karras et al. 2022 (karras), ComfyUI's own schedulers for the rest; tests
reproduce figures computed with ComfyUI's code.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

SCHEDULE_NAMES = ("normal", "karras", "exponential", "sgm_uniform", "simple", "ddim_uniform", "beta", "kl_optimal")
# ComfyUI's value for ᾱ at the last timestep of a zero-terminal-SNR schedule: exactly 0 would
# make σ infinite there, and no sampler can start from infinite noise.
ZERO_SNR_LAST_ALPHA_BAR = 4.8973451890853435e-08


class SigmaTable:
    """The sigmas of the model's training timesteps, ascending (index = timestep)."""

    def __init__(self, sigmas: torch.Tensor) -> None:
        self.sigmas = sigmas.float()
        self.log_sigmas = sigmas.log().float()

    @classmethod
    def from_scheduler_config(cls, config: Mapping[str, Any]) -> SigmaTable:
        """From a diffusers scheduler config (betas, their schedule, zero-terminal SNR)."""
        steps = config.get("num_train_timesteps", 1000)
        start, end = config.get("beta_start", 0.00085), config.get("beta_end", 0.012)
        schedule = config.get("beta_schedule", "scaled_linear")
        if schedule == "scaled_linear":
            betas = torch.linspace(start**0.5, end**0.5, steps, dtype=torch.float64) ** 2
        elif schedule == "linear":
            betas = torch.linspace(start, end, steps, dtype=torch.float64)
        else:
            raise ValueError(f"beta_schedule {schedule!r} is not supported by the kdiffusion eval backend")
        alphas_cumprod = torch.cumprod(1.0 - betas, dim=0)
        sigmas = ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5
        if config.get("rescale_betas_zero_snr", False):
            sigmas = _zero_terminal_snr(sigmas)
        return cls(sigmas)

    @property
    def sigma_min(self) -> float:
        return float(self.sigmas[0])

    @property
    def sigma_max(self) -> float:
        return float(self.sigmas[-1])

    def timestep(self, sigma: torch.Tensor) -> torch.Tensor:
        """The index of the table entry nearest to each sigma, in log space."""
        distances = sigma.log().reshape(1, -1) - self.log_sigmas[:, None]
        return distances.abs().argmin(dim=0).view(sigma.shape)

    def sigma(self, timestep: torch.Tensor) -> torch.Tensor:
        """Sigma at a (fractional) timestep, interpolated in log space."""
        t = timestep.float().clamp(0, len(self.sigmas) - 1)
        low, high, weight = t.floor().long(), t.ceil().long(), t.frac()
        return ((1 - weight) * self.log_sigmas[low] + weight * self.log_sigmas[high]).exp()


def _zero_terminal_snr(sigmas: torch.Tensor) -> torch.Tensor:
    """Lin et al. 2024: shift and scale √ᾱ so the last timestep has no signal left (ᾱ set to a
    tiny value rather than 0, as ComfyUI does), keeping the first timestep's √ᾱ."""
    root = (1 / (sigmas * sigmas + 1)).sqrt()
    first, last = root[0].clone(), root[-1].clone()
    root = (root - last) * first / (first - last)
    alphas_cumprod = root**2
    alphas_cumprod[-1] = ZERO_SNR_LAST_ALPHA_BAR
    return ((1 - alphas_cumprod) / alphas_cumprod) ** 0.5


def make_sigmas(name: str, table: SigmaTable, steps: int) -> torch.Tensor:
    """`steps` + 1 sigmas from high to low, the last 0 (ComfyUI's `calculate_sigmas`)."""
    if name in ("normal", "sgm_uniform"):
        return _normal(table, steps, sgm=name == "sgm_uniform")
    # karras and exponential in float32, as k-diffusion computes them: the SDE samplers' Brownian
    # noise moves by about √δ when a sigma moves by δ, so matching ComfyUI takes the same bits.
    if name == "karras":  # Karras et al. 2022, eq. 5, rho = 7
        ramp = torch.linspace(0, 1, steps)
        low, high = table.sigma_min ** (1 / 7), table.sigma_max ** (1 / 7)
        return _append_zero((high + ramp * (low - high)) ** 7)
    if name == "exponential":
        return _append_zero(torch.linspace(math.log(table.sigma_max), math.log(table.sigma_min), steps).exp())
    if name == "simple":
        stride = len(table.sigmas) / steps
        return _append_zero(torch.stack([table.sigmas[-(1 + int(i * stride))] for i in range(steps)]))
    if name == "ddim_uniform":
        return _ddim_uniform(table, steps)
    if name == "beta":
        return _beta(table, steps)
    if name == "kl_optimal":
        return _kl_optimal(table, steps)
    raise ValueError(f"unknown sigma schedule {name!r}")


def _append_zero(sigmas: torch.Tensor) -> torch.Tensor:
    return torch.cat([sigmas.float(), sigmas.new_zeros(1).float()])


def _normal(table: SigmaTable, steps: int, sgm: bool) -> torch.Tensor:
    """Timesteps evenly spaced from the one of σ_max to the one of σ_min (`sgm_uniform`: `steps`
    of `steps` + 1 such points, the last left out)."""
    start = table.timestep(torch.tensor(table.sigma_max))
    end = table.timestep(torch.tensor(table.sigma_min))
    timesteps = torch.linspace(start, end, steps + 1)[:-1] if sgm else torch.linspace(start, end, steps)
    return _append_zero(torch.stack([table.sigma(t) for t in timesteps]))


def _ddim_uniform(table: SigmaTable, steps: int) -> torch.Tensor:
    """Every (1000 // steps)-th table entry from timestep 1 up, reversed, with a final 0."""
    stride = max(len(table.sigmas) // steps, 1)
    chosen = [0.0] + [float(table.sigmas[index]) for index in range(1, len(table.sigmas), stride)]
    return torch.tensor(chosen[::-1], dtype=torch.float32)


def _beta(table: SigmaTable, steps: int, alpha: float = 0.6, beta: float = 0.6) -> torch.Tensor:
    """Timesteps at the quantiles of a Beta(0.6, 0.6) distribution (dense at both ends), rounded
    to table entries, repeats dropped."""
    import numpy as np
    from scipy import stats

    last = len(table.sigmas) - 1
    timesteps = np.rint(stats.beta.ppf(1 - np.linspace(0, 1, steps, endpoint=False), alpha, beta) * last)
    chosen, previous = [], None
    for t in timesteps:
        if t != previous:
            chosen.append(table.sigmas[int(t)])
        previous = t
    return _append_zero(torch.stack(chosen))


def _kl_optimal(table: SigmaTable, steps: int) -> torch.Tensor:
    """Sigmas evenly spaced in arctan(σ) (Sabour et al. 2024). One step divides by zero, as in
    ComfyUI: config validation refuses it."""
    fraction = torch.arange(steps, dtype=torch.float32).div_(steps - 1) if steps > 1 else torch.full((1,), math.nan)
    sigmas = torch.zeros(steps + 1)
    sigmas[:-1] = (fraction * math.atan(table.sigma_min) + (1 - fraction) * math.atan(table.sigma_max)).tan_()
    return sigmas
