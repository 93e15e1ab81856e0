"""Graceful drain on SIGTERM, against the real ``python -m kvpush_prod.router`` process.

A slow stream is open when the signal comes: it finishes, new requests get 503, /health
says draining, then the process exits; the drain deadline or a second SIGTERM cut it short.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.router.fakes import MODEL, FakeVLLM, wait_until

SRC = Path(__file__).resolve().parents[2] / "src"
STREAM = {"model": MODEL, "prompt": "w10 w11", "max_tokens": 4, "stream": True}
_LISTENING = re.compile(r"running on (http://\S+)")


@dataclass
class RouterProcess:
    proc: asyncio.subprocess.Process
    url: str = ""
    lines: list[str] = field(default_factory=list)
    reader: asyncio.Task[None] | None = None

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def exit_code(self, timeout: float) -> int:
        try:
            code = await asyncio.wait_for(self.proc.wait(), timeout)
        except asyncio.TimeoutError:
            raise AssertionError(f"router still running after {timeout} s:\n{self.log}") from None
        if self.reader is not None:
            await asyncio.wait_for(self.reader, 5)  # its last lines
        return code


async def _read_lines(rp: RouterProcess, found: asyncio.Future[str]) -> None:
    assert rp.proc.stderr is not None
    async for raw in rp.proc.stderr:
        line = raw.decode(errors="replace")
        rp.lines.append(line)
        m = _LISTENING.search(line)
        if m and not found.done():
            found.set_result(m.group(1))
    if not found.done():
        found.set_exception(AssertionError(f"router exited before listening:\n{rp.log}"))


@pytest.fixture
async def router_process() -> AsyncIterator[Callable[..., Awaitable[RouterProcess]]]:
    started: list[RouterProcess] = []

    async def start(p: FakeVLLM, d: FakeVLLM, *flags: str) -> RouterProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), *sys.path])}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvpush_prod.router", "--prefill", p.url, "--decode", d.url,
            "--port", "0", "--health-interval", "0.1", "--direct-below-tokens", "0", *flags,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env=env,
        )  # fmt: skip
        rp = RouterProcess(proc)
        found: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        rp.reader = asyncio.create_task(_read_lines(rp, found))
        started.append(rp)
        rp.url = await asyncio.wait_for(found, 30)
        return rp

    yield start
    for rp in started:
        if rp.proc.returncode is None:
            rp.proc.kill()
            await rp.proc.wait()
        if rp.reader is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(rp.reader, 5)


async def _draining(client: httpx.AsyncClient, url: str) -> bool:
    return (await client.get(url + "/health")).json()["status"] == "draining"


async def _open_stream(
    client: httpx.AsyncClient, url: str, stack: contextlib.AsyncExitStack
) -> tuple[AsyncIterator[bytes], bytes]:
    resp = await stack.enter_async_context(client.stream("POST", url + "/v1/completions",
                                                          json=STREAM))  # fmt: skip
    assert resp.status_code == 200
    chunks = resp.aiter_raw()
    return chunks, await asyncio.wait_for(chunks.__anext__(), 10)


async def _wait_up(client: httpx.AsyncClient, url: str) -> None:
    for _ in range(200):
        with contextlib.suppress(httpx.HTTPError):
            if (await client.get(url + "/health")).status_code == 200:
                return
        await asyncio.sleep(0.05)
    raise AssertionError("router never became healthy")


async def test_sigterm_drains_open_streams_refuses_new_requests_then_exits(fakes, router_process):
    p, d = await fakes("prefill"), await fakes("decode")
    d.gate = asyncio.Event()  # the stream stays open until the test lets it finish
    rp = await router_process(p, d)
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client, \
            contextlib.AsyncExitStack() as stack:  # fmt: skip
        await _wait_up(client, rp.url)
        chunks, got = await _open_stream(client, rp.url, stack)

        rp.signal()
        for _ in range(100):
            if await _draining(client, rp.url):
                break
            await asyncio.sleep(0.05)
        health = await client.get(rp.url + "/health")
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert health.headers["connection"] == "close"  # load balancers reconnect elsewhere
        refused = await client.post(rp.url + "/v1/completions", json={**STREAM, "stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "draining"
        assert "retry-after" in refused.headers
        await wait_until(lambda: "for 1 open" in rp.log, 10, "the drain to count the stream")
        await asyncio.sleep(0.3)  # a few ticks: the open stream keeps the router up
        assert rp.proc.returncode is None and "drained" not in rp.log

        d.gate.set()
        async for chunk in chunks:
            got += chunk
    assert got.endswith(b"data: [DONE]\n\n")
    assert await rp.exit_code(15) == 0, rp.log
    assert "drained" in rp.log
    assert len(d.requests) == 1  # the refused request never reached an engine


async def test_the_drain_deadline_closes_streams_still_open_and_exits(fakes, router_process):
    p, d = await fakes("prefill"), await fakes("decode")
    d.gate = asyncio.Event()  # never set: the stream outlives the drain
    rp = await router_process(p, d, "--drain-timeout", "1")
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client, \
            contextlib.AsyncExitStack() as stack:  # fmt: skip
        await _wait_up(client, rp.url)
        chunks, _ = await _open_stream(client, rp.url, stack)

        rp.signal()
        await wait_until(lambda: "draining: refusing new requests" in rp.log, 10, "draining")
        assert "for 1 open" in rp.log
        assert await rp.exit_code(20) == 0, rp.log
        with pytest.raises(httpx.HTTPError):  # the stream was cut, not finished
            async for _ in chunks:
                pass
    assert "drain deadline passed with 1 requests open" in rp.log
    assert "Traceback" not in rp.log  # streams ended as closed by their clients, not crashed
    # D's leg was closed by the router (vLLM would abort the request).
    await wait_until(lambda: d.requests[0].disconnected.is_set(), 10, "D's leg closed")


async def test_a_second_sigterm_closes_open_streams_and_exits_at_once(fakes, router_process):
    p, d = await fakes("prefill"), await fakes("decode")
    d.gate = asyncio.Event()
    rp = await router_process(p, d, "--drain-timeout", "600")
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client, \
            contextlib.AsyncExitStack() as stack:  # fmt: skip
        await _wait_up(client, rp.url)
        # Kept referenced: a started iterator that is collected closes its stream.
        chunks, _ = await _open_stream(client, rp.url, stack)

        rp.signal()
        await wait_until(lambda: "draining: refusing new requests" in rp.log, 10, "draining")
        assert "for 1 open" in rp.log
        rp.signal()
        assert await rp.exit_code(15) == 0, rp.log  # far sooner than the 600 s drain
        del chunks
    assert "second signal: closing 1 open requests now" in rp.log, rp.log
    await wait_until(lambda: d.requests[0].disconnected.is_set(), 10, "D's leg closed")
    assert "Traceback" not in rp.log
