"""Issue 10, item 6: a layer that already owns a side stream (`self.alt_stream`, made in
`__init__` or handed in by the model) but does not overlap its shared expert yet gets the edit
on that stream, in the file's API family, instead of a second stream next to it."""

from __future__ import annotations

from pathlib import Path

import pytest

from msrewrite.commands.apply import case_steps
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

MODEL = (Path(__file__).parent / "fixtures" / "alt_stream_moe.py").read_text()
MADE_IN_INIT = MODEL.replace(
    "self.alt_stream = alt_stream", "self.alt_stream = torch.cuda.Stream() if torch.cuda.is_available() else None"
)


def edit(tmp_path: Path, source: str, mode: str = "cuda") -> tuple[Path, Path, str]:
    original = tmp_path / "alt_stream_moe.py"
    original.write_text(source)
    src = load(original)
    steps = case_steps(
        original,
        src.text,
        src.module,
        "moe-shared-expert",
        mode,
        None,
        FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM"),
        None,
    )
    edited = tmp_path / "alt_stream_moe_ms.py"
    edited.write_text(steps[-1].new)
    return original, edited, steps[-1].new


@pytest.mark.slow  # runs the model through verify
@pytest.mark.parametrize("source, side_streams", [(MODEL, 1), (MADE_IN_INIT, 2)], ids=["handed-in", "made-in-init"])
def test_the_model_stream_is_reused_and_verifies(tmp_path, source, side_streams):
    original, edited, new = edit(tmp_path, source)
    assert "shared_expert_stream = self.alt_stream if self.enable_moe_shared_expert_stream else None" in new
    assert "with torch.cuda.stream(shared_expert_stream):" in new
    assert "_ms_side_stream" not in new  # no second stream
    result = verify_files(edited, original=original)
    assert result.ok, result.problems
    flag_on = next(r for r in result.runs if r.name == "flag on")
    # handed in: both layers on the model's one stream; made in __init__: each layer's own
    assert len([s for s in flag_on.streams if s != "main"]) == side_streams, flag_on.streams


@pytest.mark.parametrize(
    "change",
    [
        # reassigned outside __init__: not a fixed stream object
        (
            "    def forward(self, x):\n        shared =",
            "    def reset(self):\n        self.alt_stream = None\n\n    def forward(self, x):\n        shared =",
        ),
        # a stream of the other API family
        ("alt_stream=None):", "alt_stream: 'torch.npu.Stream' = None):"),
    ],
    ids=["reassigned", "other-family"],
)
def test_a_stream_that_is_not_the_models_own_fixed_one_is_not_reused(tmp_path, change):
    _, _, new = edit(tmp_path, MODEL.replace(*change))
    assert "self.alt_stream if" not in new
    assert '_ms_side_stream("shared_expert"' in new


def test_ge_graph_edits_keep_their_stream_tag(tmp_path):
    """GE graphs name streams by tag (npu_stream_switch); no stream object to reuse there."""
    _, _, new = edit(tmp_path, MODEL.replace("torch.cuda", "torch.npu"), mode="ge-graph")
    assert "self.alt_stream if" not in new
