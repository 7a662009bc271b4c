"""A large generated DeepSeek-style model file, to hold every case's analysis to its bounds.

`large_model(blocks)` writes `blocks` attention variants (MLA projections, rotary helpers, cache
writes through index_copy_ / scatter_ / copy_ helpers that call each other a few levels deep), a
MoE block with a shared expert, an indexer, an offload cache object and one decoder layer that
offloads its KV: about 130 lines a block. What made the copy-helper scan grow without bound is in
every block: locals bound from themselves through their own attributes
(`q = q.view(q.shape[0], ...).to(q.dtype)`), in helpers followed from many call sites, nested.

Every case has at most one target it can edit in the file (the MoE block, the indexer's prolog,
the offload layer), so a run edits or refuses; it is never ambiguous.
"""

from __future__ import annotations

HEADER = '''"""Generated: a DeepSeek-style model, large, for the analysis bounds tests."""

import torch
import torch.nn.functional as F
from torch import nn


class OffloadCache:
    def __init__(self, num_layers, tokens, kv_dim):
        self.temp_kv = torch.zeros(tokens, kv_dim)
        self.host_kv = [torch.zeros(tokens, kv_dim) for _ in range(num_layers)]
        self.k_cache = [torch.zeros(tokens, kv_dim) for _ in range(num_layers)]
        self.scores = torch.zeros(tokens, tokens)

    def write(self, kv):
        self.temp_kv.copy_(kv)

    def offload(self, layer_idx):
        dst = self.host_kv[layer_idx]
        dst.copy_(self.temp_kv, non_blocking=True)

    def prefetch(self, layer_idx):
        src = self.host_kv[layer_idx]
        src = src.view(src.shape[0], -1).to(src.dtype)
        self.temp_kv.copy_(src, non_blocking=True)

    def stage(self, layer_idx, kv, positions):
        cache = self.k_cache[layer_idx]
        cache = cache.view(cache.shape[0], cache.shape[-1]).to(cache.dtype)
        cache.index_copy_(0, positions, kv.to(cache.dtype))

    def mark(self, index, src):
        scores = self.scores
        scores = scores.view(scores.shape[0], -1).to(scores.dtype)
        scores.scatter_(1, index, src.to(scores.dtype))


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x, cos, sin):
    x = x.to(cos.dtype).view(x.shape)
    return x * cos + rotate_half(x) * sin


class MLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
'''

BLOCK = """

class Attention{i}(nn.Module):
    def __init__(self, hidden_size, kv_dim, heads):
        super().__init__()
        self.heads = heads
        self.head_dim = kv_dim // heads
        self.q_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.kv_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(kv_dim, hidden_size, bias=False)
        self.k_cache = torch.zeros(16, kv_dim)
        self.positions = torch.arange(16)

    def _rope(self, x, positions):
        x = x.view(x.shape[0], x.shape[1], -1).to(x.dtype)
        freqs = positions.to(x.dtype)
        freqs = freqs.view(freqs.shape[0], 1, 1).to(x.device)
        cos, sin = freqs.cos(), freqs.sin()
        cos = cos.to(x.dtype).expand(x.shape)
        sin = sin.to(x.dtype).expand(x.shape)
        out = apply_rotary(x, cos, sin)
        out = out.view(out.shape).to(out.dtype)
        return out

    def _prolog(self, hidden, positions):
        tokens = hidden.shape[0]
        dtype = hidden.dtype
        device = hidden.device
        normed = hidden.view(tokens, -1).to(dtype)
        q = self.q_proj(normed)
        q = q.view(q.shape[0], self.heads, self.head_dim).to(q.dtype)
        q_nope, q_pe = q.split(self.head_dim // 2, dim=-1)
        q_nope = q_nope.view(q_nope.shape).to(q_nope.dtype)
        q_pe = self._rope(q_pe, positions)
        q_pe = q_pe.view(q_pe.shape).to(q_nope.dtype)
        kv = self._project_kv(normed, positions)
        k_nope, k_pe = kv.split(self.head_dim // 2, dim=-1)
        k_nope = k_nope.view(k_nope.shape).to(k_nope.dtype)
        k_pe = k_pe.view(k_pe.shape).to(k_nope.dtype)
        q_full = torch.cat((q_nope, q_pe), dim=-1)
        k_full = torch.cat((k_nope, k_pe), dim=-1)
        q_full = q_full.view(tokens, -1).to(dtype)
        k_full = k_full.view(tokens, -1).to(dtype)
        self._store(k_full, positions)
        v = k_full.view(k_full.shape).to(device)
        scale = q_full.shape[-1] ** -0.5
        scores = (q_full @ k_full.T) * scale
        scores = scores.view(scores.shape).to(torch.float32)
        causal = torch.ones(scores.shape, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf")).to(scores.dtype)
        probs = scores.softmax(dim=-1).to(dtype)
        out = probs @ v
        out = out.view(out.shape[0], -1).to(dtype)
        return out

    def _project_kv(self, hidden, positions):
        kv = self.kv_proj(hidden)
        kv = kv.view(kv.shape[0], self.heads, self.head_dim).to(kv.dtype)
        k_nope, k_pe = kv.split(self.head_dim // 2, dim=-1)
        k_pe = self._rope(k_pe, positions)
        k_pe = k_pe.view(k_pe.shape).to(k_nope.dtype)
        kv = torch.cat((k_nope, k_pe), dim=-1)
        return kv.view(kv.shape[0], self.heads, self.head_dim).to(hidden.dtype)

    def _store(self, kv, positions):
        cache = self.k_cache
        cache = cache.view(cache.shape[0], cache.shape[-1]).to(cache.dtype)
        kv = kv.view(kv.shape[0], cache.shape[-1]).to(cache.dtype)
        cache.index_copy_(0, positions, kv)

    def _refresh(self, hidden, positions):
        kv = self._project_kv(hidden, positions)
        kv = kv.view(kv.shape[0], -1).to(kv.dtype)
        self._store(kv, positions)
        kv = self._project_kv(hidden, positions)
        kv = kv.view(kv.shape[0], -1).to(kv.dtype)
        self._store(kv, positions)
        return kv

    def forward(self, hidden_states):
        positions = self.positions[: hidden_states.shape[0]]
        out = self._prolog(hidden_states, positions)
        kv = self._refresh(hidden_states, positions)
        out = out + kv.view(out.shape).to(out.dtype)
        return self.o_proj(out)


class Block{i}(nn.Module):
    def __init__(self, hidden_size, kv_dim, heads):
        super().__init__()
        self.input_norm = nn.LayerNorm(hidden_size)
        self.attn = Attention{i}(hidden_size, kv_dim, heads)
        self.post_norm = nn.LayerNorm(hidden_size)
        self.mlp = MLP(hidden_size, 2 * hidden_size)

    def _residual(self, hidden, out):
        hidden = hidden.view(hidden.shape).to(out.dtype)
        out = out.view(hidden.shape).to(hidden.dtype)
        return hidden + out

    def forward(self, hidden_states):
        normed = self.input_norm(hidden_states)
        normed = normed.view(normed.shape).to(hidden_states.dtype)
        hidden_states = self._residual(hidden_states, self.attn(normed))
        normed = self.post_norm(hidden_states)
        hidden_states = self._residual(hidden_states, self.mlp(normed))
        return hidden_states
"""

FOOTER = """

class TopKRouter(nn.Module):
    def __init__(self, hidden_size, num_experts, top_k):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.randn(num_experts, hidden_size) * 0.02)

    def forward(self, hidden_states):
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        scores = F.linear(hidden_states, self.weight).sigmoid()
        topk_weights, topk_indices = torch.topk(scores, self.top_k, dim=-1)
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        return topk_weights, topk_indices


class Experts(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts):
        super().__init__()
        self.experts = nn.ModuleList(MLP(hidden_size, intermediate_size) for _ in range(num_experts))

    def forward(self, hidden_states, topk_indices, topk_weights):
        out = torch.zeros_like(hidden_states)
        for expert_idx, expert in enumerate(self.experts):
            token_idx, slot = torch.where(topk_indices == expert_idx)
            if token_idx.numel() == 0:
                continue
            weighted = expert(hidden_states[token_idx]) * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, weighted)
        return out


class DeepseekMoE(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_experts=4, top_k=2):
        super().__init__()
        self.gate = TopKRouter(hidden_size, num_experts, top_k)
        self.experts = Experts(hidden_size, intermediate_size, num_experts)
        self.shared_experts = MLP(hidden_size, intermediate_size)

    def forward(self, hidden_states):
        residuals = hidden_states
        orig_shape = hidden_states.shape
        topk_weights, topk_indices = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, hidden_states.shape[-1])
        hidden_states = self.experts(hidden_states, topk_indices, topk_weights).view(*orig_shape)
        hidden_states = hidden_states + self.shared_experts(residuals)
        return hidden_states


class Indexer(nn.Module):
    def __init__(self, hidden_size, index_dim):
        super().__init__()
        self.wq_b = nn.Linear(hidden_size, index_dim, bias=False)
        self.wk = nn.Linear(hidden_size, index_dim, bias=False)
        self.k_norm = nn.LayerNorm(index_dim)
        self.weights_proj = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, hidden_states, qr):
        q = self.wq_b(qr)
        k = self.k_norm(self.wk(hidden_states))
        weights = self.weights_proj(hidden_states)
        return (q @ k.T) * weights


class OffloadLayer(nn.Module):
    def __init__(self, hidden_size, kv_dim, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_norm = nn.LayerNorm(hidden_size)
        self.kv_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.q_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.o_proj = nn.Linear(kv_dim, hidden_size, bias=False)
        self.post_norm = nn.LayerNorm(hidden_size)
        self.index_proj = nn.Linear(hidden_size, kv_dim, bias=False)
        self.mlp = MLP(hidden_size, 2 * hidden_size)

    def forward(self, hidden_states, offload_cache: OffloadCache):
        normed = self.input_norm(hidden_states)
        offload_cache.write(self.kv_proj(normed))
        offload_cache.offload(self.layer_idx)
        q = self.q_proj(normed)
        probs = (q @ offload_cache.temp_kv.T).softmax(dim=-1)
        hidden_states = hidden_states + self.o_proj(probs @ offload_cache.temp_kv)
        mlp_in = self.post_norm(hidden_states)
        offload_cache.write(self.index_proj(mlp_in))
        hidden_states = hidden_states + self.mlp(mlp_in)
        return hidden_states


class Model(nn.Module):
    def __init__(self, hidden_size=32, kv_dim=16, heads=2):
        super().__init__()
        self.kv_dim = kv_dim
        self.blocks = nn.ModuleList([{blocks}])
        self.kv_layer = OffloadLayer(hidden_size, kv_dim, 0)
        self.moe = DeepseekMoE(hidden_size, 2 * hidden_size)
        self.indexer = Indexer(hidden_size, kv_dim)

    def forward(self, hidden_states):
        cache = OffloadCache(1, hidden_states.shape[0], self.kv_dim)
        for block in self.blocks:
            hidden_states = block(hidden_states)
        hidden_states = self.kv_layer(hidden_states, cache)
        hidden_states = self.moe(hidden_states)
        return hidden_states, self.indexer(hidden_states, hidden_states), torch.stack(cache.host_kv)


def make():
    torch.manual_seed(0)
    return Model().eval(), (torch.randn(8, 32),)
"""


def large_model(blocks: int = 12) -> str:
    """The model's source: `blocks` attention variants, each its own classes."""
    made = ", ".join(f"Block{i}(hidden_size, kv_dim, heads)" for i in range(blocks))
    return HEADER + "".join(BLOCK.format(i=i) for i in range(blocks)) + FOOTER.replace("{blocks}", made)
