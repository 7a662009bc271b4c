"""The torch trace reader (msrewrite/profile/torchscan.py) against a json.loads reference.

Every trace here is read twice: by `load_trace` (the C-level scan, chunks decoded by json where
the scan cannot vouch for them, the whole file by the exact reader when it cannot be cut) and by
`torch_trace_from_events(json.loads(file)["traceEvents"])`, and the two Traces must be equal:
the same kernels in the same order, windows, steps, stream names and host-only ranges. The
traces are written in the forms real writers use (kineto's multi-line template, torch's CUPTI
monitor's compact `json.dump`, `json.dump` with and without indent) and in the forms JSON allows
beyond them (any whitespace, any key order, escapes, numbers as strings), each at several chunk
sizes so the cuts fall everywhere.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from msrewrite.errors import BadInput
from msrewrite.profile import torchscan
from msrewrite.profile.trace import _load_torch, load_trace, torch_trace_from_events

CHUNKS = (97, 1000, 4096, 1 << 22)
KERNEL = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, std::array<char*, 3>)::{lambda(int)#1}"


# Events -------------------------------------------------------------------------------------------
def events(
    rng: random.Random, steps: int = 3, layers: int = 3, odd: bool = False, on_device: float = 0.7
) -> list[dict]:
    """A kineto-like trace: metadata, steps, two marked regions per layer on two streams, CPU ops,
    launches, flows; a marked range has a gpu_user_annotation with probability `on_device`; with
    `odd`, names and values that stress a scanner."""
    out: list[dict] = [
        {"name": "process_name", "ph": "M", "ts": 0, "pid": 4242, "tid": 0, "args": {"name": "python"}},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": 7, "args": {"name": "stream 7 "}},
        {"name": "thread_name", "ph": "M", "ts": 0, "pid": 0, "tid": 20, "args": {"name": "stream 20 "}},
    ]
    corr, ts = 100, 1000.0
    names = [KERNEL, "gemm", "fused_moe_kernel"]
    if odd:
        names += [
            'a}, {"ph": "X", "cat": "kernel"',
            'quote " and \\ backslash',
            "ünïcødé 核 \U0001f680",
            '{"ph":"X"}',
            "kernel",
            "tab\there",
            "ends with \\",
        ]
    for step in range(1, steps + 1):
        out.append(
            {
                "ph": "X",
                "cat": "user_annotation",
                "name": f"ProfilerStep#{step}",
                "pid": 4242,
                "tid": 4242,
                "ts": ts,
                "dur": 90.0,
                "args": {"External id": corr, "Record function id": 0},
            }
        )
        for layer in range(layers):
            for role, stream in (("side", 20), ("main", 7)):
                t = ts + 2 + layer * 25 + (6 if role == "main" else 0)
                corr += 1
                marker = f"msrewrite:moe-shared-expert:shared_expert:{role}"
                out.append(
                    {
                        "ph": "X",
                        "cat": "user_annotation",
                        "name": marker,
                        "pid": 4242,
                        "tid": 4242,
                        "ts": t,
                        "dur": 4.0,
                        "args": {"External id": corr},
                    }
                )
                if rng.random() < on_device:  # the others only on the host: mapped through the launches
                    out.append(
                        {
                            "ph": "X",
                            "cat": "gpu_user_annotation",
                            "name": marker,
                            "pid": 0,
                            "tid": stream,
                            "ts": t + 5,
                            "dur": 9.5,
                            "args": {"External id": corr},
                        }
                    )
                for k in range(2):
                    corr += 1
                    name = rng.choice(names)
                    out.append(
                        {
                            "ph": "X",
                            "cat": "cpu_op",
                            "name": "aten::mm",
                            "pid": 4242,
                            "tid": 4242,
                            "ts": t + k,
                            "dur": 0.5,
                            "args": {
                                "External id": corr,
                                "Input Dims": [[64, 2048], []],
                                "Concrete Inputs": ["", "1"],
                                "Input type": ["float", "Scalar"],
                                "kernel_backend": "",
                                "cat": "kernel",
                            },
                        }
                    )
                    out.append(
                        {
                            "ph": "X",
                            "cat": "cuda_runtime",
                            "name": "cudaLaunchKernel",
                            "pid": 4242,
                            "tid": 4242,
                            "ts": t + k + 0.25,
                            "dur": 0.5,
                            "args": {"External id": corr, "cbid": 211, "correlation": corr},
                        }
                    )
                    out.append(
                        {
                            "ph": "s",
                            "id": corr,
                            "pid": 4242,
                            "tid": 4242,
                            "ts": t + k + 0.25,
                            "cat": "ac2g",
                            "name": "ac2g",
                        }
                    )
                    cat = rng.choice(["kernel", "kernel", "kernel", "gpu_memcpy", "gpu_memset"])
                    out.append(
                        {
                            "ph": "X",
                            "cat": cat,
                            "name": name,
                            "pid": 0,
                            "tid": stream,
                            "ts": t + 5 + 4 * k,
                            "dur": 3.25 + k,
                            "args": {
                                "External id": corr,
                                "queued": 0,
                                "device": 0,
                                "context": 1,
                                "stream": stream,
                                "correlation": corr,
                                "registers per thread": 16,
                                "grid": [128, 1, 1],
                                "block": [128, 1, 1],
                                "est. achieved occupancy %": 8,
                            },
                        }
                    )
                    out.append(
                        {
                            "ph": "f",
                            "id": corr,
                            "pid": 0,
                            "tid": stream,
                            "ts": t + 5 + 4 * k,
                            "cat": "ac2g",
                            "name": "ac2g",
                            "bp": "e",
                        }
                    )
            out.append(
                {
                    "ph": "X",
                    "cat": "python_function",
                    "name": "torch/nn/modules/module.py(1520): _call_impl",
                    "pid": 4242,
                    "tid": 4242,
                    "ts": t,
                    "dur": 20.0,
                    "args": {"Python id": layer, "Python parent id": 0},
                }
            )
        ts += 100.0
    out.append({"name": "Record Window End", "ph": "i", "s": "g", "pid": "", "tid": "", "ts": ts})
    return out


# Writers ------------------------------------------------------------------------------------------
def kineto_text(evs: list[dict]) -> str:
    """The layout of kineto's ChromeTraceLogger: an event over three or four lines, args one per
    line, `"ph"` first."""
    parts = []
    for ev in evs:
        head = [k for k in ("ph", "cat", "name", "pid", "tid") if k in ev]
        line1 = ", ".join(f"{json.dumps(k)}: {json.dumps(ev[k])}" for k in head)
        line2 = ", ".join(f"{json.dumps(k)}: {json.dumps(ev[k])}" for k in ev if k not in head and k != "args")
        text = "  {\n    " + line1 + ",\n    " + line2
        if "args" in ev:
            text += ',\n    "args": {\n' + ",\n".join(
                f"      {json.dumps(k)}: {json.dumps(v)}" for k, v in ev["args"].items()
            )
            text += "\n    }"
        parts.append(text + "\n  }")
    return (
        '{\n  "schemaVersion": 1,\n  "deviceProperties": [\n    {"id": 0, "name": "NVIDIA H200"}\n  ],\n'
        '  "traceEvents": [\n' + ",\n".join(parts) + '\n  ],\n  "traceName": "t.json",\n  "displayTimeUnit": "ms"\n}\n'
    )


def wrap(evs: list[dict], **dump) -> str:
    return json.dumps(
        {"schemaVersion": 1, "deviceProperties": [{"id": 0}], "traceEvents": evs, "traceName": "x"}, **dump
    )


class Writer:
    """JSON written token by token with choices a strict scanner would trip on: whitespace between
    any two tokens (`ws`), keys in random order (`shuffle`), ASCII characters of chosen strings
    written as \\u escapes (`escape`), numbers written as strings (`strings`)."""

    def __init__(
        self, rng: random.Random, ws: str = "", shuffle: bool = False, escape: float = 0.0, strings: float = 0.0
    ) -> None:
        self.rng, self.ws_chars, self.shuffle, self.escape, self.strings = rng, ws, shuffle, escape, strings

    def ws(self) -> str:
        return "".join(self.rng.choice(self.ws_chars) for _ in range(self.rng.randrange(3))) if self.ws_chars else ""

    def string(self, text: str) -> str:
        out = json.dumps(text, ensure_ascii=self.rng.random() < 0.5)
        if self.escape and self.rng.random() < self.escape:
            body = "".join(
                f"\\u{ord(c):04x}" if c.isascii() and c.isalnum() and self.rng.random() < 0.5 else c for c in out[1:-1]
            )
            out = '"' + body + '"'
        return out

    def value(self, v, key: str = "") -> str:
        w = self.ws
        if isinstance(v, dict):
            items = list(v.items())
            if self.shuffle:
                self.rng.shuffle(items)
            return (
                "{"
                + w()
                + ("," + w()).join(self.string(k) + w() + ":" + w() + self.value(x, k) + w() for k, x in items)
                + "}"
            )
        if isinstance(v, list):
            return "[" + w() + ("," + w()).join(self.value(x) + w() for x in v) + "]"
        if isinstance(v, str):
            return self.string(v)
        if (
            isinstance(v, (int, float))
            and not isinstance(v, bool)
            and key in ("ts", "dur", "pid", "tid", "correlation", "External id", "stream")
        ):
            if self.rng.random() < self.strings:
                return json.dumps(str(v))
        return json.dumps(v)

    def trace(self, evs: list[dict]) -> str:
        w = self.ws
        return (
            "{"
            + w()
            + '"schemaVersion"'
            + w()
            + ":"
            + w()
            + "1"
            + w()
            + ","
            + w()
            + '"traceEvents"'
            + w()
            + ":"
            + w()
            + "["
            + w()
            + ("," + w()).join(self.value(e) + w() for e in evs)
            + "]"
            + w()
            + "}"
        )


def assert_reads_as_json_does(path: Path, chunks=CHUNKS) -> None:
    data = json.loads(path.read_bytes())
    expected = torch_trace_from_events(data["traceEvents"] if isinstance(data, dict) else data, str(path))
    assert expected.kernels, "a trace without kernels tests nothing"
    for chunk in chunks:
        got = _load_torch(path, chunk)
        assert got == expected, f"chunk {chunk}"
    assert load_trace(path) == expected


def segment_kinds(path: Path, chunk: int = 4096) -> dict[str, int]:
    kinds = {"rows": 0, "events": 0}
    for segment in torchscan.chunks(path, chunk):
        kinds["rows" if segment.rows is not None else "events"] += 1
    return kinds


# The writers' own forms: read in C, equal to json ---------------------------------------------------
@pytest.mark.parametrize("form", ["kineto", "compact", "dumps", "indent1", "indent4"])
def test_real_writers_forms_are_scanned_and_read_as_json_does(tmp_path: Path, form: str) -> None:
    evs = events(random.Random(form))
    text = {
        "kineto": lambda: kineto_text(evs),
        "compact": lambda: wrap(evs, separators=(",", ":")),
        "dumps": lambda: wrap(evs),
        "indent1": lambda: wrap(evs, indent=1),
        "indent4": lambda: wrap(evs, indent=4),
    }[form]()
    path = tmp_path / "t.json"
    path.write_text(text)
    assert_reads_as_json_does(path)
    kinds = segment_kinds(path)
    assert kinds["rows"] >= 3 and kinds["events"] == 1, kinds  # every chunk scanned; only the tail decoded


def test_host_ranges_are_mapped_through_launches_on_both_paths(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(wrap(events(random.Random(1), on_device=0)))
    assert_reads_as_json_does(path)
    trace = load_trace(path)
    # no gpu_user_annotation at all: steps and markers are found through their launches
    assert len(trace.steps) == 3 and len(trace.markers) == 18 and trace.host_only_markers == []
    assert {m.stream for m in trace.markers} == {"0:7", "0:20"}


# What JSON allows beyond them: equal to json, whichever path reads it ----------------------------
@pytest.mark.parametrize("seed", range(6))
def test_any_whitespace_between_tokens(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "t.json"
    path.write_text(Writer(random.Random(seed), ws=" \t\r\n").trace(events(random.Random(seed))))
    assert_reads_as_json_does(path)


@pytest.mark.parametrize("seed", range(4))
def test_any_key_order(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "t.json"
    path.write_text(Writer(random.Random(seed), ws=" \n", shuffle=True).trace(events(random.Random(seed))))
    assert_reads_as_json_does(path)


@pytest.mark.parametrize("seed", range(4))
def test_strings_holding_braces_quotes_key_names_and_unicode(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "t.json"
    path.write_text(Writer(random.Random(seed), ws=" ").trace(events(random.Random(seed), odd=True)))
    assert_reads_as_json_does(path)


@pytest.mark.parametrize("seed", range(4))
def test_ascii_written_as_u_escapes_in_keys_and_values(tmp_path: Path, seed: int) -> None:
    """`"p\\u0068"` is the key ph and `"kern\\u0065l"` the category kernel: json reads them so."""
    path = tmp_path / "t.json"
    path.write_text(Writer(random.Random(seed), ws=" ", escape=0.05).trace(events(random.Random(seed))))
    assert "\\u00" in path.read_text()
    assert_reads_as_json_does(path)


@pytest.mark.parametrize("seed", range(4))
def test_numbers_written_as_strings(tmp_path: Path, seed: int) -> None:
    """ts and dur as strings of µs (torch_npu writes them so), ids and correlations as strings:
    a string tid is another thread than the number, as json reads it."""
    path = tmp_path / "t.json"
    path.write_text(Writer(random.Random(seed), ws=" ", strings=0.3).trace(events(random.Random(seed))))
    assert_reads_as_json_does(path)


def _odd_text(edit: str, evs: list, r: dict) -> str | None:
    """The trace's text for the edits made on the text; None for those made on the events."""
    if edit == "correlation twice":
        return wrap(evs).replace(
            f'"correlation": {r["args"]["correlation"]}}}',
            f'"correlation": {r["args"]["correlation"]}, "correlation": 4242}}',
            1,
        )
    if edit == "keys repeated before ph":
        return wrap(evs).replace(
            '{"ph": "X", "cat": "kernel"', '{"ts": -5, "cat": "cpu_op", "ph": "X", "cat": "kernel"', 3
        )
    if edit == "key repeated after args":
        return wrap(evs).replace('"est. achieved occupancy %": 8}}', '"est. achieved occupancy %": 8}, "ts": 7.5}', 2)
    if edit == "exponent numbers":
        return wrap(evs).replace('"dur": 3.25', '"dur": 3.25e0').replace('"ts": 1', '"ts": 1e0*', 0)
    if edit == "ph before a needed cat later":
        return wrap(evs).replace('{"ph": "X", "cat": "kernel"', '{"ph": "i", "ph": "X", "cat": "kernel"', 2)
    return None


@pytest.mark.parametrize(
    "edit",
    [
        "args absent",
        "args empty",
        "nested args",
        "correlation twice",
        "correlation as a key name's tail",
        "correlation a float",
        "ph as a value",
        "ph inside args",
        "ph not first",
        "keys repeated before ph",
        "args only before ph",
        "key repeated after args",
        "exponent numbers",
        "ph before a needed cat later",
    ],
)
def test_single_odd_events(tmp_path: Path, edit: str) -> None:
    evs = events(random.Random(7))
    kernels = [i for i, e in enumerate(evs) if e.get("cat") == "kernel"]
    runtime = [i for i, e in enumerate(evs) if e.get("cat") == "cuda_runtime"]
    k, r = evs[kernels[3]], evs[runtime[5]]
    text = _odd_text(edit, evs, r)
    if edit == "args absent":
        del k["args"]
    elif edit == "args empty":
        k["args"] = {}
    elif edit == "nested args":
        k["args"]["annotation"] = {"correlation": 5, "inner": {"stream": 99, "x": [{"ph": "X"}]}}
    elif edit == "correlation as a key name's tail":
        r["args"]['x"correlation'] = 5
    elif edit == "correlation a float":
        r["args"]["correlation"] = float(r["args"]["correlation"])
    elif edit == "ph as a value":
        k["args"]["kernel_backend"] = "ph"
        evs[0]["args"]["name"] = "ph"
    elif edit == "ph inside args":
        evs[1]["args"]["ph"] = "X"
        k["args"]["ph"] = 1
    elif edit == "ph not first":
        evs[kernels[4]] = {"name": evs[kernels[4]]["name"], **{x: y for x, y in evs[kernels[4]].items() if x != "name"}}
    elif edit == "args only before ph":  # json reads it as the event's args: the stream's name comes from it
        at = next(i for i, e in enumerate(evs) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
        first = evs[at]
        first["args"]["stream"] = 99
        evs[at] = {"args": first.pop("args"), **first}
    path = tmp_path / "t.json"
    path.write_text(text if text is not None else wrap(evs))
    if text is not None:
        assert text != wrap(evs)
    assert_reads_as_json_does(path)


def test_look_alikes_of_the_keys_the_scan_reads(tmp_path: Path) -> None:
    """Keys whose text ends like "ph" or "correlation" after an escaped quote, and an args object
    whose last member is an object holding "correlation": none of them is the key it looks like.
    Every marked range is found through launches here, so a wrong correlation moves a window."""
    evs = events(random.Random(11), on_device=0)
    kernels = [e for e in evs if e.get("cat") == "kernel"]
    runtime = [e for e in evs if e.get("cat") == "cuda_runtime"]
    kernels[2]['a"ph'] = kernels[2].pop("ph")  # no ph: json does not read it as an X event
    first = {k: v for k, v in kernels[2].items() if k != 'a"ph'}
    kernels[2].clear()
    kernels[2].update({'a"ph': "X", **first})
    runtime[4]["args"]['x"correlation'] = runtime[4]["args"].pop("correlation")  # no correlation key left
    # kernels[6] loses its correlation; an object nested last in its args names kernels[0]'s launch
    del kernels[6]["args"]["correlation"]
    kernels[6]["args"]["annotation"] = {"correlation": kernels[0]["args"]["correlation"]}
    path = tmp_path / "t.json"
    path.write_text(wrap(evs))
    text = path.read_text()
    assert '{"a\\"ph": "X"' in text and '"x\\"correlation": ' in text and '"annotation": {"correlation": ' in text
    assert_reads_as_json_does(path)


def test_a_trace_that_cannot_be_cut_is_read_whole_by_the_exact_reader(tmp_path: Path, monkeypatch) -> None:
    """No event starts with `{"ph"`: the scan finds no place to cut, and past MAX_CARRY the file
    goes to the exact reader."""
    evs = [{"name": e.get("name", ""), **{k: v for k, v in e.items() if k != "name"}} for e in events(random.Random(3))]
    path = tmp_path / "t.json"
    path.write_text(wrap(evs))
    monkeypatch.setattr(torchscan, "MAX_CARRY", 2000)
    with pytest.raises(torchscan.Unusual):
        list(torchscan.chunks(path, 500))
    assert_reads_as_json_does(path, chunks=(500,))


def test_a_cut_inside_an_event_goes_to_the_exact_reader(tmp_path: Path) -> None:
    """An object array nested in an event, an element opening with `"ph"`: a chunk ending just
    after it is cut there, the next run cannot be decoded, and the whole file goes to the exact
    reader."""
    evs = events(random.Random(4))
    cpu = next(e for e in evs if e.get("cat") == "cpu_op")
    cpu["args"]["list"] = [{"a": 1}, {"ph": "X", "x": [1, 2]}]
    path = tmp_path / "t.json"
    path.write_text(wrap(evs))
    chunk = path.read_bytes().index(b'{"ph": "X", "x"') + 12
    with pytest.raises(torchscan.Unusual):
        list(torchscan.chunks(path, chunk))
    assert_reads_as_json_does(path, chunks=(chunk,) + CHUNKS)


# Bad input stays one line -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, message",
    [
        (
            '{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 2}, '
            '{"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": "soon", "dur": 2}, {"ph": "M"}]}',
            "not a number",
        ),
        (
            '{"traceEvents": [{"ph": "X", "cat": "cuda_runtime", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 2, '
            '"args": {"correlation": "x1"}}, {"ph": "M"}]}',
            "correlation is not a number",
        ),
        (
            '{"traceEvents": [{"ph": "M"}, {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 7, "ts": 1, "dur": 2}',
            "not closed",
        ),
    ],
)
def test_bad_values_are_one_line_errors_on_the_scanned_path(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(BadInput, match=message):
        load_trace(path)


def test_load_trace_gives_the_collector_back_as_it_found_it(tmp_path: Path) -> None:
    import gc

    path = tmp_path / "t.json"
    path.write_text(wrap(events(random.Random(2))))
    for state in (True, False):
        (gc.enable if state else gc.disable)()
        try:
            load_trace(path)
            assert gc.isenabled() is state
            with pytest.raises(BadInput):
                load_trace(tmp_path / "missing.json")
            assert gc.isenabled() is state
        finally:
            gc.enable()


# torch_npu: only what the reader uses is decoded ------------------------------------------------
def test_npu_folder_reads_the_same_with_and_without_the_event_filter(tmp_path: Path) -> None:
    """trace_view.json decoded whole (keep=None, every event) and filtered give the same Trace, on
    the fixtures and on one whose names, keys and markers are written with \\u escapes."""
    from msrewrite.profile.trace import _load_npu

    fixtures = Path(__file__).parent / "fixtures" / "profile"
    for folder in (fixtures / "npu_on", fixtures / "npu_off"):
        assert _load_npu(folder) == _load_npu(folder, keep=None)
    events = json.loads((fixtures / "npu_on" / "ASCEND_PROFILER_OUTPUT" / "trace_view.json").read_text())
    rng = random.Random(9)
    out = tmp_path / "run" / "ASCEND_PROFILER_OUTPUT"
    out.mkdir(parents=True)
    writer = Writer(rng, ws=" \n", escape=0.3)
    text = "[" + ",".join(writer.value(e) for e in events) + "]"
    assert "\\u00" in text
    (out / "trace_view.json").write_text(text)
    for name in ("kernel_details.csv", "op_statistic.csv"):
        (out / name).write_text((fixtures / "npu_on" / "ASCEND_PROFILER_OUTPUT" / name).read_text())
    filtered, whole = _load_npu(out.parent), _load_npu(out.parent, keep=None)
    assert filtered == whole
    assert len(whole.kernels) == 20 and len(whole.markers) == 8
