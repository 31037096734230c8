"""Which device type a run trains on, and whose autocast applies to a tensor: small rules that
the precision plan, the quantized base and the memory plan all follow."""

from __future__ import annotations


def run_device_type() -> str:
    """The device type the run will train on, by the rule `run.make_accelerator` follows."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "mps" if torch.backends.mps.is_available() else "cpu"


def autocast_device_type(device) -> str:
    """The device type whose autocast applies to tensors on `device`: its own, or the CPU's for the
    meta device, on which the memory plan traces a step inside a CPU autocast region."""
    import torch

    device_type = torch.device(device).type
    return "cpu" if device_type == "meta" else device_type
