"""The events of a torch.profiler Chrome trace that `msrewrite profile` reads, found without
decoding the rest.

Most of a kineto trace is CPU ops, Python frames and flow arrows; the reader needs only the `X`
events of six categories (kernel, gpu_memcpy, gpu_memset, gpu_user_annotation, user_annotation,
cuda_runtime), and of those only a few fields. Decoding every event with `json` costs about 50x
the time of reading the file, so the trace is scanned in chunks by one regular expression that
stops at every `"ph"` key and, in C:
  - reads a needed event whole when it is written the way kineto, torch's CUPTI monitor
    (`torch/profiler/_cupti_monitor_trace.py`) and `json.dump` of such a dict write it: keys
    `ph, cat, name, pid, tid, ts, dur[, args]` in that order, any JSON whitespace, an `args`
    object without nested objects, the event closed and followed by `,` + `{` or by `]`;
  - passes over an event whose `ph` is not "X", or whose `cat` (the key after `ph`) is a plain
    string naming none of the six categories;
  - flags anything else at a `"ph"` key.
Every `"ph"` key outside a needed event's own text is one of the three, so no event is passed
over unseen. A chunk holding a flag, a needed event without `args` after `ph`, an `args` with
`correlation` twice (or the word where it is not the key), a `\\u00XX` escape (which could spell
a key) or a field json cannot decode (so the scan misread it) is decoded by `json` instead; a
value that is not a plain number (a string `ts`) or a name with escapes is decoded by `json` on
its own. Chunks are cut where an event starts with `{ "ph"`, so each one is a run of whole
events. The last event and whatever follows the array are always decoded by `json`.

The one form read differently from `json.load`: an object shaped like a needed event nested in
an array inside another event, or a second `cat` key later in an event whose first one names
another category. No writer emits either (kineto's and the CUPTI monitor's events nest nothing
in arrays and name each key once).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from itertools import compress, repeat
from operator import add, itemgetter
from pathlib import Path
from typing import NamedTuple, cast

from msrewrite.profile.jsonstream import CHUNK, TraceFormatError, _open_array

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
CATS = DEVICE_CATS + ("gpu_user_annotation", "user_annotation", "cuda_runtime")
MAX_CARRY = 64 << 20  # no event start seen for this long: not a trace this scanner can cut

_W = rb"[ \t\n\r]*+"
_SEP = _W + rb"," + _W
_ALT = b"|".join(c.encode() for c in CATS)


def _key(name: bytes) -> bytes:
    return rb'"' + name + rb'"' + _W + rb":" + _W


# groups: 1 cat, 2 name, 3 pid, 4 tid, 5 ts, 6 dur, 7 "{" when args is there, 8 the args object's
# inner text, 9 flag. Keys before "ph" are not read: json keeps a repeated key's last value, so
# they lose to these, except an args there when none follows (group 7 empty: json decides).
_NEEDED = (
    rb'"('
    + _ALT
    + rb')"'
    + _SEP
    + _key(b"name")
    + rb'"([^"]*+)"'
    + _SEP
    + _key(b"pid")
    + rb"([^,]*+),"
    + _W
    + _key(b"tid")
    + rb"([^,]*+),"
    + _W
    + _key(b"ts")
    + rb"([^,]*+),"
    + _W
    + _key(b"dur")
    + rb"([^,}]*+)"
    + rb"(?:,"
    + _W
    + _key(b"args")
    + rb"(\{)([^}]*+)\})?"
    + _W
    + rb"\}(?="
    + _W
    + rb"(?:,"
    + _W
    + rb"\{|\]))"
)
_OTHER_CAT = rb'"(?!(?:' + _ALT + rb')")[^"]*+"'
_NOT_X = rb'"(?!X")[^"]*+"'
_SCAN = re.compile(
    rb'"ph"(?<!\\"ph")(?:'
    + _W
    + rb":"
    + _W
    + rb'(?:"X"'
    + _SEP
    + _key(b"cat")
    + rb"(?:"
    + _NEEDED
    + rb"|"
    + _OTHER_CAT
    + rb")|"
    + _NOT_X
    + rb")|(?=(.)))",
    re.S,
)
_CORRELATION = re.compile(rb'"correlation"' + _W + rb":" + _W + rb"([^,}]*+)")
_ASCII_ESCAPE = re.compile(rb"\\u00[0-7]")
_SPACE = b" \t\n\r"


class Unusual(Exception):
    """The trace cannot be cut into runs of whole events here: read it with the exact reader."""


class Decode(Exception):
    """A raw field is not what the scan took it for: decode this chunk with `json`."""


class Segment:
    """A run of whole events: `rows` (scanned in C: {"device" | "gpu_user_annotation" |
    "user_annotation" | "cuda_runtime": Columns}) or `events` (dicts decoded by json);
    `decode()` gives the same run decoded by json."""

    __slots__ = ("rows", "events", "_buf", "_pos", "_cut")

    def __init__(self, rows=None, events=None, buf: bytes = b"", pos: int = 0, cut: int = 0) -> None:
        self.rows, self.events, self._buf, self._pos, self._cut = rows, events, buf, pos, cut

    def decode(self) -> list[dict]:
        return self.events if self.events is not None else _decode_run(self._buf[self._pos : self._cut])


def chunks(path: Path, chunk: int = CHUNK) -> Iterator[Segment]:
    """The trace's event array as Segments in file order; raises Unusual when the file must be
    read another way."""
    with open(path, "rb") as f:
        buf, eof, pos = _open_array(f, chunk)
        while True:
            cut = _last_event_start(buf, pos)
            if cut is None:
                if eof:
                    yield Segment(events=_decode_tail(buf, pos))
                    return
                if len(buf) - pos > MAX_CARRY:
                    raise Unusual
                more = f.read(chunk)
                eof = len(more) < chunk
                buf = buf[pos:] + more
                pos = 0
                continue
            yield _segment(buf, pos, cut)
            if eof:
                yield Segment(events=_decode_tail(buf, cut))
                return
            more = f.read(chunk)
            eof = len(more) < chunk
            buf, pos = buf[cut:] + more, 0


def _last_event_start(buf: bytes, pos: int) -> int | None:
    """Offset of the last `{` after `pos` that opens an array element with `"ph"` as its first
    key (a `,` before it), or None."""
    hi = len(buf)
    while True:
        q = buf.rfind(b'"ph"', pos + 1, hi)
        if q < 0:
            return None
        j = q - 1
        while j > pos and buf[j] in _SPACE:
            j -= 1
        if buf[j] == 0x7B:  # {
            k = j - 1
            while k > pos and buf[k] in _SPACE:
                k -= 1
            if k > pos and buf[k] == 0x2C:  # ,
                return j
        hi = q


def _segment(buf: bytes, pos: int, cut: int) -> Segment:
    if buf.find(b"\\", pos, cut) >= 0 and _ASCII_ESCAPE.search(buf, pos, cut):
        return Segment(events=_decode_run(buf[pos:cut]))
    rows = _SCAN.findall(buf, pos, cut + 1)
    if any(map(itemgetter(8), rows)):
        return Segment(events=_decode_run(buf[pos:cut]))
    groups: dict[str, list[tuple]] = {
        "device": [],
        "gpu_user_annotation": [],
        "user_annotation": [],
        "cuda_runtime": [],
    }
    route = {c.encode(): groups["device" if c in DEVICE_CATS else c].append for c in CATS}
    for row in filter(itemgetter(0), rows):  # file order kept within each group
        route[row[0]](row)
    columns = {}
    for group, got in groups.items():
        if not got:
            continue
        _, names, pids, tids, tss, durs, opened, args, _ = zip(*got, strict=True)
        if not all(opened):  # no args after "ph": one before it would be the event's args
            return Segment(events=_decode_run(buf[pos:cut]))
        counts = list(map(bytes.count, args, repeat(b'"correlation"')))
        has = list(map(bool, counts))
        joined = b"}".join(compress(args, has))  # an args text holds no "}"
        correlations = _CORRELATION.findall(joined)
        if not len(correlations) == sum(has) == sum(counts) or b'\\"correlation"' in joined:
            # a second correlation key, or the word where it is not a key: let json say
            return Segment(events=_decode_run(buf[pos:cut]))
        columns[group] = Columns(names, pids, tids, tss, durs, args, has, correlations)
    return Segment(rows=columns, buf=buf, pos=pos, cut=cut)


class Columns(NamedTuple):
    """One group's events in a chunk, field by field (raw texts); `has` says which events carry
    args.correlation, `correlations` holds those values in order."""

    names: tuple[bytes, ...]
    pids: tuple[bytes, ...]
    tids: tuple[bytes, ...]
    ts: tuple[bytes, ...]
    dur: tuple[bytes, ...]
    args: tuple[bytes, ...]
    has: list[bool]
    correlations: list[bytes]


def _decode_run(text: bytes) -> list[dict]:
    """A run of whole events, `{...}, {...},` (the comma before the next chunk's first event)."""
    body = text.rstrip(_SPACE)
    if body.endswith(b","):
        body = body[:-1]
    if not body.strip(_SPACE):
        return []
    try:
        events = json.loads(b"[" + body + b"]")
    except ValueError:
        raise Unusual from None
    if not all(isinstance(e, dict) for e in events):
        raise Unusual
    return events


def _decode_tail(buf: bytes, pos: int) -> list[dict]:
    """The rest of the event array, decoded exactly, up to its `]`."""
    decoder = json.JSONDecoder()
    text = buf[pos:].decode(json.detect_encoding(buf[pos:]) if pos < len(buf) else "utf-8", "surrogatepass")
    events: list[dict] = []
    i, n = 0, len(text)
    while True:
        while i < n and text[i] in " \t\n\r":
            i += 1
        if i >= n:
            raise TraceFormatError("the event array is not closed (file cut short?)")
        if text[i] == "]":
            return events
        if text[i] != "{":
            raise TraceFormatError(f"unexpected byte {text[i].encode()!r} in the event array")
        try:
            event, i = decoder.raw_decode(text, i)
        except ValueError:
            raise TraceFormatError("malformed or cut-short event in the event array") from None
        events.append(event)
        while i < n and text[i] in " \t\n\r":
            i += 1
        if i < n and text[i] == ",":
            i += 1
        elif i < n and text[i] != "]":
            raise TraceFormatError(f"unexpected byte {text[i].encode()!r} in the event array")


# Turning a chunk's raw fields into values --------------------------------------------------------
class Values:
    """Raw field texts to Python values, as `json` decodes them; repeated texts decoded once."""

    def __init__(self) -> None:
        self.names: dict[bytes, str] = {}
        self.values: dict[bytes, object] = {}

    def name_list(self, raws) -> list[str]:
        """A string's text (between its quotes) decoded: UTF-8, as json reads bytes, and escapes."""
        cache = self.names
        for raw in set(raws).difference(cache):
            # a JSON string literal decodes to a str
            cache[raw] = (
                cast(str, _decoded(b'"' + raw + b'"')) if b"\\" in raw else raw.decode("utf-8", "surrogatepass")
            )
        return list(map(cache.__getitem__, raws))

    def value(self, raw: bytes) -> object:
        try:
            return self.values[raw]
        except KeyError:
            value = _decoded(raw)
            if len(self.values) < 100_000:
                self.values[raw] = value
            return value


def _decoded(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        raise Decode from None


def floats(raws, what: str, number) -> list[float]:
    """float() of each raw number (float() of a JSON number's text is the float of its value); a
    value that is not a plain number is decoded by json and goes through `number`, the reader's
    own conversion, which says when it is not a number."""
    try:
        return list(map(float, raws))
    except ValueError:
        out = []
        for raw in raws:
            try:
                out.append(float(raw))
            except ValueError:
                out.append(number(_decoded(raw), what))
        return out


def ints(raws, convert) -> list[int]:
    """int() of each raw integer; anything else decoded by json and given to `convert`."""
    try:
        return list(map(int, raws))
    except ValueError:
        out = []
        for raw in raws:
            try:
                out.append(int(raw))
            except ValueError:
                out.append(convert(_decoded(raw)))
        return out


def ends(starts: list[float], durs: list[float]) -> list[float]:
    return list(map(add, starts, durs))
