"""Accept-Encoding negotiation (RFC 9110 §12.5.3): reference cases and properties."""

from __future__ import annotations

import gzip

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvrdma.content_coding import accepts_gzip, encode, parse_accept_encoding


@pytest.mark.parametrize(
    ("header", "gzipped"),
    [
        (None, False),
        ("", False),
        ("gzip", True),
        ("GZIP", True),
        ("x-gzip", True),
        ("deflate, gzip;q=1.0, br;q=0.5", True),
        ("gzip;q=0.001", True),
        (" \tgzip \t; \tq=0.5 , ", True),
        ("gzip, identity;q=0", True),
        ("*", True),
        ("*;q=0, gzip", True),
        ("gzip;q=0.5, identity;q=0.5", True),  # a tie goes to the smaller reply
        ("gzip;q=0", False),
        ("gzip;Q=0.000", False),
        ("gzip;q=1, gzip;q=0", False),
        ("*;q=0", False),
        ("gzip;q=0, *", False),
        ("*, gzip;q=0", False),
        ("identity;q=0", False),  # nothing acceptable: identity anyway
        ("gzip;q=0.5, identity", False),
        ("*;q=0.5, identity", False),
        ("br, deflate", False),
        ("gzip;q=abc", False),
        ("gzip;q=", False),
        ("gzip;q=2", False),
        ("gzip;q=1.5", False),
        ("gzip;q=0.0001", False),
        ("gzip;q=-1", False),
        ("gzip;q=nan", False),
        ("gzip;q=1e0", False),
        ("gzip;q=0.5;q=1", False),
        ("gzip;level=9", False),
        ("gzip;", False),
        (";q=1", False),
        ("gz ip", False),
        ("gzip, br;q=x", False),  # one malformed element: the whole header is ignored
    ],
)
def test_reference_cases(header: str | None, gzipped: bool) -> None:
    assert accepts_gzip(header) is gzipped


def test_parse_lists_each_coding_in_lower_case_with_its_weight() -> None:
    assert parse_accept_encoding("GZip;q=0.5, BR, *;q=0, , identity;q=1.") == {
        "gzip": 0.5,
        "br": 1.0,
        "*": 0.0,
        "identity": 1.0,
    }
    assert parse_accept_encoding("gzip;q=0.5;x") is None


def test_encode_gzips_only_what_is_accepted() -> None:
    body, headers = encode(b"metrics\n", "gzip")
    assert gzip.decompress(body) == b"metrics\n" and headers == (("Content-Encoding", "gzip"),)
    assert encode(b"metrics\n", "gzip;q=0") == (b"metrics\n", ())


CODINGS = ["gzip", "x-gzip", "identity", "*", "br", "deflate", "compress"]
QVALUES = st.sampled_from(["0", "0.", "0.0", "0.000", "0.001", "0.5", "0.75", "1", "1.", "1.000"])
BAD_QVALUES = st.sampled_from(["", "2", "1.5", "1.001", "0.0001", "-0", "nan", "inf", "1e0", "x"])
OWS = st.text(" \t", max_size=2)
HEADER_CHARS = st.text("gzipGZIP*identy,;=q01.5 \t-x", max_size=40)


@st.composite
def elements(draw: st.DrawFn, qvalues: st.SearchStrategy[str] = QVALUES) -> list[str]:
    """Distinct codings, each maybe with a weight, in random case and with optional OWS."""
    codings = draw(st.lists(st.sampled_from(CODINGS), unique=True, max_size=len(CODINGS)))
    out = []
    for coding in codings:
        cased = "".join(c.upper() if draw(st.booleans()) else c for c in coding)
        if draw(st.booleans()):
            q = "Q" if draw(st.booleans()) else "q"
            cased += f"{draw(OWS)};{draw(OWS)}{q}={draw(qvalues)}"
        out.append(f"{draw(OWS)}{cased}{draw(OWS)}")
    return out


@given(st.text(max_size=60))
def test_any_text_gets_an_answer(header: str) -> None:
    assert accepts_gzip(header) in (True, False)


@given(HEADER_CHARS)
def test_any_mix_of_header_characters_gets_an_answer(header: str) -> None:
    assert accepts_gzip(header) in (True, False)


@given(elements())
def test_case_and_optional_whitespace_do_not_change_the_answer(listed: list[str]) -> None:
    plain = ",".join(e.replace(" ", "").replace("\t", "").lower() for e in listed)
    assert accepts_gzip(",".join(listed)) is accepts_gzip(plain)


@given(elements(), st.integers(min_value=0), st.sampled_from(["0", "0.0", "0.000"]), OWS)
def test_gzip_refused_is_never_chosen(listed: list[str], at: int, zero: str, ows: str) -> None:
    others = [e for e in listed if "gzip" not in e.lower()]
    others.insert(at % (len(others) + 1), f"gzip{ows};q={zero}")
    assert not accepts_gzip(", ".join(others))


@given(elements())
def test_everything_refused_unless_listed_leaves_identity(listed: list[str]) -> None:
    others = [e for e in listed if "gzip" not in e.lower() and "*" not in e]
    assert not accepts_gzip(", ".join([*others, "*;q=0"]))


@given(elements(), QVALUES.filter(lambda q: float(q) > 0))
def test_gzip_acceptable_and_identity_unweighted_is_chosen(listed: list[str], q: str) -> None:
    others = [e for e in listed if not any(c in e.lower() for c in ("gzip", "identity", "*"))]
    assert accepts_gzip(", ".join([*others, f"gzip;q={q}"]))


@given(elements(), st.sampled_from(CODINGS), BAD_QVALUES, st.integers(min_value=0))
def test_a_malformed_weight_anywhere_leaves_identity(
    listed: list[str], coding: str, bad: str, at: int
) -> None:
    listed.insert(at % (len(listed) + 1), f"{coding};q={bad}")
    assert not accepts_gzip(",".join(listed))
