"""Which prefill rank feeds which decode rank, and with which KV heads, when P and D run
different tensor-parallel sizes (pure arithmetic: no tensors, no bytes).

Heads are split across ranks in contiguous groups (vLLM's rule: rank ``i`` of ``tp`` serves
heads ``[i*H/tp, (i+1)*H/tp)``). A *piece* is what moves between one P rank and one D rank:
``heads`` heads starting at head ``p_first`` of P's rank-local range and ``d_first`` of D's.
With ``replicated`` (MLA: one latent per layer on every rank) each D rank is fed the whole
block by exactly one P rank.
"""

from __future__ import annotations

from dataclasses import dataclass

# Sub-transfer ids (``<tid>#<tag>`` on the links that are not the transfer's lead link, see
# ``sub_id``) are words: the tracer's span exporter reads them too.
from kvpush_prod.vocabulary import SUB_SEP as SUB_SEP
from kvpush_prod.vocabulary import base_of as base_of


@dataclass(frozen=True, slots=True)
class Piece:
    """What one P rank sends one D rank, in heads of each side's rank-local range."""

    p_rank: int
    d_rank: int
    p_first: int  # first head inside the P rank's local heads
    d_first: int  # first head inside the D rank's local heads
    heads: int
    p_local: int  # heads the P rank holds
    d_local: int  # heads the D rank holds

    @property
    def whole_p(self) -> bool:
        return self.p_first == 0 and self.heads == self.p_local

    @property
    def whole_d(self) -> bool:
        return self.d_first == 0 and self.heads == self.d_local


def problem(p_tp: int, d_tp: int, total_heads: int, replicated: bool = False) -> str:
    """Why a P of ``p_tp`` ranks cannot feed a D of ``d_tp`` ranks ("" if it can), with
    what to change."""
    if p_tp < 1 or d_tp < 1 or total_heads < 1:
        return (
            f"tensor-parallel sizes {p_tp} (prefill) and {d_tp} (decode) with "
            f"{total_heads} KV heads: all must be at least 1"
        )
    if p_tp == d_tp or replicated:
        return ""
    big, small = max(p_tp, d_tp), min(p_tp, d_tp)
    if big % small:
        return (
            f"prefill --tensor-parallel-size {p_tp} and decode --tensor-parallel-size "
            f"{d_tp}: one must divide the other; run sizes such as 1, 2, 4, 8"
        )
    if total_heads % big:
        return (
            f"the model's {total_heads} KV heads do not split evenly over "
            f"--tensor-parallel-size {big} (prefill {p_tp}, decode {d_tp}); kvpush does "
            f"not move replicated KV heads between different tensor-parallel sizes: use a "
            f"tensor-parallel size that divides {total_heads} on both, or the same size"
        )
    return ""


def pieces(p_tp: int, d_tp: int, total_heads: int, replicated: bool = False) -> list[Piece]:
    """Every (P rank, D rank) piece, D rank by D rank; raises ValueError if ``problem``."""
    why = problem(p_tp, d_tp, total_heads, replicated)
    if why:
        raise ValueError(why)
    if replicated or p_tp == d_tp:
        # Equal TP: rank to rank. Replicated: D rank r from P rank r mod p_tp, so no P rank
        # sends the same bytes to one D rank twice and the senders are spread evenly.
        return [
            Piece(
                r % p_tp,
                r,
                0,
                0,
                _local(total_heads, p_tp, replicated),
                _local(total_heads, p_tp, replicated),
                _local(total_heads, d_tp, replicated),
            )
            for r in range(d_tp)
        ]
    hp, hd = total_heads // p_tp, total_heads // d_tp
    out = []
    for r in range(d_tp):
        for s in range(p_tp):
            lo, hi = max(s * hp, r * hd), min((s + 1) * hp, (r + 1) * hd)
            if lo < hi:
                out.append(Piece(s, r, lo - s * hp, lo - r * hd, hi - lo, hp, hd))
    return out


def _local(total: int, tp: int, replicated: bool) -> int:
    return total if replicated else max(1, total // tp)


def feeders(
    d_rank: int, p_tp: int, d_tp: int, total_heads: int, replicated: bool = False
) -> list[Piece]:
    """The pieces D rank ``d_rank`` receives, by P rank."""
    return [p for p in pieces(p_tp, d_tp, total_heads, replicated) if p.d_rank == d_rank]


def fed(
    p_rank: int, p_tp: int, d_tp: int, total_heads: int, replicated: bool = False
) -> list[Piece]:
    """The pieces P rank ``p_rank`` sends, by D rank."""
    return [p for p in pieces(p_tp, d_tp, total_heads, replicated) if p.p_rank == p_rank]


def idle(p_tp: int, d_tp: int, total_heads: int, replicated: bool = False) -> list[int]:
    """The P ranks that feed no D rank (replicated KV with more P ranks than D ranks): they
    hold a prompt's blocks all the same, and must be told that no REGISTER will come."""
    if p_tp <= d_tp:
        return []  # every P rank feeds at least one D rank
    feeding = {p.p_rank for p in pieces(p_tp, d_tp, total_heads, replicated)}
    return [r for r in range(p_tp) if r not in feeding]


def unfed_told_by(
    d_rank: int,
    p_tp: int,
    d_tp: int,
    total_heads: int,
    replicated: bool = False,
    refused: bool = False,
) -> list[int]:
    """The P ranks D rank ``d_rank`` tells that a transfer will not be received: those
    that feed no D rank, or every P rank when D ``refused`` the transfer; each P rank is
    told by exactly one D rank (P rank mod D's TP). ``p_tp`` 0: not told, same as D's."""
    p_tp = p_tp or d_tp
    unfed = range(p_tp) if refused else idle(p_tp, d_tp, total_heads, replicated)
    return [r for r in unfed if r % d_tp == d_rank]


def piece(
    p_rank: int, d_rank: int, p_tp: int, d_tp: int, total_heads: int, replicated: bool = False
) -> Piece | None:
    """The piece between one P rank and one D rank (None: they exchange nothing)."""
    for p in pieces(p_tp, d_tp, total_heads, replicated):
        if p.p_rank == p_rank and p.d_rank == d_rank:
            return p
    return None


def sub_id(tid: str, p: Piece, lead_d_rank: int) -> str:
    """The transfer id the link of piece ``p`` carries for transfer ``tid``.

    The *lead* link of a P rank (to ``lead_d_rank``, the first D rank it feeds: ``lead``)
    carries ``tid`` itself, so a P rank that feeds one D rank (P's TP >= D's) never renames
    anything; a P rank that feeds several D ranks (P's TP < D's) sees ``tid#d<r>`` from the
    others and splits its transfer into one sub-transfer per D rank.
    """
    if p.d_rank == lead_d_rank:
        return tid
    return f"{tid}{SUB_SEP}d{p.d_rank}"


def lead(p_rank: int, p_tp: int, d_tp: int, total_heads: int, replicated: bool = False) -> int:
    """The first D rank P rank ``p_rank`` feeds (-1: none, e.g. replicated with more P ranks)."""
    ranks = [p.d_rank for p in fed(p_rank, p_tp, d_tp, total_heads, replicated)]
    return min(ranks) if ranks else -1


def mapping_text(p_tp: int, d_tp: int, total_heads: int, replicated: bool = False) -> str:
    """One line for the log: who feeds whom with which heads."""
    if problem(p_tp, d_tp, total_heads, replicated):
        return "no mapping"
    parts = []
    for p in pieces(p_tp, d_tp, total_heads, replicated):
        parts.append(
            f"P{p.p_rank}[{p.p_first}:{p.p_first + p.heads}]->"
            f"D{p.d_rank}[{p.d_first}:{p.d_first + p.heads}]"
        )
    kind = "replicated" if replicated else f"{total_heads} KV heads"
    return f"prefill TP {p_tp} -> decode TP {d_tp}, {kind}: " + ", ".join(parts)
