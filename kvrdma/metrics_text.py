"""Reading the Prometheus text format (0.0.4) that the workers' `/metrics` serve.

`parse_families(text)` returns the families `prometheus_client.parser` would, grouped by its
rules (a sample outside the current family's names is a family of its own, a counter's family
drops `_total`), with one regular-expression match per line where the library scans each
label character by character. A line outside the format (UTF-8 names in quotes, exemplars, a
value that is not a number, a label named twice) is a `ValueError` naming its line; no pattern
here can backtrack more than linearly, so a malformed body costs no more than a good one.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from itertools import repeat
from typing import cast

from prometheus_client.metrics_core import METRIC_TYPES, Metric
from prometheus_client.samples import Sample

_NAME = r"[a-zA-Z_:][a-zA-Z0-9_:]*"
_LABEL_NAME = r"(?!__)[a-zA-Z_][a-zA-Z0-9_]*"  # names starting with `__` are reserved
_CHARS = r'[^"\\]*(?:\\.[^"\\]*)*'  # a label value's characters, escapes included
_NUMBER = r"[-+]?(?:(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|(?i:inf|infinity|nan))"
_PAIR = f'{_LABEL_NAME}="{_CHARS}"'
# the lines prometheus_client writes: single spaces, no blanks in the braces
_CANONICAL = re.compile(rf"({_NAME})(?:\{{({_PAIR}(?:,{_PAIR})*)\}})? ({_NUMBER})(?: (-?[0-9]+))?")
# any line of the format: each run of blanks belongs to one token, so none can be split
_LOOSE_PAIR = rf'{_LABEL_NAME}[ \t]*=[ \t]*"{_CHARS}"[ \t]*'
_SAMPLE = re.compile(  # the value follows a blank or the closing brace
    rf"({_NAME})[ \t]*(?:\{{[ \t]*({_LOOSE_PAIR}(?:,[ \t]*{_LOOSE_PAIR})*(?:,[ \t]*)?)?\}}[ \t]*)?"
    rf"(?<=[ \t}}])({_NUMBER})(?:[ \t]+(-?[0-9]+))?"
)
_PAIRS = re.compile(f'({_LABEL_NAME})[ \t]*=[ \t]*"({_CHARS})"')
_SPACE = " \t\r\x0b\x0c"  # where the library splits comment lines (`string.whitespace`)
_META = re.compile(f"#[{_SPACE}]+(HELP|TYPE)(?:[{_SPACE}]+([^{_SPACE}]*)(?:[{_SPACE}]+(.*))?)?")
_VALID_NAME = re.compile(_NAME)
_ESCAPE = re.compile(r'\\[\\n"]')
_HELP_ESCAPE = re.compile(r"\\[\\n]")
_UNESCAPED = {"\\\\": "\\", "\\n": "\n", '\\"': '"'}
_TYPES = (*METRIC_TYPES, "untyped")
_SUFFIXES = {"summary": ("_count", "_sum", ""), "histogram": ("_count", "_sum", "_bucket")}
_EXCERPT = 120


def _unescape(match: re.Match[str]) -> str:
    return _UNESCAPED[match.group(0)]


def _family(name: str, documentation: str, typ: str, samples: list[Sample]) -> Metric:
    if typ == "counter":
        if name.endswith("_total"):
            name = name[:-6]
        else:
            samples = [s._replace(name=s.name + "_total") for s in samples]
    family = Metric(name, documentation, typ)
    family.samples = samples
    return family


def _bad(number: int, line: str, expected: str) -> ValueError:
    shown = repr(line[: _EXCERPT + 1])
    shown = shown if len(shown) <= _EXCERPT else f"{shown[:_EXCERPT]}..."
    return ValueError(f"line {number}: expected {expected}, got {shown}")


def _labels(text: str, canonical: bool, number: int, line: str) -> dict[str, str]:
    if canonical and "\\" not in text and '=",' not in text:
        # no value holds a quote (it would be escaped) or starts with a comma, so `",` only
        # ends a value, and the first `="` of each pair only starts one
        pieces = text[:-1].split('",')
        count = len(pieces)
        split = map(str.split, pieces, repeat('="'), repeat(1))
        labels = dict(cast(Iterable[tuple[str, str]], split))
    else:
        pairs: list[tuple[str, str]] = _PAIRS.findall(text)
        if "\\" in text:
            pairs = [(k, _ESCAPE.sub(_unescape, v)) for k, v in pairs]
        count = len(pairs)
        labels = dict(pairs)
    if len(labels) != count:
        raise _bad(number, line, "each label name at most once")
    return labels


def _loose_sample(line: str, number: int) -> Sample:
    """A sample line written otherwise than prometheus_client writes them."""
    m = _SAMPLE.fullmatch(line)
    if m is None:
        raise _bad(number, line, 'NAME{LABEL="VALUE",...} VALUE [TIMESTAMP_MS]')
    name, text, value, stamp = m.groups()
    labels = _labels(text, False, number, line) if text else {}
    return Sample(name, labels, float(value), None if stamp is None else int(stamp) / 1000)


class _Families:
    """The families read so far and the one being read, grouped as the library groups them."""

    def __init__(self) -> None:
        self.done: list[Metric] = []
        self.name, self.documentation, self.typ = "", "", "untyped"
        self.samples: list[Sample] = []
        self.names: tuple[str, ...] = ()  # the sample names the current family keeps

    def end(self) -> list[Metric]:
        if self.name:
            self.done.append(_family(self.name, self.documentation, self.typ, self.samples))
        self.name, self.documentation, self.typ = "", "", "untyped"
        self.samples, self.names = [], ()
        return self.done

    def stray(self, sample: Sample) -> None:
        """A sample of no name the current family keeps: an untyped family of its own."""
        self.end()
        self.done.append(_family(sample.name, "", "untyped", [sample]))

    def comment(self, line: str, number: int) -> None:
        meta = _META.fullmatch(line)
        if meta is None:
            return  # a comment
        kind, name, rest = meta.groups()
        if not name or not _VALID_NAME.fullmatch(name):
            raise _bad(number, line, f"# {kind} METRIC_NAME ...")
        if kind == "TYPE" and rest not in _TYPES:
            raise _bad(number, line, f"# TYPE {name} and one of {', '.join(_TYPES)}")
        if name != self.name:
            self.end()
            self.name, self.names = name, (name,)
        if kind == "HELP":
            self.documentation = _HELP_ESCAPE.sub(_unescape, rest) if rest else ""
        else:
            self.typ = rest
            self.names = tuple(name + s for s in _SUFFIXES.get(rest, ("",)))


def parse_families(text: str) -> list[Metric]:
    """The metric families of a text-format exposition; `ValueError` for a malformed line."""
    families = _Families()
    known: dict[str, dict[str, str]] = {}  # label text -> its labels, copied for each sample
    canonical = _CANONICAL.fullmatch
    for number, line in enumerate(text.split("\n"), 1):
        m = canonical(line)
        if m is None:
            line = line.strip()
            if not line:
                continue
            if line[0] == "#":
                families.comment(line, number)
                continue
            sample = _loose_sample(line, number)
        else:
            name, label_text, value, stamp = m.groups()
            if label_text is None:
                labels = {}
            elif (seen := known.get(label_text)) is not None:
                labels = seen.copy()
            else:
                labels = _labels(label_text, True, number, line)
                known[label_text] = labels.copy()
            stamp_s = None if stamp is None else int(stamp) / 1000
            sample = Sample(name, labels, float(value), stamp_s)
        if sample.name in families.names:
            families.samples.append(sample)
        else:
            families.stray(sample)
    return families.end()
