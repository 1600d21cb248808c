/* Unit tests of the engine's pure parts: templates and conditions over the run state, field
 * specs, page tokens, and the spec's projection rules (status fold, blocked_by). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../../services/workflow-engine/interp.h"
#include "pagetok.h"
#include "../../../services/workflow-engine/wf.h"
#include "../../../services/workflow-engine/wf_expr.h"

static const char *STATE =
    "{\"trigger\":{\"n\":5,\"title\":\"Hello\"},"
    "\"steps\":{\"a\":{\"status\":\"completed\",\"output\":{\"x\":[1,2],\"s\":\"abc\",\"k\":3}},"
    "\"a/b\":{\"status\":\"completed\",\"output\":{\"v\":true}}},"
    "\"loop\":{\"iteration\":2,\"max_iterations\":3}}";

static void test_templates(void **ctx) {
    (void)ctx;
    cJSON *st = cJSON_Parse(STATE);
    char err[200];
    cJSON *v = wf_expr_render(st, "${/trigger/n}", err, sizeof err);
    assert_true(cJSON_IsNumber(v)); /* exactly one template keeps its type */
    assert_int_equal(v->valueint, 5);
    cJSON_Delete(v);
    v = wf_expr_render(st, "#${/trigger/n}: ${/trigger/title} ${/steps/a/output/x} $${x}", err,
                       sizeof err);
    assert_string_equal(v->valuestring, "#5: Hello [1,2] ${x}");
    cJSON_Delete(v);
    v = wf_expr_render(st, "${/steps/a~1b/output/v}", err, sizeof err);
    assert_true(cJSON_IsTrue(v));
    cJSON_Delete(v);
    assert_null(wf_expr_render(st, "x ${/steps/zz/output}", err, sizeof err));
    assert_non_null(strstr(err, "/steps/zz/output"));
    cJSON *with =
        cJSON_Parse("{\"n\":\"${/loop/iteration}\",\"l\":[\"${/trigger/title}\"],\"k\":1}");
    v = wf_expr_render_tree(st, with, err, sizeof err);
    char *s = cJSON_PrintUnformatted(v);
    assert_string_equal(s, "{\"n\":2,\"l\":[\"Hello\"],\"k\":1}");
    free(s);
    cJSON_Delete(v);
    cJSON_Delete(with);
    cJSON_Delete(st);
}

static int holds(const cJSON *st, const char *cond) {
    cJSON *c = cJSON_Parse(cond);
    int r = wf_expr_holds(st, c);
    cJSON_Delete(c);
    return r;
}

static void test_conditions(void **ctx) {
    (void)ctx;
    cJSON *st = cJSON_Parse(STATE);
    assert_true(holds(st, "{\"op\":\"eq\",\"path\":\"/trigger/n\",\"value\":5.0}"));
    assert_true(holds(st, "{\"op\":\"gte\",\"path\":\"/loop/iteration\",\"value\":2}"));
    assert_false(holds(st, "{\"op\":\"gt\",\"path\":\"/trigger/title\",\"value\":1}"));
    assert_true(holds(st, "{\"op\":\"contains\",\"path\":\"/steps/a/output/x\",\"value\":2}"));
    assert_true(holds(st, "{\"op\":\"contains\",\"path\":\"/steps/a/output/s\",\"value\":\"bc\"}"));
    assert_true(holds(st, "{\"op\":\"in\",\"path\":\"/steps/a/output/k\",\"value\":[1,3]}"));
    /* a comparison on an absent value is false, ne and not_in included */
    assert_false(holds(st, "{\"op\":\"ne\",\"path\":\"/nope\",\"value\":1}"));
    assert_false(holds(st, "{\"op\":\"not_in\",\"path\":\"/nope\",\"value\":[1]}"));
    assert_true(holds(st, "{\"op\":\"not_exists\",\"path\":\"/nope\"}"));
    assert_true(holds(st, "{\"op\":\"all\",\"of\":[{\"op\":\"exists\",\"path\":\"/trigger\"},"
                          "{\"op\":\"none\",\"of\":[{\"op\":\"exists\",\"path\":\"/x\"}]}]}"));
    assert_false(holds(st, "{\"op\":\"any\",\"of\":[{\"op\":\"exists\",\"path\":\"/x\"}]}"));
    cJSON_Delete(st);
}

static void test_field_specs(void **ctx) {
    (void)ctx;
    char err[200];
    cJSON *spec = cJSON_Parse("{\"plan\":{\"type\":\"string\",\"required\":true},"
                              "\"n\":{\"type\":\"integer\"}}");
    cJSON *ok = cJSON_Parse("{\"plan\":\"p\",\"n\":2}");
    cJSON *missing = cJSON_Parse("{\"n\":2}");
    cJSON *badtype = cJSON_Parse("{\"plan\":\"p\",\"n\":2.5}");
    assert_int_equal(wf_expr_check_fields(spec, ok, "output", err, sizeof err), 0);
    assert_int_equal(wf_expr_check_fields(spec, missing, "output", err, sizeof err), -1);
    assert_string_equal(err, "output.plan is required");
    assert_int_equal(wf_expr_check_fields(spec, badtype, "output", err, sizeof err), -1);
    assert_string_equal(err, "output.n must be of type integer");
    cJSON_Delete(spec);
    cJSON_Delete(ok);
    cJSON_Delete(missing);
    cJSON_Delete(badtype);
}

static void test_page_tokens(void **ctx) {
    (void)ctx;
    unsigned char key[32] = {1, 2, 3}, other[32] = {9};
    char q1[65], q2[65], tok[PAGETOK_MAX + 1], id[37];
    const char *p1[] = {"ListRuns", "org-a", "m", "wf", "0"};
    const char *p2[] = {"ListRuns", "org-b", "m", "wf", "0"};
    pagetok_query(q1, p1, 5);
    pagetok_query(q2, p2, 5);
    const char *uuid = "01a23ab2-a341-73c2-b513-a83badce79a4";
    assert_int_equal(pagetok_make(key, q1, 1796281049123456LL, uuid, tok, sizeof tok), 0);
    int64_t us = 0;
    assert_int_equal(pagetok_parse(key, q1, tok, &us, id), 0);
    assert_true(us == 1796281049123456LL);
    assert_string_equal(id, uuid);
    assert_int_equal(pagetok_parse(key, q2, tok, &us, id), -1);   /* another query / org */
    assert_int_equal(pagetok_parse(other, q1, tok, &us, id), -1); /* another key */
    tok[2] = tok[2] == 'A' ? 'B' : 'A';                           /* tampered */
    assert_int_equal(pagetok_parse(key, q1, tok, &us, id), -1);
    assert_int_equal(pagetok_parse(key, q1, "garbage", &us, id), -1);
    assert_int_equal(pagetok_parse(key, q1, "", &us, id), -1);
}

static void test_projection(void **ctx) {
    (void)ctx;
    static const char *const raw[] = {"pending",   "in_progress", "awaiting_approval", "waiting",
                                      "escalated", "approved",    "completed",         "skipped",
                                      "rejected",  "failed"};
    static const char *const fold[] = {"queued", "running", "blocked", "blocked", "blocked",
                                       "done",   "done",    "done",    "failed",  "failed"};
    static const int terminal[] = {0, 0, 0, 0, 0, 1, 1, 1, 1, 1};
    for (int i = 0; i < 10; i++) {
        assert_string_equal(wf_fold_status(raw[i]), fold[i]);
        assert_int_equal(wf_raw_terminal(raw[i]), terminal[i]);
    }
    assert_string_equal(wf_project_blocked_by("waiting", "waiting-on-signal"), "waiting-on-signal");
    assert_string_equal(wf_project_blocked_by("completed", "waiting-on-signal"), "");
    assert_string_equal(wf_project_blocked_by("awaiting_approval", "awaiting-question"),
                        "awaiting-question");
    assert_true(wf_run_terminal("cancelled") && !wf_run_terminal("paused"));
}

/* The relay's plan: a run's events between two other rows in one message (both subjects),
 * other runs' alongside in the same wave, every other row alone in its message and its wave,
 * and a run's events past a message's bound in a new message of a later wave. */
static void test_relay_plan(void **ctx) {
    (void)ctx;
    const char *rows[] = {
        "wf.status.o.r1",         /* m0 w0 */
        "wf.status.o.r2",         /* m1 w0 */
        "wf.log.o.r1",            /* m0: r1's second event, the same message */
        "wf.status.o.r1",         /* m0 */
        "wf.status.o.r3",         /* m2 w0 */
        "agent.step.dispatch",    /* m3 w1: a barrier after everything above */
        "wf.status.o.r2",         /* m4 w2: after the barrier, a new message */
        "wf.status.o.r4",         /* m5 w2 */
        "agent.step.cancel.o.r4", /* m6 w3: a barrier */
        "approval.decided.o",     /* m7 w4: a barrier */
        "wf.status.o.r4",         /* m8 w5 */
        "wf.log.o.r4",            /* m8 */
    };
    int n = (int)(sizeof rows / sizeof rows[0]), lens[16], msg[16], wave[16];
    int want_msg[] = {0, 1, 0, 0, 2, 3, 4, 5, 6, 7, 8, 8};
    int want_wave[] = {0, 0, 0, 1, 2, 2, 3, 4, 5};
    for (int i = 0; i < n; i++)
        lens[i] = 100;
    assert_int_equal(wf_relay_plan(rows, lens, n, msg, wave), 9);
    for (int i = 0; i < n; i++)
        assert_int_equal(msg[i], want_msg[i]);
    for (int m = 0; m < 9; m++)
        assert_int_equal(wave[m], want_wave[m]);
    assert_int_equal(wf_relay_plan(rows, lens, 0, msg, wave), 0);
    /* many runs, one event each: a message each, a single wave */
    static char subj[600][64];
    static const char *many[600];
    static int l[600], ms[600], w[600];
    for (int i = 0; i < 600; i++) {
        snprintf(subj[i], sizeof subj[i], "wf.status.o.run%d", i);
        many[i] = subj[i];
        l[i] = 100;
    }
    assert_int_equal(wf_relay_plan(many, l, 300, ms, w), 300);
    for (int i = 0; i < 300; i++)
        assert_int_equal(w[ms[i]], 0);
    /* one run, many events: messages of WF_RELAY_BATCH_EVENTS, one per wave */
    for (int i = 0; i < 600; i++)
        many[i] = subj[7];
    int nm = (600 + WF_RELAY_BATCH_EVENTS - 1) / WF_RELAY_BATCH_EVENTS;
    assert_int_equal(wf_relay_plan(many, l, 600, ms, w), nm);
    for (int i = 0; i < 600; i++) {
        assert_int_equal(ms[i], i / WF_RELAY_BATCH_EVENTS);
        assert_int_equal(w[ms[i]], i / WF_RELAY_BATCH_EVENTS);
    }
    /* and by bytes: events of a third of the bound, three per message at most */
    for (int i = 0; i < 7; i++)
        l[i] = WF_RELAY_BATCH_BYTES / 3 - 8;
    assert_int_equal(wf_relay_plan(many, l, 7, ms, w), 3);
    assert_int_equal(ms[2], 0);
    assert_int_equal(ms[3], 1);
    assert_int_equal(ms[6], 2);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_templates),   cmocka_unit_test(test_conditions),
        cmocka_unit_test(test_field_specs), cmocka_unit_test(test_page_tokens),
        cmocka_unit_test(test_projection),  cmocka_unit_test(test_relay_plan),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
