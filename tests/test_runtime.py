"""The CPU stand-ins for torch.npu / torch_npu / torchair / torch.cuda streams."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from msrewrite.runtime import OpRecord, Stream, StreamRuntime, install

STAND_IN_MODULES = ("torch.npu", "torch_npu", "torchair", "torchair.scope", "torchair.ops")
CUDA_NAMES = (
    "is_available",
    "Stream",
    "Event",
    "stream",
    "current_stream",
    "default_stream",
    "set_stream",
    "synchronize",
)


def _snapshot():
    return {
        "modules": {name: sys.modules.get(name) for name in STAND_IN_MODULES + ("torch_npu.npu",)},
        "torch.npu": "npu" in vars(torch),
        "cuda": {name: vars(torch.cuda).get(name) for name in CUDA_NAMES},
        "record_stream": vars(torch.Tensor).get("record_stream"),
        "is_compiling": torch.compiler.is_compiling,
    }


def test_install_puts_stand_ins_in_place_and_restores_everything():
    before = _snapshot()
    with install() as rt:
        assert isinstance(rt, StreamRuntime)
        import torch_npu
        import torchair
        from torchair.scope import npu_stream_switch  # noqa: F401

        assert torch.npu is torch_npu.npu is sys.modules["torch.npu"]
        assert torchair.scope is sys.modules["torchair.scope"]
        assert not hasattr(torch_npu, "__file__")  # never the real package
        assert torch.npu.is_available() and torch.cuda.is_available()
    assert _snapshot() == before
    assert not hasattr(torch, "npu")


def test_install_restores_after_an_exception():
    before = _snapshot()
    with pytest.raises(ZeroDivisionError):
        with install():
            _ = 1 / 0
    assert _snapshot() == before


def test_nested_install_is_refused():
    with install():
        with pytest.raises(RuntimeError, match="already active"):
            with install():
                pass
        assert torch.npu.is_available()  # the outer install is untouched
    with install():  # and a fresh one works afterwards
        pass


def test_streams_and_events_follow_torch_npu_semantics():
    with install() as rt:
        main = torch.npu.current_stream()
        assert main is rt.current_stream() is torch.npu.default_stream() and main.name == "main"
        side = torch.npu.Stream(priority=-1)
        assert side.name == "side:1" and side.query()
        with torch.npu.stream(side):
            assert torch.npu.current_stream() is side
        with torch.npu.stream(None):
            assert torch.npu.current_stream() is main
        with side:
            assert rt.current_stream() is side
        torch.npu.set_stream(side)
        assert rt.current_stream() is side
        torch.npu.set_stream(main)

        event = side.record_event()
        assert isinstance(event, torch.npu.Event) and event.recorded_on is side
        default_event = torch.npu.Event()
        default_event.record()  # defaults to the current stream
        assert default_event.recorded_on is main
        side.wait_stream(main)
        side.wait_event(default_event)
        default_event.wait()
        torch.npu.Event().wait(side)  # never recorded: a no-op
        default_event.synchronize(), side.synchronize(), torch.npu.synchronize()

        start, end = torch.npu.Event(enable_timing=True), torch.npu.Event(enable_timing=True)
        start.record(), end.record()
        assert start.elapsed_time(end) >= 0
        with pytest.raises(RuntimeError, match="enable_timing"):
            event.elapsed_time(end)
        with pytest.raises(TypeError):
            torch.npu.Stream(bogus=1)


def test_stream_objects_refuse_use_after_uninstall():
    with install():
        pass
    with pytest.raises(RuntimeError, match="not installed"):
        Stream()


def test_record_stream_accepts_stand_in_streams_only():
    x = torch.ones(2)
    with install():
        x.record_stream(torch.npu.Stream())
        x.record_stream(torch.npu.current_stream())
        with pytest.raises((RuntimeError, TypeError, NotImplementedError)):
            x.record_stream(torch.cpu.Stream())  # still the real op for anything else
    with pytest.raises((RuntimeError, TypeError, NotImplementedError)):
        x.record_stream(torch.cpu.Stream())


def test_cuda_stream_api_shares_the_runtime():
    with install() as rt:
        cuda_side = torch.cuda.Stream()
        with torch.cuda.stream(cuda_side):
            assert torch.npu.current_stream() is cuda_side is rt.current_stream()
        assert torch.cuda.current_stream() is torch.npu.current_stream()
        assert torch.cuda.default_stream() is rt.default_stream()
        torch.cuda.current_stream().wait_stream(cuda_side)
        event = torch.cuda.Event()
        event.record(cuda_side)
        torch.cuda.synchronize()


def test_set_stream_limit_needs_a_stand_in_npu_stream():
    with install() as rt:
        side = torch.npu.Stream()
        for wrong in (torch.cpu.Stream(), torch.Stream("cpu"), torch.cuda.Stream(), object()):
            with pytest.raises(AssertionError):
                torch.npu.set_stream_limit(wrong, 8, 16)
        torch.npu.set_stream_limit(side, 8, 16)
        assert torch.npu.get_stream_limit(side) == {"cube_core_num": 8, "vector_core_num": 16}
        torch.npu.set_stream_limit(side, cube_num=4)  # -1 keeps the vector count
        assert torch.npu.get_stream_limit(side) == {"cube_core_num": 4, "vector_core_num": 16}
        torch.npu.reset_stream_limit(side)
        default = torch.npu.get_stream_limit(side)
        with torch.npu.npugraph_ex.scope.limit_core_num(2, 4):
            assert torch.npu.get_stream_limit(rt.current_stream()) == {"cube_core_num": 2, "vector_core_num": 4}
        assert torch.npu.get_stream_limit(rt.current_stream()) == default


def test_npu_wait_tensor_raises_in_eager_like_the_real_kernel():
    with install():
        import torchair

        a = torch.ones(2)
        with pytest.raises(NotImplementedError, match=r"^torch\.ops\.air\.wait_tensor kernel_impl is not implemented!"):
            torchair.scope.npu_wait_tensor(a, a)


def test_graph_mode_switches_streams_and_runs_wait_tensor():
    with install() as rt:
        import torchair

        a, b = torch.ones(2), torch.zeros(2)
        assert not torch.compiler.is_compiling()
        with rt.graph_mode():
            assert torch.compiler.is_compiling()
            with torchair.scope.npu_stream_switch("1", 0):
                assert rt.current_stream().name == "tag:1"
                assert torchair.scope.npu_wait_tensor(a, b) is a
                with torchair.scope.npu_stream_switch("2"):
                    assert rt.current_stream().name == "tag:2"
                tag_stream = rt.current_stream()
            with torchair.scope.npu_stream_switch("1", 0):
                assert rt.current_stream() is tag_stream  # same tag, same stream
            assert rt.current_stream().name == "main"
        assert not torch.compiler.is_compiling()
    with install(graph_mode=True) as rt:
        assert rt.in_graph_mode and torch.compiler.is_compiling()


def test_stream_switch_is_a_silent_no_op_in_eager():
    with install() as rt:
        import torchair

        with rt.record_ops() as ops:
            with torchair.scope.npu_stream_switch("1", 0), torchair.scope.limit_core_num(4, 8):
                assert rt.current_stream().name == "main"
                torch.ones(2).add_(1)
            with torchair.scope.super_kernel("sk", "stream-fusion=1"):
                pass
        assert {op.stream for op in ops} == {"main"}


def test_torchair_tagged_events_run_in_eager_and_refuse_graph_mode():
    with install() as rt:
        from torchair import ops as tops

        event = tops.npu_create_tagged_event("e1")
        with pytest.raises(ValueError):
            tops.npu_create_tagged_event("e1")
        side = torch.npu.Stream()
        with torch.npu.stream(side):
            tops.npu_tagged_event_record(event)
        tops.npu_tagged_event_wait(event)
        assert event.recorded_on is side
        tops.npu_record_tagged_stream(torch.ones(2), "default")
        with rt.graph_mode():
            for call in (
                lambda: tops.npu_tagged_event_record(event),
                lambda: tops.npu_tagged_event_wait(event),
                lambda: tops.npu_record_tagged_stream(torch.ones(2), "x"),
            ):
                with pytest.raises(NotImplementedError):
                    call()


def test_torchair_compile_stubs():
    with install():
        import torchair

        config = torchair.CompilerConfig()
        config.ge_config.aicore_num = "24|48"
        backend = torchair.get_npu_backend(compiler_config=config)
        run = backend(lambda x: (torch.compiler.is_compiling(), x + 1), [])
        compiling, value = run(torch.ones(1))
        assert compiling and value.item() == 2


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.inner(x))


def test_record_ops_attributes_ops_to_streams_lines_and_modules():
    model = nn.Sequential(nn.Linear(4, 4), _Block())
    with install() as rt:
        side = torch.npu.Stream()
        x = torch.randn(2, 4)
        with rt.record_ops() as ops:
            y = model(x)  # line_main
            with torch.npu.stream(side):
                z = y * 2  # line_side
        line_main = _line_of("y = model(x)  # line_main")
        line_side = _line_of("z = y * 2  # line_side")
    assert z.shape == y.shape
    assert all(isinstance(op, OpRecord) for op in ops)
    assert [op.stream for op in ops if op.line == line_side] == ["side:1"]
    assert ops[-1].name == "aten.mul.Tensor" and ops[-1].file == __file__ and ops[-1].module_path is None
    main_ops = [op for op in ops if op.stream == "main"]
    assert main_ops and all(op.file == __file__ for op in main_ops)
    relu = next(op for op in ops if op.name.startswith("aten.relu"))
    assert relu.module_path == "1" and relu.line == _line_of("return torch.relu(self.inner(x))")
    addmm = [op.module_path for op in ops if op.name.startswith("aten.addmm")]
    assert addmm == ["0", "1.inner"]
    assert {op.line for op in ops if op.module_path == "0"} == {line_main}


def _line_of(text: str) -> int:
    with open(__file__) as source:
        return next(number for number, line in enumerate(source, 1) if line.strip() == text)
