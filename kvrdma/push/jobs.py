"""What a producer keeps while pushing: each request (`Job`), each decoder rank's copy of it
(`Target`) and each decoder rank's agent loaded to write into (`Decoder`), and how its
tables are keyed and aged."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from kvrdma.metadata import sha256_hex
from kvrdma.nixl.protocol import DescList, Xfer
from kvrdma.push import wire
from kvrdma.push.plan import WritePlan

Key = tuple[str, int]  # (decoder engine, decoder rank)


def key_of(m: wire.Expect | wire.Abort) -> Key:
    """The decoder rank a message is from."""
    if isinstance(m, wire.Expect):
        return m.decoder.engine_id, m.decoder.tp_rank
    return m.decoder_engine, m.decoder_rank


def older(table: Mapping[str, tuple[float, object]], cutoff: float) -> list[str]:
    """The leading keys of time-ordered `table` whose time is before `cutoff`."""
    out = []
    for key, (at, _) in table.items():
        if at >= cutoff:
            break
        out.append(key)
    return out


@dataclass
class Decoder:
    """One decoder rank loaded into this producer's agent."""

    agent: str
    sha256: str
    plan: WritePlan | None  # None: the decoder reads nothing from this rank
    engine_id: str  # what a notification lost on the way to it is counted against
    local: DescList | None = None  # this producer's memory, entry by entry of the plan
    remote: DescList | None = None  # the decoder's memory
    last_used: float = 0.0  # when an Expect last named it
    replaced: frozenset[str] = frozenset()  # its rank's former agents (`wire.Expect.replaced`)
    refused: str | None = None  # why nothing is written to it: loaded only to be answered

    def release(self) -> None:
        for dl in (self.local, self.remote):
            if dl is not None:
                dl.release()


@dataclass
class Unloaded:
    """A decoder rank whose agent could not be loaded: when it is tried again (sooner if an
    Expect names it then), why it failed, and the `Ended` it is owed once loaded (its last
    Expect carries the metadata to load it)."""

    sha256: str
    retry_at: float
    wait: float  # seconds before the next try, doubled after each failure
    why: str
    expect: wire.Expect
    owed: dict[str, str] = field(default_factory=dict)  # decoder request id -> why it ended


def stale(m: wire.Expect, dec: Decoder | None, kept: list[wire.Expect | wire.Abort]) -> bool:
    """Whether `m` comes from an agent a retirement has replaced since, as `dec` (the rank's
    loaded agent) or an Expect `kept` from the rank says: its newer messages stand."""
    replaced = set(dec.replaced) if dec is not None else set()
    for e in kept:
        if isinstance(e, wire.Expect) and key_of(e) == key_of(m):
            replaced.update(e.replaced)
    return bool(replaced) and sha256_hex(m.decoder.agent_metadata) in replaced


@dataclass
class Target:
    """One decoder rank's copy of one request."""

    key: Key
    expect: wire.Expect
    segments: int  # how many it must receive
    producer_ids: list[int]  # the request's blocks that go to it
    whole: bool = True  # in one WRITE (its KV was all final when it came), else layer by layer
    dec: Decoder | None = None  # the decoder process it goes to (None: refused)
    posted: set[int] = field(default_factory=set)
    xfers: list[tuple[int, Xfer]] = field(default_factory=list)
    ended: str | None = None  # why it stopped short; None while writing or once complete
    told: bool = False  # `Ended` was sent

    @property
    def settled(self) -> bool:
        """Nothing more lands in it: every segment landed, or it stopped and its WRITEs ended."""
        return not self.xfers and (self.ended is not None or len(self.posted) == self.segments)


@dataclass
class Job:
    """One request being pushed: its blocks, its lease, which segments are final, its copies."""

    block_ids: list[int]
    expires_at: float
    layerwise: bool
    ready: set[int] = field(default_factory=set)  # segments whose KV is final
    done: bool = False  # all of its KV is final (prefill ended)
    targets: dict[Key, Target] = field(default_factory=dict)
    # the expectations (decoder request ids) aborted before the producer had the request: a
    # decoder rank's later expectation of it is another one, and is written
    aborted: set[str] = field(default_factory=set)
    expected: int | None = None  # decoder ranks that will expect it (from their Expect)
