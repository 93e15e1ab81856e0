"""What the scheduler-side connector tells the worker-side connector each step.

Plain dataclasses: vLLM ships them to worker processes with the scheduler output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from kvpush_prod.core.vocabulary import Notice


@dataclass(frozen=True)
class RecvSpec:
    """D: blocks reserved for ``transfer_id``; register them with P at ``p_address``."""

    request_id: str
    transfer_id: str
    p_host: str
    p_port: int
    block_ids: list[int]
    first_block: int
    num_tokens: int
    p_key: str = ""  # the prefill engine's public key ("" without keys)
    trace_headers: dict[str, str] | None = None  # the request's W3C trace context (spans)
    p_tp: int = 0  # the prefill engine's tensor-parallel size (0: not told, same as ours)
    prompt: bytes = b""  # digest of the request's prompt token ids (core.digest)


@dataclass(frozen=True)
class SendSpec:
    """P: this step completes the prompt of ``request_id``; push ``block_ids`` after the forward."""

    request_id: str
    transfer_id: str
    block_ids: list[int]
    owner: str = ""  # the decode engine's public key the router named ("" if none)
    trace_headers: dict[str, str] | None = None  # the request's W3C trace context (spans)
    prompt: bytes = b""  # digest of the request's prompt token ids (core.digest)


@dataclass(frozen=True)
class PeerRef:
    """A transfer and the prefill endpoint it concerns (D-side notices)."""

    transfer_id: str
    p_host: str
    p_port: int
    p_key: str = ""
    p_tp: int = 0  # the prefill engine's tensor-parallel size (0: not told, same as ours)


@dataclass
class PushMetadata(KVConnectorMetadata):
    """One step's worth of connector work for the workers."""

    # consumer
    # What D's admission tells each prefill engine (core.admission ``Answer.notices``), in
    # order; the worker turns each into D's command per link with ``notice_command``.
    notices: list[tuple[PeerRef, Notice]] = field(default_factory=list)
    recv: list[RecvSpec] = field(default_factory=list)
    abort_recv: list[str] = field(default_factory=list)  # transfer ids
    # request ids whose blocks were allocated but no REGISTER left (a hook raised): no WRITE
    # can land in them, so the workers report them in failed_recving at once
    fail_recv: list[str] = field(default_factory=list)
    # producer
    # prefill queued, blocks will come: (transfer id, decode key the router named)
    expect_send: list[tuple[str, str]] = field(default_factory=list)
    send: list[SendSpec] = field(default_factory=list)
    hold: list[str] = field(default_factory=list)  # transfer ids whose request finished
    abort_send: list[str] = field(default_factory=list)  # transfer ids
    # This step runs a forward (tokens scheduled), not only the connector's own look: D's
    # pump backs off while forwards come (``worker.STEADY_STEP_S``). Not work by itself.
    forward: bool = False

    def empty(self) -> bool:
        return not (
            self.notices
            or self.recv
            or self.abort_recv
            or self.fail_recv
            or self.expect_send
            or self.send
            or self.hold
            or self.abort_send
        )

    # Views of ``notices`` by kind (for logs and tests).
    @property
    def wait_admission(self) -> list[PeerRef]:
        return [ref for ref, n in self.notices if n is Notice.WAIT]

    @property
    def admission_over(self) -> list[str]:
        return [ref.transfer_id for ref, n in self.notices if n is Notice.OVER]

    @property
    def not_needed(self) -> list[PeerRef]:
        return [ref for ref, n in self.notices if n is Notice.NOT_NEEDED]


class PushWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: how each finished receive ended (pushed, retried, pull_fallback)."""

    def __init__(self, outcomes: dict[str, str]) -> None:
        self.outcomes = outcomes

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.outcomes)
        merged.update(getattr(other, "outcomes", {}))
        return PushWorkerMeta(merged)
