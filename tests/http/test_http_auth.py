"""The API and admin keys are compared in constant time, and only there.

Behavioural: `bearer_matches` decides through `hmac.compare_digest`. Structural: no `==` / `!=`
anywhere in `src/http` has a key on either side, so no route compares a key another way.
"""

from __future__ import annotations

import ast
import hmac
from pathlib import Path

import pytest

from ringserve.http import auth

HTTP_SRC = Path(__file__).resolve().parents[2] / "src" / "http"


def test_bearer_matches_uses_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    assert auth.bearer_matches("Bearer sk-right", "sk-right")
    assert not auth.bearer_matches("Bearer sk-wrong", "sk-right")
    assert not auth.bearer_matches("Basic sk-right", "sk-right")
    assert not auth.bearer_matches(None, "sk-right")
    assert calls == [(b"sk-right", b"sk-right"), (b"sk-wrong", b"sk-right")]


def _names(node: ast.expr) -> list[str]:
    return [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(node)
            if isinstance(n, ast.Name | ast.Attribute)]


def _is_key(name: str) -> bool:
    lowered = name.lower()
    return lowered == "token" or (lowered.endswith("key") and "file" not in lowered)


def test_no_key_is_compared_with_eq() -> None:
    found: list[str] = []
    for path in sorted(HTTP_SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            if not any(isinstance(op, ast.Eq | ast.NotEq) for op in node.ops):
                continue
            names = [name for side in (node.left, *node.comparators) for name in _names(side)]
            if any(_is_key(name) for name in names):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert found == []
