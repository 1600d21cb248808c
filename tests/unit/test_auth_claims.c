/* libcommon/auth_claims.c: decoding a verified token's payload, scope membership. Tokens are
 * minted with auth_mint, the same code the services use. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "auth.h"
#include "auth_claims.h"

static char *bearer(const char *extra) {
    auth_signer *s = NULL;
    char err[256], *tok = NULL, *out;
    auth_claims c = {.sub = "u",
                     .org_id = "o",
                     .audience = "upsquad",
                     .clearance = 2,
                     .ttl_s = 60,
                     .extra_json = extra};
    assert_int_equal(
        auth_signer_new("HS256", "0123456789abcdef0123456789abcdef", &s, err, sizeof err), AUTH_OK);
    assert_int_equal(auth_mint(s, &c, &tok, err, sizeof err), AUTH_OK);
    auth_signer_free(s);
    out = malloc(strlen(tok) + 8);
    strcpy(out, "Bearer ");
    strcat(out, tok);
    free(tok);
    return out;
}

static void test_decode(void **st) {
    (void)st;
    char *b = bearer("{\"scope\":\"a b\",\"n\":[1]}");
    cJSON *c = auth_claims_decode(b + 7);
    assert_non_null(c);
    assert_string_equal(cJSON_GetObjectItem(c, "sub")->valuestring, "u");
    assert_string_equal(cJSON_GetObjectItem(c, "scope")->valuestring, "a b");
    cJSON_Delete(c);
    free(b);
    assert_null(auth_claims_decode(NULL));
    assert_null(auth_claims_decode("nodots"));
    assert_null(auth_claims_decode("a..b"));
    assert_null(auth_claims_decode("a.!!!.b"));
    assert_null(auth_claims_decode("a.WzFd.b")); /* [1]: not an object */
    /* {"sub":"a"} without padding, and with base64url characters */
    cJSON *d = auth_claims_decode("x.eyJzdWIiOiJhIn0.y");
    assert_non_null(d);
    cJSON_Delete(d);
}

static void test_scope(void **st) {
    (void)st;
    char *spaced = bearer("{\"scope\":\"runtime.worker  runtime.orchestrator\"}");
    char *arr = bearer("{\"scope\":[\"x\",\"runtime.orchestrator\"]}");
    char *none = bearer(NULL);
    char *prefix = bearer("{\"scope\":\"runtime.orchestratorx runtime\"}");
    assert_int_equal(auth_bearer_has_scope(spaced, "runtime.orchestrator"), 1);
    assert_int_equal(auth_bearer_has_scope(spaced, "runtime.worker"), 1);
    assert_int_equal(auth_bearer_has_scope(spaced, "runtime"), 0);
    assert_int_equal(auth_bearer_has_scope(arr, "runtime.orchestrator"), 1);
    assert_int_equal(auth_bearer_has_scope(arr, "y"), 0);
    assert_int_equal(auth_bearer_has_scope(none, "runtime.orchestrator"), 0);
    assert_int_equal(auth_bearer_has_scope(prefix, "runtime.orchestrator"), 0);
    assert_int_equal(auth_bearer_has_scope(spaced + 7, "runtime.worker"), 0); /* no scheme */
    spaced[0] = 'b';                                                          /* any case */
    assert_int_equal(auth_bearer_has_scope(spaced, "runtime.worker"), 1);
    assert_int_equal(auth_bearer_has_scope(NULL, "x"), 0);
    assert_int_equal(auth_bearer_has_scope(spaced, ""), 0);
    free(spaced);
    free(arr);
    free(none);
    free(prefix);
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_decode), cmocka_unit_test(test_scope)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}
