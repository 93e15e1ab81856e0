"""Protocol versions: which ones this build speaks, how two engines settle on one, and the
refusal of a peer outside them (docs/protocol.md, "Versions").

The wire protocol is versioned apart from the package. A build speaks its own version and
the one before (N-1). Every REGISTER names the versions its sender speaks (the layout fact
``protocols``, "2-3"); an engine that does not name them (protocol 2, kvpush-prod 0.1.0)
speaks only the version of its messages. Each side then talks to each peer the highest
version both speak: P from D's REGISTER, D from the version P's messages come in. A
message to a peer not heard from yet goes in the oldest version this build speaks, which
every peer of the previous release reads. Pure: no sockets, no clocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from kvpush_prod.core.messages import PROTOCOL_VERSION, ControlMessage, Register

CURRENT = PROTOCOL_VERSION
OLDEST = CURRENT - 1  # N-1: the previous release's protocol, spoken in both directions
FACT = "protocols"  # the layout fact naming the versions a REGISTER's sender speaks
UPGRADES = "docs/operations.md, 'Upgrades'"


def spoken(lo: int = OLDEST, hi: int = CURRENT) -> str:
    """A range of versions as a fact and in messages: "2-3", or "2" for one."""
    return str(lo) if lo == hi else f"{lo}-{hi}"


def advertised(facts: Mapping[str, str], v: int) -> tuple[int, int]:
    """The versions a peer speaks, from its layout facts: ``protocols`` ("2-3"), else the
    single ``protocol`` an older build names, else the version ``v`` its message came in."""
    text = facts.get(FACT, "")
    lo, sep, hi = text.partition("-")
    try:
        if text:
            a, b = int(lo), int(hi if sep else lo)
            if 0 < a <= b:
                return a, b
        one = int(facts.get("protocol", v))
    except ValueError:
        return v, v
    return one, one


def settle(theirs: tuple[int, int], ours: tuple[int, int] = (OLDEST, CURRENT)) -> int | None:
    """The highest version both ranges hold (None: they share none)."""
    top = min(theirs[1], ours[1])
    return top if top >= max(theirs[0], ours[0]) else None


def accepts(msg: ControlMessage) -> bool:
    """Whether this build takes ``msg``: its version is one this build speaks, or it is the
    first REGISTER of a peer one release older (in that peer's oldest version, N-2 here)
    that names a version this build speaks too (the answer then goes in that one)."""
    if OLDEST <= msg.v <= CURRENT:
        return True
    if isinstance(msg, Register) and msg.v == OLDEST - 1 and msg.sender.layout is not None:
        return settle(advertised(msg.sender.layout.facts, msg.v)) is not None
    return False


def refusal(msg: ControlMessage) -> str:
    """Why ``msg``'s version is refused: both sides' versions and the upgrade that fixes it."""
    theirs = (msg.v, msg.v)
    if isinstance(msg, Register) and msg.sender.layout is not None:
        theirs = advertised(msg.sender.layout.facts, msg.v)
    peer = f"protocol {msg.v} (the peer speaks {spoken(*theirs)})"
    here = f"this engine speaks {spoken()} (kvpush-prod supports its own protocol and N-1)"
    if theirs[1] < OLDEST:
        fix = (
            "the peer runs a release more than one protocol version older: upgrade it to "
            f"a release that speaks {OLDEST} or later (upgrade one release at a time, {UPGRADES})"
        )
    else:
        fix = (
            "the peer runs a release more than one protocol version newer: upgrade this "
            f"engine first (a fleet may span two adjacent protocol versions, {UPGRADES})"
        )
    return f"{peer}, {here}: {fix}"


@dataclass
class _Peer:
    incarnation: int | None  # None: known only from a DONE (``done_heard``), not its messages
    version: int
    noted: bool = False


@dataclass(frozen=True)
class Fallback:
    """A peer first settled below this build's version: talked to in ``version``."""

    address: str
    engine_id: str
    version: int
    theirs: str  # the versions it speaks, as known


class PeerVersions:
    """The version settled on with each peer (a control address; its process incarnation:
    a restarted peer, perhaps on another release, is settled anew), at most ``limit``
    peers (the least recently heard forgotten first: a forgotten one is talked to in
    ``OLDEST`` until heard again)."""

    def __init__(self, limit: int = 4096) -> None:
        self._limit = max(1, limit)
        self._peers: OrderedDict[str, _Peer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def heard(self, msg: ControlMessage) -> Fallback | None:
        """Take what ``msg`` (accepted) says of its sender's versions; a ``Fallback`` the
        first time a peer incarnation is settled below ``CURRENT`` (to count and log)."""
        who = msg.sender
        theirs = (msg.v, msg.v)
        if isinstance(msg, Register) and who.layout is not None:
            theirs = advertised(who.layout.facts, msg.v)
            version = settle(theirs) or OLDEST
        else:
            version = max(OLDEST, min(msg.v, CURRENT))  # it speaks what it sent
        peer = self._peers.get(who.control)
        if peer is not None and peer.incarnation is None:
            peer.incarnation, peer.version = who.incarnation, version  # its own word now
        elif peer is None or peer.incarnation != who.incarnation:
            peer = _Peer(who.incarnation, version)
            self._peers[who.control] = peer
        elif isinstance(msg, Register):
            peer.version = version  # its own word: what it speaks
        else:
            peer.version = max(peer.version, version)
        self._touch(who.control)
        if peer.version < CURRENT and not peer.noted:
            peer.noted = True
            return Fallback(who.control, who.engine_id, peer.version, spoken(*theirs))
        return None

    def done_heard(self, address: str, engine_id: str, version: int) -> Fallback | None:
        """A DONE of protocol ``version`` was taken from the prefill at ``address``: a DONE
        travels as a NIXL notification, not a control message, so a D may take an older
        P's pushes without hearing any of its messages. A ``Fallback`` (to count and log)
        the first time this says a peer not known to speak ``CURRENT`` sent an older one."""
        peer = self._peers.get(address)
        if version >= CURRENT or (peer is not None and peer.version >= CURRENT):
            return None  # a peer heard speaking ours settled below it with us, not older
        if peer is None:
            peer = self._peers[address] = _Peer(None, max(OLDEST, version))
        self._touch(address)
        if peer.noted:
            return None
        peer.noted = True
        return Fallback(address, engine_id, peer.version, spoken(version, version))

    def _touch(self, address: str) -> None:
        self._peers.move_to_end(address)
        while len(self._peers) > self._limit:
            self._peers.popitem(last=False)

    def version_for(self, address: str) -> int:
        """The version to talk to the peer at ``address`` in."""
        peer = self._peers.get(address)
        return peer.version if peer is not None else OLDEST
