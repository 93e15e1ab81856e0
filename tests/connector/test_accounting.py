"""Every transfer ends once: per engine, kvpush_transfers_started_total equals the transfers
ended (every outcome) plus kvpush_transfers_active once quiet, and differs by at most the
transfers in flight while busy (docs/metrics.md, "Accounting").

The scheduler-side halves are fed as vLLM's scheduler calls them; a receive or push handed
to the workers is ended there once per rank (its counting is tests/connector/test_pump.py's),
which the books below stand for.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvpush_prod.config import KvpushConfig, config_from_extra
from kvpush_prod.connector.scheduler import (
    ConsumerSide,
    ProducerSide,
    SchedulerSide,
    scheduler_side,
)
from kvpush_prod.core.vocabulary import Side
from kvpush_prod.metrics import OUTCOME_GROUPS, OUTCOMES, TABLES

BS = 16
PREFILL = {
    "do_remote_prefill": True,
    "remote_engine_id": "prefill-0",
    "remote_host": "10.0.0.1",
    "remote_port": 15500,
    "tp_size": 1,
}
DECODE = {"do_remote_decode": True}


def request(rid: str, prompt: int, params: dict[str, Any] | None) -> Any:
    return SimpleNamespace(
        request_id=rid,
        num_prompt_tokens=prompt,
        num_computed_tokens=0,
        kv_transfer_params=params,
        prompt_token_ids=list(range(prompt)),
    )


def output(**kw: Any) -> Any:
    base: dict[str, Any] = {
        "finished_sending": None,
        "finished_recving": None,
        "failed_recving": None,
        "kv_connector_worker_meta": None,
    }
    return SimpleNamespace(**{**base, **kw})


class Books:
    """One engine's counters summed over its drains, with what its workers ended."""

    def __init__(self, side: SchedulerSide, tp: int) -> None:
        self.side, self.tp = side, tp
        self.counters: dict[tuple[str, ...], float] = {}
        self.worker_ended = 0  # receives/pushes handed over, each ended once per rank
        self.active = 0.0

    def step(self, scheduled: dict[str, int] | None = None) -> Any:
        """One engine step: the metadata built (what goes to the workers), stats drained."""
        meta = self.side.build_connector_meta(
            SimpleNamespace(num_scheduled_tokens=scheduled or {})  # type: ignore[arg-type]
        )
        self.worker_ended += (len(meta.recv) + len(meta.send)) * self.tp
        self.look()
        return meta

    def look(self) -> None:
        data = self.side.get_stats()
        for name, labels, v in data.get("c", []):
            key = (name, *labels)
            self.counters[key] = self.counters.get(key, 0.0) + v
        gauges = self.side.stats.gauge_values()
        self.active = gauges[("kvpush_transfers_active", (self.side.role,))]

    @property
    def started(self) -> float:
        return self.counters.get(("kvpush_transfers_started", self.side.role), 0.0)

    @property
    def ended(self) -> float:
        return self.worker_ended + sum(
            self.counters.get(("kvpush_transfers", self.side.role, o), 0.0) for o in OUTCOMES
        )

    def check_quiet(self) -> None:
        self.look()
        assert self.active == 0
        assert self.started == self.ended + self.active, self.counters


def d_books(tp: int = 1, budget: float = 0.5) -> tuple[ConsumerSide, Books]:
    cfg = config_from_extra({"credits": {"budget_fraction": budget}})
    side = scheduler_side(cfg, Side.CONSUMER, "decode-0", BS, 1000, tp, 0, 100)
    assert isinstance(side, ConsumerSide)
    return side, Books(side, tp)


def p_books(tp: int = 1) -> tuple[ProducerSide, Books]:
    side = scheduler_side(KvpushConfig(), Side.PRODUCER, "prefill-0", BS, 1000, tp, 0, 100)
    assert isinstance(side, ProducerSide)
    side.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda rid: (list(range(10)),)))
    return side, Books(side, tp)


def allocate(d: ConsumerSide, req: Any, n: int, external: int) -> None:
    blocks = SimpleNamespace(get_block_ids=lambda: (list(range(n)),))
    d.update_state_after_alloc(req, blocks, external)  # type: ignore[arg-type]


def params(tid: str) -> dict[str, Any]:
    return {**PREFILL, "transfer_id": tid}


# --------------------------------------------------------------------------- D: each path


def d_received(d: ConsumerSide, books: Books) -> None:
    req = request("r", 48, params("t1"))
    assert d.get_num_new_matched_tokens(req, 0) == (48, True)
    allocate(d, req, 3, 48)
    books.step()
    assert books.started - books.ended <= books.active  # in flight: its workers end it
    d.update_connector_output(output(finished_recving={"r"}))
    d.request_finished(req, [])


def d_prefix_hit(d: ConsumerSide, books: Books) -> None:
    req = request("r", 64, params("t1"))
    assert d.get_num_new_matched_tokens(req, 64) == (0, False)
    d.request_finished(req, [])


def d_over_the_budget(d: ConsumerSide, books: Books) -> None:
    req = request("r", 1600, params("t1"))  # 100 blocks, the budget is 50
    assert d.get_num_new_matched_tokens(req, 0) == (0, False)
    d.request_finished(req, [])


def d_aborted_while_waiting_and_aborted_while_receiving(d: ConsumerSide, books: Books) -> None:
    big = request("big", 800, params("t0"))  # the whole budget
    assert d.get_num_new_matched_tokens(big, 0) == (800, True)
    req = request("r", 48, params("t1"))
    assert d.get_num_new_matched_tokens(req, 0) == (None, False)  # waits for credit
    allocate(d, big, 50, 800)
    books.step()
    assert books.active == 2
    d.request_finished(req, [])  # aborted while waiting: ends here
    d.request_finished(big, [])  # aborted while receiving: its workers end it
    books.step()
    d.update_connector_output(output(finished_recving={"big"}))


def d_refused_params_and_a_duplicate_transfer_id(d: ConsumerSide, books: Books) -> None:
    bad = request("bad", 48, {**PREFILL, "remote_port": 0})
    assert d.get_num_new_matched_tokens(bad, 0) == (0, False)  # never started
    first = request("r", 48, params("t1"))
    assert d.get_num_new_matched_tokens(first, 0) == (48, True)
    dup = request("dup", 48, params("t1"))
    assert d.get_num_new_matched_tokens(dup, 0) == (0, False)  # refused: never started
    allocate(d, first, 3, 48)
    books.step()
    d.update_connector_output(output(finished_recving={"r"}, failed_recving={"r"}))
    for r in (bad, first, dup):
        d.request_finished(r, [])


def d_hooks_that_raised(d: ConsumerSide, books: Books) -> None:
    asked = request("a", 48, params("t1"))
    d.get_num_new_matched_tokens(asked, 0)
    d.after_failed_ask(asked)  # computes its prompt
    alloc = request("b", 48, params("t2"))
    d.get_num_new_matched_tokens(alloc, 0)
    d.after_failed_alloc(alloc, 48)  # its receive fails here
    finish = request("c", 48, params("t3"))
    d.get_num_new_matched_tokens(finish, 0)
    d.after_failed_finish(finish)  # aborted before its blocks were allocated


D_PATHS: list[Callable[[ConsumerSide, Books], None]] = [
    d_received,
    d_prefix_hit,
    d_over_the_budget,
    d_aborted_while_waiting_and_aborted_while_receiving,
    d_refused_params_and_a_duplicate_transfer_id,
    d_hooks_that_raised,
]


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("path", D_PATHS, ids=lambda f: f.__name__)
def test_every_transfer_d_starts_ends_once(
    path: Callable[[ConsumerSide, Books], None], tp: int
) -> None:
    d, books = d_books(tp)
    path(d, books)
    books.step()
    books.check_quiet()
    assert books.started > 0


def test_refused_params_never_start_a_transfer() -> None:
    d, books = d_books()
    d.get_num_new_matched_tokens(request("bad", 48, {**PREFILL, "remote_port": 0}), 0)
    d.get_num_new_matched_tokens(request("direct", 48, None), 0)
    books.check_quiet()
    assert books.started == 0


# --------------------------------------------------------------------------- P: each path


def p_pushed(p: ProducerSide, books: Books) -> None:
    req = request("r", 40, {**DECODE, "transfer_id": "t1"})
    p.on_new_request(req)
    books.step({"r": 40})
    assert books.started - books.ended <= books.active
    p.request_finished(req, [0, 1, 2])
    books.step()
    p.update_connector_output(output(finished_sending={"r"}))


def p_ended_before_its_prompt(p: ProducerSide, books: Books) -> None:
    req = request("r", 40, {**DECODE, "transfer_id": "t1"})
    p.on_new_request(req)
    books.step()
    p.request_finished(req, [])
    raised = request("q", 40, {**DECODE, "transfer_id": "t2"})
    p.on_new_request(raised)
    p.after_failed_finish(raised)


def p_refused_and_duplicate(p: ProducerSide, books: Books) -> None:
    first = request("r", 40, {**DECODE, "transfer_id": "t1"})
    p.on_new_request(first)
    dup = request("dup", 40, {**DECODE, "transfer_id": "t1"})
    p.on_new_request(dup)  # refused: never started
    books.step({"r": 40})
    p.request_finished(first, [0, 1, 2])
    p.request_finished(dup, [])
    p.update_connector_output(output(finished_sending={"r"}))


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize(
    "path", [p_pushed, p_ended_before_its_prompt, p_refused_and_duplicate], ids=lambda f: f.__name__
)
def test_every_transfer_p_starts_ends_once(
    path: Callable[[ProducerSide, Books], None], tp: int
) -> None:
    p, books = p_books(tp)
    path(p, books)
    books.step()
    books.check_quiet()
    assert books.started > 0


def test_the_outcome_groups_cover_every_outcome_once() -> None:
    grouped = [o for outs in OUTCOME_GROUPS.values() for o in outs]
    assert sorted(grouped) == sorted(OUTCOMES)
    assert set(OUTCOME_GROUPS) == {"pushed", "pulled", "recomputed", "failed"}


@pytest.mark.parametrize("make", [d_books, p_books], ids=["consumer", "producer"])
def test_the_scheduler_sides_report_their_tables_at_each_step(
    make: Callable[[], tuple[SchedulerSide, Books]],
) -> None:
    side, books = make()
    books.look()
    entries = {
        labels[1]: v
        for (name, labels), v in side.stats.gauge_values().items()
        if name == "kvpush_table_entries"
    }
    assert entries and set(entries) <= set(TABLES)
    assert "trust.nonces" in entries
    assert all(v == 0 for v in entries.values())
    caps = {
        labels[1]: v
        for (name, labels), v in side.stats.gauge_values().items()
        if name == "kvpush_table_capacity"
    }
    assert caps["trust.nonces"] > 0
