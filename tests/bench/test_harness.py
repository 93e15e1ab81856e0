"""Harness pieces without engines: resume plan, prompts, the closed loop, reports, CLI,
and the sitecustomize that neutralises NIXL's progress-thread spin in vLLM's engines."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import types

import pytest

from kvpush_prod.bench import report
from kvpush_prod.bench.cli import build_parser
from kvpush_prod.bench.cli import main as bench_main
from kvpush_prod.bench.runner import (
    BenchSettings,
    ResultStore,
    Workload,
    cell_key,
    estimate_wall_s,
    plan,
    prompts_for,
    raw_values,
    run_open_loop,
    run_requests,
)
from kvpush_prod.bench.sides import (
    SIDES,
    SPINFIX_DIR,
    SideSettings,
    parse_cores,
    rebind_threads,
)
from kvpush_prod.bench.stats import Sample


def _settings(tmp_path, sides, **kw):
    return BenchSettings(
        out=tmp_path,
        sides=sides,
        workload=Workload(**kw),
        side=SideSettings(workdir=tmp_path / "work"),
    )


def test_plan_skips_cells_already_in_results_json_unless_forced(tmp_path):
    store = ResultStore(tmp_path / "results.json")
    store.put("kvpush", cell_key(1024, 1), {"length": 1024, "concurrency": 1})
    s = _settings(tmp_path, ["kvpush", "single"], lengths=[1024], concurrency=[1, 4])
    again = ResultStore(tmp_path / "results.json")  # reloaded from disk
    assert plan(again, s) == {
        "kvpush": [(1024, 4, 0.0)],
        "single": [(1024, 1, 0.0), (1024, 4, 0.0)],
    }
    s.force = True
    assert plan(again, s)["kvpush"] == [(1024, 1, 0.0), (1024, 4, 0.0)]
    assert estimate_wall_s(plan(again, s), s.workload) > 0


def test_open_loop_cells_are_planned_keyed_and_sized_apart_from_closed_ones(tmp_path):
    s = _settings(tmp_path, ["kvpush"], lengths=[1024], concurrency=[4], rates=[8], requests=40)
    cells = plan(ResultStore(tmp_path / "results.json"), s)["kvpush"]
    assert cells == [(1024, 4, 0.0), (1024, 0, 8.0)]
    assert [cell_key(*c) for c in cells] == ["1024x4", "1024@8rps"]
    assert s.workload.requests_in(1024, 0, 8.0) == 40  # not "two rounds of the concurrency"
    assert estimate_wall_s({"kvpush": [(1024, 0, 8.0)]}, s.workload) >= 40 / 8


async def test_open_loop_sends_on_schedule_whatever_comes_back():
    starts = []

    async def send(url, prompt, n, max_tokens):
        starts.append(asyncio.get_running_loop().time())
        await asyncio.sleep(0.5)  # slow replies must not hold the next request back
        return Sample(True, 0.001, 0.5, (0.001,), 2)

    samples, wall = await run_open_loop(send, "http://x", ["p"] * 5, 1, 50.0, 2)
    assert len(samples) == 5
    gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    assert all(0.01 <= g < 0.3 for g in gaps), gaps  # ~20 ms apart, not 500 ms
    assert wall < 2 * 0.5  # overlapped, not 5 x 0.5 s


def test_prompts_are_distinct_within_a_cell_and_identical_across_sides():
    a = prompts_for(256, 4, 8, salt=0)
    assert len(set(a)) == 8 and all(len(p.split()) == 256 for p in a)
    assert a == prompts_for(256, 4, 8, salt=0)
    assert set(a).isdisjoint(prompts_for(256, 16, 8, salt=0))


def test_workload_sends_at_least_two_rounds_of_the_concurrency():
    assert Workload(requests=8).requests_in(1024, 16) == 32


async def test_closed_loop_never_exceeds_the_concurrency():
    inflight = peak = 0

    async def send(url, prompt, n, max_tokens):
        nonlocal inflight, peak
        inflight += 1
        peak = max(peak, inflight)
        await asyncio.sleep(0.005)
        inflight -= 1
        return Sample(True, 0.001, 0.002, (0.001,), 2)

    samples, wall = await run_requests(send, "http://x", ["p"] * 20, 1, 4, 2)
    assert len(samples) == 20 and peak == 4 and wall > 0


def _cell(length, conc, ttft, tpot, transfer=None):
    return {
        "length": length,
        "concurrency": conc,
        "requests": 8,
        "ok": 8,
        "errors": 0,
        "ttft_ms": {"p50": ttft, "p90": ttft * 1.2, "p99": ttft * 1.5},
        "tpot_ms": {"p50": tpot, "p90": tpot, "p99": tpot},
        "itl_ms": {"p50": tpot, "p90": tpot, "p99": tpot},
        "throughput_tok_s": 100.0,
        "loadavg": [0.5, 0.5, 0.5],
        "transfer": transfer or {},
    }


RESULTS = {
    "meta": {
        "cpu": "Test CPU",
        "simd": "AVX2",
        "dtype": "float32",
        "workload": {"lengths": [1024], "concurrency": [1, 4], "max_tokens": 64},
    },
    "sides": {
        "vllm-pull": {
            "label": "pull",
            "spin": "neutralised",
            "spin_markers": 2,
            "idle_cpu_pct": {"prefill": 1.0, "decode": 2.0},
        }
    },
    "cells": {
        "single": {"1024x1": _cell(1024, 1, 20.0, 5.0)},
        "vllm-pull": {
            "1024x1": _cell(1024, 1, 50.0, 6.0, {"nixl_xfer_time_seconds_decode": {"p50_s": 0.003}})
        },
        "vllm-push": {"1024x1": _cell(1024, 1, 40.0, 6.0)},
        "kvpush": {"1024x1": _cell(1024, 1, 25.0, 5.5, {"kv_ready_to_d_knows_ms": {"p50": 0.4}})},
    },
}


def test_ratios_and_targets_are_computed_against_each_baseline():
    (row,) = report.ratios(RESULTS)
    assert row["ttft_p50_vs_vllm-pull"] == pytest.approx(0.5)
    assert row["ttft_p50_vs_single"] == pytest.approx(1.25)
    assert row["ttft_p50_vs_vllm-pull-shipped"] is None
    t = {x["target"]: x for x in report.targets(RESULTS)}
    assert t["TTFT p50 vs vLLM pull, 1024 tok, c=1"]["ok"] is True
    assert t["TTFT p50 vs vLLM push, 1024 tok, c=1"]["ok"] is True  # 0.625 <= 0.85
    assert t["TTFT p50 vs vLLM pull, 1024 tok, c=4"]["ok"] is None  # not measured
    assert t["KV transfer p50 (prefill done -> D knows), 1024 tok, c=1, ms"]["ok"] is True


def test_open_loop_rows_compare_tpot_at_the_same_arrival_rate_and_show_d_batches():
    def open_cell(ttft, tpot, batch):
        return {**_cell(1024, 0, ttft, tpot), "rate": 8.0, "d_tokens_per_step": batch}

    data = {**RESULTS, "cells": {k: dict(v) for k, v in RESULTS["cells"].items()}}
    data["cells"]["kvpush"]["1024@8rps"] = open_cell(30.0, 5.0, 3.0)
    data["cells"]["vllm-push"]["1024@8rps"] = open_cell(60.0, 5.5, 3.2)
    (row,) = report.open_loop(data)
    assert row["tpot_p50"] == pytest.approx(5.0 / 5.5) and row["d_batch_base"] == 3.2
    t = {x["target"]: x for x in report.targets(data)}
    assert t["TPOT p50 vs vLLM push, 1024 tok, open loop 8 req/s"]["ok"] is True
    md = report.markdown(data)
    assert "## Open loop" in md and "| 1024 | 8/s open | kvpush |" in md
    assert report._keys(data) == [(1024, 1)]  # open cells stay out of the closed tables
    assert "## Open loop" not in report.markdown(RESULTS)


def test_what_authentication_costs_is_kvpush_against_itself_without_keys():
    data = {
        **RESULTS,
        "cells": {**RESULTS["cells"], "kvpush-insecure": {"1024x1": _cell(1024, 1, 24.0, 5.0)}},
    }
    (row,) = report.auth_cost(data)
    assert row["ttft_p50"] == pytest.approx(25.0 / 24.0)
    assert "## What authentication costs" in report.markdown(data)
    assert report.auth_cost(RESULTS) == []  # no insecure side: no table
    assert "What authentication costs" not in report.markdown(RESULTS)


def test_the_sequential_flow_is_compared_with_the_concurrent_one():
    data = {
        **RESULTS,
        "cells": {**RESULTS["cells"], "kvpush-sequential": {"1024x1": _cell(1024, 1, 50.0, 5.0)}},
    }
    (row,) = report.flow_cost(data)
    assert row["ttft_p50"] == pytest.approx(50.0 / 25.0)
    assert "## Router flow: sequential / concurrent" in report.markdown(data)
    assert report.flow_cost(RESULTS) == []


def test_markdown_and_plots_come_from_results_alone(tmp_path):
    md = report.markdown(RESULTS)
    assert "Test CPU (AVX2" in md and "| 1024 | 1 | kvpush | 25.0 |" in md
    assert "neutralised (transport.progress_delay_us)" in md
    assert report.transfer_ms(RESULTS["cells"]["vllm-pull"]["1024x1"])[0] == pytest.approx(3.0)
    pytest.importorskip("matplotlib")
    paths = report.plots(RESULTS, tmp_path / "plots")
    assert paths and all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_cli_rejects_unknown_sides_and_too_small_max_num_seqs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--sides", "vllm-pul"])
    assert bench_main(["--out", str(tmp_path), "--concurrency", "64"]) == 2
    assert (
        bench_main(["--out", str(tmp_path), "--plan", "--sides", "kvpush", "--lengths", "256"]) == 0
    )
    assert "kvpush: 256x1, 256x4, 256x16" in capsys.readouterr().out


def test_every_side_states_its_spin():
    assert {s.spin for s in SIDES.values()} == {"n/a", "neutralised", "as shipped"}
    assert SIDES["vllm-pull-shipped"].kind == "vllm-pull"


def test_spinfix_sets_the_progress_thread_delay_of_nixl_agents(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("spinfix_test", SPINFIX_DIR / "sitecustomize.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.delenv("KVPUSH_BENCH_PTHR_DELAY_US", raising=False)
    spec.loader.exec_module(mod)  # without the env var it installs no hook

    made = {}

    class Config:
        pthrDelay = None

    class Bind:
        nixlAgentConfig = Config

        @staticmethod
        def nixlAgent(name, cfg):
            made["delay"] = cfg.pthrDelay
            return object()

    fake = types.ModuleType("nixl_fake._api")
    fake.nixlBind = Bind

    class nixl_agent:  # noqa: N801 - the name nixl uses
        def __init__(self, name):
            cfg = fake.nixlBind.nixlAgentConfig()
            cfg.pthrDelay = 0  # what nixl hard-codes
            self.agent = fake.nixlBind.nixlAgent(name, cfg)

    fake.nixl_agent = nixl_agent
    monkeypatch.setenv("KVPUSH_BENCH_PTHR_DELAY_US", "1234")
    mod._patch(fake)
    nixl_agent("a")
    assert made["delay"] == 1234
    assert fake.nixlBind is Bind  # restored after the constructor
    assert mod.MARKER in capsys.readouterr().err


def test_an_engine_whose_core_died_is_given_up_at_once_not_after_the_timeout(tmp_path):
    import sys
    import time

    from kvpush_prod.bench.sides import wait_started
    from kvpush_prod.lab.launch import Proc, free_port

    # vLLM's API server stays alive when its EngineCore dies; only the log says so.
    script = (
        "print('zmq.error.ZMQError: Address already in use', flush=True); "
        "import time; time.sleep(60)"
    )
    proc = Proc("prefill", [sys.executable, "-c", script], {}, tmp_path / "p.log")
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError, match="Address already in use"):
            wait_started(f"http://127.0.0.1:{free_port()}", proc, timeout=120)
    finally:
        proc.kill()
    assert time.monotonic() - t0 < 30


def _round(ttfts, tpots):
    samples = [
        Sample(True, a, a + b * 63, (b,) * 63, 64) for a, b in zip(ttfts, tpots, strict=True)
    ]
    from kvpush_prod.bench.stats import summarise

    return {
        **summarise(samples, 1.0),
        "raw": raw_values(samples),
        "length": 1024,
        "concurrency": 1,
        "rate": 0.0,
        "d_cpu_ms_per_token": sum(tpots),
    }


def test_rounds_pool_every_rounds_requests_and_keep_each_rounds_p50(tmp_path):
    store = ResultStore(tmp_path / "results.json")
    store.add_round("kvpush", "1024x1", _round([0.010, 0.012], [0.001, 0.001]))
    assert store.data["cells"]["kvpush"]["1024x1"]["rounds"] == 1
    store.add_round("kvpush", "1024x1", _round([0.030, 0.032], [0.002, 0.002]))
    store.add_round("kvpush", "1024x1", _round([0.020, 0.022], [0.003, 0.003]))
    cell = ResultStore(tmp_path / "results.json").data["cells"]["kvpush"]["1024x1"]
    assert cell["rounds"] == 3 and cell["requests"] == 6 and "raw" not in cell
    assert cell["ttft_ms"]["p50"] == pytest.approx(21.0)  # pooled: six requests
    assert cell["tpot_ms"]["p50"] == pytest.approx(2.0)
    assert cell["d_cpu_ms_per_token"] == pytest.approx(0.004)  # median of the rounds
    assert [r["ttft_p50_ms"] for r in cell["per_round"]] == pytest.approx([11.0, 31.0, 21.0])


def test_rounds_are_planned_per_round_and_resume(tmp_path):
    s = _settings(tmp_path, ["kvpush", "vllm-push"], lengths=[1024], concurrency=[1], rounds=3)
    store = ResultStore(tmp_path / "results.json")
    store.add_round("kvpush", "1024x1", _round([0.01], [0.001]))
    assert plan(store, s, 0) == {"vllm-push": [(1024, 1, 0.0)]}
    assert set(plan(store, s, 1)) == {"kvpush", "vllm-push"}
    assert set(plan(store, s)) == {"kvpush", "vllm-push"}  # neither has all three rounds
    one = _settings(tmp_path, ["kvpush"], lengths=[1024], concurrency=[1])
    assert estimate_wall_s(plan(store, s), s.workload) == pytest.approx(
        3 * estimate_wall_s(plan(store, s), one.workload)
    )


def test_round_by_round_ratios_pair_round_i_of_each_side(tmp_path):
    store = ResultStore(tmp_path / "results.json")
    for ours, base in ((0.010, 0.020), (0.015, 0.010)):
        store.add_round("kvpush", "1024x1", _round([ours], [0.001]))
        store.add_round("vllm-push", "1024x1", _round([base], [0.001]))
    data = store.data
    assert report.round_ratios(data, "1024x1", "ttft") == pytest.approx([0.5, 1.5])
    assert report.round_ratios(data, "1024x1", "tpot") == pytest.approx([1.0, 1.0])
    md = report.markdown(data)
    assert "## Round by round" in md and "| 1024x1 | 2 | 0.50x 1.50x | 1.00x 1.00x |" in md
    assert "## Round by round" not in report.markdown(RESULTS)


def test_cli_rejects_zero_rounds(tmp_path, capsys):
    assert bench_main(["--out", str(tmp_path), "--rounds", "0"]) == 2
    assert "--rounds 0" in capsys.readouterr().err


def test_parse_cores_reads_vllms_binding_syntax():
    assert parse_cores("1") == {1}
    assert parse_cores("0,2-4") == {0, 2, 3, 4}


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to move a thread")
def test_threads_outside_the_engines_cores_are_bound_back():
    cores = sorted(os.sched_getaffinity(0))
    ready, done = threading.Event(), threading.Event()
    seen: dict[str, set[int]] = {}

    def worker():
        os.sched_setaffinity(0, {cores[-1]})  # as vLLM's NIXL connector does to its thread
        ready.set()
        done.wait(5)
        seen["after"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    mine = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {cores[0], cores[-1]})
        t.start()
        ready.wait(5)
        assert rebind_threads(os.getpid(), {cores[0], cores[-1]}) == 0  # all inside
        assert rebind_threads(os.getpid(), {cores[0]}) >= 2  # this thread and the worker
        done.set()
        t.join(5)
        assert seen["after"] == {cores[0]}
    finally:
        done.set()
        os.sched_setaffinity(0, mine)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to place processes")
def test_a_side_binds_its_workers_to_the_engines_cores_and_frontends_to_theirs(tmp_path):
    import subprocess
    import sys

    import psutil

    from kvpush_prod.bench.sides import RunningSide

    cores = sorted(os.sched_getaffinity(0))
    named = (
        "import ctypes, sys, time; ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0);"
        " print('up', flush=True); time.sleep(60)"
    )
    children = [
        subprocess.Popen([sys.executable, "-c", named, n], stdout=subprocess.PIPE)
        for n in ("VLLM::Worker", "VLLM::EngineC")
    ]
    try:
        for c in children:
            c.stdout.readline()

        class Tree:
            def tree(self):
                return [psutil.Process(c.pid) for c in children]

        side = RunningSide(
            SIDES["kvpush"],
            SideSettings(workdir=tmp_path, frontend_cores={"prefill": str(cores[-1])}),
        )
        side.procs["prefill"] = Tree()
        side.binding["prefill"] = str(cores[0])
        assert side.rebind_workers() == {"prefill": 1}  # the worker's one thread
        assert os.sched_getaffinity(children[0].pid) == {cores[0]}
        assert os.sched_getaffinity(children[1].pid) == {cores[-1]}
        assert side.rebind_workers() == {"prefill": 0}  # already in place
    finally:
        for c in children:
            c.kill()
            c.wait()


def test_each_engine_keeps_its_frontends_on_its_own_core_unless_told_otherwise(tmp_path):
    from kvpush_prod.bench.sides import FRONTENDS

    a = build_parser().parse_args([])
    assert a.frontends == "own" and FRONTENDS["own"] == {
        "prefill": "0",
        "decode": "1",
        "single": "0",
    }
    assert FRONTENDS["os"] == {}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--frontends", "anywhere"])


def test_a_round_from_before_rounds_is_merged_by_its_percentiles(tmp_path):
    store = ResultStore(tmp_path / "results.json")
    old = _round([0.010], [0.001])
    old.pop("raw")  # a results.json written before rounds kept no requests
    store.put("kvpush", "1024x1", old)
    store.add_round("kvpush", "1024x1", _round([0.030], [0.003]))
    cell = store.data["cells"]["kvpush"]["1024x1"]
    assert cell["rounds"] == 2 and cell["ttft_ms"]["p50"] == pytest.approx(20.0)
