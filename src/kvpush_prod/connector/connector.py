"""PushConnector: vLLM's KVConnectorBase_V1 contract, forwarded to the two halves.

Each hook's docstring states what it promises (what it returns, what None means, when
blocks are handed back), split by the side it runs on, as vLLM's ``base.py`` does.

No hook called while the engine serves ever raises into vLLM: what raises in our code is
logged, counted (``kvpush_hook_errors{reason=<hook>}``) and turned into an outcome for the
requests concerned (they compute their prompt, or their receive fails and vLLM's
``kv_load_failure_policy`` applies), never a dead EngineCore. The fencing rules hold on
that path too: a receive is reported failed only when no REGISTER left for it, and P keeps
blocks whose push was handed to the worker. Only construction and ``register_kv_caches``
raise (a configuration kvpush cannot run with must stop the engine at start).
"""

from __future__ import annotations

import logging
import sys
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from kvpush_prod.config import config_from_extra
from kvpush_prod.connector.compat import layout_facts, total_kv_heads
from kvpush_prod.connector.cpu_layout import cpu_token_pattern
from kvpush_prod.connector.metadata import PushMetadata, PushWorkerMeta
from kvpush_prod.connector.scheduler import SchedulerSide, scheduler_side
from kvpush_prod.connector.stats import KvpushPromMetrics, KvpushStats
from kvpush_prod.connector.trust import Trust
from kvpush_prod.connector.worker import WorkerSide
from kvpush_prod.core.compat import signature_of
from kvpush_prod.core.vocabulary import Side
from kvpush_prod.errors import ConfigError
from kvpush_prod.metrics import StatsBuffer, merge_stats
from kvpush_prod.transport.layout import Heads

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)


def rank_heads(vllm_config: Any, kv_cache_config: Any, tp_rank: int) -> Heads:
    """This rank's KV heads and tensor-parallel place, for the layout (``Layout.kv_heads``),
    and the block and head sizes that locate each token's bytes in a block."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    mla = bool(getattr(vllm_config.model_config, "use_mla", False))
    block_size = int(getattr(spec, "block_size", 0) or 0)
    head_size = int(getattr(spec, "head_size", 0) or 0)
    return Heads(
        local=1 if mla else int(getattr(spec, "num_kv_heads", 0) or 0),
        total=total_kv_heads(vllm_config),
        tp_size=int(vllm_config.parallel_config.tensor_parallel_size),
        tp_rank=tp_rank,
        replicated=mla,
        block_size=block_size,
        head_size=head_size,
        token_pattern=cpu_token_pattern(vllm_config, block_size, head_size),
    )


def unsupported_topology(parallel: Any) -> None:
    """Refuse at start-up what kvpush cannot transfer, naming the value and the fix (never a
    silent wait or a late fallback at the first request)."""
    pp = int(getattr(parallel, "pipeline_parallel_size", 1) or 1)
    if pp > 1:
        raise ConfigError(
            f"--pipeline-parallel-size {pp}: kvpush does not support pipeline parallelism "
            "(each stage holds other layers' KV and their control ports would collide); run "
            "prefill and decode engines with --pipeline-parallel-size 1 (tensor parallelism "
            "is supported)"
        )
    dcp = int(getattr(parallel, "decode_context_parallel_size", 1) or 1)
    if dcp > 1:
        raise ConfigError(
            f"--decode-context-parallel-size {dcp}: kvpush does not support decode context "
            "parallelism (KV split by tokens across ranks); run with "
            "--decode-context-parallel-size 1"
        )


def _supported_side(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> Side:
    """This engine's side (P or D), once its role, KV cache groups and topology are ones the
    connector serves; else ConfigError naming the value and the fix."""
    ktc = vllm_config.kv_transfer_config
    assert ktc is not None
    side = Side.of_kv_role(str(ktc.kv_role))
    if side is None:
        raise ConfigError(
            f"kv_transfer_config.kv_role={ktc.kv_role!r} is not supported by PushConnector: "
            "use 'kv_producer' on prefill engines and 'kv_consumer' on decode engines"
        )
    if len(kv_cache_config.kv_cache_groups) != 1:
        raise ConfigError(
            f"PushConnector supports models with one KV cache group (full attention); this "
            f"model has {len(kv_cache_config.kv_cache_groups)} groups (hybrid or "
            "sliding-window attention): serve it with vLLM's NixlConnector instead"
        )
    unsupported_topology(vllm_config.parallel_config)
    return side


class PushConnector(KVConnectorBase_V1):
    """Push-based KV transfer: D reserves blocks and grants a permit, P WRITEs, D waits."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.kv_role = _supported_side(vllm_config, kv_cache_config)
        self._hook_stats = StatsBuffer()  # hooks that raised (the sides' buffers may be broken)
        # D, worker: receives failed here (no REGISTER left), reported with the next results
        self._failed_here: set[str] = set()
        self.cfg = config_from_extra(ktc.kv_connector_extra_config)
        engine_id = str(ktc.engine_id)
        parallel = vllm_config.parallel_config
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        block_size = spec.block_size
        num_layers = len(kv_cache_config.kv_cache_groups[0].layer_names)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = scheduler_side(
                self.cfg,
                self.kv_role,
                engine_id,
                block_size,
                block_bytes=spec.page_size_bytes * num_layers,
                tp_size=parallel.tensor_parallel_size,
                dp_index=parallel.data_parallel_index,
                num_blocks=kv_cache_config.num_blocks,
                recompute_on_failure=getattr(ktc, "kv_load_failure_policy", "fail") == "recompute",
                trust=Trust.from_config(self.cfg),
                dp_size=parallel.data_parallel_size,
            )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            if ktc.kv_buffer_device not in ("cpu", "cuda"):
                raise ConfigError(
                    f"kv_transfer_config.kv_buffer_device={ktc.kv_buffer_device!r}: use 'cpu' "
                    "on the CPU platform or 'cuda' on GPUs"
                )
            tp_rank = get_tensor_model_parallel_rank()
            facts = layout_facts(vllm_config, kv_cache_config)
            self._worker = WorkerSide(
                self.cfg,
                self.kv_role,
                engine_id,
                tp_rank=tp_rank,
                heads=rank_heads(vllm_config, kv_cache_config, tp_rank),
                tp_size=parallel.tensor_parallel_size,
                dp_index=parallel.data_parallel_index,
                signature=signature_of(facts),
                num_blocks=kv_cache_config.num_blocks,
                facts=facts,
                otlp_endpoint=getattr(
                    vllm_config.observability_config, "otlp_traces_endpoint", None
                ),
                recompute_on_failure=getattr(ktc, "kv_load_failure_policy", "fail") == "recompute",
                block_bytes=spec.page_size_bytes * num_layers,
            )
            self._kv_buffer_device = ktc.kv_buffer_device

    # ============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Worker, once at start: register this rank's KV cache with NIXL, open the control
        endpoint and start the transfer pump.

        Raises ConfigError for a KV cache kvpush cannot push (GPU memory with
        ``kv_buffer_device='cpu'``, checksums on a GPU cache, a layout it cannot describe).
        """
        assert self._worker is not None
        device = next(iter(kv_caches.values())).device.type
        if device == "cuda" and self._kv_buffer_device != "cuda":
            raise ConfigError(
                "the KV cache is in GPU memory but kv_buffer_device='cpu': kvpush pushes VRAM "
                "directly (GPUDirect); set kv_buffer_device to 'cuda'"
            )
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Worker, before the forward: the step's metadata from the scheduler side.

        D's REGISTERs for newly reserved blocks, its waits, aborts and "not needed" notices
        leave now (not after the forward); P's requests to expect, hold or abort are queued
        for the pump. Returns at once: nothing here waits on the network."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is None or not isinstance(connector_metadata, PushMetadata):
            return
        self._failed_here.update(connector_metadata.fail_recv)
        try:
            self._worker.on_metadata(connector_metadata)
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("bind_connector_metadata")
            self._fail_unsent_receives(connector_metadata)

    def _fail_unsent_receives(self, meta: PushMetadata) -> None:
        """After ``on_metadata`` raised: if the step's plan never reached the pump, none of
        its receives can get a WRITE, so they fail now (else vLLM would wait for them
        forever). A plan the pump has runs its course (it fails what it cannot register;
        the permit and the transfer deadline bound the rest)."""
        if getattr(self._worker, "offered", None) is meta:
            return
        for spec in meta.recv:
            logger.error(
                "kvpush: request %s: its REGISTER was not sent; its receive fails", spec.request_id
            )
            self._failed_here.add(spec.request_id)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Worker: nothing to start (P pushes into D's blocks, D only waits); returns at once."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Worker: never blocks; a request is scheduled only once its whole KV has arrived
        (it is reported in ``finished_recving`` first)."""

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        """Worker, after each attention layer's forward: with a layer-wise push
        (``push.layerwise``) the layers computed so far are handed to the pump, which posts
        them while the forward goes on; never waits. Otherwise nothing: the push starts
        once the whole forward has finished."""
        if self._worker is not None:
            try:
                self._worker.layer_saved(layer_name)
            except Exception:  # noqa: BLE001 - never kill the engine
                self._contained("save_kv_layer")

    def wait_for_save(self) -> None:
        """Worker, after the forward: prompts completed in this step are handed to the pump.

        vLLM calls this from a ``finally``, so also when the forward raised (a fatal error,
        or SIGTERM mid-step): then this step's prompts were not computed and pushing their
        blocks would hand D garbage under a valid DONE."""
        if self._worker is not None:
            try:
                self._worker.after_forward(forward_failed=sys.exc_info()[0] is not None)
            except Exception:  # noqa: BLE001 - never kill the engine
                self._contained("wait_for_save")

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Worker, each step: the transfers that ended since the last call.

        ``finished_sending``: P's requests whose send lease is over (pushed, pulled, failed,
        expired or cancelled): only now may vLLM free their blocks (``request_finished``
        answered True). ``finished_recving``: D's receives that ended, successful or not
        (``failed_recving`` says which failed; vLLM's ``kv_load_failure_policy`` applies).
        A receive is reported only once no WRITE or READ can still land in its blocks.
        """
        assert self._worker is not None
        try:
            sending, recving, failed = self._worker.get_finished()
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("get_finished")
            sending, recving, failed = set(), set(), set()
        if self._failed_here:
            failed = failed | self._failed_here
            self._failed_here = set()
        return KVConnectorTransferResults(
            finished_sending=sending, finished_recving=recving | failed, failed_recving=failed
        )

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Worker: (finished sending, finished receiving) of ``get_transfer_results``."""
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending, results.finished_recving

    def build_connector_worker_meta(self) -> PushWorkerMeta | None:
        """Worker: how this step's finished receives ended (pushed, retried, pull_fallback),
        for the decode reply; None when no receive ended."""
        if self._worker is None:
            return None
        try:
            outcomes = self._worker.take_outcomes()
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("build_connector_worker_meta")
            return None
        return PushWorkerMeta(outcomes) if outcomes else None

    def get_kv_connector_stats(self) -> KvpushStats | None:
        """Both sides: what happened since the last call, for vLLM's /metrics; None when
        nothing did."""
        side = self._worker or self._scheduler
        try:
            data = side.get_stats() if side is not None else {}
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("get_kv_connector_stats")
            data = {}
        data = merge_stats(data, self._hook_stats.drain())
        return KvpushStats(data=data) if data else None

    def _contained(self, hook: str, rid: str = "") -> None:
        """Log and count what raised in ``hook`` (for request ``rid``); the engine goes on."""
        self._hook_stats.inc("kvpush_hook_errors", (self.kv_role.value, hook))
        logger.exception(
            "kvpush: %s raised%s; contained, the engine goes on",
            hook,
            f" for request {rid}" if rid else "",
        )

    def shutdown(self) -> None:
        """Worker: stop the pump, close the control endpoint and the NIXL agent."""
        if self._worker is not None:
            try:
                self._worker.shutdown()
            except Exception:  # noqa: BLE001 - shutting down anyway
                self._contained("shutdown")

    # ============================================================== scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Scheduler: P reads a request's block ids from the KV cache manager."""
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.bind_kv_cache_manager(kv_cache_manager)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Scheduler: how many prompt tokens beyond ``num_computed_tokens`` P will push.

        D: ``(n, True)`` once the transfer is admitted within the credit budget (the blocks
        arrive asynchronously, between steps); ``(None, False)`` while it waits for credit
        (vLLM asks again on a later step; P keeps its blocks meanwhile); ``(0, False)`` when
        nothing comes from P: no transfer, untrusted params, a prefix-cache hit, or more
        blocks than the budget (then D computes the prompt itself). P: always ``(0, False)``.
        """
        assert self._scheduler is not None
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("get_num_new_matched_tokens", request.request_id)
        try:
            self._scheduler.after_failed_ask(request)
        except Exception:  # noqa: BLE001
            self._contained("get_num_new_matched_tokens", request.request_id)
        return 0, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Scheduler, D: the blocks for the pushed tokens are allocated; the worker sends P
        the REGISTER (a write permit on them) with this step's metadata. P: nothing."""
        assert self._scheduler is not None
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
            return
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("update_state_after_alloc", request.request_id)
        try:
            self._scheduler.after_failed_alloc(request, num_external_tokens)
        except Exception:  # noqa: BLE001
            self._contained("update_state_after_alloc", request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Scheduler, each step: the registrations, waits, pushes, holds and aborts of this
        step for the workers (a ``PushMetadata``, possibly empty)."""
        assert self._scheduler is not None
        try:
            return self._scheduler.build_connector_meta(scheduler_output)
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("build_connector_meta")
        try:
            return self._scheduler.take_meta()  # what the step gathered still goes out
        except Exception:  # noqa: BLE001
            self._contained("build_connector_meta")
            return PushMetadata()

    def on_new_request(self, request: Request) -> None:
        """Scheduler, P: a request to push arrived; the worker keeps D's permit renewed
        until its prompt is computed. D: nothing."""
        if self._scheduler is not None:
            try:
                self._scheduler.on_new_request(request)
            except Exception:  # noqa: BLE001 - never kill the engine; it is not pushed
                self._contained("on_new_request", request.request_id)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler: the workers' finished sends and receives of the last step (P stops
        holding those blocks; D returns their credit and notes how each arrived)."""
        assert self._scheduler is not None
        try:
            self._scheduler.update_connector_output(connector_output)
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("update_connector_output")

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Scheduler, once when a request finishes, before vLLM frees its blocks.

        Returns (delay_free, kv_transfer_params). P: True for a request whose prompt was
        computed: its blocks are the push's until the request is reported in
        ``finished_sending``; the params name this engine (and the transfer) for the router.
        D: False (a receive still in flight is aborted, and reported in
        ``finished_recving`` only once fenced); the params carry how the KV arrived, or None.
        A router's probe gets this engine's identity (its key) and frees at once.
        """
        assert self._scheduler is not None
        try:
            return self._scheduler.request_finished(request, block_ids)
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("request_finished", request.request_id)
        try:
            return self._scheduler.after_failed_finish(request)
        except Exception:  # noqa: BLE001
            self._contained("request_finished", request.request_id)
            # Unknown state: keeping the blocks is the safe side (no WRITE into freed blocks)
            # for P; D's blocks are held by vLLM until its receive is reported anyway.
            return self.kv_role is Side.PRODUCER, None

    def has_pending_push_work(self) -> bool:
        """Scheduler: True while blocks are held for a push, aborts wait for their fence or
        notices are queued: vLLM keeps stepping (and collecting results) until then."""
        if self._scheduler is None:
            return False
        try:
            return self._scheduler.has_pending_push_work()
        except Exception:  # noqa: BLE001 - never kill the engine
            self._contained("has_pending_push_work")
            return True  # keep stepping: held blocks are collected only by steps

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvpushStats:
        return KvpushStats(data=data or {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvpushPromMetrics:
        return KvpushPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ============================================================== sleep mode (vLLM >= 0.33)
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """False: sleep mode remaps the KV cache, and kvpush's NIXL registrations and the
        layouts its peers cached (addresses of every block) would then point at freed or
        foreign memory; a push after wake-up would write there. vLLM then refuses sleep mode
        for an engine running kvpush instead of letting it sleep with stale registrations."""
        return False

    def unregister_kv_caches(self) -> None:
        """Never called while ``supports_sleep_mode`` is False; if it is, nothing is dropped
        (the engine keeps serving with its registrations) and the call is logged."""
        logger.error(
            "kvpush: unregister_kv_caches called although kvpush does not support "
            "sleep mode; registrations kept. Disable sleep mode on kvpush engines"
        )

    def restore_kv_caches(self) -> None:
        """See ``unregister_kv_caches``."""
        logger.error(
            "kvpush: restore_kv_caches called although kvpush does not support "
            "sleep mode. Disable sleep mode on kvpush engines"
        )
