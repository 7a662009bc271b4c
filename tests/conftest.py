"""Fixtures, and the rule that keeps the unit layer fast; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import os
import sys

import pytest

from helpers import ROOT, GitRepo, UnitLayerViolation, unit_layer_guard

# One OpenMP thread in every test process and every process it starts (they inherit the
# environment): the tests run tiny models, as `msrewrite verify`'s child does under its own
# torch.set_num_threads(1) (msrewrite/commands/verify.py), and with pytest-xdist's workers on a
# 2-core machine a pool per process oversubscribes the cores: OpenMP's workers spin at each
# parallel region while the other thread waits for a core, and an in-process verify_files run
# took 8-9 s instead of 0.4 s under load. Set before torch is imported (test modules import it; helpers.py does not).
os.environ["OMP_NUM_THREADS"] = "1"
if "torch" in sys.modules:  # a plugin imported it first: the variable is read at import
    sys.modules["torch"].set_num_threads(1)


def pytest_sessionstart(session):
    """Byte-compile msrewrite once, as pip does for an installed package (an editable install is
    not compiled). Many tests run the CLI in a fresh process, and where PYTHONDONTWRITEBYTECODE is
    set (our machines set it) each of those would compile every module it imports again: about
    0.2 s a process, 16% of the CLI suites' time. Stale files only; nothing else is written."""
    if hasattr(session.config, "workerinput"):  # pytest-xdist's workers: the controller did it
        return
    import compileall

    compileall.compile_dir(ROOT / "msrewrite", quiet=2)


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


def _guarded(item):
    """Run a phase of a test without the `slow` marker under helpers.unit_layer_guard, in every
    run (so CI fails too when a unit test starts a process or runs verify), and fail the test if
    it tried, even where the code under test caught the exception."""
    if item.get_closest_marker("slow") is not None:
        outcome = yield
        return
    found: list[str] = []
    with unit_layer_guard(found):
        outcome = yield
    if found:
        excinfo = outcome.excinfo
        if excinfo is None or not isinstance(excinfo[1], UnitLayerViolation):
            outcome.force_exception(
                UnitLayerViolation(f"{found[0]} in a test of the unit layer: mark the test `slow` (docs/testing.md)")
            )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _guarded(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item):
    yield from _guarded(item)
