"""The effects catalogue (msrewrite/analyze/native_ops.toml, read by analyze/catalogue.py).

Fast: the loader and its lookups; every entry's form (provenance, a schema torch's parser reads,
parameter names the running Python's functions have); apply's refusals and edits on the
adversarial models tests/adversarial/catalogue_*.py (verify runs them in tests/test_adversarial.py)
and on files that check a catalogue answer is used only for the name it is for.

Slow, marked `catalogue_source`: every entry checked against its package's own files (schema
strings in the shared libraries or sources, the Python functions' parameters). The packages are
found in MSREWRITE_CATALOGUE_SOURCES (default ~/.cache/msrewrite/catalogue-sources): per package,
a folder named as the entry's `package` holding its unpacked wheel or source tree, or the wheel
itself (`torch_npu-2.9.0-*.whl`; every wheel there is checked, each against the entries whose
range holds its version). A package not found there is skipped, by name. To fill it:
    D=~/.cache/msrewrite/catalogue-sources
    for v in 2.7.1 2.9.0 2.10.0; do pip download --no-deps torch-npu==$v -d $D; done
    pip download --no-deps sgl-kernel==0.3.21 vllm==0.33.0 -d $D
and run: MSREWRITE_CATALOGUE_SOURCES=$D pytest -m catalogue_source tests/test_catalogue.py
(sgl-kernel-cpu is built from an sglang checkout, not published: link its sgl-kernel/ folder as
$D/sgl-kernel-cpu to check it.)
"""

from __future__ import annotations

import inspect
import json
import mmap
import os
import sys
import zipfile
from pathlib import Path

import pytest

from helpers import ROOT
from msrewrite.analyze import catalogue, declared
from msrewrite.commands.apply import case_steps
from msrewrite.errors import MsrewriteError
from msrewrite.load import load
from msrewrite.plan import FlagSpec

FLAG = FlagSpec(kind="env", name="ENABLE_MOE_SHARED_EXPERT_STREAM")
ADVERSARIAL = ROOT / "tests" / "adversarial"
ENTRIES = [e for es in catalogue._load(catalogue.CATALOGUE_FILE)[0].values() for e in es]
UNIQUE = list({id(e): e for e in ENTRIES}.values())


def _apply(path: Path):
    """(the plans apply --case moe-shared-expert makes, "") or ([], its refusal), --protect none."""
    src = load(path)
    try:
        steps = case_steps(path, src.text, src.module, "moe-shared-expert", "eager", None, FLAG, None)
    except MsrewriteError as error:
        return [], str(error)
    return steps[-1].plans, ""


def _one(name: str) -> declared.Declaration:
    """The declaration of `name`'s entries: every version range of it must say the same."""
    decls = [e.declaration() for e in catalogue.lookup(name)]
    assert decls and not any(d.why for d in decls), [d.why for d in decls]
    assert len({(frozenset(d.writes), frozenset(d.returns)) for d in decls}) == 1, name
    return decls[0]


# --- the loader and its lookups ---------------------------------------------------------------


def test_the_catalogue_reads_and_is_not_small():
    found, why = catalogue._load(catalogue.CATALOGUE_FILE)
    assert not why and not catalogue.problem()
    assert len(UNIQUE) >= 80 and len(found) >= 100
    assert {e.package for e in UNIQUE} >= {"torch-npu", "sgl-kernel", "vllm", "python"}


def test_an_in_place_op_writes_its_first_argument_and_returns_it():
    decl = _one("torch.ops.npu.npu_scatter_nd_update_")
    assert decl.params[0] == "input" and decl.writes == {"input"} and decl.returns == {"input"}
    assert _one("torch_npu.npu_scatter_nd_update_").writes == {"input"}  # the torch_npu.* spelling


def test_a_rope_op_does_not_write_its_cos_and_sin():
    decl = _one("torch.ops.npu.npu_interleave_rope")
    assert decl.params == ["x", "cos", "sin"] and not decl.writes and not decl.returns


@pytest.mark.parametrize(
    "name",
    [
        "torch.ops.npu.npu_moe_finalize_routing",
        "torch_npu.npu_swiglu",
        "torch_npu.npu_rms_norm",
        "torch_npu.npu_grouped_matmul",
    ],
)
def test_finalize_norm_and_matmul_ops_return_new_tensors(name):
    decl = _one(name)
    assert not decl.writes and not decl.returns


def test_out_argument_kernels_write_only_their_outputs():
    assert _one("torch.ops.sgl_kernel.silu_and_mul").writes == {"out"}
    assert _one("torch.ops._C.rms_norm").writes == {"result"}
    assert _one("torch.ops.sgl_kernel.rotary_embedding").writes == {"query", "key"}  # not cos_sin_cache
    assert _one("torch.ops._C.fused_add_rms_norm").writes == {"input", "residual"}


def test_dispatch_and_combine_are_collectives():
    for name in ("torch_npu.npu_moe_distribute_dispatch", "torch.ops.npu.npu_moe_distribute_combine_v2"):
        entries = catalogue.lookup(name)
        assert entries and all(e.collective for e in entries)


def test_standard_library_entries_are_per_function():
    assert _one("struct.pack_into").writes == {"buffer"}  # writes through the buffer protocol
    assert not _one("shlex.quote").writes and _one("shlex.quote").returns == {"s"}  # may return s itself
    for name in ("struct", "random.shuffle", "heapq.heapify", "re.sub", "os", "shlex"):
        assert catalogue.lookup(name) == [], name


def test_every_version_range_of_an_op_is_returned():
    entries = catalogue.lookup("torch.ops.sgl_kernel.weight_packed_linear")
    assert len(entries) == 2 and {e.declaration().params[3] for e in entries} == {"is_vnni", "is_packed"}


def test_an_unknown_name_has_no_entry():
    assert catalogue.lookup("torch.ops.npu.npu_not_an_op") == []


def _entry(**fields):
    base = {"names": ["pkg.f"], "package": "pkg", "version": "1.0", "versions": ">=1.0", "source": "pkg/f.py: def f(x)"}
    return catalogue.read_entry({**base, **fields})


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"params": ["x"], "writes": [], "returns": [], "source": ""}, "no 'source'"),
        ({"params": ["x"], "writes": [], "returns": [], "package": 3}, "no 'package'"),
        ({"params": ["x"], "writes": ["y"], "returns": []}, "`writes` names 'y'"),
        ({"params": ["x"], "writes": []}, "`returns` is not a list"),
        ({"params": ["x", "x"], "writes": [], "returns": []}, "repeats a name"),
        ({"params": ["x"], "writes": [], "returns": [], "pure": True}, "unknown field 'pure'"),
        ({"schema": "f(Tensor x) -> Tensor", "writes": []}, "not both"),
        ({"names": ["torch.ops.pkg.f"], "params": ["x"], "writes": [], "returns": []}, "given by its schema"),
        ({"names": ["f"], "params": [], "writes": [], "returns": []}, "qualified names"),
        ({"params": ["x"], "writes": [], "returns": [], "collective": "no"}, "true or false"),
    ],
)
def test_a_malformed_entry_says_what_is_wrong(fields, problem):
    entry = _entry(**fields)
    assert problem in entry.problem, entry.problem
    assert entry.declaration().why  # its names stay unknown


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ("f(Tensor input, Tensor output) -> ()", "no result and no write"),  # must write something it does not say
        ("f(Tensor x", "does not parse"),
        ("f(Tensor x) -> Tensor(b)", "names no argument"),
    ],
)
def test_a_schema_entry_that_cannot_be_trusted_does_not_read(schema, why):
    assert why in _entry(schema=schema).declaration().why


def test_a_keyword_only_parameter_after_star_args():
    entry = _entry(params=["*args", "out", "**kwargs"], writes=["out"], returns=[])
    decl = entry.declaration()
    assert not entry.problem and decl.params == [] and decl.kwonly == ["out"] and entry.variadic() == ("args", "kwargs")


def test_a_catalogue_file_that_does_not_parse_is_empty_and_says_why(tmp_path):
    bad = tmp_path / "native_ops.toml"
    bad.write_text("[[op]\nnames = [")
    found, why = catalogue._load(bad)
    assert found == {} and "does not read" in why


# --- every entry's form (fast: a malformed entry fails CI) -----------------------------------


@pytest.mark.parametrize("entry", UNIQUE, ids=lambda e: f"{e.names[0]}@{e.version}")
def test_every_entry_has_provenance_and_an_effect_that_reads(entry):
    from packaging.specifiers import SpecifierSet

    assert not entry.problem, entry.problem
    assert all(getattr(entry, k).strip() for k in catalogue.PROVENANCE)
    SpecifierSet(entry.versions)  # a PEP 440 range
    decl = entry.declaration()
    assert not decl.why, decl.why
    if entry.schema:
        name, _ = declared.from_schema("check", entry.schema)
        assert all(n.split(".")[-1] == name for n in entry.names), (entry.names, name)
        parsed, why = declared.parse_schema(entry.schema)
        assert parsed is not None, why
    else:
        assert all(n.split(".")[-1].isidentifier() for n in entry.names)


def test_the_schemas_parse_kept_ahead_is_current():
    """native_ops_parsed.json is torch's parse of every catalogue schema (a run reads it instead
    of importing torch): after an edit of native_ops.toml, `python -m msrewrite.analyze.catalogue`."""
    kept = json.loads(catalogue.PARSED_FILE.read_text())["schemas"]
    assert kept == catalogue.regenerate()["schemas"], "run `python -m msrewrite.analyze.catalogue`"


def _signature_names(func) -> list[str] | None:
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return None  # a builtin without a text signature: its source line is the provenance
    return [p.name for p in signature.parameters.values()]


PYTHON = [e for e in UNIQUE if e.package == "python"]


@pytest.mark.parametrize("entry", PYTHON, ids=lambda e: e.names[0])
def test_standard_library_parameters_are_the_running_pythons(entry):
    """The parameter names an entry binds arguments by are the function's, on the Python the
    entry was read from (another Python may name them otherwise; its effect is per function)."""
    if f"{sys.version_info.major}.{sys.version_info.minor}" != ".".join(entry.version.split(".")[:2]):
        pytest.skip(f"the entry was read from Python {entry.version}")
    for name in entry.names:
        module, _, leaf = name.rpartition(".")
        owner = __import__(module.split(".")[0])
        for part in module.split(".")[1:]:
            owner = getattr(owner, part)
        names = _signature_names(getattr(owner, leaf))
        if names is not None:
            assert names == [p.lstrip("*") for p in entry.params], (name, names)


# --- apply on the adversarial models and on look-alikes ----------------------------------------


@pytest.mark.parametrize(
    ("name", "callee"),
    [
        ("catalogue_native_inplace_writes", "torch.ops.npu.npu_scatter_nd_update_(...)"),
        ("catalogue_stdlib_pack_into_writes", "struct.pack_into(...)"),
    ],
)
def test_a_catalogued_write_of_the_side_input_refuses_naming_the_op(name, callee):
    plans, refusal = _apply(ADVERSARIAL / f"{name}.py")
    assert not plans
    assert "writes 'x' in place while the side stream reads it" in refusal and f"inside {callee}" in refusal, refusal


def test_a_catalogued_pure_native_op_lets_the_edit_happen_and_is_in_the_trust_boundary():
    (plan,) = _apply(ADVERSARIAL / "catalogue_native_rope_pure.py")[0]
    assert not plan.protect_inputs
    (named,) = [u for u in plan.trust_boundary if u.startswith("torch.ops.npu.npu_interleave_rope")]
    assert "msrewrite's catalogue: torch-npu " in named and "2.9.0" in named and "not read" in named


def test_catalogued_pure_standard_library_calls_let_the_edit_happen():
    (plan,) = _apply(ADVERSARIAL / "catalogue_stdlib_pure.py")[0]
    assert not plan.protect_inputs
    assert not any(u.startswith(("hashlib.sha256 ", "re.search", "shlex.quote")) for u in plan.trust_boundary)


def _model(tmp_path: Path, imports: str, call: str, extra: str = "") -> Path:
    path = tmp_path / "model.py"
    path.write_text(
        f"""import torch
from torch import nn
{imports}

{extra}

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared_experts = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 16))
        self.gate = nn.Linear(16, 16)

    def forward(self, x):
        s = self.shared_experts(x)
        h = self.gate(x)
        y = {call}
        return h + y + s
"""
    )
    return path


def test_a_name_imported_from_the_package_is_answered(tmp_path):
    plans, refusal = _apply(_model(tmp_path, "from torch_npu import npu_swiglu", "npu_swiglu(x)"))
    assert plans and not refusal, refusal


@pytest.mark.parametrize(
    ("imports", "call", "extra"),
    [
        # the same leaf from another package: not the catalogue's op
        ("from mykernels import npu_swiglu", "npu_swiglu(x)", ""),
        # a local object named like the module
        ("", "shlex.quote(x)", "shlex = object()"),
        # a relative import of a sibling module named like the standard library's
        ("from . import shlex", "shlex.quote(x)", ""),
        # the module's name bound again in the file: a parameter, a loop target, an assignment
        ("import shlex", "shlex.quote(x)", "def _pick(shlex=None):\n    return shlex\n"),
        ("import shlex", "shlex.quote(x)", "for shlex in ():\n    pass\n"),
        ("import torch_npu", "torch_npu.npu_swiglu(x)", "torch_npu = None\n"),
        ("", "torch.ops.npu.npu_swiglu(x)", "def _pick(torch=None):\n    return torch\n"),
    ],
)
def test_a_lookalike_name_is_not_answered(tmp_path, imports, call, extra):
    plans, refusal = _apply(_model(tmp_path, imports, call, extra))
    assert not plans and "may write 'x'" in refusal, refusal


def test_names_a_package_module_binds_are_read_from_its_index(tmp_path):
    from msrewrite.analyze import packages

    path = tmp_path / "mod.py"
    path.write_text("import re\nimport shlex as sh\ndef f(re, *a, **k):\n    for s in a:\n        pass\n    q = 1\n")
    index = packages.index_file(path)
    assert index is not None and index.bound_besides_imports == {"f", "re", "a", "k", "s", "q"}
    path.write_text("def (:\n")
    assert packages.index_file(path) is None  # a file that does not parse is not read at all


@pytest.mark.parametrize("call", ["os.readv(3, [x.numpy()])", "os.preadv(3, [x.numpy()], 0)"])
def test_os_functions_that_read_into_a_buffer_are_not_pure(tmp_path, call):
    """`os` is a pure module for msrewrite but for these: they write the buffers they are given."""
    plans, refusal = _apply(_model(tmp_path, "import os", f"{call} and 0"))
    assert not plans and "may write 'x'" in refusal, refusal


def test_a_registration_in_source_wins_over_the_catalogue(tmp_path):
    """A file that registers an op of that name itself is read, not the catalogue."""
    extra = (
        '_LIB = torch.library.Library("npu", "FRAGMENT")\n'
        '_LIB.define("npu_interleave_rope(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)")\n'
    )
    plans, refusal = _apply(_model(tmp_path, "", "torch.ops.npu.npu_interleave_rope(x, x, x)", extra))
    assert not plans and "writes 'x' in place" in refusal, refusal


@pytest.mark.parametrize(
    ("op", "args", "edits"),
    [("npu_interleave_rope", "x, x, x", True), ("npu_scatter_nd_update_", "x, self.rows, h[:1]", False)],
)
def test_an_op_stored_on_the_module_is_that_op(tmp_path, op, args, edits):
    """vLLM's CustomOp shape: `self.op = torch.ops._C.silu_and_mul` in __init__, `self.op(out, x)`."""
    path = _model(tmp_path, "", f"self.op({args})")
    text = path.read_text().replace(
        "        self.gate = nn.Linear(16, 16)\n",
        f'        self.gate = nn.Linear(16, 16)\n        self.op = torch.ops.npu.{op}\n        self.register_buffer("rows", torch.tensor([[1]]))\n',
    )
    path.write_text(text)
    plans, refusal = _apply(path)
    if edits:
        assert plans and not refusal, refusal
    else:
        assert not plans and "writes 'x' in place" in refusal and "inside self.op(...)" in refusal, refusal


def test_a_malformed_entry_keeps_the_call_unknown(tmp_path, monkeypatch):
    broken = catalogue.read_entry({"names": ["torch_npu.npu_swiglu"], "schema": "npu_swiglu(Tensor x) -> ()"})
    monkeypatch.setattr(catalogue, "lookup", lambda name: [broken] if name == "torch_npu.npu_swiglu" else [])
    plans, refusal = _apply(_model(tmp_path, "import torch_npu", "torch_npu.npu_swiglu(x)"))
    assert not plans and "its catalogue entry" in refusal and "does not read" in refusal, refusal


def test_version_ranges_that_disagree_take_the_union(tmp_path, monkeypatch):
    """msrewrite cannot tell which version runs: an op that writes in one range writes."""
    old = catalogue.lookup("torch.ops.npu.npu_interleave_rope")[0]
    writes = catalogue.read_entry(
        {
            "names": ["torch.ops.npu.npu_interleave_rope"],
            "schema": "npu_interleave_rope(Tensor(a!) x, Tensor cos, Tensor sin) -> Tensor(a!)",
            "package": "torch-npu",
            "version": "0.0",
            "versions": "<2.0",
            "source": "a made-up older schema",
        }
    )
    monkeypatch.setattr(catalogue, "lookup", lambda name: [old, writes] if name.endswith("interleave_rope") else [])
    plans, refusal = _apply(_model(tmp_path, "", "torch.ops.npu.npu_interleave_rope(x, x, x)"))
    assert not plans and "writes 'x' in place" in refusal, refusal


# --- every entry against its package's source (slow; needs the packages) --------------------

SOURCES = Path(
    os.environ.get("MSREWRITE_CATALOGUE_SOURCES", Path.home() / ".cache" / "msrewrite" / "catalogue-sources")
)
PACKAGES = sorted({e.package for e in UNIQUE if e.package != "python"})


def _package_sources(package: str, tmp_path_factory) -> list[tuple[list[Path], str]]:
    """Each source of `package` found (its unpacked tree; each of its wheels, unpacked here):
    its files and its version ("" unknown)."""
    trees = [SOURCES / package] if (SOURCES / package).is_dir() else []
    for wheel in sorted(SOURCES.glob(f"{package.replace('-', '_')}-*.whl")) if SOURCES.is_dir() else []:
        tree = tmp_path_factory.mktemp(package)
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(tree)
        trees.append(tree)
    if not trees:
        pytest.skip(f"no source of {package} in {SOURCES} (set MSREWRITE_CATALOGUE_SOURCES; see this file's docstring)")
    found = []
    for tree in trees:
        files = [p for p in tree.rglob("*") if p.is_file()]
        metadata = [p for p in files if p.name == "METADATA" and p.parent.name.endswith(".dist-info")]
        version = ""
        for line in metadata[0].read_text(errors="replace").splitlines() if metadata else ():
            if line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
                break
        found.append((files, version))
    return found


def _schemas_in(files: list[Path], ops: set[str]) -> dict[str, list[str]]:
    """op name -> every schema-like string for it in the files: the printable run around each
    `op(` in shared libraries (where the registration's string literal ends up), the string
    literals of sources. Files are mapped, not read (a kernel library is hundreds of MB)."""
    found: dict[str, list[str]] = {}
    for file in files:
        if file.suffix not in (".so", ".cpp", ".cc", ".cu", ".yaml", ".h", ".py") and ".so." not in file.name:
            continue
        with file.open("rb") as handle:
            try:
                data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file
                continue
            with data:
                binary = file.suffix not in (".cpp", ".cc", ".cu", ".yaml", ".h", ".py")
                for op in ops:
                    for text in _runs_at(data, op.encode() + b"(", binary):
                        found.setdefault(op, []).append(text)
    return found


def _runs_at(data, needle: bytes, binary: bool):
    """The schema strings starting at each occurrence of `needle`: up to the end of the printable
    run in a shared library, up to the closing quote of the literal in a source."""
    at = data.find(needle)
    while at >= 0:
        before = data[at - 1 : at] if at else b"\0"
        if not (before.isalnum() or before in (b"_", b".")):
            end = at
            while end < len(data) and end - at < 4096 and 0x20 <= data[end] <= 0x7E:
                if not binary and data[end] == ord('"') and data[end - 1] != ord("\\"):
                    break
                end += 1
            text = " ".join(data[at:end].decode("ascii").replace('\\"', '"').split())
            if "->" in text:
                yield text
        at = data.find(needle, at + 1)


def _mismatches(checked: list, files: list[Path]) -> list[str]:
    """What in `checked` (catalogue entries) the package files do not show."""
    import ast

    ops = {e.schema.split("(")[0] for e in checked if e.schema}
    found = _schemas_in(files, ops) if ops else {}
    wrong = []
    for entry in checked:
        if entry.schema:
            want = str(declared.parse_schema(entry.schema)[0])
            have = {str(p) for s in found.get(entry.schema.split("(")[0], []) if (p := declared.parse_schema(s)[0])}
            if want not in have:
                wrong.append(f"{entry.names[0]}: {entry.schema!r} not among {sorted(have) or 'no schema found'}")
            continue
        for name in entry.names:
            leaf = name.rsplit(".", 1)[1]
            defs = [
                [a.arg for a in (*node.args.posonlyargs, *node.args.args)]
                for file in files
                if file.suffix == ".py" and f"def {leaf}(".encode() in file.read_bytes()
                for node in ast.walk(ast.parse(file.read_bytes()))
                if isinstance(node, ast.FunctionDef) and node.name == leaf
            ]
            if [p for p in entry.params if not p.startswith("*")] not in defs:
                wrong.append(f"{name}: params {entry.params} not among the definitions found {defs}")
    return wrong


@pytest.mark.slow
@pytest.mark.catalogue_source
@pytest.mark.parametrize("package", PACKAGES)
def test_every_entry_matches_its_package_source(package, tmp_path_factory):
    """Each schema entry's schema is one its package registers (compared as torch parses
    them); each Python function's parameters are its source's. Entries whose version range does
    not hold the package version found are left out (named in the skip when none is checked)."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    entries = [e for e in UNIQUE if e.package == package]
    wrong: list[str] = []
    checked_any = []
    for files, version in _package_sources(package, tmp_path_factory):
        try:
            checked = [e for e in entries if not version or Version(version) in SpecifierSet(e.versions)]
        except InvalidVersion:
            checked = entries
        checked_any += checked
        wrong += [f"{package} {version}: {w}" for w in _mismatches(checked, files)]
    if not checked_any:
        pytest.skip(f"{package}: no entry holds for the versions found")
    assert not wrong, "\n".join(wrong)


def test_the_source_check_reads_schema_strings_from_libraries_and_sources(tmp_path):
    """The checker above finds a schema in a shared library's printable runs and in a C++ string
    literal with escaped quotes, and only where the op's name starts a word."""
    library = tmp_path / "ops.abi3.so"
    library.write_bytes(b"\x00\x01my_op(Tensor! out, Tensor x, str mode='half') -> ()\x00xmy_op(Tensor y) -> ()\x00")
    source = tmp_path / "bindings.cpp"
    source.write_text('m.def("my_op(Tensor x, str g=\\"\\") -> Tensor");\n')
    found = _schemas_in([library, source], {"my_op"})
    assert found == {
        "my_op": ["my_op(Tensor! out, Tensor x, str mode='half') -> ()", 'my_op(Tensor x, str g="") -> Tensor']
    }
