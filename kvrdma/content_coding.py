"""The content coding of a reply, chosen from the request's Accept-Encoding (RFC 9110 §12.5.3).

A coding is acceptable when listed with a weight above 0, or matched by `*` with one; `q=0`
refuses it. "identity" (no coding) is acceptable unless refused, and ranks below every
listed coding that is. A malformed header, or one refusing everything, gets identity: a
scraper that sent it still gets its metrics.
"""

from __future__ import annotations

import gzip
import re

IDENTITY = "identity"
GZIP = "gzip"

_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_QVALUE = re.compile(r"0(\.[0-9]{0,3})?|1(\.0{0,3})?")
_OWS = " \t"
_ALIASES = {"x-gzip": GZIP}  # RFC 9110 §8.4.1.3: a recipient treats both alike


def parse_accept_encoding(header: str) -> dict[str, float] | None:
    """Each coding `header` lists (lower case) with its weight; None if `header` is malformed.

    A coding listed twice keeps its lower weight, so a refusal is never overridden.
    """
    weights: dict[str, float] = {}
    for element in header.split(","):
        coding, *params = (part.strip(_OWS) for part in element.split(";"))
        if not coding and not params:
            continue  # the list syntax allows empty elements
        if not _TOKEN.fullmatch(coding) or len(params) > 1:
            return None
        weight = 1.0
        if params:
            name, _, value = params[0].partition("=")
            if name.rstrip(_OWS).lower() != "q" or not _QVALUE.fullmatch(value.lstrip(_OWS)):
                return None
            weight = float(value)
        coding = _ALIASES.get(coding.lower(), coding.lower())
        weights[coding] = min(weight, weights.get(coding, weight))
    return weights


def accepts_gzip(header: str | None) -> bool:
    """Whether a reply to a request with Accept-Encoding `header` (None: absent) is gzipped:
    gzip is acceptable and weighs at least as much as identity."""
    weights = parse_accept_encoding(header) if header else None
    if not weights:
        return False
    anything = weights.get("*")
    gzip_weight = weights.get(GZIP, anything)
    identity_weight = weights.get(IDENTITY, 0.0 if anything is None else anything)
    return gzip_weight is not None and gzip_weight > 0 and gzip_weight >= identity_weight


def encode(body: bytes, accept_encoding: str | None) -> tuple[bytes, tuple[tuple[str, str], ...]]:
    """`body` in the coding `accept_encoding` prefers, and the headers saying which."""
    if accepts_gzip(accept_encoding):
        return gzip.compress(body), (("Content-Encoding", GZIP),)
    return body, ()
