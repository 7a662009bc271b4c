"""What the emitted helpers need from each runtime: the torchair import and eager core budgets."""

from __future__ import annotations

import pytest
import torch

from conftest import load_file, load_regen
from msrewrite.emit.helpers import GUARDED_IMPORTS
from msrewrite.runtime import install

regen = load_regen()

# The guarded import msrewrite emitted before: it only catches ImportError.
OLD_TORCHAIR_IMPORT = '''\
try:
    import torch_npu  # noqa: F401  (torchair ships inside torch_npu and is registered by it)
    import torchair
except ImportError:  # no NPU stack: the side stream stays off
    torchair = None
'''
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


@pytest.mark.parametrize("example", regen.GOLDEN_EXAMPLES["moe-shared-expert"])
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

        old_form = (GUARDED_IMPORTS["torchair"], OLD_TORCHAIR_IMPORT)
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


def test_core_limit_caveats_are_printed_once_when_applying(tmp_path):
    from conftest import run_cli

    result = run_cli("apply", str(regen.ROOT / "examples" / "longcat_layer.py"), "--case", "attn-moe-limit-core",
                     "--mode", "eager")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("Ascend C ops only") == 1
    assert "allow_internal_format = False" in result.stderr and "hang" in result.stderr
