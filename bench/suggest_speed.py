"""Benchmark (not a test): how long `suggest` takes next to simply running the model.

For each transformers MoE model: the time to import the modeling file and run its tiny decoder
layer once (the baseline), the traced `suggest` (build + record + analysis + full-size estimate),
and the static `suggest` (parse + dataflow, no import). Targets: traced suggest within a small
multiple of the baseline; static suggest under 1 s per file.

    /work/venv/bin/python bench/suggest_speed.py
"""

from __future__ import annotations

import time
from pathlib import Path

import transformers.models as hf_models

from msrewrite.harness import build_harness
from msrewrite.suggest.pipeline import analyze
from msrewrite.suggest.profiles import profile

MODELS = Path(hf_models.__file__).parent
CASES = [
    ("deepseek_v3/modeling_deepseek_v3.py", "DeepseekV3DecoderLayer"),
    ("qwen3_next/modeling_qwen3_next.py", "Qwen3NextDecoderLayer"),
    ("longcat_flash/modeling_longcat_flash.py", "LongcatFlashDecoderLayer"),
    ("hunyuan_v1_moe/modeling_hunyuan_v1_moe.py", "HunYuanMoEV1DecoderLayer"),
]


def seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    device = profile("a3")
    print(f"{'model':<28}{'run once':>10}{'traced':>10}{'ratio':>8}{'static':>10}  static<1s")
    for file, target in CASES:
        path = MODELS / file
        baseline = seconds(lambda: build_harness(path, target=target).run())
        traced = seconds(lambda: analyze(path, device=device, target=target))
        static = min(seconds(lambda: analyze(path, device=device, static=True)) for _ in range(3))
        print(f"{target:<28}{baseline:>9.2f}s{traced:>9.2f}s{traced / baseline:>7.1f}x{static:>9.2f}s  {'yes' if static < 1 else 'NO'}")


if __name__ == "__main__":
    main()
