"""Fixtures for router tests: fake engines on free ports and a router in front of them.

Everything runs in the test's event loop; nothing starts a real vLLM engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvpush_prod.router import RouterSettings, build_app, settings_from_mapping
from kvpush_prod.router.server import limited_protocol
from tests.router.fakes import FakeVLLM, Server

# Fast health polling keeps kill/restart tests short.
FAST = {
    "health_interval_s": 0.1,
    "health_timeout_s": 1.0,
    "connect_timeout_s": 1.0,
    "first_byte_timeout_s": 5.0,
    "probe_timeout_s": 2.0,
    "models_refresh_min_interval_s": 0.0,
    # The fakes' prompts are a few tokens: these tests are about the two legs, so no request
    # goes to D alone unless a test asks (tests/router/test_direct.py).
    "direct_below_tokens": 0,
}


@dataclass
class RouterHandle:
    settings: RouterSettings
    app: Any
    server: Server
    client: httpx.AsyncClient
    registry: CollectorRegistry

    @property
    def url(self) -> str:
        return self.server.url

    def sample(self, name: str, **labels: str) -> float:
        """A metric's current value (0 if the series does not exist yet)."""
        return self.registry.get_sample_value(name, labels) or 0.0

    async def post(self, path: str, body: Any, **kw: Any) -> httpx.Response:
        return await self.client.post(self.url + path, json=body, **kw)


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Awaitable[FakeVLLM]]]:
    started: list[FakeVLLM] = []

    async def make(role: str, **kw: Any) -> FakeVLLM:
        f = await FakeVLLM(role, **kw).start()
        started.append(f)
        return f

    yield make
    await asyncio.gather(*(f.stop() for f in started))


@pytest.fixture
async def router() -> AsyncIterator[Callable[..., Awaitable[RouterHandle]]]:
    handles: list[RouterHandle] = []

    async def make(
        prefill: list[FakeVLLM | str | dict[str, Any]],
        decode: list[FakeVLLM | str],
        **overrides: Any,
    ) -> RouterHandle:
        def spec(b: FakeVLLM | str | dict[str, Any]) -> str | dict[str, Any]:
            return b.url if isinstance(b, FakeVLLM) else b

        data = {
            "prefill": [spec(b) for b in prefill],
            "decode": [spec(b) for b in decode],
            **FAST,
            **overrides,
        }
        settings = settings_from_mapping(data)
        registry = CollectorRegistry()
        app = build_app(settings, registry=registry)
        # Served as `kvpush router` serves it: with the router's connection limits.
        server = Server(app, http=limited_protocol(app.state.settings, app.state.metrics))
        await server.start()
        client = httpx.AsyncClient(timeout=10.0, trust_env=False)
        h = RouterHandle(settings, app, server, client, registry)
        handles.append(h)
        return h

    yield make
    for h in handles:
        await h.client.aclose()
    await asyncio.gather(*(h.server.stop() for h in handles))
