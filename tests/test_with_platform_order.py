"""Three shapes of serving code (issue 27, points 4, 6 and 7), each with a must-edit and a
must-refuse twin; the edits run through verify (slow).

- A join inside a `with` that is not the whole body (vLLM's `with sp_ctx:` holds the routed work
  and the first use of the shared output): a context manager that neither orders nor frees
  tensors (analyze/wrappers.py) takes the fork and join inside it; side work before a profiler
  range forks before it and joins inside. Any other context manager is refused naming it, and side
  work before a `no_grad`/autocast block is refused: it must keep running outside the mode.
- An overlap for another platform (`if _is_npu:` stream code) does not make the CUDA path
  "already overlapped"; the NPU branch is left as written. Tests msrewrite does not recognise
  as exclusive keep the refusal.
- Inside a fullgraph compile region the refusal is that alone: no `--assume-pure` to vouch for
  callees first, no command that would edit.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest

from helpers import main_in_process
from msrewrite.analyze.packages import module_platform_names
from msrewrite.analyze.platforms import other_platform_blocks
from msrewrite.commands.apply import case_steps
from msrewrite.errors import NothingToDo
from msrewrite.load import load
from msrewrite.plan import FlagSpec
from msrewrite.verify import verify_files

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
ADVERSARIAL = Path(__file__).parent / "adversarial"

HEAD = """\
import torch
from torch import nn


def is_npu():
    return False


def is_cuda():
    return True


_is_npu = is_npu()
_is_cuda = is_cuda()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)
        self.alt_stream = None

"""
MAKE = """

def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""


def write(tmp_path: Path, name: str, forward: str) -> Path:
    path = tmp_path / f"{name}.py"
    path.write_text(HEAD + forward + MAKE)
    return path


def edit(path: Path, mode: str = "eager"):
    src = load(path)
    return case_steps(path, src.text, src.module, "moe-shared-expert", mode, None, FLAG, None)[-1]


def refusal(path: Path, mode: str = "eager") -> str:
    with pytest.raises(NothingToDo) as refused:
        edit(path, mode)
    return str(refused.value)


def verify(tmp_path: Path, path: Path, text: str):
    edited = tmp_path / f"{path.stem}_ms.py"
    edited.write_text(text)
    return verify_files(edited, original=path)


def indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


# A join inside a `with` ----------------------------------------------------------------------

INSIDE = """\
    def forward(self, x):
        h = self.gate(x)
        with CONTEXT:
            s = self.shared_experts(x)
            y = self.experts(h)
            out = y + s
        return out
"""
BEFORE = """\
    def forward(self, x):
        s = self.shared_experts(x)
        with CONTEXT:
            h = self.gate(x)
            y = self.experts(h)
            out = y + s
        return out
"""
RANGE = 'torch.profiler.record_function("moe")'


@pytest.mark.parametrize("context", ["torch.no_grad()", 'torch.autocast("cpu", enabled=False)', RANGE])
def test_side_work_inside_a_with_after_main_work_forks_and_joins_inside_it(tmp_path, context):
    lines = edit(write(tmp_path, "inside", INSIDE.replace("CONTEXT", context))).new.splitlines()
    opened = lines.index(f"        with {context}:")
    assert lines[opened - 1] == "        h = self.gate(x)"  # main work before the `with` stays there
    fork = next(i for i, line in enumerate(lines) if "wait_stream(current_stream)" in line)
    join = next(i for i, line in enumerate(lines) if "current_stream.wait_stream(" in line)
    ret = lines.index("        return out")
    assert opened < fork < join < ret
    assert all(not line or indent_of(line) >= 12 for line in lines[opened + 1 : ret])


def test_side_work_before_a_profiler_range_forks_before_it_and_joins_inside(tmp_path):
    lines = edit(write(tmp_path, "before", BEFORE.replace("CONTEXT", RANGE))).new.splitlines()
    opened = lines.index(f"        with {RANGE}:")
    fork = next(i for i, line in enumerate(lines) if "wait_stream(current_stream)" in line)
    join = next(i for i, line in enumerate(lines) if "current_stream.wait_stream(" in line)
    assert fork < opened < join < lines.index("        return out")
    assert indent_of(lines[join]) == 16  # inside the `with`, under the stream test


@pytest.mark.parametrize("context", ["torch.no_grad()", 'torch.autocast("cpu", enabled=False)'])
def test_side_work_before_a_mode_context_is_not_moved_into_it(tmp_path, context):
    """The side work ran outside the grad/autocast mode: a join inside it is not made (verify's late
    schedule would run the side work inside the mode), so nothing overlaps."""
    why = refusal(write(tmp_path, "mode", BEFORE.replace("CONTEXT", context)))
    assert "nothing to overlap" in why, why


OPAQUE_CONTEXTS = ["sp_ctx", "self._sequence_parallel_context()", "torch.random.fork_rng()"]


@pytest.mark.parametrize("context", OPAQUE_CONTEXTS)
def test_side_work_inside_another_context_manager_is_refused_naming_it(tmp_path, context):
    forward = INSIDE.replace("CONTEXT", context).replace("def forward(self, x):", "def forward(self, x, sp_ctx=None):")
    why = refusal(write(tmp_path, "opaque", forward))
    assert f"the side call sits inside `with {context}:` (line 27), a context manager msrewrite cannot see" in why, why
    assert "--assume-pure" not in why


@pytest.mark.parametrize("context", OPAQUE_CONTEXTS)
def test_a_join_inside_another_context_manager_is_refused_naming_it(tmp_path, context):
    forward = BEFORE.replace("CONTEXT", context).replace("def forward(self, x):", "def forward(self, x, sp_ctx=None):")
    why = refusal(write(tmp_path, "opaque", forward))
    assert f"the join falls inside `with {context}:` (line 27), a context manager msrewrite cannot see" in why, why


@pytest.mark.slow  # runs verify
@pytest.mark.parametrize(
    "name, forward",
    [
        ("inside_no_grad", INSIDE.replace("CONTEXT", "torch.no_grad()")),
        ("inside_autocast", INSIDE.replace("CONTEXT", 'torch.autocast("cpu", dtype=torch.bfloat16)')),
        ("before_range", BEFORE.replace("CONTEXT", RANGE)),
    ],
)
def test_joins_inside_a_with_verify_clean(tmp_path, name, forward):
    path = write(tmp_path, name, forward)
    result = verify(tmp_path, path, edit(path).new)
    assert result.ok and not result.findings, result.problems
    assert result.schedules == ["early", "late", "interleaved"]


# An overlap for another platform ---------------------------------------------------------------

NPU_OVERLAP = """\
    def forward(self, x):
        if TEST:
            current = torch.npu.current_stream()
            self.alt_stream.wait_stream(current)
            with torch.npu.stream(self.alt_stream):
                s = self.shared_experts(x)
            y = self.experts(self.gate(x))
            current.wait_stream(self.alt_stream)
            return y + s
        s = self.shared_experts(x)
        y = self.experts(self.gate(x))
        return y + s
"""
NPU_TESTS = ["_is_npu", "is_npu()", "_is_npu and x.shape[0] > 1"]


@pytest.mark.parametrize("test", NPU_TESTS)
def test_an_npu_overlap_does_not_block_the_cuda_path(tmp_path, test):
    path = write(tmp_path, "npu_overlap", NPU_OVERLAP.replace("TEST", test))
    new = edit(path, "cuda").new
    assert "with torch.cuda.stream(shared_expert_stream):" in new
    npu_branch = NPU_OVERLAP.replace("TEST", test).split("        s = self.shared_experts(x)\n        y")[0]
    assert npu_branch in new  # the NPU branch as written
    why = refusal(path, "eager")  # on the NPU path it is the overlap
    assert "already overlapped" in why, why


@pytest.mark.parametrize("test", ["self.dual_stream", "not _is_cuda", "_is_npu or x.shape[0] > 1"])
def test_a_test_that_is_not_exclusive_keeps_already_overlapped(tmp_path, test):
    """A flag, `not is_cuda()` (true on ROCm, where torch.cuda streams run too), an `or`."""
    why = refusal(write(tmp_path, "flag_overlap", NPU_OVERLAP.replace("TEST", test)), "cuda")
    assert "already overlapped" in why, why


def test_a_cuda_overlap_does_not_block_the_npu_path(tmp_path):
    forward = NPU_OVERLAP.replace("TEST", "_is_cuda").replace("torch.npu.", "torch.cuda.")
    new = edit(write(tmp_path, "cuda_overlap", forward), "eager").new
    assert "with torch.npu.stream(shared_expert_stream):" in new


HANDED = """\
    def forward(self, x):
        s = self.shared_experts(x)
        y = self.run_experts(self.gate(x), alt_stream=STREAM)
        return y + s

    def run_experts(self, h, alt_stream=None):
        return self.experts(h)
"""


def test_a_stream_handed_to_a_callee_is_already_overlapped(tmp_path):
    """SGLang's `execute_sbo(..., alt_stream=self.alt_stream)`: the callee overlaps on it."""
    why = refusal(write(tmp_path, "handed", HANDED.replace("STREAM", "self.alt_stream")), "cuda")
    assert "hands a stream to `self.run_experts` (`alt_stream=`)" in why, why
    new = edit(write(tmp_path, "handed_none", HANDED.replace("STREAM", "None")), "cuda").new
    assert "with torch.cuda.stream(shared_expert_stream):" in new  # `alt_stream=None` hands none


def test_platform_blocks():
    module = cst.parse_module(
        HEAD
        + """\
    def forward(self, x, n):
        flag = _is_npu and n > 1
        again = _is_npu
        again = False
        if flag:
            a = 1
        if again:
            b = 1
        if current_platform.is_npu():
            c = 1
        if not _is_npu:
            d = 1
        else:
            e = 1
"""
    )
    names = module_platform_names(module.code)
    assert names == {"_is_npu": "npu", "_is_cuda": "cuda"}
    cls = next(s for s in module.body if isinstance(s, cst.ClassDef))
    func = cls.body.body[-1]
    assert isinstance(func, cst.FunctionDef)

    def bound(mode: str) -> list[str]:
        blocks = other_platform_blocks(func, mode, names)
        return sorted(cst.Module([]).code_for_node(b).strip() for b in blocks)

    assert bound("cuda") == ["a = 1", "c = 1", "e = 1"]  # `again` is bound twice: not a test
    assert bound("eager") == ["d = 1"]


@pytest.mark.slow  # runs verify
def test_the_cuda_edit_next_to_an_npu_overlap_verifies_clean(tmp_path):
    path = write(tmp_path, "npu_overlap", NPU_OVERLAP.replace("TEST", "_is_npu"))
    result = verify(tmp_path, path, edit(path, "cuda").new)
    assert result.ok and not result.findings, result.problems


# Refusal order -------------------------------------------------------------------------------

OPAQUE_SIDE = """\
import torch
from torch import nn


def _opaque(name):
    # built at run time: msrewrite cannot read its source (like a kernel library's layer)
    return type(name, (nn.Module,), {"forward": lambda self, x: x * 3.0})


SideAct = _opaque("SideAct")


def support_torch_compile(cls):
    return cls  # vLLM's decorator compiles cls.forward as one graph


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.act = SideAct()
        self.proj = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.proj(self.act(x))


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.shared_experts = MLP(d)
        self.experts = nn.Linear(d, d, bias=False)

    def forward(self, x):
        shared = self.shared_experts(x)
        y = self.experts(x)
        return y + shared


@support_torch_compile
class Model(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.block = Block(d)

    def forward(self, x):
        return self.block(x)


def make():
    torch.manual_seed(0)
    return Model().eval(), (torch.randn(8, 16),)
"""


def apply_error(path: Path, *options: str) -> str:
    result = main_in_process("apply", "--case", "moe-shared-expert", "--mode", "eager", str(path), *options)
    assert result.returncode == 1 and not result.stdout, result.stderr
    (error,) = [line for line in result.stderr.splitlines() if line.startswith("msrewrite: error: ")]
    return error


def test_a_compiled_region_is_refused_first_and_alone(tmp_path):
    path = tmp_path / "compiled.py"
    path.write_text(OPAQUE_SIDE)
    error = apply_error(path)
    assert error.endswith(
        "Block.forward: Block.forward runs inside a torch.compile fullgraph region (vLLM's @support_torch_compile "
        "on Model, which builds Block): stream code there would be traced into the graph; vLLM keeps its own "
        "stream code inside a custom op"
    ), error
    assert "--assume-pure" not in error and "this command edits" not in error and "SideAct" not in error


def test_outside_the_compiled_region_the_callee_is_asked_for(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(OPAQUE_SIDE.replace("@support_torch_compile\n", ""))
    error = apply_error(path)
    assert "pass --assume-pure SideAct if it does not" in error and "this command edits" in error, error


@pytest.mark.slow  # runs verify
def test_outside_the_compiled_region_the_vouched_edit_verifies(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text(OPAQUE_SIDE.replace("@support_torch_compile\n", ""))
    src = load(path)
    step = case_steps(
        path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None, assume_pure=("SideAct",)
    )[-1]
    result = verify(tmp_path, path, step.new)
    assert result.ok and not result.findings, result.problems


def test_a_context_manager_no_option_lifts_is_refused_alone(tmp_path):
    """The shared expert's SideAct may write x (an --assume-pure refusal), but the side work sits
    inside `with sp_ctx:` with the routed work: that alone is named, with no callee to vouch for."""
    path = tmp_path / "opaque_with.py"
    path.write_text(
        OPAQUE_SIDE.replace("@support_torch_compile\n", "").replace(
            """    def forward(self, x):
        shared = self.shared_experts(x)
        y = self.experts(x)
        return y + shared
""",
            """    def forward(self, x, sp_ctx=None):
        h = self.experts(x)
        with sp_ctx:
            shared = self.shared_experts(x)
            y = self.experts(h)
            out = y + shared
        return out
""",
        )
    )
    error = apply_error(path)
    assert error.endswith(
        "Block.forward: the side call sits inside `with sp_ctx:` (line 35), a context manager msrewrite cannot see "
        "through: its enter or exit may order streams or free tensors, so the side work is not moved out of it nor a "
        "fork and join into it"
    ), error
