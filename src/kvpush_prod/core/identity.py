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
