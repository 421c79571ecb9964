#!/usr/bin/env bash
# The real OpenTelemetry Collector (DESIGN.md section 6), for the integration tests and the
# testbed: built with the OpenTelemetry Collector Builder from the Go module proxy, cached.
#
#   scripts/otelcol.sh build     build the Collector (cached; minutes the first time); print its path
#   scripts/otelcol.sh path      the binary's path (builds it if needed)
#   scripts/otelcol.sh start [CONFIG]
#                                start one Collector with CONFIG (default scripts/otelcol/config.yaml)
#                                in the background, wait until its OTLP/HTTP port answers
#   scripts/otelcol.sh stop      stop the Collector this run directory started
#   scripts/otelcol.sh status    exit 0 when that Collector runs and its OTLP/HTTP port answers
#   scripts/otelcol.sh env       print the settings as shell exports (for scripts/test.sh)
#
# What is built: scripts/otelcol/builder.yaml (otlp receiver, batch processor, kafka, file,
# otlphttp and debug exporters, all at v0.155.0: the proxy refuses newer contrib Kafka exporters).
# The builder's own `go mod tidy` fails here (a test-only import of the file exporter is not on
# the proxy), so the builder only generates the sources and this script runs `go mod tidy -e`
# and `go build` itself (the builder's failed tidy is expected; missing sources are not). GOSUMDB is off: only the module proxy is reachable, not the checksum
# database; the proxy itself serves the modules' go.sum-checked contents.
#
# Environment (read by the default config too): BMEG_KAFKA_BOOTSTRAP (127.0.0.1:19092),
# BMEG_OTELCOL_GRPC_PORT (4317), BMEG_OTELCOL_HTTP_PORT (4318), BMEG_OTELCOL_TOPIC (otlp_spans),
# BMEG_OTELCOL_ENCODING (otlp_proto), BMEG_OTELCOL_PARTITION_TRACES_BY_ID (false),
# BMEG_OTELCOL_COMPRESSION (none), BMEG_OTELCOL_FILE (<run dir>/spans.jsonl),
# BMEG_OTELCOL_RUN_DIR (${TMPDIR:-/tmp}/bmeg-otelcol-$USER): one Collector per run directory.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
manifest=$here/otelcol/builder.yaml
cache=${XDG_CACHE_HOME:-$HOME/.cache}/bmeg
builder_version=v0.155.0
binary=$cache/bin/otelcol-bmeg-$(sha256sum "$manifest" | cut -c1-12)
run_dir=${BMEG_OTELCOL_RUN_DIR:-${TMPDIR:-/tmp}/bmeg-otelcol-${USER:-$(id -un)}}
http_port=${BMEG_OTELCOL_HTTP_PORT:-4318}

log() { echo "otelcol.sh: $*" >&2; }

go_env() {
    export GOPATH=$cache/go GOMODCACHE=$cache/go/mod GOCACHE=$cache/go/build \
        GOSUMDB=off GOFLAGS="-modcacherw -buildvcs=false"
}

build() {
    if [ -x "$binary" ]; then return; fi
    log "building the OpenTelemetry Collector from the Go module proxy (minutes the first time)"
    local work; work=$(mktemp -d)
    mkdir -p "$cache/bin"
    (
        go_env
        cd "$work"
        sed "s|^dist:|dist:\n  output_path: $work/src|" "$manifest" >builder.yaml
        # The builder writes the sources, then its own tidy fails (see above): judged by what it wrote.
        go run "go.opentelemetry.io/collector/cmd/builder@$builder_version" \
            --config builder.yaml --skip-compilation >builder.log 2>&1 || true
        [ -f src/go.mod ] && [ -f src/components.go ] || { cat builder.log >&2; exit 1; }
        cd src
        go mod tidy -e >tidy.log 2>&1 || { cat tidy.log >&2; exit 1; }
        go build -trimpath -ldflags "-s -w" -o "$binary.partial.$$" . \
            || { log "go build failed"; exit 1; }
    )
    mv "$binary.partial.$$" "$binary"
    rm -rf "$work"
}

answers() { curl -s --max-time 2 -o /dev/null "http://127.0.0.1:$http_port/" 2>/dev/null; }

alive() { [ -f "$run_dir/otelcol.pid" ] && kill -0 "$(cat "$run_dir/otelcol.pid")" 2>/dev/null; }

start() {
    local config=${1:-$here/otelcol/config.yaml}
    if alive && answers; then log "already running (pid $(cat "$run_dir/otelcol.pid"))"; return; fi
    build
    stop
    mkdir -p "$run_dir"
    export BMEG_OTELCOL_FILE=${BMEG_OTELCOL_FILE:-$run_dir/spans.jsonl}
    "$binary" --config "$config" >"$run_dir/otelcol.log" 2>&1 &
    echo $! >"$run_dir/otelcol.pid"
    local i
    for i in $(seq 1 60); do
        if answers; then log "running on 127.0.0.1:$http_port (log $run_dir/otelcol.log)"; return; fi
        if ! alive; then cat "$run_dir/otelcol.log" >&2; log "the Collector exited"; exit 1; fi
        sleep 0.5
    done
    cat "$run_dir/otelcol.log" >&2
    log "the Collector did not answer on 127.0.0.1:$http_port within 30 s"
    exit 1
}

stop() {
    if alive; then
        local pid; pid=$(cat "$run_dir/otelcol.pid")
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 1 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$run_dir/otelcol.pid"
}

case ${1:-} in
    build) build; echo "$binary" ;;
    path) build; echo "$binary" ;;
    start) shift; start "$@" ;;
    stop) stop ;;
    status) alive && answers ;;
    env)
        echo "export BMEG_OTELCOL_BINARY=$binary"
        echo "export BMEG_OTELCOL_RUN_DIR=$run_dir"
        echo "export BMEG_OTELCOL_CONFIG=$here/otelcol/config.yaml"
        ;;
    *) echo "usage: $0 build|path|start [CONFIG]|stop|status|env" >&2; exit 2 ;;
esac
