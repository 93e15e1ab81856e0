"""The slow-link guard over a throttled network path: P in its own network namespace behind
a 100 Mbit/s ``tc tbf`` (about 12 MB/s), D and the router here, KV over UCX's TCP transport.
A profile expecting 1 Gbit/s per link: kvpush_link_slow goes to 1 and P logs once, naming
the transports; expecting 0.05 Gbit/s: the link meets it and both stay quiet."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec

from .netns import Link, throttled_link, why_not

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(why_not() is not None, reason=str(why_not()))]

CASES = {
    "slow": {"expected_gbps": 1.0, "slow_fraction": 0.5, "slow_window_s": 1.0},
    "met": {"expected_gbps": 0.05, "slow_fraction": 0.25, "slow_window_s": 1.0},
}


def _spec(tmp: pytest.TempPathFactory, case: str, link: Link) -> ClusterSpec:
    def control(host_ip: str) -> dict[str, object]:
        return {"host": "0.0.0.0", "advertise_host": host_ip}

    ucx = {"UCX_TLS": "tcp,self"}  # cross-memory attach would bypass the network
    return ClusterSpec(
        workdir=tmp.mktemp(f"guard-netns-{case}"), reference=False,
        netns={"prefill": (link.netns, link.ns_ip)},
        prefill_extra={"control": control(link.ns_ip), "links": CASES[case]},
        decode_extra={"control": control(link.host_ip)},
        prefill_env={**ucx, "UCX_NET_DEVICES": link.ns_dev},
        decode_env={**ucx, "UCX_NET_DEVICES": link.host_dev})


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[tuple[str, Cluster]]:
    with throttled_link() as link, Cluster(_spec(tmp_path_factory, request.param, link)) as c:
        yield request.param, c


async def _traffic(url: str, seconds: float) -> int:
    done, i = 0, 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(trust_env=False, timeout=120) as client:
        while time.monotonic() < deadline:
            prompt = " ".join(f"w{4 + (i * 37 + k * 11) % 1000}" for k in range(1500))
            result = await request(client, url, completion_body(prompt, 2, stream=False))
            assert result.ok, result.error
            done, i = done + 1, i + 1
    return done


def test_a_throttled_link_is_slow_against_its_expectation_and_fine_against_a_met_one(
        case: tuple[str, Cluster]) -> None:
    name, cluster = case
    assert asyncio.run(_traffic(cluster.urls["router"], 4.0)) >= 3
    time.sleep(0.5)
    samples = scrape(cluster.urls["prefill"])
    slow = [v for (n, labels), v in samples.items()
            if n == "kvpush_link_slow" and dict(labels).get("role") == "producer"]
    bandwidth = [v for (n, labels), v in samples.items()
                 if n == "kvpush_link_bandwidth_bytes_per_second"]
    print(f"{name}: measured link bandwidth {[f'{b / 1e6:.1f} MB/s' for b in bandwidth]}")
    assert bandwidth and all(b < 20e6 for b in bandwidth)  # the tbf rate, not loopback's GB/s
    pushed = sum(v for (n, labels), v in samples.items() if n == "kvpush_transfers_total"
                 and dict(labels).get("outcome") == "pushed")
    assert pushed >= 3  # the KV crossed the throttled link
    log = (cluster.log_dir / "prefill.log").read_text(errors="replace")
    lines = [line for line in log.splitlines() if "is slow: measured" in line]
    if name == "slow":
        assert slow == [1.0], samples
        assert len(lines) == 1, lines
        assert "transports in use: NIXL backend UCX" in lines[0]
        assert "UCX_TLS=tcp,self" in lines[0]
    else:
        assert slow == [0.0]
        assert lines == []
