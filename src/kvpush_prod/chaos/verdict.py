"""How a chaos run is judged: each request classified, the scenario's checks, one verdict.

A request is correct (same tokens as the single-engine reference), failed with a clear
error, hung (no end within the client bound), cancelled on purpose, or a violation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kvpush_prod.chaos.load import Record

# The columns of the chaos table (docs/chaos.md), in order.
TABLE_COLUMNS = (
    "sent",
    "push",
    "pull_fallback",
    "recompute",
    "failed_clear",
    "hung",
    "wrong_tokens",
    "leaked_blocks",
)


def clear_error(rec: Record) -> bool:
    """A failure a client can act on: an HTTP 4xx/5xx with a message, or an SSE error event."""
    if rec.error_kind == "sse":
        return bool(rec.error)
    if rec.error_kind != "http" or rec.status < 400:
        return False
    try:
        body = json.loads(rec.error)
    except ValueError:
        return bool(rec.error.strip())
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err
        return bool(msg or body.get("detail") or body.get("message"))
    return bool(body)


def served_by(rec: Record) -> str:
    """How D served a successful non-streaming answer: push, pull_fallback, recompute, local.

    ``local``: D's answer carries no transfer summary (D computed the prompt itself after a
    refused admission or a malformed request). Streaming answers: ``unknown`` (see metrics).
    """
    if rec.stream:
        return "unknown"
    if rec.kvpush is None:
        return "local"
    outcome = str(rec.kvpush.get("outcome", ""))
    if outcome in ("pushed", "retried"):
        return "push"
    if outcome == "pull_fallback":
        return "pull_fallback"
    if outcome == "failed":
        return "recompute"  # the receive failed and D answered anyway: it recomputed
    return outcome or "local"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass
class Tally:
    """Per-request classification of a run."""

    sent: int = 0
    correct: int = 0
    wrong_tokens: int = 0
    failed_clear: int = 0
    failed_unclear: int = 0
    hung: int = 0
    cancelled: int = 0
    unchecked: int = 0  # successful, but no reference answer could be had
    served: dict[str, int] = field(default_factory=dict)  # non-streaming successes
    classes: dict[int, str] = field(default_factory=dict)  # request idx -> its class
    streamed_ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # clear errors by short message
    unclear: list[dict[str, Any]] = field(default_factory=list)
    unclear_kinds: dict[str, int] = field(default_factory=dict)
    wrong: list[dict[str, Any]] = field(default_factory=list)
    hung_samples: list[dict[str, Any]] = field(default_factory=list)


def _short(rec: Record) -> str:
    msg = rec.error
    try:
        body = json.loads(msg)
        if isinstance(body, dict):
            err = body.get("error", body)
            msg = str(err.get("message", err) if isinstance(err, dict) else err)
    except ValueError:
        pass
    return f"{rec.status or rec.error_kind}: {msg[:140]}"


def describe_wrong(w: dict[str, Any]) -> str:
    """One line on a wrong answer: which request, how it was served, where it first differs."""
    got, expected = str(w.get("got", "")), str(w.get("expected", ""))
    at = next(
        (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b),
        min(len(got), len(expected)),
    )
    return (
        f"#{w.get('idx')} phase={w.get('phase')} request={w.get('request_id')} "
        f"prompt_len={w.get('prompt_len')} stream={w.get('stream')} "
        f"kvpush={w.get('kvpush')} differs at char {at}: "
        f"got {got[max(0, at - 20) : at + 40]!r}, expected {expected[max(0, at - 20) : at + 40]!r}"
    )


def tally(records: list[Record], references: dict[int, str | None]) -> Tally:
    """Classify every record; ``references[idx]`` is the reference text (None: unavailable).

    Classes: correct, wrong_tokens, unchecked, failed_clear, failed_unclear, hung, cancelled.
    """
    t = Tally(sent=len(records))
    for rec in records:
        cls = _classify(t, rec, references)
        t.classes[rec.idx] = cls
    return t


def _classify(t: Tally, rec: Record, references: dict[int, str | None]) -> str:
    if rec.error_kind == "cancelled":
        t.cancelled += 1
        return "cancelled"
    if rec.error_kind == "timeout":
        t.hung += 1
        if len(t.hung_samples) < 10:
            t.hung_samples.append(rec.to_json())
        return "hung"
    if rec.ok:
        ref = references.get(rec.idx)
        if ref is None:
            t.unchecked += 1
            cls = "unchecked"
        elif rec.text == ref:
            t.correct += 1
            cls = "correct"
        else:
            t.wrong_tokens += 1
            if len(t.wrong) < 10:
                t.wrong.append({**rec.to_json(), "got": rec.text[:200], "expected": ref[:200]})
            return "wrong_tokens"
        if rec.stream:
            t.streamed_ok += 1
        else:
            how = served_by(rec)
            t.served[how] = t.served.get(how, 0) + 1
        return cls
    if clear_error(rec):
        t.failed_clear += 1
        key = _short(rec)
        t.errors[key] = t.errors.get(key, 0) + 1
        return "failed_clear"
    t.failed_unclear += 1
    if len(t.unclear) < 10:
        t.unclear.append(rec.to_json())
    key = f"unclear {rec.error_kind}: {rec.error[:120]}"
    t.unclear_kinds[key] = t.unclear_kinds.get(key, 0) + 1
    return "failed_unclear"


def attribute_streaming(t: Tally, consumer: dict[str, float]) -> dict[str, int]:
    """How the streaming successes were served, from D's transfer counters.

    ``consumer`` holds the increases of ``kvpush_transfers_total{role="consumer"}`` by outcome
    over the run; the non-streaming answers' exact outcomes are subtracted, the rest is
    attributed to the streaming successes (push first, then pull, then recompute).
    """
    left = t.streamed_ok
    out = {"push": 0, "pull_fallback": 0, "recompute": 0, "unknown": 0}
    pushed = consumer.get("pushed", 0) + consumer.get("retried", 0) - t.served.get("push", 0)
    pulled = consumer.get("pull_fallback", 0) - t.served.get("pull_fallback", 0)
    recomputed = (
        consumer.get("recompute", 0) - t.served.get("recompute", 0) - t.served.get("local", 0)
    )
    for key, n in (("push", pushed), ("pull_fallback", pulled), ("recompute", recomputed)):
        take = max(0, min(left, int(n)))
        out[key] = take
        left -= take
    out["unknown"] = left
    return out


@dataclass
class Report:
    """Everything a scenario found, and the verdict."""

    scenario: str
    options: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    table: dict[str, Any] = field(default_factory=dict)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        return bool(ok)

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def verdict_line(self) -> str:
        t = self.table
        summary = (
            f"{t.get('sent', 0)} sent, {t.get('push', 0)} push, "
            f"{t.get('pull_fallback', 0)} pull fallback, {t.get('recompute', 0)} recompute, "
            f"{t.get('failed_clear', 0)} failed (clear), {t.get('hung', 0)} hung, "
            f"{t.get('wrong_tokens', 0)} wrong tokens, {t.get('leaked_blocks', 0)} leaked "
            f"blocks"
        )
        if self.passed:
            return f"VERDICT: PASS: {self.scenario}: {summary}"
        failed = "; ".join(f"{c.name}: {c.detail}" for c in self.checks if not c.ok)
        return f"VERDICT: FAIL: {self.scenario}: {failed or 'no check ran'} ({summary})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "verdict": "PASS" if self.passed else "FAIL",
            "verdict_line": self.verdict_line(),
            "table": self.table,
            "checks": [c.as_dict() for c in self.checks],
            "events": self.events,
            "options": self.options,
            **self.data,
        }


def table_markdown(reports: list[dict[str, Any]]) -> str:
    """The chaos table of several reports (their ``as_dict()``), as Markdown."""
    head = "| scenario | verdict | " + " | ".join(TABLE_COLUMNS) + " |"
    sep = "|" + "---|" * (len(TABLE_COLUMNS) + 2)
    rows = [head, sep]
    for r in reports:
        t = r.get("table", {})
        rows.append(
            f"| {r['scenario']} | {r['verdict']} | "
            + " | ".join(str(t.get(c, "")) for c in TABLE_COLUMNS)
            + " |"
        )
    return "\n".join(rows)


@dataclass
class Kill:
    """One engine killed under load: when, and how many requests it could have taken along.

    ``in_flight`` is the most requests that had a leg on ``engine`` at that moment: the
    larger of the router's legs open to it (read just before and just after the kill) and
    the engine's own running + waiting requests (read just before)."""

    engine: str
    at: float  # seconds since the load began (the records' clock), just before the kill
    in_flight: int
    until: float | None = None  # when the kill returned (its whole tree gone); None: ``at``

    @property
    def end(self) -> float:
        return self.at if self.until is None else self.until

    def as_dict(self) -> dict[str, Any]:
        return {
            "engine": self.engine,
            "at": round(self.at, 3),
            "until": round(self.end, 3),
            "in_flight": self.in_flight,
        }


def failures_beyond_kills(records: list[Record], kills: list[Kill]) -> list[str]:
    """Why the failed requests are more than the kills explain (empty: they are not).

    With several engines per role a kill may cost only the requests that had a leg on the
    victim: a failed request must have been in flight at some kill (started before it, ended
    after it), and each kill may account for at most its ``in_flight``. A request sent while
    the victim was down must not fail (the router routes around a dead engine). Cancelled
    and hung requests are judged elsewhere."""
    failed = [r for r in records if not r.ok and r.error_kind not in ("cancelled", "timeout")]
    problems: list[str] = []
    charged = {id(k): 0 for k in kills}
    for rec in failed:
        at = [k for k in kills if rec.started <= k.end and rec.ended >= k.at]
        if not at:
            problems.append(
                f"request #{rec.idx} ({rec.phase}) failed without a kill while "
                f"it ran ({rec.started:.1f}-{rec.ended:.1f} s): "
                f"{rec.status or rec.error_kind} {rec.error[:160]}"
            )
            continue
        charged[id(at[0])] += 1  # in flight at several kills: counts against the first
    for k in kills:
        if charged[id(k)] > k.in_flight:
            problems.append(
                f"{charged[id(k)]} requests failed at the kill of {k.engine} "
                f"({k.at:.1f} s), but only {k.in_flight} were in flight on it"
            )
    return problems
