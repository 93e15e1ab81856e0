"""``kvpush doctor --peer``: who the peer must prove to be, the probe, and its rows."""

from __future__ import annotations

from kvpush_prod.config import KvpushConfig
from kvpush_prod.control.keys import KeyPair, load_allowed, load_keypair
from kvpush_prod.doctor.checks import Row, Status
from kvpush_prod.doctor.cli import UsageError
from kvpush_prod.doctor.peer import ProbeError, ProbePlan, ProbeResult, probe_peer
from kvpush_prod.errors import ConfigError

GBIT = 1e9 / 8  # bytes per second in one gigabit per second


def _peer_key(cfg: KvpushConfig, name: str | None) -> tuple[KeyPair, bytes, str] | None:
    """This engine's key pair, the key the peer must prove and its name (None: plaintext)."""
    c = cfg.control
    if c.key_file is None or c.allowed_keys is None:
        return None
    me, allowed = load_keypair(c.key_file), load_allowed(c.allowed_keys)
    others = {n: k for k, n in allowed.items() if k != me.public}
    if name is not None:
        if name not in others:
            raise UsageError(
                f"--peer-name {name!r} is not in the allow-list {c.allowed_keys} "
                f"(other engines there: {', '.join(sorted(others)) or 'none'})"
            )
        return me, others[name], name
    if len(others) != 1:
        raise UsageError(
            "--peer-name NAME is needed: the allow-list holds "
            f"{len(others)} other engines ({', '.join(sorted(others))}); name "
            "the one listening at --peer"
        )
    ((only, key),) = others.items()
    return me, key, only


def check_peer(
    cfg: KvpushConfig, peer: tuple[str, int], name: str | None, plan: ProbePlan | None = None
) -> list[Row]:
    host, port = peer
    address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    try:
        keys = _peer_key(cfg, name)
    except ConfigError as exc:
        return [
            Row(
                "peer",
                Status.FAIL,
                f"cannot load the keys to probe with: {exc}",
                "fix the key rows above first",
            )
        ]
    plan = plan or ProbePlan(frame_bytes=min(256 << 10, cfg.control.max_message_bytes // 2))
    who = f"{keys[2]} at {address}" if keys else f"{address} (plaintext)"
    try:
        result = probe_peer(address, keys[0] if keys else None, keys[1] if keys else None, plan)
    except ProbeError as exc:
        return [Row("peer", Status.FAIL, str(exc).split(": ", 1)[0], str(exc).split(": ", 1)[-1])]
    return _rows(cfg, who, result)


def _rows(cfg: KvpushConfig, who: str, r: ProbeResult) -> list[Row]:
    gbps = r.bandwidth_bytes_per_s / GBIT
    rows = [
        Row(
            "peer handshake",
            Status.OK,
            f"{who}: {'authenticated (CurveZMQ)' if cfg.control.key_file else 'connected'} "
            f"in {r.handshake_s * 1000:.1f} ms",
        ),
        Row(
            "peer latency",
            Status.OK,
            f"round trip p50 {r.rtt_p50_s * 1e6:.0f} us, min {r.rtts_s[0] * 1e6:.0f} us, "
            f"max {r.rtts_s[-1] * 1e6:.0f} us ({len(r.rtts_s)} pings)",
        ),
        Row(
            "peer bandwidth",
            Status.OK,
            f"{r.bandwidth_bytes_per_s / 1e9:.3f} GB/s ({gbps:.2f} Gbit/s) over the control "
            f"channel, {r.burst_bytes / 1e6:.1f} MB",
        ),
    ]
    expected = cfg.links.expected_gbps
    if expected is not None:
        rows.append(
            Row(
                "expected link",
                Status.INFO,
                f"links.expected_gbps {expected:g} Gbit/s is NIXL's path; this probe "
                f"runs over the control channel's TCP ({gbps:.2f} Gbit/s), so it bounds "
                "the TCP fallback, and the slow-link guard compares NIXL at run time",
            )
        )
    rows.append(_skew_row(cfg, r))
    return rows


def _skew_row(cfg: KvpushConfig, r: ProbeResult) -> Row:
    margin = cfg.leases.skew_margin_s
    skew = abs(r.skew_s)
    detail = (
        f"peer clock {r.skew_s * 1000:+.1f} ms from ours (+-{r.skew_error_s * 1000:.1f} "
        f"ms); leases.skew_margin_s {margin:g} s"
    )
    fix = (
        f"synchronise both hosts' clocks (chrony or NTP), or raise leases.skew_margin_s "
        f"above {skew:.1f} s"
    )
    if skew - r.skew_error_s > margin:
        return Row("clock skew", Status.FAIL, detail, fix)
    if skew > margin / 2:
        return Row("clock skew", Status.WARN, detail, fix)
    return Row("clock skew", Status.OK, detail)
