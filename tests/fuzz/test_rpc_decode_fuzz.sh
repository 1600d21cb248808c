#!/usr/bin/env bash
# Fuzzes libcommon's request decoding (nesting walk + protobuf-c unpack) with libFuzzer (clang,
# ASan + UBSan) for a bounded time. A crash, sanitizer report or leak fails the test; the
# input is kept under $BUILD/fuzz/rpc-artifacts for reproduction.
#   RPC_FUZZ_SECONDS   run time (default 20)
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
seconds=${RPC_FUZZ_SECONDS:-20}
out="$BUILD/fuzz"
bin="$out/rpc_decode_fuzz"
gen="$BUILD/gen"
[ -f "$gen/upsquad/test/v1/echo.pb-c.c" ] || { echo "run 'make tests-build' first"; exit 1; }
mkdir -p "$out"
srcs=(tests/fuzz/rpc_decode_fuzz.c libcommon/rpc_codec.c libcommon/rpc_walk.c libcommon/log.c libcommon/util.c
    "$gen"/upsquad/test/v1/echo.pb-c.c "$gen"/upsquad/runtime/v1/*.pb-c.c
    "$gen"/upsquad/workflow/v1/workflow.pb-c.c "$gen"/google/protobuf/*.pb-c.c)
clang -std=c11 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -Wall -Wextra -Werror -Wno-missing-field-initializers -Wno-unused-parameter \
    -I"$gen" -Ilibcommon "${srcs[@]}" -o "$bin" -lprotobuf-c -lgrpc -lgpr -lm
tests/lib/fuzz_run.sh rpc_decode_fuzz "$bin" "$seconds" "$out/rpc-artifacts" -max_len=65536
