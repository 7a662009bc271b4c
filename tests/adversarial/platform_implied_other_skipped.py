"""Adversarial model (clean): a write under a name that implies another platform

`_use_rocm_kernel = ROCM_KERNEL and _is_hip` (SGLang's `_use_aiter = get_bool_env_var(...) and
_is_hip`) is true only on ROCm, which an NPU (eager) edit never runs on: the in-place kernel
under it is no hazard there, and apply edits the block. (Here is_hip() is False, as on the CPU
verify runs on, and the branch never runs.)

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import os

import torch
from torch import nn

EXPECT = "clean"


def is_hip():
    return False


_is_hip = is_hip()
_use_rocm_kernel = os.environ.get("MSREWRITE_TEST_ROCM_KERNEL") == "1" and _is_hip


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        if _use_rocm_kernel:
            x.mul_(2)  # a fused in-place kernel, on one platform only
        return self.w(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.experts = Experts()

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.experts(x)
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
