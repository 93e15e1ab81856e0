"""Identities on the control channel, and the NIXL agent names bound to them.

An engine's identity is its public key (the origin the channel authenticates; without keys,
its control address). Its NIXL agents are named with a tag of that identity, so a message
can claim an agent only of its own engine: a peer cannot make P write into, or D read from,
an agent that another engine announced.
"""

from __future__ import annotations

import hashlib

TAG_LEN = 12


def identity_tag(identity: str) -> str:
    """A short, stable tag of ``identity`` (hex of its SHA-256)."""
    return hashlib.sha256(identity.encode()).hexdigest()[:TAG_LEN]


def agent_name(prefix: str, identity: str) -> str:
    """The NIXL agent name ``prefix`` bound to ``identity``."""
    return f"{prefix}-{identity_tag(identity)}"


def owns_agent(identity: str, agent: str) -> bool:
    """True if ``agent`` is named for ``identity`` (only then may it speak for it)."""
    return agent.endswith("-" + identity_tag(identity))


# Ranks of one engine core: PeerInfo.rank is at most 65535.
RANK_SLOTS = 1 << 16


def dp_index_of(engine_id: str) -> int:
    """The data-parallel rank vLLM appended to ``engine_id`` (``<id>_dp<N>``), 0 if none."""
    _, sep, tail = engine_id.rpartition("_dp")
    return int(tail) if sep and tail.isdigit() and len(tail) <= 6 else 0


def peer_slot(engine_id: str, rank: int) -> int:
    """Which of its engine's ranks a peer rank is. One key may speak for several
    data-parallel engine cores behind one API server (vLLM names them ``<id>_dp<N>``), each
    with its own ranks, processes and incarnations: they must not pass for restarts of one
    another. A restarted core keeps its suffix, so a restart is still recognised."""
    return dp_index_of(engine_id) * RANK_SLOTS + rank
