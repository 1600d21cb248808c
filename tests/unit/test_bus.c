/* libcommon/bus against the NATS server of the test runtime (UPSQUAD_NATS_URL), and against
 * a private nats-server this test starts, stops and restarts (reconnect and buffering). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>

#include <cmocka.h>

#include "bus.h"
#include "log.h"
#include "util.h"

extern char **environ;

#define MAXN 1024

static const char *g_url;
static char g_prefix[64]; /* unique per run: t.<pid>.<rand> */

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* Messages received by a callback: payloads are decimal indexes. */
typedef struct collector {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int n;
    int seen[MAXN]; /* times index i arrived */
    char last[64];
    char last_trace[72]; /* the callback thread's log trace for the last message ("" none) */
    int block_first_ms;  /* the first callback sleeps this long (slow consumer) */
} collector;

static void collector_init(collector *c) {
    memset(c, 0, sizeof *c);
    pthread_mutex_init(&c->mu, NULL);
    util_cond_init_monotonic(&c->cv);
}

static void collector_destroy(collector *c) {
    pthread_cond_destroy(&c->cv);
    pthread_mutex_destroy(&c->mu);
}

static void collect_cb(bus *b, natsMsg *m, void *ud) {
    (void)b;
    collector *c = ud;
    char buf[64];
    int len = natsMsg_GetDataLength(m);
    snprintf(buf, sizeof buf, "%.*s", len < 63 ? len : 63, natsMsg_GetData(m));
    pthread_mutex_lock(&c->mu);
    int block = c->n == 0 ? c->block_first_ms : 0;
    int i = atoi(buf);
    if (i >= 0 && i < MAXN) c->seen[i]++;
    snprintf(c->last, sizeof c->last, "%s", buf);
    snprintf(c->last_trace, sizeof c->last_trace, "%s", log_get_trace() ? log_get_trace() : "");
    c->n++;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    if (block) sleep_ms(block);
}

/* Waits until c->n >= n or timeout; returns c->n. */
static int wait_count(collector *c, int n, int timeout_ms) {
    struct timespec dl;
    util_deadline(&dl, timeout_ms);
    pthread_mutex_lock(&c->mu);
    while (c->n < n)
        if (pthread_cond_timedwait(&c->cv, &c->mu, &dl) == ETIMEDOUT) break;
    int got = c->n;
    pthread_mutex_unlock(&c->mu);
    return got;
}

static void subj(char *out, size_t len, const char *suffix) {
    snprintf(out, len, "%s.%s", g_prefix, suffix);
}

static bus *must_connect(const char *url, const bus_opts *o) {
    bus *b = NULL;
    char err[256] = "";
    int rc = bus_connect_ex(url, "test_bus", o, &b, err, sizeof err);
    if (rc != BUS_OK) print_error("connect %s: %s\n", url, err);
    assert_int_equal(rc, BUS_OK);
    return b;
}

static void publish_index(bus *b, const char *subject, int i) {
    char buf[16];
    int n = snprintf(buf, sizeof buf, "%d", i);
    assert_int_equal(bus_publish(b, subject, buf, n), BUS_OK);
}

/* ---- subjects ---- */

static void test_subject_builder(void **state) {
    (void)state;
    char s[64];
    assert_int_equal(bus_subject(s, sizeof s, "wf", "status", "org-1", "run_9", NULL), BUS_OK);
    assert_string_equal(s, "wf.status.org-1.run_9");
    assert_int_equal(bus_subject(s, sizeof s, "wf", "org.evil", NULL), BUS_EINVAL);
    assert_string_equal(s, "");
    assert_int_equal(bus_subject(s, sizeof s, "wf", "*", NULL), BUS_EINVAL);
    assert_int_equal(bus_subject(s, sizeof s, "wf", ">", NULL), BUS_EINVAL);
    assert_int_equal(bus_subject(s, sizeof s, "wf", "a b", NULL), BUS_EINVAL);
    assert_int_equal(bus_subject(s, sizeof s, "wf", "", NULL), BUS_EINVAL);
    assert_int_equal(bus_subject(s, 8, "wf", "status", NULL), BUS_EINVAL); /* 9 bytes needed */
    assert_int_equal(bus_subject(s, 10, "wf", "status", NULL), BUS_OK);
    char longtok[200];
    memset(longtok, 'x', sizeof longtok - 1);
    longtok[sizeof longtok - 1] = '\0';
    assert_int_equal(bus_subject(s, sizeof s, longtok, NULL), BUS_EINVAL);
    assert_true(bus_token_valid("a-b_c:1"));
    assert_false(bus_token_valid(NULL));
}

/* ---- core ---- */

static void test_pubsub_roundtrip(void **state) {
    (void)state;
    bus *b = must_connect(g_url, NULL);
    assert_true(bus_connected(b));
    char s[96], err[256];
    subj(s, sizeof s, "ps");
    collector c;
    collector_init(&c);
    bus_sub *sub = NULL;
    assert_int_equal(bus_subscribe(b, s, NULL, collect_cb, &c, &sub, err, sizeof err), BUS_OK);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);
    for (int i = 0; i < 3; i++)
        publish_index(b, s, i);
    assert_int_equal(wait_count(&c, 3, 3000), 3);
    assert_int_equal(c.seen[0] + c.seen[1] + c.seen[2], 3);
    assert_string_equal(c.last, "2"); /* one publisher, one subscriber: in order */

    /* after unsubscribe nothing more arrives, and the collector may be freed */
    bus_unsubscribe(sub);
    publish_index(b, s, 7);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);
    sleep_ms(100);
    assert_int_equal(c.n, 3);
    assert_int_equal(bus_subscribe(b, "", NULL, collect_cb, &c, &sub, err, sizeof err), BUS_EINVAL);
    assert_int_equal(bus_publish(b, NULL, "x", 1), BUS_EINVAL);
    bus_stats st;
    bus_get_stats(b, &st);
    assert_true(st.out_msgs >= 4);
    assert_true(st.in_msgs >= 3);
    bus_close(b);
    collector_destroy(&c);
}

/* The publisher's trace rides in a traceparent header and is the callback's log trace; no
 * trace, or a malformed header, and the callback has none. */
static void test_trace_travels(void **state) {
    (void)state;
    static const char *trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    bus *b = must_connect(g_url, NULL);
    char s[96], err[256];
    subj(s, sizeof s, "tr");
    collector c;
    collector_init(&c);
    bus_sub *sub = NULL;
    assert_int_equal(bus_subscribe(b, s, NULL, collect_cb, &c, &sub, err, sizeof err), BUS_OK);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);
    log_set_trace(trace);
    publish_index(b, s, 1);
    assert_int_equal(wait_count(&c, 1, 3000), 1);
    assert_string_equal(c.last_trace, trace);
    log_set_trace("not-a-w3c-trace"); /* an x-request-id of the caller's: not sent on */
    publish_index(b, s, 2);
    assert_int_equal(wait_count(&c, 2, 3000), 2);
    assert_string_equal(c.last_trace, "");
    log_set_trace(NULL);
    natsConnection *raw = NULL; /* a publisher that is not ours sends a forged header */
    natsMsg *m = NULL;
    assert_int_equal(natsConnection_ConnectTo(&raw, g_url), NATS_OK);
    assert_int_equal(natsMsg_Create(&m, s, NULL, "3", 1), NATS_OK);
    assert_int_equal(natsMsgHeader_Set(m, "traceparent", "00-zz\"}{-x-01"), NATS_OK);
    assert_int_equal(natsConnection_PublishMsg(raw, m), NATS_OK);
    assert_int_equal(natsConnection_FlushTimeout(raw, 2000), NATS_OK);
    natsMsg_Destroy(m);
    natsConnection_Destroy(raw);
    assert_int_equal(wait_count(&c, 3, 3000), 3);
    assert_string_equal(c.last_trace, "");
    publish_index(b, s, 4); /* the callback thread kept nothing from the first message */
    assert_int_equal(wait_count(&c, 4, 3000), 4);
    assert_string_equal(c.last_trace, "");
    bus_unsubscribe(sub);
    bus_close(b);
    collector_destroy(&c);
}

static void test_queue_group_split(void **state) {
    (void)state;
    enum { N = 400 };
    bus *b1 = must_connect(g_url, NULL), *b2 = must_connect(g_url, NULL);
    bus *pub = must_connect(g_url, NULL);
    char s[96], err[256];
    subj(s, sizeof s, "qg");
    collector c1, c2, all;
    collector_init(&c1);
    collector_init(&c2);
    collector_init(&all);
    bus_sub *s1 = NULL, *s2 = NULL, *s3 = NULL;
    assert_int_equal(bus_subscribe(b1, s, "workers", collect_cb, &c1, &s1, err, sizeof err),
                     BUS_OK);
    assert_int_equal(bus_subscribe(b2, s, "workers", collect_cb, &c2, &s2, err, sizeof err),
                     BUS_OK);
    assert_int_equal(bus_subscribe(pub, s, NULL, collect_cb, &all, &s3, err, sizeof err), BUS_OK);
    assert_int_equal(bus_flush(b1, 2000), BUS_OK);
    assert_int_equal(bus_flush(b2, 2000), BUS_OK);
    assert_int_equal(bus_flush(pub, 2000), BUS_OK);
    for (int i = 0; i < N; i++)
        publish_index(pub, s, i);
    assert_int_equal(bus_flush(pub, 2000), BUS_OK);

    /* the plain subscriber gets everything; the group members share it */
    assert_int_equal(wait_count(&all, N, 5000), N);
    double t0 = now_ms();
    while (c1.n + c2.n < N && now_ms() - t0 < 5000)
        sleep_ms(10);
    sleep_ms(100); /* a duplicate would show up here */
    assert_int_equal(c1.n + c2.n, N);
    assert_true(c1.n > 0);
    assert_true(c2.n > 0);
    for (int i = 0; i < N; i++)
        assert_int_equal(c1.seen[i] + c2.seen[i], 1);
    bus_unsubscribe(s1);
    bus_unsubscribe(s2);
    bus_unsubscribe(s3);
    bus_close(b1);
    bus_close(b2);
    bus_close(pub);
    collector_destroy(&c1);
    collector_destroy(&c2);
    collector_destroy(&all);
}

static void echo_cb(bus *b, natsMsg *m, void *ud) {
    (void)ud;
    char buf[128];
    int n = snprintf(buf, sizeof buf, "pong:%.*s", natsMsg_GetDataLength(m), natsMsg_GetData(m));
    bus_respond(b, m, buf, n);
}

static void silent_cb(bus *b, natsMsg *m, void *ud) {
    (void)b;
    (void)m;
    (void)ud;
}

static void test_request_reply(void **state) {
    (void)state;
    bus *b = must_connect(g_url, NULL);
    char s[96], quiet[96], nobody[96], err[256];
    subj(s, sizeof s, "echo");
    subj(quiet, sizeof quiet, "quiet");
    subj(nobody, sizeof nobody, "nobody");
    bus_sub *e = NULL, *q = NULL;
    assert_int_equal(bus_subscribe(b, s, "echoers", echo_cb, NULL, &e, err, sizeof err), BUS_OK);
    assert_int_equal(bus_subscribe(b, quiet, NULL, silent_cb, NULL, &q, err, sizeof err), BUS_OK);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);

    natsMsg *reply = NULL;
    assert_int_equal(bus_request(b, s, "ping", 4, 2000, &reply), BUS_OK);
    assert_int_equal(natsMsg_GetDataLength(reply), 9);
    assert_memory_equal(natsMsg_GetData(reply), "pong:ping", 9);
    natsMsg_Destroy(reply);

    double t0 = now_ms();
    assert_int_equal(bus_request(b, quiet, "x", 1, 300, &reply), BUS_ETIMEOUT);
    double waited = now_ms() - t0;
    assert_null(reply);
    assert_true(waited >= 250 && waited < 2000);

    t0 = now_ms();
    assert_int_equal(bus_request(b, nobody, "x", 1, 3000, &reply), BUS_ENORESP);
    assert_true(now_ms() - t0 < 1000); /* told at once, not after the timeout */
    assert_int_equal(bus_respond(b, NULL, "x", 1), BUS_EINVAL);
    bus_unsubscribe(e);
    bus_unsubscribe(q);
    bus_close(b);
}

/* A subscriber that cannot keep up loses messages beyond its bound; others are unaffected. */
static void test_slow_consumer_bounded(void **state) {
    (void)state;
    bus_opts o;
    bus_opts_default(&o);
    o.sub_pending_msgs = 20;
    bus *b = must_connect(g_url, &o);
    bus *pub = must_connect(g_url, NULL);
    char s[96], err[256];
    subj(s, sizeof s, "slow");
    collector slow;
    collector_init(&slow);
    slow.block_first_ms = 500;
    bus_sub *sub = NULL;
    assert_int_equal(bus_subscribe(b, s, NULL, collect_cb, &slow, &sub, err, sizeof err), BUS_OK);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);
    for (int i = 0; i < 300; i++)
        publish_index(pub, s, i);
    assert_int_equal(bus_flush(pub, 2000), BUS_OK);
    sleep_ms(800);
    int got = wait_count(&slow, 300, 300);
    int64_t dropped = bus_sub_dropped(sub);
    assert_true(got < 300);
    assert_true(dropped > 0);
    assert_int_equal(got + dropped, 300);
    bus_stats st;
    bus_get_stats(b, &st);
    assert_true(st.slow_consumer_events >= 1);
    bus_unsubscribe(sub);
    bus_close(b);
    bus_close(pub);
    collector_destroy(&slow);
}

/* ---- JetStream ---- */

static void stream_name(char *out, size_t len, const char *what) {
    snprintf(out, len, "T_%s_%d", what, (int)getpid());
}

static const bus_stream_limits *test_limits(void) {
    static bus_stream_limits l;
    bus_stream_limits_default(&l);
    l.max_bytes = 1 << 20;
    l.memory = 1;
    return &l;
}

/* Runs after all tests, failed or not: the test streams never outlive the run. */
static int js_cleanup(void **state) {
    (void)state;
    bus *b = NULL;
    char err[256], name[64];
    if (bus_connect(g_url, "test_bus_cleanup", &b, err, sizeof err) != BUS_OK) return -1;
    const char *what[] = {"DEDUP", "WORK"};
    for (int i = 0; i < 2; i++) {
        stream_name(name, sizeof name, what[i]);
        bus_js_stream_delete(b, name, err, sizeof err);
    }
    bus_close(b);
    return 0;
}

static void test_js_dedup(void **state) {
    (void)state;
    bus *b = must_connect(g_url, NULL);
    char name[64], subjects[96], s[96], err[256];
    stream_name(name, sizeof name, "DEDUP");
    snprintf(subjects, sizeof subjects, "%s.dedup.>", g_prefix);
    const char *subs[] = {subjects};
    int rc = bus_js_stream_ensure(b, name, subs, 1, BUS_RETENTION_LIMITS, 3600, test_limits(), err,
                                  sizeof err);
    if (rc != BUS_OK) print_error("%s\n", err);
    assert_int_equal(rc, BUS_OK);
    /* ensuring again (another replica starting) is harmless; a changed max age is applied */
    assert_int_equal(bus_js_stream_ensure(b, name, subs, 1, BUS_RETENTION_LIMITS, 7200,
                                          test_limits(), err, sizeof err),
                     BUS_OK);

    subj(s, sizeof s, "dedup.a");
    int dup = -1;
    assert_int_equal(bus_js_publish(b, s, "one", 3, "m-1", &dup, err, sizeof err), BUS_OK);
    assert_int_equal(dup, 0);
    assert_int_equal(bus_js_publish(b, s, "one again", 9, "m-1", &dup, err, sizeof err), BUS_OK);
    assert_int_equal(dup, 1);
    assert_int_equal(bus_js_publish(b, s, "two", 3, "m-2", &dup, err, sizeof err), BUS_OK);
    assert_int_equal(dup, 0);
    assert_int_equal(bus_js_publish(b, s, "no id", 5, NULL, &dup, err, sizeof err), BUS_OK);
    assert_int_equal(bus_js_publish(b, s, "no id", 5, NULL, &dup, err, sizeof err), BUS_OK);
    assert_int_equal(dup, 0);
    uint64_t msgs = 0;
    assert_int_equal(bus_js_stream_msgs(b, name, &msgs, err, sizeof err), BUS_OK);
    assert_int_equal(msgs, 4);

    char none[96];
    subj(none, sizeof none, "no_stream_here");
    assert_int_equal(bus_js_publish(b, none, "x", 1, NULL, NULL, err, sizeof err), BUS_ENORESP);
    assert_non_null(strstr(err, "no stream"));
    assert_int_equal(bus_js_stream_ensure(b, "bad.name", subs, 1, 0, 0, NULL, err, sizeof err),
                     BUS_EINVAL);
    assert_int_equal(bus_js_stream_delete(b, name, err, sizeof err), BUS_OK);
    assert_int_equal(bus_js_stream_delete(b, name, err, sizeof err), BUS_OK);
    bus_close(b);
}

static natsMsg *fetch_one(bus_pull *p, int timeout_ms) {
    natsMsgList l;
    char err[256];
    int rc = bus_js_fetch(p, 1, timeout_ms, &l, err, sizeof err);
    if (rc != BUS_OK) print_error("fetch: %s\n", err);
    assert_int_equal(rc, BUS_OK);
    if (l.Count == 0) {
        natsMsgList_Destroy(&l);
        return NULL;
    }
    natsMsg *m = l.Msgs[0];
    l.Msgs[0] = NULL; /* ours now */
    natsMsgList_Destroy(&l);
    return m;
}

static int msg_is(natsMsg *m, const char *text) {
    return m && natsMsg_GetDataLength(m) == (int)strlen(text) &&
           memcmp(natsMsg_GetData(m), text, strlen(text)) == 0;
}

static void test_js_pull_ack_redelivery(void **state) {
    (void)state;
    bus *b = must_connect(g_url, NULL);
    char name[64], subjects[96], s[96], err[256];
    stream_name(name, sizeof name, "WORK");
    snprintf(subjects, sizeof subjects, "%s.work.>", g_prefix);
    const char *subs[] = {subjects};
    assert_int_equal(bus_js_stream_ensure(b, name, subs, 1, BUS_RETENTION_WORKQUEUE, 3600,
                                          test_limits(), err, sizeof err),
                     BUS_OK);
    subj(s, sizeof s, "work.step");
    bus_pull *p = NULL;
    int rc = bus_js_pull_subscribe(b, name, "stepper", subjects, 500, 5, &p, err, sizeof err);
    if (rc != BUS_OK) print_error("%s\n", err);
    assert_int_equal(rc, BUS_OK);

    assert_int_equal(bus_js_publish(b, s, "a", 1, "a", NULL, err, sizeof err), BUS_OK);
    assert_int_equal(bus_js_publish(b, s, "b", 1, "b", NULL, err, sizeof err), BUS_OK);
    natsMsgList l;
    assert_int_equal(bus_js_fetch(p, 2, 2000, &l, err, sizeof err), BUS_OK);
    assert_int_equal(l.Count, 2);
    assert_true(msg_is(l.Msgs[0], "a"));
    assert_true(msg_is(l.Msgs[1], "b"));
    assert_int_equal(bus_delivery_count(l.Msgs[0]), 1);
    assert_int_equal(bus_ack(l.Msgs[0]), BUS_OK); /* b is left unacked */
    natsMsgList_Destroy(&l);

    /* nothing is due before ack_wait; then b (only b) comes back */
    assert_null(fetch_one(p, 150));
    natsMsg *m = fetch_one(p, 2000);
    assert_true(msg_is(m, "b"));
    assert_int_equal(bus_delivery_count(m), 2);
    assert_int_equal(bus_ack(m), BUS_OK);
    natsMsg_Destroy(m);
    sleep_ms(700);
    assert_null(fetch_one(p, 300));

    /* the consumer survives its subscriber (a restarted replica resumes it). A message the
     * server handed to the closed subscriber's last, timed-out fetch comes back after
     * ack_wait: at-least-once, so only "delivered again, one more time per nak" is certain. */
    assert_int_equal(bus_js_publish(b, s, "c", 1, "c", NULL, err, sizeof err), BUS_OK);
    bus_pull_close(p);
    assert_int_equal(
        bus_js_pull_subscribe(b, name, "stepper", subjects, 500, 5, &p, err, sizeof err), BUS_OK);
    m = fetch_one(p, 2000);
    assert_true(msg_is(m, "c"));
    int first = bus_delivery_count(m);
    assert_true(first >= 1 && first <= 2);
    assert_int_equal(bus_nak(m, 0), BUS_OK); /* redelivered at once, long before ack_wait */
    natsMsg_Destroy(m);
    m = fetch_one(p, 300);
    assert_true(msg_is(m, "c"));
    assert_int_equal(bus_delivery_count(m), first + 1);
    assert_int_equal(bus_term(m), BUS_OK); /* never again */
    natsMsg_Destroy(m);
    sleep_ms(700);
    assert_null(fetch_one(p, 300));

    /* work-queue retention: acked and terminated messages are gone from the stream */
    uint64_t msgs = 99;
    assert_int_equal(bus_js_stream_msgs(b, name, &msgs, err, sizeof err), BUS_OK);
    assert_int_equal(msgs, 0);
    assert_int_equal(bus_js_fetch(p, 0, 100, &l, err, sizeof err), BUS_EINVAL);
    bus_pull_close(p);
    assert_int_equal(bus_js_stream_delete(b, name, err, sizeof err), BUS_OK);
    bus_close(b);
}

/* ---- reconnect against a private server ---- */

typedef struct private_nats {
    pid_t pid;
    int port;
    char url[64];
} private_nats;

static int free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        if (fd >= 0) close(fd);
        return -1;
    }
    close(fd);
    return ntohs(a.sin_port);
}

static int port_open(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET,
                            .sin_port = htons((uint16_t)port),
                            .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    int ok = fd >= 0 && connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    if (fd >= 0) close(fd);
    return ok;
}

static int nats_start(private_nats *n) {
    char port[16];
    snprintf(port, sizeof port, "%d", n->port);
    char *argv[] = {"nats-server", "-a", "127.0.0.1", "-p", port, NULL};
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    int rc = posix_spawnp(&n->pid, "nats-server", &fa, NULL, argv, environ);
    posix_spawn_file_actions_destroy(&fa);
    if (rc != 0) {
        n->pid = 0;
        return -1;
    }
    for (int i = 0; i < 100; i++) {
        if (port_open(n->port)) return 0;
        sleep_ms(50);
    }
    return -1;
}

static void nats_stop(private_nats *n) {
    if (n->pid <= 0) return;
    kill(n->pid, SIGTERM);
    int st;
    for (int i = 0; i < 100; i++) {
        if (waitpid(n->pid, &st, WNOHANG) == n->pid) {
            n->pid = 0;
            return;
        }
        sleep_ms(50);
    }
    kill(n->pid, SIGKILL);
    waitpid(n->pid, &st, 0);
    n->pid = 0;
}

static int private_setup(void **state) {
    private_nats *n = calloc(1, sizeof *n);
    n->port = free_port();
    snprintf(n->url, sizeof n->url, "nats://127.0.0.1:%d", n->port);
    *state = n;
    if (n->port <= 0 || nats_start(n) != 0) {
        fprintf(stderr, "could not start a private nats-server on port %d\n", n->port);
        return -1;
    }
    return 0;
}

static int private_teardown(void **state) {
    private_nats *n = *state;
    nats_stop(n);
    free(n);
    return 0;
}

static int wait_connected(bus *b, int want, int timeout_ms) {
    double t0 = now_ms();
    while (now_ms() - t0 < timeout_ms) {
        if (bus_connected(b) == want) return 1;
        sleep_ms(20);
    }
    return 0;
}

/* Pipelined publishes: one wait for the whole batch, each message's outcome on its own (an
 * acked one, a duplicate id, a subject no stream captures, a bad message), stored in batch
 * order, each with its own trace (the thread's unless the message names one). */
#define TRACE_A "4bf92f3577b34da6a3ce929d0e0e4736"
#define TRACE_B "0af7651916cd43dd8448eb211c80319c"

/* A stream of this run's "<prefix>.<part>.>" subjects (name and subjects: 64 and 96 bytes). */
static void test_stream(bus *b, const char *tag, const char *part, int retention, char *name,
                        char *subjects) {
    char err[256];
    stream_name(name, 64, tag);
    snprintf(subjects, 96, "%s.%s.>", g_prefix, part);
    const char *subs[] = {subjects};
    int rc =
        bus_js_stream_ensure(b, name, subs, 1, retention, 3600, test_limits(), err, sizeof err);
    if (rc != BUS_OK) print_error("stream %s: %s\n", name, err);
    assert_int_equal(rc, BUS_OK);
}

static void test_js_publish_batch(void **state) {
    (void)state;
    bus *b = must_connect(g_url, NULL);
    char name[64], subjects[96], s[96], none[96], err[256];
    test_stream(b, "BATCH", "batch", BUS_RETENTION_LIMITS, name, subjects);
    subj(s, sizeof s, "batch.a");
    subj(none, sizeof none, "no_stream_for_batch");
    assert_int_equal(bus_js_publish(b, s, "0", 1, "b-0", NULL, err, sizeof err), BUS_OK);
    bus_js_msg m[6] = {
        {.subject = s, .data = "1", .len = 1, .msg_id = "b-1"},
        {.subject = s, .data = "0", .len = 1, .msg_id = "b-0"}, /* stored before: a duplicate */
        {.subject = none, .data = "x", .len = 1, .msg_id = "b-x"},
        {.subject = s, .data = NULL, .len = 3, .msg_id = "b-bad"},
        {.subject = s, .data = "2", .len = 1, .msg_id = "b-2", .trace_id = TRACE_A},
        {.subject = s, .data = "3", .len = 1, .msg_id = NULL, .trace_id = ""},
    };
    log_set_trace(TRACE_B);
    assert_int_equal(bus_js_publish_batch(b, m, 6, err, sizeof err), BUS_ENORESP);
    log_set_trace(NULL);
    assert_non_null(strstr(err, "no stream"));
    assert_int_equal(m[0].rc, BUS_OK);
    assert_int_equal(m[0].duplicate, 0);
    assert_int_equal(m[1].rc, BUS_OK);
    assert_int_equal(m[1].duplicate, 1);
    assert_int_equal(m[2].rc, BUS_ENORESP);
    assert_int_equal(m[3].rc, BUS_EINVAL);
    assert_int_equal(m[4].rc, BUS_OK);
    assert_int_equal(m[5].rc, BUS_OK);
    uint64_t msgs = 0;
    assert_int_equal(bus_js_stream_msgs(b, name, &msgs, err, sizeof err), BUS_OK);
    assert_int_equal(msgs, 4); /* 0, 1, 2, 3 */
    /* in batch order on the stream */
    bus_pull *p = NULL;
    assert_int_equal(
        bus_js_pull_subscribe(b, name, "batch", subjects, 5000, -1, &p, err, sizeof err), BUS_OK);
    natsMsgList l;
    const char *want[] = {"0", "1", "2", "3"};
    const char *traces[] = {"", TRACE_B, TRACE_A, TRACE_B};
    int got = 0;
    for (int tries = 0; got < 4 && tries < 10; tries++) {
        assert_int_equal(bus_js_fetch(p, 4 - got, 1000, &l, err, sizeof err), BUS_OK);
        for (int i = 0; i < l.Count; i++, got++) {
            char tr[33];
            assert_true(msg_is(l.Msgs[i], want[got]));
            bus_msg_trace(l.Msgs[i], tr);
            assert_string_equal(tr, traces[got]);
            bus_ack(l.Msgs[i]);
        }
        natsMsgList_Destroy(&l);
    }
    assert_int_equal(got, 4);
    bus_pull_close(p);
    /* an empty batch, and bad arguments */
    assert_int_equal(bus_js_publish_batch(b, m, 0, err, sizeof err), BUS_OK);
    assert_int_equal(bus_js_publish_batch(b, NULL, 1, err, sizeof err), BUS_EINVAL);
    assert_int_equal(bus_js_stream_delete(b, name, err, sizeof err), BUS_OK);
    bus_close(b);
}

/* A fetch returns what the consumer has without waiting out its timeout for a full batch:
 * the server keeps a waiting pull request for several messages open until it has them all,
 * and a message that came into such a fetch (of the projection's 128) sat there for up to
 * its whole timeout. */
typedef struct late_pub {
    bus *b;
    const char *subject;
    int after_ms, n;
} late_pub;

static void *publish_later(void *arg) {
    late_pub *lp = arg;
    char err[256], id[32];
    sleep_ms(lp->after_ms);
    for (int i = 0; i < lp->n; i++) {
        snprintf(id, sizeof id, "late-%d-%d", lp->after_ms, i);
        bus_js_publish(lp->b, lp->subject, "x", 1, id, NULL, err, sizeof err);
    }
    return NULL;
}

static void test_js_fetch_returns_what_it_has(void **state) {
    (void)state;
    bus *b = must_connect(g_url, NULL);
    char name[64], subjects[96], s[96], err[256], id[32];
    test_stream(b, "PROMPT", "prompt", BUS_RETENTION_WORKQUEUE, name, subjects);
    subj(s, sizeof s, "prompt.x");
    bus_pull *p = NULL;
    assert_int_equal(
        bus_js_pull_subscribe(b, name, "prompt", subjects, 5000, -1, &p, err, sizeof err), BUS_OK);
    natsMsgList l;
    /* a backlog comes in one fetch, at once */
    for (int i = 0; i < 5; i++) {
        snprintf(id, sizeof id, "backlog-%d", i);
        assert_int_equal(bus_js_publish(b, s, "x", 1, id, NULL, err, sizeof err), BUS_OK);
    }
    double t0 = now_ms();
    assert_int_equal(bus_js_fetch(p, 128, 2000, &l, err, sizeof err), BUS_OK);
    double took = now_ms() - t0;
    assert_int_equal(l.Count, 5);
    for (int i = 0; i < l.Count; i++)
        bus_ack(l.Msgs[i]);
    natsMsgList_Destroy(&l);
    if (took > 300) print_error("a backlog of 5 took %.0f ms\n", took);
    assert_true(took < 300);
    /* messages published while a fetch waits: it returns with the first ones, and the rest
     * come to the next fetch, each round far below the timeout */
    for (int round = 0; round < 10; round++) {
        late_pub lp = {b, s, 50 + round * 13, 1 + round % 3};
        pthread_t th;
        assert_int_equal(pthread_create(&th, NULL, publish_later, &lp), 0);
        int got = 0;
        t0 = now_ms();
        while (got < lp.n && now_ms() - t0 < 4000) {
            assert_int_equal(bus_js_fetch(p, 128, 2000, &l, err, sizeof err), BUS_OK);
            for (int i = 0; i < l.Count; i++, got++)
                bus_ack(l.Msgs[i]);
            natsMsgList_Destroy(&l);
        }
        took = now_ms() - t0;
        pthread_join(th, NULL);
        assert_int_equal(got, lp.n);
        if (took > lp.after_ms + 300)
            print_error("round %d: %d message(s) published after %d ms, fetched after %.0f ms\n",
                        round, lp.n, lp.after_ms, took);
        assert_true(took < lp.after_ms + 300);
    }
    bus_pull_close(p);
    assert_int_equal(bus_js_stream_delete(b, name, err, sizeof err), BUS_OK);
    bus_close(b);
}

static void test_reconnect_buffers_publishes(void **state) {
    private_nats *n = *state;
    bus_opts o;
    bus_opts_default(&o);
    o.reconnect_wait_ms = 100;
    bus *b = must_connect(n->url, &o);
    o.reconnect_buf_bytes = 1024;
    bus *small = must_connect(n->url, &o);
    char err[256];
    collector c;
    collector_init(&c);
    bus_sub *sub = NULL;
    assert_int_equal(bus_subscribe(b, "rc.test", NULL, collect_cb, &c, &sub, err, sizeof err),
                     BUS_OK);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);
    publish_index(b, "rc.test", 0);
    assert_int_equal(wait_count(&c, 1, 2000), 1);

    nats_stop(n);
    assert_true(wait_connected(b, 0, 5000));
    assert_true(wait_connected(small, 0, 5000));
    for (int i = 1; i <= 10; i++)
        publish_index(b, "rc.test", i); /* buffered */
    /* the 1 KiB reconnect buffer takes a few 300-byte publishes, then refuses */
    char chunk[300];
    memset(chunk, 'x', sizeof chunk);
    int accepted = 0, rc;
    while ((rc = bus_publish(small, "rc.other", chunk, sizeof chunk)) == BUS_OK && accepted < 100)
        accepted++;
    assert_int_equal(rc, BUS_EFULL);
    assert_true(accepted >= 1 && accepted * (int)sizeof chunk <= 1024 + 2 * (int)sizeof chunk);
    assert_int_equal(c.n, 1);

    assert_int_equal(nats_start(n), 0);
    assert_true(wait_connected(b, 1, 5000));
    /* the subscription is re-established before the buffer is flushed: all ten arrive */
    assert_int_equal(wait_count(&c, 11, 5000), 11);
    for (int i = 0; i <= 10; i++)
        assert_int_equal(c.seen[i], 1);
    bus_stats st;
    bus_get_stats(b, &st);
    assert_true(st.reconnects >= 1);
    bus_unsubscribe(sub);
    bus_close(b);
    bus_close(small);
    collector_destroy(&c);
}

/* connect_retry: a service may start before NATS and connect once it is up. */
static void test_connect_fails_fast_or_retries(void **state) {
    private_nats *n = *state;
    bus *b = NULL;
    char err[256] = "", url[64];
    snprintf(url, sizeof url, "nats://127.0.0.1:%d", free_port());
    assert_int_equal(bus_connect(url, "t", &b, err, sizeof err), BUS_ERR);
    assert_null(b);
    assert_true(strlen(err) > 0);

    bus_opts o;
    bus_opts_default(&o);
    o.connect_retry = 1;
    o.reconnect_wait_ms = 100;
    /* closing a bus that is still trying to connect returns at once */
    assert_int_equal(bus_connect_ex(url, "t", &o, &b, err, sizeof err), BUS_OK);
    assert_false(bus_connected(b));
    double t0 = now_ms();
    bus_close(b);
    assert_true(now_ms() - t0 < 1000);

    nats_stop(n);
    assert_int_equal(bus_connect_ex(n->url, "t", &o, &b, err, sizeof err), BUS_OK);
    assert_false(bus_connected(b));
    assert_int_equal(nats_start(n), 0);
    assert_true(wait_connected(b, 1, 5000));
    bus_close(b);
}

int main(void) {
    g_url = getenv("UPSQUAD_NATS_URL");
    if (!g_url || !*g_url) {
        printf("SKIP test_bus: UPSQUAD_NATS_URL is not set\n");
        return 0;
    }
    log_init("test_bus", LOG_ERROR);
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    snprintf(g_prefix, sizeof g_prefix, "t.%d.%d", (int)getpid(), rand() % 100000);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_subject_builder),
        cmocka_unit_test(test_pubsub_roundtrip),
        cmocka_unit_test(test_trace_travels),
        cmocka_unit_test(test_queue_group_split),
        cmocka_unit_test(test_request_reply),
        cmocka_unit_test(test_slow_consumer_bounded),
        cmocka_unit_test(test_js_dedup),
        cmocka_unit_test(test_js_pull_ack_redelivery),
        cmocka_unit_test(test_js_publish_batch),
        cmocka_unit_test(test_js_fetch_returns_what_it_has),
        cmocka_unit_test_setup_teardown(test_reconnect_buffers_publishes, private_setup,
                                        private_teardown),
        cmocka_unit_test_setup_teardown(test_connect_fails_fast_or_retries, private_setup,
                                        private_teardown),
    };
    int failed = cmocka_run_group_tests(tests, NULL, js_cleanup);
    bus_library_shutdown();
    return failed;
}
