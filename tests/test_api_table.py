"""docs/modes.md's API table names every torch_npu / torchair / framework call the emitter can write."""

from __future__ import annotations

import re
from pathlib import Path

from msrewrite.emit import frameworks

ROOT = Path(__file__).resolve().parent.parent
API_NAME = re.compile(r"\b(?:torch\.npu|torchair|torch_npu)\.[A-Za-z_][A-Za-z0-9_.]*[A-Za-z0-9_]")


def _table() -> str:
    text = (ROOT / "docs" / "modes.md").read_text()
    start = text.index("## The APIs it emits")
    end = text.find("\n## ", start + 1)
    return text[start:] if end == -1 else text[start:end]


def _rows() -> set[str]:
    """Every `code` span of the table's first column, and the names inside it."""
    names: set[str] = set()
    for line in _table().splitlines():
        if not line.startswith("| `"):
            continue
        first = line.split("|")[1]
        for span in re.findall(r"`([^`]+)`", first):
            names.add(span)
            names |= set(API_NAME.findall(span))
            names |= set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*)\(", span))
    return names


def _emitted_names() -> set[str]:
    found: set[str] = set()
    sources = sorted((ROOT / "msrewrite" / "emit").glob("*.py")) + sorted((ROOT / "golden").glob("*/*/*.py"))
    for path in sources:
        for name in API_NAME.findall(path.read_text(encoding="utf-8")):
            found.add(name)
    return found


def test_every_emitted_torch_npu_and_torchair_name_has_a_row():
    emitted = _emitted_names()
    assert "torchair.scope.npu_wait_tensor" in emitted and "torch.npu.set_stream_limit" in emitted
    rows = _rows()
    missing = sorted(name for name in emitted if name not in rows)
    assert not missing, f"emitted but not in docs/modes.md's API table: {missing}"


def test_every_framework_name_has_a_row():
    rows = _rows()
    for module, name in (frameworks.SGLANG_ENV, frameworks.SGLANG_CAPTURE, frameworks.VLLM_ASCEND_CONFIG):
        assert name in rows, name
        assert f"`{module}`" in _table(), module


def test_table_names_the_versions_read():
    table = _table()
    assert "2.10.0.post4" in table and "2.14.0" in table
