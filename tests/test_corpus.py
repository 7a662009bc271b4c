"""Corpus sweep on a fixed sample of transformers files: no crash, every edit compiles, applies
with `git apply` and is idempotent, untouched files round-trip byte for byte (bench/corpus.py)."""

from __future__ import annotations

import pytest

from helpers import load_bench

pytestmark = pytest.mark.slow  # the transformers corpus sample

SAMPLE = [
    "deepseek_v3/modeling_deepseek_v3.py",
    "qwen3_next/modeling_qwen3_next.py",
    "ernie4_5_moe/modeling_ernie4_5_moe.py",
    "hunyuan_v1_moe/modeling_hunyuan_v1_moe.py",
    "llama/modeling_llama.py",
    "bert/modeling_bert.py",
    "deepseek_v3/configuration_deepseek_v3.py",
    "auto/__init__.py",
]
MOE = SAMPLE[:4]


def test_corpus_sample_sweeps_clean():
    corpus = load_bench("corpus")
    files = [corpus.models_dir() / name for name in SAMPLE]
    missing = [f for f in files if not f.is_file()]
    if missing:
        pytest.skip(f"this transformers lacks {missing}")
    # Every mode on one MoE file, eager on the rest (the targets do not depend on the mode).
    results = corpus.sweep(files[:1], all_modes=True) + corpus.sweep(files[1:], all_modes=False)
    summary = corpus.summarize(results)
    problems = [f"{r.file}: {line}" for r in results for line in r.crashes + r.failures]
    assert summary["crashes"] == 0 and summary["failures"] == 0, "\n".join(problems)
    assert summary["roundtrip_identical"] == summary["roundtrip_checked"] == len(SAMPLE)
    by_file = {r.file: r for r in results}
    for name in MOE:  # each real MoE file gets the shared-expert edit (deepseek_v3 in every mode)
        edited = {c.what for c in by_file[name].checks if c.outcome == "edited"}
        modes = ("eager", "npugraph-ex", "ge-graph", "cuda") if name == MOE[0] else ("eager",)
        assert {f"moe-shared-expert/{m}" for m in modes} <= edited, (name, edited)
    for name in SAMPLE[4:]:
        assert not any(c.what.startswith("moe-shared-expert") and c.outcome == "edited" for c in by_file[name].checks)
    edits = [c for r in results for c in r.checks if c.outcome == "edited"]
    assert edits and all(c.compiles and c.git_apply for c in edits)
    assert all(c.idempotent for c in edits if c.what.startswith("moe-shared-expert"))
