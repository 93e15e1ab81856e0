"""How long a request's prompt is, in tokens, without the model's tokenizer.

The router uses it to choose between transferring the KV and sending a short prompt straight
to D (``direct_below_tokens``); docs/router.md, "Short prompts: straight to D", states the
error of each estimate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from kvpush_prod.router.legs import CHAT_PATH

# A chat template wraps every message in its role and markers (Llama 3: 4 special tokens and
# the role; ChatML: 3 and the role), and adds the generation prompt and a BOS token.
CHAT_TOKENS_PER_MESSAGE = 4
CHAT_TOKENS_PER_REQUEST = 3
# A text prompt to /v1/completions gets the tokenizer's BOS token (vLLM: add_special_tokens).
BOS_TOKENS = 1
# Chat content parts the router can size: text. Any other part (an image, audio, a video, a
# file) is a number of tokens only the engine knows.
_TEXT_PARTS = frozenset({"text", "input_text"})


@dataclass(frozen=True)
class PromptSize:
    """A prompt's length in tokens: ``tokens`` is ``cap`` or more when it reached the cap
    given (the exact figure above it does not matter); ``None`` when it cannot be told (an
    image, prompt embeddings, no prompt at all): such a request is never sent to D alone.
    ``exact``: the client sent token ids."""

    tokens: int | None
    exact: bool = False

    def below(self, threshold: int) -> bool:
        return self.tokens is not None and self.tokens < threshold


_UNKNOWN = PromptSize(None)


class _Over(Exception):
    """The running count reached the cap: stop counting."""


class _Unsized(Exception):
    """Something in the prompt has no length the router can tell."""


class _Counter:
    """A running token count, stopped at ``cap`` so a 16 MiB prompt costs no more than a
    short one to decide on."""

    def __init__(self, chars_per_token: float, cap: int) -> None:
        self.chars_per_token = chars_per_token
        self.cap = cap
        self.total = 0

    def add(self, n: int) -> None:
        self.total += n
        if self.total >= self.cap:
            raise _Over()

    def text(self, s: str) -> None:
        """ASCII runs ``chars_per_token`` characters per token; every other character counts
        one token per byte of its UTF-8 encoding; and one token a whitespace-separated word
        when that is more. A byte-level BPE tokenizer (SentencePiece with byte fallback
        likewise, plus its leading space) makes at most one token per UTF-8 byte, so a
        string estimated at ``n`` tokens is at most ``chars_per_token * n`` real ones,
        whatever a client writes: the bound that keeps a long prompt off D. A string of
        ``cap * chars_per_token`` characters or more is over the cap unread."""
        if len(s) >= self.cap * self.chars_per_token:
            raise _Over()
        ascii_chars = len(s.encode("ascii", "ignore"))
        other_bytes = len(s.encode("utf-8", "surrogatepass")) - ascii_chars
        by_chars = math.ceil(ascii_chars / self.chars_per_token) + other_bytes
        self.add(max(by_chars, len(s.split())))

    def json(self, obj: Any) -> None:
        """Structured text the template writes out (tool schemas, tool calls): sized as its
        JSON."""
        self.text(json.dumps(obj, separators=(",", ":"), ensure_ascii=False))


def prompt_tokens(path: str, body: dict[str, Any], chars_per_token: float, cap: int) -> PromptSize:
    """The number of tokens ``body``'s prompt is estimated to be, counted up to ``cap``.

    /v1/completions: a list of token ids (or of such lists) counts exactly; text counts by
    ``_Counter.text`` plus a BOS token. /v1/chat/completions: every message's text parts
    and tool calls, the request's tools and documents, plus the template's markers. A
    prompt of several prompts counts them all.
    """
    counter = _Counter(chars_per_token, cap)
    try:
        if path == CHAT_PATH:
            _chat(counter, body)
            return PromptSize(counter.total)
        exact = _completion(counter, body)
        return PromptSize(counter.total, exact=exact)
    except _Over:
        return PromptSize(cap, exact=False)
    except _Unsized:
        return _UNKNOWN


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(type(t) is int for t in v)


def _completion(counter: _Counter, body: dict[str, Any]) -> bool:
    """Count a completion's prompt; True when it was token ids (counted exactly)."""
    if body.get("prompt_embeds") is not None:
        raise _Unsized()
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        counter.text(prompt)
        counter.add(BOS_TOKENS)
    elif isinstance(prompt, list) and prompt:
        # A list of token ids, or a batch: strings or token-id lists. Each element is one
        # token at least, so a list as long as the cap is over it before looking inside.
        if len(prompt) >= counter.cap:
            raise _Over()
        if _is_ids(prompt):
            counter.add(len(prompt))
        elif all(_is_ids(p) for p in prompt):
            for p in prompt:
                counter.add(len(p))
        elif all(isinstance(p, str) for p in prompt):
            for p in prompt:
                counter.text(p)
                counter.add(BOS_TOKENS)
            return False
        else:
            raise _Unsized()
        return True
    else:
        raise _Unsized()
    suffix = body.get("suffix")
    if isinstance(suffix, str):
        counter.text(suffix)
    return False


def _chat(counter: _Counter, body: dict[str, Any]) -> None:
    """Count a chat's prompt: every message's role and content, anything else a message
    carries (tool calls, a name, reasoning) as its JSON, the request's tools, documents and
    template arguments as theirs, and the template's markers. A chat template of the
    client's own (``chat_template``) could write anything: such a request is unsized."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or body.get("chat_template") is not None:
        raise _Unsized()
    counter.add(CHAT_TOKENS_PER_REQUEST)
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role", ""), str):
            raise _Unsized()
        counter.add(CHAT_TOKENS_PER_MESSAGE)
        counter.text(m.get("role", ""))
        _content(counter, m.get("content"))
        rest = {k: v for k, v in m.items() if k not in ("role", "content") and v is not None}
        if rest:
            counter.json(rest)
    for key in ("tools", "documents", "chat_template_kwargs"):
        if body.get(key):
            counter.json(body[key])


def _content(counter: _Counter, content: Any) -> None:
    if content is None:
        return
    if isinstance(content, str):
        counter.text(content)
        return
    if not isinstance(content, list):
        raise _Unsized()
    for part in content:
        if isinstance(part, str):
            counter.text(part)
        elif (
            isinstance(part, dict)
            and part.get("type") in _TEXT_PARTS
            and isinstance(part.get("text"), str)
        ):
            counter.text(part["text"])
        else:
            raise _Unsized()
