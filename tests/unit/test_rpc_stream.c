/* The write-buffer hint of libcommon/rpc_stream.c: a stream with frames waiting sends them
 * hinted (the transport holds them for one write), but a run of hinted frames ends after
 * RPC_STREAM_HINT_FRAMES frames or RPC_STREAM_HINT_BYTES bytes, so a long queue is written as
 * it goes rather than handed to the transport whole before its first byte leaves. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <string.h>

#include "rpc_internal.h"

/* Sends `total` frames of `len` bytes from a queue holding them all; returns the lengths of the
 * hinted runs (each ended by an unhinted frame) in runs[], their count in *n. */
static void drain(size_t total, size_t len, int *runs, int *n) {
    rpc_call c;
    memset(&c, 0, sizeof c);
    int run = 0;
    *n = 0;
    for (size_t i = 0; i < total; i++) {
        c.q_len = total - i - 1; /* the frames behind this one */
        if (rpc__stream_hint(&c, len)) {
            run++;
        } else {
            runs[(*n)++] = run;
            run = 0;
        }
    }
    assert_int_equal(run, 0); /* the last frame of a queue always flushes */
}

static void test_small_frames_end_their_run_at_the_frame_bound(void **state) {
    (void)state;
    int runs[256], n;
    drain(200, 40, runs, &n);
    /* 16 hinted, one unhinted: runs of 17 frames, then the rest of the queue */
    assert_int_equal(n, (200 + RPC_STREAM_HINT_FRAMES) / (RPC_STREAM_HINT_FRAMES + 1));
    for (int i = 0; i < n - 1; i++)
        assert_int_equal(runs[i], RPC_STREAM_HINT_FRAMES);
    assert_int_equal(runs[n - 1], (200 - 1) % (RPC_STREAM_HINT_FRAMES + 1));
}

static void test_large_frames_end_their_run_at_the_byte_bound(void **state) {
    (void)state;
    int runs[256], n;
    size_t len = 300;                                          /* the fan-out bench's frames */
    int want = (int)((RPC_STREAM_HINT_BYTES + len - 1) / len); /* hinted until the bound */
    assert_true(want < RPC_STREAM_HINT_FRAMES);
    drain(200, len, runs, &n);
    for (int i = 0; i < n - 1; i++)
        assert_int_equal(runs[i], want);
    /* a frame larger than the bound is still hinted once: a queue of them pairs up */
    drain(10, 2 * RPC_STREAM_HINT_BYTES, runs, &n);
    assert_int_equal(n, 5);
    for (int i = 0; i < n; i++)
        assert_int_equal(runs[i], 1);
}

static void test_an_empty_queue_flushes_and_starts_a_new_run(void **state) {
    (void)state;
    rpc_call c;
    memset(&c, 0, sizeof c);
    c.q_len = 5;
    for (int i = 0; i < 3; i++)
        assert_true(rpc__stream_hint(&c, 10));
    c.q_len = 0; /* nothing behind this frame: it goes unhinted, the run is over */
    assert_false(rpc__stream_hint(&c, 10));
    assert_int_equal(c.hint_run, 0);
    assert_int_equal(c.hint_bytes, 0);
    c.q_len = 100;
    for (int i = 0; i < RPC_STREAM_HINT_FRAMES; i++)
        assert_true(rpc__stream_hint(&c, 10));
    assert_false(rpc__stream_hint(&c, 10));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_small_frames_end_their_run_at_the_frame_bound),
        cmocka_unit_test(test_large_frames_end_their_run_at_the_byte_bound),
        cmocka_unit_test(test_an_empty_queue_flushes_and_starts_a_new_run),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
