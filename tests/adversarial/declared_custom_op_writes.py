"""Adversarial model: a torch.library.custom_op that declares it writes its first argument

`scale_into(x, h)` is registered with mutates_args=("out",): msrewrite reads the declaration (the
op's body would be a kernel it cannot see into) and finds the write of x, which the side stream
reads. The registration runs on CPU when the module is loaded.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


@torch.library.custom_op("msr_adv_decl_w::scale_into", mutates_args=("out",))
def scale_into(out: torch.Tensor, x: torch.Tensor) -> None:
    out.mul_(0.5).add_(x)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        scale_into(x, h)  # leak
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
