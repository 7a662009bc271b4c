"""The effects catalogue: what native ops and standard-library functions do to their arguments.

A call msrewrite has no Python body for (a `torch.ops.<ns>.<op>` registered in C++, `torch_npu.npu_*`,
an `sgl_kernel` function when its package is not on the source path, `shlex.quote`) is unknown:
it may write every argument. The catalogue (native_ops.toml, next to this file: data, not code)
says what some of them do, one entry per op and version range, each with its provenance: the
package and version read, and the schema string or source line that shows the effect.

An entry gives its effect either as a schema string, read with torch's parser as a registration
found in source is (analyze/declared.py: `Tensor(a!)` arguments are written, a `Tensor(a)` result
aliases its argument, any other result is new), or as parameter names: `params` in order (`*name`
and `**name` for the variadic ones), `writes` (the parameters it writes) and `returns` (those its
result may alias; "*": every one). `collective = true` marks an op that communicates.

Several entries for one name (the op in different version ranges) are all taken: the call's
effect is their union, since msrewrite cannot tell which version runs. An entry that does not
read (a field missing, a schema that does not parse, one that declares no result and no write,
so must write something it does not declare) leaves the op unknown, and says why.

The schemas' parse by torch is kept in native_ops_parsed.json (made by running this module), so
that a run does not import torch for them; a schema missing there is parsed with torch.
The file is read once per process, on the first lookup (stdlib `tomllib`; `tomli` on Python 3.10;
without either the catalogue is empty and every such call stays unknown).
"""

from __future__ import annotations

import functools
import json
from dataclasses import field
from pathlib import Path
from typing import Any

from msrewrite.analyze import declared
from msrewrite.records import record

CATALOGUE_FILE = Path(__file__).with_name("native_ops.toml")
# torch's parse of every schema in it, made ahead (regenerate(); tests/test_catalogue.py checks it is current)
PARSED_FILE = Path(__file__).with_name("native_ops_parsed.json")

# the fields an entry may have; REQUIRED ones must be there (PROVENANCE: non-empty strings)
FIELDS = frozenset(
    {"names", "schema", "params", "writes", "returns", "collective", "package", "version", "versions", "source"}
)
PROVENANCE = ("package", "version", "versions", "source")
# names under these roots are ops registered with torch: their effect is a schema, never a list
SCHEMA_ROOTS = ("torch.ops.",)


@record
class Entry:
    """One catalogue entry: the names it answers for, its effect and its provenance."""

    names: list[str]
    package: str = ""
    version: str = ""  # the version its provenance was read from
    versions: str = ""  # the range it holds for (PEP 440 specifiers)
    source: str = ""  # the file and the schema string or source line that shows the effect
    schema: str = ""
    params: list[str] = field(default_factory=list)
    writes: list[str] = field(default_factory=list)
    returns: list[str] = field(default_factory=list)
    collective: bool = False
    problem: str = ""  # non-empty: the entry does not read (its names stay unknown)

    def label(self) -> str:
        return f"catalogue: {self.package} {self.version}"

    def declaration(self) -> declared.Declaration:
        """The entry's effect as a declaration (`why` set when it does not read). A schema entry
        is parsed here, on first use (torch is imported for it then)."""
        if self.problem:
            return declared.Declaration(label=self.label(), why=self.problem)
        if self.schema:
            return _schema_declaration(self.label(), self.schema)
        decl = declared.Declaration(label=self.label())
        star = next((i for i, p in enumerate(self.params) if p.startswith("*")), len(self.params))
        decl.params = list(self.params[:star])
        decl.kwonly = [p for p in self.params[star:] if not p.startswith("*")]  # after `*args`
        every = {p.lstrip("*") for p in self.params}
        decl.writes = set(self.writes)
        decl.returns = every if self.returns == ["*"] else set(self.returns)
        return decl

    def variadic(self) -> tuple[str | None, str | None]:
        """The entry's `*args` and `**kwargs` parameter names (None: it has none)."""
        star = next((p[1:] for p in self.params if p.startswith("*") and not p.startswith("**")), None)
        double = next((p[2:] for p in self.params if p.startswith("**")), None)
        return star, double


@functools.lru_cache(maxsize=512)
def _schema_declaration(label: str, schema: str) -> declared.Declaration:
    """What `schema` declares: from PARSED_FILE, torch's parse of every catalogue schema made
    ahead (importing torch costs seconds a run); a schema not in it is parsed now."""
    known = _parsed(PARSED_FILE).get(schema)
    fields = known if known is not None else parse(schema)
    decl = declared.Declaration(
        label=label,
        params=list(fields["params"]),
        kwonly=list(fields["kwonly"]),
        writes=set(fields["writes"]),
        returns=set(fields["returns"]),
        why=fields["why"],
    )
    if not decl.why and not decl.writes and fields["declares_nothing"]:
        decl.why = "its schema declares no result and no write (it must write something it does not declare)"
    return decl


def parse(schema: str) -> dict[str, Any]:
    """torch's parse of a catalogue schema, as PARSED_FILE keeps it."""
    name, decl = declared.from_schema("", schema)
    parsed, _ = declared.parse_schema(schema.strip())
    return {
        "name": name,
        "params": decl.params,
        "kwonly": decl.kwonly,
        "writes": sorted(decl.writes),
        "returns": sorted(decl.returns),
        "why": decl.why,
        "declares_nothing": parsed is not None and not parsed.returns,
    }


@functools.lru_cache(maxsize=4)
def _parsed(path: Path) -> dict[str, dict[str, Any]]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))["schemas"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}  # every schema is parsed with torch instead


def regenerate(path: Path = CATALOGUE_FILE) -> dict[str, Any]:
    """PARSED_FILE's content for the catalogue at `path`: torch's parse of each of its schemas."""
    import torch

    schemas = sorted({e.schema for es in _load(path)[0].values() for e in es if e.schema})
    return {
        "note": f"generated from {path.name} by `python -m msrewrite.analyze.catalogue`: do not edit",
        "torch": torch.__version__.split("+")[0],
        "schemas": {schema: parse(schema) for schema in schemas},
    }


def lookup(name: str) -> list[Entry]:
    """The entries for fully qualified `name` (`torch.ops.npu.npu_swiglu`, `shlex.quote`); []
    when the catalogue has none."""
    return _load(CATALOGUE_FILE)[0].get(name, [])


def problem() -> str:
    """Why the catalogue could not be read at all ("" when it was)."""
    return _load(CATALOGUE_FILE)[1]


@functools.lru_cache(maxsize=4)
def _load(path: Path) -> tuple[dict[str, list[Entry]], str]:
    """name -> its entries, and why the file could not be read ("" when it was)."""
    try:
        import tomllib as toml  # Python 3.11+
    except ImportError:  # pragma: no cover - Python 3.10
        try:
            import tomli as toml  # type: ignore[no-redef, import-not-found]
        except ImportError:
            return {}, "neither tomllib (Python 3.11+) nor tomli is available to read it"
    try:
        data = toml.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return {}, f"{path.name} does not read ({e})"
    found: dict[str, list[Entry]] = {}
    for raw in data.get("op", []):
        entry = read_entry(raw)
        for name in entry.names:
            found.setdefault(name, []).append(entry)
    return found, ""


def read_entry(raw: Any) -> Entry:
    """One `[[op]]` table as an Entry; `problem` says what is wrong with it."""
    if not isinstance(raw, dict):
        return Entry(names=[], problem="an entry is not a table")
    names = raw.get("names")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and "." in n for n in names):
        return Entry(names=[], problem="`names` is not a list of qualified names")
    entry = Entry(names=list(names))
    entry.problem = _fields_problem(raw, entry)
    return entry


def _fields_problem(raw: dict, entry: Entry) -> str:
    unknown = sorted(set(raw) - FIELDS)
    if unknown:
        return f"unknown field {unknown[0]!r}"
    for key in PROVENANCE:
        value = raw.get(key)
        if not isinstance(value, str) or not value.strip():
            return f"its provenance has no {key!r}"
        setattr(entry, key, value)
    collective = raw.get("collective", False)
    if not isinstance(collective, bool):
        return "`collective` is not true or false"
    entry.collective = collective
    schema_names = [n for n in entry.names if n.startswith(SCHEMA_ROOTS)]
    if "schema" in raw:
        if not isinstance(raw["schema"], str) or not raw["schema"].strip():
            return "`schema` is not a schema string"
        if {"params", "writes", "returns"} & set(raw):
            return "an entry gives its effect as a schema or as parameter lists, not both"
        entry.schema = " ".join(raw["schema"].split())
        return ""
    if schema_names:
        return f"{schema_names[0]} is a registered op: its effect is given by its schema"
    lists = {}
    for key in ("params", "writes", "returns"):
        value = raw.get(key)
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            return f"`{key}` is not a list of parameter names"
        lists[key] = value
    entry.params, entry.writes, entry.returns = lists["params"], lists["writes"], lists["returns"]
    plain = [p.lstrip("*") for p in entry.params]
    if len(set(plain)) != len(plain) or not all(p.isidentifier() for p in plain):
        return "`params` repeats a name or holds one that is not an identifier"
    for key in ("writes", "returns"):
        named = [n for n in lists[key] if n not in plain and not (key == "returns" and lists[key] == ["*"])]
        if named:
            return f"`{key}` names {named[0]!r}, which is no parameter"
    return ""


if __name__ == "__main__":
    PARSED_FILE.write_text(json.dumps(regenerate(), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"wrote {PARSED_FILE}")
