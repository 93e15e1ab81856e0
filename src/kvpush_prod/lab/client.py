"""A small OpenAI-API client for the demo, tests, benchmarks and chaos scripts.

Measures TTFT and inter-token latency on streaming responses; never raises for HTTP errors.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Result:
    """What one request produced."""

    status: int = 0
    text: str = ""
    error: str = ""
    ttft: float | None = None  # seconds to the first token
    itl: list[float] = field(default_factory=list)  # gaps between tokens
    latency: float = 0.0
    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error


def completion_body(
    prompt: str,
    max_tokens: int,
    stream: bool,
    model: str = "tiny",
    chat: bool = False,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
        **extra,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _piece(obj: dict[str, Any], chat: bool) -> str:
    choices = obj.get("choices") or []
    if not choices:
        return ""
    c = choices[0]
    if chat:
        return (c.get("delta") or c.get("message") or {}).get("content") or ""
    return c.get("text") or ""


async def request(
    client: httpx.AsyncClient,
    base_url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout: float = 120.0,
) -> Result:
    """POST a completion (chat if ``messages`` is in the body) and gather the result."""
    chat = "messages" in body
    url = base_url.rstrip("/") + ("/v1/chat/completions" if chat else "/v1/completions")
    res = Result()
    t0 = time.perf_counter()
    try:
        if not body.get("stream"):
            return await _whole(client, url, body, headers, timeout, chat, res, t0)
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as r:
            res.status = r.status_code
            if r.status_code != 200:
                res.error = (await r.aread()).decode(errors="replace")[:500]
                res.latency = time.perf_counter() - t0
                return res
            await _read_events(r, chat, res, t0)
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - t0
    return res


async def _whole(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str] | None,
    timeout: float,
    chat: bool,
    res: Result,
    t0: float,
) -> Result:
    """``request`` without streaming: one answer, gathered into ``res``."""
    r = await client.post(url, json=body, headers=headers, timeout=timeout)
    res.status = r.status_code
    res.latency = time.perf_counter() - t0
    data = r.json()
    if r.status_code != 200:
        res.error = json.dumps(data)[:500]
        return res
    res.text = _piece(data, chat)
    res.ttft = res.latency
    res.kv_transfer_params = data.get("kv_transfer_params")
    res.finish_reason = (data.get("choices") or [{}])[0].get("finish_reason")
    res.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
    return res


async def _read_events(r: httpx.Response, chat: bool, res: Result, t0: float) -> None:
    """Gather a streamed answer's server-sent events into ``res``: its text, first-token
    time and gaps between tokens, usage, transfer parameters and finish reason."""
    last = t0
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            break
        obj = json.loads(payload)
        if "error" in obj:
            res.error = json.dumps(obj["error"])[:500]
            break
        piece = _piece(obj, chat)
        if obj.get("usage"):
            res.prompt_tokens = obj["usage"].get("prompt_tokens")
        if obj.get("kv_transfer_params"):
            res.kv_transfer_params = obj["kv_transfer_params"]
        fr = (obj.get("choices") or [{}])[0].get("finish_reason")
        if fr:
            res.finish_reason = fr
        if piece:
            now = time.perf_counter()
            if res.ttft is None:
                res.ttft = now - t0
            else:
                res.itl.append(now - last)
            last = now
            res.text += piece


def scrape(
    base_url: str, timeout: float = 10.0
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``base_url``/metrics as {(name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout).text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of samples named ``name`` whose labels include ``labels``."""
    total = 0.0
    for (n, lbls), v in samples.items():
        if n != name:
            continue
        d = dict(lbls)
        if all(d.get(k) == val for k, val in labels.items()):
            total += v
    return total
