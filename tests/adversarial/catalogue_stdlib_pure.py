"""Adversarial model: standard-library functions the catalogue says write nothing

`hashlib.sha256(x.numpy())` reads the side input's bytes, `re.search(...)` and `shlex.quote(...)`
read host strings; none of them writes an argument (msrewrite/analyze/native_ops.toml lists them
per function), so the shared expert may run beside them.

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import hashlib
import re
import shlex

import torch
from torch import nn

EXPECT = "clean"


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.tag = "moe layer 0"

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        key = hashlib.sha256(x.numpy()).hexdigest()
        quoted = shlex.quote(self.tag)
        if re.search("layer", quoted) is not None and key:
            h = h * 2.0
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
