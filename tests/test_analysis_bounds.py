"""Every analysis has a bound (issue #29): alias-path sets stay small and sound, and each function's
analysis runs under a budget (analyze/budget.py) that turns into a one-line refusal naming it.

The hole: `kvcache-offload` on a DeepSeek-V3.2-style file grew its copy-helper scan without limit
(24 GB and counting): a local bound from itself through its own attributes
(`q = q.view(q.shape[0], ...).to(q.dtype)`) re-based its whole path set each round, doubling it.
tests/large_model.py generates such a file; the slow tests run every case on it, and on every model
the suite holds, in a process whose address space is capped.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import libcst as cst
import pytest

from helpers import EXAMPLES, ROOT, run_main
from large_model import large_model
from msrewrite.analyze import budget, effects
from msrewrite.analyze.effects import MAX_PATHS, _alias_closure, _minimal, _overlap, _widened
from msrewrite.cases import get_case
from msrewrite.cases._base import Options
from msrewrite.cases._finder import find_targets

ONE_GIB = 1 << 30


# Path sets ----------------------------------------------------------------------------------------
def test_a_local_bound_from_itself_stands_for_what_it_was_bound_from():
    # q = hidden.float(); q = q.view(q.shape[0], -1).to(q.dtype)
    aliases = {"q": {"hidden", "q", "q.shape", "q.dtype"}}
    assert _alias_closure(aliases, {"self", "hidden"})["q"] == {"hidden"}
    # bound from a bare self (which covers nothing), its attributes stay, once
    aliases = {"q": {"self", "q", "q.shape", "q.dtype"}}
    assert _alias_closure(aliases, {"self"})["q"] == {"self", "self.shape", "self.dtype"}


def test_a_long_chain_of_locals_through_their_attributes_stays_one_path():
    """h1 = h0.view(h0.shape).to(h0.dtype), h2 = h1..., 300 links: each link used to double the set."""
    aliases = {f"h{i}": {f"h{i - 1}", f"h{i - 1}.shape", f"h{i - 1}.dtype"} for i in range(1, 300)}
    aliases["h0"] = {"hidden.clone", "hidden"}
    with budget.function_budget("chain", steps=20_000):  # deterministic: a few steps a link
        mapping = _alias_closure(aliases, {"self", "hidden"})
    assert mapping["h299"] == {"hidden"}


def test_a_bare_self_covers_nothing_so_its_attributes_stay():
    assert _minimal({"self", "self.cache", "self.cache.host_kv", "x", "x.shape"}) == {"self", "self.cache", "x"}


def test_past_the_cap_a_set_widens_to_owners_that_still_overlap_every_path_it_held():
    held = {f"cache.host_kv.k{i}" for i in range(MAX_PATHS)} | {"self.cache.temp_kv.t", "self.w"}
    wide = _widened(held)
    assert wide == {"cache.host_kv", "self.cache", "self.w"}
    assert all(_overlap({path}, wide) for path in held)  # nothing it held is lost: sound
    assert _widened({"self.a", "self.b"}) == {"self.a", "self.b"}  # under the cap: as it is


# A copy helper past the cap ----------------------------------------------------------------------
OFFLOAD_MODEL = """
import torch
from torch import nn


class KVCache:
    def __init__(self):
        self.temp_kv = torch.zeros(4, 8)
        self.host_kv = [torch.zeros(4, 8) for _ in range(2)]
{fields}

    def write(self, kv):
        self.temp_kv.copy_(kv)

    def offload(self, i):
        dst = (self.host_kv[i], {names})[0]
        dst.copy_(self.temp_kv, non_blocking=True)

    def scale(self):
        buf = ({names}, self.temp_kv)[-1]
        buf.mul_(0.5)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.kv = nn.Linear(8, 8)
        self.attn = nn.Linear(8, 8)
        self.mlp = nn.Linear(8, 8)
        self.cache = KVCache()

    def forward(self, x):
        self.cache.write(self.kv(x))
        self.cache.offload(0)
        y = self.attn(x)
        z = self.mlp(y)
        self.cache.scale()
        return z + self.cache.temp_kv.sum()


def make():
    torch.manual_seed(0)
    return Layer().eval(), (torch.randn(4, 8),)
"""


def offload_model(aliases: int) -> str:
    """A layer offloading its KV through a cache method whose destination may be any of `aliases`
    buffers besides the host one; `cache.scale()` later writes temp_kv through such a local."""
    fields = "\n".join(f"        self.w{i} = torch.zeros(1)" for i in range(aliases))
    names = ", ".join(f"self.w{i}" for i in range(aliases))
    return OFFLOAD_MODEL.replace("{fields}", fields).replace("{names}", names)


def forward_target(source: str):
    found = find_targets(get_case("kvcache-offload"), Path("layer.py"), cst.parse_module(source), Options())
    return {t.function: t for t in found}["Layer.forward"], source.splitlines()


def test_a_copy_helper_whose_destination_may_alias_past_the_cap_is_refused():
    target, _ = forward_target(offload_model(MAX_PATHS + 1))
    assert target.plan is None
    assert "self.cache.offload() (KVCache.offload): a name in it may alias more than 256 buffers" in target.reason


def test_a_write_through_a_widened_alias_is_still_seen():
    """scale() writes temp_kv (which the copy reads) through a local that may alias past the cap:
    the write is seen, so the copy joins before it (here offload itself is under the cap)."""
    source = offload_model(MAX_PATHS + 1).replace(
        f"dst = (self.host_kv[i], {', '.join(f'self.w{i}' for i in range(MAX_PATHS + 1))})[0]", "dst = self.host_kv[i]"
    )
    target, lines = forward_target(source)
    assert target.plan is not None, target.reason
    assert target.plan.join_line == next(n for n, line in enumerate(lines, 1) if "self.cache.scale()" in line)


@pytest.mark.slow  # runs the model through verify
def test_the_same_helper_under_the_cap_is_edited_and_verifies(tmp_path):
    path = tmp_path / "layer.py"
    path.write_text(offload_model(8))
    done = run_main("apply", "--case", "kvcache-offload", "--verify", str(path))
    assert done.returncode == 0, done.stderr
    assert "self.cache.offload(0)" in done.stdout and "kv_copy_stream" in done.stdout


# The budget --------------------------------------------------------------------------------------
OFFLOAD_EXAMPLE = str(EXAMPLES / "offload_cache_decoder.py")


def one_line_refusal(done) -> str:
    assert done.returncode == 1 and not done.stdout and "Traceback" not in done.stderr, done
    (error,) = [line for line in done.stderr.splitlines() if line.startswith("msrewrite: error:")]
    return error


def test_a_function_past_its_step_budget_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(budget, "MAX_STEPS", 40)
    error = one_line_refusal(run_main("apply", "--case", "kvcache-offload", OFFLOAD_EXAMPLE))
    assert "DecoderLayer.forward: msrewrite stopped analysing DecoderLayer.forward after 40 steps" in error


def test_a_call_case_past_its_step_budget_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(budget, "MAX_STEPS", 40)
    error = one_line_refusal(run_main("apply", "--case", "moe-shared-expert", str(EXAMPLES / "deepseek_moe.py")))
    assert "msrewrite stopped analysing DeepseekMoE.forward after 40 steps" in error


def test_running_out_of_memory_in_the_analysis_is_a_refusal_naming_the_function(monkeypatch):
    def exhausted(_method):
        raise MemoryError

    monkeypatch.setattr(effects, "_local_aliases", exhausted)
    error = one_line_refusal(run_main("apply", "--case", "kvcache-offload", OFFLOAD_EXAMPLE))
    assert "msrewrite ran out of memory analysing DecoderLayer.forward" in error


def test_the_clock_is_a_backstop(monkeypatch):
    monkeypatch.setattr(budget, "MAX_SECONDS", 1e-9)
    error = one_line_refusal(run_main("apply", "--case", "kvcache-offload", OFFLOAD_EXAMPLE))
    assert "msrewrite stopped analysing DecoderLayer.forward after 1e-09 s" in error


def test_a_budget_inside_another_adds_nothing():
    with budget.function_budget("outer", steps=5):
        with budget.function_budget("inner", steps=10**9):
            budget.charge(3)
        with pytest.raises(budget.OverBudget, match="analysing outer after 5 steps"):
            budget.charge(3)
    budget.charge(10**9)  # outside any budget: free


# Whole runs under a cap --------------------------------------------------------------------------
# Runs `apply --case CASE FILE` for every case and file in one process whose address space is
# capped; prints each run's exit code, error line, CPU seconds and the most steps one function's
# analysis took, then the process's peak resident memory.
RUNNER = r"""
import contextlib, io, json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]), int(sys.argv[1])))
from msrewrite.analyze import budget
from msrewrite.cli import main

budgets = []
class Counted(budget._Budget):
    def __init__(self, *args):
        super().__init__(*args)
        budgets.append(self)
budget._Budget = Counted

cases = json.loads(sys.argv[2])
runs = []
for path in sys.argv[3:]:
    for case in cases:
        budgets.clear()
        out, err = io.StringIO(), io.StringIO()
        start = time.process_time()
        sys.argv = ["msrewrite", "apply", "--case", case, "--mode", "eager", path]
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                main()
                code = 0
            except SystemExit as exc:
                code = exc.code
        errors = [line for line in err.getvalue().splitlines() if line.startswith("msrewrite: error:")]
        runs.append({
            "case": case, "file": path, "exit": code, "error": errors[0] if errors else "",
            "traceback": "Traceback" in err.getvalue(), "diff": out.getvalue().startswith("---"),
            "seconds": time.process_time() - start,
            "steps": max((b.steps - b.left for b in budgets), default=0),
        })
print(json.dumps({"runs": runs, "peak": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

CASES = [
    "moe-shared-expert",
    "moe-shared-expert-phased",
    "moe-shared-mlp-init",
    "indexer-prolog",
    "kvcache-offload",
    "attn-moe-limit-core",
    "afd-overlap",
    "prefill-microbatch",
]


def capped_runs(files: list[Path], cap: int = ONE_GIB + ONE_GIB // 2) -> tuple[list[dict], int]:
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(cap), json.dumps(CASES), *map(str, files)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["runs"], result["peak"]


def check_bounds(runs: list[dict], peak: int) -> None:
    assert peak < ONE_GIB, f"peak resident memory {peak >> 20} MiB"
    for run in runs:
        where = f"{run['case']} on {run['file']}"
        assert not run["traceback"], where
        assert run["seconds"] < 60, (where, run["seconds"])
        assert run["steps"] < budget.MAX_STEPS // 10, (where, run["steps"])  # far from the budget
        assert "stopped analysing" not in run["error"] and "ran out of memory" not in run["error"], (where, run)
        if run["exit"] == 0:
            assert run["diff"], where
        else:
            assert run["exit"] in (1, 2) and run["error"], (where, run)


@pytest.mark.slow  # starts a process
def test_every_case_on_a_large_generated_model_stays_within_its_bounds(tmp_path):
    path = tmp_path / "large_deepseek.py"
    path.write_text(large_model(12))
    assert len(path.read_text().splitlines()) > 1400
    runs, peak = capped_runs([path])
    check_bounds(runs, peak)
    by_case = {run["case"]: run for run in runs}
    # the copy-helper scan that used to grow without bound now finishes and edits the offload layer
    assert by_case["kvcache-offload"]["exit"] == 0, by_case["kvcache-offload"]
    assert by_case["moe-shared-expert"]["exit"] == 0, by_case["moe-shared-expert"]
    assert all(run["exit"] in (0, 1) for run in runs), runs


@pytest.mark.slow  # starts a process
def test_no_model_in_the_suite_takes_any_case_past_its_bounds():
    files = sorted(
        [
            *(ROOT / "tests" / "adversarial").glob("*.py"),
            *EXAMPLES.glob("*.py"),
            *(ROOT / "tests" / "fixtures").glob("*.py"),
        ]
    )
    runs, peak = capped_runs(files)
    assert len(runs) == len(files) * len(CASES)
    check_bounds(runs, peak)


def test_the_model_level_case_past_its_step_budget_is_refused(monkeypatch):
    monkeypatch.setattr(budget, "MAX_STEPS", 40)
    error = one_line_refusal(run_main("apply", "--case", "prefill-microbatch", str(EXAMPLES / "microbatch_moe.py")))
    assert "msrewrite stopped analysing the layer loop of microbatch_moe.py and its layers after 40 steps" in error
