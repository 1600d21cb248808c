/* libcommon/util.c: UTF-8 checking and cutting, the one file reader, the one error formatter. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ids.h"
#include "util.h"

static void test_json_object_end(void **state) {
    (void)state;
    const char *t = "{\"a\": {\"b\": \"}\\\"{\"}} tail";
    const char *e = util_json_object_end(t);
    assert_non_null(e);
    assert_string_equal(e, " tail"); /* braces inside strings and escaped quotes ignored */
    assert_null(util_json_object_end("{\"open\": {}"));
    assert_null(util_json_object_end("{\"s\": \"}"));
}

static void test_utf8_check(void **state) {
    (void)state;
    struct {
        const char *s;
        size_t n, bad;
    } cases[] = {
        {"plain ascii", 11, 11},
        {"caf\xC3\xA9", 5, 5},
        {"\xE2\x82\xAC\xF0\x9F\x98\x80", 7, 7},
        {"a\0b", 3, 3},             /* NUL is UTF-8 (callers refuse it themselves) */
        {"ab\xC3", 3, 2},           /* truncated sequence */
        {"ab\x80", 3, 2},           /* lone continuation */
        {"\xC0\xAF", 2, 0},         /* overlong '/' */
        {"x\xED\xA0\x80", 4, 1},    /* surrogate U+D800 */
        {"\xF4\x90\x80\x80", 4, 0}, /* above U+10FFFF */
        {"ok\xFF", 3, 2},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        assert_int_equal(util_utf8_check(cases[i].s, cases[i].n), cases[i].bad);
    assert_true(util_utf8_valid("caf\xC3\xA9"));
    assert_false(util_utf8_valid("caf\xC3"));
}

static void test_utf8_cut(void **state) {
    (void)state;
    char role[64];
    memset(role, 'a', 47);
    memcpy(role + 47, "\xC3\xA9", 3); /* 47 x a + é: the 48th and 49th bytes are one character */
    assert_int_equal(util_utf8_cut(role, 48), 47);
    assert_int_equal(util_utf8_cut(role, 49), 49);
    assert_int_equal(util_utf8_cut(role, 100), 49);
    assert_int_equal(util_utf8_cut("\xF0\x9F\x98\x80", 3), 0);
    assert_int_equal(util_utf8_cut("\xF0\x9F\x98\x80x", 4), 4);
    assert_int_equal(util_utf8_cut("abc", 0), 0);
    assert_int_equal(util_utf8_cut("", 5), 0);
    /* every cut of a valid string is valid */
    const char *mixed = "a\xC3\xA9\xE2\x82\xAC\xF0\x9F\x98\x80z";
    for (size_t max = 0; max <= strlen(mixed); max++) {
        char buf[32];
        size_t n = util_utf8_cut(mixed, max);
        assert_true(n <= max);
        memcpy(buf, mixed, n);
        buf[n] = 0;
        assert_true(util_utf8_valid(buf));
    }
}

static void test_errf_cuts_on_a_boundary(void **state) {
    (void)state;
    char err[6];
    assert_int_equal(util_errf(err, sizeof err, -7, "%s", "abcd\xC3\xA9xyz"), -7);
    assert_string_equal(err, "abcd"); /* not "abcd\xC3" */
    assert_true(util_utf8_valid(err));
}

static void test_read_file(void **state) {
    (void)state;
    char path[] = "/tmp/upsquad-util-XXXXXX", err[256];
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    char big[10000];
    memset(big, 'x', sizeof big);
    assert_int_equal(write(fd, big, sizeof big), (ssize_t)sizeof big);
    close(fd);
    char *buf = NULL;
    size_t len = 0;
    assert_int_equal(util_read_file(path, sizeof big, &buf, &len, err, sizeof err), 0);
    assert_int_equal(len, sizeof big);
    assert_int_equal(buf[len], 0);
    free(buf);
    buf = NULL;
    assert_int_equal(util_read_file(path, sizeof big - 1, &buf, &len, err, sizeof err), -1);
    assert_null(buf);
    assert_non_null(strstr(err, "larger than 9999 bytes"));
    unlink(path);
    assert_int_equal(util_read_file(path, 100, &buf, NULL, err, sizeof err), -1);
    assert_non_null(strstr(err, path));
    /* an empty file is an empty string */
    strcpy(path, "/tmp/upsquad-util-XXXXXX");
    fd = mkstemp(path);
    close(fd);
    assert_int_equal(util_read_file(path, 100, &buf, &len, err, sizeof err), 0);
    assert_int_equal(len, 0);
    assert_string_equal(buf, "");
    free(buf);
    unlink(path);
}

static void test_sha256(void **state) {
    (void)state;
    unsigned char raw[32];
    char hex[65], hex2[65];
    assert_int_equal(ids_sha256_raw("abc", 3, raw), 0);
    ids_hex(raw, 32, hex);
    assert_string_equal(hex, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    ids_sha256_hex("abc", 3, hex2);
    assert_string_equal(hex, hex2);
    assert_non_null(ids_sha256_md());
}

/* FNV-1a 64 test vectors, and that a hash continues over pieces as over their concatenation. */
static void test_fnv1a(void **state) {
    (void)state;
    assert_true(util_fnv1a(UTIL_FNV1A_INIT, "", 0) == UTIL_FNV1A_INIT);
    assert_true(util_fnv1a(UTIL_FNV1A_INIT, "a", 1) == 0xaf63dc4c8601ec8cULL);
    assert_true(util_fnv1a(UTIL_FNV1A_INIT, "foobar", 6) == 0x85944171f73967e8ULL);
    assert_true(util_fnv1a(util_fnv1a(UTIL_FNV1A_INIT, "foo", 3), "bar", 3) ==
                util_fnv1a(UTIL_FNV1A_INIT, "foobar", 6));
}

static int64_t mono_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* A deadline from util_deadline() on a condition variable from util_cond_init_monotonic()
 * ends the wait after its delay: on a cond variable of the default (realtime) clock the same
 * deadline lies decades in the past and the wait would end at once. */
static void test_timed_wait_monotonic(void **state) {
    (void)state;
    pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
    pthread_cond_t cv;
    assert_int_equal(util_cond_init_monotonic(&cv), 0);
    struct timespec dl;
    int64_t t0 = mono_ms();
    util_deadline(&dl, 60);
    pthread_mutex_lock(&mu);
    int rc;
    while ((rc = pthread_cond_timedwait(&cv, &mu, &dl)) == 0) {
    }
    pthread_mutex_unlock(&mu);
    int64_t waited = mono_ms() - t0;
    assert_int_equal(rc, ETIMEDOUT);
    assert_true(waited >= 59);
    assert_true(waited < 5000);
    /* a negative delay is now, and a second past the nanosecond carry stays normalized */
    util_deadline(&dl, -5);
    assert_true(dl.tv_nsec >= 0 && dl.tv_nsec < 1000000000L);
    util_deadline(&dl, 1999);
    assert_true(dl.tv_nsec >= 0 && dl.tv_nsec < 1000000000L);
    pthread_cond_destroy(&cv);
}

/* util_mono_ms / util_mono_us never go back and agree with each other. */
static void test_mono_clock(void **state) {
    (void)state;
    int64_t us0 = util_mono_us(), ms0 = util_mono_ms();
    usleep(20000);
    int64_t us1 = util_mono_us(), ms1 = util_mono_ms();
    assert_true(us1 - us0 >= 19000 && us1 - us0 < 5000000);
    assert_true(ms1 - ms0 >= 19 && ms1 - ms0 < 5000);
    assert_true(ms0 >= us0 / 1000 && ms0 - us0 / 1000 < 1000);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_object_end), cmocka_unit_test(test_utf8_check),
        cmocka_unit_test(test_utf8_cut),        cmocka_unit_test(test_errf_cuts_on_a_boundary),
        cmocka_unit_test(test_read_file),       cmocka_unit_test(test_sha256),
        cmocka_unit_test(test_fnv1a),           cmocka_unit_test(test_timed_wait_monotonic),
        cmocka_unit_test(test_mono_clock),
    };
    return cmocka_run_group_tests_name("util", tests, NULL, NULL);
}
