"""The API and admin keys: compared in constant time, and only there; several API keys
(`--api-key a b`, `--api-key a,b`, or the environment's list), any one of which authorizes a
request, in either header; an empty key in the list refused at startup.

Behavioural: `bearer_matches` decides through `hmac.compare_digest`, against every key. Structural:
no `==` / `!=` anywhere in `src/http` has a key on either side, so no route compares a key
another way.
"""

from __future__ import annotations

import ast
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from http_app_harness import BASE_URL, MODEL, error_of, serving
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from ringserve.cli import main, parse_command_line
from ringserve.http import auth
from ringserve.http.cli_args import api_key
from ringserve.http.settings import ServeSettings

HTTP_SRC = Path(__file__).resolve().parents[2] / "src" / "http"


def test_bearer_matches_uses_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[bytes, bytes]] = []
    compare_digest = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    assert auth.bearer_matches("Bearer sk-right", ("sk-right",))
    assert not auth.bearer_matches("Bearer sk-wrong", ("sk-right",))
    assert not auth.bearer_matches("Basic sk-right", ("sk-right",))
    assert not auth.bearer_matches(None, ("sk-right",))
    assert calls == [(b"sk-right", b"sk-right"), (b"sk-wrong", b"sk-right")]


def test_every_key_is_compared(monkeypatch: pytest.MonkeyPatch) -> None:
    # No early exit: the time taken does not say which key matched, or how many were tried.
    calls: list[bytes] = []
    compare_digest = hmac.compare_digest

    def recording(a: bytes, b: bytes) -> bool:
        calls.append(b)
        return compare_digest(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", recording)
    keys = ("sk-a", "sk-b", "sk-c")
    assert auth.bearer_matches("Bearer sk-a", keys)
    assert auth.x_api_key_matches("sk-b", keys)
    assert not auth.x_api_key_matches("sk-d", keys)
    assert calls == [b"sk-a", b"sk-b", b"sk-c"] * 3


async def _ok(_: Request) -> PlainTextResponse:
    return PlainTextResponse("ok")


@asynccontextmanager
async def guarded(keys: tuple[str, ...]) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a two-route app (`/v1/models`, the control route `/sleep`) behind the
    middleware, with `keys` as the API keys and `sk-admin` as the admin key."""
    app = Starlette(routes=[Route("/v1/models", _ok), Route("/sleep", _ok, methods=["POST"])])
    wrapped = auth.AuthMiddleware(app, api_keys=keys, admin_api_key="sk-admin",
                                  open_paths=(), admin_paths=("/sleep",))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=wrapped),
                                 base_url=BASE_URL) as http:
        yield http


async def test_any_of_several_keys_authorizes() -> None:
    async with guarded(("sk-a", "sk-b")) as http:
        for headers in ({"Authorization": "Bearer sk-a"}, {"Authorization": "bearer sk-b"},
                        {"x-api-key": "sk-a"}, {"x-api-key": "sk-b"}):
            assert (await http.get("/v1/models", headers=headers)).status_code == 200, headers
        for headers in ({}, {"Authorization": "Bearer sk-a,sk-b"}, {"Authorization": "Bearer "},
                        {"x-api-key": ""}, {"Authorization": "Bearer sk-admin"},
                        {"Authorization": "Bearer sk-c"}):
            assert (await http.get("/v1/models", headers=headers)).status_code == 401, headers
        # The control routes keep their one admin key: no API key opens them.
        for key in ("sk-a", "sk-b"):
            r = await http.post("/sleep", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 401
        r = await http.post("/sleep", headers={"Authorization": "Bearer sk-admin"})
        assert r.status_code == 200
    async with guarded(()) as http:  # no key: open
        assert (await http.get("/v1/models")).status_code == 200


async def test_settings_key_list_reaches_the_app(tiny_llama_dir: Path) -> None:
    settings = ServeSettings(served_model_name=MODEL, api_key="sk-a, sk-b")
    assert settings.api_keys == ("sk-a", "sk-b")
    async with serving(tiny_llama_dir, settings=settings) as s:
        for headers in ({"Authorization": "Bearer sk-b"}, {"x-api-key": "sk-a"}):
            assert (await s.http.get("/v1/models", headers=headers)).status_code == 200
        r = await s.http.get("/v1/models", headers={"Authorization": "Bearer sk-a, sk-b"})
        assert error_of(r, 401)["type"] == "AuthenticationError"


@pytest.fixture
def no_env_key(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("RINGSERVE_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    return monkeypatch


def test_key_list_from_flag_and_environment(no_env_key: pytest.MonkeyPatch) -> None:
    def keys(*argv: str) -> str | None:
        return api_key(parse_command_line(["serve", "m", *argv]))

    assert keys() is None
    assert keys("--api-key", "sk-a") == "sk-a"
    assert keys("--api-key", "sk-a", "sk-b,sk-c") == "sk-a,sk-b,sk-c"  # vLLM's form, and ours
    assert keys("--api-key=sk-a,sk-b") == "sk-a,sk-b"
    no_env_key.setenv("VLLM_API_KEY", "sk-v1,sk-v2")
    assert keys() == "sk-v1,sk-v2"
    assert ServeSettings(api_key=keys()).api_keys == ("sk-v1", "sk-v2")
    assert keys("--api-key", "sk-flag") == "sk-flag"  # the flag wins over the environment
    no_env_key.setenv("RINGSERVE_API_KEY", "sk-r")
    assert keys() == "sk-r"


@pytest.mark.parametrize("given", ["a,,b", "a,", ",a", "", " , a"])
def test_empty_key_in_the_list_exits_2(given: str, tmp_path: Path, no_env_key: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", str(tmp_path / "absent"), f"--api-key={given}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ringserve: error: --api-key: item ")
    assert "empty key" in lines[0]
    with pytest.raises(ValueError, match=r"^api_key: item"):
        ServeSettings(api_key=given)


def test_empty_key_in_the_environment_exits_2(tmp_path: Path, no_env_key: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    no_env_key.setenv("VLLM_API_KEY", "sk-secret,")
    assert main(["serve", str(tmp_path / "absent")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ringserve: error: --api-key (from $VLLM_API_KEY): item 2 of 2 is "
                          "an empty key")
    assert "sk-secret" not in err  # never a key in a message


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
