"""API-key checks: an ASGI middleware in front of every route.

As in vLLM, `/health`, `/version` and `/metrics` stay open. The control routes (sleep, pause
...) need the admin key and are refused with 403 when the server has none. Every other route
(all of `/v1`, `/tokenize`, `/detokenize`, and unknown paths) needs the API key when one is
set. Keys arrive as `Authorization: Bearer <key>` or, as Anthropic's clients send them, as
`x-api-key: <key>`, and are compared in constant time; a missing or wrong key gets 401 in the
path's error shape (OpenAI's, Anthropic's on the Messages routes: the app's `render`). Paths are compared as the router matches them:
behind `--root-path /p`, `/p/sleep` is the control route `/sleep` (`route_path`).
"""

from __future__ import annotations

import hmac
from collections.abc import Collection

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


def bearer_matches(authorization: str | None, key: str) -> bool:
    """True when `authorization` is `Bearer <key>` (constant-time comparison)."""
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(token.strip().encode(), key.encode())


def x_api_key_matches(value: str | None, key: str) -> bool:
    """True when the `x-api-key` header is `key` (constant-time comparison)."""
    return value is not None and hmac.compare_digest(value.strip().encode(), key.encode())


class AuthMiddleware:
    """Checks the API key or the admin key before a request reaches its route.

    Args:
        app: the wrapped ASGI app.
        api_key: the key of the API routes (None: open).
        admin_api_key: the key of the control routes (None: they are refused).
        open_paths: paths that need no key.
        admin_paths: the control routes.
        render: answers a refusal in the path's error shape.
    """

    def __init__(self, app: ASGIApp, *, api_key: str | None, admin_api_key: str | None,
                 open_paths: Collection[str], admin_paths: Collection[str],
                 render: ErrorRenderer = openai_error_response) -> None:
        self.app = app
        self.render = render
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.open_paths = frozenset(open_paths)
        self.admin_paths = frozenset(admin_paths)

    def _refusal(self, scope: Scope) -> APIError | None:
        path = route_path(scope)
        if path in self.open_paths:
            return None
        key = self.api_key
        if path in self.admin_paths:
            key = self.admin_api_key
            if key is None:
                return APIError(403, f"{path} is disabled: the server was started without "
                                     "--admin-api-key")
        if key is None:
            return None
        headers = Headers(scope=scope)
        if bearer_matches(headers.get("authorization"), key):
            return None
        if path not in self.admin_paths and x_api_key_matches(headers.get("x-api-key"), key):
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
