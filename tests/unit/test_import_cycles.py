"""No import cycle in the project: every import counts, at module level or inside a function,
under ``if TYPE_CHECKING`` or not, and importing ``a.b.c`` imports ``a`` and ``a.b`` first (as
Python does). A cycle hidden in a function-level import is still a cycle."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("pdserve", "gateway", "prefill_service", "decode_service", "kv_transfer", "protos")


def modules(root: Path, packages: Iterable[str]) -> dict[str, tuple[Path, bool]]:
    """Dotted name -> (file, is a package's ``__init__``); generated protobuf code aside."""
    found = {}
    for package in packages:
        for path in (root / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return found


def _owner(name: str, known: dict[str, tuple[Path, bool]]) -> str | None:
    """The project module ``name`` (a module, or a name inside one) belongs to."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    known = modules(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in known}
    for name, (path, is_package) in known.items():
        package = name if is_package else name.rpartition(".")[0]
        targets = [p for p in _parents(name)]  # a module's packages run first
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets += [source] + [f"{source}.{alias.name}" for alias in node.names]
        for target in targets:
            for step in [*_parents(target), target]:
                owner = _owner(step, known)
                if owner and owner != name:
                    graph[name].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_project_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, PACKAGES)
    assert len(graph) > 150  # every package was walked
    assert cycles(graph) == []


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    (tmp_path / "pkg" / "sub").mkdir(parents=True)
    files = {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg import b\n",
        "pkg/b.py": "def f():\n    from pkg.c import x\n",
        "pkg/c.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.a\nx = 1\n",
        "pkg/sub/__init__.py": "from pkg.sub import leaf\n",
        "pkg/sub/leaf.py": "from . import other\n",
        "pkg/sub/other.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    graph = import_graph(tmp_path, ["pkg"])
    # a -> b (module level) -> c (in a function) -> a (type checking only): one cycle; and
    # sub.leaf and sub.other run sub/__init__ first, which imports sub.leaf (-> other): another.
    assert cycles(graph) == [
        ["pkg.a", "pkg.b", "pkg.c"],
        ["pkg.sub", "pkg.sub.leaf", "pkg.sub.other"],
    ]
    assert graph["pkg.sub.other"] == {"pkg", "pkg.sub"}
