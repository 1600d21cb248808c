/* Bus fan-out on nats.c's shared delivery pool, against the runtime's NATS
 * (UPSQUAD_NATS_URL): many subscriptions cost a few threads, and each subscription still gets
 * its messages in order. And a request waits no longer than the thread's deadline (ctx.h). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "bus.h"
#include "ctx.h"
#include "log.h"

#define NSUBS 400
#define NMSGS 25

static const char *g_url;

typedef struct sub_state {
    atomic_int next;     /* the sequence number expected next */
    atomic_int disorder; /* messages that arrived out of order */
    atomic_int received;
} sub_state;

static sub_state subs[NSUBS];
static atomic_int total;

static int threads_now(void) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    int n = -1;
    while (f && fgets(line, sizeof line, f))
        if (sscanf(line, "Threads: %d", &n) == 1) break;
    if (f) fclose(f);
    return n;
}

static void on_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    sub_state *s = ud;
    int seq = atoi(natsMsg_GetData(m));
    if (seq != atomic_load(&s->next)) atomic_fetch_add(&s->disorder, 1);
    atomic_store(&s->next, seq + 1);
    atomic_fetch_add(&s->received, 1);
    atomic_fetch_add(&total, 1);
}

static void test_many_subscriptions_few_threads_order_kept(void **state) {
    (void)state;
    char err[256], prefix[64];
    bus *b = NULL;
    bus_opts o;
    bus_opts_default(&o);
    assert_int_equal(o.delivery_threads, 2);
    snprintf(prefix, sizeof prefix, "fanout.%d.%d", (int)getpid(), (int)time(NULL) % 100000);
    assert_int_equal(bus_connect_ex(g_url, "fanout-test", &o, &b, err, sizeof err), BUS_OK);
    int before = threads_now();
    static bus_sub *handles[NSUBS];
    for (int i = 0; i < NSUBS; i++) {
        char subj[128];
        snprintf(subj, sizeof subj, "%s.%d", prefix, i);
        assert_int_equal(
            bus_subscribe(b, subj, NULL, on_msg, &subs[i], &handles[i], err, sizeof err), BUS_OK);
    }
    assert_int_equal(bus_flush(b, 5000), BUS_OK);
    /* interleaved across subscriptions, in order within each */
    for (int k = 0; k < NMSGS; k++)
        for (int i = 0; i < NSUBS; i++) {
            char subj[128], data[16];
            snprintf(subj, sizeof subj, "%s.%d", prefix, i);
            int n = snprintf(data, sizeof data, "%d", k);
            assert_int_equal(bus_publish(b, subj, data, n + 1), BUS_OK);
        }
    assert_int_equal(bus_flush(b, 5000), BUS_OK);
    for (int t = 0; t < 1000 && atomic_load(&total) < NSUBS * NMSGS; t++)
        usleep(10000);
    int after = threads_now();
    assert_int_equal(atomic_load(&total), NSUBS * NMSGS);
    for (int i = 0; i < NSUBS; i++) {
        assert_int_equal(atomic_load(&subs[i].received), NMSGS);
        assert_int_equal(atomic_load(&subs[i].disorder), 0);
    }
    /* a thread per subscription would be NSUBS more; the pool is 2 (plus nats.c's timers) */
    printf("threads: %d before subscribing, %d with %d subscriptions\n", before, after, NSUBS);
    assert_true(after - before <= 4);
    for (int i = 0; i < NSUBS; i++)
        bus_unsubscribe(handles[i]);
    bus_close(b);
}

static void silent(bus *b, natsMsg *m, void *ud) {
    (void)b, (void)m, (void)ud;
}

static int64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void test_request_bounded_by_deadline(void **state) {
    (void)state;
    char err[256], subj[96];
    bus *b = NULL;
    bus_sub *q = NULL;
    natsMsg *reply = NULL;
    snprintf(subj, sizeof subj, "fanout.quiet.%d", (int)getpid());
    assert_int_equal(bus_connect(g_url, "fanout-test", &b, err, sizeof err), BUS_OK);
    assert_int_equal(bus_subscribe(b, subj, NULL, silent, NULL, &q, err, sizeof err), BUS_OK);
    assert_int_equal(bus_flush(b, 2000), BUS_OK);
    ctx_set_deadline_ms(200);
    int64_t t0 = mono_ms();
    assert_int_equal(bus_request(b, subj, "x", 1, 5000, &reply), BUS_ETIMEOUT);
    assert_true(mono_ms() - t0 < 1500); /* the deadline, not the 5 s asked */
    assert_int_equal(bus_request(b, subj, "x", 1, 5000, &reply), BUS_ETIMEOUT); /* passed */
    assert_null(reply);
    ctx_clear();
    bus_unsubscribe(q);
    bus_close(b);
}

int main(void) {
    g_url = getenv("UPSQUAD_NATS_URL");
    if (!g_url || !*g_url) {
        printf("SKIP test_bus_fanout: UPSQUAD_NATS_URL is not set\n");
        return 0;
    }
    log_init("test_bus_fanout", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_many_subscriptions_few_threads_order_kept),
        cmocka_unit_test(test_request_bounded_by_deadline),
    };
    int failed = cmocka_run_group_tests(tests, NULL, NULL);
    bus_library_shutdown();
    return failed;
}
