"""Adversarial model: a torch.library.custom_op that declares it writes nothing

`mix(x, w)` is registered with mutates_args=(): it reads the side input x and returns a new
tensor, so the shared expert may run beside it (before the declaration was read, the decorator
made it a callee that may write x, and the edit needed a copy of x or was refused).

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "clean"


@torch.library.custom_op("msr_adv_decl_p::mix", mutates_args=())
def mix(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = mix(x, self.w)
        h = self.gate(h)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
