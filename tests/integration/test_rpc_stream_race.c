/* A stream's status is written by its handler (rpc_error, the value it returns) while the
 * close completion of a client that cancels reads and writes it on a queue thread. Both go
 * through the stream's lock: under `make tsan` this test fails on a race otherwise (before the
 * fix: rpc_error and on_close touched c->code/c->message without it). In other builds it
 * checks that a cancelled stream ends CANCELLED and is counted once. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
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

int main(void) {
    log_init("test_rpc_stream_race", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cancel_while_handler_sets_status),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
