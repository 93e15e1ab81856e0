"""kill -9 the prefill engine while transfers are in flight, restart it with the same engine
id, and check that the requests in flight end cleanly and new traffic is served correctly.
"""

from __future__ import annotations

import asyncio
import sys

from kvpush_prod.chaos.harness import (
    Context,
    Needs,
    Options,
    allow_after,
    break_and_recover,
    check_resumed,
    main,
)

NAME = "kill_prefill"
DESCRIPTION = "kill -9 P mid-transfer, restart it (same engine id), traffic resumes"


def needs(opts: Options) -> Needs:
    return Needs(policy=opts.policy or "recompute", decode_blocks=opts.decode_blocks)


async def run(ctx: Context, engine: str = "prefill") -> None:
    n = ctx.opts.requests
    gen = ctx.load(n, phase="before")
    gen.hold_open = True  # during the outage it keeps probing; the rest comes after recovery
    task = asyncio.create_task(gen.run())
    try:
        await gen.wait_done(max(2, n // 4))
        await break_and_recover(ctx, gen, engine, "kill")
        allow_after(gen, n, max(8, n // 4))
        await task
    finally:
        gen.stop()
        await task
    check_resumed(ctx, "after", f"traffic resumes after {engine} restarted")


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
