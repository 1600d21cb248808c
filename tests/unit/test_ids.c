/* UUIDs and SHA-256 (libcommon/ids.c): FIPS 180-2 vectors, streaming equals one-shot,
 * UUID layout (version/variant), v7 ordering within a process and across threads, and the
 * validator's refusals. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

#include <cmocka.h>

#include "ids.h"

static void test_sha256_vectors(void **state) {
    (void)state;
    char out[65];
    ids_sha256_hex("", 0, out);
    assert_string_equal(out, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    ids_sha256_hex("abc", 3, out);
    assert_string_equal(out, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    const char *two_blocks = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    ids_sha256_hex(two_blocks, strlen(two_blocks), out);
    assert_string_equal(out, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* One million 'a' (FIPS 180-2 B.3). */
    char *mil = malloc(1000000);
    memset(mil, 'a', 1000000);
    ids_sha256_hex(mil, 1000000, out);
    assert_string_equal(out, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
    free(mil);
}

static void test_sha256_streaming(void **state) {
    (void)state;
    ids_sha256 h;
    char out[65], one[65];
    unsigned char raw[32];
    /* Fields hashed piecewise equal the one-shot hash of their concatenation. */
    assert_int_equal(ids_sha256_init(&h), 0);
    ids_sha256_update_str(&h, "run-1");
    ids_sha256_update(&h, ":", 1);
    ids_sha256_update_str(&h, "step");
    ids_sha256_update(&h, NULL, 0);
    ids_sha256_update_str(&h, ":3:1");
    assert_int_equal(ids_sha256_final_hex(&h, out), 0);
    assert_null(h.ctx);
    ids_sha256_hex("run-1:step:3:1", 14, one);
    assert_string_equal(out, one);

    assert_int_equal(ids_sha256_init(&h), 0);
    ids_sha256_update_str(&h, "abc");
    assert_int_equal(ids_sha256_final_raw(&h, raw), 0);
    assert_int_equal(raw[0], 0xba);
    assert_int_equal(raw[31], 0xad);
    /* Finalising twice fails instead of reusing a released context. */
    assert_int_equal(ids_sha256_final_raw(&h, raw), -1);
    assert_int_equal(ids_sha256_final_hex(&h, out), -1);
    assert_string_equal(out, "");

    /* Abandoned without final: free releases it (valgrind checks). */
    assert_int_equal(ids_sha256_init(&h), 0);
    ids_sha256_update_str(&h, "x");
    ids_sha256_free(&h);
    ids_sha256_free(&h);

    char hex[7];
    ids_hex((const unsigned char *)"\x00\xff\x10", 3, hex);
    assert_string_equal(hex, "00ff10");
}

static void check_layout(const char *u, char version) {
    assert_int_equal(strlen(u), IDS_UUID_LEN);
    assert_true(ids_uuid_valid(u));
    assert_int_equal(u[14], version);
    assert_non_null(strchr("89ab", u[19]));
    for (const char *p = u; *p; p++)
        assert_true(*p == '-' || (*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'));
}

static int cmp_str(const void *a, const void *b) {
    return strcmp((const char *)a, (const char *)b);
}

static void test_uuid_v4(void **state) {
    (void)state;
    enum { N = 2000 };
    char(*ids)[37] = malloc(N * sizeof *ids);
    for (int i = 0; i < N; i++) {
        assert_int_equal(ids_uuid_v4(ids[i]), 0);
        check_layout(ids[i], '4');
    }
    qsort(ids, N, sizeof *ids, cmp_str);
    for (int i = 1; i < N; i++)
        assert_true(strcmp(ids[i - 1], ids[i]) != 0);
    free(ids);
}

static uint64_t v7_ms(const char *u) {
    char hex[13];
    memcpy(hex, u, 8);
    memcpy(hex + 8, u + 9, 4);
    hex[12] = '\0';
    return strtoull(hex, NULL, 16);
}

static void test_uuid_v7_order(void **state) {
    (void)state;
    enum { N = 20000 };
    char prev[37], cur[37];
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t before = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    assert_int_equal(ids_uuid_v7(prev), 0);
    check_layout(prev, '7');
    /* Many ids per millisecond: strictly increasing as text. */
    for (int i = 0; i < N; i++) {
        assert_int_equal(ids_uuid_v7(cur), 0);
        check_layout(cur, '7');
        assert_true(strcmp(prev, cur) < 0);
        memcpy(prev, cur, sizeof cur);
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t after = (uint64_t)ts.tv_sec * 1000 + (uint64_t)ts.tv_nsec / 1000000;
    /* The timestamp field is the wall clock (sequence carries may push it a little ahead). */
    uint64_t ms = v7_ms(cur);
    assert_true(ms >= before && ms <= after + N / 3072 + 1);
}

#define V7_THREADS 4
#define V7_PER 10000
static char (*v7_all)[37];

static void *v7_worker(void *arg) {
    size_t base = (size_t)(intptr_t)arg * V7_PER;
    for (size_t i = 0; i < V7_PER; i++) {
        assert_int_equal(ids_uuid_v7(v7_all[base + i]), 0);
        if (i) assert_true(strcmp(v7_all[base + i - 1], v7_all[base + i]) < 0);
    }
    return NULL;
}

static void test_uuid_v7_threads(void **state) {
    (void)state;
    pthread_t th[V7_THREADS];
    v7_all = malloc(V7_THREADS * V7_PER * sizeof *v7_all);
    for (intptr_t i = 0; i < V7_THREADS; i++)
        pthread_create(&th[i], NULL, v7_worker, (void *)i);
    for (int i = 0; i < V7_THREADS; i++)
        pthread_join(th[i], NULL);
    qsort(v7_all, V7_THREADS * V7_PER, sizeof *v7_all, cmp_str);
    /* Unique across threads, also in the time+sequence prefix alone. */
    for (int i = 1; i < V7_THREADS * V7_PER; i++)
        assert_true(strncmp(v7_all[i - 1], v7_all[i], 18) < 0);
    free(v7_all);
}

static void test_uuid_valid(void **state) {
    (void)state;
    assert_true(ids_uuid_valid("123e4567-e89b-12d3-a456-426614174000"));
    assert_true(ids_uuid_valid("123E4567-E89B-12D3-A456-426614174000"));
    assert_true(ids_uuid_valid("00000000-0000-0000-0000-000000000000"));
    const char *bad[] = {
        "",
        "123e4567-e89b-12d3-a456-42661417400",   /* 35 */
        "123e4567-e89b-12d3-a456-4266141740000", /* 37 */
        "123e4567e89b-12d3-a456-4266141740000",  /* hyphen missing */
        "123e4567-e89b-12d3-a456_426614174000",
        "123e4567-e89b-12d3-a4561-42661417400", /* hyphen moved */
        "g23e4567-e89b-12d3-a456-426614174000",
        "{123e4567-e89b-12d3-a456-426614174000}",
        "123e4567-e89b-12d3-a456-42661417400\n",
        " 23e4567-e89b-12d3-a456-426614174000",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_false(ids_uuid_valid(bad[i]));
    assert_false(ids_uuid_valid(NULL));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sha256_vectors),  cmocka_unit_test(test_sha256_streaming),
        cmocka_unit_test(test_uuid_v4),         cmocka_unit_test(test_uuid_v7_order),
        cmocka_unit_test(test_uuid_v7_threads), cmocka_unit_test(test_uuid_valid),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
