"""Adversarial model: one router of the nn.ModuleDict scales its input in place while the side stream reads it

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
import torch.nn.functional as F
from torch import nn

EXPECT = "late schedule|race"


class SoftmaxRouter(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        return torch.softmax(self.proj(x), dim=-1)


class SigmoidRouter(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        x.mul_(0.5)
        return torch.sigmoid(self.proj(x))


class Block(nn.Module):
    def __init__(self, kind="sigmoid"):
        super().__init__()
        self.kind = kind
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.routers = nn.ModuleDict({"softmax": SoftmaxRouter(16), "sigmoid": SigmoidRouter(16)})
        self.experts = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)  # side
        w = self.routers[self.kind](x)  # leak
        h = self.experts(x) * w
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
