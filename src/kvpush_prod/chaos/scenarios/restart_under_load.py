"""P and D restarted under continuous load, gracefully (SIGTERM), by kill -9, and as a
rolling redeploy (load drained first, then a burst once the engine is back): during each
outage the router answers clear errors, after each restart traffic resumes, correctly.
"""

from __future__ import annotations

import argparse
import sys

from kvpush_prod.chaos.harness import (
    Context,
    Needs,
    Options,
    break_and_recover,
    check_resumed,
    faults_under_load,
    main,
)
from kvpush_prod.chaos.load import LoadGenerator

NAME = "restart_under_load"
DESCRIPTION = (
    "P and D restarted under load (graceful, kill -9, rolling redeploy); traffic resumes each time"
)
ALL_EVENTS = "prefill:term,decode:kill,decode:term,prefill:kill,prefill:rolling,decode:rolling"
SHORT_EVENTS = "prefill:term,decode:kill,prefill:rolling"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--events",
        default=None,
        help="comma-separated engine:how (how: term = graceful, kill = kill -9, "
        "rolling = drained then graceful, as a redeploy); default "
        f"{ALL_EVENTS!r} "
        f"from 100 requests up, else {SHORT_EVENTS!r}",
    )


def needs(opts: Options) -> Needs:
    return Needs(policy=opts.policy or "recompute", decode_blocks=opts.decode_blocks)


def events(opts: Options) -> list[tuple[str, str]]:
    spec = opts.extra.get("events") or (ALL_EVENTS if opts.requests >= 100 else SHORT_EVENTS)
    out = []
    for item in spec.split(","):
        engine, _, how = item.strip().partition(":")
        if engine not in ("prefill", "decode") or how not in ("term", "kill", "rolling"):
            raise ValueError(f"bad event {item!r}: use prefill|decode:term|kill|rolling")
        out.append((engine, how))
    return out


async def run(ctx: Context) -> None:
    plan = events(ctx.opts)
    faults: list[float] = []

    async def fault(gen: LoadGenerator, i: int) -> None:
        engine, how = plan[i - 1]
        faults.append(await break_and_recover(ctx, gen, engine, how, tag=str(i)))

    await faults_under_load(ctx, len(plan), fault)
    for i, (engine, how) in enumerate(plan, 1):
        until = faults[i] if i < len(faults) else None
        check_resumed(ctx, f"after{i}", f"traffic resumes after {how} of {engine} ({i})", until)


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
