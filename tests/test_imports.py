"""No import cycle inside bcp_core: the graph of the imports its modules make when they are loaded
(module level, `if TYPE_CHECKING:` blocks included; imports inside functions are deferred on
purpose and left out), read from the sources with `ast`, is acyclic."""

from __future__ import annotations

import ast
from pathlib import Path

import bcp_core

PACKAGE = Path(bcp_core.__file__).parent


def module_names(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package under `root`, by dotted name (a package by its own name; a
    compiled module by its C source's)."""
    out = {}
    for path in sorted([*root.rglob("*.py"), *root.rglob("*.c")]):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def load_time_imports(tree: ast.Module):
    """The import statements that run when the module is loaded: its body, and the bodies of its
    if / try / with blocks and classes, not those of functions."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt))
            stack.extend(h for h in getattr(node, "handlers", ()))  # try's except blocks


def imported_modules(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports at load time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in load_time_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name in modules)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{anchor}.{base}" if base else anchor
        for alias in node.names:  # `from pkg import sub` imports the submodule, else the package
            target = f"{base}.{alias.name}"
            out.add(target if target in modules else base)
    return {m for m in out if m in modules and m != name}


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    modules = module_names(root)
    return {name: imported_modules(name, path, modules) if path.suffix == ".py" else set()
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as the modules along it (the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    for start in sorted(graph):
        if start in state:
            continue
        path, iters = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while path:
            nxt = next(iters[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                iters.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                iters.append(iter(sorted(graph[nxt])))
    return None


def test_bcp_core_has_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 30 and "bcp_core.flatten" in graph["bcp_core.adapters.generic"]  # the graph is read
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles(tmp_path):
    """On a package made for the purpose: a -> b -> (TYPE_CHECKING) pkg/__init__ -> a, and a
    function-level import that is no cycle."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .a import A\n")
    (pkg / "a.py").write_text("from . import b\nA = 1\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import A\n")
    (pkg / "c.py").write_text("def f():\n    from . import c\n")
    graph = import_graph(pkg)
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg"}, "pkg.c": set()}
    assert find_cycle(graph) == ["pkg", "pkg.a", "pkg.b", "pkg"]
    (pkg / "b.py").write_text("X = 2\n")
    assert find_cycle(import_graph(pkg)) is None
