/* JSON-lines logger (libcommon/log.c): every line parses as JSON with the documented fields,
 * levels gate, msg is escaped and cut at 4 KiB on a character boundary, trace ids are
 * per thread, and concurrent writers never interleave inside a line. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <pthread.h>

#include <cmocka.h>

#include <cjson/cJSON.h>

#include "log.h"

/* ---- stderr capture into a temporary file ---- */

static FILE *cap_file;
static int cap_saved = -1;

static void cap_begin(void) {
    fflush(stderr);
    cap_file = tmpfile();
    assert_non_null(cap_file);
    cap_saved = dup(STDERR_FILENO);
    assert_true(dup2(fileno(cap_file), STDERR_FILENO) >= 0);
}

/* Returns everything written since cap_begin; caller frees. */
static char *cap_end(void) {
    assert_true(dup2(cap_saved, STDERR_FILENO) >= 0);
    close(cap_saved);
    fseek(cap_file, 0, SEEK_END);
    long n = ftell(cap_file);
    rewind(cap_file);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    assert_int_equal(fread(s, 1, (size_t)n, cap_file), (size_t)n);
    s[n] = '\0';
    fclose(cap_file);
    return s;
}

static size_t count_lines(const char *s) {
    size_t n = 0;
    for (; *s; s++)
        n += *s == '\n';
    return n;
}

/* Parses the single line in s (which must end with exactly one newline). */
static cJSON *one_line(const char *s) {
    size_t len = strlen(s);
    assert_true(len > 0);
    assert_int_equal(s[len - 1], '\n');
    assert_int_equal(count_lines(s), 1);
    cJSON *j = cJSON_ParseWithLength(s, len - 1);
    assert_non_null(j);
    return j;
}

static const char *str(const cJSON *j, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(j, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int setup(void **state) {
    (void)state;
    log_init("test-svc", LOG_DEBUG);
    log_set_trace(NULL);
    return 0;
}

/* ---- tests ---- */

static void test_fields(void **state) {
    (void)state;
    time_t before = time(NULL);
    cap_begin();
    log_info("rpc.done", "took %d ms for %s", 5, "ListModels");
    char *out = cap_end();
    cJSON *j = one_line(out);
    assert_string_equal(str(j, "level"), "info");
    assert_string_equal(str(j, "svc"), "test-svc");
    assert_string_equal(str(j, "event"), "rpc.done");
    assert_string_equal(str(j, "msg"), "took 5 ms for ListModels");
    assert_null(cJSON_GetObjectItem(j, "trace_id"));
    /* ISO-8601 UTC with milliseconds, close to now. */
    const char *ts = str(j, "ts");
    assert_non_null(ts);
    assert_int_equal(strlen(ts), 24);
    struct tm tm = {0};
    const char *rest = strptime(ts, "%Y-%m-%dT%H:%M:%S", &tm);
    assert_non_null(rest);
    assert_true(rest[0] == '.' && rest[4] == 'Z');
    time_t t = timegm(&tm);
    assert_true(t >= before - 1 && t <= time(NULL) + 1);
    /* Field order is fixed: ts first, msg last. */
    assert_true(strncmp(out, "{\"ts\":\"", 7) == 0);
    assert_non_null(strstr(out, "\"msg\":\"took 5 ms for ListModels\"}\n"));
    cJSON_Delete(j);
    free(out);
}

static void test_levels(void **state) {
    (void)state;
    log_init("test-svc", LOG_WARN);
    cap_begin();
    log_debug("a", "x");
    log_info("b", "x");
    log_write(LOG_INFO, "c", "direct calls are gated too");
    log_warn("d", "x");
    log_error("e", "x");
    char *out = cap_end();
    assert_int_equal(count_lines(out), 2);
    assert_non_null(strstr(out, "\"level\":\"warn\",\"svc\":\"test-svc\",\"event\":\"d\""));
    assert_non_null(strstr(out, "\"level\":\"error\",\"svc\":\"test-svc\",\"event\":\"e\""));
    free(out);

    log_init("test-svc", LOG_OFF);
    cap_begin();
    log_error("e", "x");
    out = cap_end();
    assert_string_equal(out, "");
    free(out);

    log_init("test-svc", 99); /* out of range: info */
    assert_int_equal(log__level, LOG_INFO);

    assert_int_equal(log_level_parse("debug"), LOG_DEBUG);
    assert_int_equal(log_level_parse("INFO"), LOG_INFO);
    assert_int_equal(log_level_parse("warn"), LOG_WARN);
    assert_int_equal(log_level_parse("warning"), LOG_WARN);
    assert_int_equal(log_level_parse("Error"), LOG_ERROR);
    assert_int_equal(log_level_parse("off"), LOG_OFF);
    assert_int_equal(log_level_parse("verbose"), -1);
    assert_int_equal(log_level_parse(""), -1);
    assert_int_equal(log_level_parse(NULL), -1);

    setenv("UPSQUAD_LOG_LEVEL", "error", 1);
    assert_int_equal(log_init_env("env-svc"), 0);
    assert_int_equal(log__level, LOG_ERROR);
    setenv("UPSQUAD_LOG_LEVEL", "chatty", 1);
    assert_int_equal(log_init_env("env-svc"), -1);
    assert_int_equal(log__level, LOG_INFO);
    unsetenv("UPSQUAD_LOG_LEVEL");
    assert_int_equal(log_init_env("env-svc"), 0);
    assert_int_equal(log__level, LOG_INFO);
    log_init("test-svc", LOG_DEBUG);
}

static void test_escaping(void **state) {
    (void)state;
    const char *msg = "q\"b\\s/n\nr\rt\tc\x01"
                      "d\x7f"
                      "e\xc3\xa9 j\xe6\x97\xa5 "
                      "f\xf0\x9f\x98\x80 bad\xff\xc3 end";
    const char *want = "q\"b\\s/n\nr\rt\tc\x01"
                       "d\x7f"
                       "e\xc3\xa9 j\xe6\x97\xa5 "
                       "f\xf0\x9f\x98\x80 bad\xef\xbf\xbd\xef\xbf\xbd end";
    cap_begin();
    log_info("ev\"il\n", "%s", msg);
    char *out = cap_end();
    cJSON *j = one_line(out);
    assert_string_equal(str(j, "msg"), want);
    assert_string_equal(str(j, "event"), "ev\"il\n");
    /* Controls are escaped in the raw line, never written raw. */
    assert_non_null(strstr(out, "\\u0001"));
    assert_non_null(strstr(out, "\\u007f"));
    for (const char *p = out; *p; p++)
        if (p[1]) assert_true((unsigned char)*p >= 0x20);
    cJSON_Delete(j);
    free(out);
}

static void check_truncated(const char *out, const char *unit) {
    size_t len = strlen(out);
    assert_true(len <= 4096);
    assert_true(len > 3500);
    cJSON *j = one_line(out);
    const char *m = str(j, "msg");
    size_t ml = strlen(m), ul = strlen(unit);
    assert_true(ml > 3 && strcmp(m + ml - 3, "\xe2\x80\xa6") == 0);
    /* Everything before the ellipsis is whole units: no character was cut in half. */
    assert_int_equal((ml - 3) % ul, 0);
    for (size_t i = 0; i + 3 < ml; i += ul)
        assert_memory_equal(m + i, unit, ul);
    cJSON_Delete(j);
}

static void test_truncation(void **state) {
    (void)state;
    char big[12000];
    const char *units[] = {"a", "\xc3\xa9", "\xf0\x9f\x98\x80", "\"", "\x01"};
    for (size_t u = 0; u < sizeof units / sizeof units[0]; u++) {
        size_t ul = strlen(units[u]), n = 0;
        while (n + ul < sizeof big - 1) {
            memcpy(big + n, units[u], ul);
            n += ul;
        }
        big[n] = '\0';
        cap_begin();
        log_info("big", "%s", big);
        char *out = cap_end();
        check_truncated(out, units[u]);
        free(out);
    }
    /* A message that fits is not marked. */
    cap_begin();
    log_info("small", "%s", "fits");
    char *out = cap_end();
    assert_null(strstr(out, "\xe2\x80\xa6"));
    free(out);
}

static void *trace_thread(void *arg) {
    (void)arg;
    assert_null(log_get_trace()); /* a new thread starts without one */
    log_set_trace("trace-thread");
    log_info("t", "from thread");
    return NULL;
}

static void test_trace(void **state) {
    (void)state;
    pthread_t th;
    log_set_trace("trace-main");
    cap_begin();
    assert_int_equal(pthread_create(&th, NULL, trace_thread, NULL), 0);
    pthread_join(th, NULL);
    log_info("m", "from main");
    char *out = cap_end();
    assert_int_equal(count_lines(out), 2);
    char *second = strchr(out, '\n') + 1;
    cJSON *a = cJSON_ParseWithLength(out, (size_t)(second - out - 1));
    cJSON *b = cJSON_ParseWithLength(second, strlen(second) - 1);
    assert_string_equal(str(a, "trace_id"), "trace-thread");
    assert_string_equal(str(b, "trace_id"), "trace-main");
    assert_string_equal(log_get_trace(), "trace-main");
    cJSON_Delete(a);
    cJSON_Delete(b);
    free(out);

    char longid[100];
    memset(longid, 'x', 99);
    longid[99] = '\0';
    log_set_trace(longid);
    assert_int_equal(strlen(log_get_trace()), 64);
    log_set_trace(NULL);
    assert_null(log_get_trace());
    cap_begin();
    log_info("m", "none");
    out = cap_end();
    assert_null(strstr(out, "trace_id"));
    free(out);
}

/* Ids are fields of their own, per thread, escaped, and cleared. */
static void test_ids(void **state) {
    (void)state;
    log_set_trace(NULL);
    log_set_id(LOG_ID_ORG, "org-1");
    log_set_id(LOG_ID_RUN, "run-\"2");
    log_set_id(LOG_ID_SESSION, NULL);
    log_set_id(LOG_ID_N, "ignored");
    cap_begin();
    log_info("m", "with ids");
    log_clear_ids();
    log_info("m", "without");
    char *out = cap_end();
    assert_int_equal(count_lines(out), 2);
    char *second = strchr(out, '\n') + 1;
    cJSON *a = cJSON_ParseWithLength(out, (size_t)(second - out - 1));
    cJSON *b = cJSON_ParseWithLength(second, strlen(second) - 1);
    assert_non_null(a);
    assert_string_equal(str(a, "org_id"), "org-1");
    assert_string_equal(str(a, "run_id"), "run-\"2");
    assert_null(cJSON_GetObjectItemCaseSensitive(a, "session_id"));
    assert_string_equal(str(a, "msg"), "with ids");
    assert_null(cJSON_GetObjectItemCaseSensitive(b, "org_id"));
    assert_null(log_get_id(LOG_ID_RUN));
    cJSON_Delete(a);
    cJSON_Delete(b);
    free(out);
}

/* Several threads write near-maximal lines into one pipe; the reader must see only whole,
 * parseable lines. */
#define AT_THREADS 4
#define AT_LINES 200

static void *atomic_writer(void *arg) {
    char msg[3600];
    memset(msg, 'a' + (int)(intptr_t)arg, sizeof msg - 1);
    msg[sizeof msg - 1] = '\0';
    for (int i = 0; i < AT_LINES; i++)
        log_info("atomic", "%d %s", i, msg);
    return NULL;
}

typedef struct {
    int fd;
    char *buf;
    size_t len, cap;
} pipe_reader;

static void *reader_main(void *arg) {
    pipe_reader *r = arg;
    for (;;) {
        if (r->len + 65536 > r->cap) {
            r->cap = (r->cap + 65536) * 2;
            r->buf = realloc(r->buf, r->cap);
        }
        ssize_t n = read(r->fd, r->buf + r->len, 65536);
        if (n <= 0) break;
        r->len += (size_t)n;
    }
    return NULL;
}

static void test_atomic_lines(void **state) {
    (void)state;
    int p[2];
    pthread_t w[AT_THREADS], rd;
    pipe_reader r = {0};
    assert_int_equal(pipe(p), 0);
    r.fd = p[0];
    int saved = dup(STDERR_FILENO);
    dup2(p[1], STDERR_FILENO);
    close(p[1]);
    assert_int_equal(pthread_create(&rd, NULL, reader_main, &r), 0);
    for (intptr_t i = 0; i < AT_THREADS; i++)
        pthread_create(&w[i], NULL, atomic_writer, (void *)i);
    for (int i = 0; i < AT_THREADS; i++)
        pthread_join(w[i], NULL);
    dup2(saved, STDERR_FILENO); /* closes the last write end: the reader sees EOF */
    close(saved);
    pthread_join(rd, NULL);
    close(p[0]);

    size_t lines = 0;
    for (char *s = r.buf, *end = r.buf + r.len; s < end;) {
        char *nl = memchr(s, '\n', (size_t)(end - s));
        assert_non_null(nl);
        cJSON *j = cJSON_ParseWithLength(s, (size_t)(nl - s));
        assert_non_null(j);
        const char *m = str(j, "msg");
        char c = strchr(m, ' ')[1];
        /* One writer's bytes only. */
        for (const char *q = strchr(m, ' ') + 1; *q; q++)
            assert_int_equal(*q, c);
        cJSON_Delete(j);
        lines++;
        s = nl + 1;
    }
    assert_int_equal(lines, AT_THREADS * AT_LINES);
    free(r.buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_fields, setup),
        cmocka_unit_test_setup(test_levels, setup),
        cmocka_unit_test_setup(test_escaping, setup),
        cmocka_unit_test_setup(test_truncation, setup),
        cmocka_unit_test_setup(test_trace, setup),
        cmocka_unit_test_setup(test_ids, setup),
        cmocka_unit_test_setup(test_atomic_lines, setup),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
