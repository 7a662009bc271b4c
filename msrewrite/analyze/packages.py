"""Source files of installed packages, found without importing anything.

`from sglang.srt.layers.moe import FusedMoE` names a module by its dotted path. Importing it to
find its file would run the package (and its parents' `__init__`), which msrewrite never does.
Instead the path is walked the way the path-based finder searches it, one component at a
time, in the folders the previous component gave (a package's own folder, or every portion of
a namespace package). Only the file system is looked at: no finder, no parent `__init__` runs.

The roots are the `--source-path` folders (unpacked wheels, a checkout) followed by `sys.path`.
torch, NumPy and the like are never read: torch's effects come from analyze/torch_effects.py,
and a compiled package has no source to read.

Parsed files are kept per process, keyed by path, size and modification time.
"""

from __future__ import annotations

import sys
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import libcst as cst


# Packages whose Python source says nothing useful about what their ops do to tensors.
NOT_READ = frozenset({"torch", "torch_npu", "torchair", "numpy", "triton", "jax", "tensorflow"})
MAX_FILE_BYTES = 300_000  # a larger file (generated tables, kernel zoos) is not read

_source_roots: tuple[Path, ...] = ()
_parsed: dict[tuple[Path, int, int], "cst.Module | None"] = {}
_found: dict[tuple[tuple[str, ...], str], Path | None] = {}
_roots_for: dict[tuple, tuple[str, ...]] = {}


def set_source_path(roots: list[Path] | tuple[Path, ...]) -> None:
    """Extra folders to read packages from, searched before `sys.path` (`--source-path DIR`).
    A folder that does not exist is bad input (exit 2), before anything is read."""
    global _source_roots
    for root in roots:
        if not Path(root).is_dir():
            from msrewrite.errors import BadInput

            raise BadInput(f"--source-path {root}: not a folder")
    _source_roots = tuple(Path(r).resolve() for r in roots)


def source_path() -> tuple[Path, ...]:
    return _source_roots


def _roots() -> tuple[str, ...]:
    """`--source-path` folders, then `sys.path` without the standard library (its functions never
    receive a model's tensors in a way worth reading; they stay unknown)."""
    key = (_source_roots, tuple(sys.path))
    if key not in _roots_for:
        stdlib = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
        _roots_for[key] = tuple(str(r) for r in _source_roots) + tuple(
            p for p in sys.path if p and p not in stdlib and Path(p).is_dir()
        )
    return _roots_for[key]


def module_file(dotted: str) -> Path | None:
    """The source file of module `dotted` (`pkg/sub.py` or `pkg/sub/__init__.py`), or None."""
    if not dotted or dotted.split(".")[0] in NOT_READ:
        return None
    roots = _roots()
    key = (roots, dotted)
    if key not in _found:
        _found[key] = _walk(dotted, roots)
    return _found[key]


def _walk(dotted: str, roots: tuple[str, ...]) -> Path | None:
    """Each component is looked up in the folders the previous one gave, as the path-based
    finder does: `part/__init__.py` (a package), `part.py` (a module), or a plain `part/`
    folder (a portion of a namespace package; all portions are searched)."""
    locations = list(roots)
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        portions: list[str] = []
        for folder in locations:
            base = Path(folder) / part
            if (base / "__init__.py").is_file():
                if last:
                    return base / "__init__.py"
                portions = [str(base)]
                break
            if base.with_suffix(".py").is_file():
                return base.with_suffix(".py") if last else None  # a plain module has no submodules
            if base.is_dir():
                portions.append(str(base))
        if not portions or last:
            return None  # not found, or a namespace package: no source of its own
        locations = portions
    return None


def parse_file(path: Path) -> "cst.Module | None":
    """The parsed source of `path` (cached per process by path, size and mtime), or None when it
    cannot be read, is too large, or does not parse."""
    try:
        stat = path.stat()
    except OSError:
        return None
    key = (path, stat.st_size, stat.st_mtime_ns)
    if key not in _parsed:
        module = None
        if stat.st_size <= MAX_FILE_BYTES:
            import libcst as cst

            try:
                module = cst.parse_module(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, cst.ParserSyntaxError, RecursionError):
                module = None
        _parsed[key] = module
    return _parsed[key]
