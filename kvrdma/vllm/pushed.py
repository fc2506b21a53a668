"""A decoder rank's pushed loads, from `expect_push` to their report to vLLM.

A push that fails while a producer may still write into its blocks is `quarantined` by the
kvrdma `Worker`; its report is held back until the Worker says `released`, since vLLM would
recompute into the blocks at once. A push vLLM aborts is abandoned by the Worker and reported
received once released: vLLM only frees the blocks of a finished request. One that failed
before the abort stays a failure in the stats, counted once, but vLLM gets no invalid blocks
or failed receive for it: it no longer has the request, and block ids it does not hold for it
could name another request's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvrdma.types import FailureReason, FinishedOutput


@dataclass
class _Held:
    """A pushed load whose report waits for `released`."""

    invalid: set[int] | None  # its blocks, once its push failed
    reason: FailureReason | None = None
    aborted: bool = False  # vLLM aborted the request


@dataclass
class Released:
    """What the loads released this step report."""

    failed: dict[str, set[int]] = field(default_factory=dict)  # -> invalid blocks
    reasons: dict[str, FailureReason] = field(default_factory=dict)
    # aborted: reported received; -> the blocks of a push that failed first, else None
    aborted: dict[str, set[int] | None] = field(default_factory=dict)


class PushedLoads:
    """The pushed loads of one decoder rank not yet reported to vLLM."""

    def __init__(self) -> None:
        self.expected: set[str] = set()  # requests a pushing producer writes, till reported
        self._held: dict[str, _Held] = {}
        self._aborted: set[str] = set()  # expected ones vLLM aborted, not held (yet)

    def expect(self, rid: str) -> None:
        self.expected.add(rid)

    def forget(self, rid: str, *, abandoned: bool) -> None:
        """vLLM aborted `rid`; `abandoned`: the Worker stopped its push, so it reports the
        request `released`, never finished. Else the Worker reports it itself (its push
        ended before the abort reached it), or it was quarantined already."""
        if rid not in self.expected:
            return
        held = self._held.get(rid)
        if held is not None:
            held.aborted = True
        elif abandoned:
            self._held[rid] = _Held(None, aborted=True)
        else:  # the Worker may still report it quarantined: held as aborted then
            self._aborted.add(rid)

    def take(
        self, out: FinishedOutput, invalid: dict[str, set[int]], recving: set[str]
    ) -> Released:
        """Hold back this step's quarantined loads (taken out of `recving`, `invalid` and
        `out.failures`); return what the released ones report."""
        for rid in out.quarantined & recving:
            recving.discard(rid)
            held = self._held.setdefault(rid, _Held(None, aborted=rid in self._aborted))
            held.invalid, held.reason = invalid.pop(rid, set()), out.failures.pop(rid, None)
            self._aborted.discard(rid)
        done = Released()
        for rid in out.released & self._held.keys():
            held = self._held.pop(rid)
            if held.aborted:
                done.aborted[rid] = held.invalid
            else:
                done.failed[rid] = held.invalid or set()
                if held.reason is not None:
                    done.reasons[rid] = held.reason
        return done

    def reported(self, rids: set[str]) -> None:
        """These requests are reported to vLLM this step."""
        self.expected -= rids
        self._aborted -= rids

    @property
    def held(self) -> set[str]:
        """Requests whose report waits for `released`."""
        return set(self._held)
