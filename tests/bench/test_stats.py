"""Benchmark statistics: percentiles, TPOT as vLLM bench defines it, histogram deltas."""

from __future__ import annotations

import math

import pytest

from kvpush_prod.bench.stats import Sample, histogram_delta, percentile, ratio, summarise


@pytest.mark.parametrize("q", [0, 10, 50, 90, 99, 100])
def test_percentile_interpolates_like_numpy(q):
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    ys = sorted(xs)
    pos = (len(ys) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    assert percentile(xs, q) == pytest.approx(ys[lo] + (ys[hi] - ys[lo]) * (pos - lo))


def test_percentile_of_nothing_is_none_and_of_one_is_it():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0


def test_tpot_is_latency_after_first_token_over_remaining_tokens():
    s = Sample(ok=True, ttft=0.1, latency=0.73, itl=(0.01,) * 63, output_tokens=64)
    assert s.tpot == pytest.approx(0.63 / 63)
    assert Sample(True, 0.1, 0.1, (), 1).tpot is None


def test_summarise_counts_errors_and_reports_ms_and_throughput():
    good = Sample(True, 0.020, 0.100, (0.01, 0.02), 3)
    bad = Sample(False, None, 0.5, (), 0, "HTTP 503")
    out = summarise([good, good, bad], wall_s=2.0)
    assert out["ok"] == 2 and out["errors"] == 1 and out["first_error"] == "HTTP 503"
    assert out["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert out["tpot_ms"]["p50"] == pytest.approx(40.0)
    assert out["itl_ms"]["p99"] == pytest.approx(20.0, rel=0.02)
    assert out["throughput_tok_s"] == pytest.approx(3.0)


def _hist(name, buckets, count, total):
    out = {(name + "_bucket", (("le", le),)): v for le, v in buckets.items()}
    out[(name + "_count", ())] = count
    out[(name + "_sum", ())] = total
    return out


def test_histogram_delta_subtracts_scrapes_and_interpolates_quantiles():
    name = "vllm:nixl_xfer_time_seconds"
    before = _hist(name, {"0.001": 1, "0.005": 1, "0.01": 1, "+Inf": 1}, 1, 0.0005)
    after = _hist(name, {"0.001": 1, "0.005": 9, "0.01": 11, "+Inf": 11}, 11, 0.0405)
    d = histogram_delta(before, after, name)
    assert d["count"] == 10 and d["mean_s"] == pytest.approx(0.004)
    # 8 of 10 new observations in (1 ms, 5 ms]: the median is inside that bucket.
    assert 0.001 < d["p50_s"] < 0.005
    assert histogram_delta(after, after, name) is None


def test_ratio_is_none_when_either_side_is_missing():
    assert ratio(1.0, 2.0) == 0.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0.0) is None
