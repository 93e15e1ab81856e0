"""Scheduler-side half of the PushConnector (runs in vLLM's EngineCore process).

D admits inbound transfers within its credit budget and registers reserved blocks; P marks
the requests whose prompt completes in a step; both tell their workers through metadata.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpush_prod.config import KvpushConfig
from kvpush_prod.connector.metadata import PeerRef, PushMetadata, RecvSpec, SendSpec
from kvpush_prod.connector.params import (
    RemotePrefill,
    is_probe,
    is_remote_decode,
    transfer_id_of,
)
from kvpush_prod.connector.trust import Trust
from kvpush_prod.core.credits import CreditLedger, CreditSettings, Decision
from kvpush_prod.errors import KVTransferParamsError
from kvpush_prod.metrics import StatsBuffer

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Recv:
    transfer_id: str
    remote: RemotePrefill
    nblocks: int = 0
    allocated: bool = False
    waiting: bool = False  # told LATER by the credit ledger
    admitted: bool = False

    @property
    def peer(self) -> str:
        return f"{self.remote.host}:{self.remote.port}"

    def ref(self) -> PeerRef:
        return PeerRef(self.transfer_id, self.remote.host, self.remote.port, self.remote.key)


class SchedulerSide:
    """Both roles' scheduler logic; the role decides which half is used."""

    def __init__(self, cfg: KvpushConfig, role: str, engine_id: str, block_size: int,
                 block_bytes: int, tp_size: int, dp_index: int, num_blocks: int,
                 recompute_on_failure: bool = False, trust: Trust | None = None) -> None:
        self.cfg = cfg
        self.role = role  # "producer" | "consumer"
        self.engine_id = engine_id
        self.block_size = block_size
        self.block_bytes = block_bytes  # one block, all layers, one rank
        self.tp_size = tp_size
        self.control_host = cfg.control.advertise_host or cfg.control.host
        self.control_port = cfg.control.port + dp_index * tp_size
        self.recompute_on_failure = recompute_on_failure
        self.trust = trust if trust is not None else Trust()
        self.stats = StatsBuffer()
        self._kv_cache_manager: Any = None
        # consumer
        budget = max(1, int(cfg.credits.budget_fraction * num_blocks))
        self.credits = CreditLedger(CreditSettings(
            budget_blocks=budget,
            per_peer_cap_blocks=max(1, int(cfg.credits.per_peer_fraction * budget)),
        ))
        self._recv: dict[str, _Recv] = {}  # request id -> receive in progress
        self._consumed: set[str] = set()  # request ids whose transfer is over (no re-register)
        self._aborting: set[str] = set()
        self._received: dict[str, dict[str, Any]] = {}  # request id -> what arrived, for the reply
        self._outcomes: dict[str, str] = {}  # request id -> outcome reported by the worker
        # producer
        self._requests: dict[str, Request] = {}  # P requests with do_remote_decode
        self._owners: dict[str, str] = {}  # P request id -> the decode key the router named
        self._sent: dict[str, tuple[str, int]] = {}  # request id -> (transfer id, nblocks)
        self._held: dict[str, int] = {}  # request id -> blocks held until finished_sending
        self._meta = PushMetadata()

    def bind_kv_cache_manager(self, manager: Any) -> None:
        self._kv_cache_manager = manager

    # ------------------------------------------------------------------ identity
    def identity(self) -> dict[str, Any]:
        """What a router needs to point a decode engine at this prefill engine."""
        out: dict[str, Any] = {
            "remote_engine_id": self.engine_id,
            "remote_host": self.control_host,
            "remote_port": self.control_port,
            "tp_size": self.tp_size,
            "kvpush": True,
        }
        if self.trust.public_key:
            out["remote_key"] = self.trust.public_key
        return out

    # ------------------------------------------------------------------ consumer (D)
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.role != "consumer":
            return 0, False
        rid = request.request_id
        if rid in self._consumed:
            return 0, False
        recv = self._recv.get(rid)
        if recv is None:
            try:
                remote = self.trust.remote_prefill(rid, request.kv_transfer_params)
            except KVTransferParamsError as exc:
                logger.warning("kvpush: request %s computes its prompt locally: %s", rid, exc)
                self.stats.inc("kvpush_kv_params_rejected", ("consumer", exc.reason))
                self._consumed.add(rid)
                return 0, False
            if remote is None:
                return 0, False
            recv = _Recv(remote.transfer_id, remote)
            self._recv[rid] = recv
        num_prompt = request.num_prompt_tokens
        count = num_prompt - num_computed_tokens
        if count <= 0:
            # Everything is in D's prefix cache already: P can free its blocks now.
            self._give_up(rid, recv, "prefix_hit")
            return 0, False
        nblocks = cdiv(num_prompt, self.block_size) - num_computed_tokens // self.block_size
        admission = self.credits.request(recv.transfer_id, recv.peer, nblocks, time.monotonic())
        if admission.decision is Decision.ADMIT:
            if not recv.admitted:
                recv.admitted = True
                self.stats.inc("kvpush_admissions", ("consumer", "admit"))
                self.stats.inc("kvpush_credits_granted_blocks", ("consumer",), nblocks)
            if recv.waiting:
                recv.waiting = False
                self._meta.admission_over.append(recv.transfer_id)
            return count, True
        if admission.decision is Decision.LATER:
            if not recv.waiting:
                recv.waiting = True
                self.stats.inc("kvpush_admissions", ("consumer", "later"))
                # Until it is admitted, P must keep its finished blocks for us.
                self._meta.wait_admission.append(recv.ref())
            return None, False
        logger.warning("kvpush: request %s needs %d blocks, more than the credit budget (%s); "
                       "computing its prompt locally", rid, nblocks, admission.reason)
        self.stats.inc("kvpush_admissions", ("consumer", "refuse"))
        self._give_up(rid, recv, "recompute")
        return 0, False

    def _give_up(self, rid: str, recv: _Recv, outcome: str) -> None:
        self._recv.pop(rid, None)
        self._consumed.add(rid)
        self.credits.release(recv.transfer_id)
        self._meta.not_needed.append(recv.ref())
        self.stats.inc("kvpush_transfers", ("consumer", outcome))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self.role != "consumer":
            return
        rid = request.request_id
        recv = self._recv.get(rid)
        if recv is None or recv.allocated or num_external_tokens <= 0:
            return
        num_prompt = request.num_prompt_tokens
        local = num_prompt - num_external_tokens
        first_block = local // self.block_size
        nblocks = cdiv(num_prompt, self.block_size) - first_block
        all_blocks = blocks.get_block_ids()[0]
        d_blocks = list(all_blocks[first_block:first_block + nblocks])
        if len(d_blocks) != nblocks:
            logger.error("kvpush: request %s got %d blocks, expected %d from block %d",
                         rid, len(all_blocks), nblocks, first_block)
        recv.allocated, recv.nblocks = True, len(d_blocks)
        self._consumed.add(rid)
        self._meta.recv.append(RecvSpec(rid, recv.transfer_id, recv.remote.host,
                                        recv.remote.port, d_blocks, first_block, num_prompt,
                                        recv.remote.key))

    # ------------------------------------------------------------------ producer (P)
    def on_new_request(self, request: Request) -> None:
        params = request.kv_transfer_params
        if self.role != "producer" or not is_remote_decode(params) or is_probe(params):
            return
        assert params is not None
        rid = request.request_id
        try:
            owner = self.trust.decode_owner(params)
        except KVTransferParamsError as exc:
            # Not pushed: a decode engine that registers it hears at once (and recomputes).
            logger.warning("kvpush: request %s will not be pushed: %s", rid, exc)
            self.stats.inc("kvpush_kv_params_rejected", ("producer", exc.reason))
            with contextlib.suppress(KVTransferParamsError):
                self._meta.abort_send.append(transfer_id_of(rid, params))
            return
        self._requests[rid] = request
        self._owners[rid] = owner
        # A malformed transfer_id is reported when the prompt completes.
        with contextlib.suppress(KVTransferParamsError):
            self._meta.expect_send.append((transfer_id_of(rid, params), owner))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PushMetadata:
        if self.role == "producer" and self._requests:
            self._collect_sends(scheduler_output)
        meta, self._meta = self._meta, PushMetadata()
        return meta

    def _collect_sends(self, so: SchedulerOutput) -> None:
        for rid, n in so.num_scheduled_tokens.items():
            req = self._requests.get(rid)
            if req is None or rid in self._sent:
                continue
            if req.num_computed_tokens + n < req.num_prompt_tokens:
                continue  # chunked prefill: the prompt completes in a later step
            try:
                tid = transfer_id_of(rid, req.kv_transfer_params or {})
            except KVTransferParamsError as exc:
                logger.warning("kvpush: request %s will not be pushed: %s", rid, exc)
                self.stats.inc("kvpush_kv_params_rejected", ("producer", exc.reason))
                continue
            nblocks = cdiv(req.num_prompt_tokens, self.block_size)
            blocks = list(self._kv_cache_manager.get_block_ids(rid)[0][:nblocks])
            self._sent[rid] = (tid, len(blocks))
            self._meta.send.append(SendSpec(rid, tid, blocks, self._owners.get(rid, "")))

    # ------------------------------------------------------------------ both
    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        params = request.kv_transfer_params
        if self.role == "producer":
            self._requests.pop(rid, None)
            self._owners.pop(rid, None)
            if not is_remote_decode(params):
                return False, None
            if is_probe(params):
                return False, self.identity()
            sent = self._sent.pop(rid, None)
            if sent is None:
                # Ended before its prompt was computed: D must not wait for it.
                try:
                    tid = transfer_id_of(rid, params or {})
                except KVTransferParamsError:
                    return False, None
                self._meta.abort_send.append(tid)
                self.stats.inc("kvpush_transfers", ("producer", "aborted"))
                return False, {**self.identity(), "transfer_id": tid}
            tid, nblocks = sent
            self._held[rid] = nblocks
            self._meta.hold.append(tid)
            return True, {**self.identity(), "transfer_id": tid}
        # consumer
        if is_probe(params):
            return False, self.identity()  # a router asks who we are (our key)
        self._consumed.discard(rid)
        recv = self._recv.get(rid)
        if recv is None:
            summary = self._received.pop(rid, None)
            return False, ({"kvpush": summary} if summary else None)
        if not recv.allocated:
            # Aborted while waiting for admission: P can free now.
            self._give_up(rid, recv, "aborted")
            return False, None
        # Still waiting for the push: vLLM keeps the blocks until we report the request in
        # finished_recving; the worker cancels P's push and waits for its ack or the fence.
        self._aborting.add(rid)
        self._meta.abort_recv.append(recv.transfer_id)
        return False, None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        for rid in output.finished_sending or ():
            self._held.pop(rid, None)
        worker_meta = getattr(output, "kv_connector_worker_meta", None)
        if worker_meta is not None and hasattr(worker_meta, "outcomes"):
            self._outcomes.update(worker_meta.outcomes)
        failed = output.failed_recving or set()
        for rid in output.finished_recving or ():
            recv = self._recv.pop(rid, None)
            outcome = self._outcomes.pop(rid, "")
            if recv is None:
                continue
            self.credits.release(recv.transfer_id)
            if rid in self._aborting:
                self._aborting.discard(rid)
                continue
            ok = rid not in failed
            if ok:
                self.stats.inc("kvpush_transfer_bytes", ("consumer",),
                               recv.nblocks * self.block_bytes)
            elif self.recompute_on_failure:
                self.stats.inc("kvpush_transfers", ("consumer", "recompute"))
            self._received[rid] = {
                "transfer_id": recv.transfer_id,
                "outcome": (outcome or "pushed") if ok else "failed",
                "blocks": recv.nblocks if ok else 0,
                "bytes": recv.nblocks * self.block_bytes if ok else 0,
            }

    def has_pending_push_work(self) -> bool:
        return bool(self._held or self._aborting or not self._meta.empty())

    def get_stats(self) -> dict[str, Any]:
        """This step's observations plus the gauges as they stand after the step."""
        if self.role == "producer":
            self.stats.set("kvpush_connector_blocks", ("producer",), sum(self._held.values()))
            self.stats.set("kvpush_transfers_active", ("producer",),
                           len(self._sent) + len(self._held))
            self.stats.set("kvpush_leases_active", ("producer", "send"), len(self._held))
        else:
            allocated = [r for r in self._recv.values() if r.allocated]
            self.stats.set("kvpush_connector_blocks", ("consumer",),
                           sum(r.nblocks for r in allocated))
            self.stats.set("kvpush_transfers_active", ("consumer",), len(self._recv))
            self.stats.set("kvpush_leases_active", ("consumer", "permit"), len(allocated))
            self.stats.set("kvpush_credits_budget_blocks", ("consumer",),
                           self.credits.in_use + self.credits.free)
            self.stats.set("kvpush_credits_in_use_blocks", ("consumer",), self.credits.in_use)
            self.stats.set("kvpush_credits_waiting_transfers", ("consumer",), self.credits.waiting)
        return self.stats.drain()
