"""``kvpush demo``: a prefill engine, a decode engine and the router on the tiny model over
NIXL loopback, a handful of requests, then per-request TTFT, bytes pushed and a verdict.
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kvpush_prod.lab.client import completion_body, metric_sum, request, scrape
from kvpush_prod.lab.cluster import Cluster, ClusterSpec
from kvpush_prod.lab.tinymodel import prompt_of_length

LENGTHS = [256, 1024, 1900, 512, 1024, 128, 1500, 1024]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


async def _run(cluster: Cluster, lengths: list[int], max_tokens: int) -> int:
    rows = []
    async with httpx.AsyncClient() as client:
        # Warm-up: first requests pay for NIXL wire-up and compilation caches.
        for url in (cluster.urls["router"], cluster.urls["reference"]):
            await request(client, url, completion_body(prompt_of_length(64, seed=999), 4, True))
        for i, n in enumerate(lengths, 1):
            prompt = prompt_of_length(n, seed=i)
            single = await request(
                client,
                cluster.urls["reference"],
                completion_body(prompt_of_length(n, seed=1000 + i), max_tokens, True),
            )
            expect = await request(
                client, cluster.urls["reference"], completion_body(prompt, max_tokens, False)
            )
            before = metric_sum(scrape(cluster.urls["decode"]), "kvpush_transfer_bytes_total")
            got = await request(
                client, cluster.urls["router"], completion_body(prompt, max_tokens, True)
            )
            after = metric_sum(scrape(cluster.urls["decode"]), "kvpush_transfer_bytes_total")
            ok = got.ok and got.text == expect.text
            rows.append((i, n, got.ttft, single.ttft, after - before, ok, got.error))
            print(
                f"  [{i}/{len(lengths)}] {n:5d} tokens  P/D TTFT {1000 * (got.ttft or 0):7.1f} ms"
                f"  single {1000 * (single.ttft or 0):7.1f} ms  pushed {int(after - before):>9,d} B"
                f"  {'same tokens as single engine' if ok else 'MISMATCH ' + got.error[:80]}",
                flush=True,
            )
    held = cluster.wait_idle(30)
    pd = [r[2] for r in rows if r[2] is not None]
    singles = [r[3] for r in rows if r[3] is not None]
    correct = sum(1 for r in rows if r[5])
    pushed = sum(r[4] for r in rows)
    p50, s50 = statistics.median(pd), statistics.median(singles)
    print(f"\nCPU: {_cpu_model()}; dtype float32; {len(rows)} requests, {max_tokens} output tokens")
    print(
        f"TTFT p50: P/D push {1000 * p50:.1f} ms, single engine {1000 * s50:.1f} ms "
        f"(ratio {p50 / s50:.2f}x)"
    )
    print(
        f"Connector blocks held after the run: prefill {held.get('prefill')}, "
        f"decode {held.get('decode')}"
    )
    good = correct == len(rows) and pushed > 0 and all(v == 0 for v in held.values())
    verdict = "PASS" if good else "FAIL"
    print(
        f"VERDICT: {verdict}: {correct}/{len(rows)} answers equal to the single engine, "
        f"{int(pushed):,d} KV bytes pushed over NIXL, TTFT p50 {1000 * p50:.1f} ms "
        f"vs {1000 * s50:.1f} ms single ({p50 / s50:.2f}x), "
        f"{'no' if all(v == 0 for v in held.values()) else 'LEAKED'} blocks held"
    )
    return 0 if good else 1


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="kvpush demo", description=__doc__)
    ap.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the model and logs go (default: a temporary folder)",
    )
    ap.add_argument("--requests", type=int, default=len(LENGTHS))
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="kvpush-demo-"))
    lengths = (LENGTHS * (args.requests // len(LENGTHS) + 1))[: args.requests]
    print(
        f"kvpush demo: starting prefill, decode and a single reference engine "
        f"(tiny Llama, float32) and the router; logs in {workdir / 'logs'}",
        flush=True,
    )
    t0 = time.monotonic()
    cluster = Cluster(ClusterSpec(workdir=workdir))
    try:
        cluster.start()
        print(
            f"engines ready in {time.monotonic() - t0:.0f} s; block size "
            f"{cluster.block_size()}; sending {len(lengths)} requests through the router",
            flush=True,
        )
        return asyncio.run(_run(cluster, lengths, args.max_tokens))
    except Exception as exc:  # noqa: BLE001 - the verdict line must always come
        print(f"VERDICT: FAIL: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
