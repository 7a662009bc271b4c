"""Host reads the dispatcher never sees on CPU (`.cpu()`, `.to("cpu")`, `.tolist()`, `.numpy()`,
`np.asarray`, printing): on a device each is a copy to the host on the current stream, so one before
the join reads the side stream's output too early; the same read after the join is clean."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import EXAMPLES, load_regen
from msrewrite.runtime import install
from msrewrite.sanitizer import Sanitizer

regen = load_regen()


@pytest.fixture(autouse=True)
def _inference():
    with torch.no_grad():
        yield


# each on a line of its own: the finding names the line of the read
HOST_READS = {
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "to('cpu')": lambda t: t.to("cpu"),
    "to(torch.device('cpu'))": lambda t: t.to(torch.device("cpu")),
    "to(device='cpu', dtype=...)": lambda t: t.to(device="cpu", dtype=torch.float64),
    "to('cpu', non_blocking=True)": lambda t: t.to("cpu", non_blocking=True),
    "numpy": lambda t: t.numpy(),
    "np.asarray": lambda t: np.asarray(t),
    "__array__": lambda t: t.__array__(),
    "str": lambda t: str(t),
    "f-string": lambda t: f"{t}",
    # these dispatch aten._local_scalar_dense on CPU: seen as ops already
    "item": lambda t: t[0].item(),
    "bool": lambda t: bool(t[0]),
    "int": lambda t: int(t[0]),
    "float": lambda t: float(t[0]),
}


def _side_output_read_on_main(read, joined: bool):
    main, side = torch.npu.current_stream(), torch.npu.Stream()
    data = torch.ones(4) * 3
    side.wait_stream(main)
    with torch.npu.stream(side):
        out = data * 2  # written on side
    out.record_stream(main)
    if joined:
        main.wait_stream(side)
    value = read(out)  # read on main, from the host
    main.wait_stream(side)
    return value


def _line(code) -> int:
    return code.__code__.co_firstlineno


@pytest.mark.parametrize("name", HOST_READS)
def test_a_host_read_before_the_join_races_with_the_side_stream(name):
    read = HOST_READS[name]
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            _side_output_read_on_main(read, joined=False)
    races = [f for f in san.findings if f.kind == "race-raw"]
    assert [f.second for f in races] == [(__file__, _line(read))], san.findings
    assert "main reads at" in races[0].message and "written on side:1" in races[0].message


@pytest.mark.parametrize("name", HOST_READS)
def test_the_same_host_read_after_the_join_is_clean(name):
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            value = _side_output_read_on_main(HOST_READS[name], joined=True)
    assert san.findings == []
    assert value is True or "6" in str(value)  # the side stream's values (bool(6.0) is True)


def test_to_the_models_own_device_is_no_copy_and_no_read():
    """`.to(x.device)`: on a device no copy at all (x is there already), so no read before the join."""
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            x = torch.ones(4)
            side.wait_stream(main)
            with torch.npu.stream(side):
                out = x * 2
            moved = out.to(x.device)
            main.wait_stream(side)
            out.record_stream(main)
            total = moved + 1
    assert moved is out and san.findings == [] and total.tolist() == [3.0] * 4


def test_a_host_copy_is_a_new_tensor_and_back_on_the_device_it_is_no_copy_again():
    """On a device `t.cpu()` is a new tensor: the side stream may then overwrite `t` while main reads
    the copy (no race), and `copy.to(x.device)` makes a device tensor of it (no read of `t`)."""
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            data = torch.ones(4) * 2
            host = data.cpu()
            assert host is not data and host.data_ptr() != data.data_ptr()
            assert host.cpu() is host and host.to("cpu") is host  # already on the host: no copy
            side.wait_stream(main)
            with torch.npu.stream(side):
                data.add_(1)  # the side stream overwrites the original
            back = host.to(data.device)
            total = (back + 1).sum()  # main reads its own copy
            main.wait_stream(side)
    assert san.findings == [] and total.item() == 12 and data.tolist() == [3.0] * 4
    assert data.cpu() is data  # outside the sanitizer, CPU semantics again


def test_a_non_blocking_host_copy_read_before_a_synchronize_races():
    def run(sync: bool):
        with install() as rt:
            with Sanitizer(rt, user_files=[__file__]) as san:
                data = torch.ones(4) * 2
                host = data.to("cpu", non_blocking=True)  # copy
                if sync:
                    torch.npu.current_stream().synchronize()
                host.tolist()  # host read
        return san.findings

    assert run(sync=True) == []
    (race,) = run(sync=False)
    lines = Path(__file__).read_text().splitlines()
    copy, read = (next(n for n, text in enumerate(lines, 1) if text.endswith(m)) for m in ("# copy", "# host read"))
    assert (race.kind, race.first, race.second) == ("race-raw", (__file__, copy), (__file__, read))
    assert "non_blocking=True and no synchronize" in race.message


def test_a_blocking_host_read_synchronizes_the_stream_it_ran_on():
    """`.tolist()` on the side stream waits for it: main may then write what the side stream wrote."""
    with install() as rt:
        with Sanitizer(rt, user_files=[__file__]) as san:
            main, side = torch.npu.current_stream(), torch.npu.Stream()
            data = torch.ones(4)
            side.wait_stream(main)
            with torch.npu.stream(side):
                data.add_(1)
                data.tolist()
            data.add_(1)
    assert san.findings == []


# --- through verify: the golden edit with a host read of the side output inserted ---------------
def _with_host_read(mode: str, statement: str, after_join: bool) -> tuple[str, int]:
    """The golden moe-shared-expert edit of deepseek_moe with `statement` (flag on only) before the
    join, or after it inside the join block; and the statement's line."""
    golden, _ = regen.golden_paths("moe-shared-expert", mode, "deepseek_moe")
    lines = golden.read_text().splitlines(keepends=True)
    if after_join:
        at = next(
            i for i, text in enumerate(lines) if "_ms_record_stream(current_stream, shared_experts_output)" in text
        )
        lines[at + 1 : at + 1] = [f"            {statement}\n"]
        return "".join(lines), at + 2
    at = next(i for i, text in enumerate(lines) if "join the side stream before" in text)
    lines[at:at] = ["        if shared_expert_stream is not None:\n", f"            {statement}\n"]
    return "".join(lines), at + 2


OUT = "shared_experts_output"
VERIFY_READS = {  # the audit's mutants e11 (tolist), e15 and c02 (cpu), and the other spellings
    "tolist": ("eager", f"{OUT} = torch.tensor({OUT}.tolist()).reshape({OUT}.shape)"),
    "cpu": ("eager", f"{OUT} = {OUT}.cpu().to(hidden_states.device)"),
    "cpu-cuda": ("cuda", f"{OUT} = {OUT}.cpu().to(hidden_states.device)"),
    "to-device-cpu": ("eager", f'{OUT} = {OUT}.to(torch.device("cpu")).to(hidden_states.device)'),
    "np.asarray": ("eager", f'{OUT} = torch.as_tensor(__import__("numpy").asarray({OUT}.detach()))'),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", VERIFY_READS)
@pytest.mark.parametrize("after_join", [False, True], ids=["before-join-fails", "after-join-passes"])
def test_verify_catches_a_host_read_before_the_join_and_passes_it_after(tmp_path, name, after_join):
    from msrewrite.verify import verify_files

    mode, statement = VERIFY_READS[name]
    text, line = _with_host_read(mode, statement, after_join)
    edited = tmp_path / "deepseek_moe.py"
    edited.write_text(text)
    result = verify_files(edited, original=EXAMPLES / "deepseek_moe.py", inputs=0, train=False)
    if after_join:
        assert result.ok and not result.findings, result.problems
        return
    assert not result.ok
    races = [f for f in result.findings if f.kind == "race-raw"]
    assert [f.second for f in races] == [(str(edited), line)], result.problems
    assert re.search(rf"main reads at {re.escape(str(edited))}:{line} a tensor written on side:1", races[0].message)
