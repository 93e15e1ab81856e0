"""The router's ASGI app: OpenAI endpoints, /health, /v1/models and /metrics.

``build_app(settings)`` wires pool, health monitor, dispatcher, request limits and two HTTP
clients: one for the legs, one for health checks and probes.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpush_prod.router.admin import add_admin_routes
from kvpush_prod.router.backends import BackendPool
from kvpush_prod.router.config import RouterSettings, backend_ssl_context, with_params_key
from kvpush_prod.router.health import HealthMonitor
from kvpush_prod.router.legs import CHAT_PATH, COMPLETIONS_PATH
from kvpush_prod.router.limits import Admission, LimitsMiddleware
from kvpush_prod.router.metrics import RouterMetrics
from kvpush_prod.router.proxy import Dispatcher, error_response


def build_app(
    settings: RouterSettings,
    *,
    registry: CollectorRegistry | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> FastAPI:
    """The router as a FastAPI app; backends are checked once at startup, then polled.

    ``registry`` receives the ``kvpush_router_*`` series (a fresh one if None);
    ``transport`` replaces the network for tests (e.g. ``httpx.MockTransport``; both
    clients use it). Serve it with ``router.server`` (``serve``), which adds the
    connection-level limits and the drain on SIGTERM.
    """
    settings = with_params_key(settings)  # built directly with params_key_file only
    metrics = RouterMetrics(registry=registry)
    pool = BackendPool(settings, metrics)
    admission = Admission(settings.max_concurrent_requests)

    app = FastAPI(
        title="kvpush router",
        lifespan=_lifespan(settings, pool, metrics, transport),
        docs_url=None,
        redoc_url=None,
    )
    app.add_middleware(
        LimitsMiddleware,
        admission=admission,
        metrics=metrics,
        paths=(COMPLETIONS_PATH, CHAT_PATH),
    )
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.pool = pool
    app.state.admission = admission

    _add_routes(app, settings, pool, admission, metrics)
    add_admin_routes(app, settings, pool)
    return app


def _add_routes(
    app: FastAPI,
    settings: RouterSettings,
    pool: BackendPool,
    admission: Admission,
    metrics: RouterMetrics,
) -> None:
    """The client-facing routes: the two OpenAI endpoints, health, models and metrics."""

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        dispatcher: Dispatcher = request.app.state.dispatcher
        return await dispatcher.handle(request, COMPLETIONS_PATH)

    @app.post(CHAT_PATH)
    async def chat_completions(request: Request) -> Response:
        dispatcher: Dispatcher = request.app.state.dispatcher
        return await dispatcher.handle(request, CHAT_PATH)

    @app.get("/health")
    async def health_endpoint() -> Response:
        # Draining answers 503 so load balancers move away while open streams finish.
        status = "draining" if admission.draining else "ok" if pool.ready() else "unavailable"
        body = {
            "status": status,
            "prefill": [b.describe() for b in pool.prefill],
            "decode": [b.describe() for b in pool.decode],
        }
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        client: httpx.AsyncClient = request.app.state.dispatcher.client
        return await _list_models(pool, client, settings.health_timeout_s)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)


def _lifespan(
    settings: RouterSettings,
    pool: BackendPool,
    metrics: RouterMetrics,
    transport: httpx.AsyncBaseTransport | None,
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """Startup and shutdown: the two clients, the health monitor and the dispatcher."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # One TLS context for both clients: health checks and probes verify the engines'
        # certificates exactly as the legs do, so an engine the legs would refuse is down.
        verify = backend_ssl_context(settings)
        legs_client = _client(
            settings,
            transport,
            verify,
            max_connections=settings.max_connections,
            timeout=httpx.Timeout(
                None, connect=settings.connect_timeout_s, pool=settings.pool_timeout_s
            ),
        )
        # A health check and a probe (or models refresh) per backend at most at once.
        health_client = _client(
            settings,
            transport,
            verify,
            max_connections=2 * len(pool.all) + 2,
            timeout=httpx.Timeout(settings.health_timeout_s, connect=settings.connect_timeout_s),
        )
        health = HealthMonitor(settings, pool, health_client)
        dispatcher = Dispatcher(settings, pool, health, legs_client, metrics)
        app.state.health = health
        app.state.dispatcher = dispatcher
        metrics.add_tables(
            "app",
            lambda: {
                "requests.admitted": (
                    app.state.admission.inflight,
                    settings.max_concurrent_requests,
                ),
                **dispatcher.tables(),
                **health.tables(),
                "client.legs_connections": (pooled(legs_client), settings.max_connections),
                "client.health_connections": (pooled(health_client), 2 * len(pool.all) + 2),
            },
        )
        await health.start()
        try:
            yield
        finally:
            await health.stop()
            await dispatcher.aclose()
            await legs_client.aclose()
            await health_client.aclose()

    return lifespan


async def _list_models(pool: BackendPool, client: httpx.AsyncClient, timeout: float) -> Response:
    """``GET /v1/models`` of the first up decode backend that answers; 503 if none does."""
    errors = []
    for b in pool.decode:
        if not b.up:
            continue
        try:
            r = await client.get(b.url + "/v1/models", timeout=timeout)
        except httpx.HTTPError as e:
            errors.append(f"{b.url}: {type(e).__name__}: {e}")
            continue
        return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
    down = ", ".join(f"{b.url} ({b.last_error})" for b in pool.decode if not b.up)
    detail = "; ".join(errors) if errors else f"down: {down}"
    return error_response(
        503,
        f"no healthy decode backend to list models ({detail})",
        "server_error",
        "no_backend",
    )


def pooled(client: httpx.AsyncClient) -> int:
    """Connections in ``client``'s pool now (0 where its transport keeps no pool)."""
    pool = getattr(getattr(client, "_transport", None), "_pool", None)
    return len(getattr(pool, "connections", ()))


def _client(
    settings: RouterSettings,
    transport: httpx.AsyncBaseTransport | None,
    verify: ssl.SSLContext | None,
    *,
    max_connections: int,
    timeout: httpx.Timeout,
) -> httpx.AsyncClient:
    """An HTTP client to the backends with its own pool of ``max_connections``; https://
    backends are verified with ``verify`` (None: httpx's default CAs)."""
    return httpx.AsyncClient(
        timeout=timeout,
        verify=verify if verify is not None else True,
        limits=httpx.Limits(
            max_connections=max_connections,
            max_keepalive_connections=max_connections,
            keepalive_expiry=30.0,
        ),
        transport=transport,
        headers=(
            {"Authorization": f"Bearer {settings.backend_api_key}"}
            if settings.backend_api_key
            else None
        ),
        # Backends are addressed directly; an HTTP(S)_PROXY in the environment must
        # not capture loopback or cluster-internal traffic.
        trust_env=False,
    )
