#!/usr/bin/env bash
# A real single-node Kafka broker for the integration tests: Apache Kafka's jars from Maven
# Central, KRaft mode (one process is broker and controller), PLAINTEXT on loopback.
#
#   scripts/kafka.sh fetch    download the jars into ~/.cache/bmeg/kafka/<version>/libs (cached)
#   scripts/kafka.sh start    fetch if needed, format fresh storage, start, wait until it answers
#   scripts/kafka.sh stop     stop the broker and remove its run directory (data included)
#   scripts/kafka.sh status   exit 0 when the broker answers
#   scripts/kafka.sh env      print the settings as shell exports (for scripts/test.sh)
#
# Environment: BMEG_KAFKA_PORT (default 19092; the controller listens on the port above it),
# BMEG_KAFKA_RUN_DIR (default ${TMPDIR:-/tmp}/bmeg-kafka-$USER), BMEG_PYTHON (the Python with
# kafka-python used for the readiness check; default the project's .venv).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
version=4.1.1
cache=${XDG_CACHE_HOME:-$HOME/.cache}/bmeg
home=$cache/kafka/$version
libs=$home/libs
port=${BMEG_KAFKA_PORT:-19092}
controller_port=$((port + 1))
run_dir=${BMEG_KAFKA_RUN_DIR:-${TMPDIR:-/tmp}/bmeg-kafka-${USER:-$(id -un)}}
python=${BMEG_PYTHON:-$here/../.venv/bin/python}
[ -x "$python" ] || python=python3
java_opts=(-Xmx512m -Xms128m -Djava.awt.headless=true
    "-Dlog4j2.configurationFile=$run_dir/log4j2.properties")

log() { echo "kafka.sh: $*" >&2; }

fetch() {
    if [ -f "$libs/kafka_2.13-$version.jar" ]; then return; fi
    log "fetching Apache Kafka $version and its dependencies from Maven Central"
    local work; work=$(mktemp -d)
    # log4j-slf4j-impl routes Kafka's slf4j logging into log4j2, configured by start().
    cat >"$work/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>local.bmeg</groupId><artifactId>kafka-libs</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>$version</version></dependency>
    <dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j-impl</artifactId><version>2.24.3</version></dependency>
  </dependencies>
</project>
EOF
    mvn -q -B -Dstyle.color=never -Dmaven.repo.local="$cache/m2" -f "$work/pom.xml" \
        dependency:copy-dependencies \
        -DincludeScope=runtime -DoutputDirectory="$work/libs" >"$work/mvn.log" 2>&1 \
        || { cat "$work/mvn.log" >&2; exit 1; }
    mkdir -p "$home"
    rm -rf "$libs"
    mv "$work/libs" "$libs"
    rm -rf "$work"
}

write_config() {
    cat >"$run_dir/server.properties" <<EOF
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$controller_port
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$controller_port
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
log.dirs=$run_dir/data
auto.create.topics.enable=true
num.partitions=4
# One broker: every internal topic has a single replica.
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
EOF
    # Warnings and errors only, to the broker's log file.
    cat >"$run_dir/log4j2.properties" <<EOF
appender.console.type=Console
appender.console.name=console
appender.console.layout.type=PatternLayout
appender.console.layout.pattern=[%d] %p %m (%c)%n
rootLogger.level=WARN
rootLogger.appenderRef.console.ref=console
EOF
}

ready() {
    "$python" - "127.0.0.1:$port" <<'EOF' >/dev/null 2>&1
import sys
from kafka import KafkaAdminClient

admin = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=3000)
admin.list_topics()
admin.close()
EOF
}

alive() { [ -f "$run_dir/kafka.pid" ] && kill -0 "$(cat "$run_dir/kafka.pid")" 2>/dev/null; }

start() {
    if alive && ready; then log "already running on 127.0.0.1:$port"; return; fi
    fetch
    stop
    mkdir -p "$run_dir"
    write_config
    local cluster_id
    # 16 random bytes in URL-safe base64, as Kafka's own ids; the first character is fixed because
    # one that came out '-' read as an option to the tool's parser and failed 1 start in 64
    cluster_id=$(openssl rand -base64 16 | tr '+/' '-_' | tr -d '=\n')
    cluster_id="A${cluster_id:1}"
    java "${java_opts[@]}" -cp "$libs/*" kafka.tools.StorageTool format \
        -t "$cluster_id" -c "$run_dir/server.properties" >"$run_dir/format.log" 2>&1 \
        || { cat "$run_dir/format.log" >&2; exit 1; }
    java "${java_opts[@]}" -cp "$libs/*" kafka.Kafka "$run_dir/server.properties" \
        >"$run_dir/kafka.log" 2>&1 &
    echo $! >"$run_dir/kafka.pid"
    for _ in $(seq 90); do
        if ready; then log "ready on 127.0.0.1:$port"; return; fi
        if ! alive; then break; fi
        sleep 1
    done
    log "the broker did not get ready; last lines of $run_dir/kafka.log:"
    tail -20 "$run_dir/kafka.log" >&2
    stop_broker
    exit 1
}

stop_broker() {
    if alive; then
        local pid; pid=$(cat "$run_dir/kafka.pid")
        kill "$pid"
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -9 "$pid" 2>/dev/null || true
    fi
}

stop() {
    stop_broker
    rm -rf "$run_dir"
}

status() {
    if ready; then echo "running: 127.0.0.1:$port"; else echo "not running"; return 1; fi
}

print_env() {
    printf 'export BMEG_KAFKA_PORT=%q BMEG_KAFKA_RUN_DIR=%q BMEG_KAFKA_BOOTSTRAP=%q\n' \
        "$port" "$run_dir" "127.0.0.1:$port"
}

case ${1:-} in
    env) print_env ;;
    fetch) fetch ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 fetch|start|stop|status|env" >&2; exit 2 ;;
esac
