"""prefill-microbatch run for real: a two-process gloo group, the collectives inside every layer.

Each rank runs the model three times (original, edited with the flag off, edited with the flag
on); the flag-on run uses the CPU stream stand-ins and the stream sanitizer, so the event chain
between the compute and communication streams is checked as well as the numbers.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import EXAMPLES, free_port, load_file, load_regen

pytestmark = pytest.mark.slow  # two-process gloo groups

regen = load_regen()


def _worker(rank: int, port: int, edited: str, results: str, example: str = "microbatch_moe") -> None:
    from msrewrite.runtime import install
    from msrewrite.sanitizer import Sanitizer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        original = load_file(EXAMPLES / f"{example}.py", "microbatch_original")
        outputs, streams, findings = {}, {}, []
        with torch.no_grad():
            model, (x,) = original.make()
            outputs["original"] = model(x)
            os.environ["ENABLE_PREFILL_MICROBATCH"] = "0"
            with install():
                model, (x,) = load_file(edited, "microbatch_off").make()
                outputs["flag off"] = model(x)
            os.environ["ENABLE_PREFILL_MICROBATCH"] = "1"
            with install() as rt:
                model, (x,) = load_file(edited, "microbatch_on").make()
                with Sanitizer(rt, user_files=[edited]) as san, rt.record_ops() as ops:
                    outputs["flag on"] = model(x)
                    san.check_output(outputs["flag on"])
                findings = [str(f) for f in san.findings]
                streams = {op.stream for op in ops}
        if rank == 0:
            torch.save({"outputs": outputs, "findings": findings, "streams": streams}, results)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "mode,example", [("eager", "microbatch_moe"), ("cuda", "microbatch_moe"), ("eager", "microbatch_moe_submodule")]
)
def test_prefill_microbatch_with_a_real_gloo_group(tmp_path, mode, example):
    """microbatch_moe_submodule: the collectives sit inside self.moe, whose call is the comm stage."""
    golden, _ = regen.golden_paths("prefill-microbatch", mode, example)
    results = tmp_path / "results.pt"
    mp.start_processes(
        _worker, args=(free_port(), str(golden), str(results), example), nprocs=2, join=True, start_method="spawn"
    )
    saved = torch.load(results)
    outputs = saved["outputs"]
    assert torch.equal(outputs["original"], outputs["flag off"])
    # half the rows per kernel call: equal up to the last bits
    assert torch.allclose(outputs["original"], outputs["flag on"], atol=1e-5, rtol=1e-5)
    assert saved["findings"] == []
    assert saved["streams"] == {"main", "side:1"}  # compute on main, collectives on the comm stream


@pytest.mark.parametrize(
    "example,wait",
    [
        ("microbatch_moe", "        current_stream.wait_event(stage1_mb0_done)\n"),  # expert compute after dispatch
        (
            "microbatch_moe_submodule",
            "            comm_stream.wait_event(stage0_mb0_done)\n",
        ),  # the MoE after attention
    ],
)
def test_a_missing_event_wait_is_caught(tmp_path, example, wait):
    """Drop a wait of the event chain between the compute and comm stages: a race."""
    golden, _ = regen.golden_paths("prefill-microbatch", "eager", example)
    text = golden.read_text()
    mutated = text.replace(wait, "", 1)
    assert mutated != text
    edited = tmp_path / f"{example}.py"
    edited.write_text(mutated)
    results = tmp_path / "results.pt"
    mp.start_processes(
        _worker, args=(free_port(), str(edited), str(results), example), nprocs=2, join=True, start_method="spawn"
    )
    findings = torch.load(results)["findings"]
    assert any("race-raw" in f for f in findings), findings


def test_second_comm_group_gives_micro_batch_1_its_own_stream(tmp_path):
    """--second-comm-group: micro-batch 1's collectives go over the layer's second process group on a
    second communication stream; still equal to the original, still clean."""
    from msrewrite.commands.apply import case_steps
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    src = load(EXAMPLES / "microbatch_moe.py")
    steps = case_steps(
        EXAMPLES / "microbatch_moe.py",
        src.text,
        src.module,
        "prefill-microbatch",
        "eager",
        None,
        FlagSpec(name="ENABLE_PREFILL_MICROBATCH"),
        None,
        second_group="ep_group_mb1",
    )
    edited = tmp_path / "microbatch_moe.py"
    edited.write_text(steps[-1].new)
    assert "group=self.ep_group_mb1" in steps[-1].new
    results = tmp_path / "results.pt"
    mp.start_processes(
        _worker, args=(free_port(), str(edited), str(results)), nprocs=2, join=True, start_method="spawn"
    )
    saved = torch.load(results)
    assert torch.allclose(saved["outputs"]["original"], saved["outputs"]["flag on"], atol=1e-5, rtol=1e-5)
    assert saved["findings"] == []
    assert saved["streams"] == {"main", "side:1", "side:2"}
