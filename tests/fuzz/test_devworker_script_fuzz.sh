#!/usr/bin/env bash
# Fuzzes devworker's script parser (JSON -> ExecuteStepEvent through the proto descriptors)
# with libFuzzer (clang, ASan + UBSan) for a bounded time, seeded with the committed examples.
# A crash, sanitizer report or leak fails the test; the input is kept under
# $BUILD/fuzz/devworker-script-artifacts for reproduction.
#   DW_FUZZ_SECONDS   run time (default 20)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
seconds=${DW_FUZZ_SECONDS:-20}
out="$BUILD/fuzz"
bin="$out/devworker_script_fuzz"
gen="$BUILD/gen"
[ -f "$gen/upsquad/runtime/v1/runtime.pb-c.c" ] || { echo "run 'make tests-build' first"; exit 1; }
mkdir -p "$out"
srcs=(tests/fuzz/devworker_script_fuzz.c services/devworker/script.c libcommon/pbjson.c
    libcommon/util.c "$gen"/upsquad/runtime/v1/runtime.pb-c.c "$gen"/google/protobuf/*.pb-c.c)
clang -std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Wall -Wextra -Werror -Wno-missing-field-initializers \
    -I"$gen" -Ilibcommon "${srcs[@]}" -o "$bin" -lprotobuf-c -lcjson -lm
tests/lib/fuzz_run.sh devworker_script_fuzz "$bin" "$seconds" "$out/devworker-script-artifacts" \
    -max_len=4096 tests/fuzz/devworker-script-seeds
