"""What the bench scripts share: the checkout (whose msrewrite is the one measured), transformers'
models folder, the decoder layers the traced figures build, and a timer.

The scripts run as `python bench/NAME.py`, which puts bench/ on sys.path, so `import _common`
works; tests load them with tests/helpers.load_bench, which does the same.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"  # git-ignored; one JSON file per run

# The msrewrite of this checkout, even where the interpreter has another one installed.
sys.path.insert(0, str(ROOT))

# Decoder layers of transformers with a shared expert: (file under models/, class).
TRACED_LAYERS = [
    ("deepseek_v3/modeling_deepseek_v3.py", "DeepseekV3DecoderLayer"),
    ("qwen3_next/modeling_qwen3_next.py", "Qwen3NextDecoderLayer"),
    ("longcat_flash/modeling_longcat_flash.py", "LongcatFlashDecoderLayer"),
    ("hunyuan_v1_moe/modeling_hunyuan_v1_moe.py", "HunYuanMoEV1DecoderLayer"),
]


def models_dir() -> Path:
    """The installed transformers' `models/` folder (imports transformers.models)."""
    import transformers.models as hf_models

    return Path(hf_models.__file__).parent


def best_of(fn: Callable[[], object], repeat: int) -> float:
    """The shortest of `repeat` timed calls of `fn`, in seconds."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
