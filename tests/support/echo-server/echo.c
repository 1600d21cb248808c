/* Handlers of upsquad.test.v1.EchoService (tests/proto/upsquad/test/v1/echo.proto). */
#include "echo.h"

#include <string.h>
#include <time.h>

#include "upsquad/test/v1/echo.pb-c.h"

typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

#define ECHO_MAX_PAYLOAD (1 << 20)
#define ECHO_MAX_COUNT 10000000

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
    nanosleep(&ts, NULL);
}

static int check(rpc_call *call, const EchoRequest *r) {
    if (r->payload_bytes < 0 || r->payload_bytes > ECHO_MAX_PAYLOAD)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "payload_bytes: must be in 0..%d",
                         ECHO_MAX_PAYLOAD);
    if (r->count < 0 || r->count > ECHO_MAX_COUNT)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "count: must be in 0..%d", ECHO_MAX_COUNT);
    if (r->delay_ms < 0 || r->delay_ms > 60000)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "delay_ms: must be in 0..60000");
    if (r->fail_code != 0) {
        if (r->fail_code < 1 || r->fail_code > 16)
            return rpc_error(call, RPC_INVALID_ARGUMENT, "fail_code: must be in 1..16");
        Upsquad__Test__V1__EchoError e = UPSQUAD__TEST__V1__ECHO_ERROR__INIT;
        e.field = "text";
        e.reason = r->text;
        rpc_error_detail(call, &e.base);
        return rpc_error(call, r->fail_code, "failing as asked: %s", r->text);
    }
    return RPC_OK;
}

static void fill(rpc_call *call, const EchoRequest *r, EchoResponse *out, int seq) {
    const auth_identity *id = rpc_identity(call);
    out->text = r->text;
    out->seq = seq;
    out->sub = id ? (char *)id->sub : "";
    out->org_id = id ? (char *)id->org_id : "";
    out->meta = r->meta; /* borrowed: both live in the call arena */
    if (r->cut_text_bytes > 0 && r->text && strlen(r->text) > (size_t)r->cut_text_bytes)
        out->text = rpc_strndup(call, r->text, (size_t)r->cut_text_bytes);
    if (r->payload_bytes > 0) {
        out->payload.data = rpc_alloc(call, (size_t)r->payload_bytes);
        out->payload.len = out->payload.data ? (size_t)r->payload_bytes : 0;
    }
}

static int echo_unary(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                      void *ud) {
    const EchoRequest *r = (const EchoRequest *)req;
    (void)ud;
    int rc = check(call, r);
    if (rc != RPC_OK) return rc;
    /* sleep in slices so a cancelled or expired call stops early */
    for (int left = r->delay_ms; left > 0 && !rpc_cancelled(call); left -= 10)
        sleep_ms(left < 10 ? left : 10);
    if (rpc_cancelled(call)) return rpc_error(call, RPC_CANCELLED, "cancelled");
    fill(call, r, (EchoResponse *)resp, 0);
    return RPC_OK;
}

static int echo_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    const EchoRequest *r = (const EchoRequest *)req;
    EchoResponse out = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
    (void)ud;
    int rc = check(call, r);
    if (rc != RPC_OK) return rc;
    fill(call, r, &out, 0);
    for (int i = 0; i < r->count; i++) {
        out.seq = i;
        if (r->delay_ms > 0) sleep_ms(r->delay_ms);
        /* blocks while the client is slower than us; fails once it is gone */
        if (rpc_stream_send(call, &out.base) != RPC_OK)
            return rpc_error(call, RPC_CANCELLED, "client went away after %d messages", i);
    }
    return RPC_OK;
}

#define DESC(x) &upsquad__test__v1__echo_##x##__descriptor
#define PATH(m) "/upsquad.test.v1.EchoService/" m

static const rpc_field_limit limits[] = {{"tags", 10}};

static const rpc_method methods[] = {
    {PATH("Echo"), RPC_UNARY, RPC_AUTH_REQUIRED, DESC(request), DESC(response), echo_unary, NULL,
     NULL, limits, 1},
    {PATH("Stream"), RPC_SERVER_STREAM, RPC_AUTH_REQUIRED, DESC(request), DESC(response), NULL,
     echo_stream, NULL, limits, 1},
    {PATH("PublicEcho"), RPC_UNARY, RPC_AUTH_NONE, DESC(request), DESC(response), echo_unary, NULL,
     NULL, limits, 1},
    {PATH("PublicStream"), RPC_SERVER_STREAM, RPC_AUTH_NONE, DESC(request), DESC(response), NULL,
     echo_stream, NULL, limits, 1},
};

int echo_register(rpc_server *srv) {
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
