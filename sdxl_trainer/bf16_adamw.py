"""AdamW for bf16 weights with stochastic rounding (full fine-tunes with `weights_dtype: "bf16"`).

bf16 keeps 8 bits of mantissa: an update smaller than half the spacing between neighbouring bf16
values is lost entirely when rounded to nearest, so a fine-tune at a small learning rate simply
stops moving. Rounding stochastically — up with a probability equal to the distance to the
lower neighbour — keeps every update in expectation. The Adam moments stay in fp32.

The update is elementwise, so under FSDP each process updates its own slices (the local tensors
of the sharded parameters, gradients and moments) and nothing needs to be gathered.
"""

from __future__ import annotations

import torch

from .distributed import local_tensor


def stochastic_round_to_bf16(values: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Round fp32 values to bf16, up or down at random in proportion to the distance."""
    bits = values.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=bits.device, generator=generator)
    # bf16 is the upper 16 bits of fp32: add uniform noise below them, then cut them off.
    rounded = (bits + noise) & -65536
    return rounded.view(torch.float32).to(torch.bfloat16)


def keep_fp32_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> None:
    """Put back the fp32 state a resume loaded: torch's `load_state_dict` casts every floating state
    tensor to its parameter's dtype, which would turn the fp32 moments of bf16 weights into bf16
    (AdamW's step then fails; Adafactor's rounds its statistics, and the resume is no longer exact)."""
    saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for index, param in zip(saved_ids, params, strict=True):
        for key, value in state_dict["state"].get(index, {}).items():
            if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                optimizer.state[param][key] = value.to(device=param.device)


class StochasticRoundingAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) on bf16 parameters, computed in fp32."""

    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        keep_fp32_state(self, state_dict)

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(param, dtype=torch.float32)
                    state["exp_avg_sq"] = torch.zeros_like(param, dtype=torch.float32)
                state["step"] += 1
                weights, grad = local_tensor(param), local_tensor(param.grad).float()
                exp_avg, exp_avg_sq = local_tensor(state["exp_avg"]), local_tensor(state["exp_avg_sq"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1 = 1 - beta1 ** state["step"]
                bias2 = 1 - beta2 ** state["step"]
                denominator = (exp_avg_sq / bias2).sqrt_().add_(group["eps"])
                weight = weights.float()
                weight.mul_(1 - group["lr"] * group["weight_decay"])
                weight.addcdiv_(exp_avg, denominator, value=-group["lr"] / bias1)
                weights.copy_(stochastic_round_to_bf16(weight) if weights.dtype == torch.bfloat16 else weight)
        return loss
