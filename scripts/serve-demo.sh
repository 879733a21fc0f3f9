#!/usr/bin/env bash
# Set up, start the node server on the default model (Gemma 3 270M), answer one request with curl,
# then keep serving on http://127.0.0.1:${PORT:-8000} until Ctrl-C (DEMO_ONCE=1: stop after the request).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PORT=${PORT:-8000}
.venv/bin/edgeinfer serve --host 127.0.0.1 --port "$PORT" --preload &
SERVER=$!
# The server's own exit status after our SIGTERM (143) is not the demo's: stopping it is the normal end.
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
trap 'exit 0' INT TERM
for _ in $(seq 1 300); do
  curl -sf "http://127.0.0.1:$PORT/ready" >/dev/null && break
  kill -0 $SERVER 2>/dev/null || { echo "server exited" >&2; exit 1; }
  sleep 1
done
# Gemma 3 270M is a base (not instruction-tuned) model: it continues text best.
curl -sf "http://127.0.0.1:$PORT/v1/completions" -H 'content-type: application/json' -d '{
  "model": "gemma-3-270m", "prompt": "The three primary colors are", "max_tokens": 32, "temperature": 0
}'
echo
[ "${DEMO_ONCE:-0}" = 1 ] && exit 0
echo "serving on http://127.0.0.1:$PORT (Ctrl-C to stop)" >&2
wait $SERVER
