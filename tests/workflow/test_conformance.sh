#!/usr/bin/env bash
# Runs every workflow-definition corpus case (tests/workflow/corpus, examples/workflows and
# generated large inputs) through the C validator (build/bin/defn-validate) and through ajv, an
# independent JSON Schema implementation, and requires them to agree. See conformance.js.
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
cli="$BUILD/bin/defn-validate"
if [ ! -x "$cli" ]; then
    echo "test_conformance: $cli is missing (run: make tests-build)" >&2
    exit 1
fi
# ajv 8 (with its draft 2020-12 build) lives under build/node, installed once.
if [ ! -f build/node/node_modules/ajv/dist/2020.js ]; then
    mkdir -p build/node
    npm install --prefix build/node --no-audit --no-fund --loglevel=error ajv@8 >&2
fi
node tests/workflow/conformance.js "$cli" build/node/node_modules
