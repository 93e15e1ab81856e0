"""30% of P's WRITEs complete in error (injected in P's transport), on the multi-chunk profile
(one 128 KiB block per chunk: a transfer is 1-15 WRITEs): chunks are retried, a failed last
chunk is confirmed with D and posted again, transfers fall back to D pulling only once a
chunk's retries are exhausted (or its retry budget, or the peer's breaker, says so), and
every answer is still correct.
"""

from __future__ import annotations

import sys

from kvpush_prod.chaos.harness import Context, Needs, Options, check_all_answered, main

NAME = "write_failures"
DESCRIPTION = (
    "30% injected WRITE failures on P, many chunks per transfer: retries (the last "
    "chunk after asking D), pull only once retries are exhausted; every answer correct"
)
FAIL_RATE = 0.3
PROFILE = "cpu-multichunk"
# Why a push may give way to a pull here: a chunk's attempts or its peer's retry budget ran
# out, the peer's breaker is open, or D did not answer whether a last chunk's DONE arrived.
# Never because the failed chunk was the last one (last_chunk_failed, before confirm-then-
# repost), never for a kind of error this scenario does not inject.
PULL_REASONS = ("retries_exhausted", "retry_budget", "breaker_open", "done_query_timeout")


def needs(opts: Options) -> Needs:
    return Needs(
        policy=opts.policy or "recompute",
        decode_blocks=opts.decode_blocks,
        prefill_faults=(("complete_fail_rate", FAIL_RATE), ("seed", opts.seed)),
        profile=PROFILE,
    )


async def run(ctx: Context) -> None:
    gen = ctx.load(ctx.opts.requests, phase="faulty")
    await gen.run()
    obs = ctx.observer
    await obs.poll()
    errors = obs.increase("prefill", "kvpush_chunks_total", result="error")
    retries = obs.increase("prefill", "kvpush_retries_total")
    capped = obs.increase("prefill", "kvpush_link_capped_total")
    produced = {
        o: obs.increase("prefill", "kvpush_transfers_total", role="producer", outcome=o)
        for o in ("pushed", "retried", "pull_fallback", "failed", "expired")
    }
    why = obs.by_label("prefill", "kvpush_fallbacks_total", "reason", role="producer")
    ctx.event(
        "P's transfers under faults",
        chunk_errors=errors,
        retries=retries,
        capped=capped,
        fallback_reasons=why,
        **{f"p_{k}": v for k, v in produced.items()},
    )
    ctx.report.data["faults_seen"] = {
        "chunk_errors": errors,
        "retries": retries,
        "link_capped": capped,
        "fallback_reasons": why,
        "producer_outcomes": produced,
    }
    ctx.report.check(
        "faults were injected (P saw failed WRITEs)",
        errors > 0,
        "" if errors else "kvpush_chunks_total{result=error} did not grow on P",
    )
    ctx.report.check(
        "failed chunks were posted again (retries > 0)",
        retries > 0,
        "" if retries else "kvpush_retries_total did not grow on P",
    )
    ctx.report.check(
        "pushes were retried to the end (retried > 0)",
        produced["retried"] > 0,
        "" if produced["retried"] else f"no retried transfer: {produced}",
    )
    ctx.report.check(
        "the per-link in-flight cap held chunks back",
        capped > 0,
        "" if capped else "kvpush_link_capped_total did not grow on P",
    )
    other = {r: n for r, n in why.items() if r not in PULL_REASONS}
    ctx.report.check(
        "pulls only after retries were exhausted (or budget, breaker, no answer)",
        not other,
        f"fallbacks for other reasons: {other}" if other else "",
    )
    check_all_answered(ctx, gen.records, "retries, pull and recompute absorb the faults")


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
