"""SIGSTOP the prefill engine for longer than its write permit while transfers are in
flight, then SIGCONT it: D must have failed those receives and reused their blocks, and
nothing P still had queued or posted may land in them. The proof is in the tokens: every
successful answer equals the reference, including those of requests D admitted after the
stall into the freed blocks (D's KV cache is kept small so freed blocks are reused soon).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import Any

from kvpush_prod.chaos.harness import (
    ENGINES,
    Context,
    Needs,
    Options,
    allow_after,
    check_resumed,
    main,
)
from kvpush_prod.chaos.load import LoadGenerator
from kvpush_prod.chaos.observe import TRANSFERS

NAME = "stall_prefill"
DESCRIPTION = (
    "SIGSTOP P longer than its write permit mid-transfer, then SIGCONT: no late "
    "write lands in reused blocks (policy fail: failed receives are clear errors)"
)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--stall-s",
        type=float,
        default=9.0,
        help="how long P stays stopped (the permit is leases.permit_ttl_s = 5 s)",
    )


def needs(opts: Options) -> Needs:
    return Needs(policy=opts.policy or "fail", decode_blocks=opts.decode_blocks)


async def run(ctx: Context) -> None:
    n = ctx.opts.requests
    stall = float(ctx.opts.extra.get("stall_s", 9.0))
    gen = ctx.load(n, phase="before")
    gen.hold_open = True
    task = asyncio.create_task(gen.run())
    try:
        await gen.wait_done(max(2, n // 4))
        evidence = await ctx.wait_in_flight(ENGINES, what="SIGSTOP prefill", gen=gen)
        failed_before = ctx.observer.increase(
            "decode", TRANSFERS, role="consumer", outcome="failed"
        )
        await _stall(ctx, gen, stall, evidence)
        waited = await ctx.wait_router_ready()
        gen.phase = "after"
        ctx.event(
            "router has the pair again", waited_s=None if waited is None else round(waited, 1)
        )
        # Enough requests after the stall that D's allocations cycle through its whole KV
        # cache (vLLM hands out free blocks in LRU order): the blocks freed by the stall are
        # then certainly reused by requests admitted after it.
        block = ctx.cluster.block_size()
        pool = ctx.needs.decode_blocks or 0
        gen.extend(max(0, gen.progress.sent + max(8, n // 3) - gen.limit))
        cycled = await _cycle_pool(ctx, gen, block, pool)
        allow_after(gen, n, 0)
        await task
        await _report(ctx, stall, failed_before, cycled, pool)
    finally:
        gen.stop()
        await task
    check_resumed(ctx, "after", "traffic resumes after the stall")


async def _stall(
    ctx: Context, gen: LoadGenerator, stall: float, evidence: dict[str, Any] | None
) -> None:
    """SIGSTOP the prefill engine for ``stall`` seconds; it is SIGCONTed whatever happens."""
    proc = ctx.cluster.procs["prefill"]
    gen.phase = "stall"
    proc.signal_tree(signal.SIGSTOP)
    try:
        ctx.event(
            f"SIGSTOP prefill for {stall:g} s", evidence=evidence, outstanding=ctx.outstanding()
        )
        await asyncio.sleep(stall)  # the fault's duration, not a wait for something
    finally:
        proc.signal_tree(signal.SIGCONT)
    ctx.event("SIGCONT prefill", outstanding=ctx.outstanding())


async def _report(ctx: Context, stall: float, failed_before: float, cycled: int, pool: int) -> None:
    """Check that D's KV cache was cycled after the stall; record what D failed, expired
    and fenced meanwhile."""
    ctx.report.check(
        "D's KV cache was cycled after the stall (freed blocks reused)",
        pool == 0 or cycled >= pool,
        ""
        if pool == 0 or cycled >= pool
        else f"requests after the stall used {cycled} blocks of D's {pool}",
    )
    await ctx.observer.poll()
    failed = (
        ctx.observer.increase("decode", TRANSFERS, role="consumer", outcome="failed")
        - failed_before
    )
    recompute = ctx.observer.increase("decode", TRANSFERS, role="consumer", outcome="recompute")
    ctx.event(
        "receives D failed during/after the stall",
        failed=failed,
        recompute=recompute,
        blocks_allocated_after=cycled,
    )
    expired = ctx.observer.increase("decode", "kvpush_leases_expired_total", role="consumer")
    fenced = {e: ctx.observer.increase(e, "kvpush_leases_fenced_total") for e in ENGINES}
    ctx.report.data["stall"] = {
        "seconds": stall,
        "d_failed_receives": failed,
        "d_permits_expired": expired,
        "fenced": fenced,
        "blocks_allocated_after": cycled,
        "decode_blocks": pool,
    }


async def _cycle_pool(ctx: Context, gen: LoadGenerator, block: int, pool: int) -> int:
    """Extend the load until the requests launched after the stall have allocated 1.2x
    D's blocks (prompt + output, rounded up to blocks); returns the blocks they allocated."""

    def used() -> int:
        return sum(-(-(r.prompt_len + r.max_tokens) // block) for r in ctx.phase_records("after"))

    target = int(1.2 * pool)
    cap = 10 * max(8, ctx.opts.requests)  # a bound, should the pool be huge
    while (used() < target or gen.progress.sent < gen.limit) and len(
        ctx.phase_records("after")
    ) < cap:
        if gen.progress.sent >= gen.limit:
            gen.extend(max(1, (target - used()) // 8))
        await gen.wait_done(gen.progress.done + 1, timeout=5)
    return used()


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
