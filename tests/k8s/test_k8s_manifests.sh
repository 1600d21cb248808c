#!/usr/bin/env bash
# Renders every kustomization under k8s/overlays (each environment's services, its migration
# Jobs, its bootstrap Job) with Debian's kubectl (kustomize built in; scripts/deps.sh --kubectl)
# and validates every object strictly with tests/k8s/validate.mjs: the Kubernetes and Gateway
# API schemas of the npm packages kubernetes-models and @kubernetes-models/gateway-api, unknown
# fields rejected (TypeScript excess-property checks over the same packages' types), and the
# cross-object rules. Then the validator must reject each mistake of fixtures/mistakes.yaml.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
node_dir=$BUILD/node-k8s
# pinned: a new schema release is a reviewed change, not a surprise in CI
pkgs=(kubernetes-models@5.1.0 @kubernetes-models/gateway-api@2.0.0 js-yaml@4.3.2 typescript@5.9.3)
stamp="$node_dir/.installed"
if [ "$(cat "$stamp" 2>/dev/null)" != "${pkgs[*]}" ]; then
    mkdir -p "$node_dir"
    npm install --prefix "$node_dir" --no-audit --no-fund --loglevel=error "${pkgs[@]}" >&2
    echo "${pkgs[*]}" >"$stamp"
fi
kubectl=$(scripts/deps.sh --kubectl "$BUILD/debs")
out=$BUILD/k8s
rm -rf "$out" && mkdir -p "$out"
renders=()
while IFS= read -r k; do
    dir=$(dirname "$k")
    name=${dir#k8s/overlays/}
    name=${name//\//-}
    "$kubectl" kustomize "$dir" >"$out/$name.yaml"
    renders+=("$name=$out/$name.yaml")
done < <(find k8s/overlays -name kustomization.yaml | sort)
[ ${#renders[@]} -ge 6 ] || { echo "expected 6 renders (dev, prod x app, migrate, bootstrap), got ${#renders[@]}" >&2; exit 1; }
node tests/k8s/validate.mjs --dockerfile=Dockerfile "$node_dir/node_modules" "$out/ts" "${renders[@]}"

# the validator itself: every planted mistake is reported
set +e
node tests/k8s/validate.mjs --dockerfile=Dockerfile "$node_dir/node_modules" "$out/ts-mistakes" \
    mistakes=tests/k8s/fixtures/mistakes.yaml 2>"$out/mistakes.err" >/dev/null
rc=$?
set -e
[ $rc -eq 1 ] || { echo "the validator accepted fixtures/mistakes.yaml (exit $rc)" >&2; exit 1; }
missing=0
while IFS= read -r want; do
    grep -qxF "mistakes: $want" "$out/mistakes.err" || { echo "not reported: $want" >&2; missing=1; }
done <tests/k8s/fixtures/mistakes.expected
if [ $missing -ne 0 ]; then
    echo "validator said:" >&2
    cat "$out/mistakes.err" >&2
    exit 1
fi
echo "validator rejected all $(wc -l <tests/k8s/fixtures/mistakes.expected) planted mistakes"
