"""The model harness: tiny transformers configs, user harnesses, rebuild from a rewritten copy."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # builds real transformers modules

pytest.importorskip("transformers")
import transformers.models as hf_models  # noqa: E402

from msrewrite.errors import BadInput  # noqa: E402
from msrewrite.harness import build_harness, load_module, package_of  # noqa: E402

MODELS = Path(hf_models.__file__).parent
DEEPSEEK = MODELS / "deepseek_v3" / "modeling_deepseek_v3.py"

BUILDS = [
    ("deepseek_v3/modeling_deepseek_v3.py", "DeepseekV3MoE"),
    ("qwen3_next/modeling_qwen3_next.py", "Qwen3NextSparseMoeBlock"),
    ("hunyuan_v1_moe/modeling_hunyuan_v1_moe.py", "HunYuanMoEV1Moe"),
    ("deepseek_v3/modeling_deepseek_v3.py", "DeepseekV3DecoderLayer"),
    ("qwen3_next/modeling_qwen3_next.py", "Qwen3NextDecoderLayer"),
    ("longcat_flash/modeling_longcat_flash.py", "LongcatFlashDecoderLayer"),
    ("hunyuan_v1_moe/modeling_hunyuan_v1_moe.py", "HunYuanMoEV1DecoderLayer"),
]


@pytest.mark.parametrize("file,target", BUILDS, ids=[t for _, t in BUILDS])
def test_tiny_transformers_module_builds_and_runs(file: str, target: str) -> None:
    harness = build_harness(MODELS / file, target=target)
    assert harness.target == target and harness.source == "transformers"
    assert not harness.module.training
    out = harness.run()
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape == (1, 8, 64) and out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_decoder_layers_are_moe_layers() -> None:
    ds = build_harness(DEEPSEEK, target="DeepseekV3DecoderLayer")
    assert type(ds.module.mlp).__name__ == "DeepseekV3MoE"
    qwen = build_harness(MODELS / "qwen3_next" / "modeling_qwen3_next.py", target="Qwen3NextDecoderLayer")
    assert type(qwen.module.mlp).__name__ == "Qwen3NextSparseMoeBlock" and hasattr(qwen.module, "self_attn")


def test_default_target_is_the_decoder_layer() -> None:
    assert build_harness(DEEPSEEK).target == "DeepseekV3DecoderLayer"


def test_rebuild_from_a_copied_file_gives_identical_outputs(tmp_path: Path) -> None:
    harness = build_harness(DEEPSEEK, target="DeepseekV3DecoderLayer")
    copy = tmp_path / "modeling_deepseek_v3_rewritten.py"
    shutil.copy(DEEPSEEK, copy)
    other = load_module(copy, package="transformers.models.deepseek_v3")
    assert other.__file__ == str(copy)
    twin = harness.rebuild_from(other)
    assert type(twin.module) is not type(harness.module)
    assert torch.equal(harness.run(), twin.run())


def test_user_harness_records_constructor_arguments(tmp_path: Path) -> None:
    (tmp_path / "tinynet.py").write_text(
        "import torch\n"
        "class Net(torch.nn.Module):\n"
        "    def __init__(self, width, *, depth=1):\n"
        "        super().__init__()\n"
        "        self.a = torch.nn.Linear(width, width)\n"
        "        self.b = torch.nn.Linear(width, width)\n"
        "    def forward(self, x):\n"
        "        return self.a(x) + self.b(x)\n"
    )
    (tmp_path / "h.py").write_text(
        "import torch\nfrom tinynet import Net\ndef make():\n    return Net(6, depth=2), (torch.randn(2, 6),)\n"
    )
    harness = build_harness(tmp_path / "tinynet.py", harness=f"{tmp_path / 'h.py'}:make")
    assert harness.target == "Net" and harness.init_args == (6,) and harness.init_kwargs == {"depth": 2}
    copy = tmp_path / "other" / "tinynet.py"
    copy.parent.mkdir()
    shutil.copy(tmp_path / "tinynet.py", copy)
    twin = harness.rebuild_from(load_module(copy))
    assert torch.equal(harness.run(), twin.run())


def test_plain_module_with_input_shape(tmp_path: Path) -> None:
    (tmp_path / "plain_net.py").write_text(
        "import torch\nclass Plain(torch.nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.l = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n        return self.l(x)\n"
    )
    harness = build_harness(tmp_path / "plain_net.py", input_shape=(3, 4))
    assert harness.run().shape == (3, 4)


def test_package_is_inferred_from_init_files() -> None:
    assert package_of(DEEPSEEK) == "transformers.models.deepseek_v3"


def test_broken_import_is_one_line_bad_input(tmp_path: Path) -> None:
    broken = tmp_path / "broken_model.py"
    broken.write_text("import not_a_module_anywhere_xyz\n")
    with pytest.raises(BadInput) as info:
        load_module(broken)
    assert "\n" not in str(info.value) and "not_a_module_anywhere_xyz" in str(info.value)


def test_each_load_is_a_fresh_module_and_the_same_bytes_compile_once(tmp_path: Path, monkeypatch) -> None:
    """verify loads the edited file for every run: a fresh module (its own module-level state)
    each time, compiled once for the same path and bytes, and again once the bytes change."""
    import builtins

    model = tmp_path / "counted_model.py"
    model.write_text("STATE = []\n\ndef value():\n    return 1\n")
    compiled: list[str] = []
    real_compile = builtins.compile

    def counting(source, filename, *args, **kwargs):
        compiled.append(str(filename))
        return real_compile(source, filename, *args, **kwargs)

    monkeypatch.setattr(builtins, "compile", counting)
    first = load_module(model, name="_counted_a")
    first.STATE.append("written by the first run")
    second = load_module(model, name="_counted_b")
    assert first is not second and second.STATE == [] and second.value() == 1
    assert second.__file__ == first.__file__ == str(model)
    assert compiled.count(str(model)) == 1, compiled
    model.write_text("STATE = []\n\ndef value():\n    return 2\n")
    third = load_module(model, name="_counted_c")
    assert third.value() == 2 and first.value() == 1
    assert compiled.count(str(model)) == 2, compiled
