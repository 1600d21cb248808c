/* The one redaction rule of node data (libcommon redaction.h): its table. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "redaction.h"

static void test_floors(void **state) {
    (void)state;
    assert_int_equal(redact_floor("public"), 0);
    assert_int_equal(redact_floor("internal"), 2);
    assert_int_equal(redact_floor("confidential"), 3);
    assert_int_equal(redact_floor("restricted"), 4);
    assert_int_equal(redact_floor(""), 2); /* unknown: internal */
    assert_int_equal(redact_floor(NULL), 2);
    assert_int_equal(redact_floor("Restricted"), 2); /* exact names only */
}

static void test_sensitive_keys(void **state) {
    (void)state;
    const char *yes[] = {"password", "DB_PASSWORD",   "client_secret",   "refresh_token", "api_key",
                         "ApiKey",   "Authorization", "aws_credentials", "private_key"};
    const char *no[] = {"prompt", "text", "note", "repo", "tok", "key", "", NULL};
    for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
        assert_true(redact_sensitive_key(yes[i]));
    for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
        assert_false(redact_sensitive_key(no[i]));
}

/* Every clearance 0..5 against every floor 0..4 and kind: the rule written out. */
static void test_the_rule(void **state) {
    (void)state;
    for (int c = 0; c <= 5; c++)
        for (int f = 0; f <= 4; f++) {
            assert_true(redact_visible(c, f, REDACT_STRUCTURAL, "api_key"));
            assert_int_equal(redact_visible(c, f, REDACT_PAYLOAD, "note"), c >= f);
            assert_int_equal(redact_visible(c, f, REDACT_PAYLOAD, "api_key"), c >= f && c >= 4);
            assert_int_equal(redact_visible(c, f, REDACT_FREE_TEXT, "text"), c >= 4);
            assert_int_equal(redact_visible(c, f, REDACT_FREE_TEXT, NULL), c >= f && c >= 4);
        }
    /* the engine's finding: a clearance-3 member no longer reads a run's api_key */
    assert_false(redact_visible(3, 2, REDACT_PAYLOAD, "api_key"));
    assert_true(redact_visible(4, 2, REDACT_PAYLOAD, "api_key"));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_floors),
        cmocka_unit_test(test_sensitive_keys),
        cmocka_unit_test(test_the_rule),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
