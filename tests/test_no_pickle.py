"""No module of the package imports or uses a code-carrying serializer.

Every cross-process message goes through `ringserve.serial` (msgspec msgpack): a peer that can
write a frame can describe data, never code. This scans every module under `src/` with `ast`,
excluding nothing, for imports of pickle-like modules and for `__reduce__`-style hooks.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"
FORBIDDEN_MODULES = frozenset({"pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal",
                               "shelve", "copyreg", "jsonpickle", "joblib"})
FORBIDDEN_NAMES = frozenset({"__reduce__", "__reduce_ex__", "__getstate__", "__setstate__",
                             "pickle", "cloudpickle", "dill", "marshal", "shelve"})


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[str] = []
    for node in ast.walk(tree):
        modules: list[str] = []
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules = [node.module]
        for module in modules:
            if module.split(".")[0] in FORBIDDEN_MODULES:
                found.append(f"{path.name}:{node.lineno}: imports {module}")
        if isinstance(node, ast.Name) and node.id in FORBIDDEN_NAMES:
            found.append(f"{path.name}:{node.lineno}: uses {node.id}")
        if isinstance(node, ast.Attribute) and node.attr in FORBIDDEN_NAMES:
            found.append(f"{path.name}:{node.lineno}: uses .{node.attr}")
        if isinstance(node, ast.FunctionDef) and node.name in FORBIDDEN_NAMES:
            found.append(f"{path.name}:{node.lineno}: defines {node.name}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "__import__" and node.args
                and isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).split(".")[0] in FORBIDDEN_MODULES):
            found.append(f"{path.name}:{node.lineno}: __import__({node.args[0].value!r})")
    return found


def test_the_scan_sees_every_module() -> None:
    modules = list(SRC.rglob("*.py"))
    assert len(modules) > 50
    assert SRC / "serial.py" in modules


def test_the_scan_catches_what_it_forbids(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle\nfrom dill import dumps\nimport marshal as m\n"
                   "class A:\n    def __reduce__(self):\n        return (A, ())\n"
                   "x = __import__('shelve')\n")
    assert len(_violations(bad)) == 5


def test_no_module_imports_or_uses_pickle() -> None:
    found = [v for path in sorted(SRC.rglob("*.py")) for v in _violations(path)]
    assert found == []
