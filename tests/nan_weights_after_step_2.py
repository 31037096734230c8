"""Launch target for the non-finite-weights tests: `... tests/nan_weights_after_step_2.py train_sdxl.py ARGS`.

After the second AdamW step it writes NaN into one trained weight of the process of rank 1 only,
as an optimizer step that overflowed there would; the gradients stay finite and the main process's
own weights too, so only a check in which every process takes part can catch it. Then it runs the
script named first, as `accelerate launch` would.
"""

import os
import runpy
import sys

import torch

original_step = torch.optim.AdamW.step


def step_then_poison(self, *args, **kwargs):
    result = original_step(self, *args, **kwargs)
    param = self.param_groups[0]["params"][0]
    if self.state[param]["step"] == 2 and os.environ.get("RANK") == "1":
        with torch.no_grad():
            param.view(-1)[0] = float("nan")
    return result


if __name__ == "__main__":
    torch.optim.AdamW.step = step_then_poison
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
