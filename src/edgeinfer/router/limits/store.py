"""The fleet's limit budgets in NATS JetStream key-value buckets, changed by compare-and-set only.

Two kinds of entry: a window counter (units handed out in one fixed window of one limit; the bucket's
age limit removes past windows) and a slot table (concurrency slots each router holds, with an expiry
that the holder keeps pushing forward, so a router that dies gives its slots back when they expire).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, TypeVar

from nats.js.errors import APIError, BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError

WINDOWS_BUCKET = "edgeinfer_limit_windows"
SLOTS_BUCKET = "edgeinfer_limit_slots"
ROUTERS_BUCKET = "edgeinfer_routers"
# Concurrent changes to one entry retry this often before the caller sees the conflict as an outage.
MAX_TRIES = 32
T = TypeVar("T")
Edit = Callable[[bytes | None], tuple[bytes | None, T]]


class StoreUnavailable(Exception):
    """The bucket could not be read or changed (NATS down, or too much contention)."""


async def open_bucket(js: Any, bucket: str, ttl_s: float | None) -> Any:
    """The bucket, made where it does not exist yet (several routers may race to make it)."""
    try:
        return await js.key_value(bucket)
    except BucketNotFoundError:
        pass
    try:
        return await js.create_key_value(bucket=bucket, history=1, ttl=ttl_s)
    except APIError:  # another router made it first, with the same settings
        return await js.key_value(bucket)


async def change(kv: Any, key: str, edit: Edit[T]) -> T:
    """Read `key`, `edit` its value (None: absent) into (new value or None to leave it, result), write it
    back only if nobody wrote in between, else again. StoreUnavailable when NATS fails."""
    try:
        for _ in range(MAX_TRIES):
            try:
                entry = await kv.get(key)
                old, revision = entry.value, entry.revision
            except KeyNotFoundError:  # never written, deleted, or aged out
                old, revision = None, None
            new, result = edit(old)
            if new is None:
                return result
            try:
                if revision is None:
                    await kv.create(key, new)
                else:
                    await kv.update(key, new, last=revision)
                return result
            except KeyWrongLastSequenceError:
                continue
            except APIError as exc:  # `create` over an entry written meanwhile
                if revision is None and exc.err_code == 10071:
                    continue
                raise
    except StoreUnavailable:
        raise
    except Exception as exc:  # nats-py raises timeouts, connection and API errors of several kinds
        raise StoreUnavailable(f"{type(exc).__name__}: {exc}") from exc
    raise StoreUnavailable(f"{key}: {MAX_TRIES} conflicting writers in a row")


def take_units(want: int, limit: int, force: bool = False) -> Edit[int]:
    """An edit of a window counter granting up to `want` units of what is left of `limit` (`force`: all
    of `want`, over the limit if need be: tokens a request used beyond its reservation)."""

    def edit(old: bytes | None) -> tuple[bytes | None, int]:
        used = int(old) if old else 0
        granted = want if force else max(0, min(want, limit - used))
        return (str(used + granted).encode() if granted else None), granted

    return edit


def give_units(units: int) -> Edit[None]:
    """An edit of a window counter taking `units` back (never below zero)."""

    def edit(old: bytes | None) -> tuple[bytes | None, None]:
        used = int(old) if old else 0
        return (str(max(0, used - units)).encode() if used else None), None

    return edit


def slots_edit(router: str, delta: int, limit: int, now: float, ttl_s: float) -> Edit[int]:
    """An edit of a slot table: this router's slots change by `delta` (> 0: up to what is free; < 0:
    given back; 0: its expiry pushed forward); expired holders are dropped. Returns the change made."""

    def edit(old: bytes | None) -> tuple[bytes | None, int]:
        table: dict[str, list[float]] = json.loads(old) if old else {}
        live = {r: held for r, held in table.items() if held[1] > now}
        mine = int(live.get(router, [0, 0])[0])
        if delta > 0:
            free = limit - sum(int(held[0]) for held in live.values())
            made = max(0, min(delta, free))
        else:
            made = max(delta, -mine)
        if mine + made > 0:
            live[router] = [mine + made, now + ttl_s]
        else:
            live.pop(router, None)
        if made == 0 and delta != 0 and live.keys() == table.keys():
            return None, 0
        return json.dumps(live, separators=(",", ":")).encode(), made

    return edit
