"""`git format-patch`-style mbox files that `git am` applies in order."""

from __future__ import annotations

import email.utils
import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from msrewrite import __version__
from msrewrite.errors import BadInput
from msrewrite.output.diff import diffstat, unified_diff


@dataclass
class PatchStep:
    subject: str
    body: str
    old: str
    new: str
    relpath: str


def _author() -> str:
    def git_config(key: str) -> str:
        try:
            out = subprocess.run(["git", "config", key], capture_output=True, text=True, timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            return ""
        return out.stdout.strip()

    name, mail = git_config("user.name"), git_config("user.email")
    return f"{name or 'msrewrite'} <{mail or 'msrewrite@localhost'}>"


def slug(subject: str) -> str:
    """git format-patch's file-name slug: lower case, runs of other characters become '-'."""
    text = re.sub(r"[^A-Za-z0-9._]+", "-", subject).strip("-.")
    return text[:52].rstrip("-.") or "patch"


def format_patch(step: PatchStep, number: int, total: int, date: str | None = None) -> str:
    diff = unified_diff(step.old, step.new, step.relpath, git_header=True)
    stat, _, _ = diffstat(step.old, step.new, step.relpath)
    sha = hashlib.sha1((step.subject + diff).encode()).hexdigest()
    prefix = "[PATCH]" if total == 1 else f"[PATCH {number}/{total}]"
    date = date or email.utils.formatdate(localtime=True)
    body = step.body.strip()
    return (
        f"From {sha} Mon Sep 17 00:00:00 2001\n"
        f"From: {_author()}\n"
        f"Date: {date}\n"
        f"Subject: {prefix} {step.subject}\n"
        "\n"
        + (body + "\n" if body else "")
        + "---\n"
        + stat
        + "\n"
        + diff
        + "-- \n"
        + f"msrewrite {__version__}\n"
        + "\n"
    )


def write_series(steps: list[PatchStep], folder: Path) -> list[Path]:
    """Write 0001-<slug>.patch ... into `folder`; returns the paths in order."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BadInput(f"-o {folder}: cannot create the folder ({exc.strerror or exc})") from None
    paths = []
    for number, step in enumerate(steps, start=1):
        path = folder / f"{number:04d}-{slug(step.subject)}.patch"
        text = format_patch(step, number, len(steps))
        tmp = path.with_suffix(".patch.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        paths.append(path)
    return paths


APPLY_SCRIPT = """#!/usr/bin/env bash
# Apply every stage of this patch series in order, as cann-recipes' apply_patches.sh does.
# Run it from the root of a clean checkout of the target repository.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
for stage in $(ls -d "$here"/stage*/ | sort -V); do
    echo "applying ${stage%/}"
    git am --keep-cr "$stage"*.patch
done
"""


def is_stage_folder(folder: Path) -> bool:
    return re.fullmatch(r"stage\d+", folder.name) is not None


def write_apply_script(series_root: Path) -> Path:
    """apply_patches.sh beside the stage folders; the same text whichever stage wrote it."""
    path = series_root / "apply_patches.sh"
    tmp = path.with_suffix(".sh.tmp")
    tmp.write_text(APPLY_SCRIPT, encoding="utf-8")
    tmp.chmod(0o755)
    tmp.replace(path)
    return path
