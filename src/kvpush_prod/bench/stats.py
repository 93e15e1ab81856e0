"""Latency statistics of one benchmark cell: percentiles of TTFT, TPOT and ITL, throughput,
and histogram deltas of Prometheus series (vLLM's own transfer-time histograms)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile with linear interpolation (numpy's default); None if empty."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def summary_ms(values: Iterable[float]) -> dict[str, float | None]:
    """p50/p90/p99 and mean of values given in seconds, in milliseconds."""
    xs = [v * 1000.0 for v in values]
    out: dict[str, float | None] = {f"p{q}": percentile(xs, q) for q in PERCENTILES}
    out["mean"] = sum(xs) / len(xs) if xs else None
    out["n"] = float(len(xs))
    return out


@dataclass(frozen=True)
class Sample:
    """What the benchmark keeps of one request (times in seconds)."""

    ok: bool
    ttft: float | None
    latency: float
    itl: tuple[float, ...]
    output_tokens: int
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """vLLM bench's definition: (e2e latency - TTFT) / (output tokens - 1)."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def summarise(samples: Sequence[Sample], wall_s: float) -> dict[str, Any]:
    """The cell's numbers: TTFT/TPOT/ITL p50/p90/p99 (ms), throughput, errors."""
    good = [s for s in samples if s.ok and s.ttft is not None]
    out_tokens = sum(s.output_tokens for s in good)
    errors = [s.error for s in samples if not s.ok]
    return {
        "requests": len(samples),
        "ok": len(good),
        "errors": len(errors),
        "first_error": errors[0][:300] if errors else "",
        "ttft_ms": summary_ms(s.ttft for s in good if s.ttft is not None),
        "tpot_ms": summary_ms(t for s in good if (t := s.tpot) is not None),
        "itl_ms": summary_ms(x for s in good for x in s.itl),
        "e2e_ms": summary_ms(s.latency for s in good),
        "wall_s": wall_s,
        "throughput_tok_s": out_tokens / wall_s if wall_s > 0 else None,
        "throughput_req_s": len(good) / wall_s if wall_s > 0 else None,
    }


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def histogram_delta(before: Samples, after: Samples, name: str) -> dict[str, Any] | None:
    """The observations of histogram ``name`` between two scrapes (all label sets summed):
    count, sum, mean and a bucket-interpolated p50/p90 (seconds); None if nothing new."""

    def collect(s: Samples) -> tuple[float, float, dict[float, float]]:
        count = total = 0.0
        buckets: dict[float, float] = {}
        for (n, labels), v in s.items():
            if n == name + "_count":
                count += v
            elif n == name + "_sum":
                total += v
            elif n == name + "_bucket":
                le = dict(labels).get("le", "+Inf")
                edge = math.inf if le in ("+Inf", "inf") else float(le)
                buckets[edge] = buckets.get(edge, 0.0) + v
        return count, total, buckets

    c0, s0, b0 = collect(before)
    c1, s1, b1 = collect(after)
    count = c1 - c0
    if count <= 0:
        return None
    cum = sorted((edge, b1.get(edge, 0.0) - b0.get(edge, 0.0)) for edge in b1)
    out: dict[str, Any] = {"count": count, "sum_s": s1 - s0, "mean_s": (s1 - s0) / count}
    for q in (50, 90):
        out[f"p{q}_s"] = _bucket_quantile(cum, count, q / 100.0)
    return out


def _bucket_quantile(cum: list[tuple[float, float]], count: float, q: float) -> float | None:
    """Prometheus' histogram_quantile on cumulative (edge, count) pairs."""
    rank = q * count
    prev_edge, prev_count = 0.0, 0.0
    for edge, c in cum:
        if c >= rank:
            if math.isinf(edge):
                return prev_edge
            if c == prev_count:
                return edge
            return prev_edge + (edge - prev_edge) * (rank - prev_count) / (c - prev_count)
        prev_edge, prev_count = edge, c
    return None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b
