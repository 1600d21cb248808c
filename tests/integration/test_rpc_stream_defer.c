/* Deferred stream sends (rpc_stream_push_deferred, rpc_stream_kick), in-process over real gRPC
 * on loopback: a deferred frame on an idle stream waits for the kick; a kicked burst goes out
 * whole (its frames but the last carry the write-buffer hint, which holds bytes in the
 * transport until an unhinted send follows: a burst whose last frame were hinted would never
 * arrive); a burst that opens a stream (its first frame carries the response headers) arrives
 * on a connection of its own; a plain push or the final status also starts what was deferred;
 * producers on two threads deferring and kicking the same stream lose nothing (run under
 * `make tsan` too). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "rpc.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define PATH(m) "/upsquad.test.v1.EchoService/" m
#define RESP_DESC (&upsquad__test__v1__echo_response__descriptor)
#define QUEUE 256

typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

static rpc_server *srv;
static rpc_channel *ch;
static _Atomic(rpc_call *) detached; /* the stream the handler handed over */
static atomic_int no_hello;          /* the handler detaches the stream with nothing sent */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void on_close(rpc_call *call, void *ud) {
    (void)call, (void)ud;
}

/* sends a hello (seq -1: the client's rpc_stream_open returns with the initial metadata, which
 * goes with the first frame), unless no_hello, then hands the stream to the test's producer */
static int detach_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)req, (void)ud;
    EchoResponse hello = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
    hello.seq = -1;
    if (!atomic_load(&no_hello) && rpc_stream_send(call, &hello.base) != RPC_OK)
        return RPC_CANCELLED;
    rpc_call *c = rpc_stream_detach(call, on_close, NULL);
    if (!c) return RPC_CANCELLED;
    atomic_store(&detached, c);
    return RPC_EDETACHED;
}

/* ---- the client side: a thread reading one stream ---- */

typedef struct reader {
    rpc_channel *chan; /* NULL: the shared channel */
    rpc_reader *r;
    pthread_t th;
    atomic_int hello; /* the stream is open */
    atomic_int got;   /* frames received after the hello */
    atomic_int next;  /* frames in order: the seq expected next (-1 once one came out of order) */
    atomic_int ended;
    int code;
} reader;

static void *read_main(void *arg) {
    reader *rd = arg;
    ProtobufCMessage *m;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    rpc_call_opts o = {.timeout_ms = 60000};
    rpc_stream_open(rd->chan ? rd->chan : ch, PATH("PublicStream"), &req.base, RESP_DESC, &o,
                    &rd->r);
    while (rpc_reader_next(rd->r, &m) == 1) {
        EchoResponse *e = (EchoResponse *)m;
        if (e->seq < 0) {
            atomic_store(&rd->hello, 1);
        } else {
            if (atomic_load(&rd->next) == e->seq)
                atomic_fetch_add(&rd->next, 1);
            else
                atomic_store(&rd->next, -1);
            atomic_fetch_add(&rd->got, 1);
        }
        protobuf_c_message_free_unpacked(m, NULL);
    }
    atomic_store(&rd->ended, 1);
    return NULL;
}

/* Opens a stream and waits until the server has detached it and its hello has been read (the
 * stream is idle then: nothing in flight); *call: the producer's reference. */
static reader *open_stream(rpc_call **call) {
    reader *rd = calloc(1, sizeof *rd);
    atomic_store(&detached, NULL);
    assert_int_equal(pthread_create(&rd->th, NULL, read_main, rd), 0);
    int64_t until = now_ms() + 5000;
    while ((!atomic_load(&detached) || !atomic_load(&rd->hello)) && now_ms() < until)
        usleep(2000);
    *call = atomic_load(&detached);
    assert_non_null(*call);
    assert_true(atomic_load(&rd->hello));
    usleep(100 * 1000); /* the hello's send completion, on the server's queue thread */
    return rd;
}

static void close_stream(reader *rd, rpc_call *call) {
    rpc_stream_finish(call, RPC_OK, NULL);
    rpc_call_unref(call);
    pthread_join(rd->th, NULL);
    rd->code = rpc_reader_close(rd->r, NULL);
    free(rd);
}

/* Waits up to ms for `want` frames; returns how long it took (-1: they did not all come). */
static int64_t wait_got(reader *rd, int want, int64_t ms) {
    int64_t t0 = now_ms();
    while (atomic_load(&rd->got) < want && now_ms() - t0 < ms)
        usleep(1000);
    return atomic_load(&rd->got) >= want ? now_ms() - t0 : -1;
}

static rpc_frame *frame(int seq) {
    EchoResponse m = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
    m.seq = seq;
    m.text = "token";
    rpc_frame *f = rpc_frame_encode(&m.base);
    assert_non_null(f);
    return f;
}

static int push_deferred(rpc_call *call, int seq) {
    rpc_frame *f = frame(seq);
    int rc = rpc_stream_push_deferred(call, f);
    rpc_frame_unref(f);
    return rc;
}

/* ---- tests ---- */

static void test_a_deferred_frame_waits_for_the_kick(void **state) {
    (void)state;
    rpc_call *call;
    reader *rd = open_stream(&call);
    assert_int_equal(push_deferred(call, 0), RPC_OK);
    usleep(300 * 1000);
    assert_int_equal(atomic_load(&rd->got), 0); /* not started: nothing in flight, no kick */
    assert_int_equal(rpc_stream_queued(call), 1);
    rpc_stream_kick(call);
    int64_t took = wait_got(rd, 1, 2000);
    assert_true(took >= 0 && took < 1000);
    rpc_stream_kick(call); /* nothing queued: a no-op */
    close_stream(rd, call);
}

/* rpc_stream_room: the free slots, the pushes that would succeed (a StreamGap and the frame it
 * names go together only with room for both). */
static void test_room_counts_the_free_slots(void **state) {
    (void)state;
    rpc_call *call;
    reader *rd = open_stream(&call);
    assert_int_equal(rpc_stream_room(call), QUEUE);
    for (int i = 0; i < QUEUE; i++) {
        assert_int_equal(push_deferred(call, i), RPC_OK);
        assert_int_equal(rpc_stream_room(call), QUEUE - i - 1);
    }
    assert_int_equal(push_deferred(call, QUEUE), RPC_EFULL); /* no room: refused */
    rpc_stream_kick(call);
    assert_true(wait_got(rd, QUEUE, 5000) >= 0);
    for (int i = 0; i < 100 && rpc_stream_room(call) != QUEUE; i++)
        usleep(10 * 1000);
    assert_int_equal(rpc_stream_room(call), QUEUE); /* drained: all free again */
    close_stream(rd, call);
}

/* The burst's frames but the last are hinted: the last one, unhinted, flushes them all; a frame
 * deferred later on the same (idle again) stream is not held behind a hinted write either. */
static void test_a_kicked_burst_arrives_whole_and_promptly(void **state) {
    (void)state;
    rpc_call *call;
    reader *rd = open_stream(&call);
    for (int round = 0; round < 5; round++) {
        int base = round * 101;
        for (int i = 0; i < 100; i++)
            assert_int_equal(push_deferred(call, base + i), RPC_OK);
        rpc_stream_kick(call);
        int64_t took = wait_got(rd, base + 100, 3000);
        assert_true(took >= 0 && took < 2000);
        /* one more, alone: it must not wait behind a write the transport still holds */
        assert_int_equal(push_deferred(call, base + 100), RPC_OK);
        rpc_stream_kick(call);
        took = wait_got(rd, base + 101, 2000);
        assert_true(took >= 0 && took < 1000);
    }
    assert_int_equal(atomic_load(&rd->next), 505); /* every frame, in order */
    rpc_stream_finish(call, RPC_OK, NULL);
    rpc_call_unref(call);
    pthread_join(rd->th, NULL);
    assert_int_equal(rpc_reader_close(rd->r, NULL), RPC_OK);
    free(rd);
}

/* A stream whose handler sent nothing (the hub's run streams with an empty snapshot) and whose
 * first frames come as a burst: the first one carries the response headers, and chttp2 starts
 * no write for a server's headers whose batch holds a hinted message; that batch completes
 * only once they are written, and the stream's next frame waits for that completion. Alone on
 * its connection (no other stream's write to carry the headers out), the stream received
 * nothing at all. */
static void test_a_burst_that_opens_a_stream_arrives_alone_on_its_connection(void **state) {
    (void)state;
    char err[256], target[64];
    rpc_channel *own;
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_opts co = {.target = target};
    assert_int_equal(rpc_channel_new(&co, &own, err, sizeof err), 0);
    atomic_store(&no_hello, 1);
    reader *rd = calloc(1, sizeof *rd);
    rd->chan = own;
    atomic_store(&detached, NULL);
    assert_int_equal(pthread_create(&rd->th, NULL, read_main, rd), 0);
    int64_t until = now_ms() + 5000;
    while (!atomic_load(&detached) && now_ms() < until)
        usleep(2000);
    rpc_call *call = atomic_load(&detached);
    atomic_store(&no_hello, 0);
    assert_non_null(call);
    usleep(300 * 1000); /* the request's own traffic (settings, window updates) is over */
    for (int i = 0; i < 8; i++)
        assert_int_equal(push_deferred(call, i), RPC_OK);
    rpc_stream_kick(call);
    int64_t took = wait_got(rd, 8, 3000);
    int next = atomic_load(&rd->next);
    if (took < 0) /* the stuck send would hold the status back too: end it past the queue */
        rpc_stream_abort(call, RPC_UNAVAILABLE, "frames never sent");
    close_stream(rd, call);
    rpc_channel_free(own);
    assert_true(took >= 0 && took < 2000);
    assert_int_equal(next, 8);
}

static void test_a_plain_push_or_the_status_starts_deferred_frames(void **state) {
    (void)state;
    rpc_call *call;
    reader *rd = open_stream(&call);
    for (int i = 0; i < 5; i++)
        assert_int_equal(push_deferred(call, i), RPC_OK);
    rpc_frame *f = frame(5);
    assert_int_equal(rpc_stream_push(call, f), RPC_OK); /* starts the queue: no kick needed */
    rpc_frame_unref(f);
    assert_true(wait_got(rd, 6, 2000) >= 0);
    for (int i = 6; i < 9; i++)
        assert_int_equal(push_deferred(call, i), RPC_OK);
    rpc_stream_finish(call, RPC_OK, NULL); /* the deferred frames, then the status */
    rpc_call_unref(call);
    pthread_join(rd->th, NULL);
    assert_int_equal(atomic_load(&rd->got), 9);
    assert_int_equal(atomic_load(&rd->next), 9);
    assert_int_equal(rpc_reader_close(rd->r, NULL), RPC_OK);
    free(rd);
}

typedef struct producer {
    rpc_call *call;
    int n;
    pthread_mutex_t *order; /* one producer's frame and its seq are queued together */
    atomic_int *seq;
} producer;

static void *produce(void *arg) {
    producer *p = arg;
    for (int i = 0; i < p->n;) {
        pthread_mutex_lock(p->order);
        int seq = atomic_load(p->seq);
        int rc = push_deferred(p->call, seq);
        if (rc == RPC_OK) atomic_store(p->seq, seq + 1);
        pthread_mutex_unlock(p->order);
        if (rc == RPC_EFULL) { /* the reader is behind: start what waits and retry */
            rpc_stream_kick(p->call);
            usleep(500);
            continue;
        }
        assert_int_equal(rc, RPC_OK);
        if (++i % 7 == 0) rpc_stream_kick(p->call); /* bursts of 7 */
    }
    rpc_stream_kick(p->call);
    return NULL;
}

static void test_two_producers_defer_and_kick_one_stream(void **state) {
    (void)state;
    rpc_call *call;
    reader *rd = open_stream(&call);
    pthread_mutex_t order = PTHREAD_MUTEX_INITIALIZER;
    atomic_int seq = 0;
    producer a = {call, 2000, &order, &seq}, b = {call, 2000, &order, &seq};
    pthread_t ta, tb;
    pthread_create(&ta, NULL, produce, &a);
    pthread_create(&tb, NULL, produce, &b);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    assert_true(wait_got(rd, 4000, 20000) >= 0);
    assert_int_equal(atomic_load(&rd->next), 4000);
    close_stream(rd, call);
}

static int setup(void **state) {
    (void)state;
    char err[256], target[64];
    rpc_server_opts o = {.addr = "127.0.0.1:0", .stream_queue = QUEUE};
    rpc_method m = {PATH("PublicStream"),
                    RPC_SERVER_STREAM,
                    RPC_AUTH_NONE,
                    &upsquad__test__v1__echo_request__descriptor,
                    RESP_DESC,
                    NULL,
                    detach_stream};
    if (rpc_server_new(&o, &srv, err, sizeof err) || rpc_server_add(srv, &m, 1) ||
        rpc_server_start(srv, err, sizeof err))
        return -1;
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_opts co = {.target = target};
    return rpc_channel_new(&co, &ch, err, sizeof err) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    rpc_channel_free(ch);
    rpc_server_shutdown(srv, 1000);
    rpc_server_free(srv);
    return 0;
}

int main(void) {
    log_init("test_rpc_stream_defer", LOG_WARN);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_deferred_frame_waits_for_the_kick),
        cmocka_unit_test(test_room_counts_the_free_slots),
        cmocka_unit_test(test_a_kicked_burst_arrives_whole_and_promptly),
        cmocka_unit_test(test_a_burst_that_opens_a_stream_arrives_alone_on_its_connection),
        cmocka_unit_test(test_a_plain_push_or_the_status_starts_deferred_frames),
        cmocka_unit_test(test_two_producers_defer_and_kick_one_stream),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
