"""The nemesis's fault schedule: a seeded random plan of overlapping faults with quiet windows,
pure (no cluster), serialisable into the report and replayed from it exactly.

Faults that take an engine out of service (kill, restart, stop, drain, partition) never
overlap on two engines of one role, so every role keeps an engine; at most ``max_overlap``
faults of any kind run at once, and none runs during a quiet window.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any

# Faults that take their engine out of service while they last.
OUT_OF_SERVICE = ("kill", "restart", "stop", "drain", "partition")
# Faults that leave it in service, degraded.
DEGRADING = ("write_fail", "flood", "throttle")
KINDS = OUT_OF_SERVICE + DEGRADING
# Faults that need the engines in their own network namespaces.
NETNS_KINDS = ("partition", "throttle")
DEFAULT_KINDS = tuple(k for k in KINDS if k not in NETNS_KINDS)

# How long each kind holds its engine, seconds (low, high). kill and restart hold it for as
# long as the engine takes to start again: ``restart_slot_s`` is the plan's estimate.
DURATIONS: dict[str, tuple[float, float]] = {
    "stop": (3.0, 12.0),
    "drain": (5.0, 20.0),
    "partition": (3.0, 10.0),
    "write_fail": (5.0, 20.0),
    "flood": (3.0, 10.0),
    "throttle": (10.0, 30.0),
}


# How often each kind is drawn, relative to the others: the faults that take an engine out
# are the ones that matter most, a flood costs the box a core.
WEIGHTS: dict[str, float] = {
    "kill": 3.0,
    "restart": 1.0,
    "stop": 2.0,
    "drain": 2.0,
    "partition": 2.0,
    "write_fail": 2.0,
    "flood": 1.0,
    "throttle": 1.0,
}


# A kill's planned hold when the box's engine start is not known: a restart under the
# nemesis's load measured 140-160 s on a 2-core box (vLLM's imports and engine init compete
# with four busy engines), where the cluster's own start took ~60 s.
RESTART_SLOT_S = 150.0
# A restart under load takes this many times the cluster's start (same box), with bounds.
RESTART_OVER_START = 2.5
RESTART_SLOT_BOUNDS = (60.0, 300.0)
# Room between quiet windows beyond a restart slot, so that a kill fits between two.
QUIET_ROOM_S = 40.0


def restart_slot_for(start_s: float | None) -> float:
    """The planned hold of a kill or restart on a box whose cluster took ``start_s`` to
    start (None: not measured). A plan whose slot is shorter than the box's real restarts
    runs behind itself: later faults and quiet windows wait for the engine, and a 600 s
    plan took 1,050-1,100 s with a 60 s slot on a 2-core box."""
    if start_s is None or start_s <= 0:
        return RESTART_SLOT_S
    lo, hi = RESTART_SLOT_BOUNDS
    return float(round(min(hi, max(lo, RESTART_OVER_START * start_s))))


def quiet_every_for(restart_slot_s: float, quiet_s: float, asked: float = 120.0) -> float:
    """How often a quiet window starts: ``asked``, or as far apart as a kill needs to fit
    between two windows (no fault may run in a window)."""
    return max(asked, restart_slot_s + quiet_s + QUIET_ROOM_S)


class ScheduleError(ValueError):
    """A schedule or its settings cannot be used."""


@dataclass(frozen=True)
class ScheduleConfig:
    """What the plan is drawn for."""

    duration_s: float
    prefills: tuple[str, ...]
    decodes: tuple[str, ...]
    kinds: tuple[str, ...] = DEFAULT_KINDS
    max_overlap: int = 2  # faults active at once, at most
    quiet_every_s: float = 120.0  # a quiet window starts this often
    quiet_s: float = 20.0  # ... and lasts this long (no fault may run in it)
    gap_s: tuple[float, float] = (2.0, 12.0)  # between two fault starts
    warmup_s: float = 15.0  # no fault before this
    tail_s: float = 20.0  # no fault may be planned to run into the last seconds
    restart_slot_s: float = 60.0  # a kill's or restart's planned hold on its engine

    def check(self) -> None:
        unknown = [k for k in self.kinds if k not in KINDS]
        if unknown:
            raise ScheduleError(f"unknown fault kind(s) {unknown}: choose among {', '.join(KINDS)}")
        if not self.prefills or not self.decodes:
            raise ScheduleError("the nemesis needs at least one prefill and one decode engine")
        if self.max_overlap < 1:
            raise ScheduleError(f"max_overlap {self.max_overlap}: at least 1 fault at a time")
        if self.duration_s <= self.warmup_s + self.tail_s:
            raise ScheduleError(
                f"duration {self.duration_s:g} s leaves no time for faults after the "
                f"{self.warmup_s:g} s warm-up and before the {self.tail_s:g} s tail: run longer"
            )

    def role(self, engine: str) -> str:
        return "prefill" if engine in self.prefills else "decode"


@dataclass(frozen=True)
class Fault:
    """One planned fault: ``kind`` on ``engine`` from ``at`` for ``hold_s`` seconds (planned;
    kill and restart hold until the engine is back). ``peer``: the flooding engine (flood)."""

    id: int
    at: float
    kind: str
    engine: str
    hold_s: float
    peer: str | None = None

    @property
    def out_of_service(self) -> bool:
        return self.kind in OUT_OF_SERVICE

    def planned_end(self, restart_slot_s: float) -> float:
        return self.at + (restart_slot_s if self.kind in ("kill", "restart") else self.hold_s)


@dataclass(frozen=True)
class Quiet:
    """A quiet window: no fault active, load paused, nothing may stay held after it."""

    at: float
    duration: float


@dataclass
class Schedule:
    """The plan: faults and quiet windows in time order."""

    seed: int
    config: ScheduleConfig
    faults: list[Fault] = field(default_factory=list)
    quiet: list[Quiet] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "config": asdict(self.config),
            "faults": [asdict(f) for f in self.faults],
            "quiet": [asdict(q) for q in self.quiet],
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Schedule:
        try:
            c = dict(d["config"])
            for key in ("prefills", "decodes", "kinds", "gap_s"):
                c[key] = tuple(c[key])
            return Schedule(
                int(d["seed"]),
                ScheduleConfig(**c),
                [Fault(**f) for f in d["faults"]],
                [Quiet(**q) for q in d["quiet"]],
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ScheduleError(
                f"not a nemesis schedule ({type(exc).__name__}: {exc}): pass the JSON report "
                "of a nemesis run (its 'nemesis' -> 'schedule')"
            ) from None

    def timeline(self) -> list[Fault | Quiet]:
        """Fault starts and quiet windows in the order the nemesis meets them."""
        items: list[Fault | Quiet] = [*self.faults, *self.quiet]
        return sorted(items, key=lambda x: (x.at, isinstance(x, Fault)))


def quiet_windows(cfg: ScheduleConfig) -> list[Quiet]:
    """Every ``quiet_every_s``, until the tail."""
    out = []
    t = cfg.quiet_every_s
    while t + cfg.quiet_s <= cfg.duration_s - cfg.tail_s:
        out.append(Quiet(t, cfg.quiet_s))
        t += cfg.quiet_every_s
    return out


def _hold(rng: random.Random, kind: str) -> float:
    if kind in ("kill", "restart"):
        return 0.0
    lo, hi = DURATIONS[kind]
    return round(rng.uniform(lo, hi), 2)


def _fits(cfg: ScheduleConfig, plan: list[Fault], quiet: list[Quiet], f: Fault) -> bool:
    """Whether ``f`` may join ``plan``: out of the quiet windows and the tail, at most
    ``max_overlap`` at once, and never two out-of-service faults in one role at once."""
    end = f.planned_end(cfg.restart_slot_s)
    if end > cfg.duration_s - cfg.tail_s:
        return False
    if any(f.at < q.at + q.duration and end > q.at for q in quiet):
        return False
    live = [g for g in plan if g.at <= f.at < g.planned_end(cfg.restart_slot_s)]
    if len(live) >= cfg.max_overlap:
        return False
    if f.out_of_service:
        role = cfg.role(f.engine)
        for g in plan:
            overlaps = g.at < end and f.at < g.planned_end(cfg.restart_slot_s)
            if overlaps and g.out_of_service and cfg.role(g.engine) == role:
                return False
    return True


def _draw(rng: random.Random, cfg: ScheduleConfig, fid: int, at: float) -> Fault:
    kind = rng.choices(cfg.kinds, [WEIGHTS[k] for k in cfg.kinds])[0]
    engines = [*cfg.prefills, *cfg.decodes]
    # WRITE failures are injected in P's transport: drawn on a P.
    engine = rng.choice(cfg.prefills if kind == "write_fail" else engines)
    peer = rng.choice([e for e in engines if e != engine]) if kind == "flood" else None
    return Fault(fid, round(at, 2), kind, engine, _hold(rng, kind), peer)


def generate(seed: int, cfg: ScheduleConfig) -> Schedule:
    """The plan drawn from ``seed`` (the same seed and settings always give the same plan)."""
    cfg.check()
    rng = random.Random(f"kvpush-nemesis/{seed}")
    quiet = quiet_windows(cfg)
    plan: list[Fault] = []
    t = cfg.warmup_s
    tries = 0
    while t < cfg.duration_s - cfg.tail_s:
        f = _draw(rng, cfg, len(plan) + 1, t)
        if _fits(cfg, plan, quiet, f):
            plan.append(f)
            t += rng.uniform(*cfg.gap_s)
            tries = 0
        else:
            tries += 1
            if tries >= 4:  # nothing fits here: move on
                t += rng.uniform(*cfg.gap_s)
                tries = 0
    return Schedule(seed, cfg, plan, quiet)
