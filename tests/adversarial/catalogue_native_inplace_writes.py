"""Adversarial model: a native op the catalogue says writes its first argument

`torch.ops.npu.npu_scatter_nd_update_(x, rows, updates)` has no Python body and no registration
msrewrite can read (torch_npu registers it in C++): msrewrite's catalogue
(msrewrite/analyze/native_ops.toml) gives its schema, `Tensor(a!) input`, so the call writes x,
which the side stream reads. torch_npu is not installed here: a CPU stand-in with torch_npu's
schema is defined below (its schema is a variable, which msrewrite does not read as a registration).

Markers for tests/test_adversarial.py: `# side` statements move to the side stream, `# join` is the
first statement that reads their output, `# leak` the main statement whose effect must be named.
EXPECT is "clean" or a regex one of verify's problems must match.
"""

import torch
from torch import nn

EXPECT = "race-(war|raw|waw)|late schedule|interleaved schedule"

STAND_IN = "npu_scatter_nd_update_(Tensor(a!) input, Tensor indices, Tensor updates) -> Tensor(a!)"


def _scatter_rows(input, indices, updates):
    return input.index_copy_(0, indices[:, 0], updates)


if not hasattr(torch.ops.npu, "npu_scatter_nd_update_"):
    _LIB = torch.library.Library("npu", "FRAGMENT")
    _LIB.define(STAND_IN)
    _LIB.impl("npu_scatter_nd_update_", _scatter_rows, "CompositeExplicitAutograd")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.register_buffer("rows", torch.tensor([[1]]))

    def forward(self, x):
        s = self.shared_experts(x)  # side
        h = self.gate(x)
        torch.ops.npu.npu_scatter_nd_update_(x, self.rows, h[:1])  # leak
        return h + x + s  # join


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
