"""The simulator's layer-wise push (``push.layerwise``, through the core's own LayersReady),
its calibrated post cost (fixed + per descriptor, descriptors per run of adjacent blocks),
its chunked prefill, and that with layer-wise push off it gives the numbers it gave before."""

from __future__ import annotations

import pytest

from kvpush_prod.core.commands import LayersReady
from kvpush_prod.sim.cli import main as sim_main
from kvpush_prod.sim.model import ClusterModel, Sim, Workload, scattered, simulate
from kvpush_prod.sim.presets import CPU_LOOPBACK, P5EN

SMALL = P5EN.with_(decode_kv_blocks=20_000)


def layerwise(m: ClusterModel, mode: str) -> ClusterModel:
    return m.with_(overrides=(*m.overrides, f"push.layerwise={mode}"))


def test_layerwise_on_moves_bytes_before_the_prefill_ends_and_done_after_the_last_layer():
    sim = Sim(layerwise(SMALL, "on"), "kvpush", Workload(requests=3, lengths=(8192,)))
    last_layer: dict[str, float] = {}
    for tx in sim.tx:
        real = tx.command

        def spy(command, real=real):
            if isinstance(command, LayersReady) and command.ready == command.parts:
                last_layer.setdefault(command.transfer_id, sim.loop.now)
            return real(command)

        tx.command = spy  # type: ignore[method-assign]
    reqs = sim.run()
    assert len(reqs) == 3 and all(r.done >= 0 for r in reqs)
    for r in reqs:
        assert 0 <= r.xfer_start <= r.first_bytes < r.p_done  # bytes move during the forward
        assert r.done_posted >= last_layer[f"t{r.rid}"] >= r.p_done
    counters = sim.counters
    assert counters["layerwise_steps"] == 3 and counters["transfer_done"] == 3
    assert 0 < counters["layer_writes_during_forward"] < counters["layer_writes"]


def test_layerwise_off_posts_nothing_until_the_prefill_ended():
    reqs = Sim(layerwise(SMALL, "off"), "kvpush", Workload(requests=2, lengths=(8192,))).run()
    assert all(r.xfer_start >= r.p_done for r in reqs)


@pytest.mark.parametrize(("length", "on"), [(256, False), (512, False), (8192, True)])
def test_auto_pushes_short_prompts_after_the_forward_and_long_ones_layer_by_layer(length, on):
    r = simulate(layerwise(SMALL, "auto"), "kvpush", Workload(requests=2, lengths=(length,)))
    assert r["ok"] == 2
    assert ("layerwise_steps" in r["counters"]) is on
    assert ("layer_writes" in r["counters"]) is on


# TTFTs (s) of each request before layer-wise push, per-descriptor post costs and
# tensor-parallel ranks were simulated (commit f15e564), on the post cost of then: desc_s
# 0.15 us per block per region, no fixed part, posts not serialised; one unit per engine
# (tp 1).
BEFORE = dict(post_fixed_s=0.0, desc_s=0.15e-6, coalesce=0, post_serial=0, tp=1)
W_CLOSED = Workload(requests=8, lengths=(1024, 4096), output_tokens=8, concurrency=3)
W_POISSON = Workload(
    requests=8, lengths=(512, 2048), output_tokens=8, kind="poisson", rate=30.0, seed=5
)
TTFT_BEFORE = {
    ("p5en", "pull"): [0.07097099999999999, 0.19356099999999998, 0.123842, 0.19200900000000007,
                       0.07693100000000003, 0.21616400000000024, 0.07687100000000008,
                       0.20320999999999978],
    ("p5en", "push"): [0.062095000000000004, 0.18356499999999998, 0.11043, 0.18280500000000002,
                       0.06089499999999995, 0.2069250000000003, 0.06089500000000009,
                       0.21746999999999994],
    ("p5en", "kvpush"): [0.060595, 0.169565, 0.09687, 0.18130500000000002, 0.06039499999999995,
                         0.21748500000000032, 0.06039500000000009, 0.20490999999999993],
    ("cpu", "pull"): [0.07280239999999999, 0.23547725294402347, 0.4988257206715542,
                      0.411355518178499, 0.3664660639491454, 0.7373992045900425,
                      0.7441180647521273, 0.7232296297576982],
    ("cpu", "push"): [0.06860000000000002, 0.23306765294402362, 0.4930113206715546,
                      0.39784111817849943, 0.3529516639491458, 0.7360776045900429,
                      0.7350964647521276, 0.7142080297576986],
    ("cpu", "kvpush"): [0.06760000000000002, 0.23056765294402362, 0.4890113206715546,
                        0.3938411181784994, 0.3489516639491458, 0.7260776045900429,
                        0.7250964647521276, 0.7042080297576986],
}  # fmt: skip


@pytest.mark.parametrize(("preset", "mode"), sorted(TTFT_BEFORE))
def test_layerwise_off_gives_the_same_ttfts_as_before(preset, mode):
    m, w = (SMALL, W_CLOSED) if preset == "p5en" else (CPU_LOOPBACK, W_POISSON)
    reqs = Sim(layerwise(m.with_(**BEFORE), "off"), mode, w).run()
    assert [r.ttft for r in reqs] == TTFT_BEFORE[preset, mode]


def test_descriptors_are_one_per_run_per_region_or_per_block():
    m = SMALL  # 160 regions, 80 layers
    fresh, split = list(range(10)), [0, 1, 2, 7, 8, 20, 21, 22, 23, 24]
    assert m.descriptors(range(10), fresh) == 160
    assert m.descriptors(range(10), split) == 3 * 160
    assert m.descriptors(range(10), fresh, parts=80) == 2  # one layer: K and V
    assert m.with_(coalesce=0).descriptors(range(10), fresh) == 10 * 160
    assert m.post_cost(10) < m.post_cost(1000)
    assert m.post_cost(0) == m.post_fixed_s


def test_a_fragmented_cache_costs_more_descriptors_and_more_post_time():
    w = Workload(requests=3, lengths=(4096,))
    sims = {}
    for frag in (0.0, 1.0):
        sims[frag] = Sim(layerwise(SMALL, "on").with_(fragment=frag), "kvpush", w)
        sims[frag].run()
    fresh, frag = sims[0.0], sims[1.0]
    assert frag.counters["descriptors"] > 10 * fresh.counters["descriptors"]
    assert frag.counters["posts"] == fresh.counters["posts"]
    assert frag.post_s > fresh.post_s > 0
    # vLLM push posts the whole transfer at once: D's fragmentation lands on its TTFT.
    push = [simulate(SMALL.with_(fragment=f), "push", w)["ttft_ms"]["p50"] for f in (0, 1)]
    assert push[1] > push[0]


def test_scattered_cache_hands_out_runs_as_long_as_the_fragmentation_allows():
    import random

    ids = scattered(1000, 0.0, random.Random(0))
    assert ids == list(range(1000))
    ids = scattered(1000, 1.0, random.Random(0))
    assert sorted(ids) == list(range(1000))
    breaks = sum(1 for a, b in zip(ids, ids[1:], strict=False) if b != a + 1)
    assert breaks > 950


def test_a_prompt_longer_than_a_step_is_prefilled_in_steps():
    m = SMALL.with_(max_batched_tokens=4096)
    (r,) = Sim(m, "kvpush", Workload(requests=1, lengths=(8192,))).run()
    assert r.p_done - r.p_start == pytest.approx(
        2 * m.prefill_step_s + 8192 * m.prefill_s_per_token
    )
    assert r.done >= 0


def test_cli_layerwise_table_and_bad_values(capsys):
    args = ["--layerwise-table", "--lengths", "1024", "--concurrency", "1", "--set"]
    args += ["decode_kv_blocks=20000"]
    assert sim_main([*args, "--requests", "2", "--output-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "| 1024 | 1 |" in out and "kvpush on, fragmented" in out
    with pytest.raises(SystemExit, match="--fragment 2: give a probability"):
        sim_main(["--fragment", "2"])
    with pytest.raises(SystemExit, match="7 layers over 160 KV regions"):
        sim_main(["--set", "layers=7"])
    with pytest.raises(SystemExit):
        sim_main(["--layerwise", "sometimes"])


def test_auto_decides_by_whole_pushes_so_layerwise_chunks_do_not_keep_it_on():
    """1k prompts among short ones on one P, 3 ms threshold: a whole push moves a rank's 1k
    KV in under 3 ms, but a layer's chunk measures the link 2-3x slower. Deciding on every
    chunk's estimate kept every 1k step layer-wise (12 of 12); on whole pushes' alone, auto
    turns back off once the short prompts' whole pushes measured the link."""
    m = SMALL.with_(
        n_prefill=1,
        overrides=("push.layerwise=auto", "push.layerwise_min_transfer_ms=3"),
    )
    sim = Sim(m, "kvpush", Workload(requests=24, lengths=(1024, 256), concurrency=4))
    reqs = sim.run()
    assert len(reqs) == 24 and all(r.done >= 0 for r in reqs)
    steps = sim.counters["layerwise_steps"]
    assert 0 < steps < 12  # the first 1k step, on the initial estimate, is layer-wise
    # Whole pushes measured the link at least as fast as every chunk together did (as fast
    # once the whole pushes' layer groups, cut by layers, make most of the estimate).
    sched = sim.senders[0].sched
    [link] = sched.links()
    assert sched.whole_bandwidth(link) >= sched.bandwidth(link) * (1 - 1e-9)
