"""Router settings: backend lists, policy, timeouts; from CLI flags and/or a YAML file.

Validated with pydantic; every error names the key, the offending value and the fix.
"""

from __future__ import annotations

import difflib
import os
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import certifi
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvpush_prod.errors import ConfigError
from kvpush_prod.signing import PARAMS_KEY_ENV, SignatureError, check_key, read_key_file

# The prompt length (estimated tokens) below which a request goes to D alone. Measured on
# the lab box (benchmarks/direct_threshold.py; docs/router.md, "Short prompts: straight to
# D"): P/D's TTFT p50 is about 2x a single engine's at every length from 16 to 512 tokens,
# while D's own prefill costs nothing measurable up to 128 tokens and ~2 ms from 256. At 64,
# the longest text prompt the estimate can let through (3 x 64 = 192 tokens) still costs D
# nothing measurable.
DIRECT_BELOW_TOKENS = 64

PolicyName = Literal["round_robin", "least_loaded", "engine_load", "link_aware"]
# push: both legs at once (push connectors); pull: P first, then D with P's
# kv_transfer_params (vLLM's NixlConnector, the usual prefill-then-decode proxy flow).
RouterMode = Literal["push", "pull"]


def _check_url(url: str) -> str:
    """Normalise a backend base URL (no trailing slash) and reject what httpx cannot reach."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http(s) base URL like http://127.0.0.1:8100")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(
            "must be a base URL without a path (the router appends /v1/...), "
            "like http://127.0.0.1:8100"
        )
    return f"{parts.scheme}://{parts.netloc}"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DecodeBackendConfig(_Strict):
    """One decode engine's OpenAI server."""

    url: str

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)


class PrefillBackendConfig(_Strict):
    """One prefill engine's OpenAI server, with optional overrides of its probed identity.

    An override wins over what the identity probe returns; when all four are given the
    router never probes this backend.
    """

    url: str
    control_host: str | None = None
    control_port: int | None = Field(default=None, ge=1, le=65535)
    engine_id: str | None = None
    tp_size: int | None = Field(default=None, ge=1)
    # P's control-channel public key (Z85, 40 characters); wins over the probed one. Not
    # part of the identity proper: P may run without keys.
    remote_key: str | None = Field(default=None, min_length=40, max_length=40)

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        return _check_url(v)

    @property
    def full_identity_given(self) -> bool:
        return None not in (self.control_host, self.control_port, self.engine_id, self.tp_size)


def _url_or_mapping(v: Any) -> Any:
    # A bare string in YAML or on the command line is shorthand for {url: <string>}.
    return {"url": v} if isinstance(v, str) else v


class RouterSettings(_Strict):
    """Everything the router needs; build it with :func:`load_settings` or directly."""

    prefill: list[PrefillBackendConfig] = Field(min_length=1)
    decode: list[DecodeBackendConfig] = Field(min_length=1)
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    policy: PolicyName = "round_robin"
    mode: RouterMode = "push"
    # Push mode: also give D ``remote_request_id`` (P's vLLM request id), which vLLM's own
    # NixlPushConnector requires on D (it fails the engine with a KeyError without it).
    vllm_push_compat: bool = False
    # Retries of a whole request on another (P, D) pair, only before any byte reached
    # the client; 0 disables them.
    max_retries: int = Field(default=1, ge=0, le=10)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    # P's leg is one token long: a prefill slower than this is a failure worth retrying.
    prefill_timeout_s: float = Field(default=300.0, gt=0)
    # From sending D's leg to its first byte (D waits for the KV there); None = no limit.
    first_byte_timeout_s: float | None = Field(default=600.0, gt=0)
    # A dead engine (connection refused) is out of rotation at the next poll, a frozen one
    # after health_timeout_s more; with policy engine_load each poll also reads /metrics.
    health_interval_s: float = Field(default=1.0, gt=0)
    health_timeout_s: float = Field(default=2.0, gt=0)
    probe_timeout_s: float = Field(default=60.0, gt=0)
    # An unknown model triggers a refresh of the backends' model lists at most this often,
    # so a client looping on a bad name cannot hammer the engines.
    models_refresh_min_interval_s: float = Field(default=1.0, ge=0)
    max_connections: int = Field(default=4096, ge=1)
    # Sent as a bearer token on every backend request (vLLM --api-key); without it the
    # client's own Authorization header is forwarded on both legs.
    backend_api_key: str | None = Field(default=None, repr=False)
    # -- limits (docs/router.md, "Limits") --
    # 16 MiB: a prompt at the longest context windows (as text or token ids) is about
    # 1 MiB, which leaves room for a few base64 images in a chat request; vLLM itself has
    # no limit, so a body larger than this is almost certainly a mistake or an attack.
    max_body_bytes: int = Field(default=16 << 20, ge=1024)
    # Request line plus headers; bearer tokens and a few proxies' headers fit many times.
    max_header_bytes: int = Field(default=64 << 10, ge=1024, le=16 << 20)
    # From a connection's first byte (or its opening) to the end of a request's headers.
    header_timeout_s: float = Field(default=10.0, gt=0)
    # From the end of the headers to the last body byte: 16 MiB at 0.5 MiB/s fits.
    body_timeout_s: float = Field(default=30.0, gt=0)
    # Nesting of arrays and objects in a request body; far above any real request and far
    # below Python's recursion limit, so parsing and re-encoding the legs cannot fail.
    max_json_depth: int = Field(default=128, ge=2, le=500)
    # Completion requests in progress (reading the body, waiting, streaming); beyond it a
    # request gets 503 with Retry-After at once. Each holds at most two backend connections
    # (P and D), hence the check against max_connections below.
    max_concurrent_requests: int = Field(default=1024, ge=1)
    # Waiting for a free connection in the legs' pool (max_connections).
    pool_timeout_s: float = Field(default=5.0, gt=0)
    # Sending a leg's request to a backend that stopped reading it.
    backend_write_timeout_s: float = Field(default=30.0, gt=0)
    # A client whose socket accepts no more of its answer for this long is dropped and its
    # legs closed: otherwise the stalled stream holds D's connection and pool slot forever.
    client_write_timeout_s: float = Field(default=30.0, gt=0)
    # SIGTERM: finish open requests for up to this long, then close the rest and exit.
    # Below Kubernetes' default 30 s grace period, so the router closes its legs itself
    # (the engines abort them) before a SIGKILL would.
    drain_timeout_s: float = Field(default=25.0, ge=0)
    # -- router-signed kv_transfer_params (kvpush_prod.signing) --
    # The file holding the params key shared with the engines; the key itself comes only
    # from that file or $KVPUSH_PARAMS_KEY (see with_params_key), never from a flag.
    params_key_file: str | None = None
    params_key: bytes | None = Field(default=None, repr=False, exclude=True)
    # The engines refuse signatures valid for more than an hour (verify_params' max_ttl_s).
    params_ttl_s: float = Field(default=120.0, gt=0, le=3600)
    # Probe decode backends for their control-channel key, so P accepts the transfer only
    # from the D chosen for it (prefill leg's ``decode_key``); without it the first engine
    # holding a valid key to register for a transfer gets its KV. With it a D is routed to
    # only once its probe answered. Push mode with kvpush engines only (``probes_decode``).
    probe_decode: bool = True
    # -- TLS to the engines (vLLM's --ssl-keyfile/--ssl-certfile) --
    # The CA file (PEM) the engines' certificates must chain to; the backends' URLs are then
    # https://. Without it https:// backends are checked against certifi's CAs (httpx's).
    backend_ca_file: str | None = None
    # A client certificate and its key (PEM) for engines that require one (vLLM's
    # --ssl-ca-certs with --ssl-cert-reqs 2): mutual TLS. Both or neither.
    backend_client_cert_file: str | None = None
    backend_client_key_file: str | None = None
    # -- transfer or recompute (docs/router.md, "Short prompts: straight to D") --
    # A request whose prompt is estimated below this many tokens goes to a decode backend
    # alone, without kv_transfer_params: D computes the prompt as a single engine would,
    # because moving a short prompt's KV costs more TTFT than computing it. Measured on the
    # lab box (benchmarks/direct_threshold.py); it depends on the model and the hardware,
    # so measure yours (docs/router.md). 0: every request takes both legs.
    direct_below_tokens: int = Field(default=DIRECT_BELOW_TOKENS, ge=0, le=1 << 20)
    # The estimate of a text prompt (token ids count exactly): ASCII characters per token
    # (any other character: a token per UTF-8 byte). 3 overestimates English prose (~4 per
    # token). It is also the bound on a client that lies: a text prompt sent to D alone has
    # fewer than direct_chars_per_token x direct_below_tokens UTF-8 bytes, so at most that
    # many tokens for a byte-level tokenizer (docs/router.md).
    direct_chars_per_token: float = Field(default=3.0, ge=1.0, le=16.0)
    # -- operations --
    # A request that finds no routable (P, D) pair waits up to this long for one (an engine
    # restarting after a drain) before the router answers 503; 0: answer at once.
    no_backend_wait_s: float = Field(default=0.0, ge=0, le=600)
    # The file holding the bearer token of the admin API (/admin/...: drain, undrain,
    # backends); without it the admin API is off. Like the params key, never a flag value.
    admin_token_file: str | None = None
    admin_token: bytes | None = Field(default=None, repr=False, exclude=True)
    access_log: bool = False
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"

    @field_validator("prefill", "decode", mode="before")
    @classmethod
    def _bare_urls(cls, v: Any) -> Any:
        return [_url_or_mapping(x) for x in v] if isinstance(v, list) else v

    @model_validator(mode="after")
    def _unique_urls(self) -> RouterSettings:
        lists = (
            ("prefill", [b.url for b in self.prefill]),
            ("decode", [b.url for b in self.decode]),
        )
        for role, urls in lists:
            seen: set[str] = set()
            for i, url in enumerate(urls):
                if url in seen:
                    raise ValueError(
                        f"{role}[{i}].url = {url!r} is listed twice; list each backend once"
                    )
                seen.add(url)
        return self

    @model_validator(mode="after")
    def _pool_fits_requests(self) -> RouterSettings:
        if self.max_concurrent_requests * 2 > self.max_connections:
            raise ValueError(
                f"max_concurrent_requests = {self.max_concurrent_requests} needs up to "
                f"{self.max_concurrent_requests * 2} backend connections (a P and a D leg "
                f"each) but max_connections = {self.max_connections}; raise max_connections "
                "or lower max_concurrent_requests"
            )
        return self

    @model_validator(mode="after")
    def _tls_is_whole(self) -> RouterSettings:
        if (self.backend_client_cert_file is None) != (self.backend_client_key_file is None):
            given, missing = (
                ("backend_client_cert_file", "backend_client_key_file")
                if self.backend_client_key_file is None
                else ("backend_client_key_file", "backend_client_cert_file")
            )
            raise ValueError(
                f"{given} is set but {missing} is not: mutual TLS needs the client "
                "certificate and its key; set both (or neither)"
            )
        if self.backend_ca_file is not None:
            # The operator asked for TLS to the engines: a plain http:// leg would carry the
            # signed kv_transfer_params in clear text beside the encrypted ones.
            urls = (
                ("prefill", [b.url for b in self.prefill]),
                ("decode", [b.url for b in self.decode]),
            )
            plain = [
                f"{role}[{i}].url = {url!r}"
                for role, lst in urls
                for i, url in enumerate(lst)
                if url.startswith("http://")
            ]
            if plain:
                raise ValueError(
                    f"backend_ca_file is set (TLS to the engines) but {', '.join(plain)} "
                    f"{'is' if len(plain) == 1 else 'are'} plain http://: use https:// for "
                    "every backend, or drop backend_ca_file"
                )
        return self

    @property
    def probes_decode(self) -> bool:
        """Whether decode backends are probed for their key: ``probe_decode`` in push mode
        with kvpush engines. Pull mode names no D to P, and vLLM's own connectors
        (``vllm_push_compat``) have no key while a vLLM D would hold a block for the probe."""
        return self.probe_decode and self.mode == "push" and not self.vllm_push_compat

    @model_validator(mode="after")
    def _key_is_strong(self) -> RouterSettings:
        if self.params_key is not None:
            try:
                check_key(self.params_key)
            except SignatureError as e:
                raise ValueError(f"params key: {e}") from None
        return self


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def _allowed_keys(loc: tuple[int | str, ...]) -> list[str]:
    model: type[BaseModel] = RouterSettings
    if loc and loc[0] == "prefill":
        model = PrefillBackendConfig
    elif loc and loc[0] == "decode":
        model = DecodeBackendConfig
    # params_key is set from a file or the environment only, never written as a key.
    return [k for k in model.model_fields if k != "params_key"]


def _describe(err: Any) -> str:
    loc = tuple(err["loc"])
    key = _loc(loc) or "<top level>"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        return f"unknown key {key!r}: {hint}allowed keys here are {', '.join(allowed)}"
    if err["type"] == "missing":
        return f"{key}: missing; add it (at least one backend URL)"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not loc:
        return msg
    return f"{key} = {err.get('input')!r}: {msg}"


def settings_from_mapping(data: Mapping[str, Any], source: str = "settings") -> RouterSettings:
    """Validate a plain mapping (parsed YAML, merged CLI flags) into :class:`RouterSettings`.

    The params key is read from ``params_key_file`` when given; a ``params_key`` in the
    mapping itself is refused (config files and flags are not for secrets).
    """
    if "params_key" in data:
        raise ConfigError(
            f"params_key in {source}: the params key is never read from a config file or a "
            f"flag; put it in a file (params_key_file / --params-key-file, readable only by "
            f"the router) or in ${PARAMS_KEY_ENV}"
        )
    try:
        settings = RouterSettings.model_validate(dict(data))
    except ValidationError as e:
        lines = "\n  ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"invalid router config in {source}:\n  {lines}") from None
    return with_params_key(settings)


def read_params_key(path: str | Path) -> bytes:
    """The params key in ``path``, through ``signing.read_key_file``: refused (ConfigError
    naming the file and the fix) when group or others may read the file, or when the key
    holds fewer than 32 random bytes."""
    try:
        return read_key_file(path, "params key file")
    except SignatureError as e:
        # read_key_file names the fix for a weak key or a loose file mode, not for a file
        # that cannot be read: point at the setting that named it.
        unreadable = e.reason == "key_file" and "chmod" not in str(e)
        fix = "; check params_key_file (--params-key-file)" if unreadable else ""
        raise ConfigError(f"{e}{fix}") from None


def read_admin_token(path: str | Path) -> bytes:
    """The admin API's bearer token in ``path``: its text without surrounding whitespace.

    Not a params key (it signs nothing, and ``kvpush drain`` reads the same file as an
    operator), so neither the params key's file-mode rule nor its strength test applies:
    only a minimum length.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ConfigError(
            f"cannot read the admin token file {str(path)!r}: {why}; check admin_token_file "
            "(--admin-token-file)"
        ) from None
    token = text.strip().encode()
    if len(token) < 16:
        raise ConfigError(
            f"the admin token in {str(path)!r} is {len(token)} bytes; use at least 16 random "
            "bytes (e.g. `openssl rand -hex 32 > FILE`)"
        )
    return token


def _with_admin_token(settings: RouterSettings) -> RouterSettings:
    """``settings`` with ``admin_token`` read from ``admin_token_file`` (if given)."""
    if settings.admin_token is not None or settings.admin_token_file is None:
        return settings
    return settings.model_copy(update={"admin_token": read_admin_token(settings.admin_token_file)})


def with_params_key(
    settings: RouterSettings, environ: Mapping[str, str] | None = None
) -> RouterSettings:
    """``settings`` with ``params_key`` loaded from ``params_key_file``, else from
    ``$KVPUSH_PARAMS_KEY`` in ``environ`` (not consulted when None); unchanged if neither.
    Also reads the admin token and checks the TLS files (ConfigError naming any problem)."""
    settings = _with_admin_token(settings)
    check_tls_files(settings)
    if settings.params_key is not None:
        return settings
    if settings.params_key_file is not None:
        key = read_params_key(settings.params_key_file)
    elif environ is not None and environ.get(PARAMS_KEY_ENV, "").strip():
        try:
            key = check_key(environ[PARAMS_KEY_ENV].strip().encode(), f"${PARAMS_KEY_ENV}")
        except SignatureError as e:
            raise ConfigError(str(e)) from None
    else:
        return settings
    if settings.vllm_push_compat:
        # vLLM's push connector verifies no signature, and kvpush engines refuse the
        # remote_request_id that vllm_push_compat adds to D's signed leg.
        raise ConfigError(
            "vllm_push_compat (--vllm-push-compat) with a params key: vLLM's "
            "NixlPushConnector checks no signature and kvpush engines refuse D's signed "
            "remote_request_id; drop the params key for vLLM's connectors, or "
            "vllm_push_compat for kvpush engines"
        )
    return settings.model_copy(update={"params_key": key})


def backend_ssl_context(settings: RouterSettings) -> ssl.SSLContext | None:
    """The TLS context the router's clients verify the engines with: ``backend_ca_file``
    as the only trusted CA (plus the client certificate, for mutual TLS); None without any
    TLS file (https:// backends are then checked against certifi's CAs, httpx's default).
    Raises ConfigError naming the file that cannot be used."""
    s = settings
    if s.backend_ca_file is None and s.backend_client_cert_file is None:
        return None
    # PROTOCOL_TLS_CLIENT checks the certificate chain and that it names the URL's host.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        # Only the operator's CA when given: an engine certificate that some public CA
        # signed is not one of the deployment's engines.
        ctx.load_verify_locations(cafile=s.backend_ca_file or certifi.where())
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"backend_ca_file {s.backend_ca_file!r} cannot be used as a CA: "
            f"{getattr(e, 'strerror', None) or e}; point it at the PEM certificate of the CA "
            "that signed the engines' certificates (--backend-ca-file)"
        ) from None
    if s.backend_client_cert_file is not None:
        try:
            ctx.load_cert_chain(s.backend_client_cert_file, s.backend_client_key_file)
        except (OSError, ssl.SSLError) as e:
            raise ConfigError(
                f"backend_client_cert_file {s.backend_client_cert_file!r} with "
                f"backend_client_key_file {s.backend_client_key_file!r} cannot be used: "
                f"{getattr(e, 'strerror', None) or e}; point them at a PEM certificate and "
                "its unencrypted PEM key"
            ) from None
    return ctx


def check_tls_files(settings: RouterSettings) -> None:
    """ConfigError now, at start, if a TLS file cannot be loaded (rather than at the first
    leg)."""
    backend_ssl_context(settings)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Parse a router YAML file into a mapping, with errors that name the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(
            f"cannot read router config {str(p)!r}: {e.strerror}; check the --config path"
        ) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"router config {str(p)!r} is not valid YAML: {e}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"router config {str(p)!r} must be a mapping of keys (prefill, decode, policy, ...), "
            f"got a {type(data).__name__}"
        )
    return data


def load_settings(path: str | Path, **overrides: Any) -> RouterSettings:
    """Load and validate a router YAML file; keyword overrides (not None) win over the file.

    The params key comes from the file's params_key_file, else from $KVPUSH_PARAMS_KEY.
    """
    data = read_yaml(path)
    data.update({k: v for k, v in overrides.items() if v is not None})
    return with_params_key(settings_from_mapping(data, source=str(path)), os.environ)
