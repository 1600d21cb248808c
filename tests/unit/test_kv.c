/* libcommon/kv against the Redis server of the test runtime (UPSQUAD_REDIS_URL). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "kv.h"
#include "log.h"

static const char *g_url;
static char g_prefix[48];

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static const char *key(const char *name) {
    static char buf[4][128];
    static int next;
    char *k = buf[next++ % 4];
    snprintf(k, 128, "%s:%s", g_prefix, name);
    return k;
}

static kv *must_connect(int timeout_ms) {
    kv *k = NULL;
    char err[256] = "";
    int rc = kv_connect(g_url, timeout_ms, &k, err, sizeof err);
    if (rc != KV_OK) print_error("connect: %s\n", err);
    assert_int_equal(rc, KV_OK);
    return k;
}

static long long integer(kv *k, const char *fmt, const char *arg) {
    redisReply *r = NULL;
    int rc = kv_command(k, &r, fmt, arg);
    if (rc != KV_OK) print_error("%s: %s\n", fmt, kv_errstr(k));
    assert_int_equal(rc, KV_OK);
    assert_int_equal(r->type, REDIS_REPLY_INTEGER);
    long long v = r->integer;
    freeReplyObject(r);
    return v;
}

static void test_url_and_connect_errors(void **state) {
    (void)state;
    kv *k = NULL;
    char err[256];
    const char *bad[] = {"ftp://127.0.0.1:1", "redis://",      "redis://h:0",
                         "redis://h:70000",   "redis://h:1/x", "redis://secret@h:1",
                         "redis://h:1?x"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(kv_connect(bad[i], 100, &k, err, sizeof err), KV_EINVAL);
        assert_null(k);
    }
    assert_null(strstr(err, "secret"));
    assert_int_equal(kv_connect(g_url, 0, &k, err, sizeof err), KV_EINVAL);
    /* nothing listens on port 1 */
    assert_int_equal(kv_connect("redis://127.0.0.1:1", 500, &k, err, sizeof err), KV_EIO);
    assert_non_null(strstr(err, "127.0.0.1:1"));
    /* a wrong password is refused by the server, not hidden */
    char url[160];
    snprintf(url, sizeof url, "redis://:nope@%s", g_url + strlen("redis://"));
    assert_int_equal(kv_connect(url, 500, &k, err, sizeof err), KV_EREPLY);
    assert_non_null(strstr(err, "AUTH"));

    /* /db selects a database: a key written there is not visible in db 0 */
    snprintf(url, sizeof url, "%s/3", g_url);
    assert_int_equal(kv_connect(url, 500, &k, err, sizeof err), KV_OK);
    kv *k0 = must_connect(500);
    assert_int_equal(kv_set_ttl(k, key("db3"), "x", 1, 5000), KV_OK);
    char *v = NULL;
    int found = -1;
    assert_int_equal(kv_get(k0, key("db3"), &v, NULL, &found), KV_OK);
    assert_int_equal(found, 0);
    assert_int_equal(kv_get(k, key("db3"), &v, NULL, &found), KV_OK);
    assert_int_equal(found, 1);
    free(v);
    assert_int_equal(kv_del(k, key("db3"), NULL), KV_OK);
    kv_close(k);
    kv_close(k0);
}

static void test_commands(void **state) {
    (void)state;
    kv *k = must_connect(1000);
    const char bin[5] = {'a', 0, 'b', 0, 'c'};
    assert_int_equal(kv_command(k, NULL, "SET %s %b", key("bin"), bin, sizeof bin), KV_OK);
    char *v = NULL;
    size_t len = 0;
    int found = 0;
    assert_int_equal(kv_get(k, key("bin"), &v, &len, &found), KV_OK);
    assert_int_equal(found, 1);
    assert_int_equal(len, 5);
    assert_memory_equal(v, bin, 5);
    free(v);

    /* an error reply is reported with Redis' message, and the connection stays usable */
    redisReply *r = (redisReply *)1;
    assert_int_equal(kv_command(k, &r, "INCR %s", key("bin")), KV_EREPLY);
    assert_null(r);
    assert_non_null(strstr(kv_errstr(k), "not an integer"));
    const char *argv[] = {"SET", key("argv"), "hello world"};
    assert_int_equal(kv_commandargv(k, NULL, 3, argv, NULL), KV_OK);
    assert_int_equal(kv_get(k, key("argv"), &v, &len, &found), KV_OK);
    assert_string_equal(v, "hello world");
    free(v);
    assert_int_equal(kv_commandargv(k, NULL, 0, argv, NULL), KV_EINVAL);

    int deleted = 0;
    assert_int_equal(kv_del(k, key("bin"), &deleted), KV_OK);
    assert_int_equal(deleted, 1);
    assert_int_equal(kv_del(k, key("bin"), &deleted), KV_OK);
    assert_int_equal(deleted, 0);
    assert_int_equal(kv_del(k, key("argv"), NULL), KV_OK);
    assert_int_equal(kv_get(k, key("bin"), &v, &len, &found), KV_OK);
    assert_int_equal(found, 0);
    assert_null(v);
    assert_int_equal(kv_set_ttl(k, key("x"), "v", 1, 0), KV_EINVAL);
    kv_close(k);
}

static void test_ttl_windows(void **state) {
    (void)state;
    kv *k = must_connect(1000);
    char *v = NULL;
    int found = 0;
    assert_int_equal(kv_set_ttl(k, key("live"), "worker-1", 8, 150), KV_OK);
    long long pttl = integer(k, "PTTL %s", key("live"));
    assert_true(pttl > 0 && pttl <= 150);
    assert_int_equal(kv_get(k, key("live"), &v, NULL, &found), KV_OK);
    assert_int_equal(found, 1);
    free(v);
    sleep_ms(300);
    assert_int_equal(kv_get(k, key("live"), &v, NULL, &found), KV_OK);
    assert_int_equal(found, 0);

    /* de-duplication window: first sighting, duplicate, window over */
    int set = -1;
    assert_int_equal(kv_set_nx_ttl(k, key("dedup"), "1", 1, 200, &set), KV_OK);
    assert_int_equal(set, 1);
    assert_int_equal(kv_set_nx_ttl(k, key("dedup"), "2", 1, 200, &set), KV_OK);
    assert_int_equal(set, 0);
    assert_int_equal(kv_get(k, key("dedup"), &v, NULL, &found), KV_OK);
    assert_string_equal(v, "1");
    free(v);
    sleep_ms(300);
    assert_int_equal(kv_set_nx_ttl(k, key("dedup"), "3", 1, 200, &set), KV_OK);
    assert_int_equal(set, 1);

    /* fixed-window counter: counts within the window, restarts after it */
    long long n = 0;
    for (int i = 1; i <= 3; i++) {
        assert_int_equal(kv_incr_window(k, key("rate"), 250, &n), KV_OK);
        assert_int_equal(n, i);
    }
    pttl = integer(k, "PTTL %s", key("rate"));
    assert_true(pttl > 0 && pttl <= 250);
    sleep_ms(350);
    assert_int_equal(kv_incr_window(k, key("rate"), 250, &n), KV_OK);
    assert_int_equal(n, 1);
    /* a counter that somehow lost its TTL gets one back */
    assert_int_equal(kv_command(k, NULL, "PERSIST %s", key("rate")), KV_OK);
    assert_int_equal(kv_incr_window(k, key("rate"), 250, &n), KV_OK);
    assert_int_equal(n, 2);
    assert_true(integer(k, "PTTL %s", key("rate")) > 0);
    assert_int_equal(kv_incr_window(k, key("rate"), 0, &n), KV_EINVAL);
    kv_close(k);
}

static void test_pipeline_1000(void **state) {
    (void)state;
    enum { N = 1000 };
    kv *k = must_connect(2000);
    redisReply *r = NULL;
    assert_int_equal(kv_pipeline_get(k, &r), KV_EINVAL);

    double t0 = now_ms();
    for (int i = 0; i < N; i++)
        assert_int_equal(kv_pipeline_append(k, "INCR %s", key("pipe")), KV_OK);
    assert_int_equal(kv_pipeline_pending(k), N);
    assert_int_equal(kv_command(k, NULL, "PING"), KV_EINVAL); /* replies still pending */
    for (int i = 1; i <= N; i++) {
        assert_int_equal(kv_pipeline_get(k, &r), KV_OK);
        assert_int_equal(r->type, REDIS_REPLY_INTEGER);
        assert_int_equal(r->integer, i); /* in order */
        freeReplyObject(r);
    }
    double piped = now_ms() - t0;
    assert_int_equal(kv_pipeline_pending(k), 0);

    t0 = now_ms();
    for (int i = 0; i < N; i++)
        assert_int_equal(kv_command(k, NULL, "INCR %s", key("seq")), KV_OK);
    double sequential = now_ms() - t0;
    print_message("      pipelined %d INCR in %.1f ms, sequential in %.1f ms\n", N, piped,
                  sequential);

    /* an error reply in the middle does not disturb the replies around it */
    const char *argv[] = {"HSET", key("pipe"), "f", "v"}; /* WRONGTYPE: pipe is a string */
    assert_int_equal(kv_pipeline_append(k, "GET %s", key("pipe")), KV_OK);
    assert_int_equal(kv_pipeline_appendargv(k, 4, argv, NULL), KV_OK);
    assert_int_equal(kv_pipeline_append(k, "DEL %s %s", key("pipe"), key("seq")), KV_OK);
    assert_int_equal(kv_pipeline_get(k, &r), KV_OK);
    assert_string_equal(r->str, "1000");
    freeReplyObject(r);
    assert_int_equal(kv_pipeline_get(k, &r), KV_EREPLY);
    assert_non_null(strstr(kv_errstr(k), "WRONGTYPE"));
    assert_int_equal(kv_pipeline_get(k, &r), KV_OK);
    assert_int_equal(r->integer, 2);
    freeReplyObject(r);
    kv_close(k);
}

static long long client_id(kv *k) {
    redisReply *r = NULL;
    assert_int_equal(kv_command(k, &r, "CLIENT ID"), KV_OK);
    long long id = r->integer;
    freeReplyObject(r);
    return id;
}

/* Kills k's connection from another one. CLIENT KILL ID (rather than TYPE normal) leaves
 * the other clients of the shared test server alone. */
static void kill_client(kv *killer, long long id) {
    char ids[32];
    snprintf(ids, sizeof ids, "%lld", id);
    redisReply *r = NULL;
    assert_int_equal(kv_command(killer, &r, "CLIENT KILL ID %s", ids), KV_OK);
    assert_int_equal(r->integer, 1);
    freeReplyObject(r);
}

static void test_reconnect_after_kill(void **state) {
    (void)state;
    kv *k = must_connect(1000), *killer = must_connect(1000);
    assert_int_equal(kv_set_ttl(k, key("rk"), "kept", 4, 10000), KV_OK);

    /* an idempotent command is retried once on a fresh connection */
    long long id1 = client_id(k);
    kill_client(killer, id1);
    char *v = NULL;
    int found = 0;
    assert_int_equal(kv_get(k, key("rk"), &v, NULL, &found), KV_OK);
    assert_string_equal(v, "kept");
    free(v);
    long long id2 = client_id(k);
    assert_true(id2 != id1);

    /* a non-idempotent one fails; the next call reconnects */
    kill_client(killer, id2);
    long long n = 0;
    assert_int_equal(kv_incr_window(k, key("rk-count"), 10000, &n), KV_EIO);
    assert_true(strlen(kv_errstr(k)) > 0);
    assert_int_equal(kv_incr_window(k, key("rk-count"), 10000, &n), KV_OK);
    assert_true(n >= 1);

    /* a pipeline cut short loses its pending replies, and the kv stays usable */
    kill_client(killer, client_id(k));
    assert_int_equal(kv_pipeline_append(k, "GET %s", key("rk")), KV_OK);
    assert_int_equal(kv_pipeline_append(k, "GET %s", key("rk")), KV_OK);
    redisReply *r = NULL;
    assert_int_equal(kv_pipeline_get(k, &r), KV_EIO);
    assert_int_equal(kv_pipeline_pending(k), 0);
    assert_int_equal(kv_command(k, NULL, "PING"), KV_OK);

    assert_int_equal(kv_command(k, NULL, "DEL %s %s", key("rk"), key("rk-count")), KV_OK);
    kv_close(k);
    kv_close(killer);
}

/* Every command is bounded by the kv's timeout; the connection is replaced afterwards. */
static void test_command_timeout(void **state) {
    (void)state;
    kv *k = must_connect(200);
    double t0 = now_ms();
    assert_int_equal(kv_command(k, NULL, "BLPOP %s 2", key("never")), KV_EIO);
    double waited = now_ms() - t0;
    assert_true(waited >= 150 && waited < 1500);
    assert_int_equal(kv_command(k, NULL, "PING"), KV_OK);
    kv_close(k);
}

int main(void) {
    g_url = getenv("UPSQUAD_REDIS_URL");
    if (!g_url || !*g_url) {
        printf("SKIP test_kv: UPSQUAD_REDIS_URL is not set\n");
        return 0;
    }
    log_init("test_kv", LOG_ERROR);
    snprintf(g_prefix, sizeof g_prefix, "t:kv:%d:%ld", (int)getpid(), (long)time(NULL));
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_url_and_connect_errors),
        cmocka_unit_test(test_commands),
        cmocka_unit_test(test_ttl_windows),
        cmocka_unit_test(test_pipeline_1000),
        cmocka_unit_test(test_reconnect_after_kill),
        cmocka_unit_test(test_command_timeout),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
