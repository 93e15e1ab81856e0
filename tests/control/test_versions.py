"""Protocol versions: this build speaks its own (3) and the previous release's (2) in both
directions, settles on the highest both sides speak, and refuses anything else by name."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from kvpush_prod.control import ControlCodec, ControlEndpoint
from kvpush_prod.core import messages as m
from kvpush_prod.core import protocol
from kvpush_prod.errors import ProtocolError
from kvpush_prod.lab.launch import free_port
from kvpush_prod.metrics import PROTOCOL_VERSIONS
from tests.control.golden.capture_v2 import messages_v2
from tests.control.helpers import drain

GOLDEN = Path(__file__).parent / "golden" / "v2_frames.txt"


def golden() -> dict[str, bytes]:
    lines = GOLDEN.read_text().splitlines()
    return {k: bytes.fromhex(h) for k, h in (ln.split() for ln in lines if not ln.startswith("#"))}


def test_this_build_speaks_its_own_protocol_and_the_one_before() -> None:
    assert (protocol.OLDEST, protocol.CURRENT) == (2, 3) == (m.PROTOCOL_VERSION - 1, 3)
    assert protocol.spoken() == "2-3"
    assert (str(protocol.OLDEST), str(protocol.CURRENT)) == PROTOCOL_VERSIONS  # metric labels


@pytest.mark.parametrize("kind", sorted(set(messages_v2(m)) - {"done"}))
def test_a_v2_frame_of_the_previous_release_opens_and_encodes_byte_for_byte(kind: str) -> None:
    frame = golden()[kind]
    msg = ControlCodec(1 << 20).open([frame])
    assert msg == messages_v2(m)[kind]
    assert msg.v == 2
    assert ControlCodec(1 << 20).seal(msg) == [frame]  # what 0.1.0 itself sends: it reads it


def test_a_v2_done_notification_of_the_previous_release_decodes_and_encodes_the_same() -> None:
    frame = golden()["done"]
    done = m.decode_done(frame)
    assert done == messages_v2(m)["done"]
    assert m.encode_done(done) == frame


def register(v: int, facts: dict[str, str], incarnation: int = 1) -> m.Register:
    layout = m.Layout("c", "DRAM", [m.Region(0, 64, 64, 4)], facts=facts)
    who = m.PeerInfo("decode-0", incarnation, 0, "tcp://127.0.0.1:9", "agent", b"", layout)
    return m.Register(v, "t1", who, [1], 0, 10, 5, 1000)


def heartbeat(v: int, incarnation: int = 1) -> m.Heartbeat:
    return m.Heartbeat(v, m.PeerInfo("prefill-0", incarnation, 0, "tcp://127.0.0.1:8"), 1, [])


NEW = {"protocol": "3", "protocols": "2-3"}
OLD = {"protocol": "2"}  # kvpush-prod 0.1.0 names only the one it speaks


def test_new_pair_settles_on_3_after_a_first_register_in_2() -> None:
    p, d = protocol.PeerVersions(), protocol.PeerVersions()
    assert d.version_for("tcp://127.0.0.1:8") == 2  # P not heard yet: the oldest, all read it
    assert p.heard(register(2, NEW)) is None  # D named 2-3: no fallback
    assert p.version_for("tcp://127.0.0.1:9") == 3
    assert d.heard(heartbeat(3)) is None  # P answered in 3
    assert d.version_for("tcp://127.0.0.1:8") == 3


def test_new_prefill_talks_2_to_an_old_decode_and_says_so_once() -> None:
    p = protocol.PeerVersions()
    note = p.heard(register(2, OLD))
    assert note is not None and (note.version, note.theirs, note.engine_id) == (2, "2", "decode-0")
    assert p.version_for("tcp://127.0.0.1:9") == 2
    assert p.heard(register(2, OLD)) is None  # counted once per process of the peer
    # Upgraded (a new process naming 2-3): back to 3.
    assert p.heard(register(2, NEW, incarnation=2)) is None
    assert p.version_for("tcp://127.0.0.1:9") == 3


def test_new_decode_talks_2_to_an_old_prefill_and_says_so_once() -> None:
    d = protocol.PeerVersions()
    note = d.heard(heartbeat(2))
    assert note is not None and note.version == 2
    assert d.version_for("tcp://127.0.0.1:8") == 2
    assert d.heard(heartbeat(2)) is None
    # Restarted on an old release after a new one: settled anew, in 2.
    assert d.heard(heartbeat(3, incarnation=2)) is None
    assert d.heard(heartbeat(2, incarnation=3)) is not None
    assert d.version_for("tcp://127.0.0.1:8") == 2


def test_a_new_decode_counts_an_old_prefill_it_only_took_dones_from() -> None:
    # An older P may push to D without any control message D hears: its DONE (a NIXL
    # notification, protocol 2) is then the only word of its release (CI: d_first).
    d, at = protocol.PeerVersions(), "tcp://127.0.0.1:8"
    note = d.done_heard(at, "prefill-0", 2)
    assert note is not None and (note.version, note.engine_id, note.address) == (2, "prefill-0", at)
    assert d.version_for(at) == 2
    assert d.done_heard(at, "prefill-0", 2) is None  # once
    assert d.heard(heartbeat(2)) is None  # its first message: the same process, not again
    assert d.heard(heartbeat(2, incarnation=2)) is not None  # restarted, still old: again


def test_a_done_in_2_from_a_prefill_heard_in_3_is_no_fallback() -> None:
    d = protocol.PeerVersions()
    assert d.heard(heartbeat(3)) is None
    assert d.done_heard("tcp://127.0.0.1:8", "prefill-0", 2) is None
    assert d.done_heard("tcp://127.0.0.1:7", "prefill-1", 3) is None  # ours: nothing to note
    assert d.version_for("tcp://127.0.0.1:8") == 3
    # Known only from a DONE, then its own messages say 3 (upgraded in place): 3 from then on.
    assert d.done_heard("tcp://127.0.0.1:6", "prefill-2", 2) is not None
    assert (
        d.heard(m.Heartbeat(3, m.PeerInfo("prefill-2", 4, 0, "tcp://127.0.0.1:6"), 1, [])) is None
    )
    assert d.version_for("tcp://127.0.0.1:6") == 3


def test_the_book_of_versions_is_bounded() -> None:
    book = protocol.PeerVersions(limit=2)
    for i in range(5):
        who = m.PeerInfo("p", 1, 0, f"tcp://127.0.0.1:{i + 1}")
        book.heard(m.Heartbeat(3, who, 1, []))
    assert len(book) == 2
    assert book.version_for("tcp://127.0.0.1:1") == 2  # forgotten: the oldest again


@pytest.mark.parametrize(
    ("facts", "v", "want"),
    [
        ({"protocols": "2-3"}, 2, (2, 3)),
        ({"protocol": "2"}, 2, (2, 2)),
        ({}, 2, (2, 2)),
        ({"protocols": "junk"}, 2, (2, 2)),
        ({"protocols": "3-2"}, 2, (2, 2)),
        ({"protocols": "4"}, 4, (4, 4)),
    ],
)
def test_the_versions_a_peer_names_are_read_strictly(
    facts: dict[str, str], v: int, want: tuple[int, int]
) -> None:
    assert protocol.advertised(facts, v) == want


@pytest.mark.parametrize(
    ("msg", "fix"),
    [
        (heartbeat(1), "upgrade it to a release that speaks 2 or later"),
        (heartbeat(4), "upgrade this engine first"),
        (register(1, {"protocol": "1"}), "upgrade it to a release that speaks 2 or later"),
        (register(4, {"protocols": "4-5"}), "upgrade this engine first"),
    ],
)
def test_a_version_outside_2_to_3_is_refused_naming_both_and_the_fix(
    msg: m.ControlMessage, fix: str
) -> None:
    with pytest.raises(ProtocolError) as info:
        ControlCodec(1 << 20).open([m.encode(msg)])
    assert info.value.reason == "version"
    text = str(info.value)
    assert f"protocol {msg.v}" in text and "this engine speaks 2-3" in text, text
    assert fix in text and "docs/operations.md" in text, text


def test_a_first_register_of_a_peer_one_release_older_that_also_speaks_2_is_taken() -> None:
    """The rule the next release relies on: its oldest peers first contact it in their
    oldest version (N-2 for it), naming one it speaks; it answers in that one."""
    msg = register(1, {"protocols": "1-2"})
    assert ControlCodec(1 << 20).open([m.encode(msg)]) == msg
    book = protocol.PeerVersions()
    note = book.heard(msg)
    assert note is not None and note.version == 2


def test_endpoints_negotiate_over_the_wire_and_rewrite_the_version_of_what_they_send() -> None:
    def ep() -> ControlEndpoint:
        return ControlEndpoint(ControlCodec(1 << 20), "127.0.0.1", free_port())

    p, d = ep(), ep()
    try:
        facts = {"protocol": "3", protocol.FACT: protocol.spoken()}
        layout = m.Layout("c", "DRAM", [m.Region(0, 64, 64, 4)], facts=facts)
        d_info = m.PeerInfo("decode-0", 1, 0, d.address, "agent", b"", layout)
        d.send(p.address, m.Register(3, "t1", d_info, [1], 0, 10, 5, 1000))
        ((reg, _),) = drain(p, count=1)
        assert reg.v == 2  # first contact: the version every peer of the last release reads
        p_info = m.PeerInfo("prefill-0", 9, 0, p.address)
        p.send(d.address, m.CancelAck(2, "t1", 5, p_info))
        ((ack, _),) = drain(d, count=1)
        assert ack.v == 3  # P settled on 3 from D's REGISTER
        d.send(p.address, m.Cancel(2, "t1", 5, d_info, "x"))
        ((cancel, _),) = drain(p, count=1)
        assert cancel.v == 3 and not p.protocol_fallbacks and not d.protocol_fallbacks
    finally:
        p.close()
        d.close()


def test_an_endpoint_counts_a_peer_of_the_previous_release_and_sends_it_v2_frames() -> None:
    import zmq

    d = ControlEndpoint(ControlCodec(1 << 20), "127.0.0.1", free_port())
    ctx = zmq.Context()
    old_p = ctx.socket(zmq.ROUTER)  # receives as 0.1.0's endpoint does
    port = free_port()
    old_p.bind(f"tcp://127.0.0.1:{port}")
    out = ctx.socket(zmq.DEALER)
    out.connect(d.address)
    try:
        out.send_multipart([golden()["cancel_ack"]])  # what 0.1.0 sends, byte for byte
        ((ack, _),) = drain(d, count=1)
        assert ack == messages_v2(m)["cancel_ack"]
        assert d.protocol_fallbacks == {"2": 1}
        assert d.protocol_of(ack.sender.control) == 2
        # This build's CANCEL (made in 3) leaves as the frame 0.1.0 would send itself.
        d.send(f"tcp://127.0.0.1:{port}", msgspec.structs.replace(messages_v2(m)["cancel"], v=3))
        assert old_p.poll(10_000)
        _, body = old_p.recv_multipart()
        assert body == golden()["cancel"]
    finally:
        out.close(0)
        old_p.close(0)
        ctx.term()
        d.close()


def test_an_endpoint_counts_an_older_prefill_known_only_by_its_done() -> None:
    d = ControlEndpoint(ControlCodec(1 << 20), "127.0.0.1", free_port())
    try:
        d.done_heard("tcp://127.0.0.1:8", "prefill-0", 2)
        d.done_heard("tcp://127.0.0.1:8", "prefill-0", 2)
        d.done_heard("tcp://127.0.0.1:7", "prefill-1", 3)
        assert d.protocol_fallbacks == {"2": 1}
        assert d.protocol_of("tcp://127.0.0.1:8") == 2
    finally:
        d.close()
