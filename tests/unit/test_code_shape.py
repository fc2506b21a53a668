"""The package stays readable: no import cycles, no module over 500 lines, no function over 80."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvrdma"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _module_imports(tree: ast.Module) -> Iterator[str]:
    """Names imported when the module loads, `if TYPE_CHECKING:` blocks included (a cycle a
    type checker follows is still a cycle), function-level imports not."""
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If | ast.Try):
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
            yield from (f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        for target in _module_imports(ast.parse(path.read_text())):
            if target in mods and target != name and not name.startswith(f"{target}."):
                graph[name].add(target)
    return graph


def test_no_import_cycles() -> None:
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_sees_type_checking_imports() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvrdma.x import Y\n"
    )
    assert "kvrdma.x" in set(_module_imports(tree))


@pytest.mark.parametrize("name", sorted(_modules()))
def test_modules_and_functions_stay_small(name: str) -> None:
    path = _modules()[name]
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{name}: {text.count(chr(10))} lines"
    long = [
        f"{node.name} ({node.end_lineno - node.lineno + 1} lines)"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno is not None
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert long == [], f"{name}: functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_runtime_never_imports_the_testing_helpers() -> None:
    """Only the CLI (demo, inspect) and the helpers themselves may import `kvrdma.testing`,
    at module level or inside a function: a worker or connector never loads test code."""
    offenders = []
    for name, path in _modules().items():
        if name.startswith(("kvrdma.testing", "kvrdma.cli")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if any(n == "kvrdma.testing" or n.startswith("kvrdma.testing.") for n in names):
                offenders.append(name)
    assert offenders == [], f"runtime modules importing kvrdma.testing: {offenders}"
