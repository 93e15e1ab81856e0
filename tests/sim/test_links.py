"""The simulator's per-decode paths and the router's D choice on them: a decode node behind a
slow path (``decode_link_bandwidth``) is what benchmarks/link_aware.py measures on engines;
the router's own LinkAware policy (``d_policy="link_aware"``) learns the pairs there as it
does in front of real engines."""

from __future__ import annotations

import pytest

from kvpush_prod.sim.cli import main as sim_main
from kvpush_prod.sim.model import MODES, Sim, Workload, simulate
from kvpush_prod.sim.presets import P5EN

# 1 P x 2 D on the P5en preset; D1's path 10x slower than P's NIC share.
TWO_D = P5EN.with_(n_prefill=1, n_decode=2, decode_kv_blocks=40_000)
SLOW = TWO_D.with_(decode_link_bandwidth=(0.0, 40e9 / 8))
WORK = Workload(requests=48, lengths=(8192,), output_tokens=16, concurrency=1)


def test_a_slow_decode_path_slows_the_transfers_that_cross_it():
    fast = simulate(TWO_D.with_(d_policy="round_robin"), "kvpush", WORK)
    slow = simulate(SLOW.with_(d_policy="round_robin"), "kvpush", WORK)
    assert slow["per_d"] == fast["per_d"] == [24, 24]
    # Half the transfers cross the slow path: the p50 sits on one side of the split, the p90
    # on the slow one, ~10x the fast transfer.
    assert slow["kv_transfer_ms"]["p90"] > 5 * fast["kv_transfer_ms"]["p90"]


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_pays_the_slow_path(mode: str):
    fast = simulate(TWO_D.with_(d_policy="round_robin"), mode, WORK)
    slow = simulate(SLOW.with_(d_policy="round_robin"), mode, WORK)
    assert slow["ok"] == fast["ok"] == WORK.requests
    assert slow["ttft_ms"]["p90"] > fast["ttft_ms"]["p90"]


def test_link_aware_sends_most_requests_over_the_fast_path_and_cuts_ttft():
    rr = simulate(SLOW.with_(d_policy="round_robin"), "kvpush", WORK)
    la = simulate(SLOW.with_(d_policy="link_aware"), "kvpush", WORK)
    assert la["ok"] == rr["ok"] == WORK.requests
    fast_share, slow_share = la["per_d"]
    # The first request of each pair is untimed and every 16th choice re-times: the slow
    # path still gets a few.
    assert 1 <= slow_share <= WORK.requests // 6 < fast_share
    assert la["ttft_ms"]["p50"] < 0.8 * rr["ttft_ms"]["p50"]


def test_link_aware_shares_alike_paths():
    la = simulate(TWO_D.with_(d_policy="link_aware"), "kvpush", WORK)
    assert min(la["per_d"]) >= WORK.requests // 4


def test_the_router_policy_is_the_routers_own_and_learns_in_simulated_time():
    from kvpush_prod.router.policy import LinkAware

    sim = Sim(SLOW.with_(d_policy="link_aware"), "kvpush", WORK)
    assert type(sim.d_policy) is LinkAware
    sim.run()
    p = sim._p_backends[0]
    fast, slow = (sim.d_policy.estimate(p, d) for d in sim._d_backends)
    assert fast is not None and slow is not None and slow > 3 * fast


def test_bad_decode_links_and_policies_are_refused_with_the_value(capsys):
    with pytest.raises(SystemExit, match="--decode-links '0,x'"):
        sim_main(["--decode-links", "0,x", "--decode", "2"])
    with pytest.raises(SystemExit, match="names 3 decode nodes"):
        sim_main(["--decode-links", "0,1,2", "--decode", "2"])
    with pytest.raises(SystemExit):
        sim_main(["--d-policy", "fastest"])
    assert "invalid choice: 'fastest'" in capsys.readouterr().err
