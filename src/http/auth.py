"""API-key checks: an ASGI middleware in front of every route.

As in vLLM, `/health`, `/version` and `/metrics` stay open. The control routes (sleep, pause
...) need the admin key and are refused with 403 when the server has none. Every other route
(all of `/v1`, `/tokenize`, `/detokenize`, and unknown paths) needs the API key when one is
set; the server may hold several API keys (`--api-key a b`, `--api-key a,b`), any one of which
authorizes a request. Keys arrive as `Authorization: Bearer <key>` or, as Anthropic's clients
send them, as `x-api-key: <key>`, and are compared in constant time, against every key (so the
time taken says nothing of which key matched); a missing or wrong key gets 401 in the
path's error shape (OpenAI's, Anthropic's on the Messages routes: the app's `render`). Paths are compared as the router matches them:
behind `--root-path /p`, `/p/sleep` is the control route `/sleep` (`route_path`).
"""

from __future__ import annotations

import hmac
from collections.abc import Collection, Sequence

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from ringserve.http.errors import APIError, ErrorRenderer, openai_error_response


def route_path(scope: Scope) -> str:
    """The path the router matches: `path` less the ASGI `root_path` when it starts with it.

    Starlette's router applies this rule; the key checks must see the same path, or
    `/PREFIX/sleep` would reach the control route without the admin key.
    """
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):]
    return path


def bearer_matches(authorization: str | None, keys: Sequence[str]) -> bool:
    """True when `authorization` is `Bearer <key>` for one of `keys` (constant-time)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return _one_of(token.strip(), keys)


def x_api_key_matches(value: str | None, keys: Sequence[str]) -> bool:
    """True when the `x-api-key` header is one of `keys` (constant-time)."""
    return value is not None and _one_of(value.strip(), keys)


def _one_of(given: str, keys: Sequence[str]) -> bool:
    """`given` is one of `keys`: every key is compared, with no early exit."""
    token = given.encode()
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key.encode())
    return found


class AuthMiddleware:
    """Checks the API key or the admin key before a request reaches its route.

    Args:
        app: the wrapped ASGI app.
        api_keys: the keys of the API routes, any one of which authorizes (empty: open).
        admin_api_key: the key of the control routes (None: they are refused).
        open_paths: paths that need no key.
        admin_paths: the control routes.
        admin_if_set_paths: routes behind the admin key when one is set, else behind the API
            keys (the LoRA load / unload routes, as vLLM serves them under its API key).
        render: answers a refusal in the path's error shape.
    """

    def __init__(self, app: ASGIApp, *, api_keys: Sequence[str], admin_api_key: str | None,
                 open_paths: Collection[str], admin_paths: Collection[str],
                 render: ErrorRenderer = openai_error_response,
                 admin_if_set_paths: Collection[str] = ()) -> None:
        self.app = app
        self.render = render
        self.api_keys = tuple(api_keys)
        self.admin_api_key = admin_api_key
        self.open_paths = frozenset(open_paths)
        self.admin_paths = frozenset(admin_paths)
        self.admin_if_set_paths = frozenset(admin_if_set_paths)

    def _refusal(self, scope: Scope) -> APIError | None:
        path = route_path(scope)
        if path in self.open_paths:
            return None
        keys = self.api_keys
        admin = path in self.admin_paths or (path in self.admin_if_set_paths
                                             and self.admin_api_key is not None)
        if admin:
            if self.admin_api_key is None:
                return APIError(403, f"{path} is disabled: the server was started without "
                                     "--admin-api-key")
            keys = (self.admin_api_key,)
        if not keys:
            return None
        headers = Headers(scope=scope)
        if bearer_matches(headers.get("authorization"), keys):
            return None
        if not admin and x_api_key_matches(headers.get("x-api-key"), keys):
            return None
        return APIError(401, "Missing or invalid API key: send 'Authorization: Bearer <key>'")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                headers = {"WWW-Authenticate": "Bearer"} if refusal.status == 401 else None
                await self.render(route_path(scope), refusal, headers)(scope, receive, send)
                return
        await self.app(scope, receive, send)
