"""Control channel: every bad message is rejected with a counted reason, never a crash."""

from __future__ import annotations

import socket
import threading
import time

import msgspec
import pytest
import zmq

from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.control import endpoint as endpoint_mod
from kvpush_prod.core import messages as m
from kvpush_prod.errors import ProtocolError
from kvpush_prod.launch import free_port

PEER = m.PeerInfo("engine-d", 7, 0, "tcp://127.0.0.1:1")


def cancel(tid: str = "t1") -> m.Cancel:
    return m.Cancel(m.PROTOCOL_VERSION, tid, 3, PEER, "aborted")


def test_sealed_message_opens_to_the_same_message() -> None:
    codec = ControlCodec(None, 4096)
    assert codec.open(codec.seal(cancel())) == cancel()


def test_authenticated_message_round_trips_with_the_shared_secret() -> None:
    codec = ControlCodec("s3cret", 4096)
    frames = codec.seal(cancel())
    assert len(frames[0]) == 32
    assert codec.open(frames) == cancel()


@pytest.mark.parametrize(
    ("frames", "reason"),
    [
        ([b"", b"\xc1\xc1 not msgpack"], "malformed"),
        ([b"", msgspec.msgpack.encode({"type": "cancel", "v": 1})], "malformed"),
        ([b"", msgspec.msgpack.encode({"type": "explode"})], "malformed"),
        ([b"only one frame"], "malformed"),
        ([b"", b"x" * 5000], "oversize"),
    ],
)
def test_bad_frames_are_rejected_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(ProtocolError) as info:
        ControlCodec(None, 4096).open(frames)
    assert info.value.reason == reason


def test_unauthenticated_or_forged_message_is_rejected_when_a_secret_is_set() -> None:
    body = m.encode(cancel())
    codec = ControlCodec("s3cret", 4096)
    for frames in ([b"", body], [b"\x00" * 32, body], ControlCodec("other", 4096).seal(cancel())):
        with pytest.raises(ProtocolError) as info:
            codec.open(frames)
        assert info.value.reason == "unauthenticated"


def test_other_protocol_version_is_rejected() -> None:
    old = m.Cancel(99, "t1", 3, PEER, "aborted")
    with pytest.raises(ProtocolError) as info:
        ControlCodec(None, 4096).open([b"", m.encode(old)])
    assert info.value.reason == "version"
    assert "same kvpush-prod version" in str(info.value)


def test_outbound_message_over_the_limit_is_refused() -> None:
    big = m.Cancel(m.PROTOCOL_VERSION, "t" * 3000, 1, PEER, "x")
    with pytest.raises(ProtocolError):
        ControlCodec(None, 1024).seal(big)


def _drain(ep: ControlEndpoint, seconds: float = 1.0) -> list[m.ControlMessage]:
    got: list[m.ControlMessage] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got.extend(ep.poll(0.05))
    return got


def test_endpoint_counts_rejections_and_delivers_the_good_message() -> None:
    port = free_port()
    ep = ControlEndpoint(ControlCodec("k", 2048), "127.0.0.1", port)
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send_multipart([b"", m.encode(cancel())])  # no MAC
        s.send_multipart([b"junk", b"junk"])  # forged MAC
        s.send_multipart(ControlCodec("k", 2048).seal(cancel("ok")))
        s.send_multipart([b"", b"y" * 3000])  # over the limit
        got = _drain(ep)
    finally:
        s.close(0)
        ep.close()
    assert got == [cancel("ok")]
    assert ep.rejected["unauthenticated"] == 2
    assert ep.rejected["oversize"] == 1


def test_endpoint_send_reaches_a_peer_endpoint() -> None:
    a_port, b_port = free_port(), free_port()
    a = ControlEndpoint(ControlCodec(None, 4096), "127.0.0.1", a_port)
    b = ControlEndpoint(ControlCodec(None, 4096), "127.0.0.1", b_port)
    try:
        a.send(f"tcp://127.0.0.1:{b_port}", cancel("hello"))
        assert _drain(b) == [cancel("hello")]
    finally:
        a.close()
        b.close()


def test_binding_a_busy_port_names_the_port_and_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(endpoint_mod, "BIND_WAIT_S", 0.5)
    port = free_port()
    a = ControlEndpoint(ControlCodec(None, 4096), "127.0.0.1", port)
    try:
        with pytest.raises(Exception, match=rf"{port}.*control.port"):
            ControlEndpoint(ControlCodec(None, 4096), "127.0.0.1", port)
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
    ep = ControlEndpoint(ControlCodec(None, 4096), "127.0.0.1", port)
    try:
        assert ep.address == f"tcp://127.0.0.1:{port}"
    finally:
        ep.close()
        holder.close()
