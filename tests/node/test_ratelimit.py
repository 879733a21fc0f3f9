"""Sliding-window limits with a fake clock: exact counts, Retry-After, reservations, concurrency."""

from __future__ import annotations

import pytest

from edgeinfer.api.tenants import Tenant, TenantLimits
from edgeinfer.node.billing.ratelimit import RateLimiter, RateLimitExceeded, SlidingWindowLog


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _tenant(**limits: int) -> Tenant:
    return Tenant(name="t", cache_namespace="ns", limits=TenantLimits(**limits))


def test_window_admits_exactly_the_limit_in_any_60_seconds() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    tenant = _tenant(requests_per_minute=3)
    for _ in range(3):
        limiter.admit(tenant).release()
        clock.now += 10
    with pytest.raises(RateLimitExceeded) as exc:
        limiter.admit(tenant)
    # the first admission (t=1000) leaves the window at t=1060; now is t=1030
    assert exc.value.retry_after == pytest.approx(30.0)
    clock.now = 1060.0
    limiter.admit(tenant)  # exactly one slot came free
    with pytest.raises(RateLimitExceeded):
        limiter.admit(tenant)


def test_rejections_do_not_count() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    tenant = _tenant(requests_per_minute=1)
    limiter.admit(tenant).release()
    for _ in range(5):
        with pytest.raises(RateLimitExceeded):
            limiter.admit(tenant)
    clock.now += 60
    limiter.admit(tenant)


def test_concurrency_slot_is_held_until_release() -> None:
    limiter = RateLimiter(Clock())
    tenant = _tenant(max_concurrent=2)
    a, b = limiter.admit(tenant), limiter.admit(tenant)
    with pytest.raises(RateLimitExceeded, match="concurrent"):
        limiter.admit(tenant)
    a.release()
    a.release()  # idempotent: must not free a second slot
    limiter.admit(tenant)
    with pytest.raises(RateLimitExceeded):
        limiter.admit(tenant)
    b.release()


def test_token_reservation_is_settled_to_actual_use() -> None:
    clock = Clock()
    limiter = RateLimiter(clock)
    tenant = _tenant(tokens_per_minute=100)
    first = limiter.admit(tenant)
    first.reserve_tokens(80)  # prompt + max_tokens
    second = limiter.admit(tenant)
    with pytest.raises(RateLimitExceeded, match="tokens per minute"):
        second.reserve_tokens(30)
    first.settle_tokens(20)  # the request stopped early
    third = limiter.admit(tenant)
    third.reserve_tokens(80)  # 20 + 80 fits exactly
    with pytest.raises(RateLimitExceeded) as never:
        limiter.admit(tenant).reserve_tokens(101)
    assert never.value.retry_after is None


def test_refused_token_reservation_undoes_the_request() -> None:
    limiter = RateLimiter(Clock())
    tenant = _tenant(requests_per_minute=2, tokens_per_minute=10, max_concurrent=1)
    admission = limiter.admit(tenant)
    with pytest.raises(RateLimitExceeded):
        admission.reserve_tokens(11)
    # neither the request count nor the concurrency slot was kept
    limiter.admit(tenant).release()
    limiter.admit(tenant).release()


def test_retry_after_accounts_for_several_entries() -> None:
    window = SlidingWindowLog(limit=10, window_s=60)
    window.add(0.0, 4)
    window.add(5.0, 4)
    window.add(20.0, 2)
    assert window.retry_after(30.0, 1) == pytest.approx(30.0)  # after the first entry leaves
    assert window.retry_after(30.0, 6) == pytest.approx(35.0)  # needs the second one gone too
    assert window.retry_after(30.0, 11) is None
    assert window.total(61.0) == 6  # the entry at t=0 left, the one at t=5 stays until t=65
    assert window.total(65.0) == 2
