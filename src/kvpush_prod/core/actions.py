"""What the core asks the shells to do: plain frozen dataclasses, returned in lists.

The sender/receiver engines return these; the shells carry them out (NIXL, control channel,
vLLM's block manager) and feed the results back as events. No action does any I/O itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush_prod.core.messages import ControlMessage, Done


@dataclass(frozen=True, slots=True)
class PostWrite:
    """P: post one chunk as a NIXL WRITE from P's ``src_blocks`` into D's ``dst_blocks``.

    ``done`` is set only on the last chunk of a transfer: the WRITE carries it as its
    notification, posted after every other chunk of the transfer completed.
    """

    transfer_id: str
    generation: int
    chunk_id: int
    peer: str
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    nbytes: int
    done: Done | None = None


@dataclass(frozen=True, slots=True)
class PostRead:
    """D (fallback): post one chunk as a NIXL READ of P's ``remote_blocks`` into ``local_blocks``."""

    transfer_id: str
    generation: int
    chunk_id: int
    peer: str
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class SendNotif:
    """P: send ``done`` as a bare NIXL notification (a transfer with no block to write)."""

    peer: str
    done: Done


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Either side: send a control message (REGISTER, heartbeat, CANCEL, FALLBACK, ...)."""

    peer: str
    message: ControlMessage


@dataclass(frozen=True, slots=True)
class AbortChunk:
    """Either side: release the transfer handle of an in-flight chunk (best effort)."""

    chunk_id: int
    reason: str


@dataclass(frozen=True, slots=True)
class FreeBlocks:
    """D: give reserved blocks back to vLLM; only once no permit on them is live."""

    transfer_id: str
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseSend:
    """P: end the send lease: report ``finished_sending`` so vLLM frees P's blocks."""

    transfer_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class ReportFinished:
    """D: report ``finished_recving``: every block of the transfer landed and was checked."""

    transfer_id: str


@dataclass(frozen=True, slots=True)
class ReportFailed:
    """D: report the receive in ``failed_recving``; vLLM's ``kv_load_failure_policy`` applies."""

    transfer_id: str
    reason: str
    detail: str = ""


Action = (
    PostWrite
    | PostRead
    | SendNotif
    | SendMessage
    | AbortChunk
    | FreeBlocks
    | ReleaseSend
    | ReportFinished
    | ReportFailed
)
