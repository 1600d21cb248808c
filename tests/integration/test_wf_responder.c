/* wf-responder over real NATS/JetStream (UPSQUAD_NATS_URL): this test plays the engine. It
 * publishes AgentStepDispatch on the AGENT_STEPS work queue and reads AgentStepResult on
 * agent.step.result.<org>.<run> (core subscription: a JetStream publish reaches core
 * subscribers too). Each cue's outcome, the default output, usage, durability across a
 * restart, duplicates answered from the record, poison dispatches, stats. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>
#include <cjson/cJSON.h>

#include "../lib/readyproc.h"
#include "bus.h"
#include "ids.h"
#include "log.h"
#include "pbjson.h"
#include "subjects.h"
#include "util.h"
#include "upsquad/internal/v1/agent_step.pb-c.h"

#define ORG "0d5e0000-0000-0000-0000-000000000001"
#define MAXR 64

typedef Upsquad__Internal__V1__AgentStepDispatch disp_t;
typedef Upsquad__Internal__V1__AgentStepResult res_t;

static bus *g_bus;
static readyproc g_proc;
static char g_bin[512], g_stats[96], g_env_stats[160];
static char g_run[37];
static int g_seq;
static bus_sub *g_sub;

/* Results received, by arrival. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* monotonic: setup() */
static res_t *g_res[MAXR];
static int g_nres;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void on_result(bus *b, natsMsg *m, void *ud) {
    (void)b;
    (void)ud;
    res_t *r = upsquad__internal__v1__agent_step_result__unpack(
        NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    pthread_mutex_lock(&g_mu);
    if (r && g_nres < MAXR)
        g_res[g_nres++] = r;
    else if (r)
        upsquad__internal__v1__agent_step_result__free_unpacked(r, NULL);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
}

/* The first result for key (borrowed; freed at teardown), waiting up to wait_ms. */
static const res_t *result_for(const char *key, int wait_ms) {
    int64_t end = now_ms() + wait_ms;
    pthread_mutex_lock(&g_mu);
    for (;;) {
        for (int i = 0; i < g_nres; i++)
            if (strcmp(g_res[i]->idempotency_key, key) == 0) {
                pthread_mutex_unlock(&g_mu);
                return g_res[i];
            }
        if (now_ms() >= end) break;
        struct timespec dl;
        util_deadline(&dl, 50);
        pthread_cond_timedwait(&g_cv, &g_mu, &dl);
    }
    pthread_mutex_unlock(&g_mu);
    return NULL;
}

static int results_for(const char *key) {
    int n = 0;
    pthread_mutex_lock(&g_mu);
    for (int i = 0; i < g_nres; i++)
        n += strcmp(g_res[i]->idempotency_key, key) == 0;
    pthread_mutex_unlock(&g_mu);
    return n;
}

typedef struct dspec {
    const char *goal;
    int attempt;
    const char *expects; /* "name:type,name:type" or NULL */
    int resume;          /* carries an AskUserResume */
    int no_msg_id;       /* published without Nats-Msg-Id (a re-publish outside the window) */
} dspec;

/* Publishes one dispatch; key receives its idempotency key. */
static void dispatch(const dspec *s, char key[65]) {
    char seed[128];
    snprintf(seed, sizeof seed, "%s:step%d:0:%d", g_run, ++g_seq, s->attempt ? s->attempt : 1);
    ids_sha256_hex(seed, strlen(seed), key);
    disp_t d = UPSQUAD__INTERNAL__V1__AGENT_STEP_DISPATCH__INIT;
    d.idempotency_key = key;
    d.org_id = ORG;
    d.run_id = g_run;
    d.workflow_id = "0d5e0000-0000-0000-0000-0000000000f1";
    d.action_id = "0d5e0000-0000-0000-0000-0000000000f2";
    char step[32];
    snprintf(step, sizeof step, "step%d", g_seq);
    d.step_name = step;
    d.attempt = s->attempt ? s->attempt : 1;
    d.agent_role = "architect";
    d.goal = (char *)s->goal;
    Upsquad__Internal__V1__ExpectedField fields[8], *fptr[8];
    char names[8][32], types[8][16];
    if (s->expects) {
        const char *p = s->expects;
        while (*p && d.n_expects < 8) {
            size_t i = d.n_expects;
            upsquad__internal__v1__expected_field__init(&fields[i]);
            sscanf(p, "%31[^:]:%15[^,]", names[i], types[i]);
            fields[i].name = names[i];
            fields[i].type = types[i];
            fields[i].required = 1;
            fptr[i] = &fields[i];
            d.n_expects++;
            p = strchr(p, ',');
            if (!p) break;
            p++;
        }
        d.expects = fptr;
    }
    Upsquad__Runtime__V1__AskUserResume resume = UPSQUAD__RUNTIME__V1__ASK_USER_RESUME__INIT;
    if (s->resume) {
        resume.answer_tool_result = (ProtobufCBinaryData){2, (uint8_t *)"{}"};
        d.ask_user_resume = &resume;
    }
    size_t n = upsquad__internal__v1__agent_step_dispatch__get_packed_size(&d);
    uint8_t *buf = malloc(n);
    upsquad__internal__v1__agent_step_dispatch__pack(&d, buf);
    char err[256];
    assert_int_equal(bus_js_publish(g_bus, SUBJ_AGENT_STEP_DISPATCH, buf, (int)n,
                                    s->no_msg_id ? NULL : key, NULL, err, sizeof err),
                     BUS_OK);
    free(buf);
}

static const res_t *run_step(const dspec *s, char key[65]) {
    dispatch(s, key);
    const res_t *r = result_for(key, 10000);
    assert_non_null(r);
    return r;
}

static cJSON *stats(const char *query) {
    natsMsg *reply = NULL;
    assert_int_equal(
        bus_request(g_bus, g_stats, query, query ? (int)strlen(query) : 0, 5000, &reply), BUS_OK);
    cJSON *j = cJSON_ParseWithLength(natsMsg_GetData(reply), (size_t)natsMsg_GetDataLength(reply));
    natsMsg_Destroy(reply);
    assert_non_null(j);
    return j;
}

static double num(const cJSON *o, const char *name) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, name);
    assert_true(cJSON_IsNumber(v));
    return v->valuedouble;
}

static cJSON *output_of(const res_t *r) {
    assert_int_equal(r->outcome_case, UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED);
    cJSON *o = pbjson_struct_to_json(r->completed->output);
    assert_non_null(o);
    return o;
}

/* ---- tests ---- */

static void test_default_completes_with_expected_fields(void **state) {
    (void)state;
    char key[65];
    dspec s = {.goal = "Design a fix for #42",
               .expects = "plan:string,files:array,approved:boolean"};
    const res_t *r = run_step(&s, key);
    assert_string_equal(r->org_id, ORG);
    assert_string_equal(r->run_id, g_run);
    assert_int_equal(r->attempt, 1);
    assert_true(ids_uuid_valid(r->session_id));
    assert_true(ids_uuid_valid(r->agent_id));
    assert_non_null(r->finished_at);
    cJSON *o = output_of(r);
    assert_true(cJSON_IsString(cJSON_GetObjectItemCaseSensitive(o, "plan")));
    assert_true(cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(o, "files")));
    assert_true(cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "approved")));
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(o, "goal")->valuestring,
                        "Design a fix for #42");
    cJSON_Delete(o);
    assert_non_null(strstr(r->completed->text, "Design a fix"));
    assert_non_null(r->usage);
    assert_true(r->usage->input_tokens > 0 && r->usage->output_tokens > 0);
    assert_true(r->usage->cost_usd > 0);
}

static void test_fail_cues(void **state) {
    (void)state;
    char key[65];
    dspec s = {.goal = "do it #fail"};
    const res_t *r = run_step(&s, key);
    assert_int_equal(r->outcome_case, UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_FAILED);
    assert_string_equal(r->failed->code, "worker_error");
    assert_false(r->failed->retryable);
    s.goal = "do it #fail=agent_not_found";
    r = run_step(&s, key);
    assert_string_equal(r->failed->code, "agent_not_found");
    s.goal = "do it #fail_retryable";
    r = run_step(&s, key);
    assert_true(r->failed->retryable);
    /* attempts 1..N fail retryably, then the step completes */
    s.goal = "flaky #fail_attempts=1";
    s.attempt = 1;
    r = run_step(&s, key);
    assert_int_equal(r->outcome_case, UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_FAILED);
    assert_true(r->failed->retryable);
    s.attempt = 2;
    r = run_step(&s, key);
    assert_int_equal(r->outcome_case, UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED);
}

static void test_parks(void **state) {
    (void)state;
    char key[65];
    dspec s = {.goal = "Which environment? #input_required"};
    const res_t *r = run_step(&s, key);
    assert_int_equal(r->outcome_case,
                     UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INPUT_REQUIRED);
    assert_string_equal(r->input_required->tool_name, "ask_user");
    assert_int_equal(strlen(r->input_required->idempotency_key), 64);
    cJSON *spec = cJSON_ParseWithLength((const char *)r->input_required->question_spec.data,
                                        r->input_required->question_spec.len);
    assert_non_null(spec);
    assert_non_null(strstr(cJSON_GetObjectItemCaseSensitive(spec, "question")->valuestring,
                           "Which environment?"));
    cJSON_Delete(spec);
    /* the answer comes back on a dispatch that resumes the turn: it completes */
    s.resume = 1;
    r = run_step(&s, key);
    assert_int_equal(r->outcome_case, UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED);

    dspec t = {.goal = "merge it #interrupt_required"};
    r = run_step(&t, key);
    assert_int_equal(r->outcome_case,
                     UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INTERRUPT_REQUIRED);
    assert_true(r->interrupt_required->pending_tool_intent.len > 0);
}

static void test_output_and_usage_cues(void **state) {
    (void)state;
    char key[65];
    dspec s = {.goal =
                   "Review #output={\"verdict\":\"approve\",\"comments\":[\"ok }\"]} #usage=100,50 "
                   "#cost=0.25"};
    const res_t *r = run_step(&s, key);
    cJSON *o = output_of(r);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(o, "verdict")->valuestring, "approve");
    assert_string_equal(
        cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(o, "comments"), 0)->valuestring,
        "ok }");
    assert_null(cJSON_GetObjectItemCaseSensitive(o, "goal")); /* exactly the cue's object */
    cJSON_Delete(o);
    assert_int_equal(r->usage->input_tokens, 100);
    assert_int_equal(r->usage->output_tokens, 50);
    assert_true(r->usage->cost_usd > 0.249 && r->usage->cost_usd < 0.251);

    /* a per-attempt output: attempt 1 gets the plain one, attempt 2 its own (redo tests) */
    dspec t = {.goal = "Draft #output={\"n\":1} #output@2={\"n\":2}", .attempt = 1};
    r = run_step(&t, key);
    o = output_of(r);
    assert_int_equal(cJSON_GetObjectItemCaseSensitive(o, "n")->valueint, 1);
    cJSON_Delete(o);
    t.attempt = 2;
    r = run_step(&t, key);
    o = output_of(r);
    assert_int_equal(cJSON_GetObjectItemCaseSensitive(o, "n")->valueint, 2);
    cJSON_Delete(o);
}

static void test_sleep_does_not_block_other_steps(void **state) {
    (void)state;
    char slow[65], fast[65];
    dspec s = {.goal = "slow #sleep_ms=1200"}, f = {.goal = "fast"};
    int64_t t0 = now_ms();
    dispatch(&s, slow);
    usleep(100 * 1000);
    dispatch(&f, fast);
    assert_non_null(result_for(fast, 5000));
    assert_true(now_ms() - t0 < 1100);
    assert_non_null(result_for(slow, 5000));
    assert_true(now_ms() - t0 >= 1200);
}

/* A dispatch re-published with the same key (outside JetStream's duplicate window): answered
 * from the record, counted as a second dispatch, never executed twice. */
static void test_duplicate_dispatch_answered_from_record(void **state) {
    (void)state;
    char key[65], again[65];
    dspec s = {.goal = "once", .no_msg_id = 1};
    dispatch(&s, key);
    assert_non_null(result_for(key, 5000));
    g_seq--; /* the same step, attempt and so key */
    dispatch(&s, again);
    assert_string_equal(key, again);
    for (int i = 0; i < 100 && results_for(key) < 2; i++)
        usleep(20 * 1000);
    assert_int_equal(results_for(key), 2);
    char q[128];
    snprintf(q, sizeof q, "{\"key\":\"%s\"}", key);
    cJSON *st = stats(q);
    const cJSON *rec = cJSON_GetObjectItemCaseSensitive(st, "record");
    assert_int_equal((int)num(rec, "dispatches"), 2);
    assert_int_equal((int)num(rec, "executions"), 1);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(rec, "outcome")->valuestring, "completed");
    cJSON_Delete(st);
}

static void test_poison_dispatch_rejected(void **state) {
    (void)state;
    cJSON *st = stats(NULL);
    double before = num(st, "rejected");
    cJSON_Delete(st);
    char err[256];
    assert_int_equal(
        bus_js_publish(g_bus, SUBJ_AGENT_STEP_DISPATCH, "\xff\xff", 2, NULL, NULL, err, sizeof err),
        BUS_OK);
    double after = before;
    for (int i = 0; i < 100 && after == before; i++) {
        usleep(20 * 1000);
        st = stats(NULL);
        after = num(st, "rejected");
        cJSON_Delete(st);
    }
    assert_true(after == before + 1);
}

/* Dispatches published while the consumer is down are answered once it is back (durable). */
static void test_restart_keeps_the_queue(void **state) {
    (void)state;
    assert_int_equal(readyproc_stop(&g_proc), 0);
    char key[65];
    dspec s = {.goal = "while you were away"};
    dispatch(&s, key);
    const char *env[] = {g_env_stats, NULL};
    assert_int_equal(readyproc_start(&g_proc, g_bin, env, 10000), 0);
    assert_non_null(result_for(key, 10000));
}

static void test_stats_by_run(void **state) {
    (void)state;
    char q[128];
    snprintf(q, sizeof q, "{\"run_id\":\"%s\"}", g_run);
    cJSON *st = stats(q);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(st, "consumer")->valuestring,
                        "wf-responder");
    assert_int_equal((int)num(st, "max_executions_per_key"), 1);
    assert_int_equal((int)num(st, "evicted"), 0);
    const cJSON *recs = cJSON_GetObjectItemCaseSensitive(st, "records");
    assert_true(cJSON_GetArraySize(recs) >= 1); /* this instance's (restarted) steps */
    for (const cJSON *r = recs->child; r; r = r->next)
        assert_int_equal((int)num(r, "executions"), 1);
    cJSON_Delete(st);
}

static int setup(void **state) {
    util_cond_init_monotonic(&g_cv);
    (void)state;
    char err[256], subject[128];
    if (bus_connect(getenv("UPSQUAD_NATS_URL"), "test_wf_responder", &g_bus, err, sizeof err) !=
        BUS_OK)
        return -1;
    /* a clean queue; wf-responder must create the streams itself when they are missing */
    if (bus_js_stream_delete(g_bus, STREAM_AGENT_STEPS, err, sizeof err) != BUS_OK ||
        bus_js_stream_delete(g_bus, STREAM_AGENT_RESULTS, err, sizeof err) != BUS_OK)
        return -1;
    snprintf(subject, sizeof subject, "%s.%s.%s", SUBJ_AGENT_STEP_RESULT, ORG, g_run);
    if (bus_subscribe(g_bus, subject, NULL, on_result, NULL, &g_sub, err, sizeof err) != BUS_OK ||
        bus_flush(g_bus, 5000) != BUS_OK)
        return -1;
    const char *b = getenv("BUILD");
    snprintf(g_bin, sizeof g_bin, "%s/bin/wf-responder", b ? b : "build");
    snprintf(g_stats, sizeof g_stats, "wf-responder.stats.t%d", (int)getpid());
    snprintf(g_env_stats, sizeof g_env_stats, "UPSQUAD_WF_RESPONDER_STATS_SUBJECT=%s", g_stats);
    const char *env[] = {g_env_stats, NULL};
    if (readyproc_start(&g_proc, g_bin, env, 10000) != 0) return -1;
    uint64_t msgs = 0;
    return bus_js_stream_msgs(g_bus, STREAM_AGENT_STEPS, &msgs, err, sizeof err) == BUS_OK &&
                   bus_js_stream_msgs(g_bus, STREAM_AGENT_RESULTS, &msgs, err, sizeof err) == BUS_OK
               ? 0
               : -1;
}

static int teardown(void **state) {
    (void)state;
    char err[256];
    int rc = readyproc_stop(&g_proc) == 0 ? 0 : -1;
    bus_unsubscribe(g_sub);
    bus_js_stream_delete(g_bus, STREAM_AGENT_STEPS, err, sizeof err);
    bus_js_stream_delete(g_bus, STREAM_AGENT_RESULTS, err, sizeof err);
    bus_close(g_bus);
    for (int i = 0; i < g_nres; i++)
        upsquad__internal__v1__agent_step_result__free_unpacked(g_res[i], NULL);
    return rc;
}

int main(void) {
    const char *url = getenv("UPSQUAD_NATS_URL");
    if (!url || !*url) {
        printf("SKIP test_wf_responder: UPSQUAD_NATS_URL is not set\n");
        return 0;
    }
    log_init("test_wf_responder", LOG_ERROR);
    if (ids_uuid_v4(g_run) != 0) return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_default_completes_with_expected_fields),
        cmocka_unit_test(test_fail_cues),
        cmocka_unit_test(test_parks),
        cmocka_unit_test(test_output_and_usage_cues),
        cmocka_unit_test(test_sleep_does_not_block_other_steps),
        cmocka_unit_test(test_duplicate_dispatch_answered_from_record),
        cmocka_unit_test(test_poison_dispatch_rejected),
        cmocka_unit_test(test_restart_keeps_the_queue),
        cmocka_unit_test(test_stats_by_run),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    bus_library_shutdown();
    return failed;
}
