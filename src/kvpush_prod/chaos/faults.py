"""How the nemesis applies each kind of fault to a running cluster and takes it back: kill -9
and restart, graceful restart, SIGSTOP/SIGCONT, drain/undrain through the router's admin API,
injected WRITE failures (P's switch file), a keyed flood, and, with engines in network
namespaces (``lab.netns``), a partition (the namespace's end of its link down) or a throttled
link (``tc tbf`` on both ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpush_prod.chaos.harness import Context, admin_token_file, fault_switch
from kvpush_prod.chaos.schedule import Fault
from kvpush_prod.lab.netns import heal, partition, throttle, unthrottle

THROTTLE_RATE = "10mbit"


@dataclass
class Applied:
    """A fault as the nemesis applied it (seconds on the load's clock)."""

    fault: Fault
    engines: set[str]
    delay_s: float = 0.0  # how much later than planned it started
    start: float | None = None
    end: float | None = None
    notes: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        f = self.fault
        return {
            "id": f.id,
            "kind": f.kind,
            "engine": f.engine,
            "peer": f.peer,
            "planned_at": f.at,
            "hold_s": f.hold_s,
            "engines": sorted(self.engines),
            "delay_s": round(self.delay_s, 1),
            "start": None if self.start is None else round(self.start, 2),
            "end": None if self.end is None else round(self.end, 2),
            **self.notes,
        }


def touched_engines(ctx: Context, f: Fault) -> set[str]:
    """The engines a fault touches: its engine; all P for WRITE failures (one switch file
    serves every P); the target and the flooding engine for a flood."""
    if f.kind == "write_fail":
        return set(ctx.cluster.prefill_names)
    if f.kind == "flood" and f.peer:
        return {f.engine, f.peer}
    return {f.engine}


class Faults:
    """Applies faults to ``ctx.cluster``; ``apply`` returns once the fault is over (for kill
    and restart: once the engine serves again)."""

    def __init__(self, ctx: Context, flood_rate: int = 2000) -> None:
        self.ctx = ctx
        self.flood_rate = flood_rate
        self._switch_users = 0
        self._admin = admin_token_file(ctx.cluster.spec.workdir)

    async def apply(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        """Apply ``f``; ``begun`` is set the moment it takes effect. What it saw."""
        kinds = {
            "kill": self._kill,
            "restart": self._restart,
            "stop": self._stop,
            "drain": self._drain,
            "write_fail": self._write_fail,
            "flood": self._flood,
            "partition": self._partition,
            "throttle": self._throttle,
        }
        return await kinds[f.kind](f, begun)

    async def _back(self, engine: str) -> dict[str, Any]:
        waited = await self.ctx.wait_router_ready(timeout=90.0, engine=engine)
        return {"router_back_s": None if waited is None else round(waited, 1)}

    async def _kill(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        await self.ctx.kill(f.engine)
        begun.set()
        secs = await self.ctx.restart(f.engine)
        return {"restart_s": round(secs, 1), **await self._back(f.engine)}

    async def _restart(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        begun.set()
        secs = await self.ctx.restart(f.engine, graceful=True)
        return {"restart_s": round(secs, 1), **await self._back(f.engine)}

    async def _stop(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        proc = self.ctx.cluster.procs[f.engine]
        proc.signal_tree(signal.SIGSTOP)
        begun.set()
        try:
            await asyncio.sleep(f.hold_s)  # the fault's length, not a wait for something
        finally:
            proc.signal_tree(signal.SIGCONT)
        return {}

    async def _admin_call(self, what: str, engine: str) -> int:
        token = self._admin.read_text().strip()
        async with httpx.AsyncClient(trust_env=False) as client:
            r = await client.post(
                self.ctx.cluster.urls["router"] + f"/admin/{what}",
                json={"backend": self.ctx.cluster.urls[engine]},
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            )
        return r.status_code

    async def _drain(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        status = await self._admin_call("drain", f.engine)
        begun.set()
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            undrain = await self._admin_call("undrain", f.engine)
        return {"drain_status": status, "undrain_status": undrain}

    async def _write_fail(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        switch = fault_switch(self.ctx.cluster.spec.workdir)
        self._switch_users += 1
        switch.touch()
        begun.set()
        try:
            await asyncio.sleep(f.hold_s)
        finally:
            self._switch_users -= 1
            if self._switch_users == 0:
                switch.unlink(missing_ok=True)
        return {}

    async def _flood(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        c = self.ctx.cluster
        assert f.peer is not None
        cmd = [
            sys.executable,
            "-m",
            "kvpush_prod.chaos.flood",
            "--endpoint",
            f"tcp://{c.specs[f.engine].address}:{c.control_ports[f.engine]}",
            "--server-key-file",
            str(c.keys_dir / f"{f.engine}.key"),
            "--key-file",
            str(c.key_file(f.peer)),
            "--seconds",
            str(f.hold_s),
            "--rate",
            str(self.flood_rate),
        ]
        proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        begun.set()
        try:
            out, _ = await asyncio.wait_for(proc.communicate(), f.hold_s + 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        return {"flood": out.decode(errors="replace").strip()[-300:], "rc": proc.returncode}

    def _netns(self, engine: str) -> str:
        """The namespace ``engine`` runs in (``lab.netns``)."""
        placed = self.ctx.cluster.spec.netns.get(engine)
        if placed is None:
            raise RuntimeError(
                f"{engine} does not run in a network namespace: partition and throttle "
                "need a cluster with ClusterSpec.netns (kvpush chaos nemesis --netns)"
            )
        return placed[0]

    async def _netns_hold(
        self,
        f: Fault,
        begun: asyncio.Event,
        on: Callable[[], list[str]],
        off: Callable[[], list[str]],
    ) -> dict[str, Any]:
        done = await asyncio.to_thread(on)
        begun.set()
        try:
            await asyncio.sleep(f.hold_s)  # the fault's length, not a wait for something
        finally:
            done += await asyncio.to_thread(off)
        return {"commands": done}

    async def _partition(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        ns = self._netns(f.engine)
        return await self._netns_hold(f, begun, lambda: partition(ns), lambda: heal(ns))

    async def _throttle(self, f: Fault, begun: asyncio.Event) -> dict[str, Any]:
        ns = self._netns(f.engine)
        on = lambda: throttle(ns, THROTTLE_RATE)  # noqa: E731
        return await self._netns_hold(f, begun, on, lambda: unthrottle(ns))

    def release_all(self) -> None:
        """Undo what a fault cut short left behind (a stopped engine, the switch file, a
        link down or throttled)."""
        fault_switch(self.ctx.cluster.spec.workdir).unlink(missing_ok=True)
        for proc in self.ctx.cluster.procs.values():
            with contextlib.suppress(Exception):
                proc.signal_tree(signal.SIGCONT)
        for ns, _ in self.ctx.cluster.spec.netns.values():
            with contextlib.suppress(Exception):
                unthrottle(ns)
                heal(ns)
