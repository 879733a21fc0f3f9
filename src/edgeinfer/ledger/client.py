"""Asking the fleet ledger for a tenant's usage over NATS request-reply (what a router's /v1/usage calls).

Request on LEDGER_QUERY_SUBJECT: `{"tenant": str, "start": float | null, "end": float | null}` (unix
seconds, start inclusive, end exclusive). Reply: `{"data": [{"model", "requests", "input_tokens",
"cached_input_tokens", "output_tokens", "cost_units"}, ...]}` by model name, the `data` of the node's
GET /v1/usage; or `{"error": str}` for a request it cannot read.
"""

from __future__ import annotations

import json
from typing import Any

import nats.errors
from nats.aio.client import Client

LEDGER_QUERY_SUBJECT = "edgeinfer.ledger.usage"


class LedgerError(RuntimeError):
    """The ledger refused the query (its reply names why)."""


class LedgerUnavailable(LedgerError):
    """No ledger answered: none is running or subscribed, or it did not reply in time."""


async def query_usage(
    nc: Client, tenant: str, start: float | None, end: float | None, timeout: float = 2.0
) -> list[dict[str, Any]]:
    """The tenant's usage per model, as every node's events summed by the ledger."""
    request = json.dumps({"tenant": tenant, "start": start, "end": end}).encode()
    try:
        reply = await nc.request(LEDGER_QUERY_SUBJECT, request, timeout=timeout)
    except nats.errors.NoRespondersError:
        raise LedgerUnavailable(
            f"no ledger is listening on {LEDGER_QUERY_SUBJECT} (is `edgeinfer ledger` running?)"
        ) from None
    except nats.errors.TimeoutError:
        raise LedgerUnavailable(
            f"no ledger answered on {LEDGER_QUERY_SUBJECT} within {timeout:g} s"
        ) from None
    answer = json.loads(reply.data)
    if "error" in answer:
        raise LedgerError(answer["error"])
    return answer["data"]
