"""The ledger's work: take usage events from JetStream in batches, store each once, ack; answer queries.

A durable pull consumer (`edgeinfer-ledger`) on EDGEINFER_USAGE: the server remembers what it acknowledged,
so a ledger that stops, crashes or loses NATS goes on where it was. A batch is acknowledged only after its
transaction committed; a batch delivered again (the ledger died between the two) inserts nothing new, since
`event_id` is the store's primary key. Several ledgers may share the consumer (and a PostgreSQL store): the
server splits the batches among them.

An event that does not parse is logged, re-published on `edgeinfer.usage_dead.<node>` (kept by the stream
EDGEINFER_USAGE_DEAD until an operator removes it) and terminated, so it is never delivered again and the
events behind it go on.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, StorageType, StreamConfig

from edgeinfer.api.usage_stream import DUPLICATE_WINDOW_S, ensure_stream, usage_stream_config
from edgeinfer.ledger.client import LEDGER_QUERY_SUBJECT
from edgeinfer.ledger.store import LedgerStore
from edgeinfer.types.usage_event import USAGE_STREAM, USAGE_SUBJECT_PREFIX, UsageEvent

logger = logging.getLogger("edgeinfer.ledger")

DURABLE = "edgeinfer-ledger"
DEAD_STREAM = "EDGEINFER_USAGE_DEAD"
DEAD_SUBJECT_PREFIX = "edgeinfer.usage_dead"
# How long one fetch waits for a first event; an idle ledger asks again after it.
FETCH_WAIT_S = 1.0
# A delivered event not acknowledged within this is delivered again (a ledger that died mid-batch).
ACK_WAIT_S = 30.0
RETRY_MIN_S = 0.5
RETRY_MAX_S = 30.0


def dead_stream_config() -> StreamConfig:
    return StreamConfig(
        name=DEAD_STREAM,
        subjects=[f"{DEAD_SUBJECT_PREFIX}.>"],
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
    )


class Ledger:
    def __init__(self, store: LedgerStore, batch_size: int) -> None:
        self._store = store
        self._batch_size = batch_size

    async def run(self, nc: Client) -> None:
        """Consume and answer until cancelled."""
        js = nc.jetstream()
        await ensure_stream(js, usage_stream_config())
        await ensure_stream(js, dead_stream_config())
        config = ConsumerConfig(ack_wait=ACK_WAIT_S, max_ack_pending=16 * self._batch_size)
        sub = await js.pull_subscribe(
            f"{USAGE_SUBJECT_PREFIX}.>", durable=DURABLE, stream=USAGE_STREAM, config=config
        )
        await nc.subscribe(LEDGER_QUERY_SUBJECT, queue=DURABLE, cb=self._answer)
        logger.info("ledger ready: consuming %s, answering on %s", USAGE_STREAM, LEDGER_QUERY_SUBJECT)
        retry_s = RETRY_MIN_S
        while True:
            try:
                msgs = await sub.fetch(self._batch_size, timeout=FETCH_WAIT_S)
            except TimeoutError:
                continue  # nothing new
            except Exception as exc:  # NATS restarting: fetch again once it is back
                retry_s = await _pause(f"fetching usage events failed ({_describe(exc)})", retry_s)
                continue
            try:
                await self._take(js, msgs)
                retry_s = RETRY_MIN_S
            except Exception as exc:  # the store is down: the events were given back, and come again
                retry_s = await _pause(f"storing usage events failed ({_describe(exc)})", retry_s)

    async def _take(self, js: JetStreamContext, msgs: list[Msg]) -> None:
        parsed = [(msg, _parse(msg.data)) for msg in msgs]
        good = [(msg, event) for msg, event in parsed if isinstance(event, UsageEvent)]
        if good:
            try:
                new = await asyncio.to_thread(self._store.insert, [event for _, event in good])
            except BaseException:
                await asyncio.gather(*(msg.nak() for msg, _ in good), return_exceptions=True)
                raise
            await asyncio.gather(*(msg.ack() for msg, _ in good))
            logger.debug("stored %d usage events (%d already there)", new, len(good) - new)
        for msg, result in parsed:
            if isinstance(result, ValueError):
                await _dead_letter(js, msg, result)

    async def _answer(self, msg: Msg) -> None:
        """One usage query (client.py has its shape)."""
        try:
            tenant, start, end = _parse_query(msg.data)
            reply: dict[str, Any] = {"data": await asyncio.to_thread(self._store.summary, tenant, start, end)}
        except ValueError as exc:
            reply = {"error": str(exc)}
        except Exception as exc:  # the store is down: say so rather than leave the asker to time out
            logger.exception("usage query failed")
            reply = {"error": f"the ledger's store failed: {_describe(exc)}"}
        await msg.respond(json.dumps(reply).encode())


def _parse(data: bytes) -> UsageEvent | ValueError:
    try:
        return UsageEvent.from_json(data)
    except ValueError as exc:
        return exc


async def _dead_letter(js: JetStreamContext, msg: Msg, error: ValueError) -> None:
    """Keep a corrupt event aside on the dead-letter stream, then never deliver it again."""
    seq = msg.metadata.sequence.stream
    subject = f"{DEAD_SUBJECT_PREFIX}.{msg.subject.removeprefix(USAGE_SUBJECT_PREFIX + '.')}"
    logger.warning(
        "corrupt usage event (stream sequence %d on %s): %s; moved to %s", seq, msg.subject, error, subject
    )
    reason = " ".join(str(error).split())  # a header value is one line
    # The stream sequence as message id: re-publishing after a crash between publish and term stores it once.
    headers = {"Nats-Msg-Id": f"dead-{seq}", "Edgeinfer-Error": reason}
    await js.publish(subject, msg.data, headers=headers)
    await msg.term()


def _parse_query(data: bytes) -> tuple[str, float | None, float | None]:
    try:
        query = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("a usage query is a JSON object: {tenant, start, end}") from None
    if not isinstance(query, dict) or not isinstance(query.get("tenant"), str) or not query["tenant"]:
        raise ValueError("a usage query needs a tenant (a non-empty string)")
    return query["tenant"], _bound(query, "start"), _bound(query, "end")


def _bound(query: dict[str, Any], name: str) -> float | None:
    value = query.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name} must be unix seconds (a finite number) or null")
    return float(value)


async def _pause(what: str, retry_s: float) -> float:
    """Log, wait `retry_s`, and return the next wait (doubled, bounded)."""
    logger.warning("%s; retrying in %.1f s", what, retry_s)
    await asyncio.sleep(retry_s)
    return min(RETRY_MAX_S, 2 * retry_s)


def _describe(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__
