"""`apply -i`: replace a file atomically, and never over a change made since it was read.

The new text goes to a temporary file beside the real file (a symlink's target, not the link),
with the file's mode (and owner, where allowed), and is renamed over it. Right before the rename, under an advisory lock on
the file's folder that every msrewrite `-i` run takes, the file is read again and compared with
the bytes the edit was made from: a save in an editor or a second `-i` run in between makes this
run fail with nothing written, instead of one of the two changes being lost. SIGINT, SIGTERM and
SIGHUP during the write remove the temporary file.

A file with other hard links is rewritten in place instead (the same inode, so every link sees the
edit; a rename would leave the other names on the old text): after the same check under the same
lock, with SIGINT, SIGTERM and SIGHUP noted but acted on only once it is done, the space reserved first, and the
old bytes written back if the write fails. Only a crash or SIGKILL in the middle of that one write
could leave the file partly written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import tempfile
import time
from pathlib import Path

from msrewrite.errors import BadInput
from msrewrite.load import file_digest

LOCK_WAIT_S = 10.0


class Interrupted(BadInput):
    """A signal arrived while writing: the temporary file is gone and the file is untouched."""


@contextlib.contextmanager
def signals_interrupt():
    """SIGTERM and SIGHUP raise (as SIGINT already does), so cleanup code runs."""

    def handler(signum, _frame):
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}; nothing written")

    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals stay as they are
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def folder_lock(folder: Path, label: str):
    """An exclusive flock on the folder, waited for up to LOCK_WAIT_S."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # an unreadable folder cannot be locked; the content check still runs
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    break  # a file system without flock: rely on the content check
                if time.monotonic() > deadline:
                    raise BadInput(
                        f"{label}: another msrewrite run holds the lock on its folder; nothing written, try again"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def write_in_place(path: Path, data: bytes, read_digest: str) -> Path:
    """Replace the file at `path` (through a symlink) with `data`, if it still holds the bytes
    whose sha256 is `read_digest`. Returns the file actually written."""
    real = Path(os.path.realpath(path))
    if not os.access(real, os.W_OK) or not os.access(real.parent, os.W_OK):
        raise BadInput(f"{path}: read-only, cannot edit in place")
    tmp: str | None = None
    with signals_interrupt():
        try:
            with folder_lock(real.parent, str(path)):
                info = os.stat(real)
                with open(real, "rb") as handle:
                    current = handle.read()
                if file_digest(current) != read_digest:
                    raise BadInput(
                        f"{path}: changed on disk since msrewrite read it (saved in an editor, or "
                        "another run); nothing written, run again on the new version"
                    )
                if info.st_nlink > 1:
                    _write_linked(path, real, data, current)
                    return real
                fd, tmp = tempfile.mkstemp(prefix=f".{real.name}.", suffix=".msrewrite", dir=real.parent)
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                with contextlib.suppress(OSError):  # keep the owner where we may (root editing a user's file)
                    os.chown(tmp, info.st_uid, info.st_gid)
                os.chmod(tmp, info.st_mode & 0o7777)  # after chown, which clears set-id bits
                os.replace(tmp, real)
                tmp = None
        except OSError as exc:
            raise BadInput(f"{path}: cannot write ({exc.strerror or exc}); the file is unchanged") from None
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
    return real


def _write_linked(path: Path, real: Path, data: bytes, old: bytes) -> None:
    """Overwrite a hard-linked file in place, SIGINT/SIGTERM/SIGHUP held (noted, acted on after
    the write); on a failure put `old` back."""
    held: list[int] = []
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            previous[sig] = signal.signal(sig, lambda signum, _frame: held.append(signum))
    except ValueError:  # not the main thread: signals stay as they are
        pass
    try:
        with open(real, "r+b") as handle:
            fd = handle.fileno()
            try:
                if len(data) > len(old):  # reserve the space first: a full disk fails here, file intact
                    os.posix_fallocate(fd, 0, len(data))
                handle.write(data)
                handle.truncate(len(data))
                handle.flush()
                os.fsync(fd)
            except OSError as exc:
                try:
                    handle.seek(0)
                    handle.write(old)
                    handle.truncate(len(old))
                    handle.flush()
                    restored = "the file is unchanged"
                except OSError:
                    restored = "the file may be partly written: restore it from version control"
                raise BadInput(f"{path}: cannot write ({exc.strerror or exc}); {restored}") from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:  # a signal that waited for the write: it is done, say so
        raise Interrupted(f"interrupted by {signal.Signals(held[0]).name} after {path} was rewritten in place")
