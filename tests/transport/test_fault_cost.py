"""FaultyTransport passes on the wrapped transport's record of a post's cost only for posts
that reached it: an injected failure posted nothing, so it reports no descriptors."""

from __future__ import annotations

from typing import Any

import pytest

from kvpush_prod.core import messages as m
from kvpush_prod.transport.base import ChunkFailed, RemotePeer
from kvpush_prod.transport.faults import FaultSettings, FaultyTransport

LAYOUT = m.Layout("c", "DRAM", [m.Region(0, 100, 100, 64)])


class Inner:
    def __init__(self) -> None:
        self.last_post: Any = None
        self.posts = 0

    def post(
        self, op: str, peer: RemotePeer, local: list[int], remote: list[int], notif: bytes = b""
    ) -> Any:
        self.posts += 1
        self.last_post = ("cost", self.posts)
        return self.posts


def test_the_cost_of_a_real_post_is_passed_on_and_an_injected_failure_has_none() -> None:
    inner = Inner()
    faulty = FaultyTransport(inner, FaultSettings(enabled=True, fail_nth=2))  # type: ignore[arg-type]
    peer = RemotePeer("agent-d", LAYOUT, None)
    faulty.post("WRITE", peer, [1], [2])
    assert faulty.last_post == ("cost", 1)
    with pytest.raises(ChunkFailed):
        faulty.post("WRITE", peer, [1], [2])
    assert faulty.last_post is None and inner.posts == 1
    faulty.post("WRITE", peer, [1], [2])
    assert faulty.last_post == ("cost", 2)


def test_a_wrapped_transport_without_a_record_reports_none() -> None:
    class Bare:
        def post(self, *args: Any) -> Any:
            return 1

    faulty = FaultyTransport(Bare(), FaultSettings(enabled=True))  # type: ignore[arg-type]
    faulty.post("WRITE", RemotePeer("agent-d", LAYOUT, None), [1], [2])
    assert faulty.last_post is None
