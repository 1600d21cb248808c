#!/usr/bin/env bash
# Workflow definition validation: time per validation of a generated 200-step definition
# (every step kind, templates, containers) against the time cJSON alone takes to parse it.
# The figure that matters is the ratio: validation is the parse plus the schema and the
# semantic rules, so the ratio is what the validator itself costs per byte parsed.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
# The limit has no setting to tune: the same cJSON build, the same document, best of rounds.
echo "baseline: cJSON parse of the same document (the library's only parser, no knob), best" \
    "of the same rounds as the validator"
"$BUILD/bin/defn" --steps 200 --iterations "${DEFN_BENCH_ITERATIONS:-2000}"
