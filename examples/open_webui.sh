#!/usr/bin/env bash
# Open WebUI on the bundled demo, tried the way a new user sets it up and driven from headless Chromium:
#
#   examples/open_webui.sh [ollama|openai|both]        # default: both
#
# Installs open-webui into a virtual environment of its own (once: about 7 GB with its CUDA build of
# torch, 3 to 8 minutes), starts `python -m mlx_dgemma.server` on the demo, then for each connection a
# fresh Open WebUI (offline, no login, its defaults otherwise) pointed at the server, and chats in it
# through playwright (examples/open_webui/browser.py): the first message, a second one with the
# history, the title and follow-ups, Stop, the chat controls' settings, and the server's log checked
# for 4xx. Prints PASS/FAIL per step and exits non-zero if any failed.
#
# Settings (environment):
#   OPEN_WEBUI_VENV  where Open WebUI is installed [~/.cache/mlx-dgemma/open-webui-$OPEN_WEBUI_VERSION]
#   SHOTS            folder for the screenshots [./open-webui-shots]
#   CHROMIUM         the browser [chromium on the PATH; Debian: apt-get install chromium]
#   PYTHON           the Python that has mlx-dgemma [python]
#   SERVER_PORT, WEBUI_PORT   [8181, 3131]
#   REPEAT=N         N more two-message chats, each message timed from Enter to the server [0]
#   KEEP=1           leave the server and Open WebUI running for a look by hand (the ollama connection's)
set -euo pipefail

OPEN_WEBUI_VERSION=0.12.4
CONNECTIONS=${1:-both}
[[ $CONNECTIONS == both ]] && CONNECTIONS="ollama openai"
for c in $CONNECTIONS; do
  [[ $c == ollama || $c == openai ]] || { echo "usage: $0 [ollama|openai|both]" >&2; exit 2; }
done
HERE=$(cd "$(dirname "$0")" && pwd)
VENV=${OPEN_WEBUI_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/mlx-dgemma/open-webui-$OPEN_WEBUI_VERSION}
SHOTS=$(mkdir -p "${SHOTS:-open-webui-shots}" && cd "${SHOTS:-open-webui-shots}" && pwd)
PYTHON=${PYTHON:-python}
SERVER_PORT=${SERVER_PORT:-8181}
WEBUI_PORT=${WEBUI_PORT:-3131}
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}
[[ -x $CHROMIUM ]] || { echo "no Chromium found: install one (Debian: apt-get install chromium) or set CHROMIUM" >&2; exit 1; }
WORK=$(mktemp -d -t mlx-dgemma-open-webui.XXXXXX)
PIDS=()

stop_all() {
  for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  PIDS=()
}
trap 'stop_all; rm -rf "$WORK"' EXIT

wait_for() {  # URL SECONDS PID: until the URL answers, or the process it waits on has died
  for _ in $(seq "$2"); do
    curl -sf -o /dev/null "$1" && return 0
    kill -0 "$3" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}

# 1. Open WebUI in a venv of its own (never the system's site-packages), with playwright to drive Chromium.
if [[ ! -x $VENV/bin/open-webui ]] || ! "$VENV/bin/python" -c "import playwright" 2>/dev/null \
   || [[ $("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('open-webui'))") != "$OPEN_WEBUI_VERSION" ]]; then
  echo "installing open-webui $OPEN_WEBUI_VERSION into $VENV (once; about 7 GB)"
  python3.11 -m venv "$VENV" 2>/dev/null || python3 -m venv "$VENV"
  start=$SECONDS
  "$VENV/bin/pip" install -q "open-webui==$OPEN_WEBUI_VERSION" playwright 2>&1 | grep -v "^WARNING: Location" || true
  "$VENV/bin/python" -c "import open_webui, playwright" || { echo "the install failed" >&2; exit 1; }
  echo "installed in $((SECONDS - start)) s"
fi

# 2. The server on the demo, its log at debug level (each request's body in outline, each refusal).
SERVER_LOG=$WORK/server.log
"$PYTHON" -m mlx_dgemma.server --port "$SERVER_PORT" --log-level debug >"$SERVER_LOG" 2>&1 &
PIDS+=($!)
wait_for "http://127.0.0.1:$SERVER_PORT/health" 120 "${PIDS[0]}" || { cat "$SERVER_LOG" >&2; exit 1; }

# 3. Per connection: a fresh Open WebUI (a new data folder) with only that connection, and the chat.
failed=0
for connection in $CONNECTIONS; do
  DATA=$WORK/data-$connection
  mkdir -p "$DATA"
  if [[ $connection == ollama ]]; then
    links=(ENABLE_OLLAMA_API=true OLLAMA_BASE_URL="http://127.0.0.1:$SERVER_PORT" ENABLE_OPENAI_API=false)
  else
    links=(ENABLE_OLLAMA_API=false ENABLE_OPENAI_API=true OPENAI_API_BASE_URL="http://127.0.0.1:$SERVER_PORT/v1"
           OPENAI_API_KEY=none)
  fi
  env DATA_DIR="$DATA" OFFLINE_MODE=true HF_HUB_OFFLINE=1 WEBUI_AUTH=False WEBUI_SECRET_KEY=mlx-dgemma-example \
      ENABLE_VERSION_UPDATE_CHECK=false ANONYMIZED_TELEMETRY=false DO_NOT_TRACK=true SCARF_NO_ANALYTICS=true \
      "${links[@]}" "$VENV/bin/open-webui" serve --host 127.0.0.1 --port "$WEBUI_PORT" >"$WORK/webui-$connection.log" 2>&1 &
  webui=$!
  PIDS+=($webui)
  if ! wait_for "http://127.0.0.1:$WEBUI_PORT/health" 300 "$webui"; then
    tail -30 "$WORK/webui-$connection.log" >&2
    exit 1
  fi
  "$VENV/bin/python" "$HERE/open_webui/browser.py" --connection "$connection" --webui "http://127.0.0.1:$WEBUI_PORT" \
      --server "http://127.0.0.1:$SERVER_PORT" --server-log "$SERVER_LOG" --shots "$SHOTS" --chromium "$CHROMIUM" \
      --repeat "${REPEAT:-0}" || failed=1
  if [[ ${KEEP:-} == 1 ]]; then
    echo "Open WebUI: http://127.0.0.1:$WEBUI_PORT, the server: http://127.0.0.1:$SERVER_PORT; Ctrl-C stops both"
    wait "$webui"
  fi
  kill "$webui"; wait "$webui" 2>/dev/null || true
  PIDS=("${PIDS[0]}")
done
cp "$SERVER_LOG" "$WORK"/webui-*.log "$SHOTS/"
echo "screenshots, the server's log and Open WebUI's: $SHOTS"
exit $failed
