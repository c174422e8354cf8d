"""Tests for ringserve.engine.cluster.auth: CURVE + ZAP link authentication, key loading, and
the bind policy.

Links run over tcp://127.0.0.1 on random ports; the server and the client have a context each,
as they would in separate processes. A refused peer is recognised from the server's socket
monitor (the handshake failed) and then from the server socket receiving nothing for QUIET_MS.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from ringserve.engine.cluster.auth import (
    ENV_VAR,
    ClusterAuth,
    check_bind_policy,
    cluster_secret_from_env,
    is_loopback,
)

SECRET = b"0123456789abcdef-the-cluster-secret"
OTHER_SECRET = b"fedcba9876543210-another-secret"
QUIET_MS = 500  # how long a refused peer's message must stay undelivered
WAIT_MS = 2000  # the most a handshake outcome or a good message may take

HANDSHAKE_FAILED = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
    zmq.EVENT_HANDSHAKE_FAILED_AUTH,
}
HANDSHAKE_OUTCOMES = HANDSHAKE_FAILED | {zmq.EVENT_HANDSHAKE_SUCCEEDED}


class Host:
    """One end's zmq context, and everything made in it, closed in order by `close`."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._sockets: list[zmq.Socket[Any]] = []
        self._monitored: list[tuple[zmq.Socket[Any], zmq.Socket[Any]]] = []
        self._auths: list[ClusterAuth] = []

    def socket(self, kind: int) -> zmq.Socket[Any]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self._sockets.append(sock)
        return sock

    def serve(self, auth: ClusterAuth) -> ClusterAuth:
        auth.start(self.ctx)
        self._auths.append(auth)
        return auth

    def monitor(self, sock: zmq.Socket[Any]) -> zmq.Socket[Any]:
        mon = sock.get_monitor_socket()
        self._monitored.append((sock, mon))
        return mon

    def close(self) -> None:
        for sock, mon in self._monitored:
            sock.disable_monitor()
            mon.close(linger=0)
        for sock in self._sockets:
            sock.close(linger=0)
        for auth in self._auths:
            auth.stop()
        self.ctx.term()


@pytest.fixture(autouse=True)
def no_zap_thread_left() -> Iterator[None]:
    # Autouse: set up before the hosts, so it checks after both are closed.
    yield
    assert not [t for t in threading.enumerate() if t.name == "ringserve-zap"]


def _host() -> Iterator[Host]:
    host = Host()
    try:
        yield host
    finally:
        host.close()


@pytest.fixture
def server() -> Iterator[Host]:
    yield from _host()


@pytest.fixture
def client() -> Iterator[Host]:
    yield from _host()


def bind(sock: zmq.Socket[Any]) -> str:
    return f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def recv(sock: zmq.Socket[Any], timeout_ms: int = WAIT_MS) -> list[bytes] | None:
    """The next message on `sock`, or None when none arrives in time."""
    return sock.recv_multipart() if sock.poll(timeout_ms) else None


def handshake_outcome(mon: zmq.Socket[Any]) -> int | None:
    """The first handshake event (succeeded or failed) a monitor reports, None if none in time."""
    while mon.poll(WAIT_MS):
        event = int(recv_monitor_message(mon)["event"])
        if event in HANDSHAKE_OUTCOMES:
            return event
    return None


def secured_server(host: Host, kind: int, auth: ClusterAuth) -> tuple[zmq.Socket[Any], str]:
    host.serve(auth)
    sock = host.socket(kind)
    auth.secure_server(sock)
    return sock, bind(sock)


def secured_client(host: Host, kind: int, auth: ClusterAuth, addr: str) -> zmq.Socket[Any]:
    sock = host.socket(kind)
    auth.secure_client(sock)
    sock.connect(addr)
    return sock


def assert_refused(server_sock: zmq.Socket[Any], server_mon: zmq.Socket[Any],
                   expected: int | None) -> None:
    """The server's handshake with the peer failed (`expected`; None: any way), and nothing of
    the peer's arrives."""
    outcome = handshake_outcome(server_mon)
    assert outcome in HANDSHAKE_FAILED if expected is None else outcome == expected
    assert recv(server_sock, QUIET_MS) is None


# --- links ---------------------------------------------------------------------------------


def test_same_secret_router_dealer_both_ways(server: Host, client: Host) -> None:
    router, addr = secured_server(server, zmq.ROUTER, ClusterAuth.from_secret(SECRET))
    dealer = secured_client(client, zmq.DEALER, ClusterAuth.from_secret(SECRET), addr)
    dealer.send(b"ping")
    got = recv(router)
    assert got is not None and got[1:] == [b"ping"]
    router.send_multipart([got[0], b"pong"])
    assert recv(dealer) == [b"pong"]


def test_plain_client_refused_then_good_client_served(server: Host, client: Host) -> None:
    router, addr = secured_server(server, zmq.ROUTER, ClusterAuth.from_secret(SECRET))
    mon = server.monitor(router)
    plain = client.socket(zmq.DEALER)
    plain.connect(addr)
    plain.send(b"unauthenticated")
    assert_refused(router, mon, None)  # PROTOCOL, or NO_DETAIL when the client hangs up first

    good = secured_client(client, zmq.DEALER, ClusterAuth.from_secret(SECRET), addr)
    good.send(b"hello")
    got = recv(router)
    assert got is not None and got[1:] == [b"hello"]
    assert recv(router, 50) is None  # the refused client's message never follows


def _other_secret(sock: zmq.Socket[Any]) -> None:
    ClusterAuth.from_secret(OTHER_SECRET).secure_client(sock)


def _server_key_only(sock: zmq.Socket[Any]) -> None:
    # Knows the server public key (it is not secret to CURVE), not the derived client key.
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, ClusterAuth.from_secret(SECRET).server_public_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)


@pytest.mark.parametrize(
    ("configure", "expected"),
    [
        # Encrypted to another server key: the server cannot read its hello.
        (_other_secret, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
        # A valid handshake, refused by the ZAP handler.
        (_server_key_only, zmq.EVENT_HANDSHAKE_FAILED_AUTH),
    ],
    ids=["other-secret", "server-key-only"],
)
def test_client_without_the_secret_refused(server: Host, client: Host, configure: Any,
                                           expected: int) -> None:
    router, addr = secured_server(server, zmq.ROUTER, ClusterAuth.from_secret(SECRET))
    mon = server.monitor(router)
    intruder = client.socket(zmq.DEALER)
    configure(intruder)
    intruder.connect(addr)
    intruder.send(b"intruder")
    assert_refused(router, mon, expected)

    good = secured_client(client, zmq.DEALER, ClusterAuth.from_secret(SECRET), addr)
    good.send(b"hello")
    got = recv(router)
    assert got is not None and got[1:] == [b"hello"]


def _impostor_other_secret(host: Host, sock: zmq.Socket[Any]) -> None:
    host.serve(ClusterAuth.from_secret(OTHER_SECRET)).secure_server(sock)


def _impostor_admits_anyone(host: Host, sock: zmq.Socket[Any]) -> None:
    # A CURVE server with no ZAP handler admits any client key; it still needs the real key.
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, zmq.curve_keypair()[1])


def _impostor_plain(host: Host, sock: zmq.Socket[Any]) -> None:
    pass


@pytest.mark.parametrize(
    "configure",
    [_impostor_other_secret, _impostor_admits_anyone, _impostor_plain],
    ids=["other-secret", "admits-anyone", "plain"],
)
def test_client_refuses_server_without_the_secret(server: Host, client: Host,
                                                  configure: Any) -> None:
    impostor = server.socket(zmq.ROUTER)
    configure(server, impostor)
    addr = bind(impostor)
    dealer = client.socket(zmq.DEALER)
    mon = client.monitor(dealer)
    ClusterAuth.from_secret(SECRET).secure_client(dealer)
    dealer.connect(addr)
    dealer.send(b"for the real server only")
    assert handshake_outcome(mon) in HANDSHAKE_FAILED
    assert recv(impostor, QUIET_MS) is None
    assert recv(dealer, 0) is None


def test_push_to_bound_pull(server: Host, client: Host) -> None:
    # ringserve's output links: the core's PUSH connects to the frontend's bound PULL.
    pull, addr = secured_server(server, zmq.PULL, ClusterAuth.from_secret(SECRET))
    push = secured_client(client, zmq.PUSH, ClusterAuth.from_secret(SECRET), addr)
    push.send_multipart([b"out", b"puts"])
    assert recv(pull) == [b"out", b"puts"]


@pytest.mark.parametrize(
    ("configure", "expected"),
    [
        (None, None),  # mechanism mismatch: PROTOCOL, or NO_DETAIL if the client hangs up first
        (_other_secret, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL),
        (_server_key_only, zmq.EVENT_HANDSHAKE_FAILED_AUTH),
    ],
    ids=["plain", "other-secret", "server-key-only"],
)
def test_push_without_the_secret_refused_by_pull(server: Host, client: Host, configure: Any,
                                                 expected: int | None) -> None:
    pull, addr = secured_server(server, zmq.PULL, ClusterAuth.from_secret(SECRET))
    mon = server.monitor(pull)
    push = client.socket(zmq.PUSH)
    if configure is not None:
        configure(push)
    push.connect(addr)
    push.send(b"forged output", zmq.NOBLOCK)  # queued on the pending connection
    assert_refused(pull, mon, expected)


def test_unsecured_socket_unaffected_by_running_handler(server: Host, client: Host) -> None:
    server.serve(ClusterAuth.from_secret(SECRET))
    pull = server.socket(zmq.PULL)
    addr = bind(pull)
    push = client.socket(zmq.PUSH)
    push.connect(addr)
    push.send(b"plain")
    assert recv(pull) == [b"plain"]


def test_server_refuses_everyone_once_handler_stopped(server: Host, client: Host) -> None:
    # The ZAP domain is enforced: no handler answering means no peer admitted, not all.
    auth = ClusterAuth.from_secret(SECRET)
    router, addr = secured_server(server, zmq.ROUTER, auth)
    mon = server.monitor(router)
    auth.stop()
    good = secured_client(client, zmq.DEALER, ClusterAuth.from_secret(SECRET), addr)
    good.send(b"hello")
    assert_refused(router, mon, None)


def test_secure_server_needs_the_handler_of_its_context(server: Host, client: Host) -> None:
    auth = ClusterAuth.from_secret(SECRET)
    with pytest.raises(RuntimeError, match=r"start\(ctx\)"):
        auth.secure_server(server.socket(zmq.ROUTER))
    client.serve(auth)
    with pytest.raises(RuntimeError, match=r"start\(ctx\)"):
        auth.secure_server(server.socket(zmq.ROUTER))


def test_security_set_after_bind_or_connect_refused(server: Host) -> None:
    auth = server.serve(ClusterAuth.from_secret(SECRET))
    bound = server.socket(zmq.ROUTER)
    addr = bind(bound)
    with pytest.raises(RuntimeError, match="before the socket binds or connects"):
        auth.secure_server(bound)
    connected = server.socket(zmq.DEALER)
    connected.connect(addr)
    with pytest.raises(RuntimeError, match="before the socket binds or connects"):
        auth.secure_client(connected)


def test_one_handler_per_context(server: Host) -> None:
    auth = server.serve(ClusterAuth.from_secret(SECRET))
    with pytest.raises(RuntimeError, match="already runs"):
        auth.start(server.ctx)
    with pytest.raises(RuntimeError, match="already has a ZAP handler"):
        ClusterAuth.from_secret(SECRET).start(server.ctx)
    auth.stop()
    auth.stop()  # idempotent
    server.serve(ClusterAuth.from_secret(SECRET))  # the context is free again


# --- keys and secrets ----------------------------------------------------------------------


def test_keys_derived_deterministically() -> None:
    a, b = ClusterAuth.from_secret(SECRET), ClusterAuth.from_secret(SECRET)
    other = ClusterAuth.from_secret(OTHER_SECRET)
    assert (a.server_public_key, a.client_public_key) == (b.server_public_key, b.client_public_key)
    assert a.server_public_key != a.client_public_key
    assert other.server_public_key != a.server_public_key
    assert other.client_public_key != a.client_public_key
    assert len(a.server_public_key) == 40  # z85 of 32 bytes


def test_repr_shows_no_secret_key() -> None:
    auth = ClusterAuth.from_secret(SECRET)
    text = repr(auth)
    assert auth.server_public_key.decode() in text
    for secret_key in (auth._server_secret_key, auth._client_secret_key):
        assert secret_key.decode() not in text


@pytest.mark.parametrize("secret", [b"", b"short", b"x" * 15])
def test_short_secret_refused(secret: bytes) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        ClusterAuth.from_secret(secret)


def _key_file(tmp_path: Path, contents: bytes, mode: int = 0o600) -> str:
    path = tmp_path / "cluster.key"
    path.write_bytes(contents)
    path.chmod(mode)
    return str(path)


def test_key_file_0600_accepted(tmp_path: Path) -> None:
    auth = ClusterAuth.load(_key_file(tmp_path, b"  " + SECRET + b"\n"))
    assert auth is not None
    assert auth.client_public_key == ClusterAuth.from_secret(SECRET).client_public_key


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660, 0o602])
def test_key_file_open_to_others_refused(tmp_path: Path, mode: int) -> None:
    path = _key_file(tmp_path, SECRET, mode)
    with pytest.raises(ValueError, match="chmod 600") as info:
        ClusterAuth.load(path)
    assert path in str(info.value)


def test_key_file_missing_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "absent.key")
    with pytest.raises(ValueError, match="cannot read") as info:
        ClusterAuth.load(path)
    assert path in str(info.value)


def test_key_file_directory_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a regular file"):
        ClusterAuth.load(str(tmp_path))


@pytest.mark.parametrize("contents", [b"", b" \n\t\n"])
def test_key_file_empty_refused(tmp_path: Path, contents: bytes) -> None:
    path = _key_file(tmp_path, contents)
    with pytest.raises(ValueError, match="is empty") as info:
        ClusterAuth.load(path)
    assert path in str(info.value)


def test_key_file_short_secret_refused(tmp_path: Path) -> None:
    path = _key_file(tmp_path, b"short\n")
    with pytest.raises(ValueError, match="at least 16") as info:
        ClusterAuth.load(path)
    assert path in str(info.value)


def test_env_secret_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, f" {SECRET.decode()}\n")
    assert cluster_secret_from_env() == SECRET
    auth = ClusterAuth.load(None)
    assert auth is not None
    assert auth.server_public_key == ClusterAuth.from_secret(SECRET).server_public_key


def test_no_secret_anywhere_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert cluster_secret_from_env() is None
    assert ClusterAuth.load(None) is None


@pytest.mark.parametrize("value", ["", "short"])
def test_env_secret_set_but_unusable_refused(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    # Set but empty is a mistake (say, `$(cat missing-file)`), not "no authentication".
    monkeypatch.setenv(ENV_VAR, value)
    with pytest.raises(ValueError, match=f"{ENV_VAR}.*at least 16"):
        ClusterAuth.load(None)


def test_key_file_wins_over_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, OTHER_SECRET.decode())
    auth = ClusterAuth.load(_key_file(tmp_path, SECRET))
    assert auth is not None
    assert auth.server_public_key == ClusterAuth.from_secret(SECRET).server_public_key


def test_key_file_refusal_not_masked_by_env(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_VAR, SECRET.decode())
    with pytest.raises(ValueError, match="chmod 600"):
        ClusterAuth.load(_key_file(tmp_path, SECRET, 0o644))


# --- bind policy ---------------------------------------------------------------------------

LOCAL = [
    "ipc:///tmp/ringserve-zmq-1-abc/input",
    "inproc://links",
    "tcp://127.0.0.1:5555",
    "tcp://127.0.0.2:5555",
    "tcp://127.255.255.254:1",
    "tcp://localhost:5555",
    "tcp://LOCALHOST:5555",
    "tcp://[::1]:5555",
    "tcp://[::ffff:127.0.0.1]:5555",
    "tcp://127.0.0.1:*",
    "tcp://127.0.0.1",
]
EXPOSED = [
    "tcp://0.0.0.0:5555",
    "tcp://10.1.2.3:5555",
    "tcp://*:5555",
    "tcp://*:*",
    "tcp://[::]:5555",
    "tcp://[2001:db8::1]:5555",
    "tcp://eth0:5555",
    "tcp://example.com:5555",
    "tcp://128.0.0.1:5555",
]


@pytest.mark.parametrize("address", LOCAL)
def test_local_addresses_pass(address: str) -> None:
    assert is_loopback(address)
    check_bind_policy([address], None, insecure=False)


@pytest.mark.parametrize("address", EXPOSED)
def test_exposed_address_refused_without_auth(address: str) -> None:
    assert not is_loopback(address)
    with pytest.raises(ValueError) as info:
        check_bind_policy(["ipc:///tmp/x", address], None, insecure=False)
    message = str(info.value)
    assert address in message and "ipc://" not in message
    for fix in (ENV_VAR, "--cluster-secret-file", "--insecure-cluster"):
        assert fix in message


@pytest.mark.parametrize("address", EXPOSED)
def test_exposed_address_accepted_with_auth_or_insecure(address: str) -> None:
    check_bind_policy([address], ClusterAuth.from_secret(SECRET), insecure=False)
    check_bind_policy([address], None, insecure=True)


def test_bind_policy_names_every_exposed_address() -> None:
    with pytest.raises(ValueError) as info:
        check_bind_policy(["tcp://*:1", "tcp://127.0.0.1:2", "tcp://10.0.0.1:3"], None, False)
    assert "tcp://*:1" in str(info.value) and "tcp://10.0.0.1:3" in str(info.value)
    assert "tcp://127.0.0.1:2" not in str(info.value)


def test_no_address_passes() -> None:
    check_bind_policy([], None, insecure=False)

