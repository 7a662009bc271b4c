"""Load: read a model file and parse it, turning every way that can fail into one clear line."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path
from typing import Literal

import libcst as cst

from msrewrite.errors import BadInput, EmptyFile
from msrewrite.records import record

# Largest file read, in bytes (apply/suggest/verify --max-bytes). The biggest transformers
# modeling file is about 0.3 MB; this only stops a runaway input (a log, a dump, /dev/zero).
DEFAULT_MAX_BYTES = 16 * 1024 * 1024
max_bytes = DEFAULT_MAX_BYTES

# Deepest expression nesting accepted (AST levels). libcst's code generator and our visitors
# recurse once per level and stop near 250 under Python's default recursion limit, and libcst's
# parser takes quadratic time on long operator chains (a 20,000-term `+` chain never returns),
# so such files are refused up front with the line that holds the deepest node.
MAX_NESTING = 150

BOM = "\ufeff"


def set_max_bytes(limit: int | None) -> None:
    """The --max-bytes option: a positive byte count."""
    global max_bytes
    if limit is None:
        max_bytes = DEFAULT_MAX_BYTES
        return
    if limit < 1:
        raise BadInput(f"--max-bytes must be a positive byte count, got {limit}")
    max_bytes = limit


@record
class SourceFile:
    """A loaded model file: its text as parsed, its libcst module, and what writing it back needs."""

    path: Path
    text: str  # as parsed: no BOM, a CR-only file read with "\n"
    module: cst.Module
    raw: bytes = b""  # the bytes read: `-i` refuses to replace a file saved since
    bom: bool = False
    newline: str = "\n"  # "\r" for a file whose lines end in CR only
    encoding: str = "utf-8"  # from a PEP 263 coding cookie: the edit and the diff are written in it too

    @property
    def digest(self) -> str:
        """sha256 of the bytes read."""
        return file_digest(self.raw)

    @property
    def display(self) -> str:
        return str(self.path)

    def on_disk(self, text: str) -> str:
        """`text` (as parsed) the way this file is written: its BOM and its line endings back."""
        if self.newline != "\n":
            text = text.replace("\n", self.newline)
        return BOM + text if self.bom else text

    def encode(self, text: str) -> bytes:
        """`text` (as on_disk gives it) in the file's own encoding."""
        try:
            return text.encode(self.encoding)
        except UnicodeEncodeError as exc:
            raise BadInput(
                f"{self.path}: the edit holds {exc.object[exc.start : exc.end]!r}, which its "
                f"{self.encoding} coding cookie cannot write; nothing written"
            ) from None


def file_digest(data: bytes) -> str:
    import hashlib  # only `-i` needs it; OpenSSL's hashlib is slow to import

    return hashlib.sha256(data).hexdigest()


def read_bytes(path: Path, what: str = "") -> bytes:
    """A regular file's bytes, at most max_bytes; anything else (a FIFO, a device, a folder) is
    refused before it is opened, so nothing blocks on a pipe with no writer or reads forever."""
    label = f"{what} {path}" if what else str(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        raise BadInput(f"{label}: no such file") from None
    except OSError as exc:
        raise BadInput(f"{label}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISDIR(info.st_mode):
        raise BadInput(f"{label}: is a directory, expected a Python file")
    if not stat.S_ISREG(info.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(info.st_mode) else "a socket" if stat.S_ISSOCK(info.st_mode) else "a device"
        raise BadInput(f"{label}: is {kind}, expected a regular file")
    if info.st_size > max_bytes:
        raise BadInput(f"{label}: {info.st_size} bytes, over the --max-bytes limit of {max_bytes}")
    try:
        with open(path, "rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as exc:
        raise BadInput(f"{label}: cannot read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:  # grew while we read it
        raise BadInput(f"{label}: over the --max-bytes limit of {max_bytes} bytes")
    return data


_COOKIE = re.compile(rb"^[ \t\f]*#.*?coding[:=][ \t]*([-\w.]+)", re.M)


def source_encoding(path: Path, data: bytes) -> str:
    """The encoding Python reads the file in: a PEP 263 coding cookie on line 1 or 2, else UTF-8."""
    head = data.removeprefix(BOM.encode("utf-8")).split(b"\n", 2)[:2]
    if not any(_COOKIE.match(line) for line in head):
        return "utf-8"
    import codecs
    import io
    import tokenize

    try:
        name, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError as exc:  # an unknown encoding, or a cookie that contradicts a BOM
        if data.startswith(BOM.encode("utf-8")):
            raise BadInput(f"{path}: starts with a UTF-8 BOM, but its coding cookie names another encoding") from None
        raise BadInput(f"{path}: {str(exc.msg if hasattr(exc, 'msg') else exc).rstrip('.')}") from None
    return "utf-8" if name == "utf-8-sig" else codecs.lookup(name).name


def encode_source(text: str) -> bytes:
    """Source text as Python will read it back: in the encoding its own coding cookie declares
    (verify writes edited copies of a latin-1 file with this, so its literals keep their value)."""
    head = "\n".join(text.split("\n", 2)[:2]).encode("utf-8", "replace")
    return text.encode(source_encoding(Path("<edit>"), head + b"\n"), "replace")


def decode_source(path: Path, data: bytes) -> str:
    if b"\x00" in data:
        raise BadInput(f"{path}: binary file, expected Python source")
    encoding = source_encoding(path, data)
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as exc:
        if encoding == "utf-8":
            raise BadInput(f"{path}: not UTF-8 (byte {exc.start})") from None
        raise BadInput(f"{path}: not {encoding}, as its coding cookie says (byte {exc.start})") from None


def read_source(path: Path, python: bool = True) -> str:
    """The file's text, or BadInput naming what is wrong with it. With `python`, also refused:
    nesting beyond what the parser and code generator can take (see MAX_NESTING)."""
    text = decode_source(path, read_bytes(path))
    if not text.strip(BOM + " \t\r\n\f"):
        raise EmptyFile(f"{path}: empty file")
    if python:
        check_nesting(path, text)
    return text


_BRACKETS = re.compile(r"[()\[\]{}]")


def _looks_deep(text: str) -> bool:
    """Cheap screen (about a millisecond on a 1,000-line file): deep brackets, a long line, a
    bracket whose contents run over 4,000 characters or a long run of backslash continuations are
    the only ways to write a deep expression."""
    depth = deepest = start = 0
    for match in _BRACKETS.finditer(text):
        if match.group() in "([{":
            if depth == 0:
                start = match.start()
            depth += 1
            if depth > deepest:
                deepest = depth
        else:
            depth -= 1
            if depth == 0 and match.start() - start > 4000:
                return True
    if deepest > 40 or max(map(len, text.split("\n"))) > 600:
        return True
    return "\\\n" in text and re.search(r"(?:\\\n[^\n]*){40}", text) is not None


def check_nesting(path: Path, text: str) -> None:
    if not _looks_deep(text):
        return
    import ast

    try:
        tree = ast.parse(text.lstrip(BOM))
    except SyntaxError as exc:
        raise BadInput(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from None
    except (RecursionError, MemoryError):
        raise BadInput(f"{path}: nested too deeply to parse") from None
    deepest, line = 0, 0
    stack: list[tuple[ast.AST, int]] = [(tree, 0)]
    while stack:  # iterative: the tree may be deeper than Python's recursion limit
        node, depth = stack.pop()
        if depth > deepest:
            deepest, line = depth, getattr(node, "lineno", line)
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))
    if deepest > MAX_NESTING:
        raise BadInput(
            f"{path}:{line}: nested {deepest} levels deep (an expression or chain of operators); "
            f"msrewrite handles at most {MAX_NESTING}"
        )


def parse_source(path: Path, text: str) -> cst.Module:
    try:
        return cst.parse_module(text)
    except cst.ParserSyntaxError as exc:
        reason = str(exc.message).splitlines()[0] if exc.message else "invalid syntax"
        raise BadInput(f"{path}:{exc.raw_line}:{exc.raw_column + 1}: syntax error: {reason}") from None
    except (RecursionError, ValueError) as exc:
        raise BadInput(f"{path}: cannot parse: {exc}") from None


def load(path: Path) -> SourceFile:
    data = read_bytes(path)
    raw = decode_source(path, data)
    if not raw.strip(BOM + " \t\r\n\f"):
        raise EmptyFile(f"{path}: empty file")
    check_nesting(path, raw)
    text, bom = (raw[1:], True) if raw.startswith(BOM) else (raw, False)
    newline = "\n"
    if "\r" in text and "\n" not in text:
        # Lines ending in CR only: git sees one line, libcst drops a final CR. Parse with "\n"
        # and write CR back, so the edit and the diff keep the file's own line endings.
        text, newline = text.replace("\r", "\n"), "\r"
    elif text.endswith("\r"):
        raise BadInput(f"{path}: mixed line endings ending in a lone CR; normalize them first")
    return SourceFile(
        path=path,
        text=text,
        module=parse_source(path, text),
        raw=data,
        bom=bom,
        newline=newline,
        encoding=source_encoding(path, data),
    )


# Environment that changes how git finds a repository: with any of these set, git is asked.
_GIT_DISCOVERY_ENV = (
    "GIT_DIR",
    "GIT_WORK_TREE",
    "GIT_CEILING_DIRECTORIES",
    "GIT_DISCOVERY_ACROSS_FILESYSTEM",
    "GIT_COMMON_DIR",
)


def git_root(path: Path) -> Path | None:
    """The git work tree holding `path`, if any (diff paths are relative to it)."""
    if not any(name in os.environ for name in _GIT_DISCOVERY_ENV):
        found = _discover(path)
        if found is not False:
            return found
    try:
        out = subprocess.run(
            ["git", "-C", str(path.resolve().parent), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return _nearest_dot_git(path)
    if out.returncode == 0 and out.stdout.strip():
        return Path(out.stdout.strip())
    if "not a git repository" in out.stderr:
        return None
    return _nearest_dot_git(path)


def _discover(path: Path) -> Path | Literal[False] | None:
    """git's own discovery, without starting git (a process per run costs more than the diff): the
    nearest folder up from the file holding a `.git` folder with a HEAD or a `.git` file pointing
    to one (a worktree, a submodule). False when it is not that simple (a folder that is itself a
    git directory, a `.git` that does not look like one): then git is asked."""
    for folder in path.resolve().parents:
        dot_git = folder / ".git"
        try:
            if dot_git.is_dir():
                return folder if (dot_git / "HEAD").is_file() else False
            if dot_git.is_file():
                with open(dot_git, "rb") as handle:
                    return folder if handle.read(8) == b"gitdir: " else False
            if (folder / "HEAD").is_file() and (folder / "objects").is_dir():
                return False  # inside a bare repository or a .git folder
        except OSError:
            return False
    return None


def _nearest_dot_git(path: Path) -> Path | None:
    """Where git cannot answer (a repository owned by someone else, which it calls dubious; a
    broken config; no git installed), the work tree is still the nearest folder holding .git,
    found without running git in it."""
    for folder in path.resolve().parents:
        if (folder / ".git").exists():
            return folder
    return None
