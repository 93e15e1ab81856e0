"""Scheduler-side half of the PushConnector (runs in vLLM's EngineCore process), one class
per side: D (``ConsumerSide``) admits inbound transfers through the core's admission and
registers reserved blocks; P (``ProducerSide``) marks the requests whose prompt completes in
a step. Both tell their workers through the step's metadata.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush_prod.config import KvpushConfig
from kvpush_prod.config.core import credit_settings
from kvpush_prod.connector.metadata import PeerRef, PushMetadata, RecvSpec, SendSpec
from kvpush_prod.connector.params import (
    RemotePrefill,
    is_probe,
    is_remote_decode,
    transfer_id_of,
)
from kvpush_prod.connector.trust import Trust
from kvpush_prod.core.admission import Admissions, Answer, Inbound, Verdict
from kvpush_prod.core.credits import CreditLedger, Decision
from kvpush_prod.core.digest import prompt_digest
from kvpush_prod.core.vocabulary import (
    SIGNATURE_REASONS,
    Notice,
    Outcome,
    ParamsRejectReason,
    Side,
)
from kvpush_prod.errors import KVTransferParamsError
from kvpush_prod.metrics import StatsBuffer, TableSizes, set_tables

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

_DECISION_LABEL = {Decision.ADMIT: "admit", Decision.LATER: "later", Decision.REFUSE: "refuse"}


def trace_headers_of(request: Request) -> dict[str, str] | None:
    """The request's W3C trace context (``traceparent``/``tracestate``) for transfer spans;
    None without one. Bounded: a client's headers."""
    headers = getattr(request, "trace_headers", None)
    if not headers:
        return None
    out = {
        k: str(v)[:512] for k, v in headers.items() if k.lower() in ("traceparent", "tracestate")
    }
    return out or None


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EngineFacts:
    """What either side's scheduler half is told of its engine."""

    cfg: KvpushConfig
    engine_id: str
    block_size: int
    block_bytes: int  # one block, all layers, one rank
    tp_size: int
    dp_index: int
    trust: Trust | None = None


def scheduler_side(
    cfg: KvpushConfig,
    role: Side,
    engine_id: str,
    block_size: int,
    block_bytes: int,
    tp_size: int,
    dp_index: int,
    num_blocks: int,
    recompute_on_failure: bool = False,
    trust: Trust | None = None,
    dp_size: int = 1,
) -> SchedulerSide:
    """The scheduler-side half for ``role`` (``dp_index`` of ``dp_size`` data-parallel
    engine cores behind one API server)."""
    engine = EngineFacts(cfg, engine_id, block_size, block_bytes, tp_size, dp_index, trust)
    side: SchedulerSide
    if role is Side.CONSUMER:
        side = ConsumerSide(engine, num_blocks, recompute_on_failure)
    else:
        side = ProducerSide(engine)
    side.dp_size = dp_size
    # vLLM runs the data-parallel ranks of a dense model as independent engines and tells
    # them only their index (data_parallel_size is 1 in the engine core); it marks them by
    # suffixing the engine id with _dp<rank>, which is how a rank knows it is one.
    if dp_size > 1 or engine_id.endswith(f"_dp{dp_index}"):
        side.dp_rank = dp_index
    return side


class SchedulerSide:
    """What both sides' scheduler halves share: identity, the step's metadata, stats.

    Each hook is one of vLLM's scheduler-side connector hooks (see ``PushConnector`` for
    what each promises); a side that has nothing to do in one keeps this default.
    """

    side: Side

    def __init__(self, engine: EngineFacts) -> None:
        cfg = self.cfg = engine.cfg
        self.role = self.side.value
        self.engine_id = engine.engine_id
        self.block_size = engine.block_size
        self.block_bytes = engine.block_bytes
        self.tp_size = engine.tp_size
        self.control_host = cfg.control.advertise_host or cfg.control.host
        self.control_port = cfg.control.port + engine.dp_index * engine.tp_size
        self.dp_index = engine.dp_index
        self.dp_size = 1  # set by scheduler_side (1 also when vLLM did not say)
        self.dp_rank: int | None = None  # set by scheduler_side for a data-parallel rank
        self.trust = engine.trust if engine.trust is not None else Trust()
        self.stats = StatsBuffer()
        self._kv_cache_manager: Any = None
        self._meta = PushMetadata()

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    def contained(self, hook: str, rid: str = "") -> None:
        """Log and count what raised in ``hook`` (for request ``rid``); the caller goes on."""
        self.stats.inc("kvpush_hook_errors", (self.role, hook))
        logger.exception(
            "kvpush: %s raised%s; contained, the engine goes on",
            hook,
            f" for request {rid}" if rid else "",
        )

    def take_meta(self) -> PushMetadata:
        """This step's metadata as it stands, and a fresh one for the next step."""
        meta, self._meta = self._meta, PushMetadata()
        return meta

    # What a hook that raised leaves behind is made safe by these (connector.py calls them).
    def after_failed_ask(self, request: Request) -> None:
        """``get_num_new_matched_tokens`` raised: the request computes its prompt locally."""

    def after_failed_alloc(self, request: Request, num_external_tokens: int) -> None:
        """``update_state_after_alloc`` raised."""

    def after_failed_finish(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        """``request_finished`` raised: what to answer vLLM."""
        return False, None

    def identity(self) -> dict[str, Any]:
        """What a router needs to point a decode engine at this prefill engine."""
        out: dict[str, Any] = {
            "remote_engine_id": self.engine_id,
            "remote_host": self.control_host,
            "remote_port": self.control_port,
            "tp_size": self.tp_size,
            "kvpush": True,
        }
        if self.dp_rank is not None:
            # Which of the API server's data-parallel engine cores answers: a router pins
            # the core with vLLM's X-data-parallel-rank header and points D at its port.
            out["dp_rank"] = self.dp_rank
            if self.dp_size > 1:
                out["dp_size"] = self.dp_size
        if self.trust.public_key:
            out["remote_key"] = self.trust.public_key
        return out

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        return None

    def on_new_request(self, request: Request) -> None:
        return None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushMetadata:
        meta = self.take_meta()
        meta.forward = int(getattr(scheduler_output, "total_num_scheduled_tokens", 0) or 0) > 0
        return meta

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        raise NotImplementedError

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        raise NotImplementedError

    def has_pending_push_work(self) -> bool:
        return not self._meta.empty()

    def get_stats(self) -> dict[str, Any]:
        """This step's observations plus the gauges as they stand after the step."""
        self._set_gauges()
        # A few len()s: measured at every drain, so an idle engine's last step has them at rest.
        set_tables(self.stats, self.role, {**self.trust.tables(), **self.tables()})
        return self.stats.drain()

    def started(self, n: int = 1) -> None:
        """Count ``n`` transfers begun (kvpush_transfers_started_total)."""
        self.stats.inc("kvpush_transfers_started", (self.role,), n)

    def handed_to_workers(self) -> None:
        """A transfer goes to the workers: each of the engine's ranks ends it once (and
        counts its outcome), so it counts as started once per rank (once here already)."""
        if self.tp_size > 1:
            self.started(self.tp_size - 1)

    def tables(self) -> TableSizes:
        """Entries of the tables this side keeps per request or transfer (no bound of
        their own: vLLM's requests bound them)."""
        return {}

    def _set_gauges(self) -> None:
        raise NotImplementedError


class ConsumerSide(SchedulerSide):
    """D: admits each request's inbound transfer within the credit budget (the core's
    ``Admissions``), registers its reserved blocks with P, and reports how it arrived."""

    side = Side.CONSUMER

    def __init__(
        self, engine: EngineFacts, num_blocks: int, recompute_on_failure: bool = False
    ) -> None:
        super().__init__(engine)
        self.recompute_on_failure = recompute_on_failure
        self.credits = CreditLedger(credit_settings(engine.cfg, num_blocks, engine.block_bytes))
        self.admissions: Admissions[RemotePrefill] = Admissions(self.credits, engine.block_size)
        self._received: dict[str, dict[str, Any]] = {}  # request id -> what arrived, for the reply
        self._outcomes: dict[str, str] = {}  # request id -> outcome reported by the worker

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        rid = request.request_id
        if self.admissions.is_over(rid):
            return 0, False
        rx = self.admissions.get(rid)
        if rx is None:
            try:
                remote = self.trust.remote_prefill(rid, request.kv_transfer_params)
            except KVTransferParamsError as exc:
                logger.warning("kvpush: request %s computes its prompt locally: %s", rid, exc)
                self.stats.inc("kvpush_kv_params_rejected", (self.role, exc.reason))
                self.admissions.skip(rid)
                return 0, False
            if remote is None:
                return 0, False
            tracked = self.admissions.track(
                rid, remote.transfer_id, f"{remote.host}:{remote.port}", remote
            )
            if tracked is None:
                self._refuse_duplicate(rid, remote.transfer_id)
                return 0, False
            rx = tracked
            self.started()
        answer = self.admissions.ask(
            rid,
            request.num_prompt_tokens,
            num_computed_tokens,
            time.monotonic(),
            self.free_blocks(),
        )
        self._tell(rx, answer)
        if answer.verdict is Verdict.LOAD:
            return answer.tokens, True
        if answer.verdict is Verdict.LATER:
            return None, False
        return 0, False

    def _refuse_duplicate(self, rid: str, tid: str) -> None:
        """``rid`` names the transfer id of another live request: it computes its prompt
        here, and nothing is said to P (the transfer is the other request's)."""
        logger.warning(
            "kvpush: request %s computes its prompt locally: its transfer_id %.60r "
            "is already received by request %s (a replayed leg, or a client that "
            "reuses X-Request-Id; the router gives each request its own)",
            rid,
            tid,
            self.admissions.holder(tid),
        )
        self.stats.inc(
            "kvpush_kv_params_rejected", (self.role, ParamsRejectReason.DUPLICATE_TRANSFER)
        )
        self.admissions.skip(rid)

    def free_blocks(self) -> int | None:
        """Blocks free in D's KV cache now (vLLM's block pool; evictable cached blocks
        count as free, as vLLM's allocator counts them), None before it is bound."""
        manager = self._kv_cache_manager
        pool = getattr(manager, "block_pool", None) if manager is not None else None
        if pool is None:
            return None
        return int(pool.get_num_free_blocks())

    def _tell(self, rx: Inbound[RemotePrefill], answer: Answer) -> None:
        """Count what ``answer`` changed, and put what P must hear in the metadata."""
        if answer.first_admit:
            self.stats.inc("kvpush_admissions", (self.role, "admit"))
            self.stats.inc("kvpush_credits_granted_blocks", (self.role,), answer.nblocks)
        if answer.first_wait:
            self.stats.inc("kvpush_admissions", (self.role, "later"))
        # What P must hear, as the core says it (until admitted, P keeps its blocks for us).
        for notice in answer.notices:
            if notice is not Notice.NOT_NEEDED:
                self._meta.notices.append((_ref(rx), notice))
        if answer.decision is Decision.REFUSE:
            logger.warning(
                "kvpush: request %s needs %d blocks, more than the credit budget "
                "(%s); computing its prompt locally",
                rx.key,
                answer.nblocks,
                answer.reason,
            )
            self.stats.inc("kvpush_admissions", (self.role, _DECISION_LABEL[Decision.REFUSE]))
        if answer.not_needed is not None:
            self._not_needed(rx, answer.not_needed)

    def _not_needed(self, rx: Inbound[RemotePrefill], outcome: Outcome) -> None:
        self._meta.notices.append((_ref(rx), Notice.NOT_NEEDED))
        self.stats.inc("kvpush_transfers", (self.role, outcome.value))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        rid = request.request_id
        rx = self.admissions.get(rid)
        if rx is None or rx.allocated:
            return
        if num_external_tokens <= 0:
            if rx.admitted:
                # vLLM scheduled it without the load (its local hit covers what P would
                # send): nothing will come, the credit returns and P may free.
                self.admissions.drop(rid)
                self._not_needed(rx, Outcome.PREFIX_HIT)
            return
        all_blocks = blocks.get_block_ids()[0]
        d_blocks = list(all_blocks[rx.first_block : rx.first_block + rx.nblocks])
        if len(d_blocks) != rx.nblocks:
            logger.error(
                "kvpush: request %s got %d blocks, expected %d from block %d",
                rid,
                len(all_blocks),
                rx.nblocks,
                rx.first_block,
            )
        remote = rx.remote
        spec = RecvSpec(
            rid,
            rx.transfer_id,
            remote.host,
            remote.port,
            d_blocks,
            rx.first_block,
            request.num_prompt_tokens,
            remote.key,
            trace_headers_of(request),
            remote.tp_size,
            prompt_digest(request.prompt_token_ids),
        )
        # Last, and together: allocated means its REGISTER is in this step's metadata.
        self.admissions.allocated(rid, len(d_blocks))
        self._meta.recv.append(spec)
        self.handed_to_workers()

    def after_failed_ask(self, request: Request) -> None:
        # Nothing was allocated for it: it computes its prompt, P may free, credit returns.
        rid = request.request_id
        rx = self.admissions.get(rid)
        if rx is not None and rx.allocated:
            return  # its receive is under way: it ends (or is aborted) the usual way
        self.admissions.drop(rid)
        if rx is not None:
            self._not_needed(rx, Outcome.RECOMPUTE)

    def after_failed_alloc(self, request: Request, num_external_tokens: int) -> None:
        rid = request.request_id
        if any(spec.request_id == rid for spec in self._meta.recv):
            return  # its REGISTER goes out with this step: the receive runs as usual
        rx = self.admissions.get(rid)
        if rx is not None and rx.allocated:
            return
        self.admissions.drop(rid)
        if rx is not None:
            self._not_needed(rx, Outcome.FAILED)
        if num_external_tokens > 0:
            # vLLM allocated its blocks and waits for the load; no REGISTER left, so no WRITE
            # can land in them: report the receive failed (kv_load_failure_policy applies).
            self._meta.fail_recv.append(rid)

    def after_failed_finish(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        rx = self.admissions.get(rid)
        if rx is None:
            self._received.pop(rid, None)
            return False, None
        if rx.allocated:
            # Blocks registered with P: abort and wait for the fence, as request_finished does.
            if not rx.aborting:
                rx.aborting = True
                self._meta.abort_recv.append(rx.transfer_id)
            return False, None
        self.admissions.drop(rid)
        self._not_needed(rx, Outcome.ABORTED)
        return False, None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        if is_probe(request.kv_transfer_params):
            return False, self.identity()  # a router asks who we are (our key)
        finish = self.admissions.finish(rid)
        rx = finish.rx
        if rx is None:
            summary = self._received.pop(rid, None)
            return False, ({"kvpush": summary} if summary else None)
        if finish.not_needed is not None:
            # Aborted while waiting for admission: P can free now.
            self._not_needed(rx, finish.not_needed)
            return False, None
        # Still waiting for the push: vLLM keeps the blocks until we report the request in
        # finished_recving; the worker cancels P's push and waits for its ack or the fence.
        self._meta.abort_recv.append(rx.transfer_id)
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if worker_meta is not None and hasattr(worker_meta, "outcomes"):
            self._outcomes.update(worker_meta.outcomes)
        failed = output.failed_recving or set()
        for rid in output.finished_recving or ():
            try:
                self._received_one(rid, rid not in failed)
            except Exception:  # noqa: BLE001 - one request's bookkeeping never stops the rest
                self.contained("update_connector_output", rid)

    def _received_one(self, rid: str, ok: bool) -> None:
        """The receive of ``rid`` ended (``ok`` or failed): its credit returns first."""
        rx, _ = self.admissions.ended(rid)
        outcome = self._outcomes.pop(rid, "")
        if rx is None or rx.aborting:
            return
        if ok:
            self.stats.inc("kvpush_transfer_bytes", (self.role,), rx.nblocks * self.block_bytes)
        self._received[rid] = {
            "transfer_id": rx.transfer_id,
            "outcome": (outcome or Outcome.PUSHED.value) if ok else Outcome.FAILED.value,
            "blocks": rx.nblocks if ok else 0,
            "bytes": rx.nblocks * self.block_bytes if ok else 0,
        }

    def has_pending_push_work(self) -> bool:
        return bool(self.admissions.aborting) or super().has_pending_push_work()

    def tables(self) -> TableSizes:
        return {
            **self.admissions.tables(),
            "scheduler.received": (len(self._received), None),
            "scheduler.outcomes": (len(self._outcomes), None),
        }

    def _set_gauges(self) -> None:
        allocated = [rx for rx in self.admissions.entries() if rx.allocated]
        self.stats.set("kvpush_connector_blocks", (self.role,), sum(rx.nblocks for rx in allocated))
        self.stats.set("kvpush_transfers_active", (self.role,), len(self.admissions))
        self.stats.set("kvpush_leases_active", (self.role, "permit"), len(allocated))
        free, pool = self.credits.free, self.free_blocks()
        if pool is not None:
            free = min(free, max(0, pool - self.admissions.promised()))
        self.stats.set("kvpush_credits_budget_blocks", (self.role,), self.credits.in_use + free)
        self.stats.set("kvpush_credits_in_use_blocks", (self.role,), self.credits.in_use)
        self.stats.set("kvpush_credits_waiting_transfers", (self.role,), self.credits.waiting)


def _ref(rx: Inbound[RemotePrefill]) -> PeerRef:
    return PeerRef(rx.transfer_id, rx.remote.host, rx.remote.port, rx.remote.key, rx.remote.tp_size)


class ProducerSide(SchedulerSide):
    """P: marks the requests with ``do_remote_decode`` whose prompt completes in a step, and
    keeps their blocks (``request_finished`` answers True) until the send lease ends."""

    side = Side.PRODUCER

    def __init__(self, engine: EngineFacts) -> None:
        super().__init__(engine)
        self._requests: dict[str, Request] = {}  # P requests with do_remote_decode
        self._owners: dict[str, str] = {}  # P request id -> the decode key the router named
        self._sent: dict[str, tuple[str, int]] = {}  # request id -> (transfer id, nblocks)
        self._held: dict[str, int] = {}  # request id -> blocks held until finished_sending
        # A transfer id is one request's KV: transfer id -> the live request pushing it, and
        # back. A second live request naming it is refused and never touches the first's.
        self._live: dict[str, str] = {}
        self._tid_of: dict[str, str] = {}
        self._refused: set[str] = set()  # requests refused at arrival, until they finish

    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if not is_remote_decode(params) or is_probe(params):
            return
        assert params is not None
        rid = request.request_id
        try:
            owner = self.trust.decode_owner(rid, params)
            tid = transfer_id_of(rid, params)
        except KVTransferParamsError as exc:
            self._refuse(rid, params, exc)
            return
        holder = self._live.get(tid)
        if holder is not None and holder != rid:
            logger.warning(
                "kvpush: request %s will not be pushed: its transfer_id %.60r is "
                "already pushed by request %s (a replayed leg, or a client that "
                "reuses X-Request-Id)",
                rid,
                tid,
                holder,
            )
            self.stats.inc(
                "kvpush_kv_params_rejected", (self.role, ParamsRejectReason.DUPLICATE_TRANSFER)
            )
            self._refused.add(rid)
            return
        self._live[tid], self._tid_of[rid] = rid, tid
        self._requests[rid] = request
        self._owners[rid] = owner
        self._meta.expect_send.append((tid, owner))
        self.started()

    def _refuse(self, rid: str, params: dict[str, Any], exc: KVTransferParamsError) -> None:
        """``rid``'s params were refused: it is not pushed. A decode engine that registers
        its transfer hears at once (and recomputes), but only where the transfer id can be
        believed: never for params that failed the router's signature (their transfer id
        is anyone's word, and may name another request's transfer) nor for a transfer id a
        live request holds."""
        logger.warning("kvpush: request %s will not be pushed: %s", rid, exc)
        self.stats.inc("kvpush_kv_params_rejected", (self.role, exc.reason))
        self._refused.add(rid)
        if self.trust.params_key is not None and exc.reason in SIGNATURE_REASONS:
            return
        with contextlib.suppress(KVTransferParamsError):
            tid = transfer_id_of(rid, params)
            if tid not in self._live:
                self._meta.abort_send.append(tid)

    def _forget(self, rid: str) -> None:
        tid = self._tid_of.pop(rid, None)
        if tid is not None and self._live.get(tid) == rid:
            del self._live[tid]

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushMetadata:
        if self._requests:
            self._collect_sends(scheduler_output)
        return super().build_connector_meta(scheduler_output)

    def _collect_sends(self, so: SchedulerOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            try:
                self._collect_send(rid, n)
            except Exception:  # noqa: BLE001 - one request never stops the others' pushes
                self.contained("build_connector_meta", rid)
                # Not pushed: request_finished frees its blocks and tells D.
                self._requests.pop(rid, None)

    def _collect_send(self, rid: str, n: int) -> None:
        req = self._requests.get(rid)
        if req is None or rid in self._sent:
            return
        if req.num_computed_tokens + n < req.num_prompt_tokens:
            return  # chunked prefill: the prompt completes in a later step
        tid = self._tid_of[rid]
        nblocks = cdiv(req.num_prompt_tokens, self.block_size)
        blocks = list(self._kv_cache_manager.get_block_ids(rid)[0][:nblocks])
        spec = SendSpec(
            rid,
            tid,
            blocks,
            self._owners.get(rid, ""),
            trace_headers_of(req),
            prompt_digest(req.prompt_token_ids),
        )
        # Together: a request in _sent has its push in this step's metadata, so its blocks
        # must be held until the push is over (request_finished answers True).
        self._sent[rid] = (tid, len(blocks))
        self._meta.send.append(spec)
        self.handed_to_workers()

    def after_failed_finish(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        self._requests.pop(rid, None)
        self._owners.pop(rid, None)
        if rid in self._refused:
            self._refused.discard(rid)
            return False, None
        sent = self._sent.pop(rid, None)
        if sent is not None:
            # Its push was handed to the worker: the blocks stay until finished_sending.
            tid, nblocks = sent
            self._held[rid] = nblocks
            self._meta.hold.append(tid)
            return True, None
        if rid in self._held:
            return True, None  # held already (the hold is queued)
        # Never pushed: free now, and D must not wait for it.
        unsent = self._tid_of.get(rid)
        self._forget(rid)
        if unsent is not None:
            self._meta.abort_send.append(unsent)
            self.stats.inc("kvpush_transfers", (self.role, Outcome.ABORTED.value))
        return False, None

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        self._requests.pop(rid, None)
        self._owners.pop(rid, None)
        if not is_remote_decode(params):
            return False, None
        if is_probe(params):
            return False, self.identity()
        if rid in self._refused:
            self._refused.discard(rid)
            return False, None
        sent = self._sent.pop(rid, None)
        if sent is None:
            # Ended before its prompt was computed: D must not wait for it.
            tid = self._tid_of.get(rid)
            self._forget(rid)
            if tid is None:
                return False, None
            self._meta.abort_send.append(tid)
            self.stats.inc("kvpush_transfers", (self.role, Outcome.ABORTED.value))
            return False, self.answer(request, tid, [], pushed=False)
        tid, nblocks = sent
        self._held[rid] = nblocks
        self._meta.hold.append(tid)
        return True, self.answer(request, tid, list(block_ids[:nblocks]), pushed=True)

    def answer(
        self, request: Request, transfer_id: str, block_ids: list[int], pushed: bool
    ) -> dict[str, Any]:
        """P's kv_transfer_params for the router: the keys vLLM's NixlPushConnector answers
        with (routers such as vllm-router learn push mode and the decode leg's parameters
        from them; a sequential router hands them to D as they are), plus our own
        (``transfer_id``, ``kvpush``, ``remote_key``). ``do_remote_prefill`` is False when
        no KV will come (the prompt never completed): D then computes it itself."""
        return {
            "do_remote_prefill": pushed,
            "do_remote_decode": False,
            "remote_block_ids": [block_ids],  # per KV cache group, as vLLM
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.request_id,
            "remote_host": self.control_host,
            "remote_port": self.control_port,
            "tp_size": self.tp_size,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": request.num_computed_tokens if pushed else 0,
            "transfer_mode": "push",
            **self.identity(),
            "transfer_id": transfer_id,
        }

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self._held.pop(rid, None)
            self._forget(rid)

    def has_pending_push_work(self) -> bool:
        return bool(self._held) or super().has_pending_push_work()

    def tables(self) -> TableSizes:
        return {
            "scheduler.requests": (len(self._requests), None),
            "scheduler.owners": (len(self._owners), None),
            "scheduler.sent": (len(self._sent), None),
            "scheduler.held": (len(self._held), None),
            "scheduler.live": (len(self._live), None),
            "scheduler.transfer_ids": (len(self._tid_of), None),
            "scheduler.refused": (len(self._refused), None),
        }

    def _set_gauges(self) -> None:
        self.stats.set("kvpush_connector_blocks", (self.role,), sum(self._held.values()))
        self.stats.set("kvpush_transfers_active", (self.role,), len(self._sent) + len(self._held))
        self.stats.set("kvpush_leases_active", (self.role, "send"), len(self._held))
