"""A rolling restart under load, done the way an operator should: ``kvpush drain`` each
engine (the router stops giving it new requests at once, the engine finishes what it holds),
restart it, let it rejoin. With one engine per role the requests that arrive meanwhile wait
in the router (``no_backend_wait_s``) for the engine's return: no request fails, no answer
is wrong, nothing is held afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvpush_prod.chaos.harness import (
    Context,
    Needs,
    Options,
    admin_token_file,
    check_all_answered,
    faults_under_load,
    main,
)
from kvpush_prod.chaos.load import LoadGenerator
from kvpush_prod.router.drain import drain

NAME = "drain"
DESCRIPTION = (
    "rolling restart under load by drain-then-restart (D, then P): requests wait "
    "for the restarting engine, none fails"
)
WAIT_S = 150.0  # what the router lets a request wait for a returning engine


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--engines",
        default="decode,prefill",
        help="the engines to drain and restart, in order (default decode,prefill)",
    )


def needs(opts: Options) -> Needs:
    return Needs(
        policy=opts.policy or "recompute",
        decode_blocks=opts.decode_blocks,
        admin=True,
        no_backend_wait_s=WAIT_S,
    )


async def run(ctx: Context) -> None:
    engines = [e.strip() for e in str(ctx.opts.extra.get("engines", "decode,prefill")).split(",")]
    token = admin_token_file(ctx.cluster.spec.workdir).read_text().strip()
    router = ctx.cluster.urls["router"]

    async def drain_and_restart(gen: LoadGenerator, i: int) -> None:
        engine = engines[i - 1]
        gen.phase = f"drain{i}"
        ctx.event(f"kvpush drain {engine}", outstanding=ctx.outstanding())
        drained = await asyncio.to_thread(
            drain, ctx.cluster.urls[engine], [router], token, ctx.opts.timeout, ctx.log, 0.5
        )
        ctx.report.check(
            f"{engine} drained: no request, transfer or block left ({i})",
            drained,
            "" if drained else "still busy at the deadline",
        )
        gen.phase = f"restart{i}"
        secs = await ctx.restart(engine, graceful=True)
        ctx.event(f"{engine} restarted and healthy", seconds=round(secs, 1))
        waited = await ctx.wait_router_ready(timeout=60)
        ctx.report.check(
            f"the router takes {engine} back by itself ({i})",
            waited is not None,
            "" if waited is not None else "still draining or down after 60 s",
        )
        gen.phase = f"after{i}"

    await faults_under_load(ctx, len(engines), drain_and_restart)
    records = [r for g in ctx.generators for r in g.records]
    during = [r for r in records if r.phase.startswith(("drain", "restart"))]
    ctx.event("requests sent while an engine drained or restarted", count=len(during))
    ctx.report.check(
        "requests arrived during the drains and restarts",
        bool(during),
        "" if during else "none: the scenario proved nothing",
    )
    check_all_answered(ctx, records, "a drained restart loses no request")


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
