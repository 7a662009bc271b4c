"""Adversarial model: a standard-library function that writes a tensor through the buffer protocol

`struct.pack_into(fmt, x.numpy(), 0, 2.0)` writes into x's memory (x.numpy() shares it): the
catalogue lists struct.pack_into as writing its `buffer` parameter, so the call writes x, which
the side stream reads. (A catalogue that listed the module `struct` as pure would miss it.)

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import struct

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        struct.pack_into("ff", x.numpy(), 0, 2.0, -2.0)  # leak
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
