"""Adversarial model: `not (<npu test> and X)` runs on NPU whenever X is false

`_is_npu and _FUSED` is true only on NPU, but false there too when _FUSED is off, so the write
under `if not (_is_npu and _FUSED):` runs on NPU: an NPU (eager) edit must still see it. (Here
is_npu() is False, as on the CPU verify runs on, and the write runs.)

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import os

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


def is_npu():
    return False


_is_npu = is_npu()
_FUSED = os.environ.get("MSREWRITE_TEST_FUSED") == "1"


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(16, 16)

    def forward(self, x):
        if not (_is_npu and _FUSED):
            x.mul_(2)  # a fused in-place kernel, on one platform only
        return self.w(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.experts = Experts()

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.experts(x)  # leak
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
