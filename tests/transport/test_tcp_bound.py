"""UCX's TCP transport bounded below the permit (``bound_tcp_delivery``): a WRITE held by a
partition must not land after D gave its blocks back, so the connection that holds it
dies first."""

from __future__ import annotations

import pytest

from kvpush_prod.transport.nixl import UCX_TCP_USER_TIMEOUT, bound_tcp_delivery, make_agent


def test_the_bound_is_set_in_milliseconds_unless_the_operator_set_one() -> None:
    env: dict[str, str] = {}
    assert bound_tcp_delivery(3.0, env) == ("3000ms", True)
    assert env[UCX_TCP_USER_TIMEOUT] == "3000ms"
    assert bound_tcp_delivery(0.0001, {}) == ("1ms", True)
    mine = {UCX_TCP_USER_TIMEOUT: "10s"}
    assert bound_tcp_delivery(3.0, mine) == ("10s", False)
    assert mine[UCX_TCP_USER_TIMEOUT] == "10s"


@pytest.mark.nixl
def test_ucx_takes_the_setting(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The UCX that NIXL bundles knows the variable (an unknown one is only warned about, and
    would leave TCP's 15-30 minute default in force)."""
    pytest.importorskip("nixl")
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    monkeypatch.setenv("UCX_WARN_UNUSED_ENV_VARS", "y")
    # Empty counts as unset; monkeypatch then restores whatever was there (the bound writes
    # os.environ itself).
    monkeypatch.setenv(UCX_TCP_USER_TIMEOUT, "")
    value, ours = bound_tcp_delivery(3.0)
    assert ours and value == "3000ms"
    agent = make_agent("kvpush-test-tcp-bound", "UCX", False, 1000)
    assert "UCX" in agent.backends
    err = capfd.readouterr().err
    assert "unused" not in err or UCX_TCP_USER_TIMEOUT not in err, err
