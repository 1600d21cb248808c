/* Snapshots: prices resolved per day, lookups, refcounting, and atomic swaps under concurrent
 * readers (a reader never sees a half-built or freed catalogue). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "mr_fixture.h"
#include "util.h"
#include "../../../services/model-registry/snapshot.h"

static const fx_model pair[] = {
    {"zeta", "openai", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 1, 2},
    {"alpha", "anthropic", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 3, 4},
};

static void test_prices_resolved_per_day(void **state) {
    (void)state;
    static const fx_model one[] = {{"m", "acme", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 0, 0}};
    mr_catalog c;
    mr_snapshot *s;
    char err[256];
    fx_catalog(&c, one, 1);
    /* replace the single price with a schedule: 0.75 from day 100, 1.50 from day 200 */
    mr_model *m = &c.models[0];
    free(m->prices[0].source_url);
    free(m->prices[0].note);
    free(m->prices);
    assert_int_equal(mr_model_alloc_prices(m, 2), 0);
    for (int i = 0; i < 2; i++) {
        m->prices[i].effective_from = 100 * (i + 1);
        m->prices[i].input_per_million = 0.75 * (i + 1);
        m->prices[i].output_per_million = 3.75 * (i + 1);
        m->prices[i].source_url = fx_dup("https://example.test/p");
        m->prices[i].verified_on = 50;
        m->prices[i].note = fx_dup("");
    }
    assert_int_equal(mr_snapshot_build(&c, 150, &s, err, sizeof err), 0);
    assert_int_equal(s->n, 1);
    assert_true(s->entries[0].input_per_million == 0.75);
    assert_true(s->entries[0].output_per_million == 3.75);
    assert_true(s->entries[0].cost_efficiency == mr_cost_efficiency(0.75, 3.75));
    assert_int_equal(s->valid_until, 200); /* the day the next price applies */
    assert_null(c.models);                 /* ownership moved into the snapshot */
    mr_snapshot_unref(s);
}

static void test_model_before_first_price_is_pending(void **state) {
    (void)state;
    mr_catalog c;
    mr_snapshot *s;
    char err[256];
    fx_catalog(&c, pair, 2);
    c.models[1].prices[0].effective_from = 500;
    assert_int_equal(mr_snapshot_build(&c, 499, &s, err, sizeof err), 0);
    assert_int_equal(s->n, 1);
    assert_int_equal(s->n_pending, 1);
    assert_int_equal(s->valid_until, 500);
    assert_null(mr_snapshot_find(s, "alpha", 5));
    assert_non_null(mr_snapshot_find(s, "zeta", 4));
    mr_snapshot_unref(s);
}

static void test_lookup_and_providers(void **state) {
    (void)state;
    mr_catalog c;
    mr_snapshot *s;
    char err[256];
    fx_catalog(&c, pair, 2);
    assert_int_equal(mr_snapshot_build(&c, 1, &s, err, sizeof err), 0);
    assert_int_equal(s->n_providers, 2);
    assert_string_equal(s->providers[0], "anthropic");
    assert_string_equal(s->providers[1], "openai");
    assert_string_equal(s->entries[0].m->model_id, "alpha");
    assert_ptr_equal(s->entries[0].provider, s->providers[0]);
    assert_ptr_equal(mr_snapshot_provider(s, " ANTHROPIC ", 11), s->providers[0]);
    assert_null(mr_snapshot_provider(s, "anthropi", 8));
    assert_null(mr_snapshot_provider(s, "", 0));
    const mr_entry *e = mr_snapshot_find(s, "ZETA", 4);
    assert_non_null(e);
    assert_string_equal(e->m->model_id, "zeta");
    assert_null(mr_snapshot_find(s, "zet", 3));
    assert_null(mr_snapshot_find(s, "", 0));
    mr_snapshot_unref(s);
}

static void test_invalid_catalogue_is_rejected_by_validation(void **state) {
    (void)state;
    mr_catalog c;
    char err[256];
    fx_catalog(&c, pair, 2);
    /* provider names are canonical lowercase: a mixed-case one is refused */
    free(c.models[1].provider);
    c.models[1].provider = fx_dup("Anthropic");
    assert_int_equal(mr_catalog_validate(&c, true, err, sizeof err), -1);
    assert_non_null(strstr(err, "models[1].provider"));
    mr_catalog_free(&c);
}

/* ---- holder ---- */

static mr_snapshot *snapshot_priced(double price) {
    static const fx_model many[] = {
        {"a", "p", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 1, 1},
        {"b", "p", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 1, 1},
        {"c", "q", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 1, 1},
        {"d", "q", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 1, 1},
    };
    mr_catalog c;
    mr_snapshot *s;
    char err[256];
    fx_catalog(&c, many, 4);
    for (size_t i = 0; i < c.n; i++)
        c.models[i].prices[0].input_per_million = price;
    if (mr_snapshot_build(&c, 1, &s, err, sizeof err)) abort();
    return s;
}

static void test_holder_swap_keeps_readers_alive(void **state) {
    (void)state;
    mr_holder h;
    mr_holder_init(&h);
    assert_null(mr_holder_get(&h));
    mr_holder_swap(&h, snapshot_priced(1));
    mr_snapshot *r1 = mr_holder_get(&h);
    assert_int_equal(r1->version, 1);
    mr_holder_swap(&h, snapshot_priced(2));
    /* the reader's snapshot is intact after the swap */
    assert_true(r1->entries[3].input_per_million == 1);
    mr_snapshot *r2 = mr_holder_get(&h);
    assert_int_equal(r2->version, 2);
    assert_true(r2->entries[0].input_per_million == 2);
    assert_int_equal(atomic_load(&r1->refs), 1); /* only the reader holds the old one */
    mr_snapshot_unref(r1);
    mr_snapshot_unref(r2);
    mr_holder_destroy(&h);
}

typedef struct race {
    mr_holder h;
    atomic_int stop;
    atomic_long reads, torn;
} race;

static void *reader(void *arg) {
    race *r = arg;
    while (!atomic_load(&r->stop)) {
        mr_snapshot *s = mr_holder_get(&r->h);
        /* every model of one snapshot carries the same price: a mix would be a torn read */
        double p = s->entries[0].input_per_million;
        for (size_t i = 1; i < s->n; i++)
            if (s->entries[i].input_per_million != p) atomic_fetch_add(&r->torn, 1);
        if (!mr_snapshot_find(s, "d", 1)) atomic_fetch_add(&r->torn, 1);
        if ((uint64_t)p != s->version) atomic_fetch_add(&r->torn, 1);
        mr_snapshot_unref(s);
        atomic_fetch_add(&r->reads, 1);
    }
    return NULL;
}

static void test_concurrent_swaps(void **state) {
    (void)state;
    race r;
    pthread_t th[4];
    mr_holder_init(&r.h);
    atomic_init(&r.stop, 0);
    atomic_init(&r.reads, 0);
    atomic_init(&r.torn, 0);
    mr_holder_swap(&r.h, snapshot_priced(1)); /* version 1 carries price 1 */
    for (int i = 0; i < 4; i++)
        assert_int_equal(pthread_create(&th[i], NULL, reader, &r), 0);
    /* keep swapping until the readers have overlapped many swaps, however the threads are
     * scheduled: valgrind runs one thread at a time and may not switch for a whole burst of
     * swaps, so past the first 2,000 a swap is followed by a nap that lets a reader run
     * (bounded: 30 s without 200 reads fails below) */
    int v = 1;
    int64_t until = util_mono_ms() + 30000;
    const struct timespec nap = {0, 200000};
    while (++v <= 2000 || (atomic_load(&r.reads) < 200 && util_mono_ms() < until)) {
        mr_holder_swap(&r.h, snapshot_priced(v));
        if (v > 2000) nanosleep(&nap, NULL);
    }
    v--;
    atomic_store(&r.stop, 1);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    assert_int_equal(atomic_load(&r.torn), 0);
    assert_true(atomic_load(&r.reads) > 0);
    mr_snapshot *last = mr_holder_get(&r.h);
    assert_int_equal(last->version, v);
    mr_snapshot_unref(last);
    mr_holder_destroy(&r.h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prices_resolved_per_day),
        cmocka_unit_test(test_model_before_first_price_is_pending),
        cmocka_unit_test(test_lookup_and_providers),
        cmocka_unit_test(test_invalid_catalogue_is_rejected_by_validation),
        cmocka_unit_test(test_holder_swap_keeps_readers_alive),
        cmocka_unit_test(test_concurrent_swaps),
    };
    return cmocka_run_group_tests_name("model-registry snapshot", tests, NULL, NULL);
}
