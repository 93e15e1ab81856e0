"""kill -9 the decode engine while transfers are in flight, restart it with the same engine
id, and check that P frees what it held for the dead D and pushes to the new one.
"""

from __future__ import annotations

import sys

from kvpush_prod.chaos.harness import Context, Needs, Options, main
from kvpush_prod.chaos.scenarios import kill_prefill

NAME = "kill_decode"
DESCRIPTION = "kill -9 D mid-transfer, restart it (same engine id), traffic resumes"


def needs(opts: Options) -> Needs:
    return Needs(policy=opts.policy or "recompute", decode_blocks=opts.decode_blocks)


async def run(ctx: Context) -> None:
    await kill_prefill.run(ctx, engine="decode")


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
