"""Golden files: expected output and diff of every case x mode on the bundled example models.

Inputs are the models in examples/; golden/<case>/<mode>/<example>.py is the expected rewritten
file and <example>.diff the expected diff. tests/test_golden.py compares them byte for byte.

Regenerate on purpose only, after reviewing the change in emitted code:

    python golden/regen.py            # rewrite every golden file
    python golden/regen.py --check    # exit 1 if any golden file is out of date
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from msrewrite.commands.apply import case_steps  # noqa: E402
from msrewrite.load import load  # noqa: E402
from msrewrite.output.diff import unified_diff  # noqa: E402
from msrewrite.plan import FlagSpec  # noqa: E402

# case -> example models (examples/<name>.py) its goldens cover
GOLDEN_EXAMPLES = {
    "moe-shared-expert": ["deepseek_moe", "qwen_gated_moe", "inplace_moe", "guarded_moe"],
    "moe-shared-mlp-init": ["hunyuan_moe", "hunyuan_moe_patch"],
    "moe-shared-expert-phased": ["deepep_moe", "qwen_gated_moe"],
    "indexer-prolog": ["indexer_prolog"],
    "kvcache-offload": ["offload_decoder", "offload_cache_decoder"],
    "attn-moe-limit-core": ["longcat_layer"],
    "afd-overlap": ["afd_attention_node"],
    "prefill-microbatch": ["microbatch_moe", "microbatch_moe_submodule"],
}


def golden_modes(case_name: str) -> tuple[str, ...]:
    from msrewrite.codemods import get_case

    return get_case(case_name).modes


def render(case_name: str, mode: str, example: str) -> tuple[str, str]:
    """(rewritten source, diff) exactly as `msrewrite apply --case CASE --mode MODE` produces them."""
    from msrewrite.codemods import get_case

    path = ROOT / "examples" / f"{example}.py"
    src = load(path)
    flag = FlagSpec(kind="env", name=get_case(case_name).flag_name)
    steps = case_steps(path, src.text, src.module, case_name, mode, None, flag, None)
    new = steps[-1].new
    return new, unified_diff(src.text, new, f"examples/{example}.py")


def golden_paths(case_name: str, mode: str, example: str) -> tuple[Path, Path]:
    folder = ROOT / "golden" / case_name / mode
    return folder / f"{example}.py", folder / f"{example}.diff"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    stale = []
    for case_name, examples in GOLDEN_EXAMPLES.items():
        for mode in golden_modes(case_name):
            for example in examples:
                new, diff = render(case_name, mode, example)
                for path, text in zip(golden_paths(case_name, mode, example), (new, diff)):
                    current = path.read_text(encoding="utf-8") if path.exists() else None
                    if current == text:
                        continue
                    stale.append(path)
                    if not check:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        path.write_text(text, encoding="utf-8")
    for path in stale:
        print(("out of date: " if check else "wrote ") + str(path.relative_to(ROOT)))
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
