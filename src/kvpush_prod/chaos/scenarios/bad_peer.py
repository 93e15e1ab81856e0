"""One link whose WRITEs always fail: P's circuit breaker to that D opens, transfers go
straight to pull; once the fault is cleared and the cooldown has passed, a half-open probe
push succeeds, the breaker closes and pushes resume.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from kvpush_prod.chaos.harness import (
    Context,
    Needs,
    Options,
    check_all_answered,
    fault_switch,
    main,
)
from kvpush_prod.chaos.observe import BREAKER_STATE, BREAKER_TRIPS, TRANSFERS

NAME = "bad_peer"
DESCRIPTION = (
    "every WRITE to D fails (switchable): the breaker opens, transfers pull; after "
    "the fault clears and the cooldown passes, the breaker closes and pushes resume"
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--heal-timeout",
        type=float,
        default=240.0,
        help="how long the breaker may take to close once the fault is gone "
        "(its cooldown doubles on every failed probe)",
    )


def needs(opts: Options) -> Needs:
    return Needs(
        policy=opts.policy or "recompute",
        decode_blocks=opts.decode_blocks,
        prefill_faults=(
            ("complete_fail_rate", 1.0),
            ("active_file", "{workdir}"),
            ("seed", opts.seed),
        ),
    )


def _producer(ctx: Context, outcome: str) -> float:
    return ctx.observer.increase("prefill", TRANSFERS, role="producer", outcome=outcome)


async def run(ctx: Context) -> None:
    exported = await _bad_link(ctx)
    await _healing(ctx, exported)
    await _healed(ctx)
    check_all_answered(
        ctx,
        [r for g in ctx.generators for r in g.records],
        "pull and recompute absorb the bad link",
    )


async def _bad_link(ctx: Context) -> bool:
    """Every WRITE from P fails: the breaker opens and transfers fall back to pull. True when
    P exports the breaker's state."""
    obs = ctx.observer
    switch = fault_switch(ctx.cluster.spec.workdir)
    n_bad = max(8, (2 * ctx.opts.requests) // 5)
    switch.touch()
    ctx.event("fault switch on: every WRITE from P fails", file=str(switch))
    try:
        gen = ctx.load(n_bad, phase="bad")
        await gen.run()
    finally:
        switch.unlink(missing_ok=True)
    await obs.poll()
    trips = obs.increase("prefill", BREAKER_TRIPS)
    peak = obs.peaks["prefill"].get(BREAKER_STATE)
    pulls = _producer(ctx, "pull_fallback")
    pushed_bad = _producer(ctx, "pushed") + _producer(ctx, "retried")
    ctx.event(
        "fault switch off",
        breaker_trips=trips,
        breaker_state_peak=peak,
        pull_fallbacks=pulls,
        pushed=pushed_bad,
    )
    exported = obs.exported("prefill", BREAKER_STATE)
    ctx.report.check(
        "P exports kvpush_breaker_state",
        exported,
        "" if exported else "the series is missing from P's /metrics",
    )
    ctx.report.check(
        "the breaker opened while every WRITE failed",
        (peak or 0) >= 2 or trips > 0,
        ""
        if (peak or 0) >= 2 or trips > 0
        else f"kvpush_breaker_state peak {peak}, kvpush_breaker_trips_total +{trips:g}",
    )
    ctx.report.check(
        "transfers fell back to pull while the link was bad",
        pulls > 0,
        "" if pulls else "kvpush_transfers_total{role=producer,outcome=pull_fallback} did not grow",
    )
    ctx.report.check(
        "no push completed while every WRITE failed",
        pushed_bad == 0,
        f"{pushed_bad:g} pushes completed with the fault on" if pushed_bad else "",
    )
    return exported


async def _healing(ctx: Context, exported: bool) -> None:
    """Light traffic (the half-open probe needs a transfer) until the breaker is closed and
    a push has succeeded."""
    obs = ctx.observer
    heal_timeout = float(ctx.opts.extra.get("heal_timeout", 240.0))
    pushed0 = _producer(ctx, "pushed")
    heal = ctx.load(10_000, concurrency=2, phase="healing")
    task = asyncio.create_task(heal.run())
    t0 = time.monotonic()
    closed_after: float | None = None
    state: float | None = None
    try:
        while time.monotonic() - t0 < heal_timeout:
            await asyncio.sleep(1.0)
            state = await obs.breaker_state()
            await obs.poll()
            if (state == 0 or not exported) and _producer(ctx, "pushed") > pushed0:
                closed_after = time.monotonic() - t0
                break
    finally:
        heal.stop()
        await task
    ctx.event(
        "breaker closed and pushes resumed"
        if closed_after is not None
        else "breaker did NOT close / pushes did not resume",
        seconds=None if closed_after is None else round(closed_after, 1),
        breaker_state=state,
    )
    ctx.report.check(
        "the breaker closed and pushes resumed after the fault cleared",
        closed_after is not None,
        ""
        if closed_after is not None
        else f"within {heal_timeout:.0f} s: breaker state {state}, pushes "
        f"+{_producer(ctx, 'pushed') - pushed0:g}",
    )


async def _healed(ctx: Context) -> None:
    """Healed: the rest of the load is pushed again."""
    obs, n = ctx.observer, ctx.opts.requests
    sent = sum(len(g.records) for g in ctx.generators)
    pushed1 = _producer(ctx, "pushed")
    pulls1 = _producer(ctx, "pull_fallback")
    trips1 = obs.increase("prefill", BREAKER_TRIPS)
    healed = ctx.load(max(8, n - sent), phase="healed")
    await healed.run()
    await obs.poll()
    pushed = _producer(ctx, "pushed") - pushed1
    pulled = _producer(ctx, "pull_fallback") - pulls1
    ctx.event(
        "healed phase",
        pushed=pushed,
        pull_fallbacks=pulled,
        new_trips=obs.increase("prefill", BREAKER_TRIPS) - trips1,
    )
    ctx.report.check(
        "pushes resumed: the healed phase was pushed, not pulled",
        pushed > 0 and pulled == 0,
        "" if pushed > 0 and pulled == 0 else f"healed phase: {pushed:g} pushed, {pulled:g} pulled",
    )


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
