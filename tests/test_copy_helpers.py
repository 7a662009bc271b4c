"""kvcache-offload through a cache object's methods: the copy sits in `cache.offload(i)`, the
buffer reuse in another method the layer calls later. Both are seen through the file's summaries."""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from helpers import EXAMPLES, load_regen
from msrewrite.cases import get_case
from msrewrite.cases._base import Options
from msrewrite.cases._finder import find_targets
from msrewrite.verify import verify_files

regen = load_regen()

CACHE = """
import torch
from torch import nn


class KVCache:
    def __init__(self):
        self.temp_kv = torch.zeros(4, 8)
        self.host_kv = [torch.zeros(4, 8) for _ in range(2)]
        self.scratch = torch.zeros(4, 8)

    def write(self, kv):
        self.temp_kv.copy_(kv)

    def offload(self, i):
        dst = self.host_kv[i]
        dst.copy_(self.temp_kv, non_blocking=True)
{extra}

class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv = nn.Linear(8, 8)
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)
        self.cache = KVCache()

    def forward(self, x, cache{annotation}):
{body}
"""


def targets(body: str, extra: str = "", annotation: str = ": KVCache"):
    source = CACHE.format(
        extra=textwrap.indent(textwrap.dedent(extra), " " * 4),
        annotation=annotation,
        body=textwrap.indent(textwrap.dedent(body).strip("\n"), " " * 8),
    )
    found = find_targets(get_case("kvcache-offload"), Path("layer.py"), cst.parse_module(source), Options())
    return {t.function: t for t in found}, source.splitlines()


def line_of(lines: list[str], text: str) -> int:
    return next(i for i, line in enumerate(lines, start=1) if text in line)


FORWARD = """
    cache.write(self.kv(x))
    cache.offload(0)
    y = self.attn(x)
    cache.write(self.kv(y))
    return self.mlp(y)
"""


def test_a_copy_in_a_cache_method_moves_and_joins_where_another_method_reuses_the_buffer():
    found, lines = targets(FORWARD)
    assert list(found) == ["Layer.forward"]  # the helper itself is not a target
    plan = found["Layer.forward"].plan
    assert [s.source for s in plan.side] == ["cache.offload(0)"]
    assert plan.fork_line == line_of(lines, "cache.offload(0)")  # right after write() filled the buffer
    assert plan.join_line == line_of(lines, "cache.write(self.kv(y))")  # write() reuses what it reads


def test_the_cache_held_by_the_layer_is_followed_through_init():
    found, lines = targets(FORWARD.replace("cache.", "self.cache."), annotation="")
    plan = found["Layer.forward"].plan
    assert [s.source for s in plan.side] == ["self.cache.offload(0)"]
    assert plan.join_line == line_of(lines, "self.cache.write(self.kv(y))")


def test_what_else_the_helper_writes_moves_the_join_earlier():
    """offload() also clears the scratch buffer, which the layer reads before reusing temp_kv."""
    extra = """
    def offload_and_clear(self, i):
        self.offload(i)
        self.scratch.zero_()
    """
    body = FORWARD.replace("cache.offload(0)", "cache.offload_and_clear(0)").replace(
        "y = self.attn(x)", "y = self.attn(x)\n    z = self.mlp(x)\n    y = y + cache.scratch"
    )
    found, lines = targets(body, extra)
    plan = found["Layer.forward"].plan
    assert plan.join_line == line_of(lines, "y = y + cache.scratch")


def test_a_cache_of_unknown_class_is_refused_naming_the_call():
    found, _ = targets(FORWARD, annotation="")
    target = found["Layer.forward"]
    assert target.plan is None
    assert "cache.offload() may copy the KV buffers, but msrewrite cannot see into it" in target.reason


def test_a_helper_that_calls_something_unseen_is_refused_naming_it():
    extra = """
    def offload_all(self, i):
        self.offload(i)
        swap_out(self.temp_kv)
    """
    found, _ = targets(FORWARD.replace("cache.offload(0)", "cache.offload_all(0)"), extra)
    target = found["Layer.forward"]
    assert target.plan is None and "KVCache.offload_all calls swap_out" in target.reason, target.reason


def test_a_blocking_copy_in_the_helper_is_refused():
    found, _ = targets(
        FORWARD.replace("cache.offload(0)", "cache.offload_sync(0)"),
        """
    def offload_sync(self, i):
        self.host_kv[i].copy_(self.temp_kv)
    """,
    )
    target = found["Layer.forward"]
    assert target.plan is None and "without non_blocking=True" in target.reason, target.reason


def test_a_later_call_msrewrite_cannot_see_into_is_a_join_point():
    """The layer hands the cache to a callee it cannot see into: it may rewrite the buffer."""
    body = FORWARD.replace("y = self.attn(x)", "y = self.attn(x)\n    z = self.mlp(x)\n    refresh(cache)")
    found, lines = targets(body)
    assert found["Layer.forward"].plan.join_line == line_of(lines, "refresh(cache)")


def join_after_reuse(text: str) -> str:
    """Move the join block past the statement that reuses the buffer."""
    lines = text.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if "before its buffers are reused: join here" in line)
    block = lines[start : start + 5]
    reuse = next(i for i in range(start + 5, len(lines)) if "offload_cache.write(" in lines[i])
    return "".join(lines[:start] + lines[start + 5 : reuse + 1] + block + lines[reuse + 1 :])


@pytest.mark.slow  # runs the model through verify
def test_the_golden_edit_verifies_and_a_join_after_the_reuse_races(tmp_path):
    golden, _ = regen.golden_paths("kvcache-offload", "eager", "offload_cache_decoder")
    text = golden.read_text()
    assert "                offload_cache.offload(self.layer_idx)\n" in text  # the call moved, helper untouched
    assert text.count("dst.copy_(self.temp_kv, non_blocking=True)") == 1
    edited = tmp_path / "offload_cache_decoder.py"
    edited.write_text(text)
    result = verify_files(edited, original=EXAMPLES / "offload_cache_decoder.py", inputs=0, train=False)
    assert result.ok and not result.findings, result.problems
    mutated = join_after_reuse(text)
    assert mutated != text
    edited.write_text(mutated)
    result = verify_files(edited, original=EXAMPLES / "offload_cache_decoder.py", inputs=0, train=False)
    assert "race-raw" in {f.kind for f in result.findings} or "race-war" in {f.kind for f in result.findings}, (
        [str(f) for f in result.findings],
        result.problems,
    )


def test_a_later_cache_method_calling_something_unseen_is_a_join_point():
    """refresh() hands the whole cache to a function msrewrite cannot see: it may rewrite temp_kv."""
    extra = """
    def refresh(self):
        rebuild(self)
    """
    body = FORWARD.replace("y = self.attn(x)", "y = self.attn(x)\n    z = self.mlp(x)\n    cache.refresh()")
    found, lines = targets(body, extra)
    assert found["Layer.forward"].plan.join_line == line_of(lines, "cache.refresh()")


@pytest.mark.slow  # runs the model through verify
def test_a_cache_held_by_the_layer_copying_the_layers_own_tensors(tmp_path):
    """self.cache.offload(i, k, v): the copy reads the layer's k and v, and the layer rebinds k
    before the join, so the old k is kept alive for the copy stream. Without that guard, verify
    reports the lifetime race (the emitter's rule, not only the sanitizer's)."""
    from msrewrite.commands.apply import case_steps
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    fixture = Path(__file__).parent / "fixtures" / "offload_args_decoder.py"
    src = load(fixture)
    steps = case_steps(
        fixture, src.text, src.module, "kvcache-offload", "eager", None, FlagSpec(name="ENABLE_KV_OFFLOAD_STREAM"), None
    )
    text = steps[-1].new
    assert "                self.cache.offload(self.layer_idx, k, v)\n" in text
    assert "            _ms_record_stream(kv_copy_stream, k)\n" in text
    edited = tmp_path / "offload_args_decoder.py"
    edited.write_text(text)
    result = verify_files(edited, original=fixture, inputs=0, train=False)
    assert result.ok and not result.findings, result.problems
    edited.write_text(text.replace("            _ms_record_stream(kv_copy_stream, k)\n", ""))
    result = verify_files(edited, original=fixture, inputs=0, train=False)
    assert "lifetime" in {f.kind for f in result.findings}, result.problems
