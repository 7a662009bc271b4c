"""Events of a Chrome trace, read incrementally: never the whole file in memory, never json.load.

A trace is either `{"traceEvents": [event, ...], ...}` (torch.profiler's `export_chrome_trace`,
kineto) or a bare `[event, ...]` (torch_npu's `trace_view.json`). The file is read in chunks; each
element of the event array is cut out of the chunk and decoded on its own. `keep` sees an event's
raw text first: a trace of hundreds of MB is mostly CPU ops and flow arrows, and an event whose
text holds none of the words the caller needs is skipped without being decoded.

Cutting an element: the fast path cuts at `},{` separators (found in C) and decodes each piece
alone; a separator inside an event (in a string, or a list of objects in `args`) makes a piece
undecodable, which is detected, and the file is then read by the exact path: a string-aware regex
per element, or `json.JSONDecoder.raw_decode` for deeper nesting. An unusual trace is slower,
never read wrong.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

CHUNK = 1 << 22  # 4 MiB

_STR = rb'"(?:[^"\\]|\\.)*"'
_FLAT = rb"(?:[^{}\"]|" + _STR + rb")*"
_LEVEL1 = rb"\{" + _FLAT + rb"\}"
_LEVEL2 = rb"\{(?:[^{}\"]|" + _STR + rb"|" + _LEVEL1 + rb")*\}"
_OBJECT = re.compile(rb"\{(?:[^{}\"]|" + _STR + rb"|" + _LEVEL2 + rb")*\}", re.S)
_SPACE = re.compile(rb"[ \t\r\n,]*")
_SEPARATOR = re.compile(rb"\}[ \t\r\n]*,[ \t\r\n]*\{")
_EVENTS_KEY = re.compile(rb'"traceEvents"\s*:\s*\[')


class TraceFormatError(ValueError):
    """The file is not a Chrome trace: said in one line."""


def iter_events(path: Path, keep: Callable[[bytes], object] | None = None, chunk: int = CHUNK) -> Iterator[dict]:
    """Every event (a dict) of the trace's event array, in file order; with `keep`, only events
    whose raw text `keep` accepts are decoded and yielded."""
    done = 0
    try:
        for event in _split_events(path, keep, chunk):
            done += 1
            yield event
        return
    except _Miscut:
        pass
    for index, event in enumerate(_exact_events(path, keep, chunk)):  # same events, same order
        if index >= done:
            yield event


class _Miscut(Exception):
    """A separator matched inside an event (a string or a nested list of objects)."""


def _split_events(path: Path, keep: Callable[[bytes], object] | None, chunk: int) -> Iterator[dict]:
    """The fast path: elements cut at `}` `,` `{` separators. A cut inside an element leaves both
    halves undecodable alone, and the half holding what `keep` looks for is decoded, so a miscut
    raises _Miscut instead of losing or inventing an event."""
    with open(path, "rb") as f:
        buf, eof, pos = _open_array(f, chunk)
        while True:
            pos = _SPACE.match(buf, pos).end()  # type: ignore[union-attr]  # _SPACE matches the empty string
            ends = [m.start() + 1 for m in _SEPARATOR.finditer(buf, pos)]
            if eof:
                close = buf.rfind(b"]")
                last = buf.rfind(b"}", pos, close if close >= 0 else len(buf))
                if close < 0 or buf[max(last + 1, pos) : close].strip(b" \t\r\n"):
                    raise _Miscut
                if last >= pos:
                    ends.append(last + 1)
            kept = []
            for end in ends:
                if keep is None or keep(buf[pos:end]):
                    kept.append(buf[pos:end])
                pos = _SPACE.match(buf, end).end()  # type: ignore[union-attr]  # _SPACE matches the empty string
            # One decode per chunk. Two halves of a miscut event, both kept, join back into one
            # element: the count then falls short, which is how that miscut is caught.
            try:
                events = json.loads(b"[" + b",".join(kept) + b"]")
            except ValueError:
                raise _Miscut from None
            if len(events) != len(kept):
                raise _Miscut
            yield from events
            if eof:
                return
            buf, pos, eof = _read_on(f, buf, pos, chunk)


def _open_array(f, chunk: int) -> tuple[bytes, bool, int]:
    buf = f.read(chunk)
    eof = len(buf) < chunk
    start = _array_start(buf)
    while start is None and not eof:  # the key may come after other top-level fields
        more = f.read(chunk)
        eof = len(more) < chunk
        buf += more
        start = _array_start(buf)
    if start is None:
        raise TraceFormatError("no traceEvents array (not a Chrome trace)")
    return buf, eof, start


def _exact_events(path: Path, keep: Callable[[bytes], object] | None, chunk: int) -> Iterator[dict]:
    """The exact path: each element matched by a string-aware regex, or decoded by raw_decode."""
    decoder = json.JSONDecoder()
    with open(path, "rb") as f:
        buf, eof, pos = _open_array(f, chunk)
        while True:
            pos = _SPACE.match(buf, pos).end()  # type: ignore[union-attr]  # _SPACE matches the empty string
            if pos >= len(buf):
                if eof:
                    raise TraceFormatError("the event array is not closed (file cut short?)")
                buf, pos, eof = _read_on(f, buf, pos, chunk)
                continue
            head = buf[pos : pos + 1]
            if head == b"]":
                return
            if head != b"{":
                raise TraceFormatError(f"unexpected byte {head!r} in the event array")
            m = _OBJECT.match(buf, pos)
            if m is not None and (m.end() < len(buf) or eof):
                text = m.group()
                if keep is None or keep(text):
                    yield json.loads(text)
                pos = m.end()
                continue
            if m is None:  # deeper nesting than the regex follows, or the element is cut by the chunk
                try:
                    event, end = _raw(decoder, buf, pos)
                except ValueError:
                    if eof:
                        raise TraceFormatError("malformed or cut-short event in the event array") from None
                else:
                    if keep is None or keep(buf[pos:end]):
                        yield event
                    pos = end
                    continue
            buf, pos, eof = _read_on(f, buf, pos, chunk)


def _read_on(f, buf: bytes, pos: int, chunk: int) -> tuple[bytes, int, bool]:
    """The unread rest of the buffer with the next chunk appended."""
    more = f.read(chunk)
    return buf[pos:] + more, 0, len(more) < chunk


def _raw(decoder: json.JSONDecoder, buf: bytes, pos: int) -> tuple[dict, int]:
    """Decode one element exactly; returns (event, end offset in bytes)."""
    text = buf[pos:].decode("utf-8", "surrogateescape")
    event, end_char = decoder.raw_decode(text)
    return event, pos + len(text[:end_char].encode("utf-8", "surrogateescape"))


def _array_start(buf: bytes) -> int | None:
    """Offset just after the `[` that opens the event array, or None when not seen yet."""
    head = buf.lstrip()
    if head.startswith(b"["):
        return len(buf) - len(head) + 1
    m = _EVENTS_KEY.search(buf)
    return m.end() if m else None
