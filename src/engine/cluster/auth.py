"""Authentication of the TCP zmq links between the hosts of a deployment, from a shared secret.

This module owns the cluster secret (where it is read from and what makes it acceptable), the
two CURVE keypairs derived from it, the ZAP handler that admits only peers holding it, and the
policy that refuses to bind a non-loopback TCP address without it. The frontend clients
(`mp_client`, `async_client`), the engine cores (`core_proc`) and the DP coordinator use it on
every socket of a link that can cross hosts; each process loads it once (`ClusterAuth.load`),
from `--cluster-secret-file` or `RINGSERVE_CLUSTER_SECRET`, and `cli` checks its bind addresses
with `check_bind_policy`.

Every end derives the same "server" and "client" CURVE keypairs from the secret. The end that
binds is the CURVE server (`ClusterAuth.secure_server`); the end that connects is the client
(`ClusterAuth.secure_client`). Both ends authenticate each other during libzmq's handshake,
before the application socket sees a frame:

- a client encrypts its hello to the server public key, so a server without the secret cannot
  complete the handshake;
- the server's ZAP handler (`ClusterAuth.start`, one per zmq context) admits only the derived
  client public key, so a client without the secret is disconnected. The server socket enforces
  its ZAP domain: with no handler running it refuses every peer instead of admitting all.

A peer that fails is disconnected by libzmq (it shows up as a ``HANDSHAKE_FAILED_*`` event on
a socket monitor) and keeps reconnecting at the socket's reconnect interval; none of its
messages are delivered. Sockets that are not secured (ipc links, NULL mechanism, no ZAP domain)
are unaffected by a running handler.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import os
import stat
import threading
import uuid
from typing import Any

import zmq
from zmq.utils import z85

from ringserve import envs

ENV_VAR = "RINGSERVE_CLUSTER_SECRET"
MIN_SECRET_BYTES = 16
ZAP_DOMAIN = "ringserve"

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq sends a context's ZAP requests
_ZAP_VERSION = b"1.0"

# blake2b personalisation strings (at most 16 bytes): one per derived keypair, versioned so a
# change of derivation cannot silently interoperate with the old one.
_SERVER_PERSON = b"ringserve-srv-v1"
_CLIENT_PERSON = b"ringserve-cli-v1"

_HOW_TO_FIX = "set RINGSERVE_CLUSTER_SECRET or --cluster-secret-file, or pass --insecure-cluster"


def cluster_secret_from_env() -> bytes | None:
    """The cluster secret from ``RINGSERVE_CLUSTER_SECRET``, surrounding whitespace stripped.

    Returns:
        The secret's bytes, or None when the variable is unset. A variable that is set but empty
        is returned as ``b""`` (and refused by `ClusterAuth.from_secret`), not taken as unset.
    """
    return envs.cluster_secret()


def read_secret_file(path: str) -> bytes:
    """The cluster secret in a key file: its contents stripped of surrounding whitespace.

    Args:
        path: the key file (``--cluster-secret-file``).

    Returns:
        The secret's bytes (not yet checked for length).

    Raises:
        ValueError: the file is missing or unreadable, not a regular file, readable or writable
            by group or others, or empty.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise ValueError(f"cannot read cluster secret file {path!r}: {e.strerror}") from None
    try:
        # fstat on the opened file, so the mode checked is that of the file read.
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"cluster secret file {path!r} is not a regular file")
        if info.st_mode & 0o077:
            raise ValueError(
                f"cluster secret file {path!r} is accessible by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}); restrict it with: chmod 600 {path}"
            )
        with os.fdopen(fd, "rb", closefd=False) as f:
            secret = f.read().strip()
    finally:
        os.close(fd)
    if not secret:
        raise ValueError(f"cluster secret file {path!r} is empty")
    return secret


def _keypair(secret: bytes, person: bytes) -> tuple[bytes, bytes]:
    """A CURVE keypair (public, secret; z85) derived from `secret`, one per `person`."""
    # Any 32 bytes are a valid curve25519 secret key: libsodium clamps them.
    secret_key = z85.encode(hashlib.blake2b(secret, digest_size=32, person=person).digest())
    return zmq.curve_public(secret_key), secret_key


def _require_unconnected(sock: zmq.Socket[Any], method: str) -> None:
    # libzmq copies the security options into a listener or session at bind/connect time:
    # set later, they would silently not apply to the endpoint already made.
    if sock.getsockopt(zmq.LAST_ENDPOINT):
        raise RuntimeError(f"{method} must be called before the socket binds or connects")


class _ZapHandler:
    """The ZAP handler (RFC 27) of one zmq context: a thread that answers libzmq's requests.

    It admits a CURVE peer of `ZAP_DOMAIN` whose public key is the cluster's client key, and
    refuses every other request.
    """

    def __init__(self, ctx: zmq.Context[Any], client_public_key: bytes) -> None:
        self._client_key = z85.decode(client_public_key)  # ZAP carries the raw 32 bytes
        self._sock = ctx.socket(zmq.REP)
        # A PAIR to wake the thread for stop(): the thread blocks in poll, never sleeps.
        self._wake_tx, self._wake_rx = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        self._wake_addr = f"inproc://ringserve-zap-wake-{uuid.uuid4().hex}"
        try:
            for sock in (self._sock, self._wake_tx, self._wake_rx):
                sock.setsockopt(zmq.LINGER, 0)
            try:
                self._sock.bind(_ZAP_ENDPOINT)
            except zmq.ZMQError as e:
                if e.errno != errno.EADDRINUSE:
                    raise
                raise RuntimeError("this zmq context already has a ZAP handler") from e
            self._wake_rx.bind(self._wake_addr)
            self._wake_tx.connect(self._wake_addr)
            self._thread = threading.Thread(target=self._run, name="ringserve-zap", daemon=True)
            self._thread.start()
        except BaseException:
            self._close()  # an open socket would make ctx.term() hang
            raise

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if self._wake_rx in ready:
                return
            if self._sock in ready:
                self._sock.send_multipart(self._reply(self._sock.recv_multipart()))

    def _reply(self, request: list[bytes]) -> list[bytes]:
        # Request: version, request id, domain, address, identity, mechanism, credentials...
        # Reply: version, request id, status code, status text, user id, metadata.
        request_id = request[1] if len(request) > 1 else b""
        if len(request) < 6 or request[0] != _ZAP_VERSION:
            return [_ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        domain, mechanism, credentials = request[2], request[5], request[6:]
        admitted = (
            domain == ZAP_DOMAIN.encode()
            and mechanism == b"CURVE"
            and len(credentials) == 1
            and hmac.compare_digest(credentials[0], self._client_key)
        )
        if admitted:
            return [_ZAP_VERSION, request_id, b"200", b"OK", b"", b""]
        return [_ZAP_VERSION, request_id, b"400", b"not a member of this cluster", b"", b""]

    def stop(self) -> None:
        """Stop the thread and close the sockets; the ZAP endpoint is free on return."""
        self._wake_tx.send(b"")
        self._thread.join()
        # Unbinding inproc is synchronous; close alone frees the endpoint only once libzmq's
        # reaper gets to the socket, and a handler started right after would find it in use.
        self._sock.unbind(_ZAP_ENDPOINT)
        self._wake_rx.unbind(self._wake_addr)
        self._close()

    def _close(self) -> None:
        for sock in (self._sock, self._wake_tx, self._wake_rx):
            sock.close()


class ClusterAuth:
    """The CURVE keys derived from a cluster secret, and the ZAP handler that checks them.

    The keys are fixed at construction. The one piece of state is the ZAP handler that
    `start` runs for one zmq context, until `stop`.

    Attributes:
        server_public_key: the z85 public key of the binding end (safe to log).
        client_public_key: the z85 public key of the connecting end (safe to log).
    """

    __slots__ = (
        "_client_secret_key",
        "_context",
        "_handler",
        "_server_secret_key",
        "client_public_key",
        "server_public_key",
    )

    def __init__(self, secret: bytes) -> None:
        """Derive the keys; prefer `from_secret` or `load`.

        Args:
            secret: the cluster secret, at least `MIN_SECRET_BYTES` bytes.

        Raises:
            ValueError: the secret is too short.
        """
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cluster secret is {len(secret)} bytes; at least {MIN_SECRET_BYTES} are "
                "required (make one with: openssl rand -hex 32)"
            )
        self.server_public_key, self._server_secret_key = _keypair(secret, _SERVER_PERSON)
        self.client_public_key, self._client_secret_key = _keypair(secret, _CLIENT_PERSON)
        self._handler: _ZapHandler | None = None
        self._context: int | None = None  # the libzmq context (`Context.underlying`) served

    def __repr__(self) -> str:
        # Never the secret keys: a ClusterAuth may end up in a log line or a traceback.
        return f"ClusterAuth(server_public_key={self.server_public_key.decode()!r})"

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterAuth:
        """The keys derived from `secret`.

        Args:
            secret: the cluster secret, at least `MIN_SECRET_BYTES` bytes; it should be random
                (``openssl rand -hex 32``): the keys are a plain hash of it.

        Raises:
            ValueError: the secret is too short.
        """
        return cls(secret)

    @classmethod
    def load(cls, key_file: str | None) -> ClusterAuth | None:
        """The deployment's cluster auth: from `key_file`, else from ``RINGSERVE_CLUSTER_SECRET``.

        Args:
            key_file: the ``--cluster-secret-file`` path, or None when the flag is not given. A
                key file wins over the environment variable.

        Returns:
            The ClusterAuth, or None when neither a key file nor the variable is set.

        Raises:
            ValueError: the key file is refused (see `read_secret_file`) or the secret is too
                short; the message names where the secret came from.
        """
        if key_file is not None:
            secret, source = read_secret_file(key_file), f"cluster secret file {key_file!r}"
        else:
            from_env = cluster_secret_from_env()
            if from_env is None:
                return None
            secret, source = from_env, ENV_VAR
        try:
            return cls(secret)
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    def start(self, ctx: zmq.Context[Any]) -> None:
        """Run the ZAP handler for `ctx` (a thread) until `stop`.

        Call it before `secure_server` on any socket of `ctx`. A context has at most one ZAP
        handler; contexts that only hold client (connecting) sockets need none.

        Args:
            ctx: the zmq context whose server sockets this handler checks.

        Raises:
            RuntimeError: this ClusterAuth already runs a handler, or `ctx` already has one.
        """
        if self._handler is not None:
            raise RuntimeError("this ClusterAuth already runs a ZAP handler; stop() it first")
        self._handler, self._context = _ZapHandler(ctx, self.client_public_key), ctx.underlying

    def stop(self) -> None:
        """Stop the ZAP handler and close its sockets, so that ``ctx.term()`` returns.

        Idempotent. Secured server sockets still open refuse every new peer afterwards (their
        ZAP domain is enforced), so close them first.
        """
        handler, self._handler, self._context = self._handler, None, None
        if handler is not None:
            handler.stop()

    def secure_server(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` (the end that binds) a CURVE server admitting only the cluster's clients.

        Args:
            sock: a socket of the context this ClusterAuth's handler runs for, not yet bound.

        Raises:
            RuntimeError: `start` has not been called for the socket's context, or the socket
                already binds or connects.
        """
        if self._handler is None or sock.context.underlying != self._context:
            raise RuntimeError(
                "secure_server needs this ClusterAuth's ZAP handler running for the socket's "
                "context: call start(ctx) first"
            )
        _require_unconnected(sock, "secure_server")
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.server_public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._server_secret_key)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        # Without it libzmq admits every CURVE client when no ZAP handler answers.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)

    def secure_client(self, sock: zmq.Socket[Any]) -> None:
        """Make `sock` (the end that connects) a CURVE client of the cluster's server key.

        Args:
            sock: a socket, not yet connected; it needs no ZAP handler.

        Raises:
            RuntimeError: the socket already binds or connects.
        """
        _require_unconnected(sock, "secure_client")
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._client_secret_key)


def _tcp_host(address: str) -> str:
    """The host of a ``tcp://host[:port]`` address, IPv6 brackets removed."""
    rest = address[len("tcp://") :]
    if rest.startswith("["):
        return rest[1 : rest.find("]")] if "]" in rest else rest[1:]
    if rest.count(":") == 1:
        return rest.split(":", 1)[0]
    return rest  # no port, or an unbracketed IPv6 address


def is_loopback(address: str) -> bool:
    """Whether a zmq address can be reached only from this host.

    Args:
        address: a zmq endpoint: ``ipc://`` and ``inproc://`` are local; a ``tcp://`` one is
            local when its host is ``localhost``, in 127.0.0.0/8 or ``::1`` (an interface name,
            a host name, ``*``, ``0.0.0.0`` and ``::`` are not). Other transports are not.

    Returns:
        True for a local-only address.
    """
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        return False
    host = _tcp_host(address)
    if host.lower() == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def check_bind_policy(addresses: list[str], auth: ClusterAuth | None, insecure: bool) -> None:
    """Refuse to bind a non-loopback address without a cluster secret.

    Args:
        addresses: the zmq addresses about to be bound.
        auth: the deployment's cluster auth, None when no secret is set.
        insecure: ``--insecure-cluster``: accept unauthenticated peers on any address.

    Raises:
        ValueError: `auth` is None, `insecure` is false and an address is reachable from other
            hosts; the message names those addresses.
    """
    if auth is not None or insecure:
        return
    exposed = [address for address in addresses if not is_loopback(address)]
    if exposed:
        raise ValueError(
            f"refusing to bind {', '.join(exposed)} without authentication: any host that "
            f"reaches it could drive the engine; {_HOW_TO_FIX}"
        )
