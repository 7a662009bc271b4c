"""Unified diffs that `git apply` and `patch -p1` accept.

Lines are split as git splits them: at "\\n" only. Python's str.splitlines also breaks at a form
feed, \\x85, U+2028 and lone CRs, which git keeps inside a line, so a diff built from it does not
apply. A CRLF line keeps its CR as part of the line, as git does.
"""

from __future__ import annotations

import difflib


def git_lines(text: str) -> list[str]:
    """`text` split after each "\\n" (the last line may have none)."""
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def git_blob_id(text: str) -> str:
    import hashlib  # only patch series carry blob ids

    data = text.encode("utf-8")
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def unified_diff(old: str, new: str, relpath: str, git_header: bool = False) -> str:
    """`a/relpath` -> `b/relpath` diff; with git_header, the `diff --git` and `index` lines too."""
    lines = list(
        difflib.unified_diff(
            git_lines(old),
            git_lines(new),
            fromfile=f"a/{relpath}",
            tofile=f"b/{relpath}",
            n=3,
        )
    )
    for i, line in enumerate(lines):
        if not line.endswith("\n"):  # a file without a final newline
            lines[i] = line + "\n\\ No newline at end of file\n"
    body = "".join(lines)
    if git_header and body:
        header = f"diff --git a/{relpath} b/{relpath}\nindex {git_blob_id(old)[:12]}..{git_blob_id(new)[:12]} 100644\n"
        body = header + body
    return body


def diffstat(old: str, new: str, relpath: str) -> tuple[str, int, int]:
    added = removed = 0
    for line in difflib.unified_diff(git_lines(old), git_lines(new), n=0):
        if line.startswith("+") and not line.startswith("+++"):
            added += 1
        elif line.startswith("-") and not line.startswith("---"):
            removed += 1
    total = added + removed
    width = min(total, 60)
    bar = "+" * round(width * added / total) + "-" * (width - round(width * added / total)) if total else ""
    line = f" {relpath} | {total} {bar}".rstrip()
    summary = " 1 file changed"
    if added or not removed:
        summary += f", {added} insertion{'s' if added != 1 else ''}(+)"
    if removed:
        summary += f", {removed} deletion{'s' if removed != 1 else ''}(-)"
    return line + "\n" + summary + "\n", added, removed
