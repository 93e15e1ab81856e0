"""Per-key quotas of the control channel: an engine holding a valid key gets a fair share of
each receive, a bounded backlog and a few control addresses; a heartbeat or notice bigger
than any real one is refused before it is decoded."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import msgspec
import pytest

from kvpush_prod.control import ControlCodec, ControlEndpoint, KeyPair, KeyQuotas
from kvpush_prod.control.codec import LARGE_KINDS, kind_of
from kvpush_prod.control.endpoint import MAX_SPARE_PEERS
from kvpush_prod.core import messages as m
from kvpush_prod.core.quotas import SMALL_MESSAGE_BYTES
from kvpush_prod.errors import ProtocolError
from kvpush_prod.lab.launch import free_port

from .helpers import WAIT_S, keypair, secure_endpoint

V = m.PROTOCOL_VERSION


def note(tid: str, address: str = "tcp://127.0.0.1:1") -> m.Cancel:
    """A CANCEL whose sender names ``address`` as its control address (where replies go)."""
    return m.Cancel(V, tid, 3, m.PeerInfo("engine", 7, 0, address), "aborted")


def three_keys() -> tuple[tuple[KeyPair, KeyPair, KeyPair], dict[bytes, str]]:
    a, b, c = keypair("decode-0"), keypair("decode-1"), keypair("prefill-0")
    return (a, b, c), {k.public: k.name for k in (a, b, c)}


def read_until(ep: ControlEndpoint, done: Callable[[], bool]) -> None:
    """Fill ``ep``'s backlogs from its socket until ``done`` (what was sent has arrived)."""
    deadline = time.monotonic() + WAIT_S
    while not done() and time.monotonic() < deadline:
        if ep.wait(0.05):
            ep.fill()
    assert done(), (ep.backlog, ep.rejected)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


# ------------------------------------------------------------------ the codec


def test_kind_of_reads_the_tag_of_every_message_our_encoder_writes() -> None:
    peer = m.PeerInfo("e", 1, 0, "tcp://a:1")
    for msg, tag in (
        (note("t"), b"cancel"),
        (m.Heartbeat(V, peer, 0, []), b"heartbeat"),
        (m.Register(V, "t", peer, [1], 0, 1, 1, 1), b"register"),
        (m.Fallback(V, "t", 1, peer, [1], 0, "x"), b"fallback"),
        (m.DoneQuery(V, "t", 1, peer, 0), b"done_query"),
    ):
        assert kind_of(m.encode(msg)) == tag
    assert kind_of(b"\xc1" * 64) is None
    assert {b"register", b"fallback"} == LARGE_KINDS


def big_heartbeat() -> m.Heartbeat:
    live = [(f"t{i:06d}", i) for i in range(12_000)]
    return m.Heartbeat(V, m.PeerInfo("e", 1, 0, "tcp://a:1"), 0, live)


def test_a_heartbeat_over_the_small_limit_is_refused_before_it_is_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec = ControlCodec(1 << 20)
    body = m.encode(big_heartbeat())
    assert SMALL_MESSAGE_BYTES < len(body) < 1 << 20

    def never(_: bytes) -> m.ControlMessage:
        raise AssertionError("decoded")

    monkeypatch.setattr(m, "decode_control", never)
    with pytest.raises(ProtocolError) as exc:
        codec.open([body])
    assert exc.value.reason == "oversize"
    assert "heartbeat" in str(exc.value)


def test_a_register_as_big_as_max_message_bytes_is_taken() -> None:
    codec = ControlCodec(1 << 20)
    peer = m.PeerInfo("e", 1, 0, "tcp://a:1", "agent", b"\0" * (200 << 10))
    reg = m.Register(V, "t", peer, list(range(40_000)), 0, 1, 1, 1)
    body = m.encode(reg)
    assert len(body) > SMALL_MESSAGE_BYTES
    assert codec.open([body]) == reg


def test_a_message_whose_kind_cannot_be_read_gets_the_small_limit() -> None:
    codec = ControlCodec(1 << 20)
    # The same heartbeat with its tag last: msgspec still decodes it, so it must be small.
    fields = msgspec.msgpack.decode(m.encode(big_heartbeat()))
    fields["type"] = fields.pop("type")
    reordered = msgspec.msgpack.encode(fields)
    assert kind_of(reordered) is None
    with pytest.raises(ProtocolError) as exc:
        codec.open([reordered])
    assert exc.value.reason == "oversize"
    small = msgspec.msgpack.decode(m.encode(note("t")))
    small["type"] = small.pop("type")
    assert codec.open([msgspec.msgpack.encode(small)]) == note("t")


def test_an_outbound_heartbeat_over_the_small_limit_is_refused() -> None:
    with pytest.raises(ProtocolError) as exc:
        ControlCodec(1 << 20).seal(big_heartbeat())
    assert exc.value.reason == "oversize_outbound"


# ------------------------------------------------------------------ receiving


def test_a_flooding_key_gets_its_share_and_another_keys_messages_come_in_the_same_receive() -> None:
    (ka, kb, kc), allowed = three_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    c = secure_endpoint(kc, allowed, quotas=KeyQuotas(messages_per_receive=16))
    to = kc.public.decode()
    try:
        for i in range(300):
            a.send(c.address, note(f"a{i}"), to=to)
        for i in range(3):
            b.send(c.address, note(f"b{i}"), to=to)
        read_until(c, lambda: c.backlog == 303)
        got = list(c.receive(limit=256))
        by_key = Counter(origin for _, origin in got)
        assert by_key == {ka.public.decode(): 16, kb.public.decode(): 3}
        assert c.pending
        rest = list(got)
        while c.backlog:
            rest += list(c.receive(limit=256))
        from_a = [
            msg.transfer_id
            for msg, origin in rest  # type: ignore[union-attr]
            if origin == ka.public.decode()
        ]
        assert from_a == [f"a{i}" for i in range(300)]  # each key's in the order sent
        assert not c.rejected
    finally:
        for ep in (a, b, c):
            ep.close()


def test_a_key_takes_at_most_its_bytes_per_receive_and_at_least_one_message() -> None:
    (ka, kb, kc), allowed = three_keys()
    size = len(m.encode(note("a0")))
    a = secure_endpoint(ka, allowed)
    c = secure_endpoint(kc, allowed, quotas=KeyQuotas(bytes_per_receive=3 * size))
    try:
        for i in range(10):
            a.send(c.address, note(f"a{i}"), to=kc.public.decode())
        read_until(c, lambda: c.backlog == 10)
        assert len(list(c.receive())) == 3
        c2 = secure_endpoint(kc, allowed, quotas=KeyQuotas(bytes_per_receive=1))
        try:
            a.send(c2.address, note("x"), to=kc.public.decode())
            a.send(c2.address, note("y"), to=kc.public.decode())
            read_until(c2, lambda: c2.backlog == 2)
            assert [msg.transfer_id for msg, _ in c2.receive()] == ["x"]  # type: ignore[union-attr]
        finally:
            c2.close()
    finally:
        a.close()
        c.close()


def test_messages_over_a_keys_backlog_are_dropped_and_counted_and_other_keys_still_come() -> None:
    (ka, kb, kc), allowed = three_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    c = secure_endpoint(kc, allowed, quotas=KeyQuotas(backlog_messages=10))
    to = kc.public.decode()
    try:
        for i in range(50):
            a.send(c.address, note(f"a{i}"), to=to)
        read_until(c, lambda: c.backlog + c.rejected["quota_backlog"] == 50)
        assert c.backlog == 10 and c.rejected["quota_backlog"] == 40
        b.send(c.address, note("b"), to=to)
        read_until(c, lambda: c.backlog == 11)
        got = [(msg.transfer_id, origin) for msg, origin in c.receive()]  # type: ignore[union-attr]
        assert ("b", kb.public.decode()) in got
        assert [t for t, origin in got if origin == ka.public.decode()] == [
            f"a{i}" for i in range(10)
        ]
    finally:
        for ep in (a, b, c):
            ep.close()


# ------------------------------------------------------------------ addresses


def test_a_key_naming_more_control_addresses_than_its_quota_is_refused_and_counted() -> None:
    (ka, _, kc), allowed = three_keys()
    clock = Clock()
    a = secure_endpoint(ka, allowed)
    c = secure_endpoint(
        kc, allowed, clock=clock, quotas=KeyQuotas(addresses=2, address_idle_s=10.0)
    )
    to, key = kc.public.decode(), ka.public.decode()
    addr = [f"tcp://127.0.0.1:{20_000 + i}" for i in range(3)]
    try:
        for i, address in enumerate((addr[0], addr[1], addr[2], addr[0])):
            a.send(c.address, note(f"m{i}", address), to=to)
        read_until(c, lambda: c.backlog + c.rejected["quota_addresses"] == 4)
        got = [msg.transfer_id for msg, _ in c.receive()]  # type: ignore[union-attr]
        assert got == ["m0", "m1", "m3"]
        assert c.rejected["quota_addresses"] == 1
        # A reply to a third address for that key is refused too, and opens no socket.
        c.send(addr[2], note("reply"), to=key)
        assert c.rejected["quota_addresses"] == 2 and c.open_peers == 0
        # Unused for address_idle_s, the least recently used makes room (a restarted peer).
        clock.t += 11.0
        a.send(c.address, note("m4", addr[2]), to=to)
        read_until(c, lambda: c.backlog == 1)
        assert [msg.transfer_id for msg, _ in c.receive()] == ["m4"]  # type: ignore[union-attr]
        assert c.addresses_of(key) == [addr[0], addr[2]]
    finally:
        a.close()
        c.close()


def test_replies_go_to_at_most_the_quota_of_addresses_per_key_and_open_no_more_sockets() -> None:
    (ka, kb, _), allowed = three_keys()
    a = secure_endpoint(ka, allowed, quotas=KeyQuotas(addresses=2))
    b = secure_endpoint(kb, allowed)
    try:
        for port in range(5):
            a.send(f"tcp://127.0.0.1:{30_000 + port}", note("x"), to=kb.public.decode())
        assert a.open_peers == 2
        assert a.rejected == {"quota_addresses": 3}
        # Another key has its own addresses.
        a.send(b.address, note("y"), to=ka.public.decode())
        assert a.open_peers == 3 and a.rejected == {"quota_addresses": 3}
    finally:
        a.close()
        b.close()


def test_new_addresses_of_a_key_come_at_most_a_burst_then_a_few_a_second() -> None:
    (ka, kb, _), allowed = three_keys()
    clock = Clock()
    a = secure_endpoint(
        ka, allowed, clock=clock, quotas=KeyQuotas(new_addresses_burst=3, new_addresses_per_s=1.0)
    )
    to = kb.public.decode()
    try:
        for port in range(5):
            a.send(f"tcp://127.0.0.1:{30_200 + port}", note("x"), to=to)
        assert a.open_peers == 3 and a.rejected == {"quota_addresses": 2}
        a.send("tcp://127.0.0.1:30200", note("y"), to=to)  # a known one: no token needed
        assert a.rejected == {"quota_addresses": 2}
        clock.t += 1.0
        a.send("tcp://127.0.0.1:30210", note("z"), to=to)
        a.send("tcp://127.0.0.1:30211", note("z"), to=to)
        assert a.open_peers == 4 and a.rejected == {"quota_addresses": 3}
    finally:
        a.close()


def test_a_send_to_a_new_peer_connects_a_socket_the_pumps_wait_made_ahead(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    (ka, kb, _), allowed = three_keys()
    a, b = secure_endpoint(ka, allowed), secure_endpoint(kb, allowed)
    try:
        a.wait(0.001)  # the pump thread, outside its lock

        def made_in_send() -> None:
            raise AssertionError("a socket was made inside send (under the pump's lock)")

        monkeypatch.setattr(a, "_new_dealer", made_in_send)
        for i in range(MAX_SPARE_PEERS):
            a.send(
                b.address if i == 0 else f"tcp://127.0.0.1:{30_300 + i}",
                note(f"s{i}"),
                to=kb.public.decode(),
            )
        assert a.open_peers == MAX_SPARE_PEERS and not a.rejected
        got = read_received(b, 1)
        assert [msg.transfer_id for msg, _ in got] == ["s0"]  # type: ignore[union-attr]
    finally:
        a.close()
        b.close()


def read_received(ep: ControlEndpoint, n: int) -> list[tuple[m.ControlMessage, str]]:
    got: list[tuple[m.ControlMessage, str]] = []
    deadline = time.monotonic() + WAIT_S
    while len(got) < n and time.monotonic() < deadline:
        got += list(ep.poll(0.05))
    return got


def test_without_keys_addresses_are_not_bounded_per_key() -> None:
    a = ControlEndpoint(ControlCodec(4096), "127.0.0.1", free_port(), quotas=KeyQuotas(addresses=1))
    try:
        for port in range(5):
            a.send(f"tcp://127.0.0.1:{30_100 + port}", note("x"))
        assert a.open_peers == 5 and not a.rejected
    finally:
        a.close()
