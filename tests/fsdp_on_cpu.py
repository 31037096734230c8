"""Launch target for the FSDP tests: `accelerate launch ... tests/fsdp_on_cpu.py train_sdxl.py ARGS`.

accelerate turns FSDP on only for GPU processes. This makes it take the CPU processes of a
machine without GPUs for such (a gloo process group, tensors on the CPU) and then runs the script
named first, as `accelerate launch` would. Everything else is the real code: accelerate's FSDP2
preparation, torch's `fully_shard`, the gathers and the optimizer-state (re)sharding.
"""

import os
import runpy
import sys

import torch.distributed as dist
from accelerate.state import PartialState
from accelerate.utils import DistributedType


def gpu_like_cpu_backend(self, cpu: bool = False, sagemaker_dp: bool = False, backend: str | None = None):
    return "gloo", DistributedType.MULTI_GPU


if __name__ == "__main__":
    PartialState._prepare_backend = gpu_like_cpu_backend
    os.environ["ACCELERATE_TORCH_DEVICE"] = "cpu"
    dist.init_process_group("gloo")
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
