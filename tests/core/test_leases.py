"""LeaseTable and Permit: generations, stale rejection, stop margin, reuse after expiry+skew or ack."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush_prod.core.leases import (
    LeaseCheck,
    LeaseSettings,
    LeaseState,
    LeaseTable,
    Permit,
)
from kvpush_prod.errors import ConfigError, ProtocolError

CORE = settings.get_profile("kvpush-core")


def table(skew: float = 1.0) -> LeaseTable[str]:
    return LeaseTable(LeaseSettings(skew_margin_s=skew))


def test_generations_increase_across_the_whole_table() -> None:
    t = table()
    a = t.grant("a", 0.0, 5.0)
    b = t.grant("b", 0.0, 5.0)
    assert (a.generation, b.generation) == (1, 2)
    assert a.expires_at == 5.0
    t.ack("a", a.generation)
    again = t.grant("a", 1.0, 5.0)
    assert again.generation == 3


def test_first_generation_can_start_higher_for_a_restarted_grantor() -> None:
    t: LeaseTable[str] = LeaseTable(LeaseSettings(first_generation=1000))
    assert t.grant("a", 0.0, 1.0).generation == 1000


def test_renew_with_the_current_generation_extends_the_lease() -> None:
    t = table()
    g = t.grant("a", 0.0, 5.0).generation
    assert t.renew("a", g, 3.0) is LeaseCheck.OK
    lease = t.get("a")
    assert lease is not None and lease.expires_at == 8.0
    assert t.renew("a", g, 4.0, ttl=10.0).ok
    assert t.get("a") == t.get("a") and t.get("a").expires_at == 14.0  # type: ignore[union-attr]


def test_renew_never_shortens_a_lease() -> None:
    t = table()
    g = t.grant("a", 0.0, 10.0).generation
    assert t.renew("a", g, 1.0, ttl=2.0).ok
    assert t.get("a").expires_at == 10.0  # type: ignore[union-attr]


def test_a_stale_generation_is_rejected_and_changes_nothing() -> None:
    t = table()
    old = t.grant("a", 0.0, 5.0)
    t.ack("a", old.generation)
    new = t.grant("a", 1.0, 5.0)
    assert t.renew("a", old.generation, 2.0) is LeaseCheck.STALE
    assert t.ack("a", old.generation) is LeaseCheck.STALE
    assert t.get("a") == new
    assert t.state("a") is LeaseState.LIVE
    assert not t.reusable("a", 2.0)
    assert t.stats().rejected_stale == 2


def test_renew_of_an_unknown_key_is_rejected() -> None:
    assert table().renew("nope", 1, 0.0) is LeaseCheck.UNKNOWN


def test_an_expired_lease_cannot_be_renewed_back() -> None:
    t = table()
    g = t.grant("a", 0.0, 5.0).generation
    assert t.renew("a", g, 5.0) is LeaseCheck.EXPIRED
    assert t.get("a").expires_at == 5.0  # type: ignore[union-attr]
    assert t.expire(5.0) == ["a"]  # still reported once by expire()


def test_expire_reports_each_lease_once_and_skips_renewed_ones() -> None:
    t = table()
    ga = t.grant("a", 0.0, 5.0).generation
    t.grant("b", 0.0, 5.0)
    t.renew("a", ga, 4.0)  # a now ends at 9
    assert t.expire(6.0) == ["b"]
    assert t.expire(6.0) == []
    assert t.expire(9.0) == ["a"]
    assert t.state("a") is LeaseState.EXPIRED


def test_a_released_lease_is_not_renewable_and_reusable_only_after_expiry_plus_skew() -> None:
    t = table(skew=1.0)
    g = t.grant("a", 0.0, 5.0).generation
    assert t.release("a") is True
    assert t.release("a") is False
    assert t.renew("a", g, 1.0) is LeaseCheck.ENDED
    assert not t.reusable("a", 5.5)  # the holder may still act until 5, clocks differ
    assert t.reusable("a", 6.0)
    assert t.reusable_at("a") == 6.0


def test_an_ack_with_the_current_generation_makes_reuse_immediate() -> None:
    t = table(skew=1.0)
    g = t.grant("a", 0.0, 5.0).generation
    assert t.ack("a", g) is LeaseCheck.OK
    assert t.reusable("a", 0.1)
    assert t.state("a") is LeaseState.ACKED
    assert t.expire(100.0) == []  # an acked lease is not reported as expired


def test_granting_again_before_reuse_is_allowed_is_a_protocol_error() -> None:
    t = table(skew=1.0)
    t.grant("a", 0.0, 5.0)
    with pytest.raises(ProtocolError, match=r"'a'.*generation 1"):
        t.grant("a", 5.5, 5.0)
    assert t.grant("a", 6.0, 5.0).generation == 2


def test_forget_refuses_a_lease_that_is_not_reusable() -> None:
    t = table(skew=1.0)
    g = t.grant("a", 0.0, 5.0).generation
    with pytest.raises(ProtocolError, match="not reusable"):
        t.forget("a", 5.9)
    t.forget("a", 6.0)
    assert "a" not in t and len(t) == 0
    t.grant("b", 0.0, 5.0)
    t.ack("b", g + 1)
    t.forget("b", 0.0)
    assert t.reusable("b", 0.0)  # no lease: nothing fences it


def test_a_bad_ttl_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="0"):
        table().grant("a", 0.0, 0.0)
    with pytest.raises(ProtocolError, match="inf"):
        table().grant("a", 0.0, float("inf"))


def test_next_expiry_is_the_earliest_expiry() -> None:
    t = table()
    assert t.next_expiry() is None
    t.grant("a", 0.0, 5.0)
    t.grant("b", 0.0, 3.0)
    assert t.next_expiry() == 3.0


def test_invalid_lease_settings_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        LeaseSettings(skew_margin_s=-1.0)
    with pytest.raises(ConfigError):
        LeaseSettings(first_generation=0)


# ----------------------------------------------------------------------------- holder side


def test_a_permit_stops_being_usable_stop_margin_before_expiry() -> None:
    p = Permit.from_ttl("t1", 7, ttl=10.0, received_at=100.0, stop_margin=0.5)
    assert p.expires_at == 110.0 and p.stop_at == 109.5
    assert p.usable(109.49)
    assert not p.usable(109.5)
    assert not p.usable(110.0)


def test_a_permit_renewal_with_a_stale_generation_is_rejected() -> None:
    p = Permit("t1", 7, 10.0, 0.5)
    with pytest.raises(ProtocolError, match=r"generation 7.*6"):
        p.renewed(6, 20.0)


def test_a_permit_renewal_only_moves_expiry_later() -> None:
    p = Permit("t1", 7, 10.0, 0.5)
    assert p.renewed(7, 12.0).expires_at == 12.0
    assert p.renewed(7, 9.0) is p


def test_a_permit_with_a_negative_stop_margin_or_bad_ttl_is_rejected() -> None:
    with pytest.raises(ProtocolError):
        Permit("t1", 1, 10.0, -0.1)
    with pytest.raises(ProtocolError):
        Permit.from_ttl("t1", 1, ttl=-1.0, received_at=0.0, stop_margin=0.1)


# ----------------------------------------------------------------------------- property


@CORE
@given(
    ttl=st.floats(0.5, 10.0),
    stop=st.floats(0.0, 1.0),
    skew=st.floats(0.0, 1.0),
    delays=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
    gaps=st.lists(st.floats(0.0, 8.0), min_size=12, max_size=12),
    probes=st.lists(st.floats(0.0, 60.0), min_size=20, max_size=20),
)
def test_the_holder_has_stopped_whenever_the_grantor_may_reuse(
    ttl: float,
    stop: float,
    skew: float,
    delays: list[float],
    gaps: list[float],
    probes: list[float],
) -> None:
    """Gray & Cheriton: with one-way delays <= stop + skew, no instant has the grantor
    reusing a key (without an ack) while its holder still thinks the permit usable."""
    max_delay = stop + skew
    t = table(skew=skew)
    now = 0.0
    lease = t.grant("k", now, ttl)
    permit = Permit.from_ttl("k", lease.generation, ttl, now + min(delays[0], max_delay), stop)
    # Renewals: grantor renews at growing times; each reaches the holder after a delay.
    for gap, delay in zip(gaps, delays[1:], strict=False):
        now += gap
        if t.renew("k", lease.generation, now).ok:
            received = now + min(delay, max_delay)
            permit = permit.renewed(lease.generation, received + ttl)
    for probe in probes:
        if t.reusable("k", probe):
            assert not permit.usable(probe), (
                f"at {probe}: grantor may reuse (lease ends {t.get('k')}) but the holder's "
                f"permit still runs to {permit.stop_at}"
            )


def test_many_renewals_keep_the_expiry_heap_small_and_expiry_exact() -> None:
    t = table()
    ga = t.grant("a", 0.0, 5.0).generation
    t.grant("b", 0.0, 5.0)
    for i in range(1, 2001):
        assert t.renew("a", ga, i * 0.001).ok
    assert len(t._expiry) <= 2 * len(t) + 64  # internal: stale entries were compacted
    assert t.expire(5.0) == ["b"]
    assert t.expire(6.999) == []
    assert t.expire(7.0) == ["a"]


def test_forgetting_the_last_lease_empties_the_expiry_heap() -> None:
    t = table(skew=0.0)
    for k in ("a", "b"):
        g = t.grant(k, 0.0, 5.0).generation
        assert t.renew(k, g, 1.0).ok
        assert t.ack(k, g).ok
    t.forget("a", 2.0)
    assert t.tables("p")["p_expiry"][0] > 0  # "b" still has a lease
    t.forget("b", 2.0)
    assert t.tables("p") == {"p": (0, None), "p_expiry": (0, None)}
    assert t.expire(100.0) == []


def test_retired_incarnations_keep_the_latest_and_forget_the_oldest() -> None:
    from kvpush_prod.core.incarnations import RetiredIncarnations

    retired = RetiredIncarnations(keep=3)
    for inc in range(1, 6):
        retired.add(inc)
    assert list(retired) == [3, 4, 5] and len(retired) == 3
    assert 5 in retired and 2 not in retired
    retired.add(3)  # seen again: the newest now
    assert list(retired) == [4, 5, 3]


def test_a_permit_received_exactly_stop_margin_late_stops_before_the_lease_ends() -> None:
    """The property test's find: 0.10849... + 0.99999 - 0.10849... rounds above 0.99999."""
    stop, ttl = 0.10849170761832719, 0.99999
    t = table(skew=0.0)
    lease = t.grant("k", 0.0, ttl)
    permit = Permit.from_ttl("k", lease.generation, ttl, 0.0 + stop, stop)
    assert t.reusable("k", 0.99999)
    assert not permit.usable(0.99999)
