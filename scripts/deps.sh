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
    # the well-known .proto files (google/protobuf/*.proto) protoc-c compiles
    libprotobuf-dev
    # tests: the workflow-definition conformance test runs ajv with Node.js
    libcmocka-dev python3-grpcio python3-protobuf libclang-rt-14-dev valgrind nodejs npm
    # tests: raw HTTP/2 clients of the adversarial suite (tests/adversarial)
    python3-h2
    # benchmarks
    bc
)

# What the build reads from the system, each with its package, so that a missing package is
# named before anything compiles (`--check`, run by the Makefile) instead of surfacing as
# make's bare "No rule to make target" or a compiler's "No such file". A path ending in '/'
# covers everything under it (`--missing FILE` names the package of any such file).
REQUIRED_FILES=(
    /usr/bin/cc:gcc
    /usr/bin/protoc:protobuf-compiler
    /usr/bin/protoc-c:protobuf-c-compiler
    /usr/include/google/protobuf/:libprotobuf-dev
    /usr/include/protobuf-c/:libprotobuf-c-dev
    /usr/include/grpc/:libgrpc-dev
    /usr/include/postgresql/libpq-fe.h:libpq-dev
    /usr/include/hiredis/:libhiredis-dev
    /usr/include/nats/:libnats-dev
    /usr/include/cjson/:libcjson-dev
    /usr/include/openssl/:libssl-dev
    /usr/include/microhttpd.h:libmicrohttpd-dev
    /usr/include/cmocka.h:libcmocka-dev
)
# Unpacked, not installed: Debian's kubernetes-client (kubectl with kustomize built in) renders
# the Kubernetes overlays for tests/k8s. It is extracted under the build folder rather than
# installed because a machine may already have another kubectl package owning /usr/bin/kubectl
# (installing over it would fail), and so that the test renders with the same kustomize
# everywhere. `deps.sh --kubectl DIR` prints the path of that kubectl, unpacking it first.
KUBECTL_PACKAGE=kubernetes-client
# Extra entries (tests): DEPS_EXTRA_REQUIRED="path:package ..."
# shellcheck disable=SC2206
REQUIRED_FILES+=(${DEPS_EXTRA_REQUIRED:-})

hint() {
    echo "deps: run 'make deps' (installs every package scripts/deps.sh declares), or:" \
        "apt-get install $*" >&2
}

case "${1:-}" in
--kubectl) # DIR: Debian's kubectl unpacked under DIR; prints its path
    dir=${2:?usage: deps.sh --kubectl DIR}
    bin="$dir/$KUBECTL_PACKAGE/usr/bin/kubectl"
    if [[ ! -x "$bin" ]]; then
        mkdir -p "$dir"
        # apt-get download needs the package lists: update them once when they lack it
        if ! (cd "$dir" && apt-get download -qq "$KUBECTL_PACKAGE" 2>/dev/null); then
            if [[ $(id -u) -eq 0 ]]; then apt-get update -qq; else sudo apt-get update -qq; fi
            (cd "$dir" && apt-get download -qq "$KUBECTL_PACKAGE") >&2
        fi
        for deb in "$dir/$KUBECTL_PACKAGE"_*.deb; do
            dpkg-deb -x "$deb" "$dir/$KUBECTL_PACKAGE"
        done
    fi
    echo "$bin"
    exit 0
    ;;
--list) # the declared packages, one a line (tests/scripts/test_deps.py checks them)
    printf '%s\n' "${PACKAGES[@]}"
    exit 0
    ;;
--check) # every required file present, or name each missing one with its package
    pkgs=()
    for entry in "${REQUIRED_FILES[@]}"; do
        path=${entry%%:*} pkg=${entry##*:}
        [[ -e "$path" ]] && continue
        echo "deps: missing $path (Debian package $pkg)" >&2
        pkgs+=("$pkg")
    done
    [[ ${#pkgs[@]} -eq 0 ]] && exit 0
    hint "${pkgs[@]}"
    exit 1
    ;;
--missing) # FILE: a file the build needs is absent; name its package
    file=${2:?usage: deps.sh --missing FILE}
    for entry in "${REQUIRED_FILES[@]}"; do
        path=${entry%%:*} pkg=${entry##*:}
        if [[ "$file" == "$path" || ("$path" == */ && "$file" == "$path"*) ]]; then
            echo "deps: missing $file (Debian package $pkg)" >&2
            hint "$pkg"
            exit 1
        fi
    done
    echo "deps: missing $file, which no package declared in scripts/deps.sh provides" >&2
    exit 1
    ;;
esac

# One dpkg-query for all. A package counts as present when it is installed or when an
# installed package provides it (a nodejs build that bundles npm provides and conflicts
# with npm: installing npm there would fail).
declare -A installed=()
while IFS=$'\t' read -r name status provides; do
    [[ "$status" == installed ]] || continue
    installed[${name%%:*}]=1
    IFS=',' read -ra prov <<<"$provides"
    for p in "${prov[@]}"; do
        p=${p# }
        installed[${p%% *}]=1
    done
done < <(dpkg-query -W -f='${Package}\t${db:Status-Status}\t${Provides}\n' 2>/dev/null || true)
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
