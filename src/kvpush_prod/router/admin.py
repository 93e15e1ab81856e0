"""The router's admin API: drain an engine (no new legs), undrain it, list the backends.

Off unless the router has an admin token (``admin_token_file``); every call must carry it as
``Authorization: Bearer TOKEN``. ``kvpush drain`` is its client.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvpush_prod.router.backends import BackendPool
from kvpush_prod.router.config import RouterSettings
from kvpush_prod.router.proxy import error_response

MAX_ADMIN_BODY = 4096


def _authorized(settings: RouterSettings, request: Request) -> Response | None:
    """None if the call may go on, else the answer that refuses it."""
    if settings.admin_token is None:
        return error_response(
            404,
            "the admin API is off: start the router with --admin-token-file PATH",
            "invalid_request_error",
            "admin_off",
        )
    given = request.headers.get("authorization", "")
    want = b"Bearer " + settings.admin_token
    if not hmac.compare_digest(given.encode(), want):
        return error_response(
            401,
            "missing or wrong admin token (Authorization: Bearer ...)",
            "invalid_request_error",
            "unauthorized",
        )
    return None


async def _backend_of(pool: BackendPool, request: Request) -> tuple[Any, Response | None]:
    body = await request.body()
    try:
        url = json.loads(body[:MAX_ADMIN_BODY]).get("backend") if body else None
    except (ValueError, AttributeError):
        url = None
    if not isinstance(url, str):
        return None, error_response(
            400, 'send {"backend": "http://host:port"}', "invalid_request_error", "bad_request"
        )
    b = pool.find(url)
    if b is None:
        known = ", ".join(x.url for x in pool.all)
        return None, error_response(
            404,
            f"no backend {url!r}; the router knows: {known}",
            "invalid_request_error",
            "unknown_backend",
        )
    return b, None


def add_admin_routes(app: FastAPI, settings: RouterSettings, pool: BackendPool) -> None:
    """``GET /admin/backends``, ``POST /admin/drain`` and ``POST /admin/undrain``."""

    @app.get("/admin/backends")
    async def backends(request: Request) -> Response:
        refused = _authorized(settings, request)
        if refused is not None:
            return refused
        return JSONResponse(
            {
                "prefill": [b.describe() for b in pool.prefill],
                "decode": [b.describe() for b in pool.decode],
            }
        )

    async def set_draining(request: Request, draining: bool) -> Response:
        refused = _authorized(settings, request)
        if refused is not None:
            return refused
        b, problem = await _backend_of(pool, request)
        if problem is not None:
            return problem
        pool.set_draining(b, draining)
        return JSONResponse(b.describe())

    @app.post("/admin/drain")
    async def drain(request: Request) -> Response:
        return await set_draining(request, True)

    @app.post("/admin/undrain")
    async def undrain(request: Request) -> Response:
        return await set_draining(request, False)
