#!/usr/bin/env bash
# Fuzzes the workflow definition validator with libFuzzer (clang, ASan + UBSan) for a bounded
# time, starting from the committed seeds in tests/workflow/fuzz-seeds. A crash, a sanitizer
# report or a broken validator contract fails the test; the input is kept under
# $BUILD/fuzz/artifacts for reproduction (run the binary with that file as its argument).
#   DEFN_FUZZ_SECONDS   run time (default 30)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
SECONDS_BUDGET=${DEFN_FUZZ_SECONDS:-30}
out="$BUILD/fuzz"
bin="$out/defn_fuzz"
# the validator without its protobuf adapter (defn_pb.c), which the fuzzer does not reach
srcs=($(ls services/workflow-engine/defn_*.c | grep -v '/defn_pb\.c$') tests/workflow/fuzz/defn_fuzz.c)
mkdir -p "$out"
if [ ! -x "$bin" ] || [ -n "$(find "${srcs[@]}" services/workflow-engine/*.h -newer "$bin" 2>/dev/null)" ]; then
    clang -std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer \
        -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
        -Wall -Wextra -Werror -Wno-missing-field-initializers \
        -Iservices/workflow-engine "${srcs[@]}" -o "$bin" -lcjson -lm
fi
# New inputs go to a scratch corpus; the committed seeds stay as they are.
tests/lib/fuzz_run.sh test_fuzz "$bin" "$SECONDS_BUDGET" "$out/artifacts" -max_len=32768 \
    -dict=tests/workflow/fuzz/defn.dict tests/workflow/fuzz-seeds
