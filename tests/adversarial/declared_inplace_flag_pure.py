"""Adversarial model: `fused(x, h, inplace=False)` writes nothing

The keyword convention is read from the callee's body: with `inplace=False` its `if inplace:`
branch (which hands x to an op declared to write it) cannot run; it calls `scaled`, declared
pure, so the shared expert may run beside it.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "clean"


@torch.library.custom_op("msr_adv_flag_p::scale_into", mutates_args=("out",))
def scale_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.mul_(0.5).add_(x)


@torch.library.custom_op("msr_adv_flag_p::scaled", mutates_args=())
def scaled(x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return x * 0.5 + h


def fused(x, h, inplace: bool = False):
    if inplace:
        scale_into(x, h)
        return x
    return scaled(x, h)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        h = fused(x, h, inplace=False)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
