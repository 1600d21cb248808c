/* libcommon's RPC client against libcommon's server (tests/support/echo-server), over real
 * gRPC on loopback: unary calls, tokens, deadlines, status details, long streams,
 * cancellation, round-robin over two servers, TLS and mTLS. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../lib/testproc.h"
#include "auth.h"
#include "google/rpc/status.pb-c.h"
#include "rpc.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define SECRET "client-test-secret-0123456789abcdefghij"
#define PATH(m) "/upsquad.test.v1.EchoService/" m

typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;
#define RESP_DESC (&upsquad__test__v1__echo_response__descriptor)

static char bin[512];
static testproc srv;
static rpc_channel *ch;
static char *token;

static char *mint(const char *secret, const char *sub, const char *org) {
    auth_signer *s = NULL;
    char err[200], *tok = NULL;
    assert_int_equal(auth_signer_new("HS256", secret, &s, err, sizeof err), AUTH_OK);
    auth_claims c = {
        .sub = sub, .org_id = org, .audience = "upsquad", .clearance = 2, .ttl_s = 600};
    assert_int_equal(auth_mint(s, &c, &tok, err, sizeof err), AUTH_OK);
    auth_signer_free(s);
    return tok;
}

static rpc_channel *channel_to(const char *target, int rr) {
    rpc_channel *c = NULL;
    char err[200];
    rpc_channel_opts o = {.target = target, .round_robin = rr};
    assert_int_equal(rpc_channel_new(&o, &c, err, sizeof err), 0);
    return c;
}

static int setup(void **state) {
    (void)state;
    const char *b = getenv("BUILD");
    snprintf(bin, sizeof bin, "%s/bin/echo-server", b ? b : "build");
    static const char *env[] = {"UPSQUAD_JWT_SECRET=" SECRET, NULL};
    if (testproc_start(&srv, bin, env) != 0) return -1;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", srv.port);
    ch = channel_to(target, 0);
    token = mint(SECRET, "member-1", "org-1");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    rpc_channel_free(ch);
    free(token);
    return testproc_stop(&srv) == 0 ? 0 : -1;
}

static int echo(rpc_channel *c, const char *method, EchoRequest *req, const rpc_call_opts *o,
                EchoResponse **resp, rpc_status *st) {
    return rpc_unary_call(c, method, &req->base, RESP_DESC, o, (ProtobufCMessage **)resp, st);
}

static void test_unary_with_identity(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    rpc_status st;
    req.text = "grüße";
    req.payload_bytes = 70000;
    rpc_call_opts o = {.timeout_ms = 5000, .bearer = token, .trace_id = "trace-abc"};
    assert_int_equal(echo(ch, PATH("Echo"), &req, &o, &resp, &st), RPC_OK);
    assert_string_equal(resp->text, "grüße");
    assert_string_equal(resp->sub, "member-1");
    assert_string_equal(resp->org_id, "org-1");
    assert_int_equal(resp->payload.len, 70000);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    rpc_status_clear(&st);
}

static void test_tokens_refused(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    rpc_status st;
    char *forged = mint("another-secret-entirely-xxxxxxxx", "member-1", "org-1");
    rpc_call_opts none = {.timeout_ms = 5000};
    rpc_call_opts bad = {.timeout_ms = 5000, .bearer = forged};
    assert_int_equal(echo(ch, PATH("Echo"), &req, &none, &resp, &st), RPC_UNAUTHENTICATED);
    assert_null(resp);
    assert_string_equal(st.message, "missing bearer token");
    rpc_status_clear(&st);
    assert_int_equal(echo(ch, PATH("Echo"), &req, &bad, &resp, &st), RPC_UNAUTHENTICATED);
    assert_non_null(strstr(st.message, "invalid token"));
    rpc_status_clear(&st);
    free(forged);
}

static void test_deadline(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    req.delay_ms = 3000;
    rpc_call_opts o = {.timeout_ms = 200, .bearer = token};
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    assert_int_equal(echo(ch, PATH("Echo"), &req, &o, &resp, NULL), RPC_DEADLINE_EXCEEDED);
    clock_gettime(CLOCK_MONOTONIC, &b);
    /* well before the 3 s the handler would take: the deadline cut it short */
    assert_true((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000 < 2500);
}

static void test_status_details(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    rpc_status st;
    req.text = "why";
    req.fail_code = RPC_NOT_FOUND;
    assert_int_equal(echo(ch, PATH("PublicEcho"), &req, NULL, &resp, &st), RPC_NOT_FOUND);
    assert_non_null(st.details);
    Google__Rpc__Status *s = google__rpc__status__unpack(NULL, st.details_len, st.details);
    assert_non_null(s);
    assert_int_equal(s->code, RPC_NOT_FOUND);
    assert_string_equal(s->message, st.message);
    assert_int_equal(s->n_details, 1);
    assert_string_equal(s->details[0]->type_url, "type.googleapis.com/upsquad.test.v1.EchoError");
    Upsquad__Test__V1__EchoError *e = upsquad__test__v1__echo_error__unpack(
        NULL, s->details[0]->value.len, s->details[0]->value.data);
    assert_non_null(e);
    assert_string_equal(e->reason, "why");
    upsquad__test__v1__echo_error__free_unpacked(e, NULL);
    google__rpc__status__free_unpacked(s, NULL);
    rpc_status_clear(&st);
}

static void test_long_stream(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    rpc_reader *r = NULL;
    ProtobufCMessage *m;
    int n = 0, rc;
    req.count = 100000;
    req.text = "s";
    rpc_call_opts o = {.timeout_ms = 60000, .bearer = token};
    assert_int_equal(rpc_stream_open(ch, PATH("Stream"), &req.base, RESP_DESC, &o, &r), 0);
    while ((rc = rpc_reader_next(r, &m)) == 1) {
        if (((EchoResponse *)m)->seq != n) fail_msg("seq %d at %d", ((EchoResponse *)m)->seq, n);
        n++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    assert_int_equal(rc, 0);
    assert_int_equal(n, 100000);
    assert_int_equal(rpc_reader_close(r, NULL), RPC_OK);
}

/* A message is sent as it is produced, not held for the next one (the stream sender lets the
 * transport buffer a frame only when another is queued behind it): with 600 ms between
 * messages, each arrives about 600 ms after the previous one, long before the stream ends. */
static void test_paced_stream_not_held(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    rpc_reader *r = NULL;
    ProtobufCMessage *m;
    struct timespec t0, t;
    req.count = 3;
    req.delay_ms = 600;
    req.text = "p";
    rpc_call_opts o = {.timeout_ms = 30000, .bearer = token};
    clock_gettime(CLOCK_MONOTONIC, &t0);
    assert_int_equal(rpc_stream_open(ch, PATH("Stream"), &req.base, RESP_DESC, &o, &r), 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(rpc_reader_next(r, &m), 1);
        clock_gettime(CLOCK_MONOTONIC, &t);
        long ms = (t.tv_sec - t0.tv_sec) * 1000 + (t.tv_nsec - t0.tv_nsec) / 1000000;
        assert_int_equal(((EchoResponse *)m)->seq, i);
        /* arrives after its delay, and before the next message is produced */
        if (ms < 600 * (i + 1) - 50 || ms >= 600 * (i + 2))
            fail_msg("message %d arrived at %ld ms", i, ms);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    assert_int_equal(rpc_reader_next(r, &m), 0);
    assert_int_equal(rpc_reader_close(r, NULL), RPC_OK);
}

static void test_cancel_mid_stream(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    rpc_reader *r = NULL;
    ProtobufCMessage *m;
    req.count = 10000000;
    const char *series =
        "rpc_server_handled_total{method=\"/upsquad.test.v1.EchoService/PublicStream\","
        "code=\"CANCELLED\"}";
    double before = test_metric(srv.metrics_port, series);
    assert_int_equal(rpc_stream_open(ch, PATH("PublicStream"), &req.base, RESP_DESC, NULL, &r), 0);
    for (int i = 0; i < 500; i++) {
        assert_int_equal(rpc_reader_next(r, &m), 1);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_reader_cancel(r);
    assert_int_equal(rpc_reader_close(r, NULL), RPC_CANCELLED);
    double after = before;
    for (int i = 0; i < 150 && after <= before; i++) {
        struct timespec ts = {0, 20 * 1000000};
        nanosleep(&ts, NULL);
        after = test_metric(srv.metrics_port, series);
    }
    assert_true(after == before + 1);
}

static void test_stream_refused_without_token(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    rpc_reader *r = NULL;
    ProtobufCMessage *m = NULL;
    req.count = 5;
    assert_int_equal(rpc_stream_open(ch, PATH("Stream"), &req.base, RESP_DESC, NULL, &r), 0);
    assert_true(rpc_reader_next(r, &m) < 0);
    assert_null(m);
    assert_int_equal(rpc_reader_close(r, NULL), RPC_UNAUTHENTICATED);
}

static void rr_call(rpc_channel *ch) {
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    rpc_call_opts o = {.timeout_ms = 5000};
    assert_int_equal(echo(ch, PATH("PublicEcho"), &req, &o, &resp, NULL), RPC_OK);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
}

static void test_round_robin(void **state) {
    (void)state;
    testproc other;
    static const char *env[] = {"UPSQUAD_JWT_SECRET=" SECRET, NULL};
    assert_int_equal(testproc_start(&other, bin, env), 0);
    char target[128];
    snprintf(target, sizeof target, "ipv4:127.0.0.1:%d,127.0.0.1:%d", srv.port, other.port);
    rpc_channel *rr = channel_to(target, 1);
    const char *series = "rpc_server_handled_total{method=\"/upsquad.test.v1.EchoService/"
                         "PublicEcho\",code=\"OK\"}";
    /* round_robin picks among READY subchannels only: until the second connection is up
     * (slow under the sanitizers) every call goes to the first server. Call until the second
     * server has answered one (bounded), then count 20 calls over both connections. */
    double b_up = test_metric(other.metrics_port, series);
    for (int i = 0; i < 500 && test_metric(other.metrics_port, series) <= b_up; i++) {
        rr_call(rr);
        usleep(10 * 1000);
    }
    usleep(100 * 1000); /* the warm-up's last counts land (see below) */
    double a0 = test_metric(srv.metrics_port, series), b0 = test_metric(other.metrics_port, series);
    for (int i = 0; i < 20; i++)
        rr_call(rr);
    /* A server counts a call when its reply batch completes, which may be just after the
     * client has read the reply: wait (bounded) for the last counts. */
    double a = 0, b = 0;
    for (int tries = 0; tries < 200; tries++) {
        a = test_metric(srv.metrics_port, series) - a0;
        b = test_metric(other.metrics_port, series) - b0;
        if (a + b >= 20) break;
        usleep(10 * 1000);
    }
    assert_true(a + b == 20);
    assert_true(a >= 5 && b >= 5); /* both servers took a share */
    rpc_channel_free(rr);
    assert_int_equal(testproc_stop(&other), 0);
}

static void test_unreachable(void **state) {
    (void)state;
    rpc_channel *dead = channel_to("127.0.0.1:1", 0);
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    rpc_call_opts o = {.timeout_ms = 500};
    int rc = echo(dead, PATH("PublicEcho"), &req, &o, &resp, NULL);
    assert_true(rc == RPC_UNAVAILABLE || rc == RPC_DEADLINE_EXCEEDED);
    rpc_channel_free(dead);
}

/* TLS material made at test time with the openssl CLI; nothing is committed. */
static int make_certs(const char *dir) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "cd %s && K='-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes' && "
             "openssl req -x509 $K -keyout ca.key -out ca.pem -days 1 -subj /CN=ca && "
             "openssl req $K -keyout srv.key -out srv.csr -subj /CN=localhost && "
             "echo subjectAltName=DNS:localhost > srv.ext && "
             "openssl x509 -req -in srv.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out srv.pem -days 1 -extfile srv.ext && "
             "openssl req $K -keyout cli.key -out cli.csr -subj /CN=orchestrator && "
             "openssl x509 -req -in cli.csr -CA ca.pem -CAkey ca.key -CAcreateserial "
             "-out cli.pem -days 1",
             dir);
    strcat(cmd, " >/dev/null 2>&1");
    return system(cmd);
}

static void test_mtls(void **state) {
    (void)state;
    char dir[] = "/tmp/upsquad-ctls-XXXXXX", e1[300], e2[300], e3[300], f[4][300], target[64];
    assert_non_null(mkdtemp(dir));
    assert_int_equal(make_certs(dir), 0);
    snprintf(e1, sizeof e1, "UPSQUAD_TLS_CERT_FILE=%s/srv.pem", dir);
    snprintf(e2, sizeof e2, "UPSQUAD_TLS_KEY_FILE=%s/srv.key", dir);
    snprintf(e3, sizeof e3, "UPSQUAD_TLS_CLIENT_CA_FILE=%s/ca.pem", dir);
    const char *env[] = {"UPSQUAD_JWT_SECRET=" SECRET, e1, e2, e3, NULL};
    testproc tls;
    assert_int_equal(testproc_start(&tls, bin, env), 0);
    snprintf(target, sizeof target, "127.0.0.1:%d", tls.port);
    snprintf(f[0], sizeof f[0], "%s/ca.pem", dir);
    snprintf(f[1], sizeof f[1], "%s/cli.pem", dir);
    snprintf(f[2], sizeof f[2], "%s/cli.key", dir);
    rpc_client_tls with = {f[0], f[1], f[2], "localhost"},
                   without = {f[0], NULL, NULL, "localhost"};
    struct {
        const rpc_client_tls *tls;
        int want;
    } cases[] = {{&with, RPC_OK}, {&without, RPC_UNAVAILABLE}, {NULL, RPC_UNAVAILABLE}};
    for (size_t i = 0; i < 3; i++) {
        rpc_channel *c = NULL;
        char err[200];
        rpc_channel_opts o = {.target = target, .tls = cases[i].tls};
        assert_int_equal(rpc_channel_new(&o, &c, err, sizeof err), 0);
        EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
        EchoResponse *resp = NULL;
        rpc_call_opts co = {.timeout_ms = 3000};
        int rc = echo(c, PATH("PublicEcho"), &req, &co, &resp, NULL);
        if (rc != cases[i].want) fail_msg("case %zu: got %d want %d", i, rc, cases[i].want);
        if (resp) protobuf_c_message_free_unpacked(&resp->base, NULL);
        rpc_channel_free(c);
    }
    assert_int_equal(testproc_stop(&tls), 0);
    snprintf(f[3], sizeof f[3], "rm -rf %s", dir);
    assert_int_equal(system(f[3]), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_unary_with_identity),
        cmocka_unit_test(test_tokens_refused),
        cmocka_unit_test(test_deadline),
        cmocka_unit_test(test_status_details),
        cmocka_unit_test(test_long_stream),
        cmocka_unit_test(test_paced_stream_not_held),
        cmocka_unit_test(test_cancel_mid_stream),
        cmocka_unit_test(test_stream_refused_without_token),
        cmocka_unit_test(test_round_robin),
        cmocka_unit_test(test_unreachable),
        cmocka_unit_test(test_mtls),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
