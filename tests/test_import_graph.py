"""No import circles between our modules, lazy imports included.

A module's imports are every ``import``/``from ... import`` anywhere in its file that can run: at
the top or in a function (a lazy import); not those under ``if TYPE_CHECKING:``, which never run
(annotations only). An edge goes to the module a statement
names (``from pkg import sub`` names the submodule ``pkg.sub``, ``from pkg import name`` the
package's ``__init__``); the parent packages Python runs first are not edges, as in any import
linter (else every package whose ``__init__`` re-exports its submodules would be a circle).
A circle is a strongly connected component of that graph with more than one module.

Run as a script to print the graph's circles: ``python tests/test_import_graph.py``.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("featurestore", "server", "client")

# Circles allowed while they are being removed (none now); each entry must still be a circle (see the last test).
ALLOWED: set[frozenset[str]] = set()


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under the packages in ``root``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is one of ours."""
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in modules:
            return candidate
        parts.pop()
    return None


def _type_checking(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runnable(tree: ast.AST) -> Iterable[ast.AST]:
    """Every node of ``tree`` but those inside the body of an ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        if _type_checking(node):
            assert isinstance(node, ast.If)
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours that ``module`` imports anywhere in its file (lazily too)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runnable(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per extra dot
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _resolve(target, modules)
            if resolved is not None and resolved != module:
                found.add(resolved)
    return found


def import_graph(root: Path = REPO, packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
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


def _shown(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    members = sorted(component)
    edges = [f"{a} -> {b}" for a in members for b in sorted(graph[a] & component)]
    return "; ".join(edges)


def test_no_import_circles() -> None:
    graph = import_graph()
    found = [c for c in cycles(graph) if c not in ALLOWED]
    assert not found, "import circles (lazy imports count; break them with a module both sides import):\n" + \
        "\n".join(_shown(c, graph) for c in found)


def test_the_checker_sees_a_lazy_circle(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("from pkg.a import f\n")
    (package / "a.py").write_text("from pkg.b import g\n\ndef f():\n    return g()\n")
    (package / "b.py").write_text("def g():\n    from . import a\n    return a\n")
    (package / "c.py").write_text("import pkg.a\nfrom pkg.d import x\n")
    (package / "d.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from pkg import c\nx = 1\n")
    graph = import_graph(tmp_path, ["pkg"])
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.c"] == {"pkg.a", "pkg.d"} and graph["pkg.d"] == set()
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]  # the package's own __init__ is no edge back


def test_the_allow_list_holds_only_live_circles() -> None:
    live = set(cycles(import_graph()))
    gone = [sorted(c) for c in ALLOWED if c not in live]
    assert not gone, f"no longer import circles: {gone}: remove them from ALLOWED"


if __name__ == "__main__":  # optional argument: another checkout's root
    graph = import_graph(Path(sys.argv[1]) if len(sys.argv) > 1 else REPO)
    components = cycles(graph)
    for component in components:
        print(("allowed: " if component in ALLOWED else "CIRCLE: ") + _shown(component, graph))
    print(f"{len(graph)} modules, {len(components)} circle(s)")
    sys.exit(1 if any(c not in ALLOWED for c in components) else 0)
