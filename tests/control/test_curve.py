"""CurveZMQ control channel: only allow-listed engines get a message through, each message
carries its sender's proven key, and every refusal is counted."""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import socket
import threading
import time

import pytest
import zmq

from kvpush_prod.control import ControlCodec, ControlEndpoint, EndpointSecurity, KeyQuotas
from kvpush_prod.control import endpoint as endpoint_mod
from kvpush_prod.core import messages as m
from kvpush_prod.errors import ConfigError
from kvpush_prod.lab.launch import free_port
from tests.control.helpers import WAIT_S, cancel, drain, keypair, secure_endpoint, settle, two_keys


def until_rejected(ep: ControlEndpoint, reason: str) -> list[tuple[m.ControlMessage, str]]:
    """What ``ep`` receives until it has counted ``reason`` (or time is up)."""
    return drain(ep, until=lambda _: ep.rejected[reason] >= 1)


def test_messages_round_trip_with_the_senders_key_as_origin() -> None:
    (ka, kb), allowed = two_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    try:
        a.send(b.address, cancel("hello"), to=b.public_key)
        ((msg, origin),) = drain(b, count=1)
        assert msg == cancel("hello")
        assert origin == ka.public.decode() == a.public_key
        assert b.name_of(origin) == "prefill-0"
        b.send(a.address, cancel("back"), to=origin)  # reply to the proven sender
        assert drain(a, count=1) == [(cancel("back"), kb.public.decode())]
        assert not a.rejected and not b.rejected
    finally:
        a.close()
        b.close()


def test_name_of_an_unknown_key_is_empty() -> None:
    (ka, _), allowed = two_keys()
    a = secure_endpoint(ka, allowed)
    try:
        assert a.name_of(keypair("x").public.decode()) == ""
        assert a.name_of("") == ""
    finally:
        a.close()


def test_a_client_whose_key_is_not_allowed_never_gets_a_message_through() -> None:
    (ka, kb), allowed = two_keys()
    a = secure_endpoint(ka, allowed)
    b = secure_endpoint(kb, {kb.public: kb.name})  # b does not list a
    try:
        a.send(b.address, cancel("let me in"), to=b.public_key)
        assert until_rejected(b, "handshake_unknown_key") == []
        assert b.rejected["handshake_unknown_key"] >= 1
        drain(a, until=lambda _: a.rejected["peer_refused_key"] >= 1)
        assert a.rejected["peer_refused_key"] >= 1
        assert settle(b) == []
    finally:
        a.close()
        b.close()


def test_a_client_expecting_another_server_key_never_delivers() -> None:
    (ka, kb), allowed = two_keys()
    kc = keypair("decode-1")
    a = secure_endpoint(ka, {**allowed, kc.public: kc.name})
    b = secure_endpoint(kb, allowed)
    try:
        a.send(b.address, cancel("to c"), to=kc.public.decode())  # b is not c
        assert until_rejected(b, "handshake_crypto") == []
        assert b.rejected["handshake_crypto"] >= 1
        drain(a, until=lambda _: a.rejected["peer_handshake_failed"] >= 1)
        assert a.rejected["peer_handshake_failed"] >= 1
        assert settle(b) == []
    finally:
        a.close()
        b.close()


def test_a_plaintext_client_to_a_curve_server_is_refused_and_counted() -> None:
    (_, kb), allowed = two_keys()
    b = secure_endpoint(kb, allowed)
    plain = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        plain.send(b.address, cancel("plain"))
        raw.connect(b.address)
        # The connection itself is what b must refuse; the message only has to be tried.
        # Never block on it: once the refused handshake drops the pipe, a DEALER with no
        # peer would wait forever (CI hung here for pytest-timeout's 900 s).
        with contextlib.suppress(zmq.Again):
            raw.send_multipart([m.encode(cancel("raw"))], zmq.NOBLOCK)

        # Whichever side sees the mismatch first hangs up: the other may only see the
        # connection drop mid-handshake.
        def refused() -> int:
            return b.rejected["handshake_mechanism"] + b.rejected["handshake_failed"]

        assert drain(b, until=lambda _: refused() >= 2) == []
        assert refused() >= 2
        drain(plain, until=lambda _: plain.rejected["peer_handshake_failed"] >= 1)
        assert plain.rejected["peer_handshake_failed"] >= 1
    finally:
        raw.close()
        ctx.term()
        plain.close()
        b.close()


class Recorder(threading.Thread):
    """A TCP relay to 127.0.0.1:``port`` that records the bytes its client sends."""

    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sent: list[bytes] = []  # as the client wrote them: greeting, HELLO, INITIATE...
        self.stop = threading.Event()

    def run(self) -> None:
        self.listener.settimeout(WAIT_S)
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target))
        sel = selectors.DefaultSelector()
        sel.register(client, selectors.EVENT_READ, server)
        sel.register(server, selectors.EVENT_READ, client)
        with client, server, self.listener:
            while not self.stop.is_set():
                for key, _ in sel.select(0.1):
                    data = key.fileobj.recv(65536)  # type: ignore[union-attr]
                    if not data:
                        return
                    if key.fileobj is client:
                        self.sent.append(data)
                    key.data.sendall(data)


def test_without_its_zap_handler_the_server_refuses_every_client() -> None:
    """Fail closed: libzmq alone would accept any key once the ZAP handler is gone."""
    (ka, kb), allowed = two_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    try:
        assert b._auth is not None
        b._auth.stop()
        a.send(b.address, cancel(), to=b.public_key)
        assert drain(b, until=lambda _: sum(b.rejected.values()) >= 1) == []
        assert b.rejected["handshake_failed"] >= 1
        assert settle(b) == []
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize(
    ("stepwise", "reason"), [(True, "handshake_crypto"), (False, "handshake_protocol")]
)
def test_a_replayed_connection_is_not_accepted(stepwise: bool, reason: str) -> None:
    (ka, kb), allowed = two_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    relay = Recorder(int(b.address.rsplit(":", 1)[1]))
    relay.start()
    replay = None
    try:
        a.send(f"tcp://127.0.0.1:{relay.port}", cancel("once"), to=b.public_key)
        assert drain(b, count=1) == [(cancel("once"), a.public_key)]
        recorded = list(relay.sent)
        assert b"once" not in b"".join(recorded)  # it was encrypted on the wire
        replay = socket.create_connection(("127.0.0.1", relay.target))
        if stepwise:
            # Each step of the handshake as the client sent it, after the server answered
            # the previous one: the old INITIATE's cookie does not open on a new connection.
            replay.settimeout(0.2)
            for chunk in recorded:
                replay.sendall(chunk)
                with contextlib.suppress(TimeoutError, ConnectionError):
                    replay.recv(65536)
        else:
            replay.sendall(b"".join(recorded))
        assert until_rejected(b, reason) == []
        assert b.rejected[reason] == 1
    finally:
        relay.stop.set()
        if replay is not None:
            replay.close()
        a.close()
        b.close()


def test_a_silent_client_is_dropped_after_the_handshake_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(endpoint_mod, "HANDSHAKE_IVL_MS", 200)
    (_, kb), allowed = two_keys()
    b = secure_endpoint(kb, allowed)
    port = int(b.address.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port)) as silent:
            silent.settimeout(WAIT_S)
            drain(b, until=lambda _: b.rejected["handshake_failed"] >= 1)
            assert b.rejected["handshake_failed"] >= 1
            while silent.recv(4096):  # the server's greeting, then the close
                pass
    finally:
        b.close()


@pytest.mark.parametrize(
    "address",
    [
        "tcp://a b:1",
        "tcp://host:0",
        "udp://x:1",
        "tcp://host:65536",
        "tcp://host",
        "",
        "tcp://*:5",
        "tcp://0.0.0.0:5",
        "tcp://[::]:5",
        "tcp://224.0.0.1:5",
        "tcp://h;x:1",
        "tcp://999.1.1.1:5",
        "tcp://-bad.example:5",
        "ipc:///tmp/x",
        "tcp://[zz::1]:5",
        "tcp://example.com:5/extra",
        "tcp://" + "a" * 300 + ":5",
    ],
)
def test_send_to_a_malformed_address_is_dropped_and_counted(
    address: str, caplog: pytest.LogCaptureFixture
) -> None:
    (ka, kb), allowed = two_keys()
    a = secure_endpoint(ka, allowed)
    try:
        with caplog.at_level(logging.WARNING, logger="kvpush_prod.control.endpoint"):
            a.send(address, cancel(), to=kb.public.decode())
        assert a.rejected == {"bad_address": 1}
        assert a.open_peers == 0
        assert repr(address)[:60] in caplog.text
    finally:
        a.close()


def test_plaintext_send_to_a_malformed_address_is_dropped_and_counted() -> None:
    a = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    try:
        a.send("tcp://a b:1", cancel())
        a.send(None, cancel())  # type: ignore[arg-type]
        a.send(["tcp://127.0.0.1:5"], cancel(), to=[])  # type: ignore[arg-type]
        assert a.rejected == {"bad_address": 3}
    finally:
        a.close()


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:5", "tcp://[::1]:5", "tcp://engine-0.kv.svc:15500", "tcp://localhost:65535"],
)
def test_send_accepts_a_well_formed_address(address: str) -> None:
    a = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    try:
        a.send(address, cancel())
        assert not a.rejected and a.open_peers == 1
    finally:
        a.close()


def test_send_with_an_unknown_or_missing_peer_key_is_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (ka, kb), allowed = two_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    stranger = keypair("stranger").public.decode()
    try:
        with caplog.at_level(logging.WARNING, logger="kvpush_prod.control.endpoint"):
            a.send(b.address, cancel(), to=stranger)
            a.send(b.address, cancel(), to="")
            a.send(b.address, cancel(), to="\ud800 not even ascii")
        assert a.rejected == {"unknown_peer_key": 3}
        assert a.open_peers == 0
        assert b.address in caplog.text
        assert settle(b) == []
    finally:
        a.close()
        b.close()


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_reply_addresses_keep_open_sockets_within_max_peers() -> None:
    (ka, kb), allowed = two_keys()
    # One key's addresses are bounded too (test_key_quotas); lifted here to reach max_peers.
    a = secure_endpoint(
        ka, allowed, max_peers=32, quotas=KeyQuotas(addresses=10_000, new_addresses_burst=10_000)
    )
    to = kb.public.decode()
    try:
        before = fd_count()
        for i in range(2000):
            a.send(f"tcp://127.0.0.{1 + i // 1000}:{40000 + i % 1000}", cancel(), to=to)
        assert a.open_peers == 32
        assert a.evictions == 2000 - 32
        assert not a.rejected
        # Each open peer costs a DEALER, the two ends of its monitor and a TCP socket;
        # closed ones are released by ZMQ's I/O thread shortly after.
        bound = 32 * 4 + 32
        deadline = time.monotonic() + WAIT_S
        while fd_count() - before > bound and time.monotonic() < deadline:
            a.wait(0.05)
        assert fd_count() - before <= bound
    finally:
        a.close()


def test_the_least_recently_used_peer_socket_is_closed_first() -> None:
    (ka, kb), allowed = two_keys()
    a, b = secure_endpoint(ka, allowed, max_peers=2), secure_endpoint(kb, allowed)
    try:
        a.send(b.address, cancel("1"), to=b.public_key)
        a.send("tcp://127.0.0.1:9", cancel(), to=b.public_key)
        a.send(b.address, cancel("2"), to=b.public_key)  # b's socket is now the most recent
        a.send("tcp://127.0.0.1:10", cancel(), to=b.public_key)  # evicts port 9
        assert a.evictions == 1
        a.send(b.address, cancel("3"), to=b.public_key)
        assert a.evictions == 1
        got = drain(b, count=3)
        assert [msg for msg, _ in got] == [cancel("1"), cancel("2"), cancel("3")]
    finally:
        a.close()
        b.close()


def test_receive_yields_at_most_limit_and_the_rest_on_the_next_call() -> None:
    (ka, kb), allowed = two_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    try:
        cut = False
        received: list[str] = []
        sent: list[str] = []
        for burst in range(5):  # a burst may trickle in; one cut at the limit is enough
            ids = [f"b{burst}-{i}" for i in range(10)]
            sent += ids
            for tid in ids:
                a.send(b.address, cancel(tid), to=b.public_key)
            deadline = time.monotonic() + WAIT_S
            while len(received) < len(sent) and time.monotonic() < deadline:
                if not b.wait(0.05):
                    continue
                batch = list(b.receive(limit=3))
                assert len(batch) <= 3
                received += [msg.transfer_id for msg, _ in batch]  # type: ignore[union-attr]
                if len(batch) == 3 and b.pending:
                    cut = True
                    rest = list(b.receive(limit=3))  # no wait: the rest are already here
                    assert rest
                    received += [msg.transfer_id for msg, _ in rest]  # type: ignore[union-attr]
            if cut:
                break
        assert cut
        assert received == sent
    finally:
        a.close()
        b.close()


def test_wait_returns_at_once_while_a_receive_left_messages_behind() -> None:
    a = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    b = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    try:
        for i in range(5):
            a.send(b.address, cancel(str(i)))
        drain(b, count=1)
        deadline = time.monotonic() + WAIT_S
        while not b.pending and time.monotonic() < deadline:
            a.send(b.address, cancel("more"))  # one message per call until one is left behind
            a.send(b.address, cancel("more"))
            b.wait(0.05)
            list(b.receive(limit=1))
        assert b.pending
        assert b.wait(WAIT_S) is True
    finally:
        a.close()
        b.close()


def test_security_needs_a_non_empty_allow_list() -> None:
    with pytest.raises(ConfigError, match="allow-list is empty"):
        EndpointSecurity(keypair("a"), {})


def test_security_from_files(tmp_path: os.PathLike[str]) -> None:
    from kvpush_prod.control import keys

    keys.generate("p0", tmp_path)
    keys.generate("d0", tmp_path)
    sec = EndpointSecurity.from_files(f"{tmp_path}/p0.key_secret", tmp_path)
    assert sec.keypair.name == "p0"
    assert sorted(sec.allowed.values()) == ["d0", "p0"]


def test_send_after_close_is_dropped_without_raising() -> None:
    (ka, kb), allowed = two_keys()
    a = secure_endpoint(ka, allowed)
    a.close()
    a.send("tcp://127.0.0.1:9", cancel(), to=kb.public.decode())
    assert a.open_peers == 0
