"""Adversarial model: a native op the catalogue says writes nothing and returns a new tensor

`torch.ops.npu.npu_interleave_rope(x, cos, sin)` has no Python body and no registration msrewrite
can read (torch_npu registers it in C++): msrewrite's catalogue (msrewrite/analyze/native_ops.toml)
gives its schema, `(Tensor x, Tensor cos, Tensor sin) -> Tensor`: it reads the side input x and
its cos/sin, writes none of them, so the shared expert may run beside it. torch_npu is not
installed here: a CPU stand-in with torch_npu's schema is defined below (its schema is a variable,
which msrewrite does not read as a registration).

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "clean"

STAND_IN = "npu_interleave_rope(Tensor x, Tensor cos, Tensor sin) -> Tensor"


def _rope(x, cos, sin):
    pairs = x.unflatten(-1, (-1, 2))
    rotated = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    return x * cos + rotated * sin


if not hasattr(torch.ops.npu, "npu_interleave_rope"):
    _LIB = torch.library.Library("npu", "FRAGMENT")
    _LIB.define(STAND_IN)
    _LIB.impl("npu_interleave_rope", _rope, "CompositeExplicitAutograd")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        angles = torch.linspace(0.0, 1.0, 16)
        self.register_buffer("cos", angles.cos())
        self.register_buffer("sin", angles.sin())

    def forward(self, x):
        s = self.shared_experts(x)  # side
        q = torch.ops.npu.npu_interleave_rope(x, self.cos, self.sin)
        h = self.gate(q)
        return h + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
