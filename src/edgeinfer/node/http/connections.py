"""What uvicorn does not bound on its own: the time a client may take to send its request headers, and
the number of connections one client address may hold.

uvicorn's keep-alive timeout only starts after a first response, so a client that connects and sends
nothing, or half its headers, would hold the connection forever. The body's own deadline is
`NodeMiddleware`'s (it can answer 408 there); idle keep-alive, graceful shutdown and the trusted-proxy
rules are plain uvicorn settings (`node/http/server.py`).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from edgeinfer.api.http.parser_errors import JSONErrorsH11Protocol, raw_error
from edgeinfer.node.config import ConnectionLimits

# A scope extension: drops the connection with whatever it has not sent yet. A stream whose reader stalled
# ends with it, because uvicorn's close() waits to flush that data first, which a stalled reader never allows.
ABORT_CONNECTION = "edgeinfer.abort_connection"


def guarded_protocol(limits: ConnectionLimits, exempt: frozenset[str]) -> type[JSONErrorsH11Protocol]:
    """uvicorn's h11 protocol with a header deadline and a per-address connection bound (addresses in
    `exempt`, the trusted proxies, are not bounded: every routed client arrives through them), and
    parser errors in OpenAI's shape (parser_errors.py)."""
    per_client: Counter[str] = Counter()

    class GuardedH11Protocol(JSONErrorsH11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _counted_as: str | None = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            host = self.client[0] if self.client else ""
            if host not in exempt:
                if per_client[host] >= limits.max_connections_per_client:
                    self._refuse(transport)
                    return
                per_client[host] += 1
                self._counted_as = host
            self._arm_header_timer()

        def _refuse(self, transport: asyncio.Transport) -> None:
            """Answer 429 and half-close; the request the client sends meanwhile is read and dropped (closing
            at once would reset the connection and lose the answer), and the connection closes soon after."""
            self._refused = True
            transport.write(_too_many_connections(limits.max_connections_per_client))
            if transport.can_write_eof():
                transport.write_eof()
            self.loop.call_later(min(1.0, limits.header_timeout_s), transport.close)

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_header_timer()
            if self._counted_as is not None:
                per_client[self._counted_as] -= 1
                if not per_client[self._counted_as]:
                    del per_client[self._counted_as]
                self._counted_as = None
            super().connection_lost(exc)

        def handle_events(self) -> None:
            cycle = self.cycle
            super().handle_events()
            if self.cycle is not cycle:  # a request's headers are complete: its body has its own deadline
                self._disarm_header_timer()
                self.cycle.scope.setdefault("extensions", {})[ABORT_CONNECTION] = self.transport.abort

        def on_response_complete(self) -> None:
            # Armed before uvicorn looks for a pipelined request, whose headers then disarm it.
            self._arm_header_timer()
            super().on_response_complete()

        def _arm_header_timer(self) -> None:
            self._disarm_header_timer()
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _disarm_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol


def _too_many_connections(limit: int) -> bytes:
    message = f"more than {limit} connections from this address"
    headers = (("retry-after", "1"),)
    return raw_error(429, message, type="rate_limit_error", code="too_many_connections", headers=headers)[1]
