"""The digest of a prompt's token ids: what binds pushed KV to the prompt it was computed for.

P states it with the KV (DONE, FALLBACK), D compares it with its own request's before any
block of the transfer becomes usable. Pure: no I/O.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

DIGEST_BYTES = 16
_DOMAIN = b"kvpush-prompt-v1"


def prompt_digest(token_ids: Sequence[int] | None) -> bytes:
    """16 bytes naming exactly this sequence of token ids (its length included); b"" when the
    request has no token ids (prompt embeddings): then nothing can be compared."""
    if token_ids is None:
        return b""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_DOMAIN[:16])
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.digest()
