#!/usr/bin/env bash
# Installs the Debian packages the project needs to build, run and test.
#
# Idempotent and quiet: when every package is installed it prints nothing and exits 0;
# otherwise it runs `apt-get update` and `apt-get install -y` for the missing ones only.
# Needs root (CI runs as root); a non-root user goes through sudo when it is available.
#
# Debian's `postgresql` package may create and start a cluster of its own on port 5432;
# the project never uses it: scripts/runtime.sh runs a private cluster on another port.
set -euo pipefail

PACKAGES=(
    # build
    make gcc clang pkg-config clang-format
    libgrpc-dev protobuf-compiler protobuf-c-compiler libprotobuf-c-dev
    libpq-dev libhiredis-dev libnats-dev libcjson-dev libssl-dev libmicrohttpd-dev
    # servers for local runs and tests
    postgresql redis-server nats-server openssl
    # tests
    libcmocka-dev python3-grpcio python3-protobuf libclang-rt-14-dev valgrind
)

# One dpkg-query for all: unknown packages are simply absent from its output.
declare -A installed=()
while read -r name status; do
    [[ "$status" == installed ]] && installed[${name%%:*}]=1
done < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${PACKAGES[@]}" 2>/dev/null || true)
missing=()
for pkg in "${PACKAGES[@]}"; do
    [[ -n "${installed[$pkg]:-}" ]] || missing+=("$pkg")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0

echo "deps: installing ${missing[*]}" >&2
if [[ $(id -u) -eq 0 ]]; then
    as_root=()
elif command -v sudo >/dev/null 2>&1; then
    as_root=(sudo)
else
    echo "deps: missing packages (${missing[*]}) and neither root nor sudo available" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -qq
"${as_root[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
echo "deps: installed ${#missing[@]} package(s)" >&2
