"""`ringserve serve`'s process: bind, build the engine and the app, run the tree, clean up.

`serve()` is what `ringserve.cli` calls once the flags are parsed. In order, each step failing
with an error the CLI prints as one line: bind the listening socket (so "address already in
use" is reported before any model loads), load the TLS certificate, build the `AsyncLLM`
(tokenizer), clean the segments and ipc socket directories a SIGKILLed run left behind
(`ringserve.shm.cleanup_stale`, `ringserve.engine.frontend.ipc_dir`), build the ASGI app, then
`trio.run` the `Supervisor` (hypercorn + engine under one root nursery, see
`ringserve.http.supervisor`). Errors that leave the nursery arrive in exception groups;
`serve` unwraps them so the caller sees the one that matters (`EngineDeadError` when an engine
core died, a `RingserveError`/`ValueError`/`OSError` for a user's mistake). Whatever happens,
the engine's core processes are stopped before `serve` returns.

HTTP: hypercorn's trio worker serves HTTP/1.1 and, on the same cleartext port, HTTP/2 with
prior knowledge (h2c); with `--certfile`/`--keyfile`, HTTPS with h2 or http/1.1 by ALPN.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

import hypercorn.config
import trio
from starlette.types import ASGIApp

from ringserve.config import EngineConfig
from ringserve.engine.errors import EngineDeadError, EngineStartupError
from ringserve.engine.frontend.async_llm import AsyncLLM
from ringserve.engine.frontend.attached_client import Attachment
from ringserve.engine.frontend.ipc_dir import cleanup_stale_ipc_dirs
from ringserve.errors import RingserveError
from ringserve.http.app import build_app
from ringserve.http.settings import ServerState, ServeSettings
from ringserve.http.supervisor import STOP_SIGNALS, Supervisor
from ringserve.shm import cleanup_stale

logger = logging.getLogger(__name__)

AppFactory = Callable[[AsyncLLM, ServeSettings, ServerState], ASGIApp]
"""Builds the ASGI app over the engine, the settings and the shared state."""

# After the drain, hypercorn gets this long to flush responses and close connections.
_GRACEFUL_TIMEOUT_S = 5.0
# Exceptions, most telling first, that `serve` picks out of an exception group.
_REPORTABLE: tuple[type[BaseException], ...] = (
    EngineDeadError, EngineStartupError, RingserveError, ValueError, OSError, KeyboardInterrupt)


def serve(engine_config: EngineConfig, settings: ServeSettings,
          app_factory: AppFactory | None = None, *, sock: socket.socket | None = None,
          attach: Attachment | None = None,
          stop_signals: tuple[int, ...] = STOP_SIGNALS) -> None:
    """Serve until SIGINT/SIGTERM (returns) or a failure (raises).

    Args:
        engine_config: the engine's configuration.
        settings: the HTTP server's settings.
        app_factory: builds the ASGI app (default: `ringserve.http.app.build_app`).
        sock: a listening socket shared with the other frontends of a scaled-out deployment
            (default: bind `settings.host:settings.port`).
        attach: serve as a frontend of a scaled-out deployment (`ringserve.http.scaleout`),
            over cores its supervisor started; this frontend accepts connections only once
            every core has greeted it, so its siblings serve meanwhile.
        stop_signals: the signals that stop the server (default SIGINT and SIGTERM; a
            frontend of a scaled-out deployment: its supervisor's `lifeline.STOP_SIGNAL`).

    Raises:
        OSError: the address cannot be bound (in use, not local), or TLS files cannot be read.
        EngineStartupError: an engine core failed to start (its reason).
        EngineDeadError: an engine core died while serving.
        ValueError, RingserveError: another user mistake the engine found.
    """
    configure_logging()
    factory = app_factory or build_app
    if sock is None:
        sock = open_listener(settings.host, settings.port)
    try:
        config = hypercorn_config(settings, sock)
    except BaseException:
        sock.close()
        raise
    engine = AsyncLLM(engine_config, attach=attach)
    if attach is None:
        _clean_stale()  # a scaled-out deployment's supervisor did it
    try:
        trio.run(_serve_async, engine, settings, factory, config, attach is not None,
                 stop_signals)
    except BaseExceptionGroup as group:
        reported = pick_error(group)
        if reported is group:
            raise
        raise reported from None
    finally:
        if engine.client is not None:
            engine.client.shutdown()  # idempotent; run() normally did it already


def _clean_stale() -> None:
    """Remove the segments and ipc socket directories that SIGKILLed runs left behind.

    Runs after the start-up checks, so a mistake is still reported as one line, and before any
    engine core starts.
    """
    removed = cleanup_stale()
    if removed:
        logger.info("removed %d stale shared-memory segment(s)", len(removed))
    stale_dirs = cleanup_stale_ipc_dirs()
    if stale_dirs:
        logger.info("removed %d stale ipc socket directories", len(stale_dirs))


async def _serve_async(engine: AsyncLLM, settings: ServeSettings, factory: AppFactory,
                       config: Any, engine_first: bool, stop_signals: tuple[int, ...]) -> None:
    state = ServerState()
    app = factory(engine, settings, state)
    supervisor = Supervisor(engine, settings, state, engine_first=engine_first,
                            stop_signals=stop_signals)
    await supervisor.run(app, config)


def open_listener(host: str, port: int) -> socket.socket:
    """Bind (without listening yet) the server's TCP socket.

    Args:
        host: an IPv4/IPv6 address or a host name ("[::1]" is accepted too).
        port: the port; 0 lets the kernel pick a free one.

    Raises:
        OSError: one line naming the address and the reason (in use, cannot assign, ...).
    """
    host = host.strip("[]")
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise OSError(f"cannot listen on {shown}: address already in use "
                          "(another server is running there; pick another --port)") from None
        reason = exc.strerror or str(exc)
        raise OSError(f"cannot listen on {shown}: {reason}") from None
    sock.set_inheritable(False)
    return sock


def hypercorn_config(settings: ServeSettings, sock: socket.socket) -> Any:
    """The hypercorn `Config` serving on `sock` (which it takes over).

    Raises:
        OSError: the TLS certificate or key cannot be loaded.
    """
    config = hypercorn.config.Config()
    config.graceful_timeout = _GRACEFUL_TIMEOUT_S
    config.keep_alive_timeout = settings.timeout_keep_alive
    config.accesslog = None  # the app logs requests itself (--enable-log-requests)
    config.errorlog = logging.getLogger("hypercorn.error")  # through our handler, once
    if settings.certfile is not None and settings.keyfile is not None:
        config.certfile = settings.certfile
        config.keyfile = settings.keyfile
        config.alpn_protocols = ["h2", "http/1.1"]
        try:
            config.create_ssl_context()
        except OSError as exc:
            raise OSError(f"--certfile/--keyfile: cannot load the TLS certificate: {exc}",
                          ) from None
    # The socket is bound already; hypercorn listens on it (and owns it) from here on.
    config.bind = [f"fd://{sock.detach()}"]
    return config


def configure_logging() -> None:
    """Send INFO and above to stderr, one line each, unless the host app configured logging."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            datefmt="%H:%M:%S")


def pick_error(group: BaseExceptionGroup[Any]) -> BaseException:
    """The exception to report out of `group`: the most telling leaf, else the group."""
    leaves = list(_leaves(group))
    for kind in _REPORTABLE:
        for leaf in leaves:
            if isinstance(leaf, kind):
                return leaf
    return leaves[0] if len(leaves) == 1 else group


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc
