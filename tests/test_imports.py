"""The package's import graph: no cycles, and the kernels import nothing above them.

Every `import` statement of every module under bole_jax/ counts, including those inside
functions (a deferred import still ties the two modules together). `from pkg import name` is an
edge to `pkg.name` when that is a module, else to `pkg`; the implicit import of a parent package
is not an edge (Python imports it before any of its submodules, so it cannot close a loop that
the explicit edges do not).
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bole_jax")


def _modules() -> dict[str, str]:
    """Module name -> file path of every module under bole_jax/."""
    mods = {}
    base = os.path.dirname(ROOT)
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            name = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            mods[name] = path
    return mods


def _resolve(name: str, mods: dict[str, str]) -> str | None:
    """The longest prefix of a dotted name that is a module of the package."""
    while name:
        if name in mods:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: str, mods: dict[str, str]) -> set[str]:
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(_resolve(a.name, mods) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                source = ".".join(parts + ([node.module] if node.module else []))
            else:
                source = node.module
            for a in node.names:
                sub = f"{source}.{a.name}"
                targets.add(sub if sub in mods else _resolve(source, mods))
    targets.discard(None)
    targets.discard(module)
    return targets


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_graph_sees_the_package():
    graph = _graph()
    assert "bole_jax.pallas.tree_gdn" in graph and "bole_jax.spec_decode.step" in graph
    # a deferred import inside a function counts as well as a top-level one
    assert any(graph.values())


def test_find_cycle_detects_a_loop():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    cycle = _find_cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "layer,forbidden",
    [
        (
            "bole_jax.pallas",
            (
                "bole_jax.model",
                "bole_jax.spec_decode",
                "bole_jax.serving",
                "bole_jax.measure",
                "bole_jax.llm",
            ),
        ),
        ("bole_jax.spec_decode", ("bole_jax.measure", "bole_jax.serving", "bole_jax.llm")),
        (
            "bole_jax.model",
            ("bole_jax.measure", "bole_jax.spec_decode", "bole_jax.serving", "bole_jax.llm"),
        ),
    ],
)
def test_layer_imports_nothing_above_it(layer, forbidden):
    bad = sorted(
        f"{m} -> {t}"
        for m, targets in _graph().items()
        if m == layer or m.startswith(layer + ".")
        for t in targets
        if any(t == f or t.startswith(f + ".") for f in forbidden)
    )
    assert not bad, f"{layer} imports upward:\n" + "\n".join(bad)
