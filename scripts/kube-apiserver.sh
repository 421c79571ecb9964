#!/usr/bin/env bash
# A real Kubernetes API server for the integration tests: etcd + kube-apiserver on loopback,
# token auth and RBAC, no kubelet (Deployments are stored, scaled and patched, never run).
#
#   scripts/kube-apiserver.sh build    build kube-apiserver from the Go module proxy (cached)
#   scripts/kube-apiserver.sh start    build if needed, install etcd if needed, start both,
#                                      wait for /readyz, write the two kubeconfigs
#   scripts/kube-apiserver.sh stop     stop both and remove the run directory
#   scripts/kube-apiserver.sh status   exit 0 when /readyz answers ok
#   scripts/kube-apiserver.sh env      print the settings as shell exports (for scripts/test.sh)
#
# Identities (tokens in $run_dir/tokens.csv, kubeconfigs beside it):
#   admin.kubeconfig       user "bmeg-admin", group system:masters: can do anything.
#   controller.kubeconfig  user "system:serviceaccount:bmeg:bmeg-mitigation", the name the
#                          mitigation controller's ServiceAccount has in the cluster, so the
#                          RoleBinding in mitigation/rbac.yaml binds this user too.
#
# Environment: BMEG_KUBE_PORT (secure port, default 16443), BMEG_ETCD_PORT (default 12379),
# BMEG_KUBE_RUN_DIR (default ${TMPDIR:-/tmp}/bmeg-kube-$USER).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/bmeg
version=$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' "$here/kube/go.mod")
binary=$cache/bin/kube-apiserver-$version
port=${BMEG_KUBE_PORT:-16443}
etcd_port=${BMEG_ETCD_PORT:-12379}
run_dir=${BMEG_KUBE_RUN_DIR:-${TMPDIR:-/tmp}/bmeg-kube-${USER:-$(id -un)}}
controller_user=system:serviceaccount:bmeg:bmeg-mitigation

log() { echo "kube-apiserver.sh: $*" >&2; }

build() {
    if [ -x "$binary" ]; then return; fi
    log "building kube-apiserver $version from the Go module proxy (minutes the first time)"
    mkdir -p "$cache/bin"
    local minor=${version#v1.}; minor=${minor%%.*}
    local pkg=k8s.io/component-base/version
    # The version stamps make the server report $version rather than v0.0.0-master.
    (
        cd "$here/kube"
        export GOPATH=$cache/go GOMODCACHE=$cache/go/mod GOCACHE=$cache/go/build \
            GOFLAGS="-mod=readonly -modcacherw -buildvcs=false"
        go build -trimpath -o "$binary.partial.$$" \
            -ldflags "-s -w -X $pkg.gitVersion=$version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor" .
    )
    mv "$binary.partial.$$" "$binary"
}

ensure_etcd() {
    if command -v etcd >/dev/null; then return; fi
    log "installing Debian's etcd-server"
    bash "$here/apt-install.sh" etcd-server >/dev/null
}

# Keys and certificates, made once per run directory.
make_credentials() {
    local d=$run_dir
    openssl req -x509 -newkey rsa:2048 -nodes -days 30 -subj "/CN=bmeg-kube-ca" \
        -keyout "$d/ca.key" -out "$d/ca.crt" 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -subj "/CN=kube-apiserver" \
        -keyout "$d/serving.key" -out "$d/serving.csr" 2>/dev/null
    printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\n' >"$d/serving.ext"
    openssl x509 -req -in "$d/serving.csr" -CA "$d/ca.crt" -CAkey "$d/ca.key" -CAcreateserial \
        -days 30 -extfile "$d/serving.ext" -out "$d/serving.crt" 2>/dev/null
    openssl genrsa -out "$d/sa.key" 2048 2>/dev/null
    openssl rsa -in "$d/sa.key" -pubout -out "$d/sa.pub" 2>/dev/null
    # token,user,uid,"groups"
    {
        echo "$(openssl rand -hex 24),bmeg-admin,bmeg-admin,\"system:masters\""
        echo "$(openssl rand -hex 24),$controller_user,bmeg-mitigation,\"system:serviceaccounts,system:serviceaccounts:bmeg\""
    } >"$d/tokens.csv"
    chmod 600 "$d"/*.key "$d/tokens.csv"
}

write_kubeconfig() { # name user token
    cat >"$run_dir/$1.kubeconfig" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: bmeg
  cluster:
    server: https://127.0.0.1:$port
    certificate-authority: $run_dir/ca.crt
users:
- name: $2
  user:
    token: $3
contexts:
- name: $1
  context: {cluster: bmeg, user: $2}
current-context: $1
EOF
    chmod 600 "$run_dir/$1.kubeconfig"
}

token_of() { awk -F, -v u="$1" '$2 == u {print $1}' "$run_dir/tokens.csv"; }

ready() {
    [ -f "$run_dir/ca.crt" ] && [ -f "$run_dir/tokens.csv" ] || return 1
    curl -fsS --max-time 2 --cacert "$run_dir/ca.crt" \
        -H "Authorization: Bearer $(token_of bmeg-admin)" \
        "https://127.0.0.1:$port/readyz" >/dev/null 2>&1
}

etcd_ready() { curl -fsS --max-time 2 "http://127.0.0.1:$etcd_port/health" >/dev/null 2>&1; }

alive() { [ -f "$run_dir/$1.pid" ] && kill -0 "$(cat "$run_dir/$1.pid")" 2>/dev/null; }

start() {
    if ready; then log "already running on 127.0.0.1:$port"; return; fi
    build
    ensure_etcd
    stop_processes
    rm -rf "$run_dir"
    mkdir -p -m 700 "$run_dir" "$run_dir/etcd"
    make_credentials

    etcd --name bmeg --data-dir "$run_dir/etcd" \
        --listen-client-urls "http://127.0.0.1:$etcd_port" \
        --advertise-client-urls "http://127.0.0.1:$etcd_port" \
        --listen-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
        --initial-advertise-peer-urls "http://127.0.0.1:$((etcd_port + 1))" \
        --initial-cluster "bmeg=http://127.0.0.1:$((etcd_port + 1))" \
        --log-level warn >"$run_dir/etcd.log" 2>&1 &
    echo $! >"$run_dir/etcd.pid"
    wait_for etcd_ready etcd 30

    "$binary" \
        --etcd-servers "http://127.0.0.1:$etcd_port" \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$port" \
        --tls-cert-file "$run_dir/serving.crt" --tls-private-key-file "$run_dir/serving.key" \
        --client-ca-file "$run_dir/ca.crt" \
        --token-auth-file "$run_dir/tokens.csv" \
        --authorization-mode RBAC \
        --anonymous-auth=false \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$run_dir/sa.pub" \
        --service-account-signing-key-file "$run_dir/sa.key" \
        --service-cluster-ip-range 10.96.0.0/16 \
        --endpoint-reconciler-type none \
        --enable-priority-and-fairness=false \
        >"$run_dir/kube-apiserver.log" 2>&1 &
    echo $! >"$run_dir/kube-apiserver.pid"

    write_kubeconfig admin bmeg-admin "$(token_of bmeg-admin)"
    write_kubeconfig controller "$controller_user" "$(token_of "$controller_user")"

    wait_for ready kube-apiserver 120
    log "ready on https://127.0.0.1:$port (kubeconfigs in $run_dir)"
}

# wait_for CHECK PROCESS SECONDS: until CHECK succeeds; if PROCESS dies or time runs out,
# show its log, stop everything and fail.
wait_for() {
    for _ in $(seq "$3"); do
        if "$1"; then return; fi
        if ! alive "$2"; then break; fi
        sleep 1
    done
    log "$2 did not get ready; last lines of $run_dir/$2.log:"
    tail -20 "$run_dir/$2.log" >&2
    stop_processes
    exit 1
}

stop_processes() {
    local p
    for p in kube-apiserver etcd; do
        if alive "$p"; then
            local pid; pid=$(cat "$run_dir/$p.pid")
            kill "$pid"
            for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
}

stop() {
    stop_processes
    rm -rf "$run_dir"
}

status() {
    if ready; then echo "running: https://127.0.0.1:$port, kubeconfigs in $run_dir"
    else echo "not running"; return 1; fi
}

print_env() {
    printf 'export BMEG_KUBE_PORT=%q BMEG_ETCD_PORT=%q BMEG_KUBE_RUN_DIR=%q\n' \
        "$port" "$etcd_port" "$run_dir"
}

case ${1:-} in
    env) print_env ;;
    build) build ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 build|start|stop|status|env" >&2; exit 2 ;;
esac
