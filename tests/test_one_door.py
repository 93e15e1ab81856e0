"""The driver is the one door into the core, in every shell: the connector's transfer pump,
the simulator and the stateful test world feed a Sender or Receiver only through a Driver
(``message``, ``command``, ``completed``, ``poll``, ``tick``, ``feed``), never by calling the
engine themselves. Checked by running each shell with every engine entry point guarded."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpush_prod import driver as driver_mod
from kvpush_prod.core.receiver import Receiver
from kvpush_prod.core.sender import Sender

# Every way an event reaches an engine (commands apply through these too).
ENTRY_POINTS = {
    Sender: (
        "on_message",
        "on_chunk",
        "on_peer",
        "poll",
        "tick",
        "expect_blocks",
        "blocks_ready",
        "forward_failed",
        "hold",
        "abort",
    ),
    Receiver: (
        "on_message",
        "on_chunk",
        "on_peer",
        "on_done",
        "poll",
        "tick",
        "register",
        "await_admission",
        "admission_over",
        "not_needed",
        "abort",
    ),
}
# The driver's doors: an engine entry point may run only inside one of these.
DOORS = ("feed", "apply", "_posted")


@contextlib.contextmanager
def only_through_the_driver() -> Iterator[dict[str, int]]:
    inside = threading.local()
    calls: dict[str, int] = {}
    patches: list[tuple[Any, str, Any]] = []

    def door(fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*a: Any, **kw: Any) -> Any:
            inside.depth = getattr(inside, "depth", 0) + 1
            try:
                return fn(*a, **kw)
            finally:
                inside.depth -= 1

        return wrapped

    def guarded(cls: type, name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapped(*a: Any, **kw: Any) -> Any:
            if getattr(inside, "depth", 0) == 0:
                raise AssertionError(f"{cls.__name__}.{name} called outside the driver")
            calls[f"{cls.__name__}.{name}"] = calls.get(f"{cls.__name__}.{name}", 0) + 1
            return fn(*a, **kw)

        return wrapped

    for name in DOORS:
        fn = getattr(driver_mod.Driver, name)
        patches.append((driver_mod.Driver, name, fn))
        setattr(driver_mod.Driver, name, door(fn))
    for cls, names in ENTRY_POINTS.items():
        for name in names:
            fn = getattr(cls, name)
            patches.append((cls, name, fn))
            setattr(cls, name, guarded(cls, name, fn))
    try:
        yield calls
    finally:
        for owner, name, fn in patches:
            setattr(owner, name, fn)


def test_the_connectors_pumps_feed_the_core_only_through_the_driver() -> None:
    from tests.connector.test_pump import Pair

    with only_through_the_driver() as calls:
        pair = Pair()
        pair.push()
        pair.step(6)
        assert pair.d_results.take_outcomes() == {"d-t": "pushed"}
    assert calls["Sender.blocks_ready"] and calls["Receiver.on_done"] and calls["Sender.tick"]
    assert calls["Sender.on_peer"]  # the pump's connection to D, ready


def test_the_simulator_feeds_the_core_only_through_the_driver() -> None:
    from kvpush_prod.sim.model import Workload, simulate
    from kvpush_prod.sim.presets import P5EN

    with only_through_the_driver() as calls:
        out = simulate(
            P5EN.with_(decode_kv_blocks=20_000), "kvpush", Workload(requests=6, concurrency=2)
        )
        assert out["ok"] == 6
    assert calls["Sender.blocks_ready"] and calls["Receiver.register"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_stateful_test_world_feeds_the_core_only_through_the_driver(seed: int) -> None:
    from tests.core.sim_world import Chaos, World

    with only_through_the_driver() as calls:
        w = World(1, 1, Chaos(skew=True, chunk_fail=0.2), seed)
        w.run_until(0.5)
        for _ in range(4):
            w.new_request(w.nodes["P0"], w.nodes["D0"], 2, 0)
            w.run_until(w.now + 0.05)
        w.run_until(w.now + 30.0)
        w.quiesce()
    assert calls["Sender.blocks_ready"] and calls["Receiver.register"]
