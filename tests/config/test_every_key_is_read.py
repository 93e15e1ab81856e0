"""Every key of the configuration reference is read on the real path.

Traced where it can be: each key in turn gets a distinctive valid value, and the protocol
core's settings built from that configuration (``config.core``: what the Sender, the Receiver
and D's credit ledger run on) must differ from those of the defaults. Keys the shells read
(NIXL, the control channel, the pump, the fault injector) are in ``SHELL_READERS``, a
reviewed map key -> (module, the expression that reads it); the module's code (parsed, so
comments and strings do not count) must hold that expression as an attribute read. A key in
neither is read by nothing: the test names it.

The mutation tests prove both halves: with any reader commented out or replaced, in a copy of
its module, a check here (or one of ``test_core_settings``) fails.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import shutil
import sys
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pydantic import ValidationError

from kvpush_prod.config import KvpushConfig, field_rows
from kvpush_prod.config.core import core_settings, credit_settings

from . import test_core_settings

SRC = Path(__file__).resolve().parents[2] / "src" / "kvpush_prod"
BLOCK_BYTES = 131072
NUM_BLOCKS = 1000

# key -> (module under src/kvpush_prod, an attribute read in its code that reads the key)
SHELL_READERS: dict[str, tuple[str, str]] = {
    "control.host": ("connector/worker.py", "self.cfg.control.host"),
    # Sizes the staging area (workers) and caps the credit budget (scheduler) alike.
    "staging.receive_mib": ("connector/worker.py", "self.cfg.staging.receive_mib"),
    "staging.send_mib": ("connector/worker.py", "self.cfg.staging.send_mib"),
    "control.advertise_host": ("connector/worker.py", "self.cfg.control.advertise_host"),
    "control.port": ("connector/worker.py", "cfg.control.port"),
    "control.key_file": ("connector/worker.py", "c.key_file"),
    "control.allowed_keys": ("connector/worker.py", "c.allowed_keys"),
    # A validation rule (keys or loopback, else insecure must be asked for by name).
    "control.insecure": ("config/settings.py", "self.insecure"),
    "control.allowed_peers": ("connector/trust.py", "c.allowed_peers"),
    "control.params_key_file": ("connector/trust.py", "c.params_key_file"),
    "control.params_key": ("connector/trust.py", "c.params_key"),
    "control.max_peers": ("connector/worker.py", "self.cfg.control.max_peers"),
    "control.max_message_bytes": ("connector/worker.py", "self.cfg.control.max_message_bytes"),
    "transport.backend": ("connector/worker.py", "t.backend"),
    "transport.progress_thread": ("connector/worker.py", "t.progress_thread"),
    "transport.progress_delay_us": ("connector/worker.py", "t.progress_delay_us"),
    "transport.active_poll_ms": ("connector/worker.py", "self.cfg.transport.active_poll_ms"),
    "transport.idle_poll_ms": ("connector/worker.py", "self.cfg.transport.idle_poll_ms"),
    "transport.num_threads": ("connector/worker.py", "t.num_threads"),
    "transport.connect_timeout_s": ("connector/worker.py", "cfg.transport.connect_timeout_s"),
    "push.chunk_timeout_s": ("connector/worker.py", "cfg.push.chunk_timeout_s"),
    "push.layerwise": ("connector/worker.py", "self.cfg.push.layerwise"),
    "push.layerwise_min_tokens": ("connector/worker.py", "p.layerwise_min_tokens"),
    "push.layerwise_min_transfer_ms": ("connector/worker.py", "p.layerwise_min_transfer_ms"),
    "verify.checksums": ("connector/worker.py", "cfg.verify.checksums"),
    # The fault injector takes its whole section (model_dump) and reads each field.
    **{
        f"faults.{k}": ("transport/faults.py", f"self.s.{k}")
        for k in (
            "post_fail_rate",
            "complete_fail_rate",
            "error",
            "fail_nth",
            "delay_ms",
            "stall_rate",
            "drop_done_rate",
            "active_file",
        )
    },
    "faults.op": ("transport/faults.py", "s.op"),
    "faults.connect_delay_ms": ("transport/faults.py", "s.connect_delay_ms"),
    "faults.peers": ("transport/faults.py", "s.peers"),
    "faults.enabled": ("connector/worker.py", "faults.enabled"),
    "faults.seed": ("transport/faults.py", "settings.seed"),
    # kvpush doctor fails a host whose links would not run on the fabric asked for.
    "links.fabric": ("doctor/checks.py", "cfg.links.fabric"),
    # The slow-link guard P's pump runs (connector/worker.py builds it from the config).
    "links.expected_gbps": ("connector/linkguard.py", "links.expected_gbps"),
    "links.slow_fraction": ("connector/linkguard.py", "links.slow_fraction"),
    "links.slow_window_s": ("connector/linkguard.py", "links.slow_window_s"),
}
# The configuration package defines every key; a read there counts only for these keys,
# whose whole effect is a validation rule of the model itself.
READ_BY_CONFIG = {"control.insecure"}

CoreFns = tuple[Callable[..., Any], Callable[..., Any]]


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


@functools.cache
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


def _core(cfg: KvpushConfig, fns: CoreFns = (core_settings, credit_settings)) -> tuple[Any, ...]:
    return (fns[0](cfg, BLOCK_BYTES), fns[1](cfg, NUM_BLOCKS))


@functools.cache
def attribute_reads(source: str) -> frozenset[str]:
    """Every attribute read (``a.b.c``, as written) in the code of ``source``: comments,
    strings and docstrings hold none."""
    return frozenset(
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
    )


def _shell_problem(name: str, src: Path) -> str | None:
    module, expr = SHELL_READERS[name]
    if module.startswith("config/") and name not in READ_BY_CONFIG:
        return f"{name}: read in {module}, the configuration package itself (not a reader)"
    path = src / module
    if not path.is_file():
        return f"{name}: {module} does not exist"
    try:
        reads = attribute_reads(path.read_text())
    except SyntaxError as exc:
        return f"{name}: {module} does not parse ({exc})"
    if expr not in reads:
        return f"{name}: {module} no longer reads it as {expr!r} (in code)"
    return None


def _unread(src: Path = SRC, fns: CoreFns = (core_settings, credit_settings)) -> list[str]:
    base = _core(KvpushConfig(), fns)
    out = []
    for section, key, _ in field_rows():
        name = f"{section}.{key}"
        if name in SHELL_READERS:
            problem = _shell_problem(name, src)
            if problem is not None:
                out.append(problem)
            continue
        cfg = _distinct(section, key)
        if cfg is None:
            out.append(f"{name}: no valid value other than the default to trace it with")
        elif _core(cfg, fns) == base:
            out.append(
                f"{name}: a distinctive value reaches none of the core's settings "
                "(config.core) and no shell reads it (SHELL_READERS)"
            )
    return out


def test_every_key_in_the_configuration_reference_is_read_on_the_real_path() -> None:
    assert _unread() == []


@pytest.mark.parametrize(
    "key",
    [
        "push.max_inflight_chunks",
        "retry.done_query_timeout_ms",
        "push.chunk_bytes",
        "breaker.window_s",
        "fallback.pull",
    ],
)
def test_a_key_of_the_push_sections_reaches_the_core(key: str) -> None:
    section, name = key.split(".")
    cfg = _distinct(section, name)
    assert cfg is not None and _core(cfg) != _core(KvpushConfig())


def test_the_trace_catches_a_key_nothing_reads() -> None:
    real = core_settings

    def forgetful(cfg: KvpushConfig, block_bytes: int) -> Any:
        # As if config.core dropped push.max_inflight_chunks (as it did): the default goes
        # through whatever the configuration says.
        return real(
            cfg.model_copy(
                update={"push": cfg.push.model_copy(update={"max_inflight_chunks": 64})}
            ),
            block_bytes,
        )

    unread = _unread(fns=(forgetful, credit_settings))
    assert any(u.startswith("push.max_inflight_chunks:") for u in unread)


def test_a_read_in_a_comment_or_a_string_is_not_a_read() -> None:
    source = (
        '"""self.cfg.transport.idle_poll_ms"""\n'
        "# idle = self.cfg.transport.idle_poll_ms\n"
        "x = 'self.cfg.transport.idle_poll_ms'\n"
        "y = self.cfg.transport.active_poll_ms\n"
    )
    reads = attribute_reads(source)
    assert "self.cfg.transport.idle_poll_ms" not in reads
    assert "self.cfg.transport.active_poll_ms" in reads


# ------------------------------------------------------------------ mutations: the shells


def _copy_src(tmp_path: Path) -> Path:
    """The modules SHELL_READERS names, copied (the mutations change the copies only)."""
    dst = tmp_path / "kvpush_prod"
    for module in {m for m, _ in SHELL_READERS.values()}:
        (dst / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SRC / module, dst / module)
    return dst


def _reader_nodes(source: str, expr: str) -> list[ast.Attribute]:
    return [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and ast.unparse(n) == expr
    ]


def _replace_reads(source: str, expr: str, by: str) -> str:
    """``source`` with every read of ``expr`` replaced by ``by`` (right to left, so the
    positions of the ones still to replace hold)."""
    lines = source.splitlines(keepends=True)
    nodes = _reader_nodes(source, expr)
    assert nodes, f"no read of {expr!r} to mutate"
    for n in sorted(nodes, key=lambda n: (n.lineno, n.col_offset), reverse=True):
        assert n.end_lineno == n.lineno and n.end_col_offset is not None
        line = lines[n.lineno - 1]
        lines[n.lineno - 1] = line[: n.col_offset] + by + line[n.end_col_offset :]
    return "".join(lines)


@pytest.mark.parametrize("key", sorted(SHELL_READERS))
def test_any_shell_reader_replaced_by_a_constant_is_caught(tmp_path: Path, key: str) -> None:
    src = _copy_src(tmp_path)
    module, expr = SHELL_READERS[key]
    path = src / module
    path.write_text(_replace_reads(path.read_text(), expr, "None"))
    ast.parse(path.read_text())  # the mutant is valid code that reads nothing
    assert any(u.startswith(f"{key}:") for u in _unread(src)), key


# Readers on a line of their own: commented out, the module still parses, and the key's
# name is still in its text (the substring check that came before let these pass).
COMMENTED_OUT = [
    "transport.idle_poll_ms",
    "transport.active_poll_ms",
    "push.chunk_timeout_s",
    "faults.seed",
    "control.port",
    "faults.enabled",
]


def _comment_out_reads(source: str, expr: str) -> str:
    lines = source.splitlines(keepends=True)
    for n in _reader_nodes(source, expr):
        line = lines[n.lineno - 1]
        indent = len(line) - len(line.lstrip())
        lines[n.lineno - 1] = line[:indent] + "# " + line[indent:]
    return "".join(lines)


@pytest.mark.parametrize("key", COMMENTED_OUT)
def test_a_shell_reader_commented_out_is_caught(tmp_path: Path, key: str) -> None:
    src = _copy_src(tmp_path)
    module, expr = SHELL_READERS[key]
    path = src / module
    mutant = _comment_out_reads(path.read_text(), expr)
    if key == "faults.enabled":  # `if faults.enabled:` opens a block: keep one that parses
        mutant = mutant.replace("# if faults.enabled:", "if True:  # faults.enabled")
    path.write_text(mutant)
    ast.parse(mutant)
    assert expr in mutant  # a check of the text alone would still find it
    assert any(u.startswith(f"{key}:") for u in _unread(src)), key


# ------------------------------------------------------------------ mutations: config.core


def _config_reads(tree: ast.Module) -> Iterator[tuple[ast.Attribute, str, str]]:
    """Every ``cfg.SECTION.KEY`` read in config/core.py, also through a local alias of a
    section (``leases, retry = cfg.leases, cfg.retry``): (node, section, key)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = (
                node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else node.targets
            )
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
            for t, v in zip(targets, values, strict=False):
                if (
                    isinstance(t, ast.Name)
                    and isinstance(v, ast.Attribute)
                    and isinstance(v.value, ast.Name)
                    and v.value.id == "cfg"
                ):
                    aliases[t.id] = v.attr
    sections = {s for s, _, _ in field_rows()}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not isinstance(node.ctx, ast.Load):
            continue
        owner = node.value
        if (
            isinstance(owner, ast.Attribute)
            and isinstance(owner.value, ast.Name)
            and owner.value.id == "cfg"
            and owner.attr in sections
        ):
            yield node, owner.attr, node.attr
        elif isinstance(owner, ast.Name) and owner.id in aliases:
            yield node, aliases[owner.id], node.attr


CORE_PY = SRC / "config" / "core.py"
# (key, the core setting its line sets): reads whose mutants no valid configuration tells
# apart. ``backoff_max_s=max(retry.max_backoff_ms, retry.base_backoff_ms)``: the model
# refuses max_backoff_ms < base_backoff_ms, so the second operand never wins.
EQUIVALENT = {("retry.base_backoff_ms", "backoff_max_s")}


def _equivalent(line: str, section: str, key: str) -> bool:
    return any(f"{section}.{key}" == k and f"{setting}=" in line for k, setting in EQUIVALENT)


_CORE_LINES = CORE_PY.read_text().splitlines()
CORE_READS = [
    (n.lineno, n.col_offset, s, k)
    for n, s, k in _config_reads(ast.parse(CORE_PY.read_text()))
    if not _equivalent(_CORE_LINES[n.lineno - 1], s, k)
]


def _load(path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    name = f"kvpush_mutant_{abs(hash(path))}"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _failures(fns: CoreFns, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What fails with ``fns`` as config.core's mapping: this file's trace and the tests of
    test_core_settings."""
    out = [f"trace: {u}" for u in _unread(fns=fns)]
    monkeypatch.setattr(test_core_settings, "core_settings", fns[0])
    monkeypatch.setattr(test_core_settings, "credit_settings", fns[1])
    for name in dir(test_core_settings):
        if name.startswith("test_"):
            try:
                getattr(test_core_settings, name)()
            except AssertionError:
                out.append(name)
    return out


def test_config_core_reads_every_traced_key() -> None:
    read = {f"{s}.{k}" for _, _, s, k in CORE_READS}
    traced = {f"{s}.{k}" for s, k, _ in field_rows()} - set(SHELL_READERS)
    assert traced <= read and len(CORE_READS) >= len(traced)


def test_the_unmutated_mapping_passes_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _failures((core_settings, credit_settings), monkeypatch) == []


@pytest.mark.parametrize(
    ("line", "col", "section", "key"),
    CORE_READS,
    ids=[f"{s}.{k}@{ln}" for ln, _, s, k in CORE_READS],
)
def test_any_reader_of_config_core_ignoring_its_key_is_caught(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, line: int, col: int, section: str, key: str
) -> None:
    # The read becomes the key's default: what commenting out a keyword argument does (the
    # core's defaults equal the configuration's), and possible for positional ones too.
    default = getattr(getattr(KvpushConfig(), section), key)
    lines = CORE_PY.read_text().splitlines(keepends=True)
    (node,) = [
        n
        for n, _, _ in _config_reads(ast.parse(CORE_PY.read_text()))
        if (n.lineno, n.col_offset) == (line, col)
    ]
    assert node.end_lineno == line and node.end_col_offset is not None
    text = lines[line - 1]
    lines[line - 1] = text[:col] + repr(default) + text[node.end_col_offset :]
    path = tmp_path / "core.py"
    path.write_text("".join(lines))
    mutant = _load(path, monkeypatch)
    assert _failures((mutant.core_settings, mutant.credit_settings), monkeypatch), (
        f"{section}.{key} at config/core.py:{line} ignored and no check failed"
    )
