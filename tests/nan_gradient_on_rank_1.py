"""Launch target for the fused-backward DDP test: `... tests/nan_gradient_on_rank_1.py train_sdxl.py ARGS`.

The second backward pass of the process of rank 1 starts from a NaN gradient of the loss: its
loss stays finite and so do the other process's gradients, so only the averaged gradient that
both processes see is non-finite. Then it runs the script named first, as `accelerate launch`
would.
"""

import os
import runpy
import sys

import torch

original_backward = torch.Tensor.backward
calls = []


def backward_nan_on_rank_1_at_step_2(self, gradient=None, *args, **kwargs):
    calls.append(None)
    if len(calls) == 2 and os.environ.get("RANK") == "1":
        gradient = torch.full_like(self, float("nan"))
    return original_backward(self, gradient, *args, **kwargs)


if __name__ == "__main__":
    torch.Tensor.backward = backward_nan_on_rank_1_at_step_2
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
