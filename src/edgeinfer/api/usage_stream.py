"""The JetStream stream that carries usage events from nodes to the fleet ledger (`types/usage_event.py`).

Nodes and the ledger both create it when it is missing, with the same configuration, so neither has to start
first. Kept on disk: a usage event is money, and it must outlive a restart of the NATS server.
"""

from __future__ import annotations

import logging

from nats.js import JetStreamContext
from nats.js.api import StorageType, StreamConfig
from nats.js.errors import BadRequestError, ServiceUnavailableError

from edgeinfer.types.usage_event import USAGE_STREAM, USAGE_SUBJECT_PREFIX

logger = logging.getLogger("edgeinfer.usage")

# A publish repeated within this window (same Nats-Msg-Id) is stored once. Nodes retry within seconds; the
# ledger's primary key catches whatever repeats later.
DUPLICATE_WINDOW_S = 300.0
# The stream is a transport, the ledger is the record: events are kept this long whether acknowledged or
# not, so a ledger may be down (or a second consumer may catch up) for days without losing any.
MAX_AGE_S = 7 * 24 * 3600.0
# NATS's JetStream API error code for "a stream of this name exists with another configuration".
STREAM_NAME_IN_USE = 10058


def usage_stream_config() -> StreamConfig:
    return StreamConfig(
        name=USAGE_STREAM,
        subjects=[f"{USAGE_SUBJECT_PREFIX}.>"],
        storage=StorageType.FILE,
        duplicate_window=DUPLICATE_WINDOW_S,
        max_age=MAX_AGE_S,
    )


async def ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """Create the stream unless it exists. Creating one that exists with the same configuration is a no-op
    on the server; one an operator has reconfigured (longer retention, replicas) is left as it is."""
    try:
        await js.add_stream(config)
    except ServiceUnavailableError:
        raise ConnectionError("the NATS server has no JetStream: start it with -js (and -sd DIR)") from None
    except BadRequestError as exc:
        if exc.err_code != STREAM_NAME_IN_USE:
            raise
        logger.info("stream %s exists with another configuration; using it as it is", config.name)
