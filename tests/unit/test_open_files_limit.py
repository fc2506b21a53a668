"""`raise_open_files_limit`: the agent's soft open-files limit raised to the hard one."""

from __future__ import annotations

import logging
import resource

import pytest

from kvrdma.handshake import monitors


class Limits:
    """A stand-in for `resource`'s open-files limit calls; `refuse`: setrlimit fails."""

    def __init__(self, soft: int, hard: int, *, refuse: bool = False) -> None:
        self.now, self.refuse, self.calls = (soft, hard), refuse, 0

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.now

    def set(self, which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        self.calls += 1
        if self.refuse:
            raise ValueError("not allowed to raise maximum limit")
        self.now = limits


def install(monkeypatch: pytest.MonkeyPatch, limits: Limits) -> None:
    monkeypatch.setattr(monitors.resource, "getrlimit", limits.get)
    monkeypatch.setattr(monitors.resource, "setrlimit", limits.set)


@pytest.mark.parametrize(
    ("soft", "hard", "raised"),
    [
        (1024, 524288, 524288),
        (1024, resource.RLIM_INFINITY, 1 << 20),
        (4096, 4096, 4096),  # nothing to raise: not called
        (resource.RLIM_INFINITY, resource.RLIM_INFINITY, resource.RLIM_INFINITY),
    ],
)
def test_the_soft_limit_is_raised_to_the_hard_limit(
    monkeypatch: pytest.MonkeyPatch, soft: int, hard: int, raised: int
) -> None:
    limits = Limits(soft, hard)
    install(monkeypatch, limits)
    assert monitors.raise_open_files_limit() == raised
    assert limits.now == (raised, hard)
    assert limits.calls == (1 if raised != soft else 0)


def test_a_limit_that_cannot_be_raised_stays_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    limits = Limits(1024, resource.RLIM_INFINITY, refuse=True)
    install(monkeypatch, limits)
    with caplog.at_level(logging.WARNING, logger=monitors.__name__):
        assert monitors.raise_open_files_limit() == 1024
    assert "open-files limit stays 1024" in caplog.text and "not allowed" in caplog.text
