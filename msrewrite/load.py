"""Load: read a model file and parse it, turning every way that can fail into one clear line."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import libcst as cst

from msrewrite.errors import BadInput, EmptyFile


@dataclass
class SourceFile:
    path: Path
    text: str
    module: cst.Module

    @property
    def display(self) -> str:
        return str(self.path)


def read_source(path: Path) -> str:
    """The file's text, or BadInput naming what is wrong with it."""
    if not path.exists():
        raise BadInput(f"{path}: no such file")
    if path.is_dir():
        raise BadInput(f"{path}: is a directory, expected a Python file")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BadInput(f"{path}: cannot read ({exc.strerror or exc})") from None
    if b"\x00" in data:
        raise BadInput(f"{path}: binary file, expected Python source")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BadInput(f"{path}: not UTF-8 (byte {exc.start})") from None
    if not text.strip():
        raise EmptyFile(f"{path}: empty file")
    return text


def parse_source(path: Path, text: str) -> cst.Module:
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        reason = str(exc.message).splitlines()[0] if exc.message else "invalid syntax"
        raise BadInput(f"{path}:{exc.raw_line}:{exc.raw_column + 1}: syntax error: {reason}") from None
    except (RecursionError, ValueError) as exc:
        raise BadInput(f"{path}: cannot parse: {exc}") from None


def load(path: Path) -> SourceFile:
    text = read_source(path)
    return SourceFile(path=path, text=text, module=parse_source(path, text))


def git_root(path: Path) -> Path | None:
    """The git work tree holding `path`, if any (diff paths are relative to it)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(path.resolve().parent), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return Path(out.stdout.strip())
