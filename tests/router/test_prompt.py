"""The router's prompt-length estimate (router/prompt.py): token ids exactly, text by
characters with a floor of one token a word, chat with its template's markers, and what it
cannot size."""

from __future__ import annotations

import pytest

from kvpush_prod.lab.tinymodel import prompt_of_length
from kvpush_prod.router.legs import CHAT_PATH, COMPLETIONS_PATH
from kvpush_prod.router.prompt import (
    BOS_TOKENS,
    CHAT_TOKENS_PER_MESSAGE,
    CHAT_TOKENS_PER_REQUEST,
    PromptSize,
    prompt_tokens,
)

CAP = 10_000


def completion(prompt: object, **extra: object) -> PromptSize:
    return prompt_tokens(COMPLETIONS_PATH, {"prompt": prompt, **extra}, 3.0, CAP)


def chat(messages: object, **extra: object) -> PromptSize:
    return prompt_tokens(CHAT_PATH, {"messages": messages, **extra}, 3.0, CAP)


def test_token_ids_count_exactly() -> None:
    assert completion(list(range(17))) == PromptSize(17, exact=True)
    assert completion([[1, 2, 3], [4, 5]]) == PromptSize(5, exact=True)


@pytest.mark.parametrize(
    ("text", "tokens"),
    [
        ("w10 w11 w12", 4),  # 11 ASCII characters / 3
        ("a b c d e f g", 7),  # more words than characters / 3: a token a word at least
        ("日本語のテキスト", 8 * 3),  # not ASCII: a token a UTF-8 byte (3 each here)
        ("naïve café", 3 + 2 * 2),  # 8 ASCII characters / 3, and two of 2 bytes each
        ("", 0),
    ],
)
def test_text_counts_ascii_by_characters_other_text_by_bytes_a_token_a_word_at_least(
    text: str, tokens: int
) -> None:
    assert completion(text) == PromptSize(tokens + BOS_TOKENS)


def test_a_batch_of_strings_and_a_suffix_count_all_their_text() -> None:
    assert completion(["w10 w11 w12", "abc"]).tokens == 4 + 1 + 1 + 1
    assert completion("abc", suffix="defghi").tokens == 1 + BOS_TOKENS + 2


def test_chat_counts_text_parts_tool_calls_tools_and_template_markers() -> None:
    # The template's markers, and each role's name ("system": 2 tokens, "user": 2).
    base = CHAT_TOKENS_PER_REQUEST + 2 * CHAT_TOKENS_PER_MESSAGE + 2 + 2
    got = chat(
        [
            {"role": "system", "content": "abcdef"},
            {"role": "user", "content": [{"type": "text", "text": "abc"}, "abc"]},
        ]
    )
    assert got == PromptSize(base + 2 + 1 + 1)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    with_calls = chat([{"role": "assistant", "content": None, "tool_calls": calls}])
    assert with_calls.tokens is not None
    assert with_calls.tokens > CHAT_TOKENS_PER_REQUEST + CHAT_TOKENS_PER_MESSAGE + 10
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {}}}]
    plain = chat([{"role": "user", "content": "hi"}])
    assert plain.tokens is not None
    assert (chat([{"role": "user", "content": "hi"}], tools=tools).tokens or 0) > plain.tokens + 10


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": None},
        {},
        {"prompt": []},
        {"prompt": [1, "two"]},
        {"prompt": [1.5, 2]},
        {"prompt": [True, 2]},
        {"prompt": "abc", "prompt_embeds": "AAAA"},
    ],
)
def test_a_completion_the_router_cannot_size_is_unknown(body: dict[str, object]) -> None:
    size = prompt_tokens(COMPLETIONS_PATH, body, 3.0, CAP)
    assert size.tokens is None and not size.below(CAP)


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}],
        [{"role": "user", "content": {"text": "not a list"}}],
        ["not a message"],
        [],
        None,
    ],
)
def test_a_chat_the_router_cannot_size_is_unknown(messages: object) -> None:
    assert chat(messages).tokens is None


def test_counting_stops_at_the_cap() -> None:
    huge_text = "x" * 10_000_000
    assert prompt_tokens(COMPLETIONS_PATH, {"prompt": huge_text}, 3.0, 64) == PromptSize(64)
    ids = list(range(1_000_000))
    assert prompt_tokens(COMPLETIONS_PATH, {"prompt": ids}, 3.0, 64) == PromptSize(64)
    many = [{"role": "user", "content": "hi"}] * 100
    assert prompt_tokens(CHAT_PATH, {"messages": many}, 3.0, 64) == PromptSize(64)
    assert PromptSize(64).below(64) is False and PromptSize(63).below(64) is True


@pytest.mark.parametrize("n", [1, 4, 16, 64, 256, 1000])
def test_on_the_lab_tokenizer_the_estimate_is_over_and_within_2x(n: int) -> None:
    # The lab's tiny model: one token a word ("w123"), and vLLM adds BOS.
    got = completion(prompt_of_length(n, seed=n)).tokens
    assert got is not None and n + BOS_TOKENS <= got <= 2 * (n + BOS_TOKENS)


def test_a_higher_characters_per_token_lowers_the_text_estimate() -> None:
    text = "the quick brown fox jumps over the lazy dog " * 4
    three = prompt_tokens(COMPLETIONS_PATH, {"prompt": text}, 3.0, CAP).tokens
    four = prompt_tokens(COMPLETIONS_PATH, {"prompt": text}, 4.0, CAP).tokens
    assert three is not None and four is not None and four < three


def test_whatever_else_a_message_or_the_request_carries_counts_as_its_json() -> None:
    plain = chat([{"role": "user", "content": "hi"}]).tokens
    assert plain is not None
    reasoning = "r" * 300
    for extra_message in (
        {"reasoning_content": reasoning},
        {"name": reasoning},
        {"tool_call_id": reasoning},
    ):
        got = chat([{"role": "user", "content": "hi", **extra_message}]).tokens
        assert got is not None and got >= plain + 100, extra_message
    kwargs = chat(
        [{"role": "user", "content": "hi"}], chat_template_kwargs={"system": reasoning}
    ).tokens
    assert kwargs is not None and kwargs >= plain + 100
    # A role is written out by the template too: 300 characters are 100 tokens, "user" 2.
    assert chat([{"role": "x" * 300, "content": "hi"}]) == PromptSize(plain + 98)


def test_a_chat_template_of_the_clients_own_is_unsized() -> None:
    assert chat(
        [{"role": "user", "content": "hi"}], chat_template="{{ 'x' * 10000 }}"
    ) == PromptSize(None)


@pytest.mark.parametrize(
    "text",
    [
        "x" * 191,  # the most ASCII a 64-token estimate lets through: at most 191 tokens
        "\u00e9" * 60,  # 2-byte characters
        "\U0001f600" * 15,  # 4-byte characters
        "\ud800" * 20,  # a lone surrogate (JSON allows one) counts as its 3 bytes
        "!@#$%^&*()" * 19,
    ],
)
def test_a_text_below_the_threshold_has_at_most_chars_per_token_times_it_in_utf8_bytes(
    text: str,
) -> None:
    # Every byte-level BPE token covers a UTF-8 byte at least: a client cannot send a prompt
    # of more than chars_per_token * threshold tokens down the direct path, whatever it writes.
    size = prompt_tokens(COMPLETIONS_PATH, {"prompt": text}, 3.0, 64)
    n_bytes = len(text.encode("utf-8", "surrogatepass"))
    if size.below(64):
        assert n_bytes <= 3.0 * 64
    else:
        assert size == PromptSize(64)
    assert size.tokens is not None
    assert size.tokens >= min(64, n_bytes / 3.0)
