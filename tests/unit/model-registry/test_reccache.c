/* The per-thread cache of encoded recommendations: a hit only for the same owner, snapshot
 * version and key; collisions replace; oversized entries are refused; each thread has its own. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../../../services/model-registry/reccache.h"

static int owner_a, owner_b;

static void put(const void *owner, uint64_t version, const char *key, const char *value) {
    uint8_t *d;
    assert_int_equal(mr_reccache_put(owner, version, key, strlen(key), strlen(value), &d), 0);
    memcpy(d, value, strlen(value));
}

static int get(const void *owner, uint64_t version, const char *key, char *out, size_t cap) {
    const uint8_t *d;
    size_t n;
    if (mr_reccache_get(owner, version, key, strlen(key), &d, &n) != 0) return -1;
    assert_true(n < cap);
    memcpy(out, d, n);
    out[n] = 0;
    return 0;
}

static void test_hit_needs_owner_version_and_key(void **state) {
    (void)state;
    char v[64];
    put(&owner_a, 7, "architect|balanced", "answer-1");
    assert_int_equal(get(&owner_a, 7, "architect|balanced", v, sizeof v), 0);
    assert_string_equal(v, "answer-1");
    assert_int_equal(get(&owner_a, 8, "architect|balanced", v, sizeof v), -1); /* a swap */
    assert_int_equal(get(&owner_b, 7, "architect|balanced", v, sizeof v), -1);
    assert_int_equal(get(&owner_a, 7, "architect", v, sizeof v), -1);
    assert_int_equal(get(&owner_a, 7, "planner", v, sizeof v), -1);
    /* the same key on a newer snapshot replaces the entry */
    put(&owner_a, 8, "architect|balanced", "answer-2");
    assert_int_equal(get(&owner_a, 8, "architect|balanced", v, sizeof v), 0);
    assert_string_equal(v, "answer-2");
}

/* More keys than slots: whatever is still held is right; the most recent one is held. */
static void test_collisions_never_answer_another_key(void **state) {
    (void)state;
    char key[32], want[32], v[64];
    for (int i = 0; i < 4 * MR_RECCACHE_SLOTS; i++) {
        snprintf(key, sizeof key, "role-%d", i);
        snprintf(want, sizeof want, "value-%d", i);
        put(&owner_a, 1, key, want);
    }
    int held = 0;
    for (int i = 0; i < 4 * MR_RECCACHE_SLOTS; i++) {
        snprintf(key, sizeof key, "role-%d", i);
        snprintf(want, sizeof want, "value-%d", i);
        if (get(&owner_a, 1, key, v, sizeof v) == 0) {
            assert_string_equal(v, want);
            held++;
        }
    }
    assert_true(held > 0 && held <= MR_RECCACHE_SLOTS);
    assert_int_equal(get(&owner_a, 1, key, v, sizeof v), 0);
}

static void test_oversized_entries_are_not_kept(void **state) {
    (void)state;
    static char big[MR_RECCACHE_KEY_MAX + 2];
    uint8_t *d;
    const uint8_t *g;
    size_t n;
    memset(big, 'k', sizeof big - 1);
    assert_int_equal(mr_reccache_put(&owner_a, 1, big, sizeof big - 1, 10, &d), -1);
    assert_int_equal(mr_reccache_get(&owner_a, 1, big, sizeof big - 1, &g, &n), -1);
    assert_int_equal(mr_reccache_put(&owner_a, 1, "k", 1, MR_RECCACHE_ENTRY_MAX, &d), -1);
    assert_int_equal(mr_reccache_put(&owner_a, 1, "k", 1, MR_RECCACHE_ENTRY_MAX - 1, &d), 0);
}

static void *other_thread(void *arg) {
    const uint8_t *d;
    size_t n;
    (void)arg;
    /* nothing the main thread cached is visible here (no shared state, no locks) */
    intptr_t miss = mr_reccache_get(&owner_a, 7, "x", 1, &d, &n) == -1;
    uint8_t *w;
    if (mr_reccache_put(&owner_a, 7, "x", 1, 1, &w) == 0) *w = 'T';
    return (void *)miss; /* the table is freed when this thread exits (ASan: no leak) */
}

static void test_each_thread_has_its_own_table(void **state) {
    (void)state;
    char v[8];
    put(&owner_a, 7, "x", "M");
    pthread_t t;
    void *miss;
    assert_int_equal(pthread_create(&t, NULL, other_thread, NULL), 0);
    pthread_join(t, &miss);
    assert_true((intptr_t)miss);
    assert_int_equal(get(&owner_a, 7, "x", v, sizeof v), 0);
    assert_string_equal(v, "M");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hit_needs_owner_version_and_key),
        cmocka_unit_test(test_collisions_never_answer_another_key),
        cmocka_unit_test(test_oversized_entries_are_not_kept),
        cmocka_unit_test(test_each_thread_has_its_own_table),
    };
    return cmocka_run_group_tests_name("model-registry reccache", tests, NULL, NULL);
}
