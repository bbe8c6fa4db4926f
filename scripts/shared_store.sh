#!/usr/bin/env bash
# Starts or stops the shared chunk store (Mooncake Store: master + memory holder) that
# servers join with --pic-shared-store mooncake://HOST:PORT.
#   bash scripts/shared_store.sh start [--port 50551] [--memory-mb 1024] [--host 127.0.0.1]
#   bash scripts/shared_store.sh stop
# The store runs in the background; its pid and logs are under $SGL_PIC_STORE_DIR
# (default /tmp/sgl_pic_shared_store). Prints the URL once the store takes objects.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
dir="${SGL_PIC_STORE_DIR:-/tmp/sgl_pic_shared_store}"
mkdir -p "$dir"
case "${1:-}" in
start)
    shift
    if [ -f "$dir/service.pid" ] && kill -0 "$(cat "$dir/service.pid")" 2>/dev/null; then
        echo "already running (pid $(cat "$dir/service.pid"))" >&2
        exit 1
    fi
    python -m sgl_pic.store.shared.service --log-dir "$dir" "$@" >"$dir/url" 2>"$dir/service.log" &
    echo $! >"$dir/service.pid"
    for _ in $(seq 300); do
        if [ -s "$dir/url" ]; then cat "$dir/url"; exit 0; fi
        if ! kill -0 "$(cat "$dir/service.pid")" 2>/dev/null; then
            cat "$dir/service.log" >&2
            exit 1
        fi
        sleep 0.1
    done
    echo "the shared store did not start within 30 s; see $dir" >&2
    exit 1
    ;;
stop)
    if [ -f "$dir/service.pid" ]; then
        kill "$(cat "$dir/service.pid")" 2>/dev/null || true
        rm -f "$dir/service.pid" "$dir/url"
    fi
    ;;
*)
    echo "usage: $0 start [--port N] [--memory-mb N] [--host H] | stop" >&2
    exit 2
    ;;
esac
