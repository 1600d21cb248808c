/* Prometheus metrics (libcommon/metrics.c): exact exposition text, registry identity and
 * refusals, exact totals under contention, process metrics, and the HTTP endpoint fetched
 * over loopback with a plain socket. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <errno.h>
#include <dirent.h>
#include <pthread.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <cmocka.h>

#include "log.h"
#include "metrics.h"

static int reset(void **state) {
    (void)state;
    log_init("test-metrics", LOG_OFF); /* refusals log; keep the test output clean */
    metrics_reset();
    return 0;
}

static char *render(void) {
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(metrics_render(&out, &len), 0);
    assert_int_equal(strlen(out), len);
    return out;
}

static size_t count(const char *hay, const char *needle) {
    size_t n = 0;
    for (const char *p = hay; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

/* ---- exposition ---- */

static void test_render_exact(void **state) {
    (void)state;
    static const double bounds[] = {0.125, 0.5, 1};
    metric *ok =
        metrics_counter("t_requests_total", "Requests handled.", "method=\"/a.B/C\",code=\"OK\"");
    metric *nf = metrics_counter("t_requests_total", "ignored: first help wins",
                                 "method=\"/a.B/C\",code=\"NOT_FOUND\"");
    metric *g = metrics_gauge("t_inflight", "In-flight calls.", NULL);
    metric *h = metrics_histogram("t_latency_seconds", "Latency.\nSecond \\ line.",
                                  "method=\"/a.B/C\"", bounds, 3);
    assert_non_null(ok);
    assert_non_null(nf);
    assert_non_null(g);
    assert_non_null(h);
    metric_inc(ok);
    metric_inc(ok);
    metric_inc(ok);
    metric_add(ok, 0.5);
    metric_add(ok, -10); /* counters never go down */
    metric_inc(nf);
    metric_set(g, 7);
    metric_add(g, -2);
    metric_observe(h, 0.0625);
    metric_observe(h, 0.125); /* le is inclusive */
    metric_observe(h, 0.25);
    metric_observe(h, 2);
    static const char want[] = "# HELP t_requests_total Requests handled.\n"
                               "# TYPE t_requests_total counter\n"
                               "t_requests_total{method=\"/a.B/C\",code=\"OK\"} 3.5\n"
                               "t_requests_total{method=\"/a.B/C\",code=\"NOT_FOUND\"} 1\n"
                               "# HELP t_inflight In-flight calls.\n"
                               "# TYPE t_inflight gauge\n"
                               "t_inflight 5\n"
                               "# HELP t_latency_seconds Latency.\\nSecond \\\\ line.\n"
                               "# TYPE t_latency_seconds histogram\n"
                               "t_latency_seconds_bucket{method=\"/a.B/C\",le=\"0.125\"} 2\n"
                               "t_latency_seconds_bucket{method=\"/a.B/C\",le=\"0.5\"} 3\n"
                               "t_latency_seconds_bucket{method=\"/a.B/C\",le=\"1\"} 3\n"
                               "t_latency_seconds_bucket{method=\"/a.B/C\",le=\"+Inf\"} 4\n"
                               "t_latency_seconds_sum{method=\"/a.B/C\"} 2.4375\n"
                               "t_latency_seconds_count{method=\"/a.B/C\"} 4\n";
    char *out = render();
    if (strncmp(out, want, sizeof want - 1) != 0) print_error("rendered:\n%s\n", out);
    assert_true(strncmp(out, want, sizeof want - 1) == 0);
    /* Process metrics follow, each with one HELP/TYPE. */
    assert_true(strncmp(out + sizeof want - 1, "# HELP process_", 15) == 0);
    assert_int_equal(count(out, "# TYPE t_requests_total "), 1);
    assert_int_equal(count(out, "# TYPE process_resident_memory_bytes gauge\n"), 1);
    free(out);
}

static void test_histogram_unlabelled_and_defaults(void **state) {
    (void)state;
    metric *h = metrics_histogram("t_default_seconds", "d", NULL, NULL, 0);
    assert_non_null(h);
    metric_observe(h, 0.00390625);
    metric_observe(h, 100);
    metric_observe(h, 0.0 / 0.0); /* NaN ignored */
    char *out = render();
    static const char *const les[] = {"0.0005", "0.001", "0.0025", "0.005", "0.01",
                                      "0.025",  "0.05",  "0.1",    "0.25",  "0.5",
                                      "1",      "2.5",   "5",      "10",    "+Inf"};
    for (size_t i = 0; i < 15; i++) {
        char line[96];
        snprintf(line, sizeof line, "t_default_seconds_bucket{le=\"%s\"} %d\n", les[i],
                 i < 3 ? 0 : (i < 14 ? 1 : 2));
        assert_non_null(strstr(out, line));
    }
    assert_int_equal(count(out, "t_default_seconds_bucket"), 15);
    assert_non_null(strstr(out, "t_default_seconds_sum 100.00390625\n"));
    assert_non_null(strstr(out, "t_default_seconds_count 2\n"));
    free(out);
}

static void test_registry_rules(void **state) {
    (void)state;
    metric *a = metrics_counter("t_c_total", "c", "k=\"1\"");
    assert_ptr_equal(metrics_counter("t_c_total", "c", "k=\"1\""), a);
    assert_ptr_not_equal(metrics_counter("t_c_total", "c", "k=\"2\""), a);
    assert_ptr_not_equal(metrics_counter("t_c_total", "c", NULL), a);
    assert_ptr_equal(metrics_counter("t_c_total", "c", ""),
                     metrics_counter("t_c_total", "c", NULL));
    /* Same name, other type: refused (NULL), and NULL is a safe no-op everywhere. */
    metric *bad = metrics_gauge("t_c_total", "c", "k=\"1\"");
    assert_null(bad);
    assert_null(metrics_gauge("t_c_total", "c", "k=\"3\""));
    metric_inc(bad);
    metric_add(bad, 1);
    metric_set(bad, 1);
    metric_observe(bad, 1);
    assert_true(metric_value(bad) == 0);
    /* Invalid names and buckets. */
    assert_null(metrics_counter("9starts_with_digit", "x", NULL));
    assert_null(metrics_counter("has-dash", "x", NULL));
    assert_null(metrics_counter("", "x", NULL));
    assert_null(metrics_counter("t_nl", "x", "a=\"1\"\nb=\"2\""));
    static const double unsorted[] = {1, 0.5}, dup[] = {1, 1}, inf[] = {1, 1.0 / 0.0};
    assert_null(metrics_histogram("t_h1", "h", NULL, unsorted, 2));
    assert_null(metrics_histogram("t_h2", "h", NULL, dup, 2));
    assert_null(metrics_histogram("t_h3", "h", NULL, inf, 2));
    static const double b1[] = {1, 2}, b2[] = {1, 3};
    assert_non_null(metrics_histogram("t_h4", "h", "x=\"1\"", b1, 2));
    assert_null(metrics_histogram("t_h4", "h", "x=\"2\"", b2, 2)); /* buckets differ */
    assert_non_null(metrics_histogram("t_h4", "h", "x=\"2\"", b1, 2));
    /* Operations of another type are ignored. */
    metric *g = metrics_gauge("t_g", "g", NULL);
    metric_observe(g, 5);
    metric_inc(g);
    metric_inc(g);
    assert_true(metric_value(g) == 2);
    metric_set(a, 100); /* set is for gauges only */
    metric_inc(a);
    assert_true(metric_value(a) == 1);
    /* Nothing of the refused registrations is rendered. */
    char *out = render();
    assert_null(strstr(out, "t_h1"));
    assert_null(strstr(out, "has-dash"));
    assert_int_equal(count(out, "# TYPE t_c_total counter\n"), 1);
    free(out);
}

static void test_series_limit(void **state) {
    (void)state;
    char labels[32];
    for (int i = 0; i < METRICS_MAX_SERIES; i++) {
        snprintf(labels, sizeof labels, "i=\"%d\"", i);
        assert_non_null(metrics_counter("t_many_total", "many", labels));
    }
    assert_null(metrics_counter("t_many_total", "many", "i=\"overflow\""));
    assert_null(metrics_gauge("t_other", "other", NULL));
    /* Existing series are still found. */
    assert_non_null(metrics_counter("t_many_total", "many", "i=\"9999\""));
    char *out = render();
    assert_int_equal(count(out, "\nt_many_total{"), METRICS_MAX_SERIES);
    free(out);
}

static void test_label_escape(void **state) {
    (void)state;
    char out[64];
    assert_int_equal(metrics_label_escape("a\"b\\c\nd", out, sizeof out), 10);
    assert_string_equal(out, "a\\\"b\\\\c\\nd");
    char small[4];
    assert_int_equal(metrics_label_escape("ab\"cd", small, sizeof small), 6);
    assert_string_equal(small, "ab"); /* never half an escape */
    assert_int_equal(metrics_label_escape("xyz", NULL, 0), 3);
}

/* ---- concurrency ---- */

#define THREADS 4
#define PER_THREAD 100000

static metric *shared_counter, *shared_gauge, *shared_hist;

static void *hammer(void *arg) {
    (void)arg;
    /* Registration races too: every thread looks the same series up. */
    metric *c = metrics_counter("t_race_total", "race", "x=\"y\"");
    assert_ptr_equal(c, shared_counter);
    for (int i = 0; i < PER_THREAD; i++) {
        metric_inc(c);
        metric_add(c, 0.5);
        metric_add(shared_gauge, 1);
        metric_observe(shared_hist, (i & 1) ? 0.25 : 4);
    }
    return NULL;
}

static void test_concurrency(void **state) {
    (void)state;
    static const double b[] = {1};
    pthread_t th[THREADS];
    shared_counter = metrics_counter("t_race_total", "race", "x=\"y\"");
    shared_gauge = metrics_gauge("t_race_gauge", "race", NULL);
    shared_hist = metrics_histogram("t_race_seconds", "race", NULL, b, 1);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int i = 0; i < THREADS; i++)
        pthread_create(&th[i], NULL, hammer, NULL);
    for (int i = 0; i < THREADS; i++)
        pthread_join(th[i], NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (double)(t1.tv_sec - t0.tv_sec) * 1e9 + (double)(t1.tv_nsec - t0.tv_nsec);
    print_message("4 threads x 100k x (inc + add + gauge add + observe): %.1f ns per op\n",
                  ns / (THREADS * (double)PER_THREAD * 4) * THREADS);
    /* 0.5 steps are exact in binary floating point: the totals must be exact. */
    assert_true(metric_value(shared_counter) == THREADS * PER_THREAD * 1.5);
    assert_true(metric_value(shared_gauge) == THREADS * PER_THREAD);
    char *out = render();
    assert_non_null(strstr(out, "t_race_total{x=\"y\"} 600000\n"));
    assert_non_null(strstr(out, "t_race_gauge 400000\n"));
    assert_non_null(strstr(out, "t_race_seconds_bucket{le=\"1\"} 200000\n"));
    assert_non_null(strstr(out, "t_race_seconds_bucket{le=\"+Inf\"} 400000\n"));
    assert_non_null(strstr(out, "t_race_seconds_count 400000\n"));
    assert_non_null(strstr(out, "t_race_seconds_sum 850000\n"));
    free(out);
}

/* ---- process metrics ---- */

static double sample(const char *out, const char *name) {
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr(out, key);
    assert_non_null(p);
    return strtod(p + strlen(key), NULL);
}

static int open_fds(void) {
    int n = 0;
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n - 1;
}

static void test_process_metrics(void **state) {
    (void)state;
    char *out = render();
    double rss = sample(out, "process_resident_memory_bytes");
    double start = sample(out, "process_start_time_seconds");
    double fds = sample(out, "process_open_fds");
    double now = (double)time(NULL);
    assert_true(rss > 100 * 1024 && rss < 4e9);
    assert_true(sample(out, "process_virtual_memory_bytes") >= rss);
    assert_true(start > now - 600 && start <= now + 1);
    assert_int_equal((int)fds, open_fds());
    assert_true(sample(out, "process_max_fds") >= fds);
    assert_true(sample(out, "process_cpu_seconds_total") >= 0);
    assert_non_null(strstr(out, "# TYPE process_cpu_seconds_total counter\n"));
    free(out);
}

/* ---- HTTP ---- */

/* One request over a fresh loopback connection; returns the whole response. */
static char *http(int port, const char *request) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return NULL;
    }
    assert_int_equal(write(fd, request, strlen(request)), (ssize_t)strlen(request));
    size_t len = 0, cap = 65536;
    char *buf = malloc(cap);
    for (;;) {
        if (len + 4096 > cap) buf = realloc(buf, cap *= 2);
        ssize_t n = read(fd, buf + len, cap - len - 1);
        if (n <= 0) break;
        len += (size_t)n;
    }
    buf[len] = '\0';
    close(fd);
    return buf;
}

static void test_http(void **state) {
    (void)state;
    char err[256];
    int fds_before = open_fds();
    metric *c = metrics_counter("t_http_total", "HTTP test.", "path=\"/x\"");
    metric_add(c, 41);
    metric_inc(c);
    assert_int_equal(metrics_serve("127.0.0.1:0", err, sizeof err), 0);
    int port = metrics_port();
    assert_true(port > 0);
    assert_int_equal(metrics_serve("127.0.0.1:0", err, sizeof err), -1);
    assert_non_null(strstr(err, "already running"));

    char *r = http(port, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n");
    assert_non_null(r);
    assert_true(strncmp(r, "HTTP/1.1 200", 12) == 0);
    assert_non_null(
        strcasestr(r, "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"));
    const char *body = strstr(r, "\r\n\r\n") + 4;
    const char *want = "# HELP t_http_total HTTP test.\n# TYPE t_http_total counter\n"
                       "t_http_total{path=\"/x\"} 42\n";
    assert_true(strncmp(body, want, strlen(want)) == 0);
    assert_non_null(strstr(body, "process_open_fds "));
    free(r);

    r = http(port, "GET /healthz HTTP/1.0\r\n\r\n");
    assert_true(strncmp(r, "HTTP/1.0 200", 12) == 0 || strncmp(r, "HTTP/1.1 200", 12) == 0);
    assert_string_equal(strstr(r, "\r\n\r\n") + 4, "ok");
    free(r);

    r = http(port, "GET /nope HTTP/1.0\r\n\r\n");
    assert_non_null(strstr(r, " 404 "));
    free(r);
    r = http(port, "POST /metrics HTTP/1.0\r\nContent-Length: 0\r\n\r\n");
    assert_non_null(strstr(r, " 405 "));
    assert_non_null(strcasestr(r, "\r\nAllow: GET, HEAD\r\n"));
    free(r);

    metrics_stop();
    assert_int_equal(metrics_port(), 0);
    assert_null(http(port, "GET /metrics HTTP/1.0\r\n\r\n"));
    assert_int_equal(open_fds(), fds_before); /* the listening socket was closed */
    metrics_stop();                           /* idempotent */
}

static void test_http_bad_addresses(void **state) {
    (void)state;
    char err[256];
    const char *bad[] = {"", "9101", "127.0.0.1:99999", "127.0.0.1:x", "[::1:80", "[::1]80"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        assert_int_equal(metrics_serve(bad[i], err, sizeof err), -1);
        assert_true(strlen(err) > 0);
    }
    /* A port already taken is reported as such. */
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 1), 0);
    socklen_t sl = sizeof a;
    getsockname(fd, (struct sockaddr *)&a, &sl);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", ntohs(a.sin_port));
    assert_int_equal(metrics_serve(addr, err, sizeof err), -1);
    assert_non_null(strstr(err, strerror(EADDRINUSE)));
    close(fd);
    assert_int_equal(metrics_port(), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_render_exact, reset),
        cmocka_unit_test_setup(test_histogram_unlabelled_and_defaults, reset),
        cmocka_unit_test_setup(test_registry_rules, reset),
        cmocka_unit_test_setup(test_series_limit, reset),
        cmocka_unit_test_setup(test_label_escape, reset),
        cmocka_unit_test_setup(test_concurrency, reset),
        cmocka_unit_test_setup(test_process_metrics, reset),
        cmocka_unit_test_setup(test_http, reset),
        cmocka_unit_test_setup(test_http_bad_addresses, reset),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    metrics_reset();
    return rc;
}
