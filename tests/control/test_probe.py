"""The control-port probe (``kvpush doctor --peer``): an allow-listed key gets fixed-size
answers with the engine's clock; a key not in the list gets no handshake; probes never reach
the protocol core and a plain message still does."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from kvpush_prod.control import ControlEndpoint, KeyPair, probe
from kvpush_prod.doctor.peer import ProbeError, ProbePlan, probe_peer

from .helpers import cancel, drain, keypair, secure_endpoint, two_keys

PLAN = ProbePlan(pings=5, burst_bytes=1 << 20, frame_bytes=2048, timeout_s=3.0)


class Pumped:
    """The endpoint driven as an engine's pump drives it (wait, then receive), in a thread."""

    def __init__(self, ep: ControlEndpoint, doctor: KeyPair, server: bytes) -> None:
        self.ep, self.doctor, self.server = ep, doctor, server
        self.got: list[tuple[object, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.got.extend(self.ep.poll(0.02))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def engine() -> Iterator[tuple[Pumped, dict[bytes, str]]]:
    (engine_pair, doctor_pair), allowed = two_keys()
    ep = secure_endpoint(engine_pair, allowed)
    pumped = Pumped(ep, doctor_pair, engine_pair.public)
    yield pumped, allowed
    pumped.stop()
    ep.close()


def test_an_allow_listed_key_measures_latency_bandwidth_and_skew(
    engine: tuple[Pumped, dict[bytes, str]],
) -> None:
    pumped, _ = engine
    result = probe_peer(pumped.ep.address, pumped.doctor, pumped.server, PLAN)
    assert len(result.rtts_s) == PLAN.pings and 0 < result.rtt_p50_s < 1
    assert result.burst_bytes == (PLAN.burst_bytes // PLAN.frame_bytes) * (
        PLAN.frame_bytes + len(probe.PROBE_PREFIX) + 8
    )
    assert result.bandwidth_bytes_per_s > 0
    assert abs(result.skew_s) < 0.05  # one clock: no skew beyond the round trip
    assert pumped.ep.probes == PLAN.pings + PLAN.burst_bytes // PLAN.frame_bytes
    assert pumped.got == [] and not pumped.ep.rejected  # nothing reached the core


def test_a_key_not_in_the_allow_list_gets_no_handshake(
    engine: tuple[Pumped, dict[bytes, str]],
) -> None:
    pumped, _ = engine
    with pytest.raises(ProbeError, match="handshake"):
        probe_peer(pumped.ep.address, keypair("stranger"), pumped.server, PLAN)
    assert pumped.ep.probes == 0


def test_a_control_message_still_arrives_beside_probes(
    engine: tuple[Pumped, dict[bytes, str]],
) -> None:
    pumped, allowed = engine
    pumped.stop()
    sender = secure_endpoint(pumped.doctor, allowed)
    try:
        sender.send(pumped.ep.address, cancel(), to=next(iter(allowed)).decode())
        got = drain(pumped.ep, count=1)
        assert [type(m).__name__ for m, _ in got] == ["Cancel"]
    finally:
        sender.close()


def test_a_silent_port_is_a_named_timeout() -> None:
    from kvpush_prod.lab.launch import free_port

    start = time.monotonic()
    with pytest.raises(ProbeError, match="no handshake"):
        probe_peer(f"tcp://127.0.0.1:{free_port()}", None, None, ProbePlan(timeout_s=0.5))
    assert time.monotonic() - start < 3


def test_reply_is_fixed_size_whatever_the_probe_carries() -> None:
    big = probe.reply(probe.request(7, 1 << 20), 123.5)
    assert big is not None and len(big) == probe.REPLY_BYTES
    pong = probe.parse_reply(big)
    assert pong == probe.Pong(7, len(probe.request(7, 1 << 20)), 123.5)
    assert probe.reply(probe.PROBE_PREFIX + b"x", 0.0) is None
    assert not probe.is_probe(b"\x85\xa4type")  # a control message starts as a msgpack map
