"""The samplers ComfyUI offers under k-diffusion's names, written from the published algorithms.

Each sampler integrates the probability-flow ODE (or, for the ancestral and SDE ones, the
reverse SDE) of x = x₀ + σ·ε from sigmas[0] down to 0, given `denoise(x, σ)`, the model's
estimate of x₀. The derivative of the ODE is d = (x - denoise(x, σ)) / σ (Karras et al. 2022).
- euler, heun, dpm_2 (Karras et al. 2022, Alg. 2 with and without the 2nd-order correction;
  dpm_2 takes its midpoint in log σ) and their ancestral forms (a deterministic step down to
  σ_down, then fresh noise of size σ_up: σ_down² + σ_up² = σ_next²);
- lms: linear multistep over the last 4 derivatives, coefficients integrated in σ, the last
  step landing on the model's estimate;
- the DPM-Solver family in the half-log-SNR λ = -log σ (Lu et al. 2022, DPM-Solver and
  DPM-Solver++): dpmpp_2s_ancestral (2nd-order single step, ancestral), dpmpp_sde (the same with
  SDE noise), dpmpp_2m (2nd-order multistep), dpmpp_2m_sde (multistep SDE, midpoint or heun
  correction), dpmpp_3m_sde (3rd-order multistep SDE).

Noise comes from the caller's `Noise`: per-call draws from a CPU generator (ancestral samplers)
or a Brownian tree (SDE samplers), both seeded, so a seed gives the same image on every device.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable

import torch

Denoiser = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Noise = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # noise(σ, σ_next): unit-variance noise

SDE_SAMPLERS = ("dpmpp_sde", "dpmpp_2m_sde", "dpmpp_2m_sde_heun", "dpmpp_3m_sde")
ANCESTRAL_SAMPLERS = ("euler_ancestral", "dpm_2_ancestral", "dpmpp_2s_ancestral")
# ComfyUI computes one sigma more for these and leaves out the second to last: their last step
# would otherwise spend its model call at the smallest sigma for nothing.
DISCARD_PENULTIMATE_SIGMA = ("dpm_2", "dpm_2_ancestral")


def cpu_noise(shape: torch.Size, seed: int) -> Noise:
    """Fresh draws from a CPU generator seeded once: the same numbers on every device."""
    generator = torch.Generator().manual_seed(seed)

    def draw(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        return torch.randn(shape, generator=generator)

    return draw


def brownian_noise(x: torch.Tensor, sigmas: torch.Tensor, seed: int) -> Noise:
    """The increments of one Brownian motion over σ, built on the CPU from `seed` (torchsde's
    Brownian tree): the noise between two sigmas does not depend on the steps taken between them,
    which is what makes the SDE samplers converge as steps are added."""
    import torchsde

    low, high = float(sigmas[sigmas > 0].min()), float(sigmas.max())
    tree = torchsde.BrownianTree(torch.tensor(low), torch.zeros_like(x, device="cpu"), torch.tensor(high),
                                 entropy=seed)

    def draw(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        start, end = sorted((float(sigma), float(sigma_next)))
        sign = 1.0 if float(sigma) < float(sigma_next) else -1.0
        with warnings.catch_warnings():  # float32 rounding at σ_max, which torchsde reports and handles
            warnings.filterwarnings("ignore", message="Should have t[ab][<>]=t[01]")
            increment = tree(torch.tensor(start), torch.tensor(end)) * sign
        return increment / abs(end - start) ** 0.5

    return draw


def ancestral_step(sigma: torch.Tensor, sigma_next: torch.Tensor,
                   eta: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(σ_down, σ_up): step deterministically to σ_down, then add noise σ_up, so that the result
    has noise level σ_next."""
    if not eta:
        return sigma_next, torch.zeros_like(sigma_next)
    sigma_up = torch.minimum(sigma_next, eta * (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5)
    return (sigma_next**2 - sigma_up**2) ** 0.5, sigma_up


def derivative(x: torch.Tensor, sigma: torch.Tensor, denoised: torch.Tensor) -> torch.Tensor:
    return (x - denoised) / sigma


def _lambda(sigma: torch.Tensor) -> torch.Tensor:
    """Half the log signal-to-noise ratio, -log σ (inf at σ = 0)."""
    return sigma.log().neg()


def _sigma(lam: torch.Tensor) -> torch.Tensor:
    return lam.neg().exp()


def sample_euler(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise | None) -> torch.Tensor:
    for sigma, sigma_next in itertools.pairwise(sigmas):
        x = x + derivative(x, sigma, denoise(x, sigma)) * (sigma_next - sigma)
    return x


def _ancestral(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise,
               step: Callable[..., torch.Tensor]) -> torch.Tensor:
    """The ancestral scheme: each step goes deterministically to σ_down with `step(denoise, x,
    σ, σ_down, denoised)`, then adds fresh noise of size σ_up (none after the last step)."""
    for sigma, sigma_next in itertools.pairwise(sigmas):
        denoised = denoise(x, sigma)
        sigma_down, sigma_up = ancestral_step(sigma, sigma_next)
        x = step(denoise, x, sigma, sigma_down, denoised)
        if sigma_next > 0:
            x = x + noise(sigma, sigma_next) * sigma_up
    return x


def _euler_step(denoise: Denoiser, x: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor,
                denoised: torch.Tensor) -> torch.Tensor:
    """From σ to `target` along the derivative at σ; at 0 that is the model's estimate itself."""
    return denoised if target == 0 else x + derivative(x, sigma, denoised) * (target - sigma)


def sample_euler_ancestral(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    return _ancestral(denoise, x, sigmas, noise, _euler_step)


def sample_heun(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise | None) -> torch.Tensor:
    for sigma, sigma_next in itertools.pairwise(sigmas):
        d = derivative(x, sigma, denoise(x, sigma))
        step = sigma_next - sigma
        if sigma_next == 0:  # Euler for the last step: there is no derivative at σ = 0
            x = x + d * step
        else:
            x_next = x + d * step
            d_next = derivative(x_next, sigma_next, denoise(x_next, sigma_next))
            x = x + (d + d_next) / 2 * step
    return x


def _dpm_2_step(denoise: Denoiser, x: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor,
                denoised: torch.Tensor) -> torch.Tensor:
    """From σ to `target` with the derivative taken at their geometric mean."""
    d = derivative(x, sigma, denoised)
    if target == 0:
        return x + d * (target - sigma)
    sigma_mid = sigma.log().lerp(target.log(), 0.5).exp()
    x_mid = x + d * (sigma_mid - sigma)
    return x + derivative(x_mid, sigma_mid, denoise(x_mid, sigma_mid)) * (target - sigma)


def sample_dpm_2(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise | None) -> torch.Tensor:
    for sigma, sigma_next in itertools.pairwise(sigmas):
        x = _dpm_2_step(denoise, x, sigma, sigma_next, denoise(x, sigma))
    return x


def sample_dpm_2_ancestral(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    return _ancestral(denoise, x, sigmas, noise, _dpm_2_step)


def _lms_coefficient(order: int, sigmas: list[float], i: int, j: int) -> float:
    """∫ from σ_i to σ_(i+1) of the Lagrange basis polynomial of the j-th previous point."""
    from scipy import integrate

    def basis(tau: float) -> float:
        product = 1.0
        for k in range(order):
            if k != j:
                product *= (tau - sigmas[i - k]) / (sigmas[i - j] - sigmas[i - k])
        return product

    return integrate.quad(basis, sigmas[i], sigmas[i + 1], epsrel=1e-4)[0]


def sample_lms(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise | None,
               order: int = 4) -> torch.Tensor:
    plain = sigmas.double().tolist()
    history: list[torch.Tensor] = []
    for i, sigma in enumerate(sigmas[:-1]):
        denoised = denoise(x, sigma)
        history = [*history, derivative(x, sigma, denoised)][-order:]
        if sigmas[i + 1] == 0:  # the last step lands on the model's estimate (as ComfyUI does)
            x = denoised
            continue
        current = min(i + 1, order)
        coefficients = [_lms_coefficient(current, plain, i, j) for j in range(current)]
        x = x + sum(c * d for c, d in zip(coefficients, reversed(history), strict=True))
    return x


def _dpmpp_2s_step(denoise: Denoiser, x: torch.Tensor, sigma: torch.Tensor, target: torch.Tensor,
                   denoised: torch.Tensor) -> torch.Tensor:
    """DPM-Solver++(2S): from σ to `target` with a second model call halfway in λ (Euler to 0)."""
    if target == 0:
        return x + derivative(x, sigma, denoised) * (target - sigma)
    t, t_next = _lambda(sigma), _lambda(target)
    h = t_next - t
    s = t + h / 2
    x_mid = (_sigma(s) / _sigma(t)) * x - (-h / 2).expm1() * denoised
    return (_sigma(t_next) / _sigma(t)) * x - (-h).expm1() * denoise(x_mid, _sigma(s))


def sample_dpmpp_2s_ancestral(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    return _ancestral(denoise, x, sigmas, noise, _dpmpp_2s_step)


def sample_dpmpp_sde(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise,
                     eta: float = 1.0, r: float = 0.5) -> torch.Tensor:
    """DPM-Solver++(2S) with SDE noise in both stages (the midpoint at `r` of the step in λ)."""
    for sigma, sigma_next in itertools.pairwise(sigmas):
        denoised = denoise(x, sigma)
        if sigma_next == 0:
            x = x + derivative(x, sigma, denoised) * (sigma_next - sigma)
            continue
        t, t_next = _lambda(sigma), _lambda(sigma_next)
        h = t_next - t
        s = t + h * r
        down, up = ancestral_step(_sigma(t), _sigma(s), eta)
        s_ = _lambda(down)
        x_mid = (_sigma(s_) / _sigma(t)) * x - (t - s_).expm1() * denoised
        x_mid = x_mid + noise(_sigma(t), _sigma(s)) * up
        denoised_mid = denoise(x_mid, _sigma(s))
        down, up = ancestral_step(_sigma(t), _sigma(t_next), eta)
        t_next_ = _lambda(down)
        blended = (1 - 1 / (2 * r)) * denoised + 1 / (2 * r) * denoised_mid
        x = (_sigma(t_next_) / _sigma(t)) * x - (t - t_next_).expm1() * blended
        x = x + noise(_sigma(t), _sigma(t_next)) * up
    return x


def sample_dpmpp_2m(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise | None) -> torch.Tensor:
    previous = None
    for i, (sigma, sigma_next) in enumerate(itertools.pairwise(sigmas)):
        denoised = denoise(x, sigma)
        t, t_next = _lambda(sigma), _lambda(sigma_next)
        h = t_next - t
        if previous is None or sigma_next == 0:
            estimate = denoised
        else:
            r = (t - _lambda(sigmas[i - 1])) / h
            estimate = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * previous
        x = (_sigma(t_next) / _sigma(t)) * x - (-h).expm1() * estimate
        previous = denoised
    return x


def sample_dpmpp_2m_sde(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise,
                        eta: float = 1.0, solver: str = "midpoint") -> torch.Tensor:
    previous, h_last = None, None
    for sigma, sigma_next in itertools.pairwise(sigmas):
        denoised = denoise(x, sigma)
        h = None
        if sigma_next == 0:
            x = denoised
        else:
            h = _lambda(sigma_next) - _lambda(sigma)
            eta_h = eta * h
            x = sigma_next / sigma * (-eta_h).exp() * x + (-h - eta_h).expm1().neg() * denoised
            if previous is not None:
                change = (denoised - previous) * (h / h_last)
                if solver == "heun":
                    x = x + ((-h - eta_h).expm1().neg() / (-h - eta_h) + 1) * change
                else:
                    x = x + 0.5 * (-h - eta_h).expm1().neg() * change
            if eta:
                x = x + noise(sigma, sigma_next) * sigma_next * (-2 * eta_h).expm1().neg().sqrt()
        previous, h_last = denoised, h
    return x


def sample_dpmpp_2m_sde_heun(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise) -> torch.Tensor:
    return sample_dpmpp_2m_sde(denoise, x, sigmas, noise, solver="heun")


def sample_dpmpp_3m_sde(denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, noise: Noise,
                        eta: float = 1.0) -> torch.Tensor:
    denoised_1 = denoised_2 = h_1 = h_2 = None
    for sigma, sigma_next in itertools.pairwise(sigmas):
        denoised = denoise(x, sigma)
        h = None
        if sigma_next == 0:
            x = denoised
        else:
            h = _lambda(sigma_next) - _lambda(sigma)
            h_eta = h * (eta + 1)
            x = torch.exp(-h_eta) * x + (-h_eta).expm1().neg() * denoised
            phi_2 = h_eta.neg().expm1() / h_eta + 1
            if h_2 is not None:
                r0, r1 = h_1 / h, h_2 / h
                d1_0 = (denoised - denoised_1) / r0
                d1_1 = (denoised_1 - denoised_2) / r1
                d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
                d2 = (d1_0 - d1_1) / (r0 + r1)
                x = x + phi_2 * d1 - (phi_2 / h_eta - 0.5) * d2
            elif h_1 is not None:
                x = x + phi_2 * (denoised - denoised_1) / (h_1 / h)
            if eta:
                x = x + noise(sigma, sigma_next) * sigma_next * (-2 * h * eta).expm1().neg().sqrt()
        denoised_1, denoised_2 = denoised, denoised_1
        h_1, h_2 = h, h_1
    return x


SAMPLERS: dict[str, Callable[..., torch.Tensor]] = {
    "euler": sample_euler,
    "euler_ancestral": sample_euler_ancestral,
    "heun": sample_heun,
    "dpm_2": sample_dpm_2,
    "dpm_2_ancestral": sample_dpm_2_ancestral,
    "lms": sample_lms,
    "dpmpp_2s_ancestral": sample_dpmpp_2s_ancestral,
    "dpmpp_sde": sample_dpmpp_sde,
    "dpmpp_2m": sample_dpmpp_2m,
    "dpmpp_2m_sde": sample_dpmpp_2m_sde,
    "dpmpp_2m_sde_heun": sample_dpmpp_2m_sde_heun,
    "dpmpp_3m_sde": sample_dpmpp_3m_sde,
}


def sample(name: str, denoise: Denoiser, x: torch.Tensor, sigmas: torch.Tensor, seeds: list[int]) -> torch.Tensor:
    """Run sampler `name` from x (noise at sigmas[0]) with the noise its kind needs: each row of x
    from its own seed, so that a row's noise does not depend on the rows beside it."""
    if name in SDE_SAMPLERS:
        rows = [brownian_noise(x[index:index + 1], sigmas, seed) for index, seed in enumerate(seeds)]
    elif name in ANCESTRAL_SAMPLERS:
        rows = [cpu_noise(x[index:index + 1].shape, seed) for index, seed in enumerate(seeds)]
    else:
        return SAMPLERS[name](denoise, x, sigmas, None)

    def noise(sigma: torch.Tensor, sigma_next: torch.Tensor) -> torch.Tensor:
        return torch.cat([row(sigma, sigma_next) for row in rows]).to(x.device, x.dtype)

    return SAMPLERS[name](denoise, x, sigmas, noise)
