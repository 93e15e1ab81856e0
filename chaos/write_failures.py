"""30% of P's WRITEs complete in error (injected in P's transport): chunks are retried,
transfers that still fail fall back to D pulling, and every answer is still correct.
"""

from __future__ import annotations

import sys

from kvpush_prod.chaos.harness import Context, Needs, Options, check_all_answered, main

NAME = "write_failures"
DESCRIPTION = "30% injected WRITE failures on P: retries, then pull fallback; every answer correct"
FAIL_RATE = 0.3


def needs(opts: Options) -> Needs:
    return Needs(policy=opts.policy or "recompute", decode_blocks=opts.decode_blocks,
                 prefill_faults=(("complete_fail_rate", FAIL_RATE), ("seed", opts.seed)))


async def run(ctx: Context) -> None:
    gen = ctx.load(ctx.opts.requests, phase="faulty")
    await gen.run()
    obs = ctx.observer
    await obs.poll()
    errors = obs.increase("prefill", "kvpush_chunks_total", result="error")
    retries = obs.increase("prefill", "kvpush_retries_total")
    produced = {o: obs.increase("prefill", "kvpush_transfers_total", role="producer", outcome=o)
                for o in ("pushed", "retried", "pull_fallback", "failed", "expired")}
    ctx.event("P's transfers under faults", chunk_errors=errors, retries=retries,
              **{f"p_{k}": v for k, v in produced.items()})
    ctx.report.data["faults_seen"] = {"chunk_errors": errors, "retries": retries,
                                      "producer_outcomes": produced}
    ctx.report.check("faults were injected (P saw failed WRITEs)", errors > 0,
                     "" if errors else "kvpush_chunks_total{result=error} did not grow on P")
    recovered = produced["retried"] + produced["pull_fallback"]
    ctx.report.check("failed pushes were retried or fell back to pull", recovered > 0,
                     "" if recovered else f"no retried/pull_fallback transfer: {produced}")
    check_all_answered(ctx, gen.records, "retries, pull and recompute absorb the faults")


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
