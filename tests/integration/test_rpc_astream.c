/* The asynchronous server-stream reader and parent-call propagation, in-process over real
 * gRPC on loopback: many streams read in order by two I/O threads; a consumer cancels, pauses
 * and resumes; a server call's deadline reaches the call its handler makes to another server. */
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
#include "rpc_astream.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define PATH(m) "/upsquad.test.v1.EchoService/" m
#define RESP_DESC (&upsquad__test__v1__echo_response__descriptor)

typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

static rpc_server *backend, *front;
static rpc_channel *to_backend, *to_front;
static rpc_aclient *ac;
static atomic_int backend_sent, slow_ms, slow_done;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static int threads_now(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1) break;
    if (f) fclose(f);
    return n;
}

/* backend: `count` messages numbered from 0, delay_ms apart */
static int stream_fn(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)ud;
    const EchoRequest *r = (const EchoRequest *)req;
    for (int i = 0; i < r->count; i++) {
        EchoResponse m = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
        m.seq = i;
        m.text = r->text;
        if (rpc_stream_send(call, &m.base) != RPC_OK) return RPC_CANCELLED;
        atomic_fetch_add(&backend_sent, 1);
        if (r->delay_ms) usleep((useconds_t)r->delay_ms * 1000);
    }
    return RPC_OK;
}

/* backend: sleeps delay_ms unless cancelled; reports how long it ran */
static int slow_fn(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    (void)ud, (void)resp;
    int64_t t0 = now_ms();
    while (now_ms() - t0 < ((const EchoRequest *)req)->delay_ms && !rpc_cancelled(call))
        usleep(2000);
    atomic_store(&slow_ms, (int)(now_ms() - t0));
    atomic_fetch_add(&slow_done, 1);
    return RPC_OK;
}

/* front: calls the backend's slow method for its caller, with no deadline of its own */
static int relay_fn(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    (void)ud, (void)resp;
    ProtobufCMessage *out = NULL;
    rpc_call_opts o = {.parent = call};
    int code = rpc_unary_call(to_backend, PATH("PublicEcho"), req, RESP_DESC, &o, &out, NULL);
    if (out) protobuf_c_message_free_unpacked(out, NULL);
    return code == RPC_OK ? RPC_OK : rpc_error(call, code, "backend: %d", code);
}

static rpc_server *serve(rpc_method *m, size_t n, rpc_channel **ch) {
    char err[256], target[64];
    rpc_server *s = NULL;
    rpc_server_opts o = {.addr = "127.0.0.1:0", .stream_workers = 80};
    if (rpc_server_new(&o, &s, err, sizeof err) != 0 || rpc_server_add(s, m, n) != 0 ||
        rpc_server_start(s, err, sizeof err) != 0)
        return NULL;
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(s));
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, ch, err, sizeof err) != 0) return NULL;
    return s;
}

static int setup(void **state) {
    (void)state;
    const ProtobufCMessageDescriptor *rq = &upsquad__test__v1__echo_request__descriptor;
    rpc_method bm[] = {
        {PATH("PublicStream"), RPC_SERVER_STREAM, RPC_AUTH_NONE, rq, RESP_DESC, NULL, stream_fn},
        {PATH("PublicEcho"), RPC_UNARY, RPC_AUTH_NONE, rq, RESP_DESC, slow_fn, NULL, NULL,
         .flags = RPC_BLOCKING},
    };
    rpc_method fm[] = {
        {PATH("PublicEcho"), RPC_UNARY, RPC_AUTH_NONE, rq, RESP_DESC, relay_fn, NULL, NULL,
         .flags = RPC_BLOCKING},
    };
    if ((backend = serve(bm, 2, &to_backend)) == NULL) return -1;
    if ((front = serve(fm, 1, &to_front)) == NULL) return -1;
    return rpc_aclient_new(2, &ac) == RPC_OK ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    rpc_aclient_free(ac);
    rpc_channel_free(to_front);
    rpc_server_shutdown(front, 1000); /* its handlers use to_backend */
    rpc_server_free(front);
    rpc_channel_free(to_backend);
    rpc_server_shutdown(backend, 1000);
    rpc_server_free(backend);
    return 0;
}

typedef struct reader {
    atomic_int n, disorder, done, code;
    int cancel_after; /* 0: never */
    int pause_each;
    atomic_int paused;
} reader;

static int on_msg(rpc_astream *s, const ProtobufCMessage *msg, void *ud) {
    (void)s;
    reader *r = ud;
    const EchoResponse *m = (const EchoResponse *)msg;
    if (m->seq != atomic_load(&r->n)) atomic_fetch_add(&r->disorder, 1);
    int n = atomic_fetch_add(&r->n, 1) + 1;
    if (r->cancel_after && n >= r->cancel_after) return RPC_ASTREAM_CANCEL;
    if (r->pause_each) {
        atomic_store(&r->paused, 1);
        return RPC_ASTREAM_PAUSE;
    }
    return RPC_ASTREAM_CONTINUE;
}

static void on_done(rpc_astream *s, const rpc_status *st, void *ud) {
    (void)s;
    reader *r = ud;
    atomic_store(&r->code, st->code);
    atomic_store(&r->done, 1);
}

static rpc_astream *open_stream(reader *r, int count, int delay_ms) {
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    req.count = count;
    req.delay_ms = delay_ms;
    req.text = "x";
    rpc_astream *s = NULL;
    rpc_call_opts o = {.timeout_ms = 20000};
    assert_int_equal(rpc_astream_open(ac, to_backend, PATH("PublicStream"), &req.base, RESP_DESC,
                                      &o, on_msg, on_done, r, &s),
                     RPC_OK);
    return s;
}

static void wait_done(reader *r) {
    for (int i = 0; i < 3000 && !atomic_load(&r->done); i++)
        usleep(5000);
    assert_true(atomic_load(&r->done));
}

#define NSTREAMS 64
#define NMSGS 50

static void test_many_streams_two_threads_in_order(void **state) {
    (void)state;
    static reader rs[NSTREAMS];
    rpc_astream *ss[NSTREAMS];
    memset(rs, 0, sizeof rs);
    int before = threads_now();
    for (int i = 0; i < NSTREAMS; i++)
        ss[i] = open_stream(&rs[i], NMSGS, 1);
    int during = threads_now();
    for (int i = 0; i < NSTREAMS; i++) {
        wait_done(&rs[i]);
        assert_int_equal(atomic_load(&rs[i].code), RPC_OK);
        assert_int_equal(atomic_load(&rs[i].n), NMSGS);
        assert_int_equal(atomic_load(&rs[i].disorder), 0);
        rpc_astream_unref(ss[i]);
    }
    /* the readers' side costs no thread per stream (the in-process backend's workers are
     * its own: started with the server, before `before`) */
    printf("threads: %d before, %d with %d streams open\n", before, during, NSTREAMS);
    assert_true(during - before <= 2);
}

static void test_consumer_cancel(void **state) {
    (void)state;
    reader r;
    memset(&r, 0, sizeof r);
    r.cancel_after = 3;
    atomic_store(&backend_sent, 0);
    rpc_astream *s = open_stream(&r, 1000, 5);
    wait_done(&r);
    assert_int_equal(atomic_load(&r.code), RPC_CANCELLED);
    assert_int_equal(atomic_load(&r.n), 3);
    usleep(100 * 1000);
    int sent = atomic_load(&backend_sent);
    usleep(100 * 1000);
    assert_int_equal(atomic_load(&backend_sent), sent); /* the backend stopped */
    assert_true(sent < 1000);
    rpc_astream_unref(s);
}

static void test_pause_and_resume(void **state) {
    (void)state;
    reader r;
    memset(&r, 0, sizeof r);
    r.pause_each = 1;
    rpc_astream *s = open_stream(&r, 20, 0);
    for (int i = 0; i < 4000 && !atomic_load(&r.done); i++) {
        if (atomic_exchange(&r.paused, 0)) {
            int n = atomic_load(&r.n);
            usleep(3000);
            assert_int_equal(atomic_load(&r.n), n); /* nothing delivered while paused */
            rpc_astream_resume(s);
        }
        usleep(500);
    }
    wait_done(&r);
    assert_int_equal(atomic_load(&r.code), RPC_OK);
    assert_int_equal(atomic_load(&r.n), 20);
    assert_int_equal(atomic_load(&r.disorder), 0);
    rpc_astream_unref(s);
}

static void test_cancel_while_paused(void **state) {
    (void)state;
    reader r;
    memset(&r, 0, sizeof r);
    r.pause_each = 1;
    rpc_astream *s = open_stream(&r, 100, 0);
    for (int i = 0; i < 2000 && !atomic_load(&r.paused); i++)
        usleep(1000);
    rpc_astream_cancel(s);
    wait_done(&r);
    assert_int_equal(atomic_load(&r.code), RPC_CANCELLED);
    assert_int_equal(atomic_load(&r.n), 1);
    rpc_astream_unref(s);
}

/* Before: the backend call had no deadline and ran its full 3 s after the caller had gone. */
static void test_parent_deadline_reaches_backend(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    ProtobufCMessage *out = NULL;
    req.delay_ms = 3000;
    int base = atomic_load(&slow_done);
    rpc_call_opts o = {.timeout_ms = 300};
    assert_int_equal(
        rpc_unary_call(to_front, PATH("PublicEcho"), &req.base, RESP_DESC, &o, &out, NULL),
        RPC_DEADLINE_EXCEEDED);
    for (int i = 0; i < 600 && atomic_load(&slow_done) == base; i++)
        usleep(5000);
    assert_int_equal(atomic_load(&slow_done), base + 1);
    assert_true(atomic_load(&slow_ms) < 1500);
}

int main(void) {
    log_init("test_rpc_astream", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_streams_two_threads_in_order),
        cmocka_unit_test(test_consumer_cancel),
        cmocka_unit_test(test_pause_and_resume),
        cmocka_unit_test(test_cancel_while_paused),
        cmocka_unit_test(test_parent_deadline_reaches_backend),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
