"""Per-tenant limits: requests per minute, tokens per minute, concurrent requests.

Semantics (exact, documented in docs/server.md):
- requests/min and tokens/min are *sliding* 60 s windows kept as a log of admissions: a request is
  admitted when the amounts admitted in the last 60 s plus its own stay within the limit. Rejected
  requests are never counted.
- tokens are reserved at admission — prompt tokens plus `n × max_tokens` — and the reservation is
  replaced by the tokens actually used when the request ends (keeping the admission timestamp), so a
  burst of requests can never overshoot the limit while they are still generating.
- concurrency counts requests from admission until their response is finished or abandoned.
Retry-After says when the oldest entries leave the window far enough for the request to fit.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from edgeinfer.api.tenants import Tenant

WINDOW_S = 60.0


class RateLimitExceeded(Exception):
    """The tenant is over a limit; `retry_after` seconds from now the request would fit (None: never)."""

    def __init__(self, message: str, retry_after: float | None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class _Entry:
    __slots__ = ("amount", "at", "live")

    def __init__(self, at: float, amount: int) -> None:
        self.at = at
        self.amount = amount
        self.live = True  # False once it left the window (or was removed)


class SlidingWindowLog:
    """Amounts admitted in the last `window_s` seconds, with their admission times."""

    def __init__(self, limit: int, window_s: float = WINDOW_S) -> None:
        self.limit = limit
        self.window_s = window_s
        self._entries: deque[_Entry] = deque()
        self._total = 0

    def total(self, now: float) -> int:
        while self._entries and self._entries[0].at <= now - self.window_s:
            expired = self._entries.popleft()
            expired.live = False
            self._total -= expired.amount
        return self._total

    def fits(self, now: float, amount: int) -> bool:
        return self.total(now) + amount <= self.limit

    def retry_after(self, now: float, amount: int) -> float | None:
        """Seconds until `amount` fits, assuming nothing else is admitted; None if it never fits."""
        if amount > self.limit:
            return None
        excess = self.total(now) + amount - self.limit
        if excess <= 0:
            return 0.0
        for entry in self._entries:
            excess -= entry.amount
            if excess <= 0:
                return max(0.0, entry.at + self.window_s - now)
        return None

    def add(self, now: float, amount: int) -> _Entry:
        entry = _Entry(now, amount)
        self._entries.append(entry)
        self._total += amount
        return entry

    def adjust(self, entry: _Entry, amount: int) -> None:
        """Change an entry's amount (a token reservation settled to the real count)."""
        if entry.live:
            self._total += amount - entry.amount
        entry.amount = amount

    def remove(self, entry: _Entry) -> None:
        if entry.live:
            entry.live = False
            self._entries.remove(entry)
            self._total -= entry.amount


@dataclass
class _TenantState:
    requests: SlidingWindowLog | None
    tokens: SlidingWindowLog | None
    concurrent: int = 0


class Admission:
    """One admitted request: holds a concurrency slot, a request entry and (later) a token reservation."""

    def __init__(
        self, limiter: RateLimiter, tenant: Tenant, state: _TenantState, request_entry: _Entry | None
    ):
        self._limiter = limiter
        self._tenant = tenant
        self._state = state
        self._request_entry = request_entry
        self._token_entry: _Entry | None = None
        self._released = False

    def reserve_tokens(self, tokens: int) -> None:
        """Reserve `tokens` in the tokens/min window; on refusal the whole admission is undone."""
        window = self._state.tokens
        if window is None:
            return
        now = self._limiter.clock()
        if not window.fits(now, tokens):
            retry = window.retry_after(now, tokens)
            self.cancel()
            if retry is None:
                raise RateLimitExceeded(
                    f"this request may use up to {tokens} tokens (prompt + n × max_tokens), more than the "
                    f"key's limit of {window.limit} tokens per minute; lower max_tokens",
                    None,
                )
            raise RateLimitExceeded(
                f"tokens per minute limit of {window.limit} reached for tenant {self._tenant.name}", retry
            )
        self._token_entry = window.add(now, tokens)

    def settle_tokens(self, tokens: int) -> None:
        """Replace the reservation by the tokens actually used."""
        if self._state.tokens is not None and self._token_entry is not None:
            self._state.tokens.adjust(self._token_entry, tokens)

    def release(self) -> None:
        """Free the concurrency slot (idempotent)."""
        if not self._released:
            self._released = True
            self._state.concurrent -= 1

    def cancel(self) -> None:
        """Undo the admission entirely: the request was refused after all."""
        if self._state.requests is not None and self._request_entry is not None:
            self._state.requests.remove(self._request_entry)
        if self._state.tokens is not None and self._token_entry is not None:
            self._state.tokens.remove(self._token_entry)
        self.release()


class RateLimiter:
    """Admission control for all tenants. Not thread-safe: used from the event loop only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic, window_s: float = WINDOW_S) -> None:
        self.clock = clock
        self._window_s = window_s
        self._states: dict[str, _TenantState] = {}

    def admit(self, tenant: Tenant) -> Admission:
        """Check concurrency and requests/min; RateLimitExceeded if either is exhausted."""
        state = self._state(tenant)
        now = self.clock()
        limits = tenant.limits
        if limits.max_concurrent is not None and state.concurrent >= limits.max_concurrent:
            raise RateLimitExceeded(
                f"concurrent request limit of {limits.max_concurrent} reached for tenant {tenant.name}", 1.0
            )
        if state.requests is not None and not state.requests.fits(now, 1):
            raise RateLimitExceeded(
                f"requests per minute limit of {state.requests.limit} reached for tenant {tenant.name}",
                state.requests.retry_after(now, 1),
            )
        entry = state.requests.add(now, 1) if state.requests is not None else None
        state.concurrent += 1
        return Admission(self, tenant, state, entry)

    def _state(self, tenant: Tenant) -> _TenantState:
        state = self._states.get(tenant.name)
        if state is None:
            limits = tenant.limits
            state = _TenantState(
                requests=_window(limits.requests_per_minute, self._window_s),
                tokens=_window(limits.tokens_per_minute, self._window_s),
            )
            self._states[tenant.name] = state
        return state


def _window(limit: int | None, window_s: float) -> SlidingWindowLog | None:
    return None if limit is None else SlidingWindowLog(limit, window_s)
