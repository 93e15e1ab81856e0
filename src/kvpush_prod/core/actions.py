"""What the core asks the shells to do: plain frozen dataclasses, returned in lists.

The sender/receiver engines return these; the shells carry them out (NIXL, control channel,
vLLM's block manager) and feed the results back as events. No action does any I/O itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpush_prod.core.messages import ControlMessage, Done, PeerInfo
from kvpush_prod.core.vocabulary import NoteKind, Outcome


@dataclass(frozen=True, slots=True)
class ConnectPeer:
    """Make ``info``'s NIXL agent reachable (idempotent by agent name); drop ``replaces``
    (the agent of an earlier incarnation of the same engine rank) if given."""

    info: PeerInfo
    replaces: str = ""


@dataclass(frozen=True, slots=True)
class PostWrite:
    """P: post one chunk as a NIXL WRITE from P's ``src_blocks`` into D's ``dst_blocks``.

    ``done`` is set only on the last chunk of a transfer: the WRITE carries it as its
    notification, posted after every other chunk of the transfer completed; ``all_src``
    then lists every block of the transfer (for an optional checksum, over every part).
    """

    transfer_id: str
    generation: int
    chunk_id: int
    peer: str  # agent name
    src_blocks: tuple[int, ...]
    dst_blocks: tuple[int, ...]
    nbytes: int
    done: Done | None = None
    all_src: tuple[int, ...] = ()
    # The WRITE moves part ``part`` of ``parts`` of each block (1: all of it): regions
    # ``[first, end)`` of the layout, None: every region. A whole push cut by regions
    # (``core.chunking``): its region group; a layer-wise push (``layerwise``): layer
    # ``part``'s equal share of the layout's regions.
    part: int = 0
    parts: int = 1
    regions: tuple[int, int] | None = None
    layerwise: bool = False


@dataclass(frozen=True, slots=True)
class PostRead:
    """D (fallback): post one chunk as a NIXL READ of P's ``remote_blocks`` into ``local_blocks``."""

    transfer_id: str
    generation: int
    chunk_id: int
    peer: str  # agent name
    local_blocks: tuple[int, ...]
    remote_blocks: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class SendMessage:
    """Either side: send a control message to the endpoint at ``peer`` (an address).

    ``to`` is the identity the endpoint there must prove (its public key on an authenticated
    channel): a message never goes to an address on its own word.
    """

    peer: str
    message: ControlMessage
    to: str = ""


@dataclass(frozen=True, slots=True)
class DropPeer:
    """Forget a peer's NIXL agent (it was pushed out of the bounded peer directory)."""

    agent_name: str


@dataclass(frozen=True, slots=True)
class ReleaseSend:
    """P: end the send lease: report ``finished_sending`` so vLLM frees P's blocks."""

    transfer_id: str
    outcome: Outcome  # pushed | retried | pull_fallback | failed | expired | cancelled
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class ReportFinished:
    """D: report ``finished_recving``: the KV arrived (or the aborted request may free)."""

    transfer_id: str
    outcome: Outcome  # pushed | retried | pull_fallback | aborted
    checksum: int = -1  # pulled blocks: crc32 P computed, for the shell to check (-1: none)
    # Pulled: the ids read into (units when block sizes differ: ``units`` per block of ours),
    # what the shell checks ``checksum`` over, in the order P computed it.
    blocks: tuple[int, ...] = ()
    units: int = 0


@dataclass(frozen=True, slots=True)
class ReportFailed:
    """D: report the receive in ``failed_recving``; vLLM's ``kv_load_failure_policy`` applies.

    Only emitted once no WRITE or READ can still land in the transfer's blocks.
    """

    transfer_id: str
    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Note:
    """Something an operator counts: ``kind`` names the counter, ``reason`` its label."""

    kind: NoteKind
    reason: str
    detail: str = ""
    value: float = 0.0  # queue_wait: seconds from ready (blocks + permit) to first chunk posted


Action = (
    ConnectPeer
    | DropPeer
    | PostWrite
    | PostRead
    | SendMessage
    | ReleaseSend
    | ReportFinished
    | ReportFailed
    | Note
)
