"""The protocol's words, as the core names them: re-exported from ``kvpush_prod.vocabulary``
(the one module that holds every word, low in the tree so every layer can use them)."""

from kvpush_prod.vocabulary import *  # noqa: F403 (all of them: its __all__)
from kvpush_prod.vocabulary import __all__ as __all__
