"""Clients that give up: half of the requests are abandoned (connection closed) before,
around or after the transfer: at a uniform moment in their first 1.2 s (about a request's
life here), or, for half of the streaming ones, after a uniform number of received tokens.
The rest must be correct, the pair must keep serving, and no block or credit may stay held.
"""

from __future__ import annotations

import sys

from kvpush_prod.chaos.harness import Context, Needs, Options, check_resumed, main
from kvpush_prod.chaos.observe import TRANSFERS

NAME = "client_cancel"
DESCRIPTION = (
    "clients close the connection at random moments (before/around/after the "
    "transfer); no leak, no wrong answer, the pair keeps serving"
)
CANCEL_FRACTION = 0.5
CANCEL_MAX_S = 1.2


def needs(opts: Options) -> Needs:
    return Needs(policy=opts.policy or "fail", decode_blocks=opts.decode_blocks)


async def run(ctx: Context) -> None:
    n = ctx.opts.requests
    gen = ctx.load(
        n,
        phase="cancelling",
        mix=ctx.opts.mix(cancel_fraction=CANCEL_FRACTION, cancel_max_s=CANCEL_MAX_S),
    )
    await gen.run()
    cancelled = [r for r in gen.records if r.error_kind == "cancelled"]
    before_byte = sum(1 for r in cancelled if r.first_byte is None)
    at = sorted(r.cancel_after for r in cancelled if r.cancel_after is not None)
    timing: dict[str, object] = {
        "cancelled": len(cancelled),
        "before_first_byte": before_byte,
        "after_first_byte": len(cancelled) - before_byte,
        "after_tokens": sum(1 for r in cancelled if "tokens" in r.error),
        "completed_despite_cancel_plan": sum(
            1 for r in gen.records if r.cancel_after is not None and r.ok
        ),
        "cancel_at_s_quartiles": [
            round(at[int(q * (len(at) - 1))], 3) for q in (0, 0.25, 0.5, 0.75, 1)
        ]
        if at
        else [],
    }
    await ctx.observer.poll()
    for role, engine in (("consumer", "decode"), ("producer", "prefill")):
        for outcome in ("aborted", "cancelled", "expired", "failed"):
            v = ctx.observer.increase(engine, TRANSFERS, role=role, outcome=outcome)
            if v:
                timing[f"{role}_{outcome}"] = v
    ctx.event("cancels", **{k: v for k, v in timing.items() if k != "cancel_at_s_quartiles"})
    ctx.report.data["cancels"] = timing
    ctx.report.check(
        "some clients cancelled",
        len(cancelled) > 0,
        "" if cancelled else "no request was cancelled (all answered first)",
    )
    # The pair keeps serving: a batch with no cancel, all correct.
    after = ctx.load(max(8, n // 5), mix=ctx.opts.mix(), phase="after")
    await after.run()
    check_resumed(ctx, "after", "the pair serves every request after the cancels")


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
