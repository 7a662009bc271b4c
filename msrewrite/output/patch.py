"""`git format-patch`-style mbox files that `git am` applies in order."""

from __future__ import annotations

import email.utils
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

from msrewrite import __version__
from msrewrite.errors import BadInput
from msrewrite.output.diff import diffstat, unified_diff
from msrewrite.output.inplace import signals_interrupt
from msrewrite.records import record


@record
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


def _numbered_patches(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if re.fullmatch(r"\d{4}-.*\.patch", p.name))


def write_series(steps: list[PatchStep], folder: Path, force: bool = False) -> list[Path]:
    """Write 0001-<slug>.patch ... into `folder`; returns the paths in order.

    The series is written into a temporary folder beside `folder` and then renamed into place, so
    a failure (a full disk, a signal) leaves no partial series and no temporary file. A folder
    that already holds a numbered series is refused unless `force`, which replaces that series."""
    label = f"-o {folder}"
    files = [
        (f"{number:04d}-{slug(step.subject)}.patch", format_patch(step, number, len(steps)))
        for number, step in enumerate(steps, start=1)
    ]
    if folder.is_dir():
        old = _numbered_patches(folder)
        if old and not force:
            raise BadInput(
                f"{label}: already holds {len(old)} patch file(s) ({old[0].name}, ...); "
                "pass --force to replace them, or choose an empty folder"
            )
    elif folder.exists():
        raise BadInput(f"{label}: exists and is not a folder")
    else:
        old = []
    created = _first_missing(folder)
    staging: Path | None = None
    try:
        with signals_interrupt():
            folder.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".msrewrite", dir=folder.parent))
            for name, text in files:
                with open(staging / name, "w", encoding="utf-8", newline="") as handle:
                    handle.write(text)
                    handle.flush()
                    os.fsync(handle.fileno())
            if not folder.exists():
                os.rename(staging, folder)
                staging = None
            else:
                for path in old:
                    path.unlink()
                for name, _ in files:
                    os.replace(staging / name, folder / name)
    except BaseException as exc:
        if created is not None and not (created == folder and staging is None):
            shutil.rmtree(created, ignore_errors=True)
        if isinstance(exc, OSError):
            raise BadInput(f"{label}: cannot write the patches ({exc.strerror or exc}); nothing written") from None
        raise
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return [folder / name for name, _ in files]


def _first_missing(folder: Path) -> Path | None:
    """The outermost folder of `folder`'s path that does not exist yet (removed again on failure)."""
    missing = None
    for path in [folder, *folder.parents]:
        if path.exists():
            break
        missing = path
    return missing


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
    try:
        tmp.write_text(APPLY_SCRIPT, encoding="utf-8")
        tmp.chmod(0o755)
        tmp.replace(path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise BadInput(f"{path}: cannot write ({exc.strerror or exc})") from None
    return path
