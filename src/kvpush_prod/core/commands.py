"""What the engine (vLLM's step) tells the core, as typed events: each names one call on the
Sender (P) or Receiver (D) and applies it, so the thread that owns the core runs it.

The engine thread builds them (from the scheduler's metadata, after the forward), the pump
thread applies them; the simulated world applies the same ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

from kvpush_prod.core.actions import Action
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender

E_contra = TypeVar("E_contra", contravariant=True)


class Command(Protocol[E_contra]):
    """An engine-thread event for an engine of type ``E``."""

    def apply(self, engine: E_contra, now: float, /) -> list[Action]:
        """Feed the event to ``engine`` at ``now``; the actions to carry out."""
        ...


# ------------------------------------------------------------------------------ P (Sender)


@dataclass(frozen=True, slots=True)
class ExpectBlocks:
    """P's scheduler has the request: its blocks will come (D's permit is kept renewed).

    ``owner``: the decode engine's identity the router named ("": none named)."""

    transfer_id: str
    owner: str = ""

    def apply(self, engine: Sender, now: float, /) -> list[Action]:
        return engine.expect_blocks(self.transfer_id, now, self.owner)


@dataclass(frozen=True, slots=True)
class BlocksReady:
    """P's forward computed the prompt: its KV is in ``blocks``; push it."""

    transfer_id: str
    blocks: tuple[int, ...]
    owner: str = ""
    prompt: bytes = b""  # digest of the prompt's token ids (core.digest)

    def apply(self, engine: Sender, now: float, /) -> list[Action]:
        return engine.blocks_ready(
            self.transfer_id, list(self.blocks), now, self.owner, self.prompt
        )


@dataclass(frozen=True, slots=True)
class LayersReady:
    """Layer-wise push: P's forward, still running, has computed the first ``ready`` of the
    ``parts`` layers of the prompt in ``blocks``; push those (``BlocksReady`` follows
    when the forward ends)."""

    transfer_id: str
    blocks: tuple[int, ...]
    ready: int
    parts: int
    owner: str = ""
    prompt: bytes = b""

    def apply(self, engine: Sender, now: float, /) -> list[Action]:
        return engine.layers_ready(
            self.transfer_id,
            list(self.blocks),
            self.ready,
            self.parts,
            now,
            self.owner,
            self.prompt,
        )


@dataclass(frozen=True, slots=True)
class ForwardFailed:
    """P's forward raised: ``blocks`` hold no usable KV; nothing is pushed, D is told."""

    transfer_id: str
    blocks: tuple[int, ...]

    def apply(self, engine: Sender, now: float, /) -> list[Action]:
        return engine.forward_failed(self.transfer_id, list(self.blocks), now)


@dataclass(frozen=True, slots=True)
class Hold:
    """P's request finished: its blocks are the core's until it releases the send."""

    transfer_id: str

    def apply(self, engine: Sender, now: float, /) -> list[Action]:
        return engine.hold(self.transfer_id)


@dataclass(frozen=True, slots=True)
class AbortSend:
    """P's request ended before its KV was computed: the transfer cannot happen."""

    transfer_id: str

    def apply(self, engine: Sender, now: float, /) -> list[Action]:
        return engine.abort(self.transfer_id, now)


# ------------------------------------------------------------------------------ D (Receiver)


@dataclass(frozen=True, slots=True)
class AwaitAdmission:
    """D has no credit for the transfer yet: P at ``address`` keeps its blocks meanwhile."""

    transfer_id: str
    address: str
    owner: str = ""

    def apply(self, engine: Receiver, now: float, /) -> list[Action]:
        return engine.await_admission(self.transfer_id, self.address, self.owner)


@dataclass(frozen=True, slots=True)
class AdmissionOver:
    """D admitted the transfer it was waiting to admit (or no longer waits for it)."""

    transfer_id: str

    def apply(self, engine: Receiver, now: float, /) -> list[Action]:
        return engine.admission_over(self.transfer_id)


@dataclass(frozen=True, slots=True)
class RegisterBlocks:
    """D reserved ``blocks`` for the transfer: grant P at ``address`` a write permit on them.

    ``first_block``: the index, in the prompt's blocks, of ``blocks[0]`` (the ones before are
    in D's prefix cache). ``owner``: the prefill engine's identity ("": the address)."""

    transfer_id: str
    address: str
    blocks: tuple[int, ...]
    first_block: int
    num_tokens: int
    owner: str = ""
    prompt: bytes = b""  # digest of D's prompt token ids: the KV must be for this prompt

    def apply(self, engine: Receiver, now: float, /) -> list[Action]:
        return engine.register(
            self.transfer_id,
            self.address,
            list(self.blocks),
            self.first_block,
            self.num_tokens,
            now,
            self.owner,
            self.prompt,
        )


@dataclass(frozen=True, slots=True)
class NotNeeded:
    """D will not receive the transfer (it computes the prompt): P may free its blocks."""

    transfer_id: str
    address: str
    owner: str = ""

    def apply(self, engine: Receiver, now: float, /) -> list[Action]:
        return engine.not_needed(self.transfer_id, self.address, self.owner)


@dataclass(frozen=True, slots=True)
class AbortReceive:
    """D's request was aborted while receiving: stop P, free the blocks once fenced."""

    transfer_id: str

    def apply(self, engine: Receiver, now: float, /) -> list[Action]:
        return engine.abort(self.transfer_id, now)


SendCommand = ExpectBlocks | BlocksReady | LayersReady | ForwardFailed | Hold | AbortSend
ReceiveCommand = AwaitAdmission | AdmissionOver | RegisterBlocks | NotNeeded | AbortReceive
