"""The simulator's tensor-parallel ranks (``ClusterModel.tp``): one rank is simulated, moving
1/tp of every block on 1/tp of the node's NIC with its own pump; the core chunks that rank's
blocks, as each rank's connector does."""

from __future__ import annotations

import math

import pytest

from kvpush_prod.sim.cli import main as sim_main
from kvpush_prod.sim.model import Sim, Workload, simulate
from kvpush_prod.sim.presets import P5EN

SMALL = P5EN.with_(decode_kv_blocks=20_000)
W = Workload(requests=4, lengths=(2048,), output_tokens=4, concurrency=2)


def test_a_rank_moves_its_part_of_every_block_on_its_part_of_the_nic():
    assert SMALL.tp == 8
    assert SMALL.rank_block_bytes * 8 == SMALL.kv_bytes_per_token * SMALL.block_tokens
    assert SMALL.rank_kv_bytes(2048) * 8 == SMALL.kv_bytes(2048)
    assert SMALL.rank_bandwidth * 8 == SMALL.nic_bandwidth
    sim = Sim(SMALL, "kvpush", W)
    sim.run()
    assert sum(link.bytes_moved for link in sim.links) == pytest.approx(4 * 2048 * 40 * 1024)


def test_the_core_chunks_a_ranks_blocks():
    # 2048 tokens = 128 blocks; a rank's block is 640 KiB (5 MiB at tp 1) in 160 regions.
    # Cut by blocks, a 4 MiB chunk holds 6 of them (one at tp 1), every region of each: 160
    # descriptors a chunk on a fresh cache. Cut by layers (the default), a chunk is a group
    # of regions over all 128 blocks: 8 regions (512 KiB each) at tp 8, one region (4 MiB)
    # at tp 1, so a transfer posts 160 descriptors in all.
    chunks, descs = {}, {}
    for cut in ("blocks", "layers"):
        for tp in (1, 8):
            m = SMALL.with_(tp=tp, overrides=(f"push.chunk_by={cut}",))
            r = simulate(m, "kvpush", W)
            assert r["ok"] == 4 and r["counters"]["transfer_done"] == 4
            chunks[cut, tp] = r["counters"]["chunks"] / 4
            descs[cut, tp] = r["counters"]["descriptors"] / 4
    assert chunks == {
        ("blocks", 1): 128,
        ("blocks", 8): math.ceil(128 / 6),
        ("layers", 1): 160,
        ("layers", 8): 160 / 8,
    }
    assert descs == {
        ("blocks", 1): 128 * 160,
        ("blocks", 8): math.ceil(128 / 6) * 160,
        ("layers", 1): 160,
        ("layers", 8): 160,
    }


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_vllms_transfers_take_as_long_per_rank_as_whole(mode):
    # vLLM's connectors work per rank too: 1/tp of the bytes on 1/tp of the NIC, and each
    # rank posts the same descriptors (one per region per run), in parallel.
    one, eight = (
        [round(q.ttft, 9) for q in Sim(SMALL.with_(tp=tp), mode, W).run()] for tp in (1, 8)
    )
    assert one == eight


def test_cli_takes_tp_and_refuses_a_bad_one(capsys):
    args = ["--requests", "2", "--concurrency", "1", "--lengths", "1024", "--output-tokens", "2"]
    assert sim_main([*args, "--modes", "kvpush", "--tp", "4"]) == 0
    assert "TP 4: each rank moves 1280 KiB per block" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="tp 0: give --tp N"):
        sim_main(["--tp", "0"])


def test_tp_alike_ranks_on_a_shared_nic_finish_as_one_rank_on_its_share():
    # Why one rank may stand for all: the node's NIC shares its bandwidth equally among the
    # flows in flight, so tp ranks posting the same flows at the same times finish each one
    # when a single rank's flows would on 1/tp of the bandwidth.
    from kvpush_prod.sim.events import Link, Loop

    flows = [(0.0, 300.0), (0.5, 100.0), (1.0, 50.0), (4.0, 200.0)]  # (start s, bytes)

    def ends(copies: int, bandwidth: float) -> list[float]:
        loop, out = Loop(), {}
        link = Link(loop, bandwidth=bandwidth, latency=0.25)
        for i, (at, nbytes) in enumerate(flows):
            for c in range(copies):
                loop.at(
                    at,
                    lambda i=i, c=c, n=nbytes: link.send(
                        n, lambda: out.setdefault((i, c), loop.now)
                    ),
                )
        loop.run()
        return [max(out[i, c] for c in range(copies)) for i in range(len(flows))]

    assert ends(8, 800.0) == pytest.approx(ends(1, 100.0))
