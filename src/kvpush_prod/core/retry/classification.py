"""What a transport error on a chunk means: retry it, fall back to D pulling, or fail.

One table maps each NIXL error (its exception class and its status name) to a canonical
``ErrorKind`` and an action; a ``ChunkError`` carries the kind as a type from the transport
to the core, and text (an error NIXL itself reported) is read against the table as a fallback.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from kvpush_prod.core.vocabulary import Word


class ErrorClass(enum.Enum):
    """What to do after a transport error on a chunk."""

    RETRY = "retry"  # transient: posting the same chunk again may succeed
    FALLBACK = "fallback"  # the push path is broken, D may still pull: send FALLBACK
    FATAL = "fatal"  # the request itself is wrong: neither retry nor pull can give right bytes


class ErrorKind(Word):
    """The canonical name of a transport error (NIXL's status name without ``NIXL_ERR_``)."""

    BACKEND = "BACKEND"
    TIMEOUT = "TIMEOUT"
    ERR = "ERR"  # the completion state ERR, without detail
    UNKNOWN = "UNKNOWN"
    NOT_POSTED = "NOT_POSTED"
    REPOST_ACTIVE = "REPOST_ACTIVE"
    REMOTE_DISCONNECT = "REMOTE_DISCONNECT"
    NOT_FOUND = "NOT_FOUND"
    CANCELED = "CANCELED"
    NOT_ALLOWED = "NOT_ALLOWED"
    NOT_SUPPORTED = "NOT_SUPPORTED"
    INVALID_PARAM = "INVALID_PARAM"
    MISMATCH = "MISMATCH"
    UNCLASSIFIED = "UNCLASSIFIED"  # not in the table


@dataclass(frozen=True, slots=True)
class Classification:
    """One row of the classification table; ``peer_down`` also counts against the breaker."""

    kind: ErrorKind
    action: ErrorClass
    peer_down: bool
    why: str


R, F, X = ErrorClass.RETRY, ErrorClass.FALLBACK, ErrorClass.FATAL
K = ErrorKind

# canonical kind, NIXL exception class, NIXL status name, action, peer_down, why
_TABLE: tuple[tuple[ErrorKind, str, str, ErrorClass, bool, str], ...] = (
    (K.BACKEND, "nixlBackendError", "NIXL_ERR_BACKEND", R, False,
     "transient backend (UCX/EFA) failure"),
    (K.TIMEOUT, "TimeoutError", "TIMEOUT", R, False,
     "the chunk did not complete in time"),
    (K.ERR, "", "ERR", R, False,
     "completion state ERR without detail"),
    (K.UNKNOWN, "nixlUnknownError", "NIXL_ERR_UNKNOWN", R, False,
     "unknown transport error: retried under the budget, then fallback"),
    (K.NOT_POSTED, "nixlNotPostedError", "NIXL_ERR_NOT_POSTED", R, False,
     "the transfer was not posted: posting again is safe"),
    (K.REPOST_ACTIVE, "nixlRepostActiveError", "NIXL_ERR_REPOST_ACTIVE", R, False,
     "the handle is still busy: post again later"),
    (K.REMOTE_DISCONNECT, "nixlRemoteDisconnectError", "NIXL_ERR_REMOTE_DISCONNECT", F, True,
     "the remote agent went away: re-handshake; D may pull"),
    (K.NOT_FOUND, "nixlNotFoundError", "NIXL_ERR_NOT_FOUND", F, True,
     "remote agent or memory not known here (stale metadata): never retried"),
    (K.CANCELED, "nixlCancelledError", "NIXL_ERR_CANCELED", F, False,
     "the transfer was cancelled under us: never retried"),
    (K.NOT_ALLOWED, "nixlNotAllowedError", "NIXL_ERR_NOT_ALLOWED", F, False,
     "operation not allowed in the handle's state: never retried"),
    (K.NOT_SUPPORTED, "nixlNotSupportedError", "NIXL_ERR_NOT_SUPPORTED", F, False,
     "the backend cannot do this operation: never retried"),
    (K.INVALID_PARAM, "nixlInvalidParamError", "NIXL_ERR_INVALID_PARAM", X, False,
     "bad descriptors or block ids (a bug): never retried"),
    (K.MISMATCH, "nixlMismatchError", "NIXL_ERR_MISMATCH", X, False,
     "layouts differ between P and D: a pull would move wrong bytes too"),
)  # fmt: skip

# Anything not in the table: do not repeat what we do not understand, but let D still pull.
UNCLASSIFIED = Classification(
    ErrorKind.UNCLASSIFIED, ErrorClass.FALLBACK, False, "not in the table"
)

BY_KIND: Mapping[ErrorKind, Classification] = MappingProxyType(
    {
        **{row[0]: Classification(row[0], row[3], row[4], row[5]) for row in _TABLE},
        ErrorKind.UNCLASSIFIED: UNCLASSIFIED,
    }
)


def _build_lookup() -> Mapping[str, Classification]:
    out: dict[str, Classification] = {}
    for kind, exc_name, status, _, _, _ in _TABLE:
        for name in (kind.value, exc_name, status):
            if name:
                out[name] = BY_KIND[kind]
    # NIXL spells it both ways; the Python exception says "Cancelled".
    out["NIXL_ERR_CANCELLED"] = out["CANCELED"]
    out["CANCELLED"] = out["CANCELED"]
    return MappingProxyType(out)


CLASSIFICATION: Mapping[str, Classification] = _build_lookup()


@dataclass(frozen=True, slots=True)
class ChunkError:
    """Why a chunk failed, as the transport knows it: the error's kind, and what it said."""

    kind: ErrorKind
    detail: str = ""

    def __str__(self) -> str:
        return self.detail or self.kind.value

    @classmethod
    def from_text(cls, text: str) -> ChunkError:
        """An error NIXL reported as text (a status name, "ERR:<exception class>", a log
        line): its kind read against the table."""
        return cls(classify(text).kind, text)

    @classmethod
    def from_exception(cls, exc: BaseException, default: ErrorKind | None = None) -> ChunkError:
        """A NIXL exception, classified by its class and then its bases; one of no known
        class is ``default`` if given, else read from its message."""
        detail = f"{type(exc).__name__}: {exc}"
        kind = _kind_of_class(exc)
        if kind is None:
            kind = default if default is not None else _from_text(str(exc)).kind
        return cls(kind, detail)


def _kind_of_class(exc: BaseException) -> ErrorKind | None:
    for cls in type(exc).__mro__:
        found = CLASSIFICATION.get(cls.__name__)
        if found is not None:
            return found.kind
    return None


def classify(error: ChunkError | str | BaseException) -> Classification:
    """Classify a ``ChunkError`` (by its kind), a NIXL exception (or its class name), a status
    string, "TIMEOUT" or "ERR".

    For an exception, its class and then its bases are looked up, so a subclass of
    ``nixlBackendError`` classifies like it; a status name inside the message counts too.
    """
    if isinstance(error, ChunkError):
        return BY_KIND[error.kind]
    if isinstance(error, BaseException):
        kind = _kind_of_class(error)
        return BY_KIND[kind] if kind is not None else _from_text(str(error))
    name = error.strip()
    # Status strings are upper case ("timeout" and "err" come from logs and completions too).
    found = CLASSIFICATION.get(name) or CLASSIFICATION.get(name.upper())
    return found if found is not None else _from_text(name)


def _from_text(text: str) -> Classification:
    """The first known name inside a message such as "ERR:nixlBackendError" (else
    UNCLASSIFIED); the most specific token wins over the bare completion state "ERR"."""
    fallback: Classification | None = None
    for token in re.split(r"[\s:,()\[\]'\"]+", text):
        found = CLASSIFICATION.get(token)
        if found is None:
            continue
        if found.kind is not ErrorKind.ERR:
            return found
        fallback = fallback or found
    return fallback or UNCLASSIFIED


def classification_rows() -> list[tuple[ErrorKind, str, str, ErrorClass, bool, str]]:
    """The table as rows (canonical, exception class, status name, action, peer_down, why)."""
    return list(_TABLE)
