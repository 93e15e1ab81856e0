"""What the chaos load sends: a seeded, endless stream of distinct requests.

Mixed prompt lengths, output lengths, streaming or not, completions or chat; no two prompts
share even their first block, so no answer comes from a prefix-cache hit by accident, unless
the mix asks for shared prefixes (``prefix_fraction``: prompts opening with one of a few
common prefixes, as system prompts do).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvpush_prod.lab.client import completion_body
from kvpush_prod.lab.tinymodel import TinyModelSpec, _special_tokens


@dataclass(frozen=True)
class Mix:
    """The shape of the load."""

    min_prompt: int = 100
    max_prompt: int = 1900
    min_tokens: int = 16
    max_tokens: int = 32
    stream_fraction: float = 0.5
    chat_fraction: float = 0.1
    cancel_fraction: float = 0.0  # requests the client abandons on purpose
    cancel_max_s: float = 1.5  # they are abandoned at a uniform time in [0, this]
    # ... or, streaming ones with this probability, after a uniform number of tokens
    cancel_tokens_fraction: float = 0.5
    prefix_fraction: float = 0.0  # requests whose prompt opens with a shared prefix
    prefixes: int = 4  # ... one of this many (per seed)
    prefix_len: int = 256  # ... of this many tokens (at most the prompt's length - 16)


@dataclass(frozen=True)
class RequestSpec:
    """One request of the load."""

    idx: int
    prompt: str
    prompt_len: int
    max_tokens: int
    stream: bool
    chat: bool
    cancel_after: float | None = None
    cancel_after_tokens: int | None = None  # streaming: close after this many pieces

    def body(self) -> dict[str, Any]:
        return completion_body(self.prompt, self.max_tokens, self.stream, chat=self.chat)

    def reference_key(self) -> tuple[str, int, bool]:
        """Requests with the same key must get the same greedy answer."""
        return (self.prompt, self.max_tokens, self.chat)


def _words(rng: random.Random, n: int) -> str:
    first = len(_special_tokens())
    vocab = TinyModelSpec().vocab_size
    return " ".join(f"w{rng.randrange(first, vocab)}" for _ in range(n))


def make_request(idx: int, seed: int, mix: Mix) -> RequestSpec:
    """Request ``idx`` of the load seeded ``seed`` (the same pair always gives the same one)."""
    rng = random.Random(f"kvpush-chaos/{seed}/{idx}")
    n = rng.randint(mix.min_prompt, mix.max_prompt)
    prompt = _words(rng, n)
    max_tokens = rng.randint(mix.min_tokens, mix.max_tokens)
    stream = rng.random() < mix.stream_fraction
    chat = rng.random() < mix.chat_fraction
    cancel: float | None = None
    cancel_tokens: int | None = None
    if mix.cancel_fraction and rng.random() < mix.cancel_fraction:
        if stream and rng.random() < mix.cancel_tokens_fraction:
            cancel_tokens = rng.randint(1, max(1, max_tokens - 2))
        else:
            cancel = rng.uniform(0.0, mix.cancel_max_s)
    if mix.prefix_fraction and rng.random() < mix.prefix_fraction:
        prompt = _with_prefix(prompt, n, seed, rng.randrange(mix.prefixes), mix.prefix_len)
    return RequestSpec(
        idx=idx,
        prompt=prompt,
        prompt_len=n,
        max_tokens=max_tokens,
        stream=stream,
        chat=chat,
        cancel_after=cancel,
        cancel_after_tokens=cancel_tokens,
    )


def _with_prefix(prompt: str, n: int, seed: int, k: int, prefix_len: int) -> str:
    """``prompt`` (``n`` tokens) with its first tokens replaced by shared prefix ``k``."""
    take = max(0, min(prefix_len, n - 16))
    if take == 0:
        return prompt
    prefix = _words(random.Random(f"kvpush-chaos-prefix/{seed}/{k}"), prefix_len)
    return " ".join(prefix.split()[:take] + prompt.split()[take:])


def workload(seed: int, mix: Mix) -> Iterator[RequestSpec]:
    """Requests 0, 1, 2, ... of the load seeded ``seed``."""
    idx = 0
    while True:
        yield make_request(idx, seed, mix)
        idx += 1
