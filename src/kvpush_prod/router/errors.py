"""Router-side failures: a leg that failed, a backend's 4xx to pass on, no backend to use,
a request a router limit refused.

All derive from kvpush_prod.errors.KvpushError; messages name the backend and what happened.
"""

from __future__ import annotations

from kvpush_prod.errors import KvpushError
from kvpush_prod.router.metrics import RejectReason
from kvpush_prod.router.types import Backend


class RouterError(KvpushError):
    """Base of the router's own errors."""


class NoBackendError(RouterError):
    """No routable backend of some role; the message lists each one and why it is out."""


class LegFailure(RouterError):
    """One leg (P or D) of one attempt failed in a way another (P, D) pair may not.

    ``kind`` is one of connect, timeout, pool, status, disconnect, stream_error, unfinished
    (D answered 200 but ended the request unfinished: legs.unfinished_answer); with the role
    it makes the bounded ``reason`` label of the retries counter.
    """

    def __init__(self, backend: Backend, kind: str, detail: str) -> None:
        super().__init__(f"{backend.role.value} backend {backend.url}: {kind}: {detail}")
        self.backend = backend
        self.kind = kind
        self.detail = detail

    @property
    def reason(self) -> str:
        return f"{self.backend.role.value}_{self.kind}"


class BackendClientError(RouterError):
    """A backend rejected the request itself (4xx): the client gets that answer, no retry."""

    def __init__(self, backend: Backend, status: int, body: bytes, content_type: str) -> None:
        super().__init__(
            f"{backend.role.value} backend {backend.url} rejected the request: HTTP {status}"
        )
        self.backend = backend
        self.status = status
        self.body = body
        self.content_type = content_type


class ClientGone(RouterError):
    """The client disconnected before the response started."""


class RequestRejected(RouterError):
    """The router refused the request itself: the client gets ``status`` with the message.

    ``reason`` names the router limit that refused it (None: a plain bad request, such as
    a body that is not JSON); ``param`` the offending request field, if one; ``close``
    asks to close the connection after the answer (the rest of the request was not read);
    ``retry_after`` (seconds) is sent as Retry-After for a refusal that passes.
    """

    def __init__(
        self,
        reason: RejectReason | None,
        status: int,
        message: str,
        *,
        param: str | None = None,
        close: bool = False,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = status
        self.message = message
        self.param = param
        self.close = close
        self.retry_after = retry_after
