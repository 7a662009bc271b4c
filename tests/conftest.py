from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def load_regen():
    spec = importlib.util.spec_from_file_location("golden_regen", ROOT / "golden" / "regen.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def free_port() -> int:
    """A free TCP port on loopback, for a gloo process group of this test's own processes."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def load_file(path, name):
    """Import a model file under a name of our choosing (a fresh module each time)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


class GitRepo(type(Path())):  # type: ignore[misc]
    """A Path to a work tree, with .git(*args) running git inside it."""

    def git(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=self, capture_output=True, text=True, check=True)


@pytest.fixture
def git_repo(tmp_path):
    """An empty git repository with an identity, for git apply / git am checks."""
    repo = GitRepo(tmp_path / "repo")
    repo.mkdir()
    repo.git("init", "-q")
    repo.git("config", "user.email", "test@example.com")
    repo.git("config", "user.name", "Test")
    repo.git("config", "commit.gpgsign", "false")
    return repo
