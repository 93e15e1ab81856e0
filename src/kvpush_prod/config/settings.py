"""What can be configured: the settings sections, their defaults and ranges, and the rules
across keys. The one set of defaults; `loading` builds a validated `KvpushConfig` from them.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvpush_prod.transport.faults import FaultSettings

PARAMS_KEY_ENV = "KVPUSH_PARAMS_KEY"  # the router's params key (a secret: never in a file)
KEY_FILE_ENV = "KVPUSH_KEY_FILE"
ALLOWED_KEYS_ENV = "KVPUSH_ALLOWED_KEYS"
REMOVED_SECRET_ENV = "KVPUSH_SECRET"
PROFILE_ENV = "KVPUSH_PROFILE"
SECURITY_DOCS = "docs/security.md"
# Keys that existed once: an old profile gets told what replaced them, not "unknown key".
REMOVED_KEYS = {
    ("transport", "active_poll_us"): (
        "replaced by transport.active_poll_ms (whole milliseconds, at least 1): a poll period "
        "below 1 ms busied a whole core on the engine's CPU, and completions no longer wait "
        "for the period (the engine thread polls once per step); use active_poll_ms: 1"
    ),
    ("control", "secret"): (
        "the shared HMAC secret was replaced by per-engine CurveZMQ keys (encrypted, mutually "
        "authenticated, replay-safe): run `kvpush keys generate NAME --dir DIR` for each "
        "engine, then set control.key_file and control.allowed_keys (see docs/security.md)"
    ),
}
DOCS = "docs/configuration.md"
MASK = "<set, masked>"
_WILDCARD_HOSTS = ("0.0.0.0", "::", "[::]", "*")
_LOOPBACK_HOSTS = ("localhost", "ip6-localhost")


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host in _LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _secret(description: str) -> Any:
    # Marked so that `config show`, errors and docs never print the value.
    return Field(None, description=description, json_schema_extra={"secret": True})


class _Section(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default); NaN and
    # infinities are never a sensible duration, size or fraction.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ControlSettings(_Section):
    """The control channel between engines (REGISTER, heartbeats, cancel, fallback notices)."""

    host: str = Field("127.0.0.1", description="Address the control endpoint binds to.")
    advertise_host: str | None = Field(
        None,
        description="Address peers use to reach this engine; defaults to `host`. Required "
        "when `host` is a wildcard such as 0.0.0.0.",
    )
    port: int = Field(
        15500,
        ge=1024,
        le=65000,
        description="Base port; tensor-parallel rank r of data-parallel rank d listens on "
        "port + d * tp_size + r.",
    )
    key_file: str | None = Field(
        None,
        description="This engine's CurveZMQ key pair: the secret certificate written by "
        f"`kvpush keys generate` (or ${KEY_FILE_ENV}). With `allowed_keys` it makes the "
        "control channel encrypted and mutually authenticated.",
    )
    allowed_keys: str | None = Field(
        None,
        description="The engines this one talks to: a directory of public certificates "
        f"(`*.key`) or one such file (or ${ALLOWED_KEYS_ENV}). A peer whose key is not "
        "listed is refused at the handshake.",
    )
    insecure: bool = Field(
        False,
        description="Run the control channel without keys on a non-loopback address "
        "(plaintext, unauthenticated: any host that reaches the port can forge messages). "
        "Logged at start-up, exported as kvpush_control_insecure and alerted on.",
    )
    allowed_peers: list[str] = Field(
        default_factory=list,
        max_length=256,
        description="Networks (CIDR, e.g. 10.0.0.0/16) a prefill address in "
        "kv_transfer_params may be in; empty: any. An address outside is refused and the "
        "prompt computed locally.",
    )
    params_key_file: str | None = Field(
        None,
        description="File holding the router's params key: when set (or "
        f"${PARAMS_KEY_ENV}), the engine accepts only kv_transfer_params the router signed, "
        "so a client that reaches the engine directly cannot name peers.",
    )
    params_key: str | None = _secret(
        f"The router's params key itself; only from ${PARAMS_KEY_ENV} (keep it out of files)."
    )
    max_peers: int = Field(
        1024,
        ge=1,
        le=1_000_000,
        description="Most peers (and sockets to them) remembered at once; the least recently "
        "used is forgotten first.",
    )
    max_message_bytes: int = Field(
        1 << 20, ge=1024, le=64 << 20, description="Largest control message accepted."
    )

    @model_validator(mode="after")
    def _reachable(self) -> ControlSettings:
        if self.host in _WILDCARD_HOSTS and not self.advertise_host:
            raise ValueError(
                f"host={self.host!r} binds every interface, so peers cannot be told where to "
                "connect: set advertise_host to this engine's address on the KV network"
            )
        if self.advertise_host is not None and self.advertise_host in _WILDCARD_HOSTS:
            raise ValueError(
                f"advertise_host={self.advertise_host!r} is not an address peers can reach: "
                "set it to this engine's address on the KV network"
            )
        if (self.key_file is None) != (self.allowed_keys is None):
            given, missing = (
                ("key_file", "allowed_keys")
                if self.allowed_keys is None
                else ("allowed_keys", "key_file")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: CurveZMQ needs both this engine's key "
                f"pair and the list of peers it accepts (see {SECURITY_DOCS})"
            )
        if self.key_file is not None and self.insecure:
            raise ValueError(
                "insecure: true together with key_file: the keys make the channel secure; "
                "remove insecure (or the keys)"
            )
        if self.key_file is None and not self.insecure and not is_loopback(self.host):
            raise ValueError(
                f"host={self.host!r} exposes the control port to the network without "
                "authentication: any host that reaches it could make this engine write or "
                "free KV blocks. Give each engine keys (`kvpush keys generate NAME --dir DIR`, "
                "then control.key_file and control.allowed_keys), or, on a network you "
                f"trust, set control.insecure: true (see {SECURITY_DOCS})"
            )
        for net in self.allowed_peers:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(
                    f"allowed_peers entry {net!r} is not a network: write it as CIDR, e.g. "
                    "10.0.0.0/16 or fd00::/8"
                ) from None
        return self


class TransportSettings(_Section):
    """How KV bytes move (NIXL)."""

    backend: Literal["UCX", "LIBFABRIC"] = Field(
        "UCX",
        description="NIXL backend plugin: UCX (InfiniBand, RoCE, TCP, shared memory) or "
        "LIBFABRIC (AWS EFA).",
    )
    progress_thread: bool = Field(
        False,
        description="Run NIXL's progress thread too. Off by default: the transfer pump drives "
        "progress itself (polling while transfers are active, a light pass every tick), and "
        "a progress thread sharing the engine's core holds UCX's spinlock while preempted, "
        "which was measured to stretch a 0.4 ms WRITE post to 2-8 ms. Turn it on for "
        "backends that need constant progress (libfabric/EFA) on hosts with spare cores.",
    )
    progress_delay_us: int = Field(
        10000,
        ge=100,
        le=1_000_000,
        description="Sleep of NIXL's progress thread between passes. nixl's Python API "
        "hard-codes 0, which spins a whole core per agent; our own poller drives progress "
        "while transfers are active.",
    )
    active_poll_ms: int = Field(
        1,
        ge=1,
        le=1000,
        description="Period of the transfer pump's transport polls while chunks or receives "
        "are in flight, in whole milliseconds; 1 ms is the floor: NIXL gives no fd to block "
        "on, and a shorter period busies a core. Completions do not wait for it: the engine "
        "thread also polls once per step and right after handing over a push.",
    )
    idle_poll_ms: int = Field(
        50,
        ge=1,
        le=10_000,
        description="Longest sleep of the transfer pump when nothing is in flight (it blocks "
        "on the control socket and wakes at once for a message or a push).",
    )
    num_threads: int = Field(
        0, ge=0, le=64, description="NIXL backend worker threads (0: the backend's default)."
    )
    connect_timeout_s: float = Field(
        10.0,
        ge=0.1,
        le=600.0,
        description="Longest wait for a NIXL connection to a peer engine (loading its "
        "agent and preparing its descriptors, done off the transfer pump): P's to a decode "
        "engine (the transfers to it wait meanwhile, their permits renewed by D's "
        "heartbeats; past it they fall back to pull, or fail with fallback.pull off) and D's "
        "to a prefill engine it pulls from (the pull's READs wait, within P's read permit; "
        "past it the pull fails and vLLM's kv_load_failure_policy applies). A connection "
        "that lands later is still used by the transfers after them.",
    )


class PushSettings(_Section):
    """Push scheduling on P."""

    chunk_bytes: int = Field(
        4 << 20, ge=4096, le=1 << 30, description="Largest single WRITE posted for a transfer."
    )
    target_latency_ms: float = Field(
        2.0,
        gt=0,
        le=10_000,
        description="In-flight bytes per link = measured bandwidth x this (at least one chunk).",
    )
    max_inflight_chunks: int = Field(
        64, ge=1, le=100_000, description="Most chunks posted and not completed, per link."
    )
    chunk_by: Literal["layers", "blocks"] = Field(
        "layers",
        description="How a push larger than chunk_bytes is cut into chunks. layers: groups "
        "of consecutive layers (KV regions) over all of the transfer's blocks, about "
        "chunk_bytes each, so a transfer posts about one descriptor per region and run of "
        "adjacent blocks; blocks: ranges of blocks over every region, each chunk its own "
        "descriptor per region (0.2's cut: chunks x regions descriptors on a "
        "fresh cache). Layer-wise pushes post per layer either way.",
    )
    chunk_timeout_s: float = Field(
        10.0, gt=0, le=3600, description="A chunk still in flight after this has failed (TIMEOUT)."
    )
    layerwise: Literal["off", "on", "auto"] = Field(
        "off",
        description="Layer-wise push: P posts each layer's KV as soon as the forward computed "
        "it (vLLM's save_kv_layer), while later layers are still computed; DONE goes after "
        "the forward ended and every layer landed. on: every push; auto: a step whose "
        "prompts to push hold at least layerwise_min_tokens tokens and whose KV takes at "
        "least layerwise_min_transfer_ms at the link's bandwidth as whole pushes measured it; "
        "off: after the "
        "forward, as one piece. CPU KV caches only (a GPU engine pushes after the forward).",
    )

    @field_validator("layerwise", mode="before")
    @classmethod
    def _yaml_switch(cls, value: Any) -> Any:
        # YAML 1.1 reads an unquoted off / on as false / true.
        return {False: "off", True: "on"}.get(value, value) if isinstance(value, bool) else value

    layerwise_min_tokens: int = Field(
        1024,
        ge=0,
        le=1 << 24,
        description="push.layerwise auto: fewest prompt tokens pushed in one step for "
        "layer-wise push (short prompts pay per-layer posts for little overlap).",
    )
    layerwise_min_transfer_ms: float = Field(
        2.0,
        ge=0,
        le=60_000,
        description="push.layerwise auto: least expected transfer time (the step's KV bytes "
        "at the bandwidth of P's slowest link as whole pushes measured it, layer-wise pushes' "
        "small chunks left out; before one landed, the initial estimate or what layer-wise "
        "chunks measured, whichever is higher) for layer-wise push.",
    )


class CreditSettings(_Section):
    """D's receive window for inbound transfers."""

    budget_fraction: float = Field(
        0.5,
        gt=0,
        le=1.0,
        description="Fraction of D's KV blocks inbound transfers may reserve at most; within "
        "it, a transfer is admitted only when D's KV cache has the blocks free.",
    )
    per_peer_fraction: float = Field(
        1.0, gt=0, le=1.0, description="Fraction of the budget one prefill peer may hold."
    )


class LeaseSettings(_Section):
    """Permits (D lets P write) and send leases (P holds blocks for D)."""

    permit_ttl_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="Write permit term; D renews it by heartbeat while P is alive and still "
        "holds the transfer, so a dead P is noticed within about this long.",
    )
    send_lease_ttl_s: float = Field(
        60.0, gt=0, le=3600, description="How long P holds finished blocks for D without news."
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, le=600, description="Lease renewal period.")
    stop_margin_s: float = Field(
        1.0, ge=0, le=600, description="P stops posting this long before its permit expires."
    )
    skew_margin_s: float = Field(
        1.0, ge=0, le=600, description="D reuses blocks only this long after permit expiry."
    )
    register_grace_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="How long P keeps renewing a REGISTER for a request it has not received "
        "yet (the prefill leg can lag the decode leg under load); after that D's permit runs "
        "out and the receive fails.",
    )
    peer_timeout_s: float = Field(
        3.0, gt=0, le=600, description="A peer unheard this long is presumed dead (no renewals)."
    )
    transfer_timeout_s: float = Field(
        120.0, gt=0, le=86_400, description="Hard bound on one transfer, queueing included."
    )

    @model_validator(mode="after")
    def _margins_fit(self) -> LeaseSettings:
        if self.stop_margin_s >= self.permit_ttl_s:
            raise ValueError(
                f"stop_margin_s={self.stop_margin_s} must be below permit_ttl_s="
                f"{self.permit_ttl_s}: otherwise P could never write"
            )
        for name in ("permit_ttl_s", "send_lease_ttl_s"):
            ttl = getattr(self, name)
            if self.heartbeat_interval_s * 2 > ttl:
                raise ValueError(
                    f"heartbeat_interval_s={self.heartbeat_interval_s} must be at most half of "
                    f"{name}={ttl} so one lost heartbeat does not expire a lease"
                )
        return self


class RetrySettings(_Section):
    """Retries of failed chunks (full-jitter exponential backoff, per-peer budget)."""

    max_attempts: int = Field(
        3, ge=1, le=100, description="Posts of one chunk in all, the first included (1: no retry)."
    )
    base_backoff_ms: float = Field(
        2.0, gt=0, le=60_000, description="Window of the first retry's random wait: [0, base]."
    )
    max_backoff_ms: float = Field(
        200.0, gt=0, le=600_000, description="The wait window doubles per retry up to this."
    )
    budget_per_s: float = Field(
        10.0,
        gt=0,
        le=100_000,
        description="Retry tokens refilled per second per peer; a retry without a token "
        "falls back instead.",
    )
    budget_burst: int = Field(
        20, ge=1, le=100_000, description="Retry tokens one peer may hold (retries at once)."
    )
    done_query_timeout_ms: float = Field(
        1000.0,
        gt=0,
        le=600_000,
        description="A failed last chunk (it carries DONE, which may have landed anyway): how "
        "long P waits for D to say whether DONE arrived before falling back to pull. D's "
        "answer ends the push (DONE arrived) or lets P post the last chunk again under the "
        "retry policy and budget.",
    )

    @model_validator(mode="after")
    def _backoff_grows(self) -> RetrySettings:
        if self.max_backoff_ms < self.base_backoff_ms:
            raise ValueError(
                f"max_backoff_ms={self.max_backoff_ms} must be >= base_backoff_ms="
                f"{self.base_backoff_ms}"
            )
        return self


class BreakerSettings(_Section):
    """Per-peer circuit breaker."""

    failure_threshold: int = Field(
        3, ge=1, le=1000, description="Failed pushes within `window_s` that open the breaker."
    )
    window_s: float = Field(10.0, gt=0, le=3600, description="Window the failures are counted in.")
    cooldown_s: float = Field(
        5.0,
        gt=0,
        le=3600,
        description="How long the breaker stays open before a half-open probe; doubles after "
        "each failed probe.",
    )
    max_cooldown_s: float = Field(
        300.0, gt=0, le=86_400, description="The cooldown never grows past this."
    )

    @model_validator(mode="after")
    def _cooldown_grows(self) -> BreakerSettings:
        if self.max_cooldown_s < self.cooldown_s:
            raise ValueError(
                f"max_cooldown_s={self.max_cooldown_s} must be >= cooldown_s={self.cooldown_s}"
            )
        return self


class FallbackSettings(_Section):
    """What happens when a push cannot complete."""

    pull: bool = Field(True, description="Let D pull (READ) the KV when the push fails.")
    pull_permit_s: float = Field(
        30.0, gt=0, le=3600, description="How long D may READ P's blocks after a FALLBACK."
    )


class StagingSettings(_Section):
    """Contiguous areas that KV passes through when caches are fragmented: D's receive
    area (pushes land there, copied into the KV cache on arrival) and P's gather area
    (scattered blocks copied together before a WRITE)."""

    receive_mib: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="Size of D's staging area in MiB (0: off, P writes into D's KV blocks "
        "directly). On: every push and pull lands in a contiguous range of this area, one "
        "NIXL descriptor per layer and run of P's blocks however scattered D's free blocks "
        "are, and D copies it into its KV blocks once the transfer has landed (off the "
        "engine thread). Costs this much memory and one copy of the KV; D's credit budget "
        "is capped at the blocks the area holds, so a prompt whose KV is larger is computed "
        "on D. For decode engines whose caches fragment (long-running, mixed lengths). "
        "CPU KV caches only; decode engines only.",
    )
    send_mib: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="Size of P's gather area in MiB (0: off, WRITEs read P's KV blocks "
        "where they are). On: a WRITE whose blocks on P are scattered (at least twice the "
        "runs D's side has) is first copied into contiguous slots of this area and posted "
        "from there, one descriptor per layer and run of D's blocks; slots come back when "
        "the WRITE completes (a WRITE given up while in flight keeps them for "
        "leases.permit_ttl_s). A chunk finding no room is posted from the KV blocks. "
        "Costs this much memory and a copy of the chunk on the posting thread. With "
        "receive_mib on D, a push of a fragmented P to a fragmented D posts about one "
        "descriptor per layer. CPU KV caches only; prefill engines only.",
    )


class VerifySettings(_Section):
    """Extra correctness checks (cost CPU; for tests and canaries)."""

    checksums: bool = Field(
        False, description="P sends a crc32 of the pushed blocks; D checks it on arrival."
    )


class LinkSettings(_Section):
    """What a link (P rank -> D rank) should reach, checked by `kvpush doctor` and at run time."""

    fabric: Literal["any", "rdma", "efa"] = Field(
        "any",
        description="The network the links must run on: rdma (InfiniBand or RoCE verbs "
        "through UCX), efa (AWS EFA through LIBFABRIC) or any. `kvpush doctor` fails a host "
        "where the links would fall back to TCP instead.",
    )
    expected_gbps: float | None = Field(
        None,
        gt=0,
        le=100_000,
        description="Bandwidth one link should reach, in gigabits per second (e.g. 400 for "
        "two 200 Gbps EFA NICs per GPU); unset: no expectation and no slow-link guard.",
    )
    slow_fraction: float = Field(
        0.5,
        gt=0,
        le=1.0,
        description="A link measured below this fraction of `expected_gbps` for `slow_window_s` "
        "is slow: kvpush_link_slow goes to 1, one log line names its transports, and the "
        "KvpushLinkSlow alert fires.",
    )
    slow_window_s: float = Field(
        60.0,
        gt=0,
        le=86_400,
        description="How long a link must stay below the fraction (with transfers measured) "
        "before it is called slow; one fast measurement clears it.",
    )


class KvpushConfig(_Section):
    """Everything the connector reads. Unknown keys are errors.

    Each field is a section; adding a section is adding a field here (docs, CLI and
    provenance pick it up from the model).
    """

    control: ControlSettings = ControlSettings()
    transport: TransportSettings = TransportSettings()
    push: PushSettings = PushSettings()
    credits: CreditSettings = CreditSettings()
    leases: LeaseSettings = LeaseSettings()
    retry: RetrySettings = RetrySettings()
    breaker: BreakerSettings = BreakerSettings()
    fallback: FallbackSettings = FallbackSettings()
    verify: VerifySettings = VerifySettings()
    staging: StagingSettings = StagingSettings()
    faults: FaultSettings = FaultSettings()
    links: LinkSettings = LinkSettings()


# Cross-field rules (model validators above), listed for the docs.
CROSS_FIELD_RULES: tuple[str, ...] = (
    "`control.advertise_host` must be set when `control.host` is a wildcard (0.0.0.0, ::), "
    "and must not itself be one",
    "`leases.stop_margin_s` < `leases.permit_ttl_s`",
    "`leases.heartbeat_interval_s` <= half of `leases.permit_ttl_s` and of "
    "`leases.send_lease_ttl_s`",
    "`retry.max_backoff_ms` >= `retry.base_backoff_ms`",
    "`breaker.max_cooldown_s` >= `breaker.cooldown_s`",
)
