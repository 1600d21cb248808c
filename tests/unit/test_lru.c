/* libcommon/lru: bounds by count and bytes, recency order, pinned entries, ownership. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "lru.h"

static int g_freed;

typedef struct val {
    int n;
    int pinned;
} val;

static void val_free(void *v) {
    g_freed++;
    free(v);
}

static int val_pinned(const void *v) {
    return ((const val *)v)->pinned;
}

static val *mk(int n) {
    val *v = calloc(1, sizeof *v);
    v->n = n;
    return v;
}

static lru *mk_lru(size_t entries, size_t bytes) {
    lru *l = NULL;
    lru_opts o = {
        .max_entries = entries, .max_bytes = bytes, .free_val = val_free, .pinned = val_pinned};
    assert_int_equal(lru_create(&o, &l), 0);
    return l;
}

static void test_count_bound_evicts_least_recent(void **state) {
    (void)state;
    g_freed = 0;
    lru *l = mk_lru(3, 0);
    assert_int_equal(lru_insert(l, "a", mk(1), 0), 0);
    assert_int_equal(lru_insert(l, "b", mk(2), 0), 0);
    assert_int_equal(lru_insert(l, "c", mk(3), 0), 0);
    assert_non_null(lru_get(l, "a")); /* a is now the most recent: b is the coldest */
    assert_int_equal(lru_insert(l, "d", mk(4), 0), 0);
    assert_null(lru_get(l, "b"));
    assert_int_equal(((val *)lru_get(l, "a"))->n, 1);
    assert_int_equal(lru_count(l), 3);
    assert_int_equal(lru_evicted(l), 1);
    assert_int_equal(g_freed, 1);
    lru_destroy(l);
    assert_int_equal(g_freed, 4);
}

static void test_duplicate_key_refused_and_value_freed(void **state) {
    (void)state;
    g_freed = 0;
    lru *l = mk_lru(4, 0);
    assert_int_equal(lru_insert(l, "k", mk(1), 0), 0);
    assert_int_equal(lru_insert(l, "k", mk(2), 0), -1);
    assert_int_equal(g_freed, 1); /* ownership was taken also on failure */
    assert_int_equal(((val *)lru_get(l, "k"))->n, 1);
    lru_destroy(l);
}

static void test_byte_bound_and_recharge(void **state) {
    (void)state;
    lru *l = mk_lru(100, 100);
    assert_int_equal(lru_insert(l, "a", mk(1), 40), 0); /* 41 with the key */
    assert_int_equal(lru_insert(l, "b", mk(2), 40), 0);
    assert_int_equal(lru_bytes(l), 82);
    assert_int_equal(lru_recharge(l, "b", 60), 0); /* 41 + 61 > 100: a goes, never b */
    assert_null(lru_get(l, "a"));
    assert_non_null(lru_get(l, "b"));
    assert_int_equal(lru_bytes(l), 61);
    assert_int_equal(lru_recharge(l, "zz", 1), -1);
    lru_destroy(l);
}

static void test_pinned_entries_survive(void **state) {
    (void)state;
    lru *l = mk_lru(2, 0);
    val *p = mk(1);
    p->pinned = 1;
    assert_int_equal(lru_insert(l, "pinned", p, 0), 0);
    assert_int_equal(lru_insert(l, "x", mk(2), 0), 0);
    assert_int_equal(lru_insert(l, "y", mk(3), 0), 0); /* pinned is coldest but stays */
    assert_non_null(lru_get(l, "pinned"));
    assert_null(lru_get(l, "x"));
    assert_int_equal(lru_count(l), 2);
    lru_destroy(l);
}

static void count_cb(const char *key, void *v, void *ud) {
    (void)key;
    (void)v;
    (*(int *)ud)++;
}

static void test_many_keys(void **state) {
    (void)state;
    lru *l = mk_lru(1000, 0);
    char k[32];
    for (int i = 0; i < 5000; i++) {
        snprintf(k, sizeof k, "key-%d", i);
        assert_int_equal(lru_insert(l, k, mk(i), 8), 0);
    }
    assert_int_equal(lru_count(l), 1000);
    assert_int_equal(lru_evicted(l), 4000);
    for (int i = 4000; i < 5000; i++) {
        snprintf(k, sizeof k, "key-%d", i);
        val *v = lru_get(l, k);
        assert_non_null(v);
        assert_int_equal(v->n, i);
    }
    int n = 0;
    lru_foreach(l, count_cb, &n);
    assert_int_equal(n, 1000);
    lru_destroy(l);
    lru_opts bad = {.max_entries = 0};
    lru *x = NULL;
    assert_int_equal(lru_create(&bad, &x), -1);
    assert_null(x);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_count_bound_evicts_least_recent),
        cmocka_unit_test(test_duplicate_key_refused_and_value_freed),
        cmocka_unit_test(test_byte_bound_and_recharge),
        cmocka_unit_test(test_pinned_entries_survive),
        cmocka_unit_test(test_many_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
