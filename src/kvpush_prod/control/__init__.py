"""The control channel between engines: CurveZMQ-authenticated, size-limited msgpack messages.

Each engine holds its own key pair and accepts only the keys of the deployment's allow-list.
"""

from kvpush_prod.control.codec import ControlCodec
from kvpush_prod.control.endpoint import ControlEndpoint, KeyQuotas
from kvpush_prod.control.keys import KeyPair, fingerprint, load_allowed, load_keypair
from kvpush_prod.control.security import EndpointSecurity
from kvpush_prod.vocabulary import RejectReason

__all__ = [
    "ControlCodec",
    "ControlEndpoint",
    "EndpointSecurity",
    "KeyPair",
    "KeyQuotas",
    "RejectReason",
    "fingerprint",
    "load_allowed",
    "load_keypair",
]
