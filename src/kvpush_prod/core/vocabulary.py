"""The protocol's words, as the core names them: re-exported from ``kvpush_prod.vocabulary``
(the one module that holds every word, low in the tree so every layer can use them)."""

from kvpush_prod.vocabulary import (
    SIGNATURE_REASONS,
    AfterDrain,
    KeyProblem,
    NoteKind,
    Notice,
    Outcome,
    ParamsRejectReason,
    RejectReason,
    Side,
    Word,
)

__all__ = [
    "SIGNATURE_REASONS",
    "AfterDrain",
    "KeyProblem",
    "NoteKind",
    "Notice",
    "Outcome",
    "ParamsRejectReason",
    "RejectReason",
    "Side",
    "Word",
]
