"""Fake vLLM OpenAI servers (prefill and decode) and a uvicorn runner for router tests.

They answer like vLLM (completions and chat, JSON and SSE), record what they got, and can
hang, fail, die mid-stream or wait for each other, as a test needs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

MODEL = "tiny"


@dataclass
class Seen:
    """One request a fake got."""

    path: str
    headers: dict[str, str]
    body: dict[str, Any]
    scheme: str = "http"  # "https" when it arrived over TLS
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)


Hook = Callable[["FakeVLLM", Seen], Awaitable[Response | None]]


class Server:
    """A uvicorn server in the test's event loop, on 127.0.0.1 and a chosen or free port."""

    def __init__(self, app: Any, **config: Any) -> None:
        self.app = app
        self.config = config  # uvicorn.Config arguments over the defaults below
        self.port = 0
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.config.get("ssl_certfile") else "http"
        return f"{scheme}://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets whose
        # proto says TCP, and without it Nagle + delayed ACK add 40 ms to every answer.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.port = sock.getsockname()[1]
        kwargs: dict[str, Any] = {
            "log_config": None,
            "log_level": "critical",
            "access_log": False,
            "lifespan": "on",
            "timeout_graceful_shutdown": 1,
            "timeout_keep_alive": 30,
            **self.config,
        }
        self._server = uvicorn.Server(uvicorn.Config(self.app, **kwargs))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        deadline = time.monotonic() + 10
        while not self._server.started:
            if self._task.done():
                self._task.result()
                raise RuntimeError("uvicorn exited during startup")
            if time.monotonic() > deadline:
                raise TimeoutError("uvicorn did not start within 10 s")
            await asyncio.sleep(0.005)

    async def stop(self, *, kill: bool = False) -> None:
        """Stop; ``kill`` drops open connections at once, as when a process dies."""
        if self._server is None or self._task is None:
            return
        if kill:
            # uvicorn's force_exit leaves requests in progress running; a dead process
            # would drop their connections, so do that (test-only use of uvicorn internals).
            for conn in list(self._server.server_state.connections):
                conn.transport.abort()
            for t in list(self._server.server_state.tasks):
                t.cancel()
        self._server.should_exit = True
        self._server.force_exit = kill
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, 5)
        self._server = None
        self._task = None


class FakeVLLM:
    """One fake engine. Knobs are plain attributes a test sets before sending requests."""

    def __init__(
        self,
        role: str,
        *,
        models: tuple[str, ...] = (MODEL,),
        engine_id: str | None = None,
        control_port: int = 5600,
        tls: dict[str, Any] | None = None,
    ) -> None:
        self.role = role
        # uvicorn's TLS arguments (ssl_certfile, ssl_keyfile, ssl_ca_certs, ssl_cert_reqs),
        # as vLLM's --ssl-* flags pass them: served over https://; read again by restart().
        self.tls = dict(tls or {})
        self.models = models
        self.engine_id = engine_id or f"engine-{uuid.uuid4().hex[:8]}"
        self.control_host = "10.0.0.7"
        self.control_port = control_port
        self.tp_size = 1
        # Data parallelism behind this API server: engine cores 0..dp_size-1, each with its
        # engine id suffixed _dp<rank> and its own control port (as vLLM and kvpush do). A
        # request goes to the rank named by X-data-parallel-rank, else to the next in turn
        # (vLLM's own balancing); with dp_header_honoured False the header is ignored.
        self.dp_size = 1
        self.dp_header_honoured = True
        self.dp_size_known = False  # a dense model's engine cores do not know dp_size
        self._next_rank = 0
        self._rank_of: dict[str, int] = {}
        # The engine's control-channel public key (Z85), or None: an engine without keys.
        self.remote_key: str | None = None
        self.requests: list[Seen] = []  # completions and chat, probes excluded
        self.probes: list[Seen] = []
        self.arrived = asyncio.Event()  # set on the first non-probe request
        # Behaviour knobs.
        self.health_status = 200
        self.status = 200  # for completions/chat (not probes)
        self.probe_status = 200  # for probes
        self.tokens = ["w4", " w5", " w6", " w7"]
        self.hook: Hook | None = None  # awaited first; a Response it returns is sent as is
        self.hang = False  # never answer: wait for the client to go away
        self.hang_stream = False  # send 200 headers, then no byte until the client goes
        self.die_after_chunks: int | None = None  # raise mid-stream after this many chunks
        # End answers unfinished after this many tokens, as vLLM does when it stops (SIGTERM)
        # while decoding: finish_reason "abort", or streamed, a usage event and [DONE] with no
        # finish reason.
        self.abort_after: int | None = None
        self.chunk_delay = 0.0
        self.gate: asyncio.Event | None = None  # streamed: wait on it before the last token
        # What /metrics reports (vLLM's series the engine_load policy reads).
        self.running, self.waiting, self.kv_usage = 0, 0, 0.0
        self.server = Server(self._build(), **self.tls)

    @property
    def url(self) -> str:
        return self.server.url

    async def start(self, port: int = 0) -> FakeVLLM:
        await self.server.start(port)
        return self

    async def stop(self) -> None:
        await self.server.stop(kill=True)

    async def restart(self, engine_id: str | None = None) -> None:
        port = self.server.port
        await self.stop()
        if engine_id is not None:
            self.engine_id = engine_id
        self.server = Server(self._build(), **self.tls)
        await self.server.start(port)

    # -- vLLM-shaped bodies --------------------------------------------------------------

    def identity_params(self, request_id: str) -> dict[str, Any]:
        rank = self._rank_of.get(request_id, 0)
        dp = self.dp_size > 1
        out: dict[str, Any] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [[1, 2]],
            "remote_engine_id": f"{self.engine_id}_dp{rank}" if dp else self.engine_id,
            "remote_request_id": request_id,
            "remote_host": self.control_host,
            "remote_port": self.control_port + rank * self.tp_size,
            "tp_size": self.tp_size,
        }
        if dp:
            out["dp_rank"] = rank
            if self.dp_size_known:
                out["dp_size"] = self.dp_size
        if self.remote_key is not None:
            out["remote_key"] = self.remote_key
        return out

    def probe_answer(self, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        """A probe's answer: P's identity; a D with a key answers its identity too, a D
        without keys like vLLM (``kv_transfer_params: null``)."""
        out = self.full_body(path, body, rid)
        if self.role == "decode" and self.remote_key is not None:
            out["kv_transfer_params"] = self.identity_params(rid)
        return out

    def full_body(self, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        n = min(int(body.get("max_tokens") or len(self.tokens)), len(self.tokens))
        finish = "length"
        if self.abort_after is not None and self.role == "decode":
            n, finish = min(n, self.abort_after), "abort"
        text = "".join(self.tokens[:n])
        ktp = self.identity_params(rid) if self.role == "prefill" else None
        common = {"created": 1, "model": body.get("model", MODEL)}
        usage = {"prompt_tokens": 3, "total_tokens": 3 + n, "completion_tokens": n}
        if path.endswith("/chat/completions"):
            return {
                "id": f"chatcmpl-{rid}",
                "object": "chat.completion",
                **common,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "finish_reason": finish,
                    }
                ],
                "usage": usage,
                "kv_transfer_params": ktp,
            }
        return {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            **common,
            "choices": [
                {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish,
                    "stop_reason": None,
                }
            ],
            "usage": usage,
            "kv_transfer_params": ktp,
        }

    def sse_events(self, path: str, body: dict[str, Any], rid: str) -> list[bytes]:
        chat = path.endswith("/chat/completions")
        events = []
        tokens = self.tokens if self.abort_after is None else self.tokens[: self.abort_after]
        for i, tok in enumerate(tokens):
            last = i == len(self.tokens) - 1
            if chat:
                chunk = {
                    "id": f"chatcmpl-{rid}",
                    "object": "chat.completion.chunk",
                    "created": 1,
                    "model": body.get("model", MODEL),
                    "choices": [
                        {
                            "index": 0,
                            "delta": {"content": tok}
                            if i
                            else {"role": "assistant", "content": tok},
                            "finish_reason": "length" if last else None,
                        }
                    ],
                }
            else:
                chunk = {
                    "id": f"cmpl-{rid}",
                    "object": "text_completion",
                    "created": 1,
                    "model": body.get("model", MODEL),
                    "choices": [
                        {
                            "index": 0,
                            "text": tok,
                            "logprobs": None,
                            "finish_reason": "length" if last else None,
                        }
                    ],
                }
            events.append(f"data: {json.dumps(chunk)}\n\n".encode())
        if self.abort_after is not None:
            usage = {"id": f"cmpl-{rid}", "choices": [], "usage": {"completion_tokens": 0}}
            events.append(f"data: {json.dumps(usage)}\n\n".encode())
        events.append(b"data: [DONE]\n\n")
        return events

    # -- the app -------------------------------------------------------------------------

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=self.health_status)

        @app.get("/metrics")
        async def metrics() -> Response:
            text = (
                "# TYPE vllm:num_requests_running gauge\n"
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {self.running}\n'
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {self.waiting}\n'
                "# TYPE vllm:kv_cache_usage_perc gauge\n"
                f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {self.kv_usage}\n'
            )
            return Response(text, media_type="text/plain")

        @app.get("/v1/models")
        async def models() -> Response:
            data = [
                {"id": m, "object": "model", "created": 1, "owned_by": "vllm", "root": m}
                for m in self.models
            ]
            return JSONResponse({"object": "list", "data": data})

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            return await self._generate(request, "/v1/completions")

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._generate(request, "/v1/chat/completions")

        return app

    async def _generate(self, request: Request, path: str) -> Response:
        body = await request.json()
        seen = Seen(path, dict(request.headers), body, request.url.scheme)
        rid = request.headers.get("x-request-id", uuid.uuid4().hex)
        if self.dp_size > 1:
            pinned = request.headers.get("x-data-parallel-rank")
            if pinned is not None and self.dp_header_honoured:
                if not 0 <= int(pinned) < self.dp_size:  # vLLM's own answer
                    return JSONResponse(
                        {
                            "error": {
                                "message": f"data_parallel_rank {pinned} is out of range "
                                f"[0, {self.dp_size}).",
                                "type": "BadRequestError",
                                "param": None,
                                "code": 400,
                            }
                        },
                        status_code=400,
                    )
                self._rank_of[rid] = int(pinned)
            else:
                self._rank_of[rid] = self._next_rank % self.dp_size
                self._next_rank += 1
        if (body.get("kv_transfer_params") or {}).get("kvpush_probe"):
            self.probes.append(seen)
            if self.probe_status != 200:
                return JSONResponse(
                    {"error": {"message": "fake probe failure"}}, status_code=self.probe_status
                )
            return JSONResponse(self.probe_answer(path, body, rid))
        self.requests.append(seen)
        self.arrived.set()
        if self.hook is not None:
            answer = await self.hook(self, seen)
            if answer is not None:
                return answer
        if self.hang:
            while not await request.is_disconnected():
                await asyncio.sleep(0.01)
            seen.disconnected.set()
            return Response(status_code=499)
        if self.status != 200:
            return JSONResponse(
                {
                    "error": {
                        "message": f"fake {self.role} failure",
                        "type": "InternalServerError" if self.status >= 500 else "BadRequestError",
                        "param": None,
                        "code": self.status,
                    }
                },
                status_code=self.status,
            )
        if body.get("stream"):
            return StreamingResponse(
                self._stream(path, body, rid, seen), media_type="text/event-stream"
            )
        seen.finished.set()
        return JSONResponse(self.full_body(path, body, rid))

    async def _stream(
        self, path: str, body: dict[str, Any], rid: str, seen: Seen
    ) -> AsyncIterator[bytes]:
        try:
            if self.hang_stream:
                await asyncio.Event().wait()
            events = self.sse_events(path, body, rid)
            for i, ev in enumerate(events):
                if self.die_after_chunks is not None and i == self.die_after_chunks:
                    raise RuntimeError("fake decode engine died mid-stream")
                if self.gate is not None and i == len(events) - 2:
                    await self.gate.wait()
                if self.chunk_delay:
                    await asyncio.sleep(self.chunk_delay)
                yield ev
            seen.finished.set()
        except asyncio.CancelledError:
            seen.disconnected.set()
            raise


async def wait_until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Poll ``cond`` until true; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what or cond}")
        await asyncio.sleep(0.01)
