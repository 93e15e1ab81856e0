"""Two prefill and two decode engines behind the router (policy ``engine_load``) under
steady load: kill -9 one decode engine mid-transfer, restart it and let it rejoin; then the
same for one prefill engine. The requests that fail are at most those in flight on the
victim, none hangs, none is wrong, nothing is held afterwards, the victim serves again.
"""

from __future__ import annotations

import argparse
import sys

from kvpush_prod.chaos.harness import (
    Context,
    Needs,
    Options,
    check_resumed,
    faults_under_load,
    kill_in_flight,
    main,
    rejoin,
)
from kvpush_prod.chaos.load import LoadGenerator

NAME = "nxm_kill"
DESCRIPTION = (
    "2 P x 2 D under load: kill -9 one D, restart, rejoin; then one P; failures "
    "at most the victim's requests in flight"
)
DEFAULTS = {"requests": 80, "concurrency": 6}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--victims",
        default="decode-1,prefill-1",
        help="the engines to kill, in order (default decode-1,prefill-1)",
    )
    ap.add_argument("--prefills", type=int, default=2, help="prefill engines (default 2)")
    ap.add_argument("--decodes", type=int, default=2, help="decode engines (default 2)")
    ap.add_argument(
        "--outage-rate",
        type=float,
        default=2.0,
        help="requests a second while a victim restarts (default 2)",
    )


def needs(opts: Options) -> Needs:
    prefills, decodes = int(opts.extra.get("prefills", 2)), int(opts.extra.get("decodes", 2))
    if prefills < 2 or decodes < 2:
        raise ValueError(
            f"nxm_kill needs at least 2 prefill and 2 decode engines (got "
            f"--prefills {prefills} --decodes {decodes}): with one engine per "
            "role run kill_prefill or kill_decode"
        )
    return Needs(
        policy=opts.policy or "recompute",
        decode_blocks=opts.decode_blocks,
        prefills=prefills,
        decodes=decodes,
        router_policy="engine_load",
    )


async def run(ctx: Context) -> None:
    victims = [
        v.strip()
        for v in str(ctx.opts.extra.get("victims", "decode-1,prefill-1")).split(",")
        if v.strip()
    ]
    unknown = [v for v in victims if v not in ctx.engines]
    if unknown:
        raise ValueError(
            f"unknown victim(s) {unknown}: the cluster's engines are {list(ctx.engines)}"
        )
    rate = float(ctx.opts.extra.get("outage_rate", 2.0))

    async def kill_and_rejoin(gen: LoadGenerator, i: int) -> None:
        await kill_in_flight(ctx, gen, victims[i - 1], tag=str(i))
        await rejoin(ctx, gen, victims[i - 1], tag=str(i), per_s=rate)

    await faults_under_load(ctx, len(victims), kill_and_rejoin)
    outage = [r for g in ctx.generators for r in g.records if r.phase.startswith("outage")]
    ctx.event("requests sent while a victim was down or restarting", count=len(outage))
    ctx.report.check(
        "requests arrived while a victim was down",
        bool(outage),
        "" if outage else "none: the kills proved nothing about routing around",
    )
    for i, victim in enumerate(victims, 1):
        until = ctx.kills[i].at if i < len(ctx.kills) else None
        check_resumed(
            ctx, f"after{i}", f"every request after {victim} rejoined succeeded ({i})", until
        )


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
