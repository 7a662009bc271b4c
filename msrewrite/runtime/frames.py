"""Find the user's frame behind an op or an API call.

"User" means outside torch, msrewrite itself and the Python standard library,
so that an op is attributed to the model line that launched it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import types
from functools import lru_cache

import torch

import msrewrite


def _dir(path: str) -> str:
    return os.path.join(os.path.realpath(path), "")


_INTERNAL_DIRS = (_dir(os.path.dirname(torch.__file__)), _dir(os.path.dirname(msrewrite.__file__)))
_STDLIB_DIR = _dir(sysconfig.get_paths()["stdlib"])
_RUNTIME_DIR = os.path.join(os.path.dirname(os.path.realpath(__file__)), "")


@lru_cache(maxsize=4096)
def is_internal(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen ...>, <string> from exec stays user code
        return filename.startswith("<frozen")
    real = os.path.realpath(filename)
    if real.startswith(_INTERNAL_DIRS):
        return True
    # Third-party packages (transformers models) are user code even under the stdlib prefix.
    return real.startswith(_STDLIB_DIR) and "site-packages" not in real


@lru_cache(maxsize=4096)
def is_runtime(filename: str) -> bool:
    return os.path.realpath(filename).startswith(_RUNTIME_DIR)


@lru_cache(maxsize=4096)
def _real(filename: str) -> str:
    return os.path.realpath(filename)


def user_frame(start: types.FrameType | None = None, user_files: frozenset[str] | None = None):
    """The innermost frame in ``user_files`` (when given), else outside internals; None if none."""
    frame: types.FrameType | None = start if start is not None else sys._getframe(1)
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        if not is_internal(name):
            if not user_files or _real(name) in user_files:
                return frame
            if fallback is None and not _is_tooling(name):
                fallback = frame
        frame = frame.f_back
    return fallback


_TOOLING = ("typer", "click", "_pytest", "pytest", "pluggy", "rich")


@lru_cache(maxsize=4096)
def _is_tooling(filename: str) -> bool:
    """Frames of the command line or test runner that called the model: never a useful location."""
    real = os.path.realpath(filename)
    if sys.argv and sys.argv[0] and real == os.path.realpath(sys.argv[0]):  # the console script
        return True
    parts = real.split(os.sep)
    return "site-packages" in parts and parts[parts.index("site-packages") + 1] in _TOOLING


def in_files(frame: types.FrameType, files: frozenset[str]) -> bool:
    """Is ``frame`` in one of ``files`` (normalize_files' real paths)?"""
    return _real(frame.f_code.co_filename) in files


def location(frame: types.FrameType | None) -> tuple[str, int]:
    if frame is None:
        return ("<after the module returned>", 0)
    return (frame.f_code.co_filename, frame.f_lineno)


def normalize_files(paths) -> frozenset[str]:
    return frozenset(os.path.realpath(os.fspath(p)) for p in paths or ())
