"""Background health checks, served-model discovery and prefill identity probes.

All of it runs off the request path: one polling task per backend, plus refresh-on-miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from typing import Any

import httpx

from kvpush_prod.router.backends import BackendPool, check_remote_key, resolve_identity
from kvpush_prod.router.config import RouterSettings
from kvpush_prod.router.legs import (
    COMPLETIONS_PATH,
    DP_RANK_HEADER,
    describe_error,
    dumps,
    probe_body,
)
from kvpush_prod.router.types import Backend, EngineLoad, PrefillIdentity, Role

log = logging.getLogger(__name__)


def _err(e: BaseException) -> str:
    return describe_error(e)


_LOAD_SERIES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}


def parse_load(text: str, now: float) -> EngineLoad:
    """Running and waiting requests (summed over the engine's cores) and the fullest core's
    KV cache usage, from vLLM's Prometheus text; only these lines are parsed."""
    got = {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        field = _LOAD_SERIES.get(name)
        if field is None:
            continue
        value = float(line.rsplit(" ", 1)[1])
        if value != value or value < 0:  # NaN or negative: not a load
            continue
        got[field] = max(got[field], value) if field == "kv_usage" else got[field] + value
    return EngineLoad(got["running"], got["waiting"], min(got["kv_usage"], 1.0), now)


# Data-parallel ranks of one API server the identity probe looks for, at most.
MAX_DP_RANKS = 256
OUT_OF_RANGE = "data-parallel rank out of range"


class HealthMonitor:
    """Keeps each backend's ``healthy``, ``models``, (for P) ``identity`` and (for D, with
    probe_decode, the default) control-channel key current.

    ``client`` is its own, never the legs' one: a pool full of streams (or of clients that
    stopped reading) must not make healthy backends look down.
    """

    def __init__(self, settings: RouterSettings, pool: BackendPool, client: httpx.AsyncClient):
        self.settings = settings
        self.pool = pool
        self.client = client
        self._tasks: list[asyncio.Task[None]] = []
        self._models_lock = asyncio.Lock()
        self._models_refreshed_at = float("-inf")
        self._key_failures: dict[str, str] = {}
        t = settings.health_timeout_s
        self._health_timeout = httpx.Timeout(t, connect=min(t, settings.connect_timeout_s))
        self._probe_timeout = httpx.Timeout(
            settings.probe_timeout_s, connect=settings.connect_timeout_s
        )

    def tables(self) -> dict[str, tuple[int, int | None]]:
        """Entries of the monitor's tables (kvpush_router_table_entries)."""
        n = len(self.pool.all)
        return {
            "health.tasks": (len(self._tasks), n),
            "health.key_failures": (len(self._key_failures), n),
        }

    async def start(self) -> None:
        """Check every backend once (so the router can serve at once), then keep polling."""
        await asyncio.gather(*(self.check(b) for b in self.pool.all))
        self._tasks = [asyncio.create_task(self._poll_forever(b)) for b in self.pool.all]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    async def _poll_forever(self, b: Backend) -> None:
        while True:
            await asyncio.sleep(self.settings.health_interval_s)
            try:
                await self.check(b)
            except Exception:  # a bug here must not end the loop: log it and poll again
                log.exception("health check of %s backend %s crashed", b.role.value, b.url)

    async def check(self, b: Backend) -> None:
        """One health round for ``b``: /health, then models and identity when needed."""
        epoch = b.epoch
        try:
            r = await self.client.get(b.url + "/health", timeout=self._health_timeout)
        except httpx.HTTPError as e:
            self.pool.mark_down(b, f"GET /health failed: {_err(e)}")
            return
        if r.status_code != 200:
            self.pool.mark_down(b, f"GET /health answered HTTP {r.status_code}")
            return
        if not b.healthy or not b.models_known:
            # Coming (back) up: the engine may have restarted with other served models.
            try:
                await self.fetch_models(b)
            except (httpx.HTTPError, ValueError) as e:
                self.pool.mark_down(b, f"GET /v1/models failed: {_err(e)}")
                return
        if b.role is Role.PREFILL and not b.identity_complete and b.needs_identity:
            await self.probe(b, epoch)
        if b.role is Role.DECODE and b.needs_key and not b.key_probed:
            await self.probe_decode_key(b, epoch)
        if self.settings.policy in ("engine_load", "link_aware"):
            await self.read_load(b)
        self.pool.mark_healthy(b, epoch)

    async def read_load(self, b: Backend) -> None:
        """The engine's own load from its /metrics; on failure the last reading stays (an
        engine that cannot answer /metrics but answers /health is not taken out for it)."""
        try:
            r = await self.client.get(b.url + "/metrics", timeout=self._health_timeout)
            r.raise_for_status()
            b.load = parse_load(r.text, time.monotonic())
        except (httpx.HTTPError, ValueError) as e:
            log.debug("reading the load of %s failed: %s", b.url, _err(e))

    async def fetch_models(self, b: Backend) -> None:
        r = await self.client.get(b.url + "/v1/models", timeout=self._health_timeout)
        r.raise_for_status()
        data = r.json()
        try:
            ids = [str(m["id"]) for m in data["data"]]
        except (KeyError, TypeError) as e:
            raise ValueError(f"unexpected /v1/models body {data!r}") from e
        self.pool.set_models(b, ids)

    async def probe(self, b: Backend, epoch: int) -> None:
        """Learn P's identity from one tiny request; leaves it None (P unused) on failure.

        A P whose answer names a ``dp_rank`` (a data-parallel engine core behind its API
        server) is probed once per DP rank, 0, 1, ... until vLLM answers that the rank is out
        of range (vLLM's ``X-data-parallel-rank`` header; the engine cores of a dense model
        do not know how many they are): each core has its own control port, and a P leg is
        pinned to the core D registers with."""
        if not b.models:
            self.pool.set_identity(b, None, "cannot probe identity: /v1/models lists no model")
            return
        identity, error = await self._probe_identity(b, epoch, None)
        if b.epoch != epoch:
            return  # marked down while probing: the next good poll probes again
        if identity is None:
            self.pool.set_identity(b, None, error)
            return
        ranks: dict[int, PrefillIdentity] = {}
        if identity.dp_rank is not None:
            probed = await self._probe_ranks(b, epoch)
            if probed is None:
                return
            ranks = probed
        if ranks:
            if identity.dp_size not in (1, len(ranks)):
                self.pool.set_identity(
                    b,
                    None,
                    (
                        f"P says it has {identity.dp_size} data-parallel ranks but answered "
                        f"for {len(ranks)}"
                    ),
                )
                return
            identity = dataclasses.replace(identity, dp_size=len(ranks))
            ranks = {r: dataclasses.replace(i, dp_size=len(ranks)) for r, i in ranks.items()}
        log.info(
            "prefill backend %s identity %s%s",
            b.url,
            identity,
            f" ({len(ranks)} data-parallel ranks)" if ranks else "",
        )
        self.pool.set_identity(b, identity, None, ranks)

    async def _probe_ranks(self, b: Backend, epoch: int) -> dict[int, PrefillIdentity] | None:
        """The identity of each data-parallel rank of ``b``, probed 0, 1, ... until vLLM
        answers that the rank is out of range. None when a probe failed (``b``'s identity
        then says why) or ``b`` was marked down meanwhile."""
        ranks: dict[int, PrefillIdentity] = {}
        for rank in range(MAX_DP_RANKS):
            got, error = await self._probe_identity(b, epoch, rank)
            if b.epoch != epoch:
                return None
            if got is None and rank > 0 and error.startswith(OUT_OF_RANGE):
                break  # every rank seen
            if got is None:
                self.pool.set_identity(b, None, error)
                return None
            if got.dp_rank != rank:
                self.pool.set_identity(
                    b,
                    None,
                    (
                        f"identity probe of data-parallel rank {rank} was answered by rank "
                        f"{got.dp_rank}: this vLLM ignores the X-data-parallel-rank header, so a "
                        "decode engine cannot know which engine core holds a request's KV; run "
                        "one API server per DP rank (--data-parallel-rank / "
                        "--data-parallel-external-lb) and list each as a prefill backend"
                    ),
                )
                return None
            ranks[rank] = got
        return ranks

    async def _probe_identity(
        self, b: Backend, epoch: int, rank: int | None
    ) -> tuple[PrefillIdentity | None, str]:
        """One probe (pinned to DP ``rank`` when given): the identity, or None and why."""
        at = "" if rank is None else f" (data-parallel rank {rank})"
        try:
            r = await self._post_probe(b, rank)
        except httpx.HTTPError as e:
            return None, f"identity probe{at} failed: {_err(e)}"
        if r.status_code == 400 and rank is not None and "out of range" in r.text:
            return None, f"{OUT_OF_RANGE}: {r.text[:300]}"
        if r.status_code != 200:
            return None, f"identity probe{at} answered HTTP {r.status_code}: {r.text[:300]}"
        try:
            params = r.json().get("kv_transfer_params")
            return resolve_identity(params if isinstance(params, dict) else None, b.overrides), ""
        except (ValueError, AttributeError) as e:
            return None, f"identity probe{at}: {e}"

    async def _post_probe(self, b: Backend, rank: int | None = None) -> httpx.Response:
        # Not signed: a probe authorizes nothing (an engine answers it with its public
        # identity and holds nothing), so engines answer it without a signature, and a
        # signed leg names a transfer a probe does not have.
        body = probe_body(b.models[0])
        headers = {
            "Content-Type": "application/json",
            "X-Request-Id": f"kvpush-probe-{uuid.uuid4().hex}",
        }
        if rank is not None:
            headers[DP_RANK_HEADER] = str(rank)
        return await self.client.post(
            b.url + COMPLETIONS_PATH,
            content=dumps(body),
            headers=headers,
            timeout=self._probe_timeout,
        )

    async def probe_decode_key(self, b: Backend, epoch: int) -> None:
        """Learn D's control-channel key from the same probe. On failure D stays out of
        rotation (why: in /health) and the next poll asks again: a leg to a D whose key is
        unknown would go to P without ``decode_key``, and P would take a registration for
        it from any engine holding a valid key."""
        failure = None
        try:
            r = await self._post_probe(b) if b.models else None
        except httpx.HTTPError as e:
            r, failure = None, f"key probe failed: {_err(e)}"
        if b.epoch != epoch:
            return
        if r is None:
            failure = failure or "cannot probe the key: /v1/models lists no model"
        elif r.status_code != 200:
            failure = f"key probe answered HTTP {r.status_code}: {r.text[:300]}"
        else:
            try:
                params = r.json().get("kv_transfer_params")
                key = check_remote_key(
                    params.get("remote_key") if isinstance(params, dict) else None
                )
            except (ValueError, AttributeError) as e:
                failure = f"key probe: {e}"
            else:
                self.pool.set_decode_key(b, key)
                self._key_failures.pop(b.url, None)
                return
        self.pool.set_decode_key_failure(b, failure)
        if self._key_failures.get(b.url) != failure:  # one failing every poll is logged once
            self._key_failures[b.url] = failure
            log.warning(
                "decode backend %s: %s; not routed to until its key is known "
                "(--no-probe-decode routes without it)",
                b.url,
                failure,
            )

    def note_prefill_response(self, b: Backend, body: bytes) -> None:
        """Pick up a changed identity (P restarted between polls) from a P leg's answer."""
        ident = b.identity
        if ident is None or b"remote_engine_id" not in body:
            return
        known = [ident, *b.ranks.values()]
        if any(b'"remote_engine_id":"' + i.engine_id.encode() + b'"' in body for i in known):
            return  # the usual case, same engine (or one of its DP ranks): no need to parse
        try:
            params: Any = json.loads(body).get("kv_transfer_params")
            identity = resolve_identity(params, b.overrides)
        except (ValueError, AttributeError):
            return
        if identity.dp_rank is not None or ident.dp_rank is not None:
            # Restarted with data parallelism (before or now): every rank's identity may
            # have changed; probe them all again before the next leg.
            log.warning(
                "prefill backend %s changed identity (data-parallel engine): "
                "probing its ranks again",
                b.url,
            )
            self.pool.set_identity(b, None, "identity changed: probing its ranks again")
            return
        if identity != b.identity:
            log.warning(
                "prefill backend %s changed identity: %s -> %s", b.url, b.identity, identity
            )
            self.pool.set_identity(b, identity, None)

    async def knows_model(self, model: str) -> bool:
        """Whether some backend serves ``model``; on a miss, refresh the lists once first."""
        if self.pool.knows_model(model):
            return True
        await self.refresh_models()
        return self.pool.knows_model(model)

    async def refresh_models(self) -> None:
        async with self._models_lock:
            now = time.monotonic()
            if now - self._models_refreshed_at < self.settings.models_refresh_min_interval_s:
                return
            self._models_refreshed_at = now
            targets = [b for b in self.pool.all if b.healthy]
            results = await asyncio.gather(
                *(self.fetch_models(b) for b in targets), return_exceptions=True
            )
            for b, res in zip(targets, results, strict=True):
                if isinstance(res, BaseException):
                    log.warning("refreshing models of %s failed: %s", b.url, _err(res))
