"""Control channel: every bad message is rejected with a counted reason, never a crash."""

from __future__ import annotations

import socket
import threading

import msgspec
import pytest
import zmq

from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.control import endpoint as endpoint_mod
from kvpush_prod.core import messages as m
from kvpush_prod.errors import ProtocolError
from kvpush_prod.lab.launch import free_port
from tests.control.helpers import PEER, cancel, drain, secure_endpoint, two_keys


def test_sealed_message_opens_to_the_same_message() -> None:
    codec = ControlCodec(4096)
    frames = codec.seal(cancel())
    assert len(frames) == 1
    assert codec.open(frames) == cancel()


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"\xc1\xc1 not msgpack"], "malformed"),
        ([msgspec.msgpack.encode({"type": "cancel", "v": 1})], "malformed"),
        ([msgspec.msgpack.encode({"type": "explode"})], "malformed"),
        ([b"", m.encode(cancel())], "malformed"),  # the old [mac, body] layout
        ([], "malformed"),
        ([b"x" * 5000], "oversize"),
    ],
)
def test_bad_frames_are_rejected_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        ControlCodec(4096).open(frames)
    assert info.value.reason == reason


def test_other_protocol_version_is_rejected() -> None:
    old = m.Cancel(99, "t1", 3, PEER, "aborted")
    with pytest.raises(ProtocolError) as info:
        ControlCodec(4096).open([m.encode(old)])
    assert info.value.reason == "version"
    assert "protocol 99" in str(info.value) and "upgrade this engine first" in str(info.value)


def test_outbound_message_over_the_limit_is_refused() -> None:
    big = m.Cancel(m.PROTOCOL_VERSION, "t" * 3000, 1, PEER, "x")
    with pytest.raises(ProtocolError) as info:
        ControlCodec(1024).seal(big)
    assert info.value.reason == "oversize_outbound"


def test_endpoint_counts_rejections_and_delivers_the_good_message() -> None:
    port = free_port()
    ep = ControlEndpoint(ControlCodec(2048), "127.0.0.1", port)
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send_multipart([b"junk"])
        s.send_multipart([b"", m.encode(cancel())])  # two frames
        s.send_multipart([m.encode(cancel("ok"))])
        s.send_multipart([b"y" * 3000])  # over the limit
        got = drain(ep, until=lambda got: ep.rejected["oversize"] >= 1)
    finally:
        s.close(0)
        ctx.term()
        ep.close()
    assert got == [(cancel("ok"), "")]
    assert ep.rejected["malformed"] == 2
    assert ep.rejected["oversize"] == 1


def test_plaintext_endpoint_send_reaches_a_peer_endpoint_with_an_empty_origin() -> None:
    a = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    b = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    try:
        a.send(b.address, cancel("hello"), to="ignored without keys")
        assert drain(b, count=1) == [(cancel("hello"), "")]
        assert b.name_of("") == ""
    finally:
        a.close()
        b.close()


def test_oversize_outbound_message_is_counted_not_raised() -> None:
    a = ControlEndpoint(ControlCodec(1024), "127.0.0.1", free_port())
    try:
        a.send("tcp://127.0.0.1:9", m.Cancel(m.PROTOCOL_VERSION, "t" * 3000, 1, PEER, "x"))
        assert a.rejected["oversize_outbound"] == 1
        assert a.open_peers == 0
    finally:
        a.close()


def test_binding_a_busy_port_names_the_port_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_mod, "BIND_WAIT_S", 0.5)
    port = free_port()
    a = ControlEndpoint(ControlCodec(4096), "127.0.0.1", port)
    try:
        with pytest.raises(Exception, match=rf"{port}.*control.port"):
            ControlEndpoint(ControlCodec(4096), "127.0.0.1", port)
    finally:
        a.close()


def test_a_port_freed_during_the_bind_wait_is_taken() -> None:
    """A restarted engine may race its dying predecessor for the control port: the bind
    waits for the port instead of failing the engine's start-up."""
    port = free_port()
    holder = socket.socket()
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("127.0.0.1", port))
    holder.listen()
    threading.Timer(1.0, holder.close).start()
    ep = ControlEndpoint(ControlCodec(4096), "127.0.0.1", port)
    try:
        assert ep.address == f"tcp://127.0.0.1:{port}"
    finally:
        ep.close()
        holder.close()


def test_wake_interrupts_a_long_wait() -> None:
    ep = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port())
    try:
        threading.Timer(0.2, ep.wake).start()
        assert ep.wait(60.0) is False  # returns long before 60 s, and no message came
    finally:
        ep.close()


def test_close_is_idempotent_and_ends_the_zap_thread() -> None:
    before = {t.ident for t in threading.enumerate()}
    (a, _), allowed = two_keys()
    ep = secure_endpoint(a, allowed)
    ep.close()
    ep.close()
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
