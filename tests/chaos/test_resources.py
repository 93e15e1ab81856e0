"""Resource flatness without engines: synthetic series judged at quiet windows (flat and
noisy passes, a leak fails, load that comes and goes passes), and the sampler on this test's
own process tree and a scripted /metrics."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest

from kvpush_prod.chaos.resources import (
    BOUNDS,
    MIB,
    MIN_JUDGED_S,
    SLOW_WARMUP,
    TABLE_KIND,
    VLLM_WARMUP_S,
    ResourceSampler,
    Series,
    Target,
    cluster_targets,
    flatness,
    parse_tables,
    quiet_spans,
    report_lines,
    theil_sen,
    tree_stats,
)

STEP_S = 5.0


def bursts(
    duration_s: float, busy_s: float = 40.0, idle_s: float = 20.0
) -> list[tuple[float, float]]:
    """Load as a nemesis drives it: ``busy_s`` of requests in flight, then ``idle_s`` of
    none, over and over (one load sample a second)."""
    period = busy_s + idle_s
    return [(float(t), 8.0 if t % period < busy_s else 0.0) for t in range(int(duration_s) + 1)]


def series(kind: str, duration_s: float, value: Callable[[float], float]) -> Series:
    s = Series("x", kind)
    t = 0.0
    while t <= duration_s:
        s.points.append((t, value(t)))
        t += STEP_S
    return s


def busy(load: list[tuple[float, float]], t: float) -> bool:
    return load[int(t)][1] > 0


def test_a_flat_noisy_series_passes() -> None:
    rng = random.Random(1)
    load = bursts(600)
    s = series("fds", 600, lambda t: 120 + rng.choice((-2, -1, 0, 1, 2)))
    row = flatness(s, load)
    assert row.passed, row
    assert row.method.startswith("quiet windows")


def test_a_leak_of_one_fd_a_minute_fails() -> None:
    load = bursts(600)
    row = flatness(series("fds", 600, lambda t: 120 + t // 60), load)
    assert not row.passed
    assert row.slope_per_hour == pytest.approx(60, abs=10)
    assert row.growth > BOUNDS["fds"].slack


def test_a_load_spike_that_returns_passes() -> None:
    load = bursts(600)
    # Sockets and threads climb while requests are in flight and come back after.
    row = flatness(series("sockets", 600, lambda t: 40 + (60 if busy(load, t) else 0)), load)
    assert row.passed, row
    assert row.first == row.last == 40


def test_load_that_grows_over_the_run_but_returns_at_each_quiet_window_passes() -> None:
    load = bursts(1800)
    mem = series("rss_bytes", 1800, lambda t: 900 * MIB + (t * 0.5 * MIB if busy(load, t) else 0))
    assert flatness(mem, load).passed


def test_rss_growing_with_time_fails_and_within_its_bound_passes() -> None:
    load = bursts(3600)
    leak = series("rss_bytes", 3600, lambda t: 900 * MIB + t / 3600 * 200 * MIB)
    slow = series("rss_bytes", 3600, lambda t: 900 * MIB + t / 3600 * 20 * MIB)
    assert not flatness(leak, load).passed
    assert flatness(slow, load).passed


def test_rss_growing_like_its_control_passes_and_beyond_it_fails() -> None:
    load = bursts(600)
    vllm = lambda t: 1600 * MIB + 300 * MIB * (1 - 0.995 ** (t / 5))  # noqa: E731 - saturating
    control = series("rss_bytes", 600, vllm)
    alike = series("rss_bytes", 600, lambda t: vllm(t) + 90 * MIB)
    leaking = series("rss_bytes", 600, lambda t: vllm(t) + t / 600 * 100 * MIB)
    assert not flatness(series("rss_bytes", 600, vllm), load).passed  # alone, vLLM's growth
    alike.control = leaking.control = control
    row = flatness(alike, load)
    assert row.passed, row
    assert row.control_per_hour is not None and row.control_per_hour > BOUNDS["rss_bytes"].per_hour
    assert "control" in row.method
    row = flatness(leaking, load)
    assert not row.passed and row.slope_per_hour == pytest.approx(600 * MIB, rel=0.1)


def test_a_shrinking_control_excuses_nothing() -> None:
    load = bursts(600)
    leak = series("rss_bytes", 600, lambda t: 900 * MIB + t / 600 * 100 * MIB)
    leak.control = series("rss_bytes", 600, lambda t: 900 * MIB - t * MIB)
    row = flatness(leak, load)
    assert not row.passed and row.control_per_hour == 0.0


def test_the_control_is_sampled_never_judged_and_judges_only_engines_rss() -> None:
    now = iter(range(100))
    grows = iter(range(0, 10**9, 10**8))
    pid = os.getpid()
    sampler = ResourceSampler(
        [
            Target("prefill", lambda: pid, "http://p", control="reference"),
            Target("reference", lambda: pid, None, judged=False),
        ],
        clock=lambda: float(next(now)),
        scrape=lambda url: 'kvpush_table_entries{role="producer",table="push.links"} 1.0\n',
    )
    for _ in range(3):
        sampler.sample_once()
    sampler.series["reference/main/rss_bytes"].points = [(t, float(next(grows))) for t in (0, 1, 2)]
    rows = {r.name: r for r in sampler.report([(0.0, 0.0)], warmup_s=0, settle_s=0)}
    assert not any(n.startswith("reference/") for n in rows)
    assert rows["prefill/main/rss_bytes"].control_per_hour == pytest.approx(1e8 * 3600)
    assert rows["prefill/main/fds"].control_per_hour is None
    assert rows["prefill/table/producer/push.links"].control_per_hour is None


def slow_sampler(duration_s: float, rss: Callable[[float], float]) -> ResourceSampler:
    """A sampler of a prefill engine's worker (slow warm-up) and fds, with given RSS."""
    sampler = ResourceSampler([Target("prefill", lambda: None, None, slow_warmup=SLOW_WARMUP)])
    for kind, value in (("rss_bytes", rss), ("fds", lambda t: 100.0)):
        got = series(kind, duration_s, value)
        got.name = f"prefill/VLLM::Worker/{kind}"
        sampler.series[got.name] = got
    return sampler


def test_a_prefill_workers_rss_is_reported_not_judged_before_vllms_warm_up() -> None:
    warming = lambda t: 1600 * MIB + t * MIB  # noqa: E731 - 3.5 GiB an hour
    rows = {r.name: r for r in slow_sampler(600, warming).report(bursts(600))}
    row = rows["prefill/VLLM::Worker/rss_bytes"]
    assert row.passed and row.note.startswith("not judged: vLLM's warm-up")
    assert row.slope_per_hour == pytest.approx(3600 * MIB, rel=0.01)  # still reported
    assert rows["prefill/VLLM::Worker/fds"].note == ""  # other kinds judged as ever


def test_a_series_with_a_minimum_span_is_judged_only_once_it_has_it() -> None:
    load = bursts(600)
    grows = lambda t: 100.0 + t // 20  # noqa: E731 - three fds a minute
    sampler = ResourceSampler([Target("prefill", lambda: None, None)])
    for name, duration in (("late", 200.0), ("long", 600.0)):
        got = series("fds", duration, grows)
        got.name, got.min_span_s = f"prefill/{name}/fds", MIN_JUDGED_S
        sampler.series[got.name] = got
    rows = {r.name: r for r in sampler.report(load)}
    late = rows["prefill/late/fds"]
    assert late.passed and late.note.startswith("not judged: the process started late")
    assert not rows["prefill/long/fds"].passed


def test_a_prefill_workers_rss_is_judged_after_vllms_warm_up() -> None:
    run = VLLM_WARMUP_S + MIN_JUDGED_S + 600
    load = bursts(run)
    # Fast warm-up growth, then flat: passes; a leak after the warm-up: fails.
    flat = lambda t: 1600 * MIB + min(t, VLLM_WARMUP_S) * MIB  # noqa: E731
    leak = lambda t: flat(t) + max(0.0, t - VLLM_WARMUP_S) * MIB / 10  # noqa: E731
    row = slow_sampler(run, flat).report(load)[-1]
    assert row.name.endswith("rss_bytes") and row.passed and row.note == "", row
    bad = [r for r in slow_sampler(run, leak).report(load) if not r.passed]
    assert [r.name for r in bad] == ["prefill/VLLM::Worker/rss_bytes"]


def test_a_table_with_a_capacity_may_fill_up_to_it_and_one_without_may_not() -> None:
    load = bursts(600)
    grows = lambda t: float(int(t))  # noqa: E731 - one entry a second, every transfer kept
    capped = series(TABLE_KIND, 600, grows)
    capped.capacity = 65536
    row = flatness(capped, load)
    assert row.passed and "capped" in row.note
    assert not flatness(series(TABLE_KIND, 600, grows), load).passed


def test_without_quiet_windows_every_sample_after_the_warmup_is_judged() -> None:
    always = [(0.0, 5.0)]
    row = flatness(series("threads", 600, lambda t: 30 + t // 30), always)
    assert row.method.startswith("all samples")
    assert not row.passed


def test_theil_sen_is_not_moved_by_a_few_outliers() -> None:
    points = [(float(t), 10.0) for t in range(50)]
    points[10] = (10.0, 1000.0)
    points[30] = (30.0, -500.0)
    assert theil_sen(points) == 0
    assert theil_sen([(float(t), 2.0 * t) for t in range(1000)]) == pytest.approx(2.0)


def test_quiet_spans_start_once_load_has_been_zero_for_the_settle_time() -> None:
    load = [(0.0, 3.0), (10.0, 0.0), (20.0, 1.0), (30.0, 0.0), (31.0, 2.0), (40.0, 0.0)]
    assert quiet_spans(load, 2.0) == [(12.0, 20.0), (42.0, float("inf"))]


def test_tables_are_read_from_engine_and_router_metrics() -> None:
    text = "\n".join(
        [
            "# TYPE kvpush_table_entries gauge",
            'kvpush_table_entries{engine="0",model_name="m",role="producer",table="sender.peers"} 3.0',
            'kvpush_table_entries{engine="1",model_name="m",role="producer",table="sender.peers"} 2.0',
            "# TYPE kvpush_table_capacity gauge",
            'kvpush_table_capacity{engine="0",model_name="m",role="producer",table="sender.peers"} 1024.0',
            "# TYPE kvpush_router_table_entries gauge",
            'kvpush_router_table_entries{table="legs.background"} 0.0',
            "",
        ]
    )
    assert parse_tables(text) == {
        "producer/sender.peers": (3.0, 1024.0),
        "engine1/producer/sender.peers": (2.0, None),
        "legs.background": (0.0, None),
    }


def test_the_sampler_reads_a_process_tree_and_its_tables_and_skips_what_is_down() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        now = iter(range(100))
        scraped = 'kvpush_router_table_entries{table="legs.background"} 2.0\n'
        sampler = ResourceSampler(
            [
                Target("me", os.getpid, "http://router"),
                Target("gone", lambda: None, "http://down"),
            ],
            clock=lambda: float(next(now)),
            scrape=lambda url: scraped if url == "http://router" else _raise(),
        )
        sampler.sample_once()
        sampler.sample_once()
    finally:
        child.kill()
        child.wait()
    names = set(sampler.series)
    assert {"me/main/rss_bytes", "me/main/fds", "me/main/threads", "me/main/sockets"} <= names
    assert {"me/tree/fds", "me/table/legs.background"} <= names
    assert any(
        n.startswith("me/") and "/main/" not in n and "/tree/" not in n and "table" not in n
        for n in names
    )
    assert not any(n.startswith("gone/") for n in names)
    assert sampler.series["me/table/legs.background"].points == [(0.0, 2.0), (1.0, 2.0)]
    assert sampler.series["me/main/rss_bytes"].points[0][1] > 10 * MIB
    rows = sampler.report([(0.0, 0.0)], warmup_s=0, settle_s=0)
    assert len(rows) == len(names)
    lines = report_lines(rows)
    assert lines[0].startswith("| series |") and len(lines) == len(rows) + 2


def test_a_tree_sums_its_processes() -> None:
    stats = tree_stats(os.getpid())
    procs = [k for k in stats if k != "tree"]
    assert stats["tree"]["fds"] == sum(stats[p]["fds"] for p in procs)


def test_a_clusters_targets_follow_its_processes_and_skip_the_down_ones() -> None:
    up = SimpleNamespace(pid=os.getpid(), alive=lambda: True)
    down = SimpleNamespace(pid=1, alive=lambda: False)
    cluster = SimpleNamespace(
        procs={"prefill": up, "decode": down, "router": up},
        urls={"prefill": "http://p", "decode": "http://d", "router": "http://r"},
        engine_names=["prefill", "decode"],
        prefill_names=["prefill"],
    )
    targets = {t.name: t for t in cluster_targets(cluster)}  # type: ignore[arg-type]
    assert set(targets) == {"prefill", "decode", "router"}
    assert targets["prefill"].pid() == os.getpid() and targets["decode"].pid() is None
    assert targets["router"].metrics_url == "http://r"
    assert targets["prefill"].control is None


def test_a_clusters_reference_engine_is_the_control_found_by_its_port() -> None:
    import socket

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        up = SimpleNamespace(pid=os.getpid(), alive=lambda: True)
        cluster = SimpleNamespace(
            procs={"prefill": up, "decode": up, "router": up},  # a shared reference
            urls={
                "prefill": "http://p",
                "decode": "http://d",
                "router": "http://r",
                "reference": f"http://127.0.0.1:{port}",
            },
            engine_names=["prefill", "decode"],
            prefill_names=["prefill"],
        )
        targets = {t.name: t for t in cluster_targets(cluster)}  # type: ignore[arg-type]
        assert targets["prefill"].control == "reference"
        assert targets["prefill"].slow_warmup == SLOW_WARMUP
        assert targets["decode"].control is None and targets["router"].control is None
        assert targets["decode"].slow_warmup == ()
        assert not targets["reference"].judged and targets["reference"].metrics_url is None
        assert targets["reference"].pid() == os.getpid()


def test_sampling_more_often_than_never_is_required() -> None:
    with pytest.raises(ValueError, match="every_s=0"):
        ResourceSampler([], every_s=0)


def _raise() -> str:
    raise OSError("connection refused")
