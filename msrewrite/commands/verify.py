"""`msrewrite verify` and `apply --verify`: equivalence runs plus the stream sanitizer on CPU."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer

from msrewrite.errors import EXIT_NOTHING_TO_DO, EXIT_OK, BadInput
from msrewrite.plan import FlagSpec
from msrewrite.verify import VerifyResult, summary, verify_files


def _report(result: VerifyResult, json_out: bool) -> int:
    if json_out:
        typer.echo(result.to_json())
    else:
        for line in summary(result):
            typer.echo(line)
        for problem in result.problems:
            typer.echo(f"problem: {problem}")
    return EXIT_OK if result.ok else EXIT_NOTHING_TO_DO


def run_verify(
    *,
    rewritten: Path,
    original: Path | None,
    harness: str | None,
    target: str | None,
    flag: str,
    mode: str,
    atol: float,
    rtol: float,
    json_out: bool,
) -> int:
    if atol < 0 or rtol < 0:
        raise BadInput("--atol and --rtol must not be negative")
    spec = None
    if flag:
        try:
            spec = FlagSpec.parse(flag)
        except ValueError as exc:
            raise BadInput(str(exc)) from None
    result = verify_files(
        rewritten, original=original, harness=harness, target=target, flag=spec, mode=mode, atol=atol, rtol=rtol
    )
    return _report(result, json_out)


def verify_edit(
    file: Path, new_text: str, *, function: str | None, flag: FlagSpec, mode: str, harness: str | None
) -> int:
    """`apply --verify`: check the edit just made without writing anything next to the user's file.
    `function` is the edited Class.method (None for model-level edits such as prefill-microbatch)."""
    from msrewrite.harness import package_of

    with tempfile.TemporaryDirectory(prefix="msrewrite-verify-") as folder:
        edited = Path(folder) / file.name
        edited.write_text(new_text, encoding="utf-8")
        target = function.split(".")[0] if function and "." in function else None
        result = verify_files(
            edited,
            original=file,
            harness=harness,
            target=target,
            flag=flag,
            mode=mode,
            package=package_of(file),
            explicit_target=False,
        )
    typer.echo("verify:", err=True)
    for line in summary(result):
        typer.echo(f"  {line}", err=True)
    for problem in result.problems:
        typer.echo(f"  problem: {problem}", err=True)
    return EXIT_OK if result.ok else EXIT_NOTHING_TO_DO
