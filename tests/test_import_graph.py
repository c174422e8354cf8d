"""The package's import graph, read from the source: no circles, and a light `import ringserve`.

Every `import` counts, at module level, inside functions (lazy imports) and under
`TYPE_CHECKING` alike: a lazy or type-only import that closes a circle still ties two modules
together, and the next change turns it into an import-time failure.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
PACKAGE = "ringserve"


def _modules(src: Path) -> dict[str, Path]:
    modules = {}
    for path in src.rglob("*.py"):
        parts = [PACKAGE, *path.relative_to(src).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is one of the package's modules."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the package's modules it imports (every import statement in it)."""
    modules = _modules(src)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    origin = ".".join([*base, node.module] if node.module else base)
                else:
                    origin = node.module or ""
                # `from pkg import module` is an edge to the module, `from module import name` to
                # the module; a package's `__init__` that Python runs first on the way to any of
                # its modules is not counted (it would tie every module to what it re-exports).
                names = [f"{origin}.{alias.name}" if f"{origin}.{alias.name}" in modules
                         else origin for alias in node.names]
            for name in names:
                target = _resolve(name, modules)
                if target is not None and target != module:
                    targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(root: str) -> None:
        # Iterative, so a deep graph cannot hit the recursion limit.
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
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
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def test_the_graph_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("def f():\n    from ringserve.b import x\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ringserve import a\n")
    (tmp_path / "c.py").write_text("import ringserve.a\n")
    graph = import_graph(tmp_path)
    assert graph["ringserve.a"] == {"ringserve.b"}
    assert graph["ringserve.b"] == {"ringserve.a"}
    assert circles(graph) == [["ringserve.a", "ringserve.b"]]


def test_no_import_circles() -> None:
    found = circles(import_graph())
    assert not found, "import circles in src/ (break each by moving the shared piece down a " \
        "floor or passing it in):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_import_ringserve_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys, ringserve, ringserve.cli\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "", f"`import ringserve` imported {out.stdout.strip()}"


def test_help_imports_no_engine() -> None:
    # What keeps `ringserve --help` fast: it parses flags without torch, transformers, zmq or the
    # engine's modules (the time itself is reported in the README, never asserted).
    code = ("import sys\nfrom ringserve import cli\n"
            "try:\n    cli.main(['--help'])\nexcept SystemExit:\n    pass\n"
            "heavy = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
            "print('heavy:', ','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert "usage: ringserve" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "heavy:", out.stdout[-300:]
