"""What the user-facing docs name exists: `kvrdma` commands and flags, Python names, files,
tests and metric series, each as the code has it."""

from __future__ import annotations

import argparse
import ast
import fnmatch
import importlib
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest

from kvrdma import telemetry
from kvrdma.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    [
        ROOT / "README.md",
        *(ROOT / "docs").glob("*.md"),
        ROOT / "deploy" / "k8s" / "README.md",
        ROOT / "metrics" / "README.md",
        ROOT / "agent" / "README.md",
    ]
)
_SPAN = re.compile(r"`([^`]+)`")
_FENCE = re.compile(r"^```[a-z]*\n(.*?)^```", re.S | re.M)
_EXTENSIONS = ("py", "md", "yml", "yaml", "json", "sh")
_FILE = re.compile(rf"^([\w.-]+/)*[\w.-]+\.(?:{'|'.join(_EXTENSIONS)})(?:::[\w*]+)?$")
# `kvrdma SUB ...` where a shell runs it: first on the line (after `VAR=value`s), or after
# `&&`, `|` or `exec`; not `from kvrdma import` or `kubectl -n kvrdma get`
_COMMAND = re.compile(
    r"(?:^\s*|&&\s*|\|\s*|\bexec\s+)(?:[A-Z_]+=\S*\s+)*kvrdma (\w+)((?: +[^\s#|;&]+)*)"
)
_DOTTED = re.compile(r"(?<![\w/.-])kvrdma(?:\.[A-Za-z_]\w*)+")
_SERIES = re.compile(r"(?<![:\w])(kvrdma_[a-z0-9_]*[a-z0-9])(_\*)?(?![:\w])")
# a label the PodMonitor adds, not a series kvrdma exports
_NOT_SERIES = {"kvrdma_pod_role"}


def _code(text: str) -> list[str]:
    """The inline code spans (one line each) and the code blocks' lines (continuations
    joined) of a Markdown text."""
    blocks = [m[1].replace("\\\n", " ") for m in _FENCE.finditer(text)]
    spans = [" ".join(s.split()) for s in _SPAN.findall(_FENCE.sub("", text))]
    return [*spans, *(line for b in blocks for line in b.splitlines())]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def bad_commands(text: str, where: Path) -> list[str]:
    commands = _subcommands()
    problems = []
    for code in _code(text):
        for m in _COMMAND.finditer(code):
            if m[1] not in commands:
                problems.append(f"`{code}`: no command 'kvrdma {m[1]}'")
                continue
            known = commands[m[1]]._option_string_actions
            for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", m[2]):
                if flag not in known:
                    problems.append(f"`{code}`: 'kvrdma {m[1]}' has no {flag}")
    return problems


def _resolve(dotted: str) -> object:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def bad_python_names(text: str, where: Path) -> list[str]:
    problems = []
    for code in _code(text):
        for dotted in _DOTTED.findall(code):
            if dotted.rsplit(".", 1)[1] in _EXTENSIONS:
                continue
            try:
                _resolve(dotted)
            except (ImportError, AttributeError):
                problems.append(f"`{code}` names {dotted}, which does not exist")
    return problems


def _find(name: str) -> Path | None:
    """The first file called `name` in the repository, outside hidden directories."""
    for top, dirs, files in sorted(os.walk(ROOT)):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        if name in files:
            return Path(top) / name
    return None


def _path_of(where: Path, name: str) -> Path | None:
    """Where `name` lies: beside the doc, under the repository root, or (a bare file name)
    anywhere in the repository; None when nowhere."""
    for base in (where.parent, ROOT):
        if (base / name).exists():
            return base / name
    return _find(name) if "/" not in name else None


def _functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}


def bad_files(text: str, where: Path) -> list[str]:
    names = [s for s in _SPAN.findall(text) if _FILE.match(s)]
    names += [t for t in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text) if "//" not in t]
    problems = []
    for name in names:
        file, _, test = name.partition("::")
        if file.startswith("/") or "*" in file or "<" in file:
            continue
        path = _path_of(where, file)
        if path is None:
            problems.append(f"`{name}`: no such file")
        elif test and not fnmatch.filter(_functions(path), test):
            problems.append(f"`{name}`: no such test in {path.relative_to(ROOT)}")
    return problems


def bad_series(text: str, where: Path) -> list[str]:
    names = {d.name for d in telemetry.METRIC_DOCS}
    names |= {n.removesuffix("_total") for n in names}
    problems = []
    for code in _code(text):
        for name, star in _SERIES.findall(code):
            if name in _NOT_SERIES:
                continue
            if star and not any(n.startswith(name + "_") for n in names):
                problems.append(f"`{code}`: no series {name}_*")
            base = re.sub(r"_(bucket|sum|count|created)$", "", name)
            if not star and base not in names:
                problems.append(f"`{code}`: no series {name}")
    return problems


CHECKS: list[Callable[[str, Path], list[str]]] = [
    bad_commands,
    bad_python_names,
    bad_files,
    bad_series,
]


@pytest.mark.parametrize("check", CHECKS, ids=[c.__name__ for c in CHECKS])
@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_docs_name_what_exists(doc: Path, check: Callable[[str, Path], list[str]]) -> None:
    assert check(doc.read_text(encoding="utf-8"), doc) == []


@pytest.mark.parametrize(
    ("check", "text"),
    [
        (bad_commands, "Run `kvrdma demo --p-tp 2\n--no-such-flag`."),
        (bad_commands, "```sh\nKVRDMA_X=1 kvrdma nosuch\n```"),
        (bad_python_names, "See `kvrdma.nixl.ucx.tcp_only()`."),
        (bad_files, "See [`x`](docs/nosuch.md) and `test_faults.py::test_nosuch`."),
        (bad_files, "Generated by `metrics/nosuch.py`."),
        (bad_series, "Counted in `kvrdma_nosuch_total` and `kvrdma_nosuch_*`."),
    ],
)
def test_each_check_finds_a_wrong_name(check: Callable[[str, Path], list[str]], text: str) -> None:
    assert check(text, ROOT / "README.md")


def test_each_check_sees_the_readmes_names() -> None:
    """The scans read the names known to be in the README (none is skipped unseen)."""
    code = _code((ROOT / "README.md").read_text(encoding="utf-8"))
    assert any(_COMMAND.search(c) and "--remote-tp 4 --layout split_kv" in c for c in code)
    assert "kvrdma.ProgressLoop" in {d for c in code for d in _DOTTED.findall(c)}
    assert ("kvrdma_corrupt_blocks_total", "") in {s for c in code for s in _SERIES.findall(c)}
