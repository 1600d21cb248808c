/* A stream's status is written by its handler (rpc_error, the value it returns) while the
 * close completion of a client that cancels reads and writes it on a queue thread. Both go
 * through the stream's lock: under `make tsan` this test fails on a race otherwise (before the
 * fix: rpc_error and on_close touched c->code/c->message without it). In other builds it
 * checks that a cancelled stream ends CANCELLED and is counted once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <cmocka.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "metrics.h"
#include "rpc.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define PATH(m) "/upsquad.test.v1.EchoService/" m
#define RESP_DESC (&upsquad__test__v1__echo_response__descriptor)
typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

static rpc_server *srv;
static rpc_channel *ch;

/* sends until the client goes, setting a status between messages (as a handler that records
 * its latest failure would) */
static int busy_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)req, (void)ud;
    EchoResponse m = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
    for (int i = 0; i < 100000; i++) {
        m.seq = i;
        if (rpc_stream_send(call, &m.base) != RPC_OK) break;
        rpc_error(call, RPC_ABORTED, "attempt %d failed", i);
    }
    return RPC_OK;
}

static int setup(void **state) {
    (void)state;
    char err[256], target[64];
    rpc_server_opts o = {.addr = "127.0.0.1:0", .stream_queue = 4};
    rpc_method m = {PATH("PublicStream"),
                    RPC_SERVER_STREAM,
                    RPC_AUTH_NONE,
                    &upsquad__test__v1__echo_request__descriptor,
                    RESP_DESC,
                    NULL,
                    busy_stream};
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

static void test_cancel_while_handler_sets_status(void **state) {
    (void)state;
    metric *cancelled =
        metrics_counter("rpc_server_handled_total", "",
                        "method=\"/upsquad.test.v1.EchoService/PublicStream\",code=\"ABORTED\"");
    double before = metric_value(cancelled);
    for (int round = 0; round < 20; round++) {
        EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
        rpc_reader *r = NULL;
        rpc_call_opts o = {.timeout_ms = 5000};
        assert_int_equal(rpc_stream_open(ch, PATH("PublicStream"), &req.base, RESP_DESC, &o, &r),
                         RPC_OK);
        for (int i = 0; i < 5; i++) {
            ProtobufCMessage *m = NULL;
            assert_int_equal(rpc_reader_next(r, &m), 1);
            protobuf_c_message_free_unpacked(m, NULL);
        }
        rpc_reader_cancel(r);
        assert_int_equal(rpc_reader_close(r, NULL), RPC_CANCELLED);
    }
    /* each stream is counted once, with the status its handler had set when the client left
     * (the server learns it on its own schedule: wait, bounded) */
    for (int i = 0; i < 500 && metric_value(cancelled) < before + 20; i++)
        usleep(2000);
    assert_true(metric_value(cancelled) == before + 20);
}

/* A client that cancels the moment it has sent its request: the server's close completion may
 * be taken by one queue thread before another has dispatched the stream. Before the fix that
 * close was lost (the stream state did not exist yet): the stream was never closed, the
 * detached stream's on_close never ran, and its owner and the call leaked (found by stream-hub's
 * churn test: subscribers left behind after their clients had gone). Every detached stream must
 * see its on_close. */
static atomic_int detached, closed;

static void early_on_close(rpc_call *call, void *ud) {
    (void)ud;
    atomic_fetch_add(&closed, 1);
    rpc_call_unref(call);
}

static int detaching_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)req, (void)ud;
    if (rpc_stream_detach(call, early_on_close, NULL) == NULL) return RPC_CANCELLED;
    atomic_fetch_add(&detached, 1);
    return RPC_EDETACHED;
}

static void test_cancel_at_once_still_closes_a_detached_stream(void **state) {
    (void)state;
    char err[256], target[64];
    rpc_server *s2 = NULL;
    rpc_server_opts o = {.addr = "127.0.0.1:0", .unary_threads = 4, .stream_queue = 4};
    rpc_method m = {PATH("PublicStream"),
                    RPC_SERVER_STREAM,
                    RPC_AUTH_NONE,
                    &upsquad__test__v1__echo_request__descriptor,
                    RESP_DESC,
                    NULL,
                    detaching_stream};
    assert_int_equal(rpc_server_new(&o, &s2, err, sizeof err), 0);
    assert_int_equal(rpc_server_add(s2, &m, 1), 0);
    assert_int_equal(rpc_server_start(s2, err, sizeof err), 0);
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(s2));
    /* the C core's client directly: the request goes out and the call is cancelled at once,
     * without waiting for anything from the server */
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_channel_credentials *cr = grpc_insecure_credentials_create();
    grpc_channel *gch = grpc_channel_create(target, cr, NULL);
    grpc_channel_credentials_release(cr);
    grpc_slice method = grpc_slice_from_static_string(PATH("PublicStream"));
    for (int round = 0; round < 400; round++) {
        grpc_call *call = grpc_channel_create_call(gch, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method,
                                                   NULL, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        grpc_slice empty = grpc_empty_slice();
        grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&empty, 1);
        grpc_op ops[3];
        memset(ops, 0, sizeof ops);
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[1].op = GRPC_OP_SEND_MESSAGE;
        ops[1].data.send_message.send_message = bb;
        ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        assert_int_equal(grpc_call_start_batch(call, ops, 3, (void *)1, NULL), GRPC_CALL_OK);
        if (round % 4) usleep((useconds_t)(round % 7) * 100); /* vary the moment */
        grpc_call_cancel(call, NULL);
        grpc_completion_queue_pluck(cq, (void *)1, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        grpc_byte_buffer_destroy(bb);
        grpc_call_unref(call);
    }
    /* the server learns of each cancel on its own schedule: wait, bounded */
    for (int i = 0; i < 1000 && atomic_load(&closed) < atomic_load(&detached); i++)
        usleep(5000);
    int d = atomic_load(&detached), c = atomic_load(&closed);
    if (c != d) fprintf(stderr, "%d detached streams, %d closed\n", d, c);
    assert_int_equal(c, d);
    grpc_channel_destroy(gch);
    grpc_completion_queue_shutdown(cq);
    grpc_completion_queue_destroy(cq);
    rpc_server_shutdown(s2, 1000);
    rpc_server_free(s2);
}

int main(void) {
    log_init("test_rpc_stream_race", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cancel_while_handler_sets_status),
        cmocka_unit_test(test_cancel_at_once_still_closes_a_detached_stream),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
