"""A transfer split across tensor-parallel ranks: the books of its sub-transfers and joins.

Pure (no I/O, no clock): which parts make a request, when it has ended and how, and which
id each link carries on the wire are protocol decisions, so they live in the core; the
worker shell only feeds it what its pump sees.

When P and D run different tensor-parallel sizes (``core.tpmap``), one request's transfer
is several *sub-transfers*, one per (P rank, D rank) link, each an ordinary transfer of the
core. This module keeps the books: which sub-transfers make up a request on this
rank (``Joins``: the request is reported once every part ended), which id a link carries
on the wire (``Links``, D side: several P ranks feeding one D rank all name the transfer by
its own id, so D tells their parts apart by the generation it granted each), and what a P
rank that feeds several D ranks replays to a part it learns of late (``Splits``).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvpush_prod.core import messages as m
from kvpush_prod.core import tpmap
from kvpush_prod.core.vocabulary import Outcome

MAX_REMEMBERED = 65_536  # links and splits remembered (oldest forgotten first)

_WITH_ID = (
    m.Register,
    m.Cancel,
    m.CancelAck,
    m.Failed,
    m.Fallback,
    m.PullDone,
    m.DoneQuery,
    m.DoneState,
)


@dataclass(eq=False)
class Join:
    """The parts of one request's transfer on this rank; it ends when the last part ends."""

    base: str
    left: set[str]
    ok: bool = True
    outcome: Outcome | None = None  # the first part's outcome that was not a delivery
    nbytes: int = 0


class Joins:
    """Parts -> their join. A part not in any join is a transfer of its own."""

    def __init__(self) -> None:
        self._of: OrderedDict[str, Join] = OrderedDict()

    def split(self, base: str, parts: list[str]) -> Join:
        """``base`` is made of ``parts`` (idempotent; parts already known keep their join)."""
        join = self._of.get(base) or Join(base, set())
        for part in parts:
            if part not in self._of:
                join.left.add(part)
                self._of[part] = join
        while len(self._of) > MAX_REMEMBERED:
            self._of.popitem(last=False)
        return join

    def __len__(self) -> int:
        return len(self._of)

    def of(self, part: str) -> Join | None:
        return self._of.get(part)

    def parts(self, base: str) -> list[str]:
        """The parts of ``base`` not ended yet (``[base]`` when it was never split)."""
        join = self._of.get(base)
        return sorted(join.left) if join is not None else [base]

    def end(self, part: str, ok: bool, outcome: Outcome, nbytes: int = 0) -> Join | None:
        """``part`` ended; the join when it was the last part (then forgotten), else None.
        A part of no join is returned as a join of one."""
        join = self._of.pop(part, None)
        if join is None:
            return Join(part, set(), ok, outcome, nbytes)
        join.left.discard(part)
        join.nbytes += nbytes
        if not ok or not outcome.delivered:
            join.ok = join.ok and ok
            if join.outcome is None or join.outcome.delivered:
                join.outcome = outcome
        elif join.outcome is None:
            join.outcome = outcome
        if join.left:
            return None
        return join

    def drop(self, base: str) -> None:
        """Forget ``base`` and its parts (the request ended before any was needed)."""
        join = self._of.get(base)
        if join is None:
            return
        for part in [p for p, j in self._of.items() if j is join]:
            del self._of[part]


@dataclass(frozen=True)
class Link:
    """One sub-transfer of a D rank: the core's id for it, the id on the wire, the P rank."""

    core_id: str
    wire_id: str
    p_rank: int
    d_first: int = 0  # first head of this D rank's that the link fills
    heads: int = 0  # heads it fills (0: the whole block)


def d_links(
    tid: str, d_rank: int, d_tp: int, p_tp: int, total_heads: int, replicated: bool
) -> list[Link]:
    """The sub-transfers D rank ``d_rank`` receives for ``tid`` from a P of ``p_tp`` ranks
    (raises ValueError when the sizes cannot be mapped: ``tpmap.problem``)."""
    if p_tp in (0, d_tp) and not replicated:
        return [Link(tid, tid, d_rank)]
    pieces = tpmap.feeders(d_rank, p_tp, d_tp, total_heads, replicated)
    out = []
    for pc in pieces:
        wire = tpmap.sub_id(tid, pc, tpmap.lead(pc.p_rank, p_tp, d_tp, total_heads, replicated))
        core = wire if len(pieces) == 1 else f"{wire}{tpmap.SUB_SEP}p{pc.p_rank}"
        out.append(Link(core, wire, pc.p_rank, pc.d_first, 0 if pc.whole_d else pc.heads))
    return out


class Links:
    """D side: the core's ids <-> the wire's, for links whose ids differ (a D rank fed by
    several P ranks: each P rank names the transfer by its own id, and D tells them apart by
    the generation of the REGISTER it sent that P rank)."""

    def __init__(self) -> None:
        self._wire: OrderedDict[str, str] = OrderedDict()  # core id -> wire id
        self._by_rank: OrderedDict[tuple[str, int], str] = OrderedDict()  # (wire, P rank)
        self._by_gen: OrderedDict[tuple[str, int], str] = OrderedDict()  # (wire, generation)

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the id maps, each bounded by ``MAX_REMEMBERED``."""
        return {
            "links.wire": (len(self._wire), MAX_REMEMBERED),
            "links.by_rank": (len(self._by_rank), MAX_REMEMBERED),
            "links.by_generation": (len(self._by_gen), MAX_REMEMBERED),
        }

    def add(self, link: Link) -> None:
        if link.core_id == link.wire_id:
            return
        self._put(self._wire, link.core_id, link.wire_id)
        self._put(self._by_rank, (link.wire_id, link.p_rank), link.core_id)

    @staticmethod
    def _put(d: OrderedDict[Any, str], key: Any, value: str) -> None:
        d[key] = value
        d.move_to_end(key)
        while len(d) > MAX_REMEMBERED:
            d.popitem(last=False)

    def outbound(self, msg: m.ControlMessage) -> m.ControlMessage:
        """``msg`` as the P rank it goes to knows the transfer (a Register's generation is
        remembered: the P rank's answers carry it)."""
        if isinstance(msg, m.Heartbeat):
            if not self._wire or not any(t in self._wire for t, _ in msg.live):
                return msg
            return msgspec.structs.replace(
                msg, live=[(self._wire.get(t, t), g) for t, g in msg.live]
            )
        if isinstance(msg, _WITH_ID):
            wire = self._wire.get(msg.transfer_id)
            if wire is None:
                return msg
            if isinstance(msg, m.Register):
                self._put(self._by_gen, (wire, msg.generation), msg.transfer_id)
            return msgspec.structs.replace(msg, transfer_id=wire)
        return msg

    def inbound(self, msg: m.ControlMessage) -> m.ControlMessage:
        """``msg`` from a P rank, with the transfer named by the core's id."""
        if not self._wire:
            return msg
        if isinstance(msg, m.Heartbeat):
            live = [(self._core(t, g, msg.sender.rank), g) for t, g in msg.live]
            return msgspec.structs.replace(msg, live=live)
        if isinstance(msg, _WITH_ID):
            core = self._core(msg.transfer_id, msg.generation, msg.sender.rank)
            return (
                msg if core == msg.transfer_id else msgspec.structs.replace(msg, transfer_id=core)
            )
        return msg

    def done(self, done: m.Done) -> m.Done:
        """A DONE notification with the transfer named by the core's id (by generation:
        a notification does not say which P rank sent it)."""
        core = self._by_gen.get((done.transfer_id, done.generation))
        return done if core is None else msgspec.structs.replace(done, transfer_id=core)

    def _core(self, wire: str, generation: int, p_rank: int) -> str:
        return self._by_gen.get((wire, generation)) or self._by_rank.get((wire, p_rank)) or wire


@dataclass
class _Known:
    """What P's engine told the shell of a transfer (replayed to a part learnt late)."""

    owner: str = ""
    expected: bool = False
    blocks: tuple[int, ...] | None = None
    held: bool = False
    failed: bool = False
    prompt: bytes = b""  # digest of the prompt's token ids (core.digest)
    # Layer-wise push: the first ``layers`` of ``parts`` layers of ``layer_blocks`` are
    # computed (the forward still runs while ``blocks`` is None)
    layer_blocks: tuple[int, ...] = ()
    layers: int = 0
    parts: int = 1


@dataclass
class Splits:
    """P side: a P rank that feeds several D ranks (P's TP < D's) runs one sub-transfer per
    D rank. It learns D's size from the first REGISTER of the transfer (any of its D ranks),
    then makes every part at once; what the engine already said of the transfer is replayed
    to the new parts, and what it says later goes to all parts."""

    p_rank: int
    p_tp: int
    total_heads: int
    replicated: bool = False
    joins: Joins = field(default_factory=Joins)
    known: OrderedDict[str, _Known] = field(default_factory=OrderedDict)
    ended: OrderedDict[str, None] = field(default_factory=OrderedDict)  # bases released

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the parts, the engine's facts and the bases released (each bounded
        by ``MAX_REMEMBERED``)."""
        return {
            "splits.parts": (len(self.joins), MAX_REMEMBERED),
            "splits.known": (len(self.known), MAX_REMEMBERED),
            "splits.ended": (len(self.ended), MAX_REMEMBERED),
        }

    def note(self, tid: str) -> _Known:
        """The engine's facts of ``tid`` (to update before fanning a command out)."""
        k = self.known.get(tid)
        if k is None:
            k = self.known[tid] = _Known()
            while len(self.known) > MAX_REMEMBERED:
                self.known.popitem(last=False)
        return k

    def parts(self, tid: str) -> list[str]:
        return self.joins.parts(tid)

    def on_register(self, reg: m.Register) -> tuple[str, list[str], _Known | None]:
        """A REGISTER from a D rank: (base, the parts made now, what to replay to them);
        no parts when nothing splits (same sizes, already split, base ended, or the
        mapping is refused: the core then refuses the REGISTER with the reason)."""
        layout = reg.sender.layout
        base = tpmap.base_of(reg.transfer_id)
        if (
            layout is None
            or layout.tp_size <= self.p_tp
            or base in self.ended
            or self.joins.of(base) is not None
        ):
            return base, [], None
        d_tp = layout.tp_size
        if tpmap.problem(self.p_tp, d_tp, self.total_heads, self.replicated):
            return base, [], None
        lead = tpmap.lead(self.p_rank, self.p_tp, d_tp, self.total_heads, self.replicated)
        parts = [
            tpmap.sub_id(base, pc, lead)
            for pc in tpmap.fed(self.p_rank, self.p_tp, d_tp, self.total_heads, self.replicated)
        ]
        if reg.transfer_id not in parts or len(parts) < 2:
            return base, [], None
        self.joins.split(base, parts)
        return base, [p for p in parts if p != base], self.known.get(base)

    def end(self, part: str, ok: bool, outcome: Outcome, nbytes: int) -> Join | None:
        join = self.joins.end(part, ok, outcome, nbytes)
        if join is not None:
            self.known.pop(join.base, None)
            self.ended[join.base] = None
            while len(self.ended) > MAX_REMEMBERED:
                self.ended.popitem(last=False)
        return join

    def forget(self, tid: str) -> None:
        """The request ended before its KV was computed (AbortSend): nothing to join."""
        self.joins.drop(tid)
        self.known.pop(tid, None)
