"""Adversarial model: `fused(x, h, inplace=True)` writes x through the op its body calls

The keyword convention is read from the callee's body: with `inplace=True` it hands x to
`scale_into`, a custom op declared to write its first argument; the side stream reads x.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


@torch.library.custom_op("msr_adv_flag_w::scale_into", mutates_args=("out",))
def scale_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.mul_(0.5).add_(x)


@torch.library.custom_op("msr_adv_flag_w::scaled", mutates_args=())
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
        h = fused(x, h, inplace=True)  # leak
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
