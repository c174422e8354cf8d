"""This process's use of Ray (`RaySession`): join the cluster `RAY_ADDRESS` names, reuse a Ray
already initialized, or start a private one on 127.0.0.1, once for every executor of the
process; the last user stops what the session started (see `ray_executor`'s docstring).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import secrets
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

from ringserve import envs

OBJECT_STORE_BYTES = 100 << 20  # a private Ray stores nothing big: only call results
# Ray's longest socket path is <temp dir>/session_<date>_<time>_<us>_<pid>/sockets/plasma_store.
_MAX_TEMP_DIR_CHARS = 107 - 64
_AUTH_ENV = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")  # what a private Ray changes in os.environ


@contextlib.contextmanager
def _loopback_only() -> Iterator[None]:
    """Keep a private Ray on 127.0.0.1 while it starts.

    Ray turns a node IP of 127.0.0.1 into "a remotely reachable IP" (the host's route to the
    internet) unless Ray clusters are disabled, which is what its
    ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` does: set for the processes Ray starts (they read it
    at import), and its already-imported constant in this process, until `ray.init` returns.
    """
    from ray._private import ray_constants

    name = ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR
    saved_env, saved_flag = os.environ.get(name), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[name] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved_env


class RaySession:
    """This process's use of Ray: join, reuse or start it once; stop what it started, last."""

    _lock = threading.Lock()
    _users = 0
    _owned = False
    _temp_dir: Path | None = None
    _remove_temp_dir = False
    _token = secrets.token_hex(32)
    _saved_auth: ClassVar[dict[str, str | None]] = {}  # what a private Ray's token auth replaced

    @classmethod
    def acquire(cls) -> None:
        """Make sure this process is connected to Ray (see the module docstring)."""
        import ray

        with cls._lock:
            if cls._users == 0 and not ray.is_initialized():
                cls._connect(ray)
            cls._users += 1

    @classmethod
    def release(cls) -> None:
        """Drop one user; the last one stops (or disconnects from) the Ray this session began."""
        import ray

        with cls._lock:
            cls._users -= 1
            if cls._users > 0 or not cls._owned:
                return
            cls._owned = False
            ray.shutdown()
            cls._cleanup_temp_dir()
            cls._restore_auth()

    @classmethod
    def _connect(cls, ray: Any) -> None:
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        address = os.environ.get("RAY_ADDRESS")
        if address and address.startswith("ray://"):
            raise ValueError(
                f"RAY_ADDRESS: got {address!r}, allowed: a cluster address (auto, host:port); "
                "Ray Client (ray://) cannot host the engine core's end of the worker sockets"
            )
        if address:
            ray.init(address=address, logging_level=logging.WARNING)
            cls._owned = True
            return
        temp_dir = cls._make_temp_dir()
        cls._saved_auth = {name: os.environ.get(name) for name in _AUTH_ENV}
        if not {"RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"} & os.environ.keys():
            # Ray turns token auth on for a new local cluster and would write a token to
            # ~/.ray/auth_token: give it one of ours instead (its processes inherit it).
            os.environ["RAY_AUTH_TOKEN"] = cls._token
        try:
            with _loopback_only():
                ray.init(
                    address="local", include_dashboard=False, _temp_dir=str(temp_dir),
                    _node_ip_address="127.0.0.1", object_store_memory=OBJECT_STORE_BYTES,
                    logging_level=logging.WARNING,
                )
        except BaseException:
            cls._cleanup_temp_dir()
            cls._restore_auth()
            raise
        cls._owned = True

    @classmethod
    def _restore_auth(cls) -> None:
        """Undo the token auth a private Ray turned on in this process (Ray sets
        ``RAY_AUTH_MODE=token`` in `os.environ` and in its cached config for a new local
        cluster): left on, a later session that joins a cluster without token auth would
        refuse that cluster's calls (its actors are cancelled as soon as they are created)."""
        if not cls._saved_auth:
            return
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        for name, value in cls._saved_auth.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        cls._saved_auth = {}
        Config.initialize("")  # as Ray's own tests reset it: the config first, then the cache
        AuthenticationTokenLoader.instance().reset_cache()

    @classmethod
    def _make_temp_dir(cls) -> Path:
        given = envs.ray_tmpdir()
        if given is not None:
            given.mkdir(parents=True, exist_ok=True)
            temp_dir, cls._remove_temp_dir = given.resolve(), False
        else:
            temp_dir, cls._remove_temp_dir = Path(tempfile.mkdtemp(prefix="ringserve-ray-")), True
            atexit.register(cls._cleanup_temp_dir)  # before ray.init: runs after Ray's own
        cls._temp_dir = temp_dir
        if len(str(temp_dir)) > _MAX_TEMP_DIR_CHARS:
            cls._cleanup_temp_dir()
            raise ValueError(
                f"RINGSERVE_RAY_TMPDIR: got {str(temp_dir)!r} ({len(str(temp_dir))} characters), "
                f"allowed: a path of at most {_MAX_TEMP_DIR_CHARS} characters (Ray's unix "
                "sockets live below it and a socket path holds at most 107 bytes)"
            )
        return temp_dir

    @classmethod
    def _cleanup_temp_dir(cls) -> None:
        if cls._temp_dir is not None and cls._remove_temp_dir:
            shutil.rmtree(cls._temp_dir, ignore_errors=True)
        cls._temp_dir = None
