"""Every key of the configuration reference is read on the real path.

Traced where it can be: each key in turn gets a distinctive valid value, and the protocol
core's settings built from that configuration (``config.core``: what the Sender, the Receiver
and D's credit ledger run on) must differ from those of the defaults. Keys the shells read
(NIXL, the control channel, the pump, the fault injector) are in ``SHELL_READERS``, a
reviewed map key -> (module, the expression that reads it), checked against the module's
source. A key in neither is read by nothing: the test names it.
"""

from __future__ import annotations

import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from kvpush_prod.config import KvpushConfig, field_rows
from kvpush_prod.config.core import core_settings, credit_settings

SRC = Path(__file__).resolve().parents[2] / "src" / "kvpush_prod"
BLOCK_BYTES = 131072
NUM_BLOCKS = 1000

# key -> (module under src/kvpush_prod, an expression in it that reads the key)
SHELL_READERS: dict[str, tuple[str, str]] = {
    "control.host": ("connector/worker.py", "self.cfg.control.host"),
    "control.advertise_host": ("connector/worker.py", "self.cfg.control.advertise_host"),
    "control.port": ("connector/worker.py", "cfg.control.port"),
    "control.key_file": ("connector/worker.py", "c.key_file"),
    "control.allowed_keys": ("connector/worker.py", "c.allowed_keys"),
    "control.insecure": ("config/settings.py", "self.insecure"),
    "control.allowed_peers": ("connector/trust.py", "allowed_peers"),
    "control.params_key_file": ("connector/trust.py", "params_key_file"),
    "control.params_key": ("connector/trust.py", "params_key"),
    "control.max_peers": ("connector/worker.py", "max_peers=self.cfg.control.max_peers"),
    "control.max_message_bytes": ("connector/worker.py", "self.cfg.control.max_message_bytes"),
    "transport.backend": ("connector/worker.py", "t.backend"),
    "transport.progress_thread": ("connector/worker.py", "t.progress_thread"),
    "transport.progress_delay_us": ("connector/worker.py", "t.progress_delay_us"),
    "transport.active_poll_ms": ("connector/worker.py", "self.cfg.transport.active_poll_ms"),
    "transport.idle_poll_ms": ("connector/worker.py", "self.cfg.transport.idle_poll_ms"),
    "transport.num_threads": ("connector/worker.py", "t.num_threads"),
    "push.chunk_timeout_s": ("connector/worker.py", "cfg.push.chunk_timeout_s"),
    "verify.checksums": ("connector/worker.py", "cfg.verify.checksums"),
    # The fault injector takes its whole section (model_dump) and reads each field.
    **{f"faults.{k}": ("transport/faults.py", f"self.s.{k}")
       for k in ("post_fail_rate", "complete_fail_rate", "error", "fail_nth", "delay_ms",
                 "stall_rate", "drop_done_rate", "active_file")},
    "faults.op": ("transport/faults.py", "s.op != op"),
    "faults.peers": ("transport/faults.py", "s.peers and"),
    "faults.enabled": ("connector/worker.py", "faults.enabled"),
    "faults.seed": ("transport/faults.py", "settings.seed"),
}


def _candidates(default: Any, annotation: Any) -> list[Any]:
    """Values unlike ``default`` a field of ``annotation`` may take (tried in turn)."""
    if isinstance(default, bool):
        return [not default]
    if isinstance(default, int):
        return [default + 1, default - 1, default * 2, 1]
    if isinstance(default, float):
        return [default * 1.37, default * 0.73, default + 0.5, default / 3, 1.0]
    if typing.get_origin(annotation) is typing.Literal:
        return [a for a in typing.get_args(annotation) if a != default]
    if isinstance(default, list):
        return [["10.0.0.0/8"], ["x"]]
    return ["tcp-x", "10.1.2.3", "/tmp/kvpush-key-x", "x" * 32]


def _distinct(section: str, key: str) -> KvpushConfig | None:
    """A valid configuration that differs from the defaults in ``section.key`` only."""
    model = type(getattr(KvpushConfig(), section))
    f = model.model_fields[key]
    default = getattr(getattr(KvpushConfig(), section), key)
    for value in _candidates(default, f.annotation):
        try:
            return KvpushConfig.model_validate({section: {key: value}})
        except ValidationError:
            continue
    return None


def _core(cfg: KvpushConfig) -> tuple[Any, ...]:
    return (core_settings(cfg, BLOCK_BYTES), credit_settings(cfg, NUM_BLOCKS))


def _unread() -> list[str]:
    base = _core(KvpushConfig())
    out = []
    for section, key, _ in field_rows():
        name = f"{section}.{key}"
        reader = SHELL_READERS.get(name)
        if reader is not None:
            module, expr = reader
            if expr not in (SRC / module).read_text():
                out.append(f"{name}: {module} no longer reads it as {expr!r}")
            continue
        cfg = _distinct(section, key)
        if cfg is None:
            out.append(f"{name}: no valid value other than the default to trace it with")
        elif _core(cfg) == base:
            out.append(f"{name}: a distinctive value reaches none of the core's settings "
                       "(config.core) and no shell reads it (SHELL_READERS)")
    return out


def test_every_key_in_the_configuration_reference_is_read_on_the_real_path() -> None:
    assert _unread() == []


@pytest.mark.parametrize("key", ["push.max_inflight_chunks", "retry.done_query_timeout_ms",
                                 "push.chunk_bytes", "breaker.window_s", "fallback.pull"])
def test_a_key_of_the_push_sections_reaches_the_core(key: str) -> None:
    section, name = key.split(".")
    cfg = _distinct(section, name)
    assert cfg is not None and _core(cfg) != _core(KvpushConfig())


def test_the_trace_catches_a_key_nothing_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    real = core_settings

    def forgetful(cfg: KvpushConfig, block_bytes: int) -> Any:
        # As if config.core dropped push.max_inflight_chunks (as it did): the default goes
        # through whatever the configuration says.
        return real(cfg.model_copy(update={"push": cfg.push.model_copy(
            update={"max_inflight_chunks": 64})}), block_bytes)

    monkeypatch.setitem(globals(), "core_settings", forgetful)
    assert any(u.startswith("push.max_inflight_chunks:") for u in _unread())
