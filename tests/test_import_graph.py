"""The first-party import graph has no cycles and its dependencies point down.

The graph is read from the source with ``ast``, not from ``sys.modules``: every import statement
counts, those inside functions and under ``if TYPE_CHECKING:`` included, since each one is a
dependency a reader (and, for the runtime ones, Python) has to follow. An edge runs from the
importing module to the module it names; ``from pkg import name`` also adds an edge to
``pkg/__init__.py``, which Python runs first, and to ``pkg/name.py`` when ``name`` is a
submodule. Packages outside :data:`PACKAGES` (the standard library, third-party code) are left
out.

The layers, top to bottom: ``moeserve`` (the CLI), ``server`` and ``clients``, ``moe_runtime``,
``tracer``; ``richconsole`` is a leaf every report may use. Within ``moe_runtime``,
``config.py`` is the floor the rest builds on: it may import only leaf modules (:data:`CONFIG_LEAVES`).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("moeserve", "moe_runtime", "tracer", "server", "clients", "richconsole")

#: Packages holding a known import cycle that is being removed: a cycle whose modules all lie in
#: one of them is allowed, any other fails. The test also fails once such a package has no cycle
#: left, so its entry is deleted as soon as the cycle is gone.
ALLOWED_CYCLES: tuple[str, ...] = ()

#: Packages each top-level package must never import.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "tracer": ("moe_runtime", "server", "clients", "moeserve"),
    "moe_runtime": ("server", "clients", "moeserve"),
    "clients": ("moe_runtime", "server"),
}

#: The floor under ``moe_runtime/config.py``: the only modules of ``moe_runtime`` it may import.
#: ``config_types`` and ``errors`` import nothing from :data:`PACKAGES`; ``device`` imports only
#: ``errors`` (its ``ConfigError``). Below ``moe_runtime`` the config may import ``tracer``.
CONFIG_LEAVES = frozenset({"moe_runtime.config_types", "moe_runtime.device", "moe_runtime.errors"})


def _modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` file of ``packages`` under ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ``modules`` (``import a.b.c`` where ``c`` is
    an attribute names ``a.b``); None outside them."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """Module -> the modules of ``packages`` it imports (see the module docstring for the edges)."""
    modules = _modules(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges: set[str] = set()
        package = module if _is_package(path) else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    target = _resolve(alias.name, modules)
                    if target:
                        edges.add(target)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                target = _resolve(source, modules)
                if target is None:
                    continue
                edges.add(target)
                if target == source and _is_package(modules[target]):
                    for alias in node.names:
                        if f"{source}.{alias.name}" in modules:
                            edges.add(f"{source}.{alias.name}")
        edges.discard(module)
        graph[module] = edges
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def one_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest cycle through the component's first module, as ``[a, b, ..., a]``."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    return paths[node] + [start]
                if child not in paths:
                    paths[child] = paths[node] + [child]
                    following.append(child)
        frontier = following
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def _show(graph: dict[str, set[str]], component: frozenset[str]) -> str:
    return f"{' -> '.join(one_cycle(graph, component))} (component: {', '.join(sorted(component))})"


def _within(component: frozenset[str], package: str) -> bool:
    return all(m == package or m.startswith(package + ".") for m in component)


def test_no_import_cycles() -> None:
    graph = import_graph()
    components = strongly_connected(graph)
    unexpected = [c for c in components if not any(_within(c, p) for p in ALLOWED_CYCLES)]
    assert not unexpected, "import cycles:\n" + "\n".join(_show(graph, c) for c in unexpected)
    gone = [p for p in ALLOWED_CYCLES if not any(_within(c, p) for c in components)]
    assert not gone, f"no cycle is left in {', '.join(gone)}: remove it from ALLOWED_CYCLES"


def test_layering() -> None:
    graph = import_graph()
    found = {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if target.split(".")[0] in FORBIDDEN.get(module.split(".")[0], ())
    }
    wrong = sorted(found)
    assert not wrong, "imports against the layering:\n" + "\n".join(f"{m} imports {t}" for m, t in wrong)


def test_config_is_the_floor() -> None:
    graph = import_graph()
    imported = {m for m in graph["moe_runtime.config"] if m.split(".")[0] == "moe_runtime"}
    assert imported <= CONFIG_LEAVES, f"moe_runtime.config imports {sorted(imported - CONFIG_LEAVES)}"
    for leaf in sorted(CONFIG_LEAVES):
        assert leaf in graph, f"{leaf} is listed in the floor but does not exist"
        outside = graph[leaf] - CONFIG_LEAVES
        assert not outside, f"{leaf} is listed in the floor but imports {sorted(outside)}"
    assert not graph["moe_runtime.config_types"] and not graph["moe_runtime.errors"]
    assert graph["moe_runtime.device"] <= {"moe_runtime.errors"}


def test_graph_sees_every_kind_of_import(tmp_path: Path) -> None:
    """The edges the tests above rely on are found: imports inside a function and under
    ``TYPE_CHECKING``, ``from pkg import name`` (to the package's ``__init__`` and to the
    submodule), relative imports, ``import a.b.c`` of an attribute; and a cycle is reported."""
    files = {
        "pkg/__init__.py": "from pkg.sub import thing\n",
        "pkg/sub/__init__.py": "thing = 1\n",
        "pkg/sub/leaf.py": "import os\n",
        "pkg/a.py": "def f():\n    from pkg import b\n",
        "pkg/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.leaf import x\n",
        "pkg/c.py": "import pkg.sub.leaf.attribute\nfrom . import a\nfrom ..other import y\n",
        "pkg/d.py": "from pkg.sub import leaf, thing\n",
        "other/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ("pkg",))
    assert graph == {
        "pkg": {"pkg.sub"},
        "pkg.sub": set(),
        "pkg.sub.leaf": set(),
        "pkg.a": {"pkg", "pkg.b"},
        "pkg.b": {"pkg.sub.leaf"},
        "pkg.c": {"pkg", "pkg.a", "pkg.sub.leaf"},
        "pkg.d": {"pkg.sub", "pkg.sub.leaf"},
    }
    assert strongly_connected(graph) == []
    graph["pkg.sub.leaf"].add("pkg.c")
    (component,) = strongly_connected(graph)
    assert component == {"pkg.a", "pkg.b", "pkg.c", "pkg.sub.leaf"}
    assert one_cycle(graph, component) == ["pkg.a", "pkg.b", "pkg.sub.leaf", "pkg.c", "pkg.a"]
