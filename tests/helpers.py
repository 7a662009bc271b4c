"""What tests share besides fixtures: paths, the CLI in a subprocess, file imports, a git work tree.

Tests import these with `from helpers import ...` (pytest puts tests/ on sys.path, since tests/
is not a package); fixtures stay in conftest.py.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
BENCH = ROOT / "bench"


def load_file(path, name: str) -> ModuleType:
    """Import a model file under a name of our choosing (a fresh module each time)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_bench(name: str) -> ModuleType:
    """bench/<name>.py as the module bench_<name>. It is registered in sys.modules before it runs
    (its dataclasses and its worker processes look it up by name), and bench/ goes on sys.path
    for the scripts' `from _common import ...`, as when one runs as `python bench/<name>.py`."""
    if str(BENCH) not in sys.path:
        sys.path.append(str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def load_regen() -> ModuleType:
    """golden/regen.py as a module (golden_examples(), the regeneration functions)."""
    return load_file(ROOT / "golden" / "regen.py", "golden_regen")


def free_port() -> int:
    """A free TCP port on loopback, for a gloo process group of this test's own processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_cli(*args: str, cwd: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the real console entry point in a subprocess, as a user would."""
    return subprocess.run(
        [sys.executable, "-m", "msrewrite", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=300,
    )


class GitRepo(type(Path())):  # type: ignore[misc]  # Path's concrete class is chosen at run time
    """A Path to a work tree, with .git(*args) running git inside it."""

    def git(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=self, capture_output=True, text=True, check=True)
