"""A hostile network and hostile clients against real engines, while normal traffic flows.

An intruder forges every control message, both without keys and with a key of its own (an
engine of the deployment that owns none of the transfers), replays a recorded CURVE session,
floods (10k messages, 1 MB fields, 2k reply addresses; as an insider, 720 KB heartbeats,
65,536 REGISTERs of transfers that do not exist, a fresh reply address per message), and
clients send kv_transfer_params naming malformed, dead and foreign peers. Every normal
request must still answer the single engine's tokens, the engines stay up, nothing is held
afterwards, and every rejection is counted in a metric.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import zmq

from kvpush_prod.control.keys import KeyPair, load_allowed, load_keypair
from kvpush_prod.core import messages as m
from kvpush_prod.lab.client import Result, completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster
from kvpush_prod.lab.launch import free_port
from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.signing import DECODE, PREFILL

from .conftest import SECURE_MAX_PEERS

pytestmark = pytest.mark.e2e

MAX_TOKENS = 16
MAX_PEERS = SECURE_MAX_PEERS
_seeds = itertools.count(50_000)
V = m.PROTOCOL_VERSION
JUNK_LAYOUT = m.Layout("not-this-model", "DRAM", [m.Region(4096, 4096, 4096, 8)])


@pytest.fixture(scope="module")
def cluster(secure_recompute: Cluster) -> Cluster:
    return secure_recompute


class Intruder:
    """Speaks the control protocol at an engine's port, with a key of its own or none."""

    def __init__(self, keypair: KeyPair | None) -> None:
        self.keypair = keypair
        self.ctx = zmq.Context()
        self.ctx.setsockopt(zmq.LINGER, 0)
        self.rng = random.Random(7)

    def connect(self, port: int, server_key: bytes, address: str = "127.0.0.1") -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        if self.keypair is not None:
            sock.curve_publickey = self.keypair.public
            sock.curve_secretkey = self.keypair.secret
            sock.curve_serverkey = server_key
        sock.connect(f"tcp://{address}:{port}")
        return sock

    def claim(
        self,
        engine_id: str,
        port: int,
        layout: m.Layout | None = JUNK_LAYOUT,
        meta: bytes = b"x" * 64,
    ) -> m.PeerInfo:
        """A PeerInfo claiming to be ``engine_id`` at ``port`` (a new incarnation each time)."""
        return m.PeerInfo(
            engine_id,
            self.rng.getrandbits(62),
            0,
            f"tcp://127.0.0.1:{port}",
            f"evil-{self.rng.getrandbits(32):x}",
            meta,
            layout,
        )

    def gen(self) -> int:
        return self.rng.getrandbits(63)

    def at_prefill(self, tid: str, d_port: int) -> list[m.ControlMessage]:
        """Everything a decode engine may say to P about ``tid``, forged."""
        d = self.claim("decode", d_port)
        slim = self.claim("decode", d_port, None, b"")
        return [
            m.Register(V, tid, d, [0, 1, 2], 0, 300, self.gen(), 5000),
            m.Heartbeat(V, slim, 0, [(tid, self.gen())], 60_000),
            m.Cancel(V, tid, 0, slim, "not_needed"),
            m.Cancel(V, tid, self.gen(), slim, "aborted"),
            m.PullDone(V, tid, self.gen(), slim, True),
        ]

    def at_decode(self, tid: str, p_port: int) -> list[m.ControlMessage]:
        """Everything a prefill engine may say to D about ``tid``, forged."""
        p = self.claim("prefill", p_port)
        slim = self.claim("prefill", p_port, None, b"")
        return [
            m.Failed(V, tid, self.gen(), slim, "prefill_failed"),
            m.CancelAck(V, tid, self.gen(), slim),
            m.Fallback(V, tid, self.gen(), p, [0, 1, 2], 0, "push_failed"),
            m.Heartbeat(V, slim, 0, [(tid, self.gen())], 60_000),
        ]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def public_keys(cluster: Cluster) -> dict[str, bytes]:
    return {name: key for key, name in load_allowed(cluster.allowed_dir).items()}


class Recorder:
    """A TCP relay to an engine's control port that records what the client sent."""

    def __init__(self, target_port: int) -> None:
        self.port = free_port()
        self.sent = bytearray()
        self._srv = socket.create_server(("127.0.0.1", self.port))
        self._target = target_port
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self._srv.accept()
        upstream = socket.create_connection(("127.0.0.1", self._target))

        def pump(a: socket.socket, b: socket.socket, record: bool) -> None:
            try:
                while data := a.recv(65536):
                    if record:
                        self.sent += data
                    b.sendall(data)
            except OSError:
                pass

        threading.Thread(target=pump, args=(upstream, client, False), daemon=True).start()
        pump(client, upstream, True)


def rejected(samples: dict, role: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        lb = dict(labels)
        if name == "kvpush_control_messages_rejected_total" and lb.get("role") == role:
            out[lb["reason"]] = out.get(lb["reason"], 0.0) + value
    return out


def params_rejected(samples: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for (name, labels), value in samples.items():
        if name == "kvpush_kv_params_rejected_total":
            reason = dict(labels).get("reason", "")
            out[reason] = out.get(reason, 0.0) + value
    return out


def fds(cluster: Cluster, name: str) -> int:
    return sum(p.num_fds() for p in cluster.procs[name].tree() if p.is_running())


async def routed_by_hand(
    client: httpx.AsyncClient, cluster: Cluster, prompt: str, tid: str, keys: dict[str, bytes]
) -> Result:
    """Both legs sent as the router sends them, with a transfer id the intruder knows."""
    p_params = cluster.sign(
        {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "transfer_id": tid,
            "decode_key": keys["decode"].decode(),
        },
        PREFILL,
    )
    d_params = cluster.sign(
        {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": "prefill",
            "remote_host": "127.0.0.1",
            "remote_port": cluster.p_control,
            "tp_size": 1,
            "transfer_id": tid,
            "remote_key": keys["prefill"].decode(),
        },
        DECODE,
    )
    p_leg = request(
        client,
        cluster.urls["prefill"],
        completion_body(prompt, 1, False, kv_transfer_params=p_params),
    )
    d_leg = request(
        client,
        cluster.urls["decode"],
        completion_body(prompt, MAX_TOKENS, False, kv_transfer_params=d_params),
    )
    _, got = await asyncio.gather(p_leg, d_leg)
    return got


def spray(stop: threading.Event, socks: list[tuple[zmq.Socket, list[m.ControlMessage]]]) -> None:
    """Send forged messages over and over until ``stop`` (while a transfer is live)."""
    while not stop.is_set():
        for sock, msgs in socks:
            for msg in msgs:
                # A socket that never completes its handshake fills up: drop the rest.
                with contextlib.suppress(zmq.Again):
                    sock.send(m.encode(msg), zmq.NOBLOCK)
        time.sleep(0.002)


async def test_forged_replayed_and_flooded_control_messages_and_hostile_params_harm_nothing(
    cluster: Cluster, tmp_path: Path
) -> None:
    keys = public_keys(cluster)
    insider = Intruder(load_keypair(cluster.key_file("intruder")))
    outsider = Intruder(None)
    before = {n: scrape(cluster.urls[n]) for n in ("prefill", "decode")}
    p_fds = fds(cluster, "prefill")
    results: list[tuple[str, Result, Result]] = []  # (what, got, reference)

    async with httpx.AsyncClient(timeout=120) as client:

        async def normal(n_tokens: int, how: str) -> None:
            prompt = prompt_of_length(n_tokens, seed=next(_seeds))
            ref = await request(
                client, cluster.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
            )
            if how == "router":
                got = await request(
                    client, cluster.urls["router"], completion_body(prompt, MAX_TOKENS, False)
                )
            else:
                got = await targeted(prompt)
            results.append((how, got, ref))

        async def targeted(prompt: str) -> Result:
            # The intruder knows this transfer id and forges every notice about it, with
            # its own key and with none, for as long as the transfer lives.
            tid = f"hostile-{next(_seeds)}"
            socks = []
            for who in (insider, outsider):
                socks.append(
                    (
                        who.connect(cluster.p_control, keys["prefill"]),
                        who.at_prefill(tid, cluster.d_control),
                    )
                )
                socks.append(
                    (
                        who.connect(cluster.d_control, keys["decode"]),
                        who.at_decode(tid, cluster.p_control),
                    )
                )
            stop = threading.Event()
            thread = threading.Thread(target=spray, args=(stop, socks), daemon=True)
            thread.start()
            try:
                return await routed_by_hand(client, cluster, prompt, tid, keys)
            finally:
                stop.set()
                thread.join()

        # 1. Targeted forgeries during live transfers, beside normal router traffic.
        await asyncio.gather(
            *(normal(n, how) for n in (300, 700, 1200) for how in ("router", "targeted"))
        )

        # 2. Floods: 10k messages, 1 MB fields, 2k reply addresses (each a new incarnation
        #    claiming a port where nothing listens: P answers every one of them).
        flood = insider.connect(cluster.p_control, keys["prefill"])
        for i in range(10_000):
            reply_port = 20_000 + i % 2_000
            msg = insider.at_prefill(f"flood-{i}", reply_port)[i % 5]
            flood.send(m.encode(msg))
        big = insider.claim("decode", cluster.d_control, meta=b"\0" * 1_000_000)
        for _ in range(5):
            flood.send(m.encode(m.Register(V, "big", big, [0], 0, 16, 1, 5000)))
        flood_d = insider.connect(cluster.d_control, keys["decode"])
        for i in range(10_000):
            flood_d.send(m.encode(insider.at_decode(f"flood-{i}", 20_000 + i % 2_000)[i % 4]))
        junk = outsider.connect(cluster.p_control, keys["prefill"])
        for _ in range(1_000):
            junk.send(b"\xc1" * 512)

        # 2b. The floods of an engine that holds a valid key (issue 22), beside normal
        #     traffic: 64 heartbeats of ~720 KB at each engine, 65,536 REGISTERs for
        #     transfers that do not exist, and notices each naming a fresh reply address.
        #     Each is refused and counted by the insider's quotas; the engines' decode gaps
        #     under them are measured by benchmarks/keyed_flood.py.
        slim = insider.claim("decode", cluster.d_control, None, b"")
        huge = m.encode(
            m.Heartbeat(V, slim, 0, [(str(i % 97), i) for i in range(m.MAX_LIVE)], 60_000)
        )
        for sock in (flood, flood_d):
            for _ in range(64):
                sock.send(huge)
        ghosts = [
            m.encode(m.Register(V, f"ghost-{i}", slim, [0, 1, 2], 0, 300, 1 + i, 5000))
            for i in range(65_536)
        ]
        for body in ghosts:
            flood.send(body)
        for i in range(5_000):
            fresh = insider.claim("decode", 30_000 + i, None, b"")
            flood.send(m.encode(m.Cancel(V, f"gone-{i}", 0, fresh, "aborted")))
            flood_d.send(m.encode(m.DoneQuery(V, f"gone-{i}", 1, fresh, 0)))
        await asyncio.gather(
            *(normal(n, how) for n in (350, 650) for how in ("router", "targeted"))
        )

        # 3. A recorded CURVE session of the insider, replayed byte for byte.
        relay = Recorder(cluster.p_control)
        recorded = insider.connect(relay.port, keys["prefill"])
        recorded.send(m.encode(insider.at_prefill("replayed", cluster.d_control)[0]))
        await asyncio.sleep(1.0)
        with socket.create_connection(("127.0.0.1", cluster.p_control)) as raw:
            raw.sendall(bytes(relay.sent))
            await asyncio.sleep(1.0)

        # 4. Clients that reach D directly and name malformed, dead and foreign peers.
        hostile_params = {
            "unsigned": {
                "do_remote_prefill": True,
                "remote_host": "127.0.0.1",
                "remote_port": cluster.p_control,
                "remote_key": keys["prefill"].decode(),
            },
            "malformed": cluster.sign(
                {
                    "do_remote_prefill": True,
                    "remote_host": "a b",
                    "remote_port": cluster.p_control,
                    "transfer_id": "hostile-malformed",
                },
                DECODE,
            ),
            "dead": cluster.sign(
                {
                    "do_remote_prefill": True,
                    "remote_host": "127.0.0.1",
                    "remote_port": free_port(),
                    "transfer_id": "hostile-dead",
                    "remote_key": keys["prefill"].decode(),
                },
                DECODE,
            ),
            "foreign": cluster.sign(
                {
                    "do_remote_prefill": True,
                    "remote_host": "127.0.0.1",
                    "remote_port": cluster.p_control,
                    "transfer_id": "hostile-foreign",
                    "remote_key": zmq.curve_keypair()[0].decode(),
                },
                DECODE,
            ),
        }

        async def hostile(kind: str, params: dict) -> None:
            prompt = prompt_of_length(400, seed=next(_seeds))
            ref = await request(
                client, cluster.urls["reference"], completion_body(prompt, MAX_TOKENS, False)
            )
            got = await request(
                client,
                cluster.urls["decode"],
                completion_body(prompt, MAX_TOKENS, False, kv_transfer_params=params),
            )
            results.append((f"client:{kind}", got, ref))

        await asyncio.gather(
            *(hostile(k, p) for k, p in hostile_params.items()),
            *(normal(n, "router") for n in (200, 900)),
        )

        # 5. Afterwards the pair still serves, pushed, and every lease is over.
        for n in (250, 1100):
            await normal(n, "router")
        for n in (500, 800):
            await normal(n, "targeted")
    insider.close()
    outsider.close()

    wrong = [
        (how, got.status, got.error, got.text[:40], ref.text[:40])
        for how, got, ref in results
        if not got.ok or got.text != ref.text
    ]
    assert wrong == []
    for name in ("prefill", "decode"):
        assert httpx.get(cluster.urls[name] + "/health", timeout=5).status_code == 200
    assert cluster.wait_idle(90) == {"prefill": 0.0, "decode": 0.0}
    # 2,000 reply addresses and more: P keeps at most max_peers sockets (a few fds each).
    assert fds(cluster, "prefill") - p_fds < 4 * MAX_PEERS + 200

    # Every rejection is counted (a request makes the engines ship their counters).
    async with httpx.AsyncClient(timeout=60) as client:
        await request(client, cluster.urls["router"], completion_body("w5 w6", 2, False))
    after = {n: scrape(cluster.urls[n]) for n in ("prefill", "decode")}
    grew = {}
    for name, role in (("prefill", "producer"), ("decode", "consumer")):
        b, a = rejected(before[name], role), rejected(after[name], role)
        grew[name] = {r: a[r] - b.get(r, 0.0) for r in a if a[r] > b.get(r, 0.0)}
    p_grew, d_grew = grew["prefill"], grew["decode"]
    assert {"not_owner", "incompatible", "malformed"} <= p_grew.keys(), p_grew
    assert any(r.startswith("handshake_") for r in p_grew), p_grew  # no key, replay, junk
    assert {"not_owner"} <= d_grew.keys(), d_grew
    # The insider over its own quotas (2b): a REGISTER flood, fresh reply addresses, and
    # heartbeats bigger than any real one (refused before they are decoded).
    assert {"quota_registrations", "quota_addresses", "oversize"} <= p_grew.keys(), p_grew
    assert {"quota_addresses", "oversize"} <= d_grew.keys(), d_grew
    assert any(r.startswith("handshake_") for r in d_grew), d_grew
    params_grew = {
        r: v - params_rejected(before["decode"]).get(r, 0.0)
        for r, v in params_rejected(after["decode"]).items()
    }
    assert {"unsigned", "malformed", "unknown_key"} <= {
        r for r, v in params_grew.items() if v > 0
    }, params_grew
    for name in ("prefill", "decode"):
        assert metric_sum(after[name], "kvpush_pump_errors_total") == 0
    # The normal requests were pushed, not recomputed. (At stop 17 one request sent right
    # after the floods was recomputed in 4 of 4 runs: a CurveZMQ handshake between the real
    # P and D did not finish within HANDSHAKE_IVL while pyzmq's asyncio ZAP thread served
    # the allow-list; with our own blocking ZAP thread, 0 recomputed in every run since.)
    pushed = metric_sum(after["decode"], "kvpush_transfers_total", outcome="pushed") - metric_sum(
        before["decode"], "kvpush_transfers_total", outcome="pushed"
    )
    normal = sum(1 for how, _, _ in results if not how.startswith("client:"))
    assert pushed >= normal, (pushed, normal)
