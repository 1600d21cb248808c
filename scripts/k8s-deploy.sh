#!/usr/bin/env bash
# Deploys one environment of k8s/overlays in the order the services need:
#   1. the namespace;
#   2. with --bootstrap: the database bootstrap Job (roles, schemas, passwords), waited for;
#   3. the schema migration Jobs of this release, waited for: a new schema is in place before
#      any pod of the new release serves (migrations are additive, so the old pods keep
#      working on it while the rollout replaces them);
#   4. the services, and each Deployment's rollout waited for.
# The Jobs have fixed names and an immutable pod template, so the previous release's Jobs are
# deleted first. Uses $KUBECTL (default: the kubectl of PATH, the operator's, 1.20 or newer)
# and its current context.
#
#   scripts/k8s-deploy.sh dev|prod [--bootstrap] [--timeout 10m]
set -euo pipefail
cd "$(dirname "$0")/.."
env=${1:?usage: scripts/k8s-deploy.sh dev|prod [--bootstrap] [--timeout 10m]}
shift
bootstrap=0 timeout=10m
while [[ $# -gt 0 ]]; do
    case "$1" in
    --bootstrap) bootstrap=1 ;;
    --timeout) timeout=${2:?--timeout wants a duration}; shift ;;
    *) echo "k8s-deploy: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
overlay=k8s/overlays/$env
[[ -f $overlay/kustomization.yaml ]] || { echo "k8s-deploy: no overlay $overlay" >&2; exit 2; }
ns=upsquad
k=${KUBECTL:-kubectl}

run_jobs() { # DIR LABEL: replace the Jobs of a kustomization and wait until each completes
    local dir=$1 selector=$2
    "$k" -n "$ns" delete job -l "$selector" --ignore-not-found --wait=true
    "$k" apply -k "$dir"
    if ! "$k" -n "$ns" wait --for=condition=complete --timeout="$timeout" job -l "$selector"; then
        echo "k8s-deploy: $dir did not complete; its logs:" >&2
        "$k" -n "$ns" logs -l "$selector" --all-containers --tail=50 >&2 || true
        exit 1
    fi
}

"$k" apply -f k8s/base/app/namespace.yaml
if ((bootstrap)); then
    run_jobs "$overlay/bootstrap" app.kubernetes.io/component=bootstrap
fi
run_jobs "$overlay/migrate" app.kubernetes.io/component=migration
"$k" apply -k "$overlay"
for d in $("$k" -n "$ns" get deploy -l app.kubernetes.io/part-of=upsquad -o name); do
    "$k" -n "$ns" rollout status "$d" --timeout="$timeout"
done
