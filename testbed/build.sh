#!/usr/bin/env bash
# Build the testbed's one binary, `socialnet`, into the cache, only when its sources changed.
#   bash testbed/build.sh        # prints the binary's path as its last line
#   bash testbed/build.sh --test # runs the Go tests first (CI does)
# The stamp beside the binary holds a hash of testbed/**/*.go, go.mod and go.sum; Go modules
# and the build cache live under ~/.cache/bmeg/go, as for the other Go builds of the project.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
cache=${XDG_CACHE_HOME:-$HOME/.cache}/bmeg
out=$cache/testbed/bin
bin=$out/socialnet

command -v go >/dev/null || { echo "build.sh: Go is not installed (need go >= 1.26)" >&2; exit 1; }

export GOPATH=$cache/go GOMODCACHE=$cache/go/mod GOCACHE=$cache/go/build \
    GOFLAGS="-mod=readonly -modcacherw -buildvcs=false" CGO_ENABLED=0
if [ "${1:-}" = "--test" ]; then
    (cd "$here" && nice -n 10 go test ./...) >&2
fi

hash=$(cd "$here" && { find . -name '*.go' -print0 | sort -z | xargs -0 sha256sum; sha256sum go.mod go.sum; } \
    | sha256sum | cut -c1-16)
if [ -x "$bin" ] && [ "$(cat "$bin.stamp" 2>/dev/null)" = "$hash" ]; then
    echo "$bin"
    exit 0
fi

mkdir -p "$out"
(cd "$here" && nice -n 10 go build -trimpath -o "$bin.tmp" ./cmd/socialnet) >&2
mv "$bin.tmp" "$bin"
echo "$hash" > "$bin.stamp"
echo "$bin"
