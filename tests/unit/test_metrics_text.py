"""kvrdma.metrics_text: the families prometheus_client's own parser reads, for what workers
write and for the rest of the text format; a clear, bounded error for what is not it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Enum,
    Gauge,
    Histogram,
    Info,
    Summary,
    generate_latest,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvrdma import telemetry as t
from kvrdma.metrics_text import parse_families
from kvrdma.telemetry import KvrdmaMetrics

pytestmark = pytest.mark.timeout(60)

ESCAPES = 'decode "quoted"\\back\\slash\nnew line, {brace}="x",'


def library(text: str) -> list[Metric]:
    return list(text_string_to_metric_families(text))


def comparable(families: list[Metric]) -> list[tuple[object, ...]]:
    """`families` as values that compare equal when their NaNs are at the same places."""
    return [
        (f.name, f.documentation, f.type, [(s.name, s.labels, repr(float(s.value)), s.timestamp)
                                           for s in f.samples])
        for f in families
    ]  # fmt: skip


def test_a_workers_exposition_reads_as_the_library_reads_it() -> None:
    registry = CollectorRegistry()
    t.build_info(registry)
    m = KvrdmaMetrics(registry=registry, engine_id="prefill-0", role="producer", tp_rank=3)
    for peer in ("decode-0", ESCAPES, "dé-ü ☃"):
        for mode in ("pull", "push"):
            m.observe_transfer(remote_engine=peer, mode=mode, outcome="success", seconds=0.01,
                               post_seconds=1e-4, nbytes=1 << 20, descriptors=64)  # fmt: skip
        m.handshake(remote_engine=peer, outcome=t.HANDSHAKE_OUTCOMES[0], seconds=0.02)
    m.set_connected_peers(3)
    text = generate_latest(registry).decode()
    families = parse_families(text)
    assert families == library(text)
    by_name = {f.name: f for f in families}
    assert by_name["kvrdma_transfers"].type == "counter"
    assert by_name["kvrdma_transfer_duration_seconds"].type == "histogram"
    assert by_name["kvrdma_transfer_duration_seconds_created"].type == "gauge"
    buckets = [
        s
        for s in by_name["kvrdma_transfer_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["remote_engine"] == ESCAPES
    ]
    assert {s.labels["le"] for s in buckets} >= {"0.01", "+Inf"}
    assert all(s.labels["mode"] in ("pull", "push") for s in buckets)


_LABEL_VALUES = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_VALUES = st.floats(allow_nan=False, width=64) | st.integers(-(2**60), 2**60)


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.tuples(_LABEL_VALUES, _LABEL_VALUES, _VALUES), min_size=1, max_size=6),
    doc=st.text(st.characters(exclude_categories=("Cs",)), max_size=20),
)
def test_any_registry_reads_as_the_library_reads_it(
    values: list[tuple[str, str, float]], doc: str
) -> None:
    registry = CollectorRegistry()
    kw = {"registry": registry, "labelnames": ("a", "b")}
    gauge = Gauge("g", doc, **kw)  # type: ignore[arg-type]
    counter = Counter("c", doc, **kw)  # type: ignore[arg-type]
    histogram = Histogram("h_seconds", doc, buckets=(0.5, 10), **kw)  # type: ignore[arg-type]
    summary = Summary("s", doc, **kw)  # type: ignore[arg-type]
    info = Info("i", doc, registry=registry)
    state = Enum("e", doc, states=["up", "down"], registry=registry)
    for a, b, v in values:
        gauge.labels(a, b).set(v)
        counter.labels(a, b).inc(abs(v))
        histogram.labels(a, b).observe(v)
        summary.labels(a, b).observe(v)
    info.info({"version": values[0][0]})
    state.state("down")
    text = generate_latest(registry).decode()
    assert parse_families(text) == library(text)


@pytest.mark.parametrize(
    "text",
    [
        "# a comment\n\n# TYPE x gauge\nx 1\n",
        "# HELP x first\n# TYPE x counter\nx 3\n# HELP x second\n",  # `x` read as `x_total`
        "# TYPE x_total counter\nx_total 1 1700000000000\n",  # a timestamp, in milliseconds
        '# TYPE h histogram\nh_bucket{le="+Inf"} 2\nh_count 2\nh_sum 3\nh_created 1\n',
        '# TYPE s summary\ns{quantile="0.5"} 1\ns_count 1\ns_sum -Inf\n',
        '\t x\t{ a = "1" ,\tb="2", }\t 1e3 \r\n  # TYPE y untyped\ny{} NaN\n',
        'x{a="\\\\n\\"\\t"} +1.5\ny 7\ny 8\n',  # samples of no TYPE: a family each
        "# TYPE a gauge\nb 1\na 2\n",  # a stray sample ends the family before it
        '# TYPE i info\ni{x="1"} 1\n# TYPE z unknown\nz .5\n',
    ],
    ids=lambda text: text.split("\n")[0][:24],
)
def test_the_rest_of_the_format_reads_as_the_library_reads_it(text: str) -> None:
    assert comparable(parse_families(text)) == comparable(library(text))


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("x 1\nnot a sample\n", 2),
        ("x{a=1} 1\n", 1),
        ('x{a="1"', 1),
        ('x{a="1",a="2"} 1\n', 1),
        ('x{__name__="y"} 1\n', 1),
        ("x 1_000\n", 1),
        ("x one\n", 1),
        ("x 1 2 3\n", 1),
        ('{"utf8.name"} 1\n', 1),
        ('x{a="1"} 1 # {trace_id="0"} 1\n', 1),
        ("# TYPE x\nx 1\n", 1),
        ("# TYPE x counters\nx 1\n", 1),
        ("\n\n# HELP 1x bad name\n", 3),
    ],
)
def test_a_malformed_line_is_refused_naming_it(text: str, line: int) -> None:
    with pytest.raises(ValueError, match=f"^line {line}: expected "):
        parse_families(text)


@pytest.mark.parametrize(
    "line",
    [
        "x{" + " " * (4 << 20) + "!",
        'x{a="' + "\\\\" * (2 << 20),
        "x{" + 'a="1",' * (1 << 19) + "} one",
        "x" * (4 << 20) + " !",
        "x 1" + " " * (4 << 20) + "!",
    ],
    ids=["blanks", "backslashes", "labels", "name", "trailing"],
)
def test_a_huge_malformed_line_fails_at_once_with_a_short_message(line: str) -> None:
    """Any backtracking worse than linear would run far past the test's timeout here."""
    with pytest.raises(ValueError) as refused:
        parse_families(f"ok 1\n{line}\n")
    message = str(refused.value)
    assert message.startswith("line 2: expected ") and len(message) < 300, message[:400]
