"""One JSON line per HTTP request on the `edgeinfer.access` logger."""

from __future__ import annotations

import json
import logging
import time
from typing import Any

ACCESS_LOGGER = "edgeinfer.access"

_logger = logging.getLogger(ACCESS_LOGGER)


def log_access(fields: dict[str, Any]) -> None:
    """Emit `fields` (plus a wall-clock `ts`) as one JSON object; keys with None values are dropped."""
    if not _logger.isEnabledFor(logging.INFO):
        return
    record = {"ts": round(time.time(), 3)}
    record.update({key: value for key, value in fields.items() if value is not None})
    _logger.info(json.dumps(record, separators=(",", ":"), default=str))
