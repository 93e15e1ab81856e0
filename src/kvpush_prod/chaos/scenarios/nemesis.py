"""The nemesis: steady mixed traffic through the router over 2 P x 2 D for a set duration while
a seeded random schedule applies overlapping faults (kill -9 and restart, SIGSTOP/SIGCONT,
graceful restart, drain/undrain, injected WRITE failures, a keyed flood; with ``--netns``,
every engine in its own network namespace, partitions and throttled links too), with quiet
windows. Invariants
are checked while it runs; the report's schedule replays with ``--replay REPORT.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvpush_prod.chaos.harness import Context, Needs, Options, main
from kvpush_prod.chaos.nemesis import Nemesis, Settings
from kvpush_prod.chaos.schedule import (
    DEFAULT_KINDS,
    KINDS,
    NETNS_KINDS,
    Schedule,
    ScheduleConfig,
    ScheduleError,
    generate,
    quiet_every_for,
    restart_slot_for,
)
from kvpush_prod.lab.netns import why_not

NAME = "nemesis"
DESCRIPTION = (
    "2 P x 2 D under steady mixed load for a set time while a seeded schedule of "
    "overlapping faults runs; invariants checked continuously; replayable"
)
DEFAULTS = {"concurrency": 4, "timeout": 120.0, "progress_every": 50}
WRITE_FAIL_RATE = 0.5  # of P's WRITEs while the switch file exists


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load (default 600)")
    ap.add_argument(
        "--replay",
        type=Path,
        default=None,
        help="run the schedule (and load seed) of this nemesis report again",
    )
    ap.add_argument(
        "--netns",
        action="store_true",
        help="run each prefill and decode engine in its own network namespace (root, "
        "iproute2), KV over TCP between them; adds the partition and throttle faults",
    )
    ap.add_argument(
        "--kinds",
        default=None,
        help=f"fault kinds to draw (default {','.join(DEFAULT_KINDS)}, with --netns "
        f"{','.join(KINDS)}; {','.join(NETNS_KINDS)} need --netns)",
    )
    ap.add_argument("--max-overlap", type=int, default=2, help="faults active at once, at most")
    ap.add_argument(
        "--quiet-every",
        type=float,
        default=None,
        help="a quiet window this often (default 120 s, or further apart where a restart "
        "slot needs it: slot + quiet + 40 s)",
    )
    ap.add_argument("--quiet-s", type=float, default=20.0, help="each quiet window's length")
    ap.add_argument(
        "--restart-slot",
        type=float,
        default=None,
        help="planned seconds a killed engine is out (default: 2.5 x how long this cluster "
        "took to start, within 60-300 s; 150 s when not measured)",
    )
    ap.add_argument("--grace", type=float, default=10.0, help="a fault explains failures so long")
    ap.add_argument("--role-bound", type=float, default=30.0, help="max seconds a role is out")
    ap.add_argument("--flood-rate", type=int, default=2000, help="flood messages a second")
    ap.add_argument("--prefills", type=int, default=2)
    ap.add_argument("--decodes", type=int, default=2)


def needs(opts: Options) -> Needs:
    prefills, decodes = int(opts.extra.get("prefills", 2)), int(opts.extra.get("decodes", 2))
    if prefills < 2 or decodes < 2:
        raise ValueError(
            f"the nemesis needs at least 2 prefill and 2 decode engines (got --prefills "
            f"{prefills} --decodes {decodes}): it takes one engine of a role out at a time"
        )
    netns = bool(opts.extra.get("netns"))
    if netns and why_not() is not None:
        raise ValueError(f"--netns: this machine cannot run engines in namespaces: {why_not()}")
    return Needs(
        policy=opts.policy or "recompute",
        decode_blocks=opts.decode_blocks,
        prefill_faults=(
            ("complete_fail_rate", WRITE_FAIL_RATE),
            ("active_file", "{workdir}"),
            ("seed", opts.seed),
        ),
        admin=True,
        prefills=prefills,
        decodes=decodes,
        router_policy="engine_load",
        netns=netns,
    )


def kinds_of(extra: dict[str, Any]) -> tuple[str, ...]:
    """The fault kinds to draw: ``--kinds``, or every kind the cluster can take."""
    given = extra.get("kinds")
    if not given:
        return KINDS if extra.get("netns") else DEFAULT_KINDS
    return tuple(k.strip() for k in str(given).split(",") if k.strip())


def schedule_for(ctx: Context) -> Schedule:
    """The replayed schedule (``--replay``) or a fresh one drawn from ``--seed``."""
    x = ctx.opts.extra
    replay = x.get("replay")
    if replay:
        try:
            report = json.loads(Path(replay).read_text())
            sched = Schedule.from_dict(report["nemesis"]["schedule"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ScheduleError(
                f"--replay {replay}: cannot read a nemesis schedule from it ({exc}); give the "
                "JSON report a nemesis run wrote with --report"
            ) from None
        ctx.opts.seed = int(report.get("options", {}).get("seed", sched.seed))  # the same load
        return sched
    kinds = kinds_of(x)
    netns = [k for k in kinds if k in NETNS_KINDS]
    if netns and not all(e in ctx.cluster.spec.netns for e in ctx.cluster.engine_names):
        raise ScheduleError(
            f"fault kinds {netns} need every engine in its own network namespace "
            "(ClusterSpec.netns): add --netns, or drop them from --kinds"
        )
    quiet_s = float(x.get("quiet_s") or 20.0)
    start_s = getattr(ctx.cluster, "start_s", None)
    if x.get("restart_slot") is not None:
        slot = float(x["restart_slot"])
    else:
        slot = restart_slot_for(start_s)
    if x.get("quiet_every") is not None:
        quiet_every = float(x["quiet_every"])
    else:
        quiet_every = quiet_every_for(slot, quiet_s)
    ctx.event(
        f"nemesis plan: restart slot {slot:g} s, a quiet window every {quiet_every:g} s",
        cluster_start_s=None if start_s is None else round(start_s, 1),
        slot_given=x.get("restart_slot") is not None,
    )
    cfg = ScheduleConfig(
        duration_s=float(x.get("duration", 600.0)),
        prefills=tuple(ctx.cluster.prefill_names),
        decodes=tuple(ctx.cluster.decode_names),
        kinds=kinds,
        max_overlap=int(x.get("max_overlap", 2)),
        quiet_every_s=quiet_every,
        quiet_s=quiet_s,
        restart_slot_s=slot,
    )
    return generate(ctx.opts.seed, cfg)


async def run(ctx: Context) -> None:
    sched = schedule_for(ctx)
    x = ctx.opts.extra
    settings = Settings(
        grace_s=float(x.get("grace", 10.0)),
        role_bound_s=float(x.get("role_bound", 30.0)),
        flood_rate=int(x.get("flood_rate", 2000)),
    )
    ctx.event(
        f"nemesis: {len(sched.faults)} faults and {len(sched.quiet)} quiet windows in "
        f"{sched.config.duration_s:g} s",
        seed=sched.seed,
        kinds=",".join(sched.config.kinds),
    )
    nem = Nemesis(ctx, sched, settings)
    await nem.run()
    data = ctx.report.data["nemesis"]
    restarts = [f["restart_s"] for f in data["faults"] if "restart_s" in f]
    ctx.event(
        f"nemesis ran {data['behind_plan_s']:g} s behind its plan",
        restarts=len(restarts),
        restart_s=f"{min(restarts):g}-{max(restarts):g}" if restarts else "-",
        planned_slot_s=sched.config.restart_slot_s,
    )
    for f in data["faults"]:
        ctx.log(
            f"fault {f['id']:3d} {f['kind']:10s} {f['engine']:10s} "
            f"{f['start'] or 0:7.1f}-{f['end'] or 0:7.1f} s: "
            f"{len(f.get('requests_in_flight', []))} requests in flight, "
            f"failed {f.get('failed_requests', [])[:12]}"
        )


if __name__ == "__main__":
    sys.exit(main(sys.modules[__name__]))
