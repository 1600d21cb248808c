/* devworker's directive language (script.c), token splitting, prices, the JWS claims decoder
 * and the protobuf -> JSON dump of `inspect`: pure functions, no server. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../../services/devworker/inspect.h"
#include "auth_claims.h"
#include "../../../services/devworker/price.h"
#include "../../../services/devworker/script.h"

typedef Upsquad__Runtime__V1__ExecuteStepEvent Ev;

/* Parses src (the JSON after the marker); asserts success; returns the script. */
static dw_script *ok(const char *src) {
    dw_script *s = NULL;
    char err[512] = "", ptr[256] = "";
    int rc = dw_script_parse(src, 100, &s, err, sizeof err, ptr, sizeof ptr);
    if (rc != 0) fail_msg("parse failed: %s (%s)", err, ptr);
    return s;
}

/* Asserts the parse fails with a message containing want and the pointer ptr_want. */
static void bad(const char *src, const char *want, const char *ptr_want) {
    dw_script *s = NULL;
    char err[512] = "", ptr[256] = "";
    assert_int_equal(dw_script_parse(src, 3, &s, err, sizeof err, ptr, sizeof ptr), -1);
    assert_null(s);
    if (strstr(err, want) == NULL) fail_msg("message \"%s\" lacks \"%s\"", err, want);
    if (ptr_want) assert_string_equal(ptr, ptr_want);
}

static void test_detect(void **st) {
    (void)st;
    const char *body;
    assert_int_equal(dw_script_detect("#!script\n[]", &body), 1);
    assert_string_equal(body, "[]");
    assert_int_equal(dw_script_detect("#!script \t\r\n[1]", &body), 1);
    assert_string_equal(body, "[1]");
    assert_int_equal(dw_script_detect("#!script", &body), 1);
    assert_string_equal(body, "");
    assert_int_equal(dw_script_detect("#!scripts\n[]", &body), 0);
    assert_int_equal(dw_script_detect(" #!script\n[]", &body), 0);
    assert_int_equal(dw_script_detect("hello", &body), 0);
}

/* Splits like the echo reply: tokens concatenate to the text. */
static void test_tokens(void **st) {
    (void)st;
    const char *t = "echo: a  b \n";
    const char *want[] = {"echo:", " a", "  b \n"};
    size_t n, i = 0;
    while ((n = dw_next_token(t)) > 0) {
        assert_true(i < 3);
        assert_int_equal(n, strlen(want[i]));
        assert_memory_equal(t, want[i], n);
        t += n;
        i++;
    }
    assert_int_equal(i, 3);
    assert_int_equal(dw_next_token(""), 0);
    assert_int_equal(dw_word_count("  what is\tthis \n"), 3);
    assert_int_equal(dw_word_count(""), 0);
    assert_int_equal(dw_word_count("   "), 0);
}

static void test_events_and_defaults(void **st) {
    (void)st;
    dw_script *s =
        ok("[{\"status\": \"acting\"}, {\"status\": 3},"
           " {\"tool_call\": {\"tool_name\": \"t\", \"arguments\": {\"a\": [1, {}]}}},"
           " {\"tool_call\": {\"tool_name\": \"u\", \"tool_call_id\": \"mine\"}},"
           " {\"tool_result\": {\"result\": [1, 2]}},"
           " {\"structured_answer\": {\"rows\": [[\"a\"], {\"cells\": [\"b\", \"c\"]}]}},"
           " {\"decomposition\": [\"x\", {\"title\": \"y\", \"ordering\": 9}]},"
           " {\"interrupt\": {\"pending_tool_intent\": {\"k\": 1}}},"
           " {\"status\": {\"status\": \"ERROR\", \"timestamp\": "
           "\"2026-12-03T10:00:00Z\"}},"
           " {\"complete\": \"bye\"}, {\"error\": {\"code\": null}}]");
    size_t n;
    const dw_op *op = dw_script_ops(s, &n);
    assert_int_equal(n, 11);
    assert_int_equal(op[0].ev->status->status,
                     UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_ACTING);
    assert_true(op[0].flags & DW_F_TIMESTAMP);
    assert_int_equal(op[1].ev->status->status,
                     UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_COMPLETE);
    assert_true(op[2].flags & DW_F_CALL_ID);
    assert_int_equal(op[2].ev->tool_call->arguments->n_fields, 1);
    assert_false(op[3].flags & DW_F_CALL_ID);
    assert_string_equal(op[3].ev->tool_call->tool_call_id, "mine");
    assert_string_equal(op[4].ev->tool_result->result, "[1,2]");
    assert_true(op[4].flags & DW_F_RESULT_ID);
    assert_int_equal(op[5].ev->structured_answer->n_rows, 2);
    assert_int_equal(op[5].ev->structured_answer->rows[1]->n_cells, 2);
    assert_string_equal(op[5].ev->structured_answer->rows[1]->cells[1], "c");
    assert_int_equal(op[6].ev->decomposition->n_todos, 2);
    assert_int_equal(op[6].ev->decomposition->todos[0]->ordering, 0);
    assert_int_equal(op[6].ev->decomposition->todos[1]->ordering, 9);
    assert_true(op[7].ends_step);
    assert_true(op[7].flags & DW_F_IDEM_KEY);
    assert_int_equal(op[7].ev->interrupt_required->pending_tool_intent.len, strlen("{\"k\":1}"));
    assert_false(op[8].flags & DW_F_TIMESTAMP);
    assert_int_equal(op[8].ev->status->timestamp->seconds, 1796292000);
    assert_string_equal(op[9].ev->completion->final_response, "bye");
    assert_true(op[9].flags & DW_F_USAGE);
    assert_string_equal(op[10].ev->error->code, "");
    dw_script_free(s);
}

static void test_control_directives(void **st) {
    (void)st;
    dw_script *s =
        ok("[{\"tokens\": \"a b\", \"delay_ms\": 5}, {\"sleep_ms\": 0}, {\"hang\": true},"
           " {\"crash\": true}, {\"checkpoint\": {\"state\": \"S\"}},"
           " {\"checkpoint\": true}, {\"inspect\": true}]");
    size_t n;
    const dw_op *op = dw_script_ops(s, &n);
    assert_int_equal(n, 7);
    assert_int_equal(op[0].kind, DW_OP_TOKENS);
    assert_int_equal(op[0].ms, 5);
    assert_int_equal(op[1].kind, DW_OP_SLEEP);
    assert_int_equal(op[2].kind, DW_OP_HANG);
    assert_int_equal(op[3].kind, DW_OP_CRASH);
    assert_int_equal(op[4].kind, DW_OP_CHECKPOINT);
    assert_string_equal(op[4].text, "S");
    assert_null(op[5].text);
    assert_int_equal(op[6].kind, DW_OP_INSPECT);
    dw_script_free(s);
}

static void test_malformed(void **st) {
    (void)st;
    bad("[", "script: not valid JSON", "");
    bad("[] x", "script: not valid JSON", "");
    bad("\"x\"", "expected a JSON array of directives, got a string", "");
    bad("[{}, {}, {}, {}]", "4 elements; at most 3", "");
    bad("[{\"token\": \"a\"}, null]", "script element 1: expected an object with one directive",
        "/1");
    bad("[{\"tool_call\": {\"arguments\": {\"a\": {\"b\": 1}}, \"tool_name\": 7}}]",
        "script element 0: tool_call.tool_name: expected a string, got a number",
        "/0/tool_call/tool_name");
    bad("[{\"status\": {\"status\": 99}}]", "99 is not a upsquad.runtime.v1.AgentStatus value",
        "/0/status/status");
    bad("[{\"status\": {\"timestamp\": \"yesterday\"}}]", "expected an RFC 3339 timestamp",
        "/0/status/timestamp");
    bad("[{\"structured_answer\": {\"columns\": \"a\"}}]", "columns: expected an array",
        "/0/structured_answer/columns");
    bad("[{\"decomposition\": [{\"title\": \"a\", \"extra\": 1}]}]",
        "decomposition.todos.0.extra: unknown field", "/0/decomposition/todos/0/extra");
    bad("[{\"complete\": 5}]", "complete: expected an object, got a number", "/0/complete");
    bad("[{\"complete\": {\"token_usage\": {\"cost_usd\": \"1\"}}}]",
        "complete.token_usage.cost_usd: expected a number", "/0/complete/token_usage/cost_usd");
    bad("[{\"token\": \"a\", \"delay_ms\": 60001}]", "delay_ms: 60001 is out of range",
        "/0/delay_ms");
    bad("[{\"inspect\": 1}]", "inspect: expected true", "/0/inspect");
    bad("[{\"ask_user\": {\"question_spec\": 5}}]",
        "ask_user.question_spec: expected a string, an object or an array",
        "/0/ask_user/question_spec");
    bad("[{\"security\": {\"detail\": \"\\ud800\"}}]", "", NULL); /* lone surrogate */
}

static void test_prices(void **st) {
    (void)st;
    assert_non_null(dw_price_lookup("gpt-5.5"));
    assert_null(dw_price_lookup("gpt-99"));
    assert_null(dw_price_lookup(""));
    assert_float_equal(dw_price_cost("gpt-5.5", 1000000, 1000000), 35.0, 1e-9);
    assert_float_equal(dw_price_cost("claude-haiku-5-5", 10, 20), (10 * 0.1 + 20 * 0.5) / 1e6,
                       1e-15);
    assert_float_equal(dw_price_cost("nope", 10, 20), 0.0, 0.0);
    size_t n;
    const dw_price *t = dw_price_table(&n);
    for (size_t i = 0; i < n; i++)
        for (size_t j = i + 1; j < n; j++)
            assert_string_not_equal(t[i].model_id, t[j].model_id);
}

static void test_jws_claims(void **st) {
    (void)st;
    /* {"alg":"HS256"} . {"sub":"a","n":1} . sig */
    cJSON *c = auth_claims_decode("eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJhIiwibiI6MX0.c2ln");
    assert_non_null(c);
    assert_string_equal(cJSON_GetObjectItem(c, "sub")->valuestring, "a");
    cJSON_Delete(c);
    assert_null(auth_claims_decode("no-dots"));
    assert_null(auth_claims_decode("a..b"));
    assert_null(auth_claims_decode("a.!!!!.b"));
    assert_null(auth_claims_decode(NULL));
}

static void test_pb_to_json(void **st) {
    (void)st;
    Upsquad__Runtime__V1__SessionSnapshot s = UPSQUAD__RUNTIME__V1__SESSION_SNAPSHOT__INIT;
    Upsquad__Runtime__V1__SessionSnapshot__RbacGrantsEntry e =
        UPSQUAD__RUNTIME__V1__SESSION_SNAPSHOT__RBAC_GRANTS_ENTRY__INIT;
    Upsquad__Runtime__V1__SessionSnapshot__RbacGrantsEntry *ep = &e;
    char *tools[] = {"a", "b"};
    e.key = "k";
    e.value = "v";
    s.model_id = "m";
    s.max_loops = 3;
    s.n_tools = 2;
    s.tools = tools;
    s.n_rbac_grants = 1;
    s.rbac_grants = &ep;
    s.execution_mode = UPSQUAD__RUNTIME__V1__EXECUTION_MODE__EXECUTION_MODE_AUTONOMOUS;
    cJSON *j = dw_pb_to_json(&s.base);
    char *txt = cJSON_PrintUnformatted(j);
    assert_string_equal(txt,
                        "{\"model_id\":\"m\",\"tools\":[\"a\",\"b\"],\"rbac_grants\":{\"k\":\"v\"},"
                        "\"max_loops\":3,\"execution_mode\":\"EXECUTION_MODE_AUTONOMOUS\"}");
    cJSON_free(txt);
    cJSON_Delete(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_detect),
        cmocka_unit_test(test_tokens),
        cmocka_unit_test(test_events_and_defaults),
        cmocka_unit_test(test_control_directives),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_prices),
        cmocka_unit_test(test_jws_claims),
        cmocka_unit_test(test_pb_to_json),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
