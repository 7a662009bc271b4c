"""afd-overlap run for real: two processes in a gloo group on this machine's loopback.

Rank 1 serves the remote FFN; rank 0 runs the attention node three times (original, edited with
the flag off, edited with the flag on) and the outputs must be identical.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import EXAMPLES, free_port, load_file, load_regen

pytestmark = pytest.mark.slow  # two-process gloo groups

regen = load_regen()
RUNS = ("original", "flag off", "flag on")


def _worker(rank: int, port: int, edited: str, results: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    sys.path.insert(0, str(EXAMPLES))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        original = load_file(EXAMPLES / "afd_attention_node.py", "afd_original")
        if rank == 1:
            original.serve_ffn(attention_rank=0, steps=len(RUNS))
            return
        rewritten = load_file(edited, "afd_rewritten")
        outputs = {}
        for run in RUNS:
            os.environ["ENABLE_AFD_OVERLAP"] = "0" if run == "flag off" else "1"
            module = original if run == "original" else rewritten
            layer, (x,) = module.make()
            with torch.no_grad():
                outputs[run] = layer(x)
        torch.save(outputs, results)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("mode", ["eager", "cuda"])
def test_afd_overlap_with_a_real_gloo_group(tmp_path, mode):
    golden, _ = regen.golden_paths("afd-overlap", mode, "afd_attention_node")
    text = golden.read_text()
    if mode == "cuda":  # the edit is the same torch.distributed code; run it on CPU tensors
        assert "dist.isend(" in text and "torch.cuda" not in text
    results = tmp_path / "results.pt"
    mp.start_processes(
        _worker, args=(free_port(), str(golden), str(results)), nprocs=2, join=True, start_method="spawn"
    )
    outputs = torch.load(results)
    assert torch.equal(outputs["original"], outputs["flag off"])
    assert torch.equal(outputs["original"], outputs["flag on"])
