"""What the emitted helpers need from each runtime: the torchair import and eager core budgets."""

from __future__ import annotations

import pytest
import torch

from helpers import load_file, load_regen
from msrewrite.emit.helpers import GUARDED_IMPORTS
from msrewrite.runtime import install

regen = load_regen()

# The guarded import msrewrite emitted before: it only catches ImportError.
OLD_TORCHAIR_IMPORT = """\
try:
    import torch_npu  # noqa: F401  (torchair ships inside torch_npu and is registered by it)
    import torchair
except ImportError:  # no NPU stack: the side stream stays off
    torchair = None
"""
INIT_ERROR = RuntimeError("torchair: libge_runner.so: cannot open shared object file")


def _golden_module(tmp_path, case, mode, example, replace=None):
    golden, _ = regen.golden_paths(case, mode, example)
    text = golden.read_text()
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    path = tmp_path / f"{example}.py"
    path.write_text(text)
    return load_file(path, f"golden_{example}_{mode.replace('-', '_')}")


def test_stand_in_models_a_torchair_that_fails_to_initialise_lazily():
    with install(torchair_init_error=INIT_ERROR):
        import torchair  # the proxy imports fine, as torch_npu's does

        with pytest.raises(RuntimeError, match="libge_runner"):
            torchair.scope  # noqa: B018
        with pytest.raises(ImportError):
            import torchair.scope  # noqa: F401
        old, new = {}, {}
        exec(OLD_TORCHAIR_IMPORT, old)
        exec(GUARDED_IMPORTS["torchair"], new)
    assert old["torchair"] is not None  # the old form keeps the broken proxy
    assert new["torchair"] is None
    with install():
        new = {}
        exec(GUARDED_IMPORTS["torchair"], new)
        assert new["torchair"] is not None  # a working torchair is kept


@pytest.mark.slow  # runs the golden models
@pytest.mark.parametrize("example", regen.golden_examples()["moe-shared-expert"])
def test_ge_golden_falls_back_when_torchair_fails_to_initialise(tmp_path, example):
    """The old import lets the error surface inside forward; the emitted one runs the original path."""
    model_file = regen.ROOT / "examples" / f"{example}.py"
    original = load_file(model_file, f"original_{example}")
    model, inputs = original.make()
    expected = model(*inputs)
    with install(torchair_init_error=INIT_ERROR):
        edited = _golden_module(tmp_path, "moe-shared-expert", "ge-graph", example)
        assert edited.torchair is None
        edited_model, _ = edited.make()
        torch.testing.assert_close(edited_model(*inputs), expected, rtol=0, atol=0)

        emitted_try = GUARDED_IMPORTS["torchair"].split("\n\n")[0] + "\n"  # the try/except block
        old_form = (emitted_try, OLD_TORCHAIR_IMPORT)
        broken = _golden_module(tmp_path, "moe-shared-expert", "ge-graph", example, replace=old_form)
        broken_model, _ = broken.make()
        with pytest.raises(RuntimeError, match="libge_runner"):
            broken_model(*inputs)


def test_eager_core_limits_restore_the_main_stream_limit_and_set_the_side_once(tmp_path):
    """A limit the main stream already had comes back after the window; the side's is set once."""
    with install() as rt:
        edited = _golden_module(tmp_path, "attn-moe-limit-core", "eager", "longcat_layer")
        model, inputs = edited.make()
        main = torch.npu.current_stream()
        torch.npu.set_stream_limit(main, 20, 40)  # e.g. the serving framework's own budget
        seen = []
        real_set = torch.npu.set_stream_limit

        def spy(stream, cube_num=-1, vector_num=-1):
            seen.append((stream.name, cube_num, vector_num))
            real_set(stream, cube_num, vector_num)

        torch.npu.set_stream_limit = spy
        try:
            for _ in range(3):
                model(*inputs)
        finally:
            torch.npu.set_stream_limit = real_set
        side = edited._MS_SIDE_STREAMS["moe_shortcut"]
        assert torch.npu.get_stream_limit(main) == {"cube_core_num": 20, "vector_core_num": 40}
        assert torch.npu.get_stream_limit(side) == {"cube_core_num": 8, "vector_core_num": 16}
        side_sets = [s for s in seen if s[0] == side.name]
        assert side_sets == [(side.name, 8, 16)]  # once, when the stream was made
        assert seen.count(("main", 16, 32)) == 3 and seen.count(("main", 20, 40)) == 3
        assert rt.core_limits[main.stream_id] == {"cube_core_num": 20, "vector_core_num": 40}


@pytest.mark.slow  # runs the golden models
@pytest.mark.parametrize("mode", regen.golden_modes("attn-moe-limit-core"))
def test_every_core_limit_golden_leaves_a_pre_set_main_limit_as_it_was(tmp_path, mode):
    """issue 13's done-when, for each core-limit golden run eagerly under the stand-ins: eager saves
    and restores the main stream's limit, npugraph-ex's limit_core_num scope restores it on exit,
    ge-graph's torchair scope touches no stream limit outside a GE graph."""
    with install():
        edited = _golden_module(tmp_path, "attn-moe-limit-core", mode, "longcat_layer")
        model, inputs = edited.make()
        main = torch.npu.current_stream()
        torch.npu.set_stream_limit(main, 20, 40)
        for _ in range(2):
            model(*inputs)
        assert torch.npu.get_stream_limit(main) == {"cube_core_num": 20, "vector_core_num": 40}


def test_core_limit_caveats_are_printed_once_when_applying():
    from helpers import run_main

    result = run_main(
        "apply", str(regen.ROOT / "examples" / "longcat_layer.py"), "--case", "attn-moe-limit-core", "--mode", "eager"
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("Ascend C ops only") == 1
    assert "allow_internal_format = False" in result.stderr and "hang" in result.stderr


# --- torchair compile modes: the side stream and its gates follow GE graph mode -------------------
COMPILE_MODES = {  # name -> (CompilerConfig.mode, debug.run_eagerly)
    "max-autotune": ("max-autotune", False),
    "reduce-overhead": ("reduce-overhead", False),
    "npugraph_ex": ("npugraph_ex", False),
    "run_eagerly": ("max-autotune", True),
}
GE_GOLDENS = [
    (case, example)
    for case, examples in regen.golden_examples().items()
    if "ge-graph" in regen.golden_modes(case)
    for example in examples
]
OLD_WAIT_GATE = (
    "if torchair is None or not (_MS_GE_GRAPH and torch.compiler.is_compiling()):",
    "if torchair is None or not torch.compiler.is_compiling():",
)
OLD_STREAMS_GATE = ("return _MS_GE_GRAPH or not torch.compiler.is_compiling()", "return True")


def _config(torchair, compile_mode):
    config = torchair.CompilerConfig()
    config.mode, config.debug.run_eagerly = COMPILE_MODES[compile_mode]
    return config


def _compiled_run(tmp_path, case, example, compile_mode, replace=(), record=True):
    """Run the ge-graph golden through the stand-in torchair backend built for `compile_mode`,
    under the sanitizer; returns (output, findings, streams the model's ops ran on)."""
    from msrewrite.sanitizer import Sanitizer

    original = load_file(regen.ROOT / "examples" / f"{example}.py", f"original_{example}")
    model, inputs = original.make()
    with torch.no_grad():
        expected = model(*inputs)
    with install() as rt:
        golden, _ = regen.golden_paths(case, "ge-graph", example)
        text = golden.read_text()
        for old, new in replace:
            assert old in text
            text = text.replace(old, new)
        path = tmp_path / f"{example}.py"
        path.write_text(text)
        edited = load_file(path, f"ge_{example}_{compile_mode.replace('-', '_')}")
        import torchair

        config = _config(torchair, compile_mode)
        backend = torchair.get_npu_backend(compiler_config=edited._ms_torchair_config(config) if record else config)
        edited_model, _ = edited.make()
        run = backend(edited_model, list(inputs))
        with torch.no_grad(), Sanitizer(rt, user_files=[path]) as san, rt.record_ops() as ops:
            out = run(*inputs)
            if compile_mode != "max-autotune":  # GE joins every stream at the output, plans memory itself
                san.check_output(out)
    return expected, out, san.findings, {op.stream for op in ops}


def test_stand_in_backend_follows_the_compiler_config_mode():
    with install() as rt:
        import torchair

        seen = {}
        for name in COMPILE_MODES:
            backend = torchair.get_npu_backend(compiler_config=_config(torchair, name))

            def probe(x):
                wait_ok = True
                try:
                    torchair.scope.npu_wait_tensor(x, x)
                except NotImplementedError:
                    wait_ok = False
                with torchair.scope.npu_stream_switch("probe", 0):
                    stream = rt.current_stream().name
                return torch.compiler.is_compiling(), rt.in_graph_mode, wait_ok, stream

            seen[name] = backend(probe, [])(torch.ones(1))
        config = torchair.CompilerConfig()
        config.mode = "default"
        with pytest.raises(ValueError):
            torchair.get_npu_backend(compiler_config=config)
    assert seen == {
        "max-autotune": (True, True, True, "tag:probe"),
        "reduce-overhead": (True, False, False, "tag:probe"),  # a real stream per tag, no GE ops
        "npugraph_ex": (True, False, False, "tag:probe"),
        "run_eagerly": (True, False, False, "main"),  # eager kernels: the switch does nothing
    }


@pytest.mark.slow  # runs the golden models under torch.compile
@pytest.mark.parametrize("compile_mode", COMPILE_MODES)
@pytest.mark.parametrize("case,example", GE_GOLDENS)
def test_ge_golden_raises_nothing_under_each_compile_mode(tmp_path, case, example, compile_mode):
    """With the backend's config recorded, each ge-graph golden is exact and clean in every torchair
    mode, and uses its side stream only in GE graph mode."""
    expected, out, findings, streams = _compiled_run(tmp_path, case, example, compile_mode)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not findings, findings
    side = {s for s in streams if s.startswith("tag:")}
    assert bool(side) == (compile_mode == "max-autotune"), streams


@pytest.mark.slow  # runs the compiled models
@pytest.mark.parametrize("compile_mode", ["reduce-overhead", "npugraph_ex", "run_eagerly"])
@pytest.mark.parametrize("example", regen.golden_examples()["moe-shared-expert-phased"])
def test_old_wait_tensor_gate_is_caught(tmp_path, example, compile_mode):
    """Gated on is_compiling() alone, npu_wait_tensor is reached outside GE graph mode and raises."""
    mutant = [OLD_WAIT_GATE, OLD_STREAMS_GATE]
    with pytest.raises(NotImplementedError, match="wait_tensor"):
        _compiled_run(tmp_path, "moe-shared-expert-phased", example, compile_mode, replace=mutant)


@pytest.mark.parametrize("example", regen.golden_examples()["moe-shared-expert"])
def test_side_stream_left_on_under_reduce_overhead_races(tmp_path, example):
    """Why the side stream follows the recorded mode too: reduce-overhead gives each tag a real
    stream and joins it only at the graph's output, so the side result's consumer races."""
    _, _, findings, streams = _compiled_run(
        tmp_path, "moe-shared-expert", example, "reduce-overhead", replace=[OLD_STREAMS_GATE]
    )
    assert any(s.startswith("tag:") for s in streams)
    assert any(f.kind.startswith("race-") for f in findings), findings


# --- mode detection from the torchair CompilerConfig the file builds ------------------------------
VLLM_ASCEND_STYLE = """

def build_decode_backend():
    import torchair  # inside: torchair comes with torch_npu
    from torchair import CompilerConfig

    config = CompilerConfig()
    config.mode = "reduce-overhead"
    return torchair.get_npu_backend(compiler_config=config)
"""


def _with_config(body: str) -> str:
    base = (regen.ROOT / "examples" / "deepseek_moe.py").read_text()
    return base + body


@pytest.mark.parametrize(
    "body,mode",
    [
        (VLLM_ASCEND_STYLE, "npugraph-ex"),
        (VLLM_ASCEND_STYLE.replace("reduce-overhead", "npugraph_ex"), "npugraph-ex"),
        (VLLM_ASCEND_STYLE.replace("reduce-overhead", "max-autotune"), "ge-graph"),
        (VLLM_ASCEND_STYLE.replace('    config.mode = "reduce-overhead"\n', ""), "ge-graph"),  # the default
    ],
)
def test_mode_follows_the_compiler_config_mode(body, mode):
    from msrewrite.modes import detect_mode

    found, why = detect_mode(_with_config(body))
    assert found == mode, why
    assert "CompilerConfig" in why


@pytest.mark.parametrize(
    "body,match",
    [
        (VLLM_ASCEND_STYLE.replace('"reduce-overhead"', "graph_mode"), "config.mode = graph_mode"),
        (
            VLLM_ASCEND_STYLE.replace(
                'config.mode = "reduce-overhead"', 'config.mode = "reduce-overhead"\n    config.mode = "max-autotune"'
            ),
            "no edit is right in both",
        ),
    ],
)
def test_mode_that_cannot_be_told_asks_for_mode(tmp_path, body, match):
    from helpers import run_main

    model = tmp_path / "model.py"
    model.write_text(_with_config(body))
    result = run_main("apply", "--case", "moe-shared-expert", str(model))
    assert result.returncode != 0
    assert result.stderr.startswith("msrewrite: error: cannot tell torchair's graph mode") and match in result.stderr
    assert "--mode" in result.stderr
    assert model.read_text() == _with_config(body)
    given = run_main("apply", "--case", "moe-shared-expert", "--mode", "npugraph-ex", str(model))
    assert given.returncode == 0, given.stderr


@pytest.mark.slow  # starts a process or runs verify
def test_vllm_ascend_style_reduce_overhead_file_gets_npugraph_ex_and_verifies(tmp_path):
    """config.mode = "reduce-overhead" gets native streams and events, proven by verify, and exact and
    clean when run through the stand-in backend with reduce-overhead semantics."""
    from helpers import run_main
    from msrewrite.sanitizer import Sanitizer

    model_file = tmp_path / "deepseek_moe.py"
    model_file.write_text(_with_config(VLLM_ASCEND_STYLE))
    result = run_main("apply", "--case", "moe-shared-expert", "--verify", "-i", str(model_file))
    assert result.returncode == 0, result.stderr
    assert "mode npugraph-ex (auto: torchair CompilerConfig mode 'reduce-overhead'" in result.stderr
    text = model_file.read_text()
    assert "torch.npu.stream(" in text and "npu_stream_switch" not in text
    original = load_file(regen.ROOT / "examples" / "deepseek_moe.py", "original_deepseek_moe_ro")
    model, inputs = original.make()
    with torch.no_grad():
        expected = model(*inputs)
    with install() as rt:
        edited = load_file(model_file, "vllm_ascend_style_deepseek_moe")
        edited_model, _ = edited.make()
        run = edited.build_decode_backend()(edited_model, list(inputs))
        with torch.no_grad(), Sanitizer(rt, user_files=[model_file]) as san, rt.record_ops() as ops:
            out = run(*inputs)
            san.check_output(out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not san.findings, san.findings
    assert {op.stream for op in ops} >= {"main", "side:1"}


def test_ge_graph_file_records_its_backend_config(tmp_path):
    """A file that builds its GE backend hands the config to _ms_torchair_config, once."""
    from helpers import run_main

    model_file = tmp_path / "deepseek_moe.py"
    model_file.write_text(_with_config(VLLM_ASCEND_STYLE.replace("reduce-overhead", "max-autotune")))
    result = run_main("apply", "--case", "moe-shared-expert", "-i", str(model_file))
    assert result.returncode == 0, result.stderr
    text = model_file.read_text()
    assert text.count("return torchair.get_npu_backend(compiler_config=_ms_torchair_config(config))") == 1
    assert "does not build torchair's backend" not in result.stderr
    again = run_main("apply", "--case", "moe-shared-expert", "-i", str(model_file))
    assert again.returncode != 0 and model_file.read_text() == text  # already applied: nothing changes
    plain = tmp_path / "plain.py"
    plain.write_text((regen.ROOT / "examples" / "deepseek_moe.py").read_text())
    told = run_main("apply", "--case", "moe-shared-expert", "--mode", "ge-graph", str(plain))
    assert told.returncode == 0 and "does not build torchair's backend" in told.stderr


# --- npugraph-ex lifetimes on torch_npu 2.10 and 2.14 ---------------------------------------------
NO_CAPTURE_GATE = ("_ms_capture_safe(self.shared_expert_stream)", "self.shared_expert_stream")


def _npugraph_ex_compiled_run(tmp_path, example, torch_npu_version, replace=None):
    """The npugraph-ex golden inside a compiled graph (aclgraph semantics) under the sanitizer."""
    from msrewrite.sanitizer import Sanitizer

    golden, _ = regen.golden_paths("moe-shared-expert", "npugraph-ex", example)
    text = golden.read_text()
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    path = tmp_path / f"{example}_{torch_npu_version.replace('.', '_')}.py"
    path.write_text(text)
    original = load_file(regen.ROOT / "examples" / f"{example}.py", f"original_{example}")
    model, inputs = original.make()
    with torch.no_grad():
        expected = model(*inputs)
    with install(torch_npu_version=torch_npu_version) as rt:
        edited = load_file(path, f"edited_{path.stem}").make()[0]
        edited.load_state_dict(model.state_dict())
        sanitizer = Sanitizer(rt, user_files=[str(path)])
        with torch.no_grad(), rt.aclgraph_mode(), sanitizer, rt.record_ops() as ops:
            out = edited(*inputs)
    return expected, out, sanitizer.findings, {op.stream for op in ops}


@pytest.mark.slow  # runs the compiled models
@pytest.mark.parametrize("version", ["2.14", "2.10"])
@pytest.mark.parametrize("example", regen.golden_examples()["moe-shared-expert"])
def test_npugraph_ex_side_stream_only_where_record_stream_reaches_it(tmp_path, example, version):
    """torch_npu 2.14 lowers record_stream in a compiled graph by stream id: the side stream runs.
    2.10 lowers it by FX node name (a stream of its own): the side stream stays off there."""
    expected, out, findings, streams = _npugraph_ex_compiled_run(tmp_path, example, version)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not findings, findings
    assert (streams != {"main"}) == (version == "2.14"), streams


# inplace_moe's side buffers outlive the graph (its input and its returned output): nothing to free early
@pytest.mark.parametrize("example", ["deepseek_moe", "guarded_moe", "qwen_gated_moe"])
def test_npugraph_ex_without_the_capture_gate_loses_lifetimes_on_2_10(tmp_path, example):
    """The mutant without _ms_capture_safe: on 2.10 record_stream lands on another stream and the
    sanitizer reports the unprotected free."""
    _, _, findings, streams = _npugraph_ex_compiled_run(tmp_path, example, "2.10", replace=NO_CAPTURE_GATE)
    assert streams != {"main"}
    assert any(f.kind == "lifetime" for f in findings), findings


def test_tagged_events_must_come_from_npu_create_tagged_event():
    with install():
        from torchair import ops as tops

        made = tops.npu_create_tagged_event("made")
        tops.npu_tagged_event_record(made)
        tops.npu_tagged_event_wait(made)
        plain = torch.npu.Event()
        for call in (tops.npu_tagged_event_record, tops.npu_tagged_event_wait):
            with pytest.raises(ValueError, match="is not in use"):
                call(plain)


# --- verify runs each edit under the compiled graphs its helpers claim to handle ---------------------
BLOCK = """
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Linear(16, 16)
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.gate(x)
        return h + s


def make():
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
"""
# audit B's n06: _ms_capture_safe without its torch_npu 2.10 guard (the side stream kept where
# record_stream lands on a stream of its own); g02: _ms_torchair_config without its mode check
# (the side stream kept under reduce-overhead / npugraph_ex, where nothing joins a tag's stream)
NO_2_10_GUARD = (
    '    if stream is not None and torch.compiler.is_compiling() and hasattr(torch.npu, "fake_record_stream"):\n'
    "        return None\n",
    "",
)
NO_CONFIG_CHECK = ('_MS_GE_GRAPH = mode == "max-autotune" and not run_eagerly', "_MS_GE_GRAPH = True")
NPUGRAPH_EX_RUNS = ["flag on, npugraph_ex capture (torch_npu 2.14)", "flag on, npugraph_ex capture (torch_npu 2.10)"]
TORCHAIR_RUNS = ["flag on, torchair reduce-overhead", "flag on, torchair npugraph_ex", "flag on, torchair run_eagerly"]


@pytest.fixture(scope="module")
def block(tmp_path_factory):
    """The small block and its npugraph-ex and ge-graph edits, as apply makes them."""
    from msrewrite.commands.apply import case_steps
    from msrewrite.load import load
    from msrewrite.plan import FlagSpec

    folder = tmp_path_factory.mktemp("compiled")
    original = folder / "block.py"
    original.write_text(BLOCK)
    src = load(original)
    flag = FlagSpec(name="ENABLE_MOE_SHARED_EXPERT_STREAM")
    edits = {
        mode: case_steps(original, src.text, src.module, "moe-shared-expert", mode, None, flag, None)[-1].new
        for mode in ("npugraph-ex", "ge-graph")
    }
    return original, edits


def _verify_block(tmp_path, block, mode, replace=None):
    from msrewrite.verify import verify_files

    original, edits = block
    text = edits[mode]
    if replace:
        assert replace[0] in text
        text = text.replace(*replace)
    edited = tmp_path / "block_ms.py"
    edited.write_text(text)
    return verify_files(edited, original=original, inputs=0, train=False, schedules=("early",))


def _streams(result, name):
    return next(r.streams for r in result.runs if r.name == name)


@pytest.mark.slow  # runs verify
def test_verify_runs_npugraph_ex_edits_captured_on_both_torch_npu_lowerings(tmp_path, block):
    """Captured on 2.14 the side stream runs; on 2.10 the original path does. Each run is in the
    summary and the JSON, compared with the original."""
    import json

    from msrewrite.verify import summary

    result = _verify_block(tmp_path, block, "npugraph-ex")
    assert result.ok, result.problems
    names = [r.name for r in result.runs]
    assert set(NPUGRAPH_EX_RUNS) <= set(names), names
    assert not any(name.endswith(tuple(NPUGRAPH_EX_RUNS)) for name in names if ": " in name)  # default run only
    assert set(_streams(result, NPUGRAPH_EX_RUNS[0])) == {"main", "side:1"}
    assert set(_streams(result, NPUGRAPH_EX_RUNS[1])) == {"main"}
    lines = summary(result)
    assert all(any(line.startswith(f"{name}: 1 output tensor(s)") for line in lines) for name in NPUGRAPH_EX_RUNS)
    assert f"= {NPUGRAPH_EX_RUNS[1]});" in lines[-1]
    assert set(NPUGRAPH_EX_RUNS) <= json.loads(result.to_json())["runs"].keys()


@pytest.mark.slow  # runs verify
def test_npugraph_ex_edit_without_its_2_10_guard_fails_verify(tmp_path, block):
    """n06: eagerly and on 2.14 the edit is clean; captured on 2.10 its record_stream(main) reaches
    another stream, and the side output is freed unprotected."""
    result = _verify_block(tmp_path, block, "npugraph-ex", replace=NO_2_10_GUARD)
    assert not result.ok
    assert result.findings and all(f.kind == "lifetime" for f in result.findings), result.problems
    assert all(f.message.startswith("under npugraph_ex capture (torch_npu 2.10): ") for f in result.findings)
    assert any(
        p.startswith("sanitizer: [lifetime] under npugraph_ex capture (torch_npu 2.10): ") for p in result.problems
    )
    assert set(_streams(result, NPUGRAPH_EX_RUNS[1])) == {"main", "side:1"}


@pytest.mark.slow  # runs verify
def test_verify_runs_ge_graph_edits_under_each_torchair_config_through_their_hook(tmp_path, block):
    """reduce-overhead, npugraph_ex and run_eagerly configs go through _ms_torchair_config, which
    keeps the original path there: every op on main, outputs equal."""
    result = _verify_block(tmp_path, block, "ge-graph")
    assert result.ok, result.problems
    for name in TORCHAIR_RUNS:
        assert set(_streams(result, name)) == {"main"}, name
    assert set(_streams(result, "flag on")) == {"main", "tag:shared_expert"}


@pytest.mark.slow  # runs verify
def test_ge_graph_edit_without_its_config_check_fails_verify(tmp_path, block):
    """g02: under reduce-overhead (and npugraph_ex) the tag's stream is real and never joined: the
    add reads the side output unordered."""
    result = _verify_block(tmp_path, block, "ge-graph", replace=NO_CONFIG_CHECK)
    assert not result.ok
    races = [f for f in result.findings if f.kind == "race-raw"]
    assert races and all(f.message.startswith("under torchair reduce-overhead: ") for f in result.findings), [
        f.message for f in result.findings
    ]
    for name in TORCHAIR_RUNS[:2]:
        assert "tag:shared_expert" in _streams(result, name)
    assert set(_streams(result, TORCHAIR_RUNS[2])) == {"main"}  # run_eagerly: the switch is a no-op


@pytest.mark.slow  # runs verify
def test_npugraph_ex_edit_that_drops_its_side_stream_on_2_14_too_is_reported(tmp_path, block):
    """The guard without its 2.10 probe keeps every compiled graph single-stream: no race, but not
    the edit's claim (torch_npu 2.14 lowers record_stream by stream id and keeps the side stream)."""
    everywhere = (' and hasattr(torch.npu, "fake_record_stream"):', ":")
    result = _verify_block(tmp_path, block, "npugraph-ex", replace=everywhere)
    assert result.problems == [f"{NPUGRAPH_EX_RUNS[0]}: no op ran on a side stream (is the flag wired?)"]
