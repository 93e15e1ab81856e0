"""The router's pool of backends: state changes (health, prefill identity, D's key, served
models, legs in flight) and the choice of (prefill, decode) pairs through a policy.

The pool keeps the metrics gauges in step. The backend record itself is in ``types``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kvpush_prod.router.config import PrefillBackendConfig, RouterSettings
from kvpush_prod.router.errors import NoBackendError
from kvpush_prod.router.metrics import RouterMetrics
from kvpush_prod.router.policy import Policy, make_policy
from kvpush_prod.router.types import Backend, PrefillIdentity, Role

log = logging.getLogger(__name__)


_Z85 = frozenset(
    "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"
)


def check_remote_key(v: Any) -> str | None:
    """A control-channel public key as probed (40 Z85 characters) or None; ValueError else."""
    if v is None:
        return None
    if not isinstance(v, str) or len(v) != 40 or not _Z85.issuperset(v):
        raise ValueError(
            f"remote_key {v!r} is not a control-channel public key (40 Z85 characters); "
            "check the engine's control.key_file"
        )
    return v


_IDENTITY_KEYS = {
    "engine_id": "remote_engine_id",
    "host": "remote_host",
    "port": "remote_port",
    "tp_size": "tp_size",
}


def resolve_identity(
    probed: Mapping[str, Any] | None, overrides: PrefillBackendConfig | None
) -> PrefillIdentity:
    """Merge probed ``kv_transfer_params`` with YAML overrides (overrides win).

    Raises ValueError naming the fields neither source gave.
    """
    probed = probed or {}
    given: dict[str, Any] = {}
    if overrides is not None:
        given = {
            "engine_id": overrides.engine_id,
            "host": overrides.control_host,
            "port": overrides.control_port,
            "tp_size": overrides.tp_size,
        }
    values: dict[str, Any] = {}
    missing: list[str] = []
    for name, key in _IDENTITY_KEYS.items():
        v = given.get(name)
        if v is None:
            v = probed.get(key)
        if v is None:
            missing.append(key)
        values[name] = v
    if missing:
        raise ValueError(
            f"kv_transfer_params lacks {', '.join(missing)} (got {dict(probed)!r}); start the "
            "prefill engine with a push kv connector (kv_role kv_producer or kv_both), or set "
            "engine_id/control_host/control_port/tp_size for it in the router YAML"
        )
    given_key = overrides.remote_key if overrides is not None else None
    try:
        dp_size = int(probed.get("dp_size") or 1)
        dp_rank = probed.get("dp_rank")
        return PrefillIdentity(
            engine_id=str(values["engine_id"]),
            host=str(values["host"]),
            port=int(values["port"]),
            tp_size=int(values["tp_size"]),
            remote_key=check_remote_key(given_key or probed.get("remote_key")),
            dp_rank=None if dp_rank is None else int(dp_rank),
            dp_size=max(1, dp_size),
        )
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"bad identity value in kv_transfer_params {dict(probed)!r}: {e}"
        ) from None


class BackendPool:
    """All backends of both roles, the pairing policy and the gauges that mirror them."""

    def __init__(self, settings: RouterSettings, metrics: RouterMetrics) -> None:
        self.metrics = metrics
        self.prefill = [
            Backend(Role.PREFILL, b.url, overrides=b, needs_identity=settings.mode == "push")
            for b in settings.prefill
        ]
        self.decode = [
            Backend(Role.DECODE, b.url, needs_key=settings.probes_decode) for b in settings.decode
        ]
        self._policy: dict[Role, Policy] = {
            Role.PREFILL: make_policy(settings.policy),
            Role.DECODE: make_policy(settings.policy),
        }
        for b in self.prefill:
            if b.overrides is not None and b.overrides.full_identity_given:
                b.identity = resolve_identity(None, b.overrides)
        for b in self.all:
            metrics.set_backend_up(b.role.value, b.url, False)
            metrics.set_inflight(b.role.value, b.url, 0)

    @property
    def all(self) -> list[Backend]:
        return [*self.prefill, *self.decode]

    def by_role(self, role: Role) -> list[Backend]:
        return self.prefill if role is Role.PREFILL else self.decode

    # -- state changes -----------------------------------------------------------------

    def _publish(self, b: Backend, was_up: bool) -> None:
        if b.up != was_up:
            self.metrics.set_backend_up(b.role.value, b.url, b.up)
            if b.up and b.draining:
                # Back after being down: the drained engine was restarted.
                b.draining = False
                log.warning(
                    "%s backend %s is back after its drain: routing to it again",
                    b.role.value,
                    b.url,
                )
            if b.up:
                log.info("%s backend %s is up", b.role.value, b.url)
            else:
                log.warning("%s backend %s is down: %s", b.role.value, b.url, b.last_error)

    def mark_down(self, b: Backend, reason: str) -> None:
        """Stop routing to ``b`` until a health check brings it back."""
        was_up = b.up
        b.epoch += 1
        b.healthy = False
        b.last_error = reason
        if b.role is Role.PREFILL and not (b.overrides and b.overrides.full_identity_given):
            # A restarted engine has a new engine id and maybe a new control port:
            # forget the old identity so it is probed again before use.
            b.identity = None
            b.ranks = {}
        # Likewise a restarted D may come back with another key.
        b.remote_key = None
        b.key_probed = False
        self._publish(b, was_up)

    def mark_healthy(self, b: Backend, epoch: int) -> None:
        """Record a good health check that started at ``epoch`` (ignored if stale)."""
        if b.epoch != epoch:
            return
        was_up = b.up
        b.healthy = True
        if b.up:
            b.last_error = None
        elif b.last_error is None:
            b.last_error = (
                "identity not probed yet"
                if b.role is Role.PREFILL
                else "control-channel key not probed yet"
            )
        self._publish(b, was_up)

    def set_identity(
        self,
        b: Backend,
        identity: PrefillIdentity | None,
        error: str | None,
        ranks: dict[int, PrefillIdentity] | None = None,
    ) -> None:
        """Record P's identity (``ranks``: with data parallelism, every DP rank's)."""
        was_up = b.up
        b.identity = identity
        b.ranks = dict(ranks or {}) if identity is not None else {}
        if error is not None:
            if error != b.last_error:  # a probe failing every poll is logged once
                log.error("prefill backend %s unusable: %s", b.url, error)
            b.last_error = error
        elif b.healthy:
            b.last_error = None
        self._publish(b, was_up)

    def set_decode_key(self, b: Backend, key: str | None) -> None:
        """Record what D answered the key probe with (None: D runs without keys)."""
        if key != b.remote_key or not b.key_probed:
            log.info("decode backend %s control key: %s", b.url, key or "none (no keys)")
        was_up = b.up
        b.remote_key = key
        b.key_probed = True
        if b.healthy:
            b.last_error = None
        self._publish(b, was_up)

    def set_decode_key_failure(self, b: Backend, error: str) -> None:
        """D's key probe failed: D stays out of rotation until a probe answers."""
        was_up = b.up
        b.remote_key = None
        b.key_probed = False
        b.last_error = error
        self._publish(b, was_up)

    def set_models(self, b: Backend, models: Iterable[str]) -> None:
        b.models = tuple(models)
        b.served = frozenset(b.models)
        b.models_known = True

    def find(self, url: str) -> Backend | None:
        """The backend configured at ``url`` (trailing slashes ignored), or None."""
        want = url.rstrip("/")
        return next((b for b in self.all if b.url.rstrip("/") == want), None)

    def set_draining(self, b: Backend, draining: bool) -> None:
        """Stop (or resume) giving ``b`` new legs; legs already open finish."""
        if b.draining != draining:
            log.warning(
                "%s backend %s %s",
                b.role.value,
                b.url,
                "draining: no new requests" if draining else "undrained",
            )
        b.draining = draining

    def leg_started(self, b: Backend) -> None:
        b.inflight += 1
        self.metrics.set_inflight(b.role.value, b.url, b.inflight)

    def leg_ended(self, b: Backend) -> None:
        b.inflight -= 1
        self.metrics.set_inflight(b.role.value, b.url, b.inflight)

    # -- queries -------------------------------------------------------------------------

    def knows_model(self, model: str) -> bool:
        """Whether any backend, up or not, has listed ``model`` in its ``/v1/models``."""
        return any(model in b.served for b in self.all)

    def known_models(self) -> list[str]:
        return sorted({m for b in self.all for m in b.models})

    def ready(self) -> bool:
        return any(b.up for b in self.prefill) and any(b.up for b in self.decode)

    def _eligible(self, role: Role, model: str | None, exclude: set[Backend]) -> list[Backend]:
        return [
            b
            for b in self.by_role(role)
            if b.up and not b.draining and b not in exclude and b.serves(model)
        ]

    def has_pair(self, model: str | None, exclude: set[Backend]) -> bool:
        return bool(self._eligible(Role.PREFILL, model, exclude)) and bool(
            self._eligible(Role.DECODE, model, exclude)
        )

    def has_decode(self, model: str | None, exclude: set[Backend]) -> bool:
        return bool(self._eligible(Role.DECODE, model, exclude))

    def choose_decode(self, model: str | None, exclude: set[Backend]) -> Backend:
        """Pick a D alone (a request sent straight to D needs no P), by the same policy and
        rotation as the pairs' D. Raises NoBackendError naming every decode backend."""
        eligible = self._eligible(Role.DECODE, model, exclude)
        if not eligible:
            raise NoBackendError(self._why_none(Role.DECODE, model, exclude))
        return self._policy[Role.DECODE].choose(self.decode, eligible)

    def choose_pair(self, model: str | None, exclude: set[Backend]) -> tuple[Backend, Backend]:
        """Pick (P, D) among routable backends serving ``model``, not in ``exclude``.

        Raises NoBackendError naming every backend of a role that has none to offer.
        """
        chosen: list[Backend] = []
        missing: list[str] = []
        for role in (Role.PREFILL, Role.DECODE):
            eligible = self._eligible(role, model, exclude)
            if not eligible:
                missing.append(self._why_none(role, model, exclude))
                continue
            policy = self._policy[role]
            if role is Role.DECODE and chosen:
                chosen.append(policy.choose_for(chosen[0], self.decode, eligible))
            else:
                chosen.append(policy.choose(self.by_role(role), eligible))
        if missing:
            raise NoBackendError("; ".join(missing))
        return chosen[0], chosen[1]

    @property
    def learns_links(self) -> bool:
        """Whether the D policy learns each (P, D) link (``observe_pair``)."""
        return self._policy[Role.DECODE].learns_links

    def observe_pair(self, p: Backend, d: Backend, seconds: float, prompt_tokens: int) -> None:
        """A streamed request's D leg gave its first token ``seconds`` after P answered."""
        self._policy[Role.DECODE].observe(p, d, seconds, prompt_tokens)

    def _why_none(self, role: Role, model: str | None, exclude: set[Backend]) -> str:
        parts = []
        for b in self.by_role(role):
            if b in exclude and b.up:
                why = "failed on this request"
            elif b.up and b.draining:
                why = "draining"
            elif not b.up:
                why = b.last_error or "down"
            else:
                why = f"does not serve model {model!r}"
            parts.append(f"{b.url} ({why})")
        return f"no healthy {role.value} backend: {', '.join(parts)}"
