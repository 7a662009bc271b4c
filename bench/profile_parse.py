"""How fast `msrewrite profile` reads a large trace: the streamed event reader vs reading the file.

    python bench/profile_parse.py [--mb 300] [--keep FILE]

Writes a kineto-style Chrome trace of about --mb MB into a temporary folder (the same field layout
as the fixtures: CPU ops, CUDA runtime launches, flow arrows, kernels on two streams, user ranges,
one `ProfilerStep#N` per step), then times, each best of 3 with the file in the page cache:
reading it in 4 MiB chunks (`read`), the cheapest C-level pass over the same chunks
(`bytes.count(b'"ph"')`: no reader can do less than one such pass, since every event has to be
looked at), the profile reader (`msrewrite.profile.trace.load_trace`: torchscan's scan, json
only where the scan cannot vouch) and, for scale, `json.load`. Prints the ratios; the target is
reader / read <= 2. The trace has no gpu_user_annotation events, so every step is found through
its launches (the reader's slowest path: every kernel's and launch's correlation is read).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from _common import best_of


def write_trace(path: Path, megabytes: float) -> int:
    """A kineto-like trace; returns the number of events."""
    kernel = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3>)"
    count = 0
    target = megabytes * 1e6
    with open(path, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "deviceProperties": [],\n  "traceEvents": [\n')
        ts, step, corr, first = 1000.0, 0, 0, True
        while f.tell() < target:
            step += 1
            events = [
                {
                    "ph": "X",
                    "cat": "user_annotation",
                    "name": f"ProfilerStep#{step}",
                    "pid": 1,
                    "tid": 1,
                    "ts": ts,
                    "dur": 900.0,
                    "args": {"External id": corr},
                }
            ]
            for layer in range(40):
                for which, stream in (("main", 7), ("side", 20)):
                    corr += 1
                    t = ts + layer * 20 + (0 if which == "main" else 2)
                    events += [
                        {
                            "ph": "X",
                            "cat": "cpu_op",
                            "name": "aten::add",
                            "pid": 1,
                            "tid": 1,
                            "ts": t,
                            "dur": 3.0,
                            "args": {
                                "External id": corr,
                                "Record function id": 0,
                                "Ev Idx": corr,
                                "Input Dims": [[64, 2048], [64, 2048], []],
                                "Input type": ["float", "float", "Scalar"],
                                "Input Strides": [[2048, 1], [2048, 1], []],
                                "Concrete Inputs": ["", "", "1"],
                            },
                        },
                        {
                            "ph": "X",
                            "cat": "cuda_runtime",
                            "name": "cudaLaunchKernel",
                            "pid": 1,
                            "tid": 1,
                            "ts": t + 1,
                            "dur": 1.5,
                            "args": {"External id": corr, "cbid": 211, "correlation": corr},
                        },
                        {
                            "ph": "f",
                            "id": corr,
                            "pid": 1,
                            "tid": 1,
                            "ts": t + 1,
                            "cat": "ac2g",
                            "name": "ac2g",
                            "bp": "e",
                        },
                        {
                            "ph": "X",
                            "cat": "kernel",
                            "name": kernel,
                            "pid": 0,
                            "tid": stream,
                            "ts": t + 5,
                            "dur": 6.0,
                            "args": {
                                "External id": corr,
                                "queued": 0,
                                "device": 0,
                                "context": 1,
                                "stream": stream,
                                "correlation": corr,
                                "registers per thread": 16,
                                "shared memory": 0,
                                "blocks per SM": 1.2,
                                "warps per SM": 4.8,
                                "grid": [128, 1, 1],
                                "block": [128, 1, 1],
                                "est. achieved occupancy %": 8,
                            },
                        },
                    ]
            for event in events:
                f.write(("" if first else ",\n") + "  " + json.dumps(event))
                first = False
            count += len(events)
            ts += 1000.0
        f.write("\n  ]\n}\n")
    return count


def read_chunks(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass


def count_chunks(path: Path) -> int:
    """Read in 4 MiB chunks and count one literal in each: the least a reader must do."""
    found = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            found += chunk.count(b'"ph"')
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=300.0)
    ap.add_argument("--keep", type=Path, help="write the trace here instead of a temporary folder")
    ap.add_argument("--no-json-load", action="store_true", help="skip the json.load figure (memory)")
    args = ap.parse_args()
    from msrewrite.profile.trace import load_trace

    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "trace.json"
        events = write_trace(path, args.mb)
        size = path.stat().st_size / 1e6
        read = best_of(lambda: read_chunks(path), 3)
        floor = best_of(lambda: count_chunks(path), 3)
        reader = best_of(lambda: load_trace(path), 3)
        loaded = load_trace(path)
        print(f"trace: {size:.0f} MB, {events} events, {len(loaded.kernels)} kernels, {len(loaded.steps)} steps")
        print(f"read in 4 MiB chunks: {read:.3f} s")
        print(f"+ one bytes.count:    {floor:.3f} s  ({floor / read:.2f}x the read: the floor of any reader)")
        print(f"profile reader:       {reader:.3f} s  ({reader / read:.2f}x the read; target <= 2x)")
        if not args.no_json_load:
            full = best_of(lambda: json.load(open(path)), 1)
            print(f"json.load:            {full:.3f} s  ({full / read:.2f}x the read)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
