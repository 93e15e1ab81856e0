"""The chaos harness without engines: workload, request classification, verdict, counters
across restarts, and the load generator against a scripted fake router.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from kvpush_prod.chaos.load import LoadGenerator, Record
from kvpush_prod.chaos.observe import TRANSFERS, Observer, Reading, idle_problems, role_of
from kvpush_prod.chaos.verdict import (
    Kill,
    Report,
    attribute_streaming,
    clear_error,
    failures_beyond_kills,
    tally,
)
from kvpush_prod.chaos.workload import Mix, make_request, workload


def _rec(**kw: Any) -> Record:
    base: dict[str, Any] = {
        "idx": 0,
        "phase": "p",
        "stream": False,
        "chat": False,
        "prompt_len": 10,
        "max_tokens": 4,
        "started": 0.0,
    }
    base.update(kw)
    return Record(**base)


# ------------------------------------------------------------------ workload


def test_workload_is_deterministic_by_seed_and_index() -> None:
    a = [s for _, s in zip(range(20), workload(3, Mix()), strict=False)]
    b = [make_request(i, 3, Mix()) for i in range(20)]
    assert a == b
    assert make_request(0, 4, Mix()) != a[0]


def test_workload_prompts_differ_from_their_first_block_and_respect_the_mix() -> None:
    mix = Mix(min_prompt=100, max_prompt=300, min_tokens=16, max_tokens=32)
    specs = [make_request(i, 0, mix) for i in range(200)]
    heads = {" ".join(s.prompt.split()[:16]) for s in specs}
    assert len(heads) == len(specs)  # no prefix-cache hit by accident, even at block size 16
    for s in specs:
        assert len(s.prompt.split()) == s.prompt_len
        assert 100 <= s.prompt_len <= 300 and 16 <= s.max_tokens <= 32
    assert any(s.stream for s in specs) and any(not s.stream for s in specs)


def test_cancel_plans_mix_times_and_token_counts() -> None:
    mix = Mix(stream_fraction=0.5, cancel_fraction=1.0, cancel_max_s=1.0)
    specs = [make_request(i, 0, mix) for i in range(200)]
    assert all((s.cancel_after is None) != (s.cancel_after_tokens is None) for s in specs)
    assert any(s.cancel_after_tokens for s in specs)
    assert all(s.stream for s in specs if s.cancel_after_tokens)
    assert all(0 <= (s.cancel_after or 0) <= 1.0 for s in specs)


# ------------------------------------------------------------------ classification


def test_clear_errors_need_a_status_and_a_message() -> None:
    body = json.dumps({"error": {"message": "no healthy prefill backend", "code": 503}})
    assert clear_error(_rec(status=503, error_kind="http", error=body))
    assert clear_error(_rec(status=502, error_kind="sse", error='{"message": "x"}'))
    assert not clear_error(_rec(status=500, error_kind="http", error=""))
    assert not clear_error(
        _rec(status=500, error_kind="http", error=json.dumps({"error": {"message": ""}}))
    )
    assert not clear_error(_rec(status=200, error_kind="truncated", error="no [DONE]"))
    assert not clear_error(_rec(status=0, error_kind="transport", error="ReadError"))


def test_tally_classifies_every_request_once() -> None:
    records = [
        _rec(idx=0, status=200, text="a b", kvpush={"outcome": "pushed"}),
        _rec(idx=1, status=200, text="a c", kvpush={"outcome": "pushed"}),  # wrong
        _rec(idx=2, status=200, text="x", kvpush={"outcome": "failed"}),  # recomputed
        _rec(idx=3, status=200, text="y"),  # no summary: local compute
        _rec(idx=4, status=200, text="z", stream=True, done_marker=True),
        _rec(
            idx=5,
            status=200,
            text="z",
            stream=True,
            done_marker=False,
            error_kind="truncated",
            error="the stream ended without [DONE]",
        ),
        _rec(idx=6, status=503, error_kind="http", error='{"error": {"message": "down"}}'),
        _rec(idx=7, error_kind="timeout", error="no answer"),
        _rec(idx=8, error_kind="cancelled", error="cancelled by the client"),
        _rec(idx=9, status=200, text="q", kvpush={"outcome": "pull_fallback"}),
    ]
    refs = {0: "a b", 1: "a b", 2: "x", 3: "y", 4: "z", 9: "q"}
    t = tally(records, refs)
    assert (
        t.sent,
        t.correct,
        t.wrong_tokens,
        t.failed_clear,
        t.failed_unclear,
        t.hung,
        t.cancelled,
    ) == (10, 5, 1, 1, 1, 1, 1)
    assert t.served == {"push": 1, "recompute": 1, "local": 1, "pull_fallback": 1}
    assert t.streamed_ok == 1
    assert t.wrong[0]["idx"] == 1


def test_streaming_successes_are_attributed_from_the_consumer_counters() -> None:
    t = tally(
        [_rec(idx=i, status=200, text="t", stream=True, done_marker=True) for i in range(5)]
        + [_rec(idx=9, status=200, text="t", kvpush={"outcome": "pushed"})],
        {i: "t" for i in (0, 1, 2, 3, 4, 9)},
    )
    got = attribute_streaming(t, {"pushed": 3, "retried": 1, "pull_fallback": 1, "recompute": 7})
    assert got == {"push": 3, "pull_fallback": 1, "recompute": 1, "unknown": 0}


def test_report_verdict_line_names_the_failed_checks() -> None:
    r = Report("demo", {})
    r.table = {"sent": 3, "push": 2, "hung": 1}
    r.check("no hang", False, "1 hung past 120 s")
    r.check("tokens", True)
    line = r.verdict_line()
    assert line.startswith("VERDICT: FAIL: demo: no hang: 1 hung past 120 s")
    assert "3 sent, 2 push" in line
    assert not r.passed
    assert Report("empty", {}).verdict_line().startswith("VERDICT: FAIL")


def test_idle_problems_name_the_engine_and_the_series() -> None:
    d = Reading("decode", 0.0, True, blocks=3, active=0, credits=None, kv_usage=0.2)
    probs = idle_problems(d, 0.0)
    assert "decode: kvpush_connector_blocks=3" in probs
    assert any("kvpush_credits_in_use_blocks not exported" in p for p in probs)
    assert any("kv_cache_usage_perc=0.2000" in p for p in probs)
    assert idle_problems(Reading("prefill", 0.0, False), 0.0) == []


def test_every_decode_engine_of_many_is_checked_for_credits_left() -> None:
    assert [role_of(n) for n in ("decode", "decode-1", "prefill", "prefill-1")] == [
        "decode",
        "decode",
        "prefill",
        "prefill",
    ]
    d1 = Reading("decode-1", 0.0, True, blocks=0, active=0, credits=4, kv_usage=0.0)
    assert idle_problems(d1, 0.0) == ["decode-1: kvpush_credits_in_use_blocks=4"]
    p1 = Reading("prefill-1", 0.0, True, blocks=0, active=0, credits=None, kv_usage=0.0)
    assert idle_problems(p1, 0.0) == []


def _failed(idx: int, started: float, ended: float) -> Any:
    return _rec(
        idx=idx,
        started=started,
        ended=ended,
        status=502,
        error_kind="http",
        error='{"error": {"message": "decode leg failed"}}',
    )


def test_failures_in_flight_at_a_kill_are_allowed_up_to_its_count() -> None:
    kills = [
        Kill("decode-1", at=10.0, in_flight=2, until=10.2),
        Kill("prefill-1", at=50.0, in_flight=1),
    ]
    ok = [_rec(idx=0, status=200, started=9.0, ended=12.0)]
    # Two failures spanning the first kill (one started while the kill ran), one the second.
    assert (
        failures_beyond_kills(
            ok + [_failed(1, 8.0, 10.5), _failed(2, 10.1, 10.4), _failed(3, 49.0, 51.0)], kills
        )
        == []
    )
    # A third failure at the first kill is one more than were in flight on the victim.
    too_many = failures_beyond_kills(
        [_failed(1, 8.0, 10.5), _failed(2, 9.0, 11.0), _failed(4, 9.5, 10.3)], kills
    )
    assert too_many == [
        "3 requests failed at the kill of decode-1 (10.0 s), but only 2 were in flight on it"
    ]
    # A request sent while the victim was down must not fail (the other engines serve it).
    later = failures_beyond_kills([_failed(5, 20.0, 21.0)], kills)
    assert len(later) == 1 and later[0].startswith("request #5 (p) failed without a kill")
    # Hung and cancelled requests are judged by their own checks.
    assert (
        failures_beyond_kills(
            [
                _rec(idx=6, error_kind="timeout", started=20.0),
                _rec(idx=7, error_kind="cancelled", started=20.0),
            ],
            kills,
        )
        == []
    )


# ------------------------------------------------------------------ counters across restarts


def _samples(start: float, pushed: float) -> dict[Any, float]:
    return {
        ("process_start_time_seconds", ()): start,
        (TRANSFERS, (("outcome", "pushed"), ("role", "consumer"))): pushed,
    }


def test_counter_increases_survive_an_engine_restart() -> None:
    obs = Observer(cluster=None, engines=("decode",))  # type: ignore[arg-type]
    obs._ingest("decode", _samples(100.0, 10))  # baseline: not counted
    obs._ingest("decode", _samples(100.0, 14))  # +4
    obs._ingest("decode", None)  # killed: no scrape
    obs._ingest("decode", _samples(200.0, 3))  # a new process: +3 from zero
    obs._ingest("decode", _samples(200.0, 5))  # +2
    assert obs.increase("decode", TRANSFERS, role="consumer", outcome="pushed") == 9
    assert obs.tracks["decode"].restarts_seen == 1
    assert obs.missing_scrapes["decode"] == 1


# ------------------------------------------------------------------ the load generator


class FakeRouter:
    """Answers by prompt: 'ok', 'stream-ok', 'truncated', 'sse-error', 'down', 'slow'."""

    def __init__(self) -> None:
        self.inflight = 0
        self.max_inflight = 0
        self.mode = "ok"

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(0.01)
            mode = self.mode
            if mode == "down":
                return httpx.Response(503, json={"error": {"message": "no healthy prefill"}})
            if mode == "slow":
                await asyncio.sleep(5)
            if not body.get("stream"):
                reason = "abort" if mode == "abort" else "length"
                return httpx.Response(
                    200,
                    json={
                        "choices": [
                            {"text": "" if mode == "abort" else " w1 w2", "finish_reason": reason}
                        ],
                        "usage": {"prompt_tokens": 3},
                    },
                )
            events = [{"choices": [{"text": f" w{i}"}]} for i in range(5)]
            lines = [f"data: {json.dumps(e)}\n\n" for e in events]
            if mode == "truncated":
                lines = lines[:2]
            elif mode == "sse-error":
                lines = lines[:1] + [f"data: {json.dumps({'error': {'message': 'boom'}})}\n\n"]
            else:
                lines.append("data: [DONE]\n\n")
            return httpx.Response(
                200, content="".join(lines).encode(), headers={"content-type": "text/event-stream"}
            )
        finally:
            self.inflight -= 1


def _gen(router: FakeRouter, n: int, mix: Mix, **kw: Any) -> LoadGenerator:
    return LoadGenerator(
        "http://router",
        workload(0, mix),
        concurrency=kw.pop("c", 4),
        limit=n,
        log=lambda m: None,
        transport=httpx.MockTransport(router),
        **kw,
    )


def test_generator_records_answers_and_respects_concurrency() -> None:
    router = FakeRouter()
    gen = _gen(router, 12, Mix(min_prompt=5, max_prompt=10, stream_fraction=0.5))
    records = asyncio.run(gen.run())
    assert len(records) == 12 and all(r.ok for r in records)
    assert router.max_inflight <= 4
    assert all(r.text == " w0 w1 w2 w3 w4" for r in records if r.stream)
    assert all(r.text == " w1 w2" and r.prompt_tokens == 3 for r in records if not r.stream)


def test_generator_flags_truncated_streams_and_stream_errors() -> None:
    mix = Mix(min_prompt=5, max_prompt=10, stream_fraction=1.0)
    for mode, kind in (("truncated", "truncated"), ("sse-error", "sse")):
        router = FakeRouter()
        router.mode = mode
        records = asyncio.run(_gen(router, 3, mix).run())
        assert [r.error_kind for r in records] == [kind] * 3


def test_a_200_that_says_abort_is_an_unclear_failure_not_an_answer() -> None:
    router = FakeRouter()
    router.mode = "abort"
    records = asyncio.run(
        _gen(router, 2, Mix(min_prompt=5, max_prompt=10, stream_fraction=0.0)).run()
    )
    assert [r.error_kind for r in records] == ["aborted", "aborted"]
    t = tally(records, {r.idx: " w1 w2" for r in records})
    assert (t.wrong_tokens, t.failed_unclear, t.failed_clear) == (0, 2, 0)
    assert set(t.classes.values()) == {"failed_unclear"}


def test_generator_counts_a_request_past_the_bound_as_hung() -> None:
    router = FakeRouter()
    router.mode = "slow"
    records = asyncio.run(_gen(router, 2, Mix(min_prompt=5, max_prompt=10), timeout=0.2).run())
    assert [r.error_kind for r in records] == ["timeout", "timeout"]


def test_generator_probes_one_at_a_time_during_an_outage() -> None:
    router = FakeRouter()
    router.mode = "down"
    gen = _gen(router, 6, Mix(min_prompt=5, max_prompt=10), c=4, probe_interval=0.05)

    async def go() -> list[Record]:
        task = asyncio.create_task(gen.run())
        await gen.wait_done(5)
        assert gen.outage
        router.mode = "ok"
        return await task

    records = asyncio.run(go())
    assert records[-1].ok and not gen.outage
    # After the first 503s, requests go one at a time.
    starts = sorted(r.started for r in records if r.started > records[3].ended)
    assert all(b - a >= 0.04 for a, b in zip(starts, starts[1:], strict=False))


def test_generator_cancels_after_some_streamed_tokens() -> None:
    router = FakeRouter()
    mix = Mix(
        min_prompt=5,
        max_prompt=10,
        stream_fraction=1.0,
        cancel_fraction=1.0,
        cancel_tokens_fraction=1.0,
        min_tokens=4,
        max_tokens=6,
    )
    records = asyncio.run(_gen(router, 4, mix).run())
    assert all(r.error_kind == "cancelled" and "tokens" in r.error for r in records)
    assert all(r.first_byte is not None for r in records)
