"""The nemesis's continuous invariants, pure: fed fault intervals, finished requests, reference
answers and metric readings while the run goes on; each breach is kept as a violation at once.

Invariants: every answer equals the single engine's; no request outlives its bound; a request
fails only while a fault touched an engine it used (or its client cancelled); per engine,
transfers started = ended (all outcomes) + active (exact when quiet); nothing held after a
quiet window; no role without an engine in service for longer than the bound.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvpush_prod.chaos.load import Record

_URL = re.compile(r"https?://[\w.\-]+:\d+")


@dataclass
class Violation:
    """One breach of an invariant, when it was seen."""

    at: float
    invariant: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {"at": round(self.at, 2), "invariant": self.invariant, "detail": self.detail}


@dataclass
class Span:
    """A fault as it happened: the engines it touched, from ``start`` to ``end`` (None: still
    on)."""

    fid: int
    kind: str
    engines: frozenset[str]
    start: float
    end: float | None = None

    def overlaps(self, t0: float, t1: float, grace: float) -> bool:
        """Whether [t0, t1] meets the fault, its end extended by ``grace``."""
        end = float("inf") if self.end is None else self.end + grace
        return t0 <= end and t1 >= self.start


@dataclass
class Counts:
    """How the requests the checker saw ended."""

    correct: int = 0
    wrong: int = 0
    failed_explained: int = 0
    failed_unexplained: int = 0
    hung: int = 0
    cancelled: int = 0
    unchecked: int = 0


def engines_named(text: str, names: dict[str, str]) -> set[str]:
    """The engines whose URL ``text`` names (``names``: URL -> engine name)."""
    return {names[u] for u in _URL.findall(text) if u in names}


@dataclass
class Invariants:
    """The checker's state; ``grace_s`` extends each fault past its end (a request still
    winding down then may fail for it), ``role_bound_s`` bounds a role out of service."""

    names: dict[str, str]  # engine URL -> engine name
    grace_s: float = 10.0
    role_bound_s: float = 30.0
    spans: dict[int, Span] = field(default_factory=dict)
    violations: list[Violation] = field(default_factory=list)
    counts: Counts = field(default_factory=Counts)
    explained_by: dict[int, list[int]] = field(default_factory=dict)  # fault id -> idx
    accounting_checks: int = 0
    held_checks: int = 0
    _role_out: dict[str, float] = field(default_factory=dict)
    _reported: set[str] = field(default_factory=set)
    longest_role_out: dict[str, float] = field(default_factory=dict)
    # Told of each violation as it is kept (the nemesis logs it at once, so a run stopped
    # before its report still names what broke).
    on_violation: Callable[[Violation], None] | None = None

    def _violate(self, at: float, invariant: str, detail: str) -> None:
        v = Violation(at, invariant, detail)
        self.violations.append(v)
        if self.on_violation is not None:
            self.on_violation(v)

    # -- faults
    def fault_started(self, fid: int, kind: str, engines: set[str], at: float) -> None:
        self.spans[fid] = Span(fid, kind, frozenset(engines), at)

    def fault_ended(self, fid: int, at: float) -> None:
        self.spans[fid].end = at

    # -- requests
    def request(self, rec: Record, reference: str | None) -> str:
        """Judge one finished request (``reference``: the single engine's answer, None when
        it could not be had); its class."""
        if rec.error_kind == "cancelled":
            self.counts.cancelled += 1
            return "cancelled"
        if rec.error_kind == "timeout":
            self.counts.hung += 1
            self._violate(
                rec.ended,
                "no request outlives its bound",
                f"#{rec.idx} ({rec.started:.1f}-{rec.ended:.1f} s): {rec.error}",
            )
            return "hung"
        if rec.ok:
            return self._answer(rec, reference)
        return self._failure(rec)

    def _answer(self, rec: Record, reference: str | None) -> str:
        if reference is None:
            self.counts.unchecked += 1
            return "unchecked"
        if rec.text == reference:
            self.counts.correct += 1
            return "correct"
        self.counts.wrong += 1
        at = next(
            (i for i, (a, b) in enumerate(zip(rec.text, reference, strict=False)) if a != b),
            min(len(rec.text), len(reference)),
        )
        self._violate(
            rec.ended,
            "every answer equals the single engine's",
            f"#{rec.idx} (stream={rec.stream}, request {rec.request_id}) differs at char "
            f"{at}: got {rec.text[at : at + 40]!r}, expected {reference[at : at + 40]!r}",
        )
        return "wrong"

    def _failure(self, rec: Record) -> str:
        touched = engines_named(rec.error, self.names)
        hits = [
            s
            for s in self.spans.values()
            if s.overlaps(rec.started, rec.ended, self.grace_s)
            and (not touched or touched & s.engines)
        ]
        if hits:
            self.counts.failed_explained += 1
            for s in hits:
                self.explained_by.setdefault(s.fid, []).append(rec.idx)
            return "failed_explained"
        self.counts.failed_unexplained += 1
        where = f"it touched {sorted(touched)}" if touched else "it names no engine"
        self._violate(
            rec.ended,
            "a request fails only when a fault touched an engine it used",
            f"#{rec.idx} ({rec.started:.1f}-{rec.ended:.1f} s) failed with no fault on the "
            f"engines ({where}): {rec.status or rec.error_kind} {rec.error[:200]}",
        )
        return "failed_unexplained"

    # -- metrics
    def accounting(
        self, engine: str, at: float, started: float, ended: float, active: float, slack: float
    ) -> None:
        """Transfers started = ended + active on ``engine``, within ``slack`` (0: exact, as
        at a quiet window)."""
        self.accounting_checks += 1
        gap = started - ended - active
        if abs(gap) > slack:
            self._violate(
                at,
                "every transfer ends exactly once (started = ended + active)",
                f"{engine}: started {started:g}, ended {ended:g}, active {active:g}: off by "
                f"{gap:+g}" + (f" (allowed {slack:g} while busy)" if slack else " (quiet)"),
            )

    def held(self, engine: str, at: float, readings: dict[str, float | None]) -> None:
        """After a quiet window: nothing held on ``engine`` (each reading 0; None: absent)."""
        self.held_checks += 1
        held = {k: v for k, v in readings.items() if v}
        if held:
            self._violate(
                at,
                "nothing held after a quiet window",
                f"{engine}: " + ", ".join(f"{k}={v:g}" for k, v in held.items()),
            )

    def roles_in_service(self, at: float, in_service: dict[str, int]) -> None:
        """How many engines of each role the router may route to now; a role with none for
        longer than ``role_bound_s`` is a violation (reported once per stretch)."""
        for role, n in in_service.items():
            since = self._role_out.get(role)
            if n > 0:
                self._role_out.pop(role, None)
                self._reported.discard(role)
                continue
            if since is None:
                self._role_out[role] = at
                continue
            out = at - since
            self.longest_role_out[role] = max(self.longest_role_out.get(role, 0.0), out)
            if out > self.role_bound_s and role not in self._reported:
                self._reported.add(role)
                self._violate(
                    at,
                    "no role is left without an engine longer than the bound",
                    f"no {role} engine in service for {out:.0f} s (bound {self.role_bound_s:g} s)",
                )

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": self.counts.__dict__,
            "violations": [v.as_dict() for v in self.violations],
            "accounting_checks": self.accounting_checks,
            "held_checks": self.held_checks,
            "longest_role_out_s": {k: round(v, 1) for k, v in self.longest_role_out.items()},
            "grace_s": self.grace_s,
            "role_bound_s": self.role_bound_s,
        }


def in_flight_during(span: Span, records: list[Record]) -> list[int]:
    """The requests that ran while ``span`` was on (the ones it may have touched)."""
    end = float("inf") if span.end is None else span.end
    return [r.idx for r in records if r.started <= end and r.ended >= span.start]
