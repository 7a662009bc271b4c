"""Adversarial model: `h *= self.scale` on the main path reads the attribute the side work also
reads; it writes h, never the scale, so the side stream may run beside it

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

from types import SimpleNamespace

import torch
from torch import nn

EXPECT = "clean"


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.experts = nn.Linear(16, 16)
        self.scale = config.routed_scaling_factor  # as SGLang's deepseek_v2

    def forward(self, x):
        s = self.shared_experts(x) * self.scale  # side
        h = self.experts(x)
        h *= self.scale
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(SimpleNamespace(routed_scaling_factor=torch.full((16,), 0.5))), (torch.randn(2, 8, 16),)
