#!/usr/bin/env bash
# One xllm_async replica per device on consecutive ports, HAProxy in front (deploy/haproxy_cfg.py).
#
#   deploy/replicas.sh start [K]    K replicas (default 8): device i on port BASE_PORT+i, HAProxy on LISTEN
#   deploy/replicas.sh restart      rolling restart: one replica at a time, SIGTERM, wait, start, wait healthy
#   deploy/replicas.sh stop         SIGTERM everything (each replica drains first)
#   deploy/replicas.sh reload       SIGHUP every replica: each re-reads XLLM_ITEM_TABLE (a bad file keeps the old)
#
# Environment: DEVICE_KIND (cuda, npu or cpu; default cuda), BASE_PORT (8001), LISTEN (127.0.0.1:8000),
# RUN_DIR (/tmp/xllm-replicas: logs, pids, haproxy.cfg), PYTHON (.venv/bin/python), and any XLLM_*
# setting, which every replica gets (XLLM_MODEL above all).
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE_KIND=${DEVICE_KIND:-cuda}
BASE_PORT=${BASE_PORT:-8001}
LISTEN=${LISTEN:-127.0.0.1:8000}
RUN_DIR=${RUN_DIR:-/tmp/xllm-replicas}
PYTHON=${PYTHON:-.venv/bin/python}
HAPROXY=${HAPROXY:-$(command -v haproxy || echo /usr/sbin/haproxy)}

device() { if [ "$DEVICE_KIND" = cpu ]; then echo cpu; else echo "$DEVICE_KIND:$1"; fi; }

start_replica() {  # $1: index
    XLLM_DEVICES=$(device "$1") XLLM_PORT=$((BASE_PORT + $1)) \
        nohup "$PYTHON" server.py >"$RUN_DIR/replica-$1.log" 2>&1 &
    echo $! >"$RUN_DIR/replica-$1.pid"
}

wait_healthy() {  # $1: index; the model loads before /health answers
    local port=$((BASE_PORT + $1))
    for _ in $(seq 600); do
        "$PYTHON" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/health', timeout=2)" \
            2>/dev/null && return 0
        kill -0 "$(cat "$RUN_DIR/replica-$1.pid")" 2>/dev/null || { tail "$RUN_DIR/replica-$1.log"; return 1; }
        sleep 0.5
    done
    echo "replica $1 not healthy after 300 s" >&2
    return 1
}

stop_replica() {  # $1: index; SIGTERM drains (XLLM_DRAIN_TIMEOUT), then the process exits
    local pid
    pid=$(cat "$RUN_DIR/replica-$1.pid")
    kill -TERM "$pid" 2>/dev/null || return 0
    while kill -0 "$pid" 2>/dev/null; do sleep 0.2; done
}

replicas() { ls "$RUN_DIR"/replica-*.pid 2>/dev/null | sed 's/.*replica-\([0-9]*\)\.pid/\1/' | sort -n; }

case "${1:-}" in
    start)
        k=${2:-8}
        mkdir -p "$RUN_DIR"
        for i in $(seq 0 $((k - 1))); do start_replica "$i"; done
        for i in $(seq 0 $((k - 1))); do wait_healthy "$i"; done
        "$PYTHON" deploy/haproxy_cfg.py --replicas "$k" --base-port "$BASE_PORT" --listen "$LISTEN" \
            --stats-socket "$RUN_DIR/haproxy.sock" >"$RUN_DIR/haproxy.cfg"
        nohup "$HAPROXY" -db -f "$RUN_DIR/haproxy.cfg" >"$RUN_DIR/haproxy.log" 2>&1 &
        echo $! >"$RUN_DIR/haproxy.pid"
        echo "$k replicas on ports $BASE_PORT..$((BASE_PORT + k - 1)), HAProxy on $LISTEN; logs in $RUN_DIR"
        ;;
    restart)
        for i in $(replicas); do
            stop_replica "$i"
            start_replica "$i"
            wait_healthy "$i"
            sleep 3  # HAProxy's `rise 2` checks, 1 s apart, before it sends this replica requests again
            echo "replica $i restarted"
        done
        ;;
    reload)
        for i in $(replicas); do
            kill -HUP "$(cat "$RUN_DIR/replica-$i.pid")" && echo "replica $i: item table reload asked (see its log)"
        done
        ;;
    stop)
        for i in $(replicas); do stop_replica "$i" & done
        wait
        [ -f "$RUN_DIR/haproxy.pid" ] && kill -TERM "$(cat "$RUN_DIR/haproxy.pid")" 2>/dev/null || true
        ;;
    *)
        sed -n '2,13p' "$0"
        exit 2
        ;;
esac
