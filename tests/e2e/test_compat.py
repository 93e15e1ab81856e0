"""Engines that cannot share KV meet: the prefill engine refuses the decode engine at the
first handshake, with an error naming both sides' values, counted and alerted on; no byte
moves, the decode engine computes the prompts itself (kv_load_failure_policy: recompute),
and nothing is held afterwards. Here: different KV block sizes on P and D."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import httpx
import pytest

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

pytestmark = pytest.mark.e2e

_seeds = itertools.count(9000)


@pytest.fixture(scope="module")
def mismatched(e2e_workdir) -> Iterator[Cluster]:  # type: ignore[no-untyped-def]
    spec = ClusterSpec(workdir=e2e_workdir("e2e-compat"), reference=False,
                       prefill_args=["--block-size", "32"], decode_args=["--block-size", "64"],
                       kv_load_failure_policy="recompute", prefill_kv_gib=1, decode_kv_gib=1)
    with Cluster(spec) as c:
        yield c


async def test_a_block_size_mismatch_is_refused_at_the_handshake_naming_both_values(
        mismatched: Cluster) -> None:
    assert (mismatched.block_size("prefill"), mismatched.block_size("decode")) == (32, 64)
    before_p, before_d = scrape(mismatched.urls["prefill"]), scrape(mismatched.urls["decode"])
    async with httpx.AsyncClient(timeout=120) as client:
        for n in (5, 200, 700):
            got = await request(client, mismatched.urls["router"],
                                completion_body(prompt_of_length(n, seed=next(_seeds)), 8,
                                                False))
            assert got.ok, got.error
            assert len(got.text) > 0
            summary = (got.kv_transfer_params or {}).get("kvpush", {})
            assert summary.get("outcome") != "pushed", summary
    after_p, after_d = scrape(mismatched.urls["prefill"]), scrape(mismatched.urls["decode"])
    refused = (metric_sum(after_p, "kvpush_control_messages_rejected_total",
                          reason="incompatible")
               - metric_sum(before_p, "kvpush_control_messages_rejected_total",
                            reason="incompatible"))
    assert refused >= 1
    pushed = (metric_sum(after_d, "kvpush_transfers_total", outcome="pushed")
              - metric_sum(before_d, "kvpush_transfers_total", outcome="pushed"))
    assert pushed == 0
    # Both logs name the difference, this side's value first.
    p_log = mismatched.procs["prefill"].log_path.read_text(errors="replace")
    d_log = mismatched.procs["decode"].log_path.read_text(errors="replace")
    assert "block_size: '32' here, '64' on the peer" in p_log
    assert "block_size: '32' here, '64' on the peer" in d_log  # P's refusal, relayed to D
    # Nothing is held for the send lease, also when D's REGISTER reached P before P had the
    # request: the router named that D, so P frees the blocks as they come.
    assert mismatched.wait_idle(timeout=15) == {"prefill": 0, "decode": 0}
