"""The unit layer (`-m "not slow"`) starts no process and runs no model through verify.

conftest.py wraps every test without the `slow` marker in helpers.unit_layer_guard; these tests
show that the guard refuses each way of starting a process or a verify run, that it is active in
an unmarked test and not in a `slow` one, and that it puts everything back.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess

import pytest

from helpers import EXAMPLES, UnitLayerViolation, run_forked, unit_layer_guard

REAL_FORK, REAL_FORK_EXEC = os.fork, subprocess._fork_exec  # type: ignore[attr-defined]  # at collection: unguarded


def _spawners():
    from msrewrite.verify import verify_files

    return {
        "subprocess": lambda: subprocess.run(["true"], check=True),
        "multiprocessing": lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
        "fork": os.fork,
        "system": lambda: os.system("true"),
        "posix_spawn": lambda: os.posix_spawn("/bin/true", ["true"], {}),
        "fork server": lambda: run_forked("cases"),
        "verify": lambda: verify_files(EXAMPLES / "deepseek_moe.py", mode="eager"),
    }


@pytest.mark.parametrize("way", list(_spawners()))
def test_the_guard_refuses_every_way_to_start_a_process_or_a_verify_run(way):
    found: list[str] = []
    # nested inside the guard conftest.py already put around this test: the inner one records
    with unit_layer_guard(found), pytest.raises(UnitLayerViolation, match="mark the test `slow`"):
        _spawners()[way]()
    assert len(found) == 1, found


def test_an_unmarked_test_runs_under_the_guard():
    """(Calling a refused function here would fail this test even inside pytest.raises: the
    conftest hook fails a unit test that tried, whether or not the code caught the exception.)"""
    assert os.fork is not REAL_FORK and subprocess._fork_exec is not REAL_FORK_EXEC  # type: ignore[attr-defined]


@pytest.mark.slow
def test_a_slow_test_runs_without_it():
    assert os.fork is REAL_FORK and subprocess._fork_exec is REAL_FORK_EXEC  # type: ignore[attr-defined]
    assert subprocess.run(["true"]).returncode == 0


def test_the_guard_puts_everything_back():
    import _posixsubprocess

    import msrewrite.verify

    before = (_posixsubprocess.fork_exec, os.fork, os.system, msrewrite.verify._build_reference)
    with unit_layer_guard([]):
        assert os.fork is not before[1]
    assert (_posixsubprocess.fork_exec, os.fork, os.system, msrewrite.verify._build_reference) == before
