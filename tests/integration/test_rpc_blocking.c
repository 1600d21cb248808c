/* Blocking handlers (RPC_BLOCKING) on libcommon's server, in-process, over real gRPC on
 * loopback with libcommon's client: a slow blocking handler does not stall Health/Check or an
 * inline method; a full pool answers RESOURCE_EXHAUSTED (and counts it); the call's deadline
 * reaches Postgres as the transaction's statement_timeout and cuts a pg_sleep short. */
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

#include "ctx.h"
#include "db.h"
#include "err.h"
#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "metrics.h"
#include "rpc.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define PATH(m) "/upsquad.test.v1.EchoService/" m

typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

static rpc_server *srv;
static rpc_channel *ch;
static db_pool *pool; /* NULL without Postgres */
static atomic_int entered, finished;
static atomic_int last_db_rc;
static atomic_llong last_handler_ms;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Blocking: sleeps delay_ms (leaving early when the client goes), or, for text "pg", runs
 * pg_sleep(delay_ms) in a transaction and reports the db code. */
static int slow_echo(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                     void *ud) {
    (void)ud;
    const EchoRequest *r = (const EchoRequest *)req;
    EchoResponse *out = (EchoResponse *)resp;
    int64_t t0 = now_ms();
    int code = RPC_OK;
    atomic_fetch_add(&entered, 1);
    if (strcmp(r->text, "pg") == 0 && pool) {
        char err[256], sql[64];
        db_tx *tx = NULL;
        snprintf(sql, sizeof sql, "SELECT pg_sleep(%g)", r->delay_ms / 1000.0);
        int rc = db_tx_begin(pool, NULL, &tx, err, sizeof err);
        if (rc == DB_OK) rc = db_exec(db_tx_conn(tx), sql, 0, NULL, NULL, err, sizeof err);
        db_tx_rollback(tx);
        atomic_store(&last_db_rc, rc);
        if (rc != DB_OK) code = rpc_error(call, err_to_status(rc), "%s", err);
    } else {
        while (now_ms() - t0 < r->delay_ms && !rpc_cancelled(call))
            usleep(2000);
    }
    out->text = rpc_strdup(call, r->text);
    atomic_store(&last_handler_ms, now_ms() - t0);
    atomic_fetch_add(&finished, 1);
    return code;
}

static int fast_echo(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                     void *ud) {
    (void)ud;
    const EchoRequest *r = (const EchoRequest *)req;
    ((EchoResponse *)resp)->text = rpc_strdup(call, r->text);
    if (strcmp(r->text, "error-then-ok") == 0) rpc_error(call, RPC_NOT_FOUND, "gone");
    return RPC_OK; /* even after rpc_error: the rule says the error wins */
}

static int setup(void **state) {
    (void)state;
    char err[256];
    rpc_server_opts o = {
        .addr = "127.0.0.1:0", .unary_threads = 1, .blocking_workers = 1, .blocking_queue = 1};
    rpc_method m[] = {
        {PATH("Echo"), RPC_UNARY, RPC_AUTH_NONE, &upsquad__test__v1__echo_request__descriptor,
         &upsquad__test__v1__echo_response__descriptor, slow_echo, NULL, NULL,
         .flags = RPC_BLOCKING},
        {PATH("PublicEcho"), RPC_UNARY, RPC_AUTH_NONE, &upsquad__test__v1__echo_request__descriptor,
         &upsquad__test__v1__echo_response__descriptor, fast_echo, NULL, NULL, 0},
    };
    if (rpc_server_new(&o, &srv, err, sizeof err) != 0 || rpc_server_add(srv, m, 2) != 0 ||
        rpc_server_start(srv, err, sizeof err) != 0) {
        fprintf(stderr, "server: %s\n", err);
        return -1;
    }
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, &ch, err, sizeof err) != 0) return -1;
    const char *dsn = getenv("UPSQUAD_PG_ADMIN_DSN");
    if (dsn && *dsn && db_pool_open(dsn, 2, &pool, err, sizeof err) != DB_OK) {
        fprintf(stderr, "db: %s\n", err);
        return -1;
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    rpc_channel_free(ch);
    rpc_server_shutdown(srv, 1000);
    rpc_server_free(srv);
    db_pool_close(pool);
    return 0;
}

typedef struct bg_call {
    pthread_t t;
    int delay_ms;
    const char *text;
    int64_t timeout_ms;
    int code;
} bg_call;

static int echo(const char *path, const char *text, int delay_ms, int64_t timeout_ms) {
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    req.text = (char *)text;
    req.delay_ms = delay_ms;
    rpc_call_opts o = {.timeout_ms = timeout_ms};
    int code = rpc_unary_call(ch, path, &req.base, &upsquad__test__v1__echo_response__descriptor,
                              &o, &resp, NULL);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    return code;
}

static void *bg_run(void *arg) {
    bg_call *b = arg;
    b->code = echo(PATH("Echo"), b->text, b->delay_ms, b->timeout_ms);
    return NULL;
}

static void bg_start(bg_call *b, const char *text, int delay_ms, int64_t timeout_ms) {
    b->text = text;
    b->delay_ms = delay_ms;
    b->timeout_ms = timeout_ms;
    assert_int_equal(pthread_create(&b->t, NULL, bg_run, b), 0);
}

static void wait_for(atomic_int *v, int want) {
    int64_t until = now_ms() + 5000;
    while (atomic_load(v) < want && now_ms() < until)
        usleep(2000);
    assert_true(atomic_load(v) >= want);
}

static int health_check(int64_t *ms) {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = 2000};
    int64_t t0 = now_ms();
    int code =
        rpc_unary_call(ch, "/grpc.health.v1.Health/Check", &req.base,
                       &grpc__health__v1__health_check_response__descriptor, &o, &resp, NULL);
    *ms = now_ms() - t0;
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    return code;
}

static void test_slow_handler_does_not_stall_health(void **state) {
    (void)state;
    bg_call b;
    int base = atomic_load(&entered);
    bg_start(&b, "slow", 1500, 5000);
    wait_for(&entered, base + 1); /* the only queue thread would be stuck now if it ran inline */
    int64_t ms;
    assert_int_equal(health_check(&ms), RPC_OK);
    assert_true(ms < 500);
    int64_t t0 = now_ms();
    assert_int_equal(echo(PATH("PublicEcho"), "inline", 0, 2000), RPC_OK);
    assert_true(now_ms() - t0 < 500);
    pthread_join(b.t, NULL);
    assert_int_equal(b.code, RPC_OK);
}

static void test_pool_full_is_resource_exhausted(void **state) {
    (void)state;
    metric *refused = metrics_counter("rpc_server_blocking_refused_total", "", NULL);
    metric *queued = metrics_gauge("rpc_server_blocking_queued", "", NULL);
    double refused0 = metric_value(refused);
    bg_call a, b;
    int base = atomic_load(&entered);
    bg_start(&a, "one", 1200, 5000);
    wait_for(&entered, base + 1); /* the one worker is busy */
    bg_start(&b, "two", 100, 5000);
    int64_t until = now_ms() + 3000; /* ... and the one queue slot taken */
    while (metric_value(queued) < 1 && now_ms() < until)
        usleep(2000);
    assert_true(metric_value(queued) >= 1);
    assert_int_equal(echo(PATH("Echo"), "three", 0, 2000), RPC_RESOURCE_EXHAUSTED);
    assert_true(metric_value(refused) >= refused0 + 1);
    pthread_join(a.t, NULL);
    pthread_join(b.t, NULL);
    assert_int_equal(a.code, RPC_OK);
    assert_int_equal(b.code, RPC_OK); /* the queued call still ran */
}

static void test_cancel_reaches_blocking_handler(void **state) {
    (void)state;
    int base = atomic_load(&finished);
    int64_t t0 = now_ms();
    assert_int_equal(echo(PATH("Echo"), "cut", 4000, 300), RPC_DEADLINE_EXCEEDED);
    wait_for(&finished, base + 1);
    /* rpc_cancelled() turned true at the deadline, long before the 4 s sleep */
    assert_true(now_ms() - t0 < 2500);
}

/* Before: the reply carried a response and the status NOT_FOUND at once. */
static void test_error_then_ok_is_the_error(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st;
    req.text = "error-then-ok";
    rpc_call_opts o = {.timeout_ms = 2000};
    assert_int_equal(rpc_unary_call(ch, PATH("PublicEcho"), &req.base,
                                    &upsquad__test__v1__echo_response__descriptor, &o, &resp, &st),
                     RPC_NOT_FOUND);
    assert_null(resp);
    assert_string_equal(st.message, "gone");
    rpc_status_clear(&st);
}

static void test_deadline_cuts_query(void **state) {
    (void)state;
    if (pool == NULL) {
        printf("skip: UPSQUAD_PG_ADMIN_DSN is not set\n");
        return;
    }
    int base = atomic_load(&finished);
    int64_t t0 = now_ms();
    assert_int_equal(echo(PATH("Echo"), "pg", 5000, 400), RPC_DEADLINE_EXCEEDED);
    wait_for(&finished, base + 1);
    assert_int_equal(atomic_load(&last_db_rc), DB_EDEADLINE);
    assert_true(atomic_load(&last_handler_ms) < 1500); /* not the 5 s of pg_sleep */
    assert_true(now_ms() - t0 < 2000);
}

/* The same without RPC: the thread's deadline becomes statement_timeout; the pool's own
 * timeout stays a different error. */
static void test_db_deadline_codes(void **state) {
    (void)state;
    if (pool == NULL) return;
    char err[256];
    db_tx *tx = NULL;
    ctx_set_deadline_ms(300);
    int64_t t0 = now_ms();
    assert_int_equal(db_tx_begin(pool, NULL, &tx, err, sizeof err), DB_OK);
    assert_int_equal(db_exec(db_tx_conn(tx), "SELECT pg_sleep(5)", 0, NULL, NULL, err, sizeof err),
                     DB_EDEADLINE);
    assert_true(now_ms() - t0 < 1500);
    db_tx_rollback(tx);
    /* past the deadline nothing starts */
    assert_int_equal(db_tx_begin(pool, NULL, &tx, err, sizeof err), DB_EDEADLINE);
    assert_null(tx);
    ctx_clear();
    /* without a deadline the setting is the pool's again (SET LOCAL ended with the tx) */
    assert_int_equal(db_tx_begin(pool, NULL, &tx, err, sizeof err), DB_OK);
    PGresult *res = NULL;
    assert_int_equal(
        db_exec(db_tx_conn(tx), "SHOW statement_timeout", 0, NULL, &res, err, sizeof err), DB_OK);
    assert_string_equal(PQgetvalue(res, 0, 0), "30s");
    PQclear(res);
    assert_int_equal(db_exec(db_tx_conn(tx), "SET LOCAL statement_timeout = 100", 0, NULL, NULL,
                             err, sizeof err),
                     DB_OK);
    assert_int_equal(db_exec(db_tx_conn(tx), "SELECT pg_sleep(2)", 0, NULL, NULL, err, sizeof err),
                     DB_ECANCELED);
    db_tx_rollback(tx);
    assert_int_equal(err_to_status(DB_ECANCELED), RPC_UNAVAILABLE);
    assert_int_equal(err_to_status(DB_EDEADLINE), RPC_DEADLINE_EXCEEDED);
    /* commit of no transaction is an error, not a crash */
    assert_int_equal(db_tx_commit(NULL, err, sizeof err), DB_EINVAL);
}

int main(void) {
    log_init("test_rpc_blocking", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_slow_handler_does_not_stall_health),
        cmocka_unit_test(test_pool_full_is_resource_exhausted),
        cmocka_unit_test(test_cancel_reaches_blocking_handler),
        cmocka_unit_test(test_error_then_ok_is_the_error),
        cmocka_unit_test(test_deadline_cuts_query),
        cmocka_unit_test(test_db_deadline_codes),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
