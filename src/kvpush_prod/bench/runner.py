"""``kvpush bench``: one workload (prompt lengths x concurrency levels x N requests) against
each side in turn, on the same model, cores and machine; results kept cell by cell in a JSON
file so an interrupted or partial run resumes where it stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvpush_prod.bench.machine import machine_facts
from kvpush_prod.bench.sides import SIDES, RunningSide, Side, SideSettings
from kvpush_prod.bench.stats import Sample, histogram_delta, summarise, summary_ms
from kvpush_prod.bench.traces import read_events, transfer_times

RESULTS = "results.json"


@dataclass
class Workload:
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 1900])
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    requests: int = 32  # per cell
    max_tokens: int = 64
    warmup: int = 3  # requests per prompt length before measuring (handshakes, caches)
    # Open loop: requests per second, sent on a fixed schedule whatever the replies (the
    # same arrival times for every side), so D decodes at the same offered load.
    rates: list[float] = field(default_factory=list)
    # Each side started this many times, sides interleaved (A B, then B A, ...): one start's
    # OS placement of the unpinned frontends moves a 2-core box's TPOT by up to ~30%, so a
    # cell's numbers pool every round's requests (see ``merge_rounds``).
    rounds: int = 1

    def cells(self) -> list[Cell]:
        closed = [(n, c, 0.0) for n in self.lengths for c in self.concurrency]
        return closed + [(n, 0, float(r)) for n in self.lengths for r in self.rates]

    def requests_in(self, length: int, concurrency: int, rate: float = 0.0) -> int:
        if rate:
            return self.requests
        # At least two rounds of the concurrency, so the level is really reached.
        return max(self.requests, 2 * concurrency)


Cell = tuple[int, int, float]  # prompt length, concurrency (closed loop), rate/s (open loop)


def cell_key(length: int, concurrency: int, rate: float = 0.0) -> str:
    return f"{length}@{rate:g}rps" if rate else f"{length}x{concurrency}"


# ---------------------------------------------------------------------------------- store
class ResultStore:
    """``results.json``: machine facts, settings, and cells[side][LxC]; saved after each cell.

    With several rounds, rounds[side][LxC] keeps each round's cell and cells[side][LxC] is
    their merge."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {"meta": {}, "sides": {}, "cells": {}}
        if path.is_file():
            self.data = json.loads(path.read_text())
            for key in ("meta", "sides", "cells"):
                self.data.setdefault(key, {})

    def rounds_of(self, side: str, key: str) -> list[dict[str, Any]]:
        """Every round's cell so far (a single-round file: its one cell)."""
        rounds = self.data.get("rounds", {}).get(side, {}).get(key)
        if rounds is not None:
            return list(rounds)
        cell = self.data["cells"].get(side, {}).get(key)
        return [cell] if cell is not None else []

    def put(self, side: str, key: str, cell: dict[str, Any]) -> None:
        self.data["cells"].setdefault(side, {})[key] = cell
        self.save()

    def add_round(self, side: str, key: str, cell: dict[str, Any]) -> None:
        rounds = [*self.rounds_of(side, key), cell]
        self.data.setdefault("rounds", {}).setdefault(side, {})[key] = rounds
        self.put(side, key, merge_rounds(rounds))

    def forget(self, side: str) -> None:
        """Drop ``side``'s cells (a forced rerun starts its rounds afresh)."""
        self.data["cells"].pop(side, None)
        self.data.get("rounds", {}).pop(side, None)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, sort_keys=True))
        tmp.replace(self.path)


RAW = ("ttft", "tpot", "e2e")  # per-request values (s) a cell keeps so rounds can be pooled


def raw_values(samples: list[Sample]) -> dict[str, list[float]]:
    good = [x for x in samples if x.ok and x.ttft is not None]
    return {
        "ttft": [round(x.ttft, 6) for x in good if x.ttft is not None],
        "tpot": [round(t, 6) for x in good if (t := x.tpot) is not None],
        "e2e": [round(x.latency, 6) for x in good],
    }


def _median(values: list[float]) -> float | None:
    import statistics

    return statistics.median(values) if values else None


def _median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        q: _median([x[q] for x in summaries if x.get(q) is not None])
        for q in ("p50", "p90", "p99", "mean")
    }


def merge_rounds(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """One cell from several rounds of it: TTFT, TPOT and e2e percentiles over every round's
    requests pooled (the median of the rounds' percentiles where a round kept no requests:
    a file from before rounds); ITL percentiles, throughput, D's CPU and batch the median of
    the rounds; request and error counts summed; the transfer section and the load the last
    round's. Each round's p50s stay in ``per_round``."""
    if len(rounds) == 1:
        return {**rounds[0], "rounds": 1}
    out = dict(rounds[-1])
    for name in RAW:
        if all("raw" in r for r in rounds):
            out[f"{name}_ms"] = summary_ms([v for r in rounds for v in r["raw"][name]])
        else:
            out[f"{name}_ms"] = _median_summary([r.get(f"{name}_ms") or {} for r in rounds])
    out.pop("raw", None)
    for name in (
        "throughput_tok_s",
        "throughput_req_s",
        "wall_s",
        "d_cpu_ms_per_token",
        "d_tokens_per_step",
    ):
        vals = [r[name] for r in rounds if r.get(name) is not None]
        out[name] = _median(vals)
    out["itl_ms"] = _median_summary([r.get("itl_ms") or {} for r in rounds])
    for name in ("requests", "ok", "errors"):
        out[name] = sum(int(r.get(name) or 0) for r in rounds)
    out["first_error"] = next((r["first_error"] for r in rounds if r.get("first_error")), "")
    out["rounds"] = len(rounds)
    out["per_round"] = [
        {
            "ttft_p50_ms": (r.get("ttft_ms") or {}).get("p50"),
            "tpot_p50_ms": (r.get("tpot_ms") or {}).get("p50"),
        }
        for r in rounds
    ]
    return out


# ---------------------------------------------------------------------------------- client
RequestFn = Callable[[str, str, int, int], Awaitable[Sample]]


def _vllm_request_fn(session: Any, pbar: Any) -> RequestFn:
    """vLLM's own benchmark client (``vllm bench serve``'s request function)."""
    from vllm.benchmarks.lib.endpoint_request_func import (
        RequestFuncInput,
        async_request_openai_completions,
    )

    async def send(url: str, prompt: str, prompt_len: int, max_tokens: int) -> Sample:
        inp = RequestFuncInput(
            prompt=prompt,
            api_url=url + "/v1/completions",
            prompt_len=prompt_len,
            output_len=max_tokens,
            model="tiny",
            ignore_eos=True,
            extra_body={"temperature": 0.0},
        )
        out = await async_request_openai_completions(inp, session, pbar)
        ntok = out.output_tokens or (len(out.itl) + 1 if out.success else 0)
        return Sample(
            out.success,
            out.ttft if out.success else None,
            out.latency,
            tuple(out.itl),
            ntok,
            out.error[-300:],
        )

    return send


def _own_request_fn(client: Any, pbar: Any) -> RequestFn:
    """kvpush_prod.lab.client: the same definitions, used where vLLM's client cannot load."""
    from kvpush_prod.lab.client import completion_body, request

    async def send(url: str, prompt: str, prompt_len: int, max_tokens: int) -> Sample:
        r = await request(
            client, url, completion_body(prompt, max_tokens, True, ignore_eos=True), timeout=3600
        )
        if pbar is not None:
            pbar.update(1)
        ntok = len(r.itl) + 1 if r.ttft is not None else 0
        return Sample(r.ok, r.ttft, r.latency, tuple(r.itl), ntok, r.error)

    return send


async def run_requests(
    send: RequestFn,
    url: str,
    prompts: list[str],
    prompt_len: int,
    concurrency: int,
    max_tokens: int,
) -> tuple[list[Sample], float]:
    """Closed loop: at most ``concurrency`` requests in flight; returns samples and wall time."""
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt: str) -> Sample:
        async with sem:
            return await send(url, prompt, prompt_len, max_tokens)

    t0 = time.perf_counter()
    samples = await asyncio.gather(*(one(p) for p in prompts))
    return list(samples), time.perf_counter() - t0


async def run_open_loop(
    send: RequestFn,
    url: str,
    prompts: list[str],
    prompt_len: int,
    rate: float,
    max_tokens: int,
) -> tuple[list[Sample], float]:
    """Open loop: request ``i`` leaves at ``i / rate`` s whatever came back (fixed schedule,
    the same for every side); returns samples and wall time."""
    t0 = time.perf_counter()

    async def one(i: int, prompt: str) -> Sample:
        await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
        return await send(url, prompt, prompt_len, max_tokens)

    samples = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return list(samples), time.perf_counter() - t0


def prompts_for(length: int, concurrency: int, n: int, salt: int) -> list[str]:
    """Distinct random prompts of exactly ``length`` tokens, the same for every side.

    Random words, not ``tinymodel.prompt_of_length``: its prompts for different seeds are
    shifts of one cycle and the prompt of a length is a prefix of the longer one's, so cells
    would hit each other's prefix cache.
    """
    import random

    from kvpush_prod.lab.tinymodel import _special_tokens

    first = len(_special_tokens())
    span = 1024 - first
    out = []
    for i in range(n):
        rng = random.Random(f"kvpush-bench/{salt}/{length}/{concurrency}/{i}")
        out.append(" ".join(f"w{first + rng.randrange(span)}" for _ in range(length)))
    return out


# ---------------------------------------------------------------------------------- per cell
def _scrape_all(running: RunningSide) -> dict[str, Any]:
    from kvpush_prod.lab.client import scrape

    out = {}
    for name in running.engines():
        try:
            out[name] = scrape(running.engine_urls[name])
        except Exception:  # noqa: BLE001 - a metrics hiccup must not lose the cell
            out[name] = {}
    return out


def _sum(samples: dict[Any, float], name: str, **labels: str) -> float:
    from kvpush_prod.lab.client import metric_sum

    return metric_sum(samples, name, **labels)


def d_tokens_per_step(before: dict[str, Any], after: dict[str, Any], engine: str) -> float | None:
    """Mean tokens per engine step of ``engine`` between two scrapes (None if unknown)."""
    for name in ("vllm:iteration_tokens_total", "vllm:iteration_tokens"):
        h = histogram_delta(before.get(engine, {}), after.get(engine, {}), name)
        if h:
            return round(float(h["mean_s"]), 2)
    return None


def transfer_section(
    running: RunningSide, before: dict[str, Any], after: dict[str, Any], since: float, until: float
) -> dict[str, Any]:
    """How long KV transfers took in this cell, from the best source each side offers."""
    out: dict[str, Any] = {}
    if not running.side.disaggregated:
        return out
    d0, d1 = before.get("decode", {}), after.get("decode", {})
    src = "vllm:prompt_tokens_by_source_total"
    out["decode_prompt_tokens_external"] = _sum(d1, src, source="external_kv_transfer") - _sum(
        d0, src, source="external_kv_transfer"
    )
    out["decode_prompt_tokens_local"] = _sum(d1, src, source="local_compute") - _sum(
        d0, src, source="local_compute"
    )
    if running.side.kind == "kvpush":
        times = transfer_times(read_events(running.trace_dir), since, until)
        for phase in (
            "kv_ready_to_d_knows",
            "ready_to_post",
            "post_to_done",
            "done_to_report",
            "register_lead",
        ):
            vals = [row[phase] for row in times.values() if phase in row]
            if vals:
                out[phase + "_ms"] = summary_ms(vals)
        out["source"] = "kvpush trace: P blocks_ready -> D report (both wall clocks, one box)"
        for eng in ("prefill", "decode"):
            h = histogram_delta(before.get(eng, {}), after.get(eng, {}), "kvpush_transfer_seconds")
            if h:
                out[f"kvpush_transfer_seconds_{eng}"] = h
        # What each post handed NIXL and what building it cost (P's engine-side work).
        for metric in ("kvpush_post_descriptors", "kvpush_post_build_seconds"):
            h = histogram_delta(before.get("prefill", {}), after.get("prefill", {}), metric)
            if h:
                out[metric] = h
    else:
        # vLLM: the NIXL transfer (post -> completion) as its connector measures it; on D for
        # pull (READs), on P for push (WRITEs). No hook gives "prefill done -> D knows".
        for eng in ("prefill", "decode"):
            for metric in (
                "vllm:nixl_xfer_time_seconds",
                "vllm:nixl_post_time_seconds",
                "vllm:nixl_num_descriptors",
            ):
                h = histogram_delta(before.get(eng, {}), after.get(eng, {}), metric)
                if h:
                    out[f"{metric.split(':')[1]}_{eng}"] = h
        out["source"] = "vLLM /metrics vllm:nixl_xfer_time_seconds (NIXL post -> done only)"
    return out


# ---------------------------------------------------------------------------------- driver
@dataclass
class BenchSettings:
    out: Path
    sides: list[str]
    workload: Workload
    side: SideSettings
    force: bool = False
    client: str = "vllm"  # vllm | own
    progress: bool = True
    command: str = ""


def plan(
    store: ResultStore, s: BenchSettings, round_no: int | None = None
) -> dict[str, list[Cell]]:
    """The cells still to run, per side (all of them with ``force``): with ``round_no``,
    those with fewer than ``round_no + 1`` rounds; without, those missing any round."""
    want = s.workload.rounds if round_no is None else round_no + 1
    todo: dict[str, list[Cell]] = {}
    for name in s.sides:
        cells = [
            c
            for c in s.workload.cells()
            if s.force or len(store.rounds_of(name, cell_key(*c))) < want
        ]
        if cells:
            todo[name] = cells
    return todo


def estimate_wall_s(
    todo: dict[str, list[Cell]],
    w: Workload,
    start_s: float = 90.0,
    per_token_s: float = 0.00012,
    per_output_token_s: float = 0.012,
) -> float:
    """A rough wall-time estimate for the plan (AVX2 box figures; a guide, not a promise)."""
    total = 0.0
    for _side, cells in todo.items():
        # Every round starts the side again (cells already in some rounds count fully).
        side = start_s + len(w.lengths) * w.warmup * 1.0
        for length, conc, rate in cells:
            n = w.requests_in(length, conc, rate)
            per_req = length * per_token_s + w.max_tokens * per_output_token_s
            side += n / rate + per_req if rate else n * per_req / max(1.0, conc**0.5)
        total += side * w.rounds
    return total


def run(s: BenchSettings) -> ResultStore:
    """Run every planned cell; results are saved as they come."""
    from kvpush_prod.lab.serve import patch_vllm_version

    patch_vllm_version()
    store = ResultStore(s.out / RESULTS)
    meta = _record_meta(store, s)
    if s.force:
        for name in s.sides:
            store.forget(name)
        s.force = False
    store.save()
    rounds = s.workload.rounds
    left = plan(store, s)
    total = sum(
        s.workload.requests_in(*c)
        for r in range(rounds)
        for cells in plan(store, s, r).values()
        for c in cells
    )
    print(
        f"kvpush bench: {meta['cpu']} ({meta['simd']}, {meta['cores']} cores), dtype float32;"
        f" {sum(len(c) for c in left.values())} cells on {len(left)} sides"
        + (f" x {rounds} rounds (sides interleaved)" if rounds > 1 else "")
        + f", {total} requests; about {estimate_wall_s(left, s.workload) / 60:.0f} min",
        flush=True,
    )
    if not total:
        return store
    pbar = None
    if s.progress:
        from tqdm import tqdm

        pbar = tqdm(total=total, unit="req", dynamic_ncols=True)
    try:
        for r in range(rounds):
            # Alternate the order so a drifting box (heat, other load) favours no side.
            order = s.sides if r % 2 == 0 else list(reversed(s.sides))
            for name in order:
                cells = plan(store, s, r).get(name)
                if cells:
                    if pbar is not None and rounds > 1:
                        pbar.set_description(f"round {r + 1}/{rounds}")
                    _run_side(store, s, SIDES[name], cells, pbar)
    finally:
        if pbar is not None:
            pbar.close()
    return store


def _record_meta(store: ResultStore, s: BenchSettings) -> dict[str, Any]:
    """The machine and the settings of this run, kept in ``store`` (not saved yet)."""
    meta = machine_facts()
    # Every invocation that added cells to this results file, in order (resumed runs).
    meta["commands"] = [*store.data.get("meta", {}).get("commands", []), s.command]
    meta.update(
        {
            "workload": asdict(s.workload),
            "max_num_seqs": s.side.max_num_seqs,
            "pthr_delay_us_vllm": s.side.pthr_delay_us,
            "kvpush_extra": s.side.kvpush_extra,
            "command": s.command,
            "client": s.client,
            "binding": {"prefill": "0", "decode": "1", "single": s.side.single_cores},
            "frontend_cores": s.side.frontend_cores,
        }
    )
    store.data["meta"] = meta
    return meta


def _run_side(
    store: ResultStore, s: BenchSettings, side: Side, cells: list[Cell], pbar: Any
) -> None:
    if pbar is not None:
        pbar.set_description(f"{side.name}: starting")
    t0 = time.monotonic()
    running = RunningSide(side, s.side)
    try:
        try:
            running.start()
        except Exception as first:  # noqa: BLE001 - e.g. a port taken meanwhile: once more
            print(
                f"\n{side.name}: start failed ({str(first).splitlines()[0][:200]}); retrying",
                flush=True,
            )
            running = RunningSide(side, s.side)
            running.start()
    except Exception as exc:  # noqa: BLE001 - record and go on with the other sides
        store.data["sides"][side.name] = {
            "label": side.label,
            "spin": side.spin,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
        }
        store.save()
        print(f"\n{side.name}: failed to start: {exc}", flush=True)
        if pbar is not None:
            pbar.update(sum(s.workload.requests_in(*c) for c in cells))
        return
    try:
        started_s = time.monotonic() - t0
        asyncio.run(_run_cells(store, s, running, cells, pbar, started_s))
    finally:
        running.stop()


async def _run_cells(
    store: ResultStore,
    s: BenchSettings,
    running: RunningSide,
    cells: list[Cell],
    pbar: Any,
    started_s: float,
) -> None:
    side = running.side
    import aiohttp

    limit = max(max(c for _, c, _r in cells), 64) + 4
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(
        trust_env=False, timeout=timeout, connector=aiohttp.TCPConnector(limit=limit)
    ) as session:
        import httpx

        async with httpx.AsyncClient(trust_env=False) as hclient:

            def request_fn(bar: Any) -> Any:
                return (
                    _vllm_request_fn(session, bar)
                    if s.client == "vllm"
                    else _own_request_fn(hclient, bar)
                )

            if pbar is not None:
                pbar.set_description(f"{side.name}: warm-up")
            warm_errors = await _warm_up(request_fn(None), running, cells, s.workload.warmup)
            info = _side_info(running, started_s, warm_errors)
            if s.side.fragment:
                if pbar is not None:
                    pbar.set_description(f"{side.name}: fragmenting the KV cache")
                info["fragment"] = await _fragment(request_fn(None), running, s.side.fragment)
            store.data["sides"][side.name] = info
            store.save()
            send = request_fn(pbar)
            for length, conc, rate in cells:
                if pbar is not None:
                    pbar.set_description(f"{side.name} {cell_key(length, conc, rate)}")
                cell = await _run_cell(s, running, send, length, conc, rate)
                store.add_round(side.name, cell_key(length, conc, rate), cell)


async def _warm_up(send: Any, running: RunningSide, cells: list[Cell], warmup: int) -> int:
    """Warm every prompt length up; the errors it met."""
    errors = 0
    for length in sorted({n for n, _, _r in cells}):
        prompts = prompts_for(length, 0, warmup, salt=99)
        got, _ = await run_requests(send, running.entry, prompts, length, 2, 8)
        errors += sum(1 for g in got if not g.ok)
    return errors


# Prompt lengths and output lengths of the churn: mixed, so that requests end in an order
# unrelated to the one they started in and free their blocks scattered.
_CHURN = ((48, 9), (530, 2), (200, 17), (90, 5), (410, 13), (130, 1), (300, 21), (70, 3))


async def _fragment(send: Any, running: RunningSide, cycles: int) -> dict[str, Any]:
    """Churn the KV cache that receives (D's, or the single engine's): requests of mixed
    lengths, 16 at once, until about ``cycles`` times its blocks went through them; its free
    blocks are then in the scattered order those requests freed them, as after hours of
    traffic. Returns what it did."""
    engine = "decode" if running.side.disaggregated else "single"
    blocks, block_size = _pool(running.engine_urls[engine])
    tokens = cycles * blocks * block_size
    per_round = sum(n for n, _ in _CHURN)
    rounds = max(1, -(-tokens // per_round))
    jobs = [
        run_requests(send, running.entry, prompts_for(n, 0, rounds, salt=5000 + i), n, 2, out)
        for i, (n, out) in enumerate(_CHURN)
    ]
    results = await asyncio.gather(*jobs)
    errors = sum(1 for got, _ in results for g in got if not g.ok)
    return {
        "cycles": cycles,
        "pool_blocks": blocks,
        "block_size": block_size,
        "requests": rounds * len(_CHURN),
        "tokens": rounds * per_round,
        "errors": errors,
    }


def _pool(url: str) -> tuple[int, int]:
    """The KV cache of the engine at ``url``: its number of blocks and their size in tokens
    (vLLM's ``vllm:cache_config_info``)."""
    import re

    import httpx

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=10).text
    line = next((x for x in text.splitlines() if x.startswith("vllm:cache_config_info{")), "")
    blocks = re.search(r'num_gpu_blocks="(\d+)"', line)
    size = re.search(r'block_size="(\d+)"', line)
    if blocks is None or size is None:
        raise RuntimeError(
            f"{url}/metrics has no vllm:cache_config_info with num_gpu_blocks "
            "and block_size: cannot size the churn of --fragment"
        )
    return int(blocks.group(1)), int(size.group(1))


def _side_info(running: RunningSide, started_s: float, warm_errors: int) -> dict[str, Any]:
    """What the results say of a side as it runs, checked after the warm-up."""
    side = running.side
    # Threads the warm-up started (handshakes) inherit their creator's cores: check the
    # placement once more before measuring.
    late = running.rebind_workers()
    return {
        "label": side.label,
        "kind": side.kind,
        "spin": side.spin,
        "spin_markers": running.spin_markers(),
        "idle_cpu_pct": running.idle_cpu(),
        "start_s": round(started_s, 1),
        "warmup_errors": warm_errors,
        # Worker threads found outside their engine's cores and bound back, at start and
        # after the warm-up (vLLM's NIXL connectors move the forward's thread).
        "rebound_threads": {k: v + late.get(k, 0) for k, v in running.rebound.items()},
    }


async def _run_cell(
    s: BenchSettings, running: RunningSide, send: Any, length: int, conc: int, rate: float
) -> dict[str, Any]:
    """One cell of one side: its requests, then what they cost (from the engines)."""
    side, w = running.side, s.workload
    n = w.requests_in(length, conc, rate)
    # Open-loop cells get their own prompts (no prefix hits on closed-loop ones).
    prompts = (
        prompts_for(length, conc, n, salt=0)
        if not rate
        else prompts_for(length, 1000 + int(rate * 10), n, salt=0)
    )
    before = _scrape_all(running)
    cpu_engine = "decode" if side.disaggregated else "single"
    cpu_before = running.cpu_seconds(cpu_engine)
    since = time.time()
    if rate:
        samples, wall = await run_open_loop(
            send, running.entry, prompts, length, rate, w.max_tokens
        )
    else:
        samples, wall = await run_requests(send, running.entry, prompts, length, conc, w.max_tokens)
    until = time.time()
    cpu_used = running.cpu_seconds(cpu_engine) - cpu_before
    await asyncio.sleep(0.3)  # let the last reports and traces land
    after = _scrape_all(running)
    cell = summarise(samples, wall)
    cell["raw"] = raw_values(samples)
    out_tokens = sum(x.output_tokens for x in samples if x.ok)
    cell.update(
        {
            # D's (or the single engine's) CPU per output token, whole process tree: what
            # decoding costs beside the transfer.
            "d_cpu_ms_per_token": (round(1000 * cpu_used / out_tokens, 3) if out_tokens else None),
            "length": length,
            "concurrency": conc,
            "rate": rate,
            # D's mean tokens per engine step (vLLM's iteration histogram): its decode batch,
            # which a closed loop makes larger when TTFT is shorter.
            "d_tokens_per_step": d_tokens_per_step(before, after, cpu_engine),
            "loadavg": os.getloadavg(),
            "at": since,
            "transfer": transfer_section(running, before, after, since, until),
        }
    )
    return cell
