"""What the pump needs of a transport, as a type: connect peers, post block WRITEs and READs,
see them complete, read notifications. ``NixlTransport`` is it; ``FaultyTransport`` wraps it.

A chunk's failure travels as a ``ChunkError`` (its kind from the classification table): a
transport raises ``ChunkFailed`` carrying one, or returns one as a completion state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvpush_prod.core.messages import Layout
from kvpush_prod.core.retry import ChunkError
from kvpush_prod.errors import TransportError

if TYPE_CHECKING:
    from kvpush_prod.transport.runs import PairPlan

Op = Literal["WRITE", "READ"]
Completion = Literal["DONE", "PROC"] | ChunkError  # landed, still in flight, or failed


@dataclass
class RemotePeer:
    """A connected remote agent and its prepared descriptor list."""

    agent_name: str
    layout: Layout  # the remote bytes this rank exchanges with it (a head slab across TP sizes)
    dlist: Any
    local: Layout | None = None  # this rank's bytes exchanged with it (None: the whole layout)
    local_dlist: Any = None
    # Block sizes differ (core.blocksize): ids are units of ``unit_tokens`` tokens, this
    # rank's blocks hold ``local_k`` of them and the peer's ``remote_k``; both dlists then
    # list unit pieces (transport.layout.unit_descriptors). 0: whole blocks.
    unit_tokens: int = 0
    local_k: int = 1
    remote_k: int = 1
    # Both sides' regions as ids see them (``transport.runs``), set by connect: whether a
    # run of ids is one descriptor per region, and where each id sits in the dlists.
    plan: PairPlan | None = None
    # Disconnected (its dlists released): a split post's parts not posted yet never go out
    # (not on freed dlists, and not on a new connection to the same agent).
    closed: bool = False


class ChunkFailed(TransportError):
    """A chunk could not be posted; ``error`` says why, as the retry classification reads it."""

    def __init__(self, error: ChunkError) -> None:
        super().__init__(error.kind.value, str(error))
        self.error = error


def chunk_error(exc: BaseException) -> ChunkError:
    """The ``ChunkError`` an exception from posting stands for: a ``ChunkFailed``'s own, a
    NIXL exception's by its class, anything else read from its message."""
    if isinstance(exc, ChunkFailed):
        return exc.error
    return ChunkError.from_exception(exc)


class Transport(Protocol):
    """One worker rank's view of the data plane (not thread-safe: the pump is its caller)."""

    @property
    def layout(self) -> Layout:
        """This rank's registered KV cache."""
        ...

    @property
    def name(self) -> str:
        """This rank's agent name."""
        ...

    def metadata(self) -> bytes:
        """What a peer needs to connect to this rank's agent."""
        ...

    def connect(self, agent_meta: bytes, layout: Layout, expect_name: str = "") -> RemotePeer:
        """Add a remote agent (idempotent by name) and prepare its descriptors."""
        ...

    def disconnect(self, agent_name: str) -> None: ...

    def post(
        self,
        op: Op,
        peer: RemotePeer,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes = b"",
        regions: tuple[int, int] | None = None,
    ) -> Any:
        """Start a WRITE (local -> remote) or READ (remote -> local) of regions ``[first,
        end)`` of each block (None: all of them); a handle to poll."""
        ...

    def state(self, handle: Any) -> Completion: ...

    def release(self, handle: Any) -> None: ...

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications by sender; the call also makes progress on the backend."""
        ...

    def close(self) -> None: ...
