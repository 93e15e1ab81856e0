"""The control channel between engines: authenticated, size-limited msgpack messages over ZMQ."""

from kvpush_prod.control.codec import ControlCodec, RejectReason
from kvpush_prod.control.endpoint import ControlEndpoint

__all__ = ["ControlCodec", "ControlEndpoint", "RejectReason"]
