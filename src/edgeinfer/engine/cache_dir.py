"""Where edgeinfer keeps what it makes and fetches: one root, `$EDGEINFER_CACHE_DIR`, else
`~/.cache/edgeinfer`."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "EDGEINFER_CACHE_DIR"


def cache_root() -> Path:
    """Prepared models, compiled graphs, kernel builds, and (under `models/`) the default models."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgeinfer"


def models_cache_dir() -> Path:
    """The default models, assembled from their packages: `<cache root>/models`."""
    return cache_root() / "models"
