"""An attention node of an attention-FFN-disaggregated (AFD) model, LongCat-Flash style: the
routed FFN runs on a remote rank; this layer sends it the normed activations and adds back the
result, while the local shortcut MLP runs on its own.

`serve_ffn` is the remote side: it receives activations, applies the FFN and sends them back.
"""

import datetime
import socket
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class AttentionNodeLayer(nn.Module):
    def __init__(self, hidden_size=64, ffn_rank=1):
        super().__init__()
        self.ffn_rank = ffn_rank
        self.input_norm = nn.LayerNorm(hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.post_norm = nn.LayerNorm(hidden_size)
        self.shortcut_mlp = nn.Sequential(nn.Linear(hidden_size, 128), nn.SiLU(), nn.Linear(128, hidden_size))

    def attention(self, hidden_states):
        q, k, v = self.qkv(hidden_states).chunk(3, dim=-1)
        return self.o_proj(F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True)[0])

    def forward(self, hidden_states):
        hidden_states = hidden_states + self.attention(self.input_norm(hidden_states))
        normed = self.post_norm(hidden_states)
        dist.send(normed, dst=self.ffn_rank)
        shortcut = self.shortcut_mlp(normed)
        ffn_out = torch.empty_like(normed)
        dist.recv(ffn_out, src=self.ffn_rank)
        return hidden_states + ffn_out + shortcut


def serve_ffn(attention_rank=0, hidden_size=64, tokens=8, steps=1):
    """The remote FFN node: receive, compute, send back, `steps` times (None: until the
    attention node goes away)."""
    torch.manual_seed(1)
    ffn = nn.Sequential(nn.Linear(hidden_size, 256), nn.GELU(), nn.Linear(256, hidden_size)).eval()
    step = 0
    while steps is None or step < steps:
        activations = torch.empty(tokens, hidden_size)
        dist.recv(activations, src=attention_rank)
        with torch.no_grad():
            dist.send(ffn(activations), dst=attention_rank)
        step += 1


def make():
    """The layer and its input. Run alone (by `msrewrite verify` or `suggest`), it first starts a
    two-process gloo group on loopback whose rank 1, a child process, serves the FFN."""
    if not dist.is_initialized():
        _start_ffn_node()
    torch.manual_seed(0)
    return AttentionNodeLayer().eval(), (torch.randn(8, 64),)


def _start_ffn_node():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    subprocess.Popen([sys.executable, __file__, "--serve-ffn", str(port)])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                            timeout=datetime.timedelta(seconds=60))


if __name__ == "__main__" and sys.argv[1:2] == ["--serve-ffn"]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[2]}", rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    try:
        serve_ffn(steps=None)
    except RuntimeError:  # the attention node exited: the connection is gone
        pass
