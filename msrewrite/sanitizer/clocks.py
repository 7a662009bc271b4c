"""Vector clocks per stream, as in torch.cuda._sanitizer (CSAN).

Every launch bumps a global sequence number and stores it in its stream's own
entry; ``clocks[s][t]`` is the last sequence number on ``t`` known complete
before new work on ``s``. Event record snapshots a clock, event wait merges it,
host synchronization merges into every stream through the host clock.
"""

from __future__ import annotations

Clock = dict  # stream -> sequence number


def _merge(into: Clock, other: Clock) -> None:
    for stream, seq in other.items():
        if seq > into.get(stream, 0):
            into[stream] = seq


class VectorClocks:
    def __init__(self) -> None:
        self.seq = 0
        self._clocks: dict[object, Clock] = {}
        self._events: dict[object, Clock] = {}
        self._host: Clock = {}

    def clock(self, stream) -> Clock:
        if stream not in self._clocks:
            self._clocks[stream] = dict(self._host)  # a new stream starts after what the host saw
        return self._clocks[stream]

    def streams(self) -> list:
        return list(self._clocks)

    def launch(self, stream) -> int:
        self.seq += 1
        self.clock(stream)[stream] = self.seq
        return self.seq

    def covers(self, stream, seq: int, other) -> bool:
        """Is work number ``seq`` on ``other`` ordered before new work on ``stream``?"""
        return other is stream or seq <= self.clock(stream).get(other, 0)

    def host_covers(self, stream, seq: int) -> bool:
        """Has the host waited for work number ``seq`` on ``stream``?"""
        return seq <= self._host.get(stream, 0)

    def merge(self, stream, snapshot: Clock) -> None:
        _merge(self.clock(stream), snapshot)

    def record_event(self, event, stream) -> None:
        self._events[event] = dict(self.clock(stream))

    def wait_event(self, event, stream) -> None:
        if event in self._events:
            self.merge(stream, self._events[event])

    def host_waits(self, snapshot: Clock) -> None:
        _merge(self._host, snapshot)
        for clock in self._clocks.values():
            _merge(clock, snapshot)

    def sync_stream(self, stream) -> None:
        self.host_waits(dict(self.clock(stream)))

    def sync_event(self, event) -> None:
        if event in self._events:
            self.host_waits(self._events[event])

    def sync_all(self) -> None:
        everything: Clock = {}
        for clock in self._clocks.values():
            _merge(everything, clock)
        self.host_waits(everything)
