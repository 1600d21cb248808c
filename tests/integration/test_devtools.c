/* devtools over real NATS (UPSQUAD_NATS_URL): every catalogued action answers from its
 * fixture, each cue, de-duplication by idempotency key, batches (their delayed calls side by
 * side on the workers), stats, announcements, the dedup bound.
 * Needs the whole bus to itself for the tool subjects (tests run one at a time). */
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
#include "log.h"
#include "pbjson.h"
#include "subjects.h"
#include "upsquad/internal/v1/tool.pb-c.h"

#define DEDUP_KEYS 200 /* small, so that the bound is reached by the last test */
#define TEST_WORKERS 8 /* UPSQUAD_DEVTOOLS_WORKERS: a batch of 8 delayed calls runs at once */
#define TEST_QUEUE 8   /* UPSQUAD_DEVTOOLS_QUEUE: a batch of 12 delayed calls overflows it */

typedef Upsquad__Internal__V1__ToolInvokeRequest req_t;
typedef Upsquad__Internal__V1__ToolInvokeResponse resp_t;

static bus *g_bus;
static readyproc g_proc;
static char g_run[64];      /* run id of this test process */
static char g_stats[96];    /* the instance's stats subject */
static char g_catalog[512]; /* path of the catalogue */
static int g_seq;
static const char *g_step = "step"; /* step_name of the requests */

/* Announcements seen on tool.announce (a subscription made before devtools started). */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_announces;
static size_t g_announced_actions;
static bus_sub *g_announce_sub;

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void on_announce(bus *b, natsMsg *m, void *ud) {
    (void)b;
    (void)ud;
    Upsquad__Internal__V1__ToolAnnounce *a = upsquad__internal__v1__tool_announce__unpack(
        NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    if (!a) return; /* an empty discovery request */
    size_t n = 0;
    for (size_t i = 0; i < a->n_tools; i++)
        n += a->tools[i]->n_actions;
    pthread_mutex_lock(&g_mu);
    if (strcmp(a->provider, "devtools") == 0) {
        g_announces++;
        g_announced_actions = n;
    }
    pthread_mutex_unlock(&g_mu);
    upsquad__internal__v1__tool_announce__free_unpacked(a, NULL);
}

static void new_key(char *key, size_t len) {
    snprintf(key, len, "k-%s-%d", g_run, ++g_seq);
}

/* One invocation: args_json (object text, NULL = {}), request timeout field timeout_field_ms,
 * waiting wait_ms for the reply. *out NULL on a bus error (returned). Caller frees *out. */
static int invoke_full(const char *tool, const char *action, const char *key, const char *args_json,
                       int timeout_field_ms, int wait_ms, resp_t **out) {
    *out = NULL;
    req_t q = UPSQUAD__INTERNAL__V1__TOOL_INVOKE_REQUEST__INIT;
    q.idempotency_key = (char *)key;
    q.org_id = "0d5e0000-0000-0000-0000-000000000001";
    q.run_id = g_run;
    q.step_name = (char *)g_step;
    q.tool = (char *)tool;
    q.action = (char *)action;
    q.timeout_ms = timeout_field_ms;
    char err[256];
    cJSON *args = cJSON_Parse(args_json ? args_json : "{}");
    assert_non_null(args);
    assert_int_equal(pbjson_struct_from_json(args, &q.arguments, err, sizeof err), 0);
    cJSON_Delete(args);
    size_t n = upsquad__internal__v1__tool_invoke_request__get_packed_size(&q);
    uint8_t *buf = malloc(n + 1);
    upsquad__internal__v1__tool_invoke_request__pack(&q, buf);
    pbjson_struct_free(q.arguments);
    char subject[128];
    snprintf(subject, sizeof subject, "%s.%s", SUBJ_TOOL_INVOKE, tool);
    natsMsg *reply = NULL;
    int rc = bus_request(g_bus, subject, buf, (int)n, wait_ms, &reply);
    free(buf);
    if (rc != BUS_OK) return rc;
    *out = upsquad__internal__v1__tool_invoke_response__unpack(
        NULL, (size_t)natsMsg_GetDataLength(reply), (const uint8_t *)natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    assert_non_null(*out);
    return 0;
}

static resp_t *invoke(const char *tool, const char *action, const char *key, const char *args) {
    resp_t *r = NULL;
    assert_int_equal(invoke_full(tool, action, key, args, 0, 5000, &r), 0);
    return r;
}

static void resp_free(resp_t *r) {
    upsquad__internal__v1__tool_invoke_response__free_unpacked(r, NULL);
}

static cJSON *result_json(const resp_t *r) {
    assert_non_null(r->result);
    cJSON *j = pbjson_struct_to_json(r->result);
    assert_non_null(j);
    return j;
}

/* Stats as JSON; query NULL or a JSON object text. Caller frees. */
static cJSON *stats(const char *query) {
    natsMsg *reply = NULL;
    int len = query ? (int)strlen(query) : 0;
    assert_int_equal(bus_request(g_bus, g_stats, query, len, 5000, &reply), BUS_OK);
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

/* The record of one key: tries, executions, replays. */
static void key_counts(const char *key, int *tries, int *execs, int *replays) {
    char q[256];
    snprintf(q, sizeof q, "{\"key\":\"%s\"}", key);
    cJSON *s = stats(q);
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(s, "record");
    assert_true(cJSON_IsObject(r));
    *tries = (int)num(r, "tries");
    *execs = (int)num(r, "executions");
    *replays = (int)num(r, "replays");
    cJSON_Delete(s);
}

/* ---- tests ---- */

/* A value of the argument's type, so that every required argument can be sent. */
static cJSON *sample(const char *type) {
    if (strcmp(type, "string") == 0) return cJSON_CreateString("acme/widgets");
    if (strcmp(type, "integer") == 0 || strcmp(type, "number") == 0) return cJSON_CreateNumber(7);
    if (strcmp(type, "boolean") == 0) return cJSON_CreateTrue();
    if (strcmp(type, "array") == 0) return cJSON_CreateArray();
    return cJSON_CreateObject();
}

static void test_every_catalogued_action_answers(void **state) {
    (void)state;
    FILE *f = fopen(g_catalog, "rb");
    assert_non_null(f);
    static char text[1 << 20];
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    cJSON *cat = cJSON_ParseWithLength(text, n);
    assert_non_null(cat);
    size_t actions = 0;
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(cat, "tools");
    for (const cJSON *t = tools->child; t; t = t->next) {
        const char *tool = cJSON_GetObjectItemCaseSensitive(t, "tool")->valuestring;
        const cJSON *acts = cJSON_GetObjectItemCaseSensitive(t, "actions");
        for (const cJSON *a = acts->child; a; a = a->next) {
            const char *action = cJSON_GetObjectItemCaseSensitive(a, "action")->valuestring;
            cJSON *args = cJSON_CreateObject();
            const cJSON *list = cJSON_GetObjectItemCaseSensitive(a, "args");
            for (const cJSON *g = list->child; g; g = g->next)
                if (cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(g, "required")))
                    cJSON_AddItemToObject(
                        args, cJSON_GetObjectItemCaseSensitive(g, "name")->valuestring,
                        sample(cJSON_GetObjectItemCaseSensitive(g, "type")->valuestring));
            char *txt = cJSON_PrintUnformatted(args);
            char key[96];
            new_key(key, sizeof key);
            resp_t *r = invoke(tool, action, key, txt);
            if (!r->ok) fail_msg("%s.%s: %s %s", tool, action, r->error_code, r->error_message);
            assert_non_null(r->result);
            assert_true(r->result->n_fields > 0);
            assert_false(r->replayed);
            resp_free(r);
            free(txt);
            cJSON_Delete(args);
            actions++;
        }
    }
    pthread_mutex_lock(&g_mu);
    assert_int_equal(g_announced_actions, actions); /* the announcement lists them all */
    pthread_mutex_unlock(&g_mu);
    cJSON_Delete(cat);
}

static void test_fixture_templated_with_input(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    resp_t *r = invoke("github", "get_issue", key, "{\"repo\":\"acme/widgets\",\"number\":42}");
    assert_true(r->ok);
    cJSON *j = result_json(r);
    const cJSON *number = cJSON_GetObjectItemCaseSensitive(j, "number");
    assert_true(cJSON_IsNumber(number)); /* a whole-value template keeps the input's type */
    assert_int_equal((int)number->valuedouble, 42);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "html_url")->valuestring,
                        "https://github.com/acme/widgets/issues/42");
    cJSON_Delete(j);
    resp_free(r);

    /* deterministic: another key with the same input renders the same text */
    new_key(key, sizeof key);
    r = invoke("github", "create_issue", key, "{\"repo\":\"acme/ops\",\"title\":\"Postmortem\"}");
    assert_true(r->ok);
    j = result_json(r);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "title")->valuestring, "Postmortem");
    assert_true(cJSON_IsArray(cJSON_GetObjectItemCaseSensitive(j, "labels"))); /* default [] */
    double n = cJSON_GetObjectItemCaseSensitive(j, "number")->valuedouble;
    assert_true(n >= 100 && n < 10000);
    cJSON_Delete(j);
    resp_free(r);
}

static void test_dedup_replays_recorded_result(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    const char *args = "{\"repo\":\"acme/widgets\",\"number\":5,\"body\":\"hi\"}";
    resp_t *a = invoke("github", "create_comment", key, args);
    resp_t *b = invoke("github", "create_comment", key, args);
    assert_true(a->ok && b->ok);
    assert_false(a->replayed);
    assert_true(b->replayed);
    cJSON *ja = result_json(a), *jb = result_json(b);
    assert_true(cJSON_Compare(ja, jb, 1));
    cJSON_Delete(ja);
    cJSON_Delete(jb);
    resp_free(a);
    resp_free(b);
    int tries, execs, replays;
    key_counts(key, &tries, &execs, &replays);
    assert_int_equal(tries, 1);
    assert_int_equal(execs, 1);
    assert_int_equal(replays, 1);
}

static void test_fail_is_permanent_and_recorded(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    resp_t *r = invoke("github", "get_issue", key,
                       "{\"repo\":\"acme/widgets\",\"number\":1,\"__fail\":true}");
    assert_false(r->ok);
    assert_string_equal(r->error_code, "provider_error");
    assert_false(r->retryable);
    assert_null(r->result);
    resp_free(r);
    r = invoke("github", "get_issue", key,
               "{\"repo\":\"acme/widgets\",\"number\":1,\"__fail\":true}");
    assert_false(r->ok);
    assert_true(r->replayed); /* the failure is the key's recorded outcome */
    resp_free(r);

    new_key(key, sizeof key);
    r = invoke("github", "get_issue", key,
               "{\"repo\":\"acme/widgets\",\"number\":1,\"__fail\":\"not_found\"}");
    assert_false(r->ok);
    assert_string_equal(r->error_code, "not_found");
    resp_free(r);
}

static void test_fail_times_then_succeeds(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    const char *args = "{\"repo\":\"acme/widgets\",\"number\":3,\"__fail_times\":2}";
    for (int i = 0; i < 2; i++) {
        resp_t *r = invoke("github", "merge_pull_request", key, args);
        assert_false(r->ok);
        assert_true(r->retryable);
        assert_false(r->replayed);
        resp_free(r);
    }
    resp_t *r = invoke("github", "merge_pull_request", key, args);
    assert_true(r->ok);
    assert_false(r->replayed);
    resp_free(r);
    r = invoke("github", "merge_pull_request", key, args);
    assert_true(r->ok);
    assert_true(r->replayed);
    resp_free(r);
    int tries, execs, replays;
    key_counts(key, &tries, &execs, &replays);
    assert_int_equal(tries, 3);
    assert_int_equal(execs, 1);
    assert_int_equal(replays, 1);
}

/* Cues written inside a string argument work where a definition cannot add arguments. */
static void test_cue_inside_string_argument(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    const char *args = "{\"repo\":\"acme/widgets\",\"number\":3,\"body\":\"note __fail_times=1\"}";
    resp_t *r = invoke("github", "create_comment", key, args);
    assert_false(r->ok);
    assert_true(r->retryable);
    resp_free(r);
    r = invoke("github", "create_comment", key, args);
    assert_true(r->ok);
    resp_free(r);

    /* __init__ in free text is not a cue */
    new_key(key, sizeof key);
    r = invoke("github", "create_comment", key,
               "{\"repo\":\"a/b\",\"number\":1,\"body\":\"see __init__.py and x__fail\"}");
    assert_true(r->ok);
    resp_free(r);

    new_key(key, sizeof key);
    r = invoke(
        "github", "create_comment", key,
        "{\"repo\":\"a/b\",\"number\":1,\"body\":\"__result={\\\"id\\\":\\\"x}\\\"} done\"}");
    assert_true(r->ok);
    cJSON *j = result_json(r);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "id")->valuestring, "x}");
    cJSON_Delete(j);
    resp_free(r);
}

static void test_result_override(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    resp_t *r = invoke("github", "get_check_runs", key,
                       "{\"repo\":\"acme/widgets\",\"ref\":\"main\","
                       "\"__result\":{\"conclusion\":\"failure\",\"extra\":1}}");
    assert_true(r->ok);
    cJSON *j = result_json(r);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "conclusion")->valuestring, "failure");
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "status")->valuestring, "completed");
    assert_true(cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(j, "extra")));
    cJSON_Delete(j);
    resp_free(r);
}

/* A poll wait calls the same action once per lap, each lap with its own key: __pending=N makes
 * the first N laps of the step answer the fixture's "pending" object. */
static void test_pending_laps_of_a_poll(void **state) {
    (void)state;
    char key[96];
    g_step = "wait_for_checks";
    const char *args = "{\"repo\":\"acme/widgets\",\"ref\":\"abc __pending=2\"}";
    const char *want[] = {"in_progress", "in_progress", "completed", "completed"};
    for (int lap = 0; lap < 4; lap++) {
        new_key(key, sizeof key);
        resp_t *r = invoke("github", "get_check_runs", key, args);
        assert_true(r->ok);
        cJSON *j = result_json(r);
        assert_string_equal(cJSON_GetObjectItemCaseSensitive(j, "status")->valuestring, want[lap]);
        const cJSON *concl = cJSON_GetObjectItemCaseSensitive(j, "conclusion");
        if (lap < 2)
            assert_true(cJSON_IsNull(concl));
        else
            assert_string_equal(concl->valuestring, "success");
        cJSON_Delete(j);
        resp_free(r);
    }
    /* a replay of a pending lap stays pending (the recorded outcome), and counts no lap */
    g_step = "wait_again";
    new_key(key, sizeof key);
    resp_t *a = invoke("github", "get_check_runs", key, args);
    resp_t *b = invoke("github", "get_check_runs", key, args);
    cJSON *ja = result_json(a), *jb = result_json(b);
    assert_true(b->replayed);
    assert_true(cJSON_Compare(ja, jb, 1));
    cJSON_Delete(ja);
    cJSON_Delete(jb);
    resp_free(a);
    resp_free(b);
    new_key(key, sizeof key);
    a = invoke("github", "get_check_runs", key, args);
    ja = result_json(a);
    assert_string_equal(cJSON_GetObjectItemCaseSensitive(ja, "status")->valuestring,
                        "in_progress"); /* lap 2 of this step */
    cJSON_Delete(ja);
    resp_free(a);
    g_step = "step";
}

typedef struct bg_call {
    const char *key, *args;
    int timeout_field, wait;
    resp_t *r;
    int rc;
} bg_call;

static void *bg_invoke(void *arg) {
    bg_call *c = arg;
    c->rc = invoke_full("github", "get_issue", c->key, c->args, c->timeout_field, c->wait, &c->r);
    return NULL;
}

static void test_sleep_delays_and_does_not_block_others(void **state) {
    (void)state;
    char key[96], other[96];
    new_key(key, sizeof key);
    bg_call c = {
        .key = key, .args = "{\"repo\":\"a/b\",\"number\":1,\"__sleep_ms\":800}", .wait = 5000};
    pthread_t th;
    int64_t t0 = now_ms();
    pthread_create(&th, NULL, bg_invoke, &c);
    usleep(200 * 1000);
    /* another key of the same tool answers at once */
    new_key(other, sizeof other);
    int64_t t1 = now_ms();
    resp_t *r = invoke("github", "get_issue", other, "{\"repo\":\"a/b\",\"number\":2}");
    assert_true(r->ok);
    assert_true(now_ms() - t1 < 500);
    resp_free(r);
    /* the same key while it runs: waits for that try and gets its outcome; nothing runs twice */
    r = invoke("github", "get_issue", key, c.args);
    assert_true(r->ok);
    assert_true(r->replayed);
    assert_true(now_ms() - t0 >= 800);
    resp_free(r);
    pthread_join(th, NULL);
    assert_int_equal(c.rc, 0);
    assert_true(c.r->ok);
    assert_false(c.r->replayed);
    resp_free(c.r);
    int tries, execs, replays;
    key_counts(key, &tries, &execs, &replays);
    assert_int_equal(tries, 1);
    assert_int_equal(execs, 1);
    assert_int_equal(replays, 1);
}

/* A duplicate whose own deadline comes first is told "in_progress" (retryable) in time. */
static void test_duplicate_of_running_key_in_progress(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    bg_call c = {
        .key = key, .args = "{\"repo\":\"a/b\",\"number\":1,\"__sleep_ms\":1500}", .wait = 5000};
    pthread_t th;
    pthread_create(&th, NULL, bg_invoke, &c);
    usleep(200 * 1000);
    resp_t *r = NULL;
    int64_t t0 = now_ms();
    assert_int_equal(invoke_full("github", "get_issue", key, c.args, 400, 1000, &r), 0);
    assert_true(now_ms() - t0 < 400); /* answered within 80 % of its timeout_ms */
    assert_false(r->ok);
    assert_string_equal(r->error_code, "in_progress");
    assert_true(r->retryable);
    resp_free(r);
    pthread_join(th, NULL);
    assert_true(c.r->ok);
    resp_free(c.r);
}

static void test_sleep_beyond_timeout_gives_up(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    /* sleeps on the first try only; that try exceeds the request's timeout_ms */
    const char *args = "{\"repo\":\"a/b\",\"number\":1,\"__sleep_ms\":3000,\"__sleep_times\":1}";
    resp_t *r = NULL;
    int64_t t0 = now_ms();
    assert_int_equal(invoke_full("github", "get_issue", key, args, 300, 5000, &r), 0);
    assert_true(now_ms() - t0 < 2000);
    assert_false(r->ok);
    assert_string_equal(r->error_code, "timeout");
    assert_true(r->retryable);
    resp_free(r);
    assert_int_equal(invoke_full("github", "get_issue", key, args, 300, 5000, &r), 0);
    assert_true(r->ok); /* the retry with the same key runs: nothing had run */
    resp_free(r);
    int tries, execs, replays;
    key_counts(key, &tries, &execs, &replays);
    assert_int_equal(tries, 2);
    assert_int_equal(execs, 1);

    /* as the engine retries: it stops waiting at timeout_ms and asks again at once, possibly
     * before devtools gave up; that retry waits for the first try to end, then runs */
    new_key(key, sizeof key);
    int rc = invoke_full("github", "get_issue", key, args, 300, 300, &r);
    if (rc == 0)
        resp_free(r);
    else
        assert_int_equal(rc, BUS_ETIMEOUT);
    assert_int_equal(invoke_full("github", "get_issue", key, args, 300, 1000, &r), 0);
    assert_true(r->ok);
    resp_free(r);
    key_counts(key, &tries, &execs, &replays);
    assert_int_equal(execs, 1);
}

/* The side effect happened but the reply was late: the caller's retry gets the recorded
 * result and nothing runs twice. */
static void test_late_reply_then_retry_replays(void **state) {
    (void)state;
    char key[96];
    new_key(key, sizeof key);
    const char *args = "{\"repo\":\"a/b\",\"number\":1,\"__reply_delay_ms\":1000}";
    resp_t *r = NULL;
    assert_int_equal(invoke_full("github", "get_issue", key, args, 0, 300, &r), BUS_ETIMEOUT);
    assert_int_equal(invoke_full("github", "get_issue", key, args, 0, 5000, &r), 0);
    assert_true(r->ok);
    assert_true(r->replayed);
    resp_free(r);
    int tries, execs, replays;
    key_counts(key, &tries, &execs, &replays);
    assert_int_equal(execs, 1);
    assert_int_equal(replays, 1);
}

static void expect_error(const char *tool, const char *action, const char *args, const char *code,
                         const char *needle) {
    char key[96];
    new_key(key, sizeof key);
    resp_t *r = invoke(tool, action, key, args);
    assert_false(r->ok);
    assert_string_equal(r->error_code, code);
    assert_false(r->retryable);
    if (!strstr(r->error_message, needle))
        fail_msg("\"%s\" lacks \"%s\"", r->error_message, needle);
    resp_free(r);
}

static void test_bad_requests(void **state) {
    (void)state;
    expect_error("github", "delete_repo", "{}", "unknown_action", "delete_repo");
    expect_error("github", "get_issue", "{\"repo\":\"a/b\"}", "invalid_arguments",
                 "arguments.number");
    expect_error("github", "get_issue", "{\"repo\":\"a/b\",\"number\":1,\"color\":\"red\"}",
                 "invalid_arguments", "arguments.color");
    expect_error("github", "get_issue", "{\"repo\":\"a/b\",\"number\":1,\"__bogus\":1}",
                 "invalid_arguments", "__bogus");
    expect_error("github", "get_issue", "{\"repo\":\"a/b\",\"number\":1,\"__sleep_ms\":-5}",
                 "invalid_arguments", "__sleep_ms");
    /* an empty idempotency key */
    resp_t *r = invoke("github", "get_issue", "", "{\"repo\":\"a/b\",\"number\":1}");
    assert_false(r->ok);
    assert_string_equal(r->error_code, "invalid_arguments");
    assert_non_null(strstr(r->error_message, "idempotency_key"));
    resp_free(r);
    /* garbage that is not a ToolInvokeRequest */
    natsMsg *reply = NULL;
    assert_int_equal(bus_request(g_bus, "tool.invoke.github", "\xff\xff\xff", 3, 5000, &reply), 0);
    r = upsquad__internal__v1__tool_invoke_response__unpack(
        NULL, (size_t)natsMsg_GetDataLength(reply), (const uint8_t *)natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    assert_non_null(r);
    assert_false(r->ok);
    assert_string_equal(r->error_code, "invalid_arguments");
    resp_free(r);
}

typedef Upsquad__Internal__V1__ToolInvokeBatchResponse batch_resp_t;

/* One tool.batch.<tool> request of n calls (actions[i] NULL = get_issue), answered within
 * wait_ms; *ms gets the round trip. Caller frees the response. */
static batch_resp_t *batch_send(const char *tool, size_t n, const char *const *actions,
                                const char *const *keys, const char *const *args, int wait_ms,
                                int64_t *ms) {
    req_t q[32], *calls[32];
    Google__Protobuf__Struct *st[32];
    char err[256];
    assert_true(n <= 32);
    for (size_t i = 0; i < n; i++) {
        upsquad__internal__v1__tool_invoke_request__init(&q[i]);
        q[i].idempotency_key = (char *)keys[i];
        q[i].org_id = "0d5e0000-0000-0000-0000-000000000001";
        q[i].run_id = g_run;
        q[i].step_name = (char *)g_step;
        q[i].tool = (char *)tool;
        q[i].action = (char *)(actions && actions[i] ? actions[i] : "get_issue");
        cJSON *a = cJSON_Parse(args[i]);
        assert_non_null(a);
        assert_int_equal(pbjson_struct_from_json(a, &st[i], err, sizeof err), 0);
        cJSON_Delete(a);
        q[i].arguments = st[i];
        calls[i] = &q[i];
    }
    Upsquad__Internal__V1__ToolInvokeBatchRequest b =
        UPSQUAD__INTERNAL__V1__TOOL_INVOKE_BATCH_REQUEST__INIT;
    b.calls = calls;
    b.n_calls = n;
    size_t len = upsquad__internal__v1__tool_invoke_batch_request__get_packed_size(&b);
    uint8_t *buf = malloc(len);
    upsquad__internal__v1__tool_invoke_batch_request__pack(&b, buf);
    for (size_t i = 0; i < n; i++)
        pbjson_struct_free(st[i]);
    natsMsg *reply = NULL;
    int64_t t0 = now_ms();
    char subject[96];
    snprintf(subject, sizeof subject, "tool.batch.%s", tool);
    assert_int_equal(bus_request(g_bus, subject, buf, (int)len, wait_ms, &reply), 0);
    if (ms) *ms = now_ms() - t0;
    free(buf);
    batch_resp_t *r = upsquad__internal__v1__tool_invoke_batch_response__unpack(
        NULL, (size_t)natsMsg_GetDataLength(reply), (const uint8_t *)natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    assert_non_null(r);
    return r;
}

/* A result's "number" (get_issue echoes its argument): which call it answers. */
static int result_number(const resp_t *r) {
    cJSON *j = result_json(r);
    int n = (int)num(j, "number");
    cJSON_Delete(j);
    return n;
}

/* tool.batch.<tool>: each call through the same admission (a recorded key replays, a bad call
 * gets its own error, a cue fails only its call), one reply with the responses in order. */
static void test_batch(void **state) {
    (void)state;
    char k1[96], k2[96], k3[96];
    new_key(k1, sizeof k1);
    new_key(k2, sizeof k2);
    new_key(k3, sizeof k3);
    const char *args = "{\"repo\":\"acme/widgets\",\"number\":5,\"body\":\"hi\"}";
    resp_t *first = invoke("github", "create_comment", k1, args); /* recorded: replays */
    assert_true(first->ok);
    const char *keys[] = {k1, k2, k3, k2};
    const char *bodies[] = {args, args,
                            "{\"repo\":\"acme/widgets\",\"number\":5,\"body\":\"x __fail\"}", args};
    const char *actions[] = {"create_comment", "create_comment", "create_comment",
                             "no_such_action"};
    batch_resp_t *r = batch_send("github", 4, actions, keys, bodies, 5000, NULL);
    assert_int_equal(r->n_results, 4);
    assert_true(r->results[0]->ok && r->results[0]->replayed); /* k1 was recorded */
    assert_true(r->results[1]->ok && !r->results[1]->replayed);
    assert_false(r->results[2]->ok);
    assert_false(r->results[2]->retryable);
    assert_string_equal(r->results[3]->error_code, "unknown_action");
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    resp_free(first);
    /* k2 ran once in the batch: a single call replays it */
    resp_t *again = invoke("github", "create_comment", k2, args);
    assert_true(again->replayed);
    resp_free(again);
    int tries, execs, replays;
    key_counts(k2, &tries, &execs, &replays);
    assert_int_equal(execs, 1);
    /* garbage: no results, and the requester sends its calls alone */
    natsMsg *reply = NULL;
    assert_int_equal(bus_request(g_bus, "tool.batch.github", "\xff\xff\xff", 3, 5000, &reply), 0);
    r = upsquad__internal__v1__tool_invoke_batch_response__unpack(
        NULL, (size_t)natsMsg_GetDataLength(reply), (const uint8_t *)natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    assert_non_null(r);
    assert_int_equal(r->n_results, 0);
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
}

/* n calls of get_issue, call i with its own key, "number": first + i and the extra members
 * (e.g. a delay cue) in args[i] (text of at most 160 bytes). */
#define BATCH_N 12
typedef struct batch_calls {
    char key[BATCH_N][96], args[BATCH_N][160];
    const char *keys[BATCH_N], *argv[BATCH_N];
} batch_calls;

static void batch_calls_make(batch_calls *c, size_t n, int first, const char *extra) {
    for (size_t i = 0; i < n; i++) {
        new_key(c->key[i], sizeof c->key[i]);
        snprintf(c->args[i], sizeof c->args[i], "{\"repo\":\"a/b\",\"number\":%d,%s}",
                 first + (int)i, extra);
        c->keys[i] = c->key[i];
        c->argv[i] = c->args[i];
    }
}

/* Waits (up to 5 s) until `busy` workers run a delayed call and none waits in the queue. */
static void wait_workers(int busy) {
    for (int i = 0; i < 250; i++) {
        cJSON *s = stats(NULL);
        int now = (int)num(s, "workers_busy"), queued = (int)num(s, "queued");
        cJSON_Delete(s);
        if (now == busy && queued == 0) return;
        usleep(20 * 1000);
    }
    fail_msg("workers busy never reached %d", busy);
}

/* The delayed calls of a batch run on the workers side by side: the batch takes about its
 * slowest call, not the sum (8 x 400 ms here, 8 workers), and the results keep their order. */
static void test_batch_delayed_calls_run_concurrently(void **state) {
    (void)state;
    batch_calls c;
    batch_calls_make(&c, 8, 1, "\"__sleep_ms\":400");
    wait_workers(0); /* an earlier test's late reply may still hold one */
    int64_t ms = 0;
    batch_resp_t *r = batch_send("github", 8, NULL, c.keys, c.argv, 10000, &ms);
    assert_int_equal(r->n_results, 8);
    for (int i = 0; i < 8; i++) {
        assert_true(r->results[i]->ok);
        assert_false(r->results[i]->replayed);
        assert_int_equal(result_number(r->results[i]), i + 1);
    }
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    print_message("batch of 8 calls sleeping 400 ms: answered in %lld ms\n", (long long)ms);
    assert_true(ms > 350);  /* every call slept */
    assert_true(ms < 1600); /* not one after the other (3.2 s) */
    int tries, execs, replays;
    for (int i = 0; i < 8; i++) {
        key_counts(c.key[i], &tries, &execs, &replays);
        assert_int_equal(execs, 1);
    }
}

static void *batch_in_background(void *arg) {
    batch_calls *c = arg;
    batch_resp_t *r = batch_send("github", 2, NULL, c->keys, c->argv, 10000, NULL);
    assert_int_equal(r->n_results, 2);
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    return NULL;
}

/* A batch waiting for its delayed calls holds up no other subscription: another tool's batch,
 * single calls of every tool and the stats answer meanwhile (each subscription has a delivery
 * thread of its own; a shared one would make them wait for the batch's second). */
static void test_a_waiting_batch_holds_up_no_other_subscription(void **state) {
    (void)state;
    batch_calls slow, other;
    batch_calls_make(&slow, 2, 1, "\"__sleep_ms\":1500");
    wait_workers(0);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, batch_in_background, &slow), 0);
    wait_workers(2); /* both calls sleeping: the github batch's thread waits for them */
    int64_t t0 = now_ms();
    new_key(other.key[0], sizeof other.key[0]);
    new_key(other.key[1], sizeof other.key[1]);
    const char *keys[] = {other.key[0], other.key[1]}, *args[] = {"{}", "{}"},
               *actions[] = {"read_run_state", "list_pending_approvals"};
    batch_resp_t *r = batch_send("platform", 2, actions, keys, args, 5000, NULL);
    assert_int_equal(r->n_results, 2);
    assert_true(r->results[0]->ok && r->results[1]->ok);
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    char k[96];
    new_key(k, sizeof k);
    resp_t *one = invoke("github", "get_issue", k, "{\"repo\":\"a/b\",\"number\":7}");
    assert_true(one->ok);
    resp_free(one);
    cJSON_Delete(stats(NULL));
    int64_t took = now_ms() - t0;
    print_message("while a batch waited 1.5 s: another batch, a call and the stats in %lld ms\n",
                  (long long)took);
    assert_true(took < 1000);
    pthread_join(th, NULL);
}

/* A key twice in a batch, and in a single request running meanwhile, still runs once: the
 * batch's copies wait for the running try (on the workers) and replay its outcome, while the
 * batch's other delayed calls run beside them. */
static void test_batch_duplicate_key_runs_once(void **state) {
    (void)state;
    batch_calls c;
    batch_calls_make(&c, 4, 1, "\"__sleep_ms\":500");
    snprintf(c.key[1], sizeof c.key[1], "%s", c.key[0]); /* calls 0 and 1 share a key */
    bg_call single = {.key = c.key[0], .args = c.args[0], .wait = 5000};
    pthread_t th;
    wait_workers(0);
    pthread_create(&th, NULL, bg_invoke, &single);
    wait_workers(1); /* the single runs first: its key is running */
    int64_t ms = 0;
    batch_resp_t *r = batch_send("github", 4, NULL, c.keys, c.argv, 10000, &ms);
    pthread_join(th, NULL);
    assert_int_equal(single.rc, 0);
    assert_true(single.r->ok && !single.r->replayed);
    resp_free(single.r);
    assert_int_equal(r->n_results, 4);
    for (int i = 0; i < 4; i++)
        assert_true(r->results[i]->ok);
    assert_true(r->results[0]->replayed && r->results[1]->replayed);
    assert_false(r->results[2]->replayed || r->results[3]->replayed);
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    print_message("batch with a running key twice, 500 ms calls: answered in %lld ms\n",
                  (long long)ms);
    assert_true(ms < 1000); /* the waits and the other calls side by side, not 1.4 s in a row */
    int tries, execs, replays;
    key_counts(c.key[0], &tries, &execs, &replays);
    assert_int_equal(tries, 1);
    assert_int_equal(execs, 1);
    assert_int_equal(replays, 2);

    /* inside one batch alone: the first call runs, its copy replays it */
    batch_calls_make(&c, 2, 1, "\"__sleep_ms\":300");
    snprintf(c.key[1], sizeof c.key[1], "%s", c.key[0]);
    r = batch_send("github", 2, NULL, c.keys, c.argv, 10000, NULL);
    assert_int_equal(r->n_results, 2);
    assert_true(r->results[0]->ok && !r->results[0]->replayed);
    assert_true(r->results[1]->ok && r->results[1]->replayed);
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    key_counts(c.key[0], &tries, &execs, &replays);
    assert_int_equal(tries, 1);
    assert_int_equal(execs, 1);
}

/* The workers busy (8 single calls sleeping) and the queue's room (8) below the batch's
 * delayed calls (12): the calls the queue cannot take run on the batch's thread, so every call
 * is answered; none is refused "overloaded". The last two of them share a key: the copy,
 * left behind too, waits for its key on the batch's thread after the first ran there, and
 * replays it. */
static void test_batch_beyond_the_queue_runs_inline(void **state) {
    (void)state;
    bg_call busy[TEST_WORKERS];
    char keys[TEST_WORKERS][96];
    pthread_t th[TEST_WORKERS];
    wait_workers(0);
    for (int i = 0; i < TEST_WORKERS; i++) {
        new_key(keys[i], sizeof keys[i]);
        busy[i] = (bg_call){.key = keys[i],
                            .args = "{\"repo\":\"a/b\",\"number\":1,\"__sleep_ms\":2000}",
                            .wait = 8000};
        pthread_create(&th[i], NULL, bg_invoke, &busy[i]);
    }
    wait_workers(TEST_WORKERS); /* every worker has taken one; the queue is empty */
    cJSON *s = stats(NULL);
    double inline0 = num(s, "batch_inline"), overloaded0 = num(s, "overloaded");
    cJSON_Delete(s);
    batch_calls c;
    batch_calls_make(&c, BATCH_N, 1, "\"__sleep_ms\":250");
    snprintf(c.key[BATCH_N - 1], sizeof c.key[0], "%s", c.key[BATCH_N - 2]);
    int64_t ms = 0;
    batch_resp_t *r = batch_send("github", BATCH_N, NULL, c.keys, c.argv, 15000, &ms);
    assert_int_equal(r->n_results, BATCH_N);
    for (int i = 0; i < BATCH_N; i++) {
        int copy = i == BATCH_N - 1;
        assert_true(r->results[i]->ok);
        assert_int_equal(r->results[i]->replayed, copy);
        assert_int_equal(result_number(r->results[i]), copy ? i : i + 1);
    }
    upsquad__internal__v1__tool_invoke_batch_response__free_unpacked(r, NULL);
    s = stats(NULL);
    double inlined = num(s, "batch_inline") - inline0;
    print_message("batch of %d delayed calls, %d places in the queue: %.0f ran inline, %lld ms\n",
                  BATCH_N, TEST_QUEUE, inlined, (long long)ms);
    assert_true(inlined >= BATCH_N - TEST_QUEUE);
    assert_true(num(s, "overloaded") == overloaded0);
    cJSON_Delete(s);
    int tries, execs, replays;
    key_counts(c.key[BATCH_N - 1], &tries, &execs, &replays);
    assert_int_equal(tries, 1);
    assert_int_equal(execs, 1);
    for (int i = 0; i < TEST_WORKERS; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(busy[i].rc, 0);
        assert_true(busy[i].r->ok);
        resp_free(busy[i].r);
    }
}

static void test_stats_by_run(void **state) {
    (void)state;
    char q[160];
    snprintf(q, sizeof q, "{\"run_id\":\"%s\"}", g_run);
    cJSON *s = stats(q);
    const cJSON *recs = cJSON_GetObjectItemCaseSensitive(s, "records");
    assert_true(cJSON_IsArray(recs));
    assert_true(cJSON_GetArraySize(recs) > 20);
    for (const cJSON *r = recs->child; r; r = r->next) {
        assert_true(num(r, "executions") <= 1); /* no key ran twice */
        assert_string_equal(cJSON_GetObjectItemCaseSensitive(r, "run_id")->valuestring, g_run);
    }
    assert_int_equal((int)num(s, "max_executions_per_key"), 1);
    assert_true(num(s, "replays") >= 4);
    assert_true(num(s, "rejected") >= 7);
    assert_int_equal((int)num(s, "dedup_max_keys"), DEDUP_KEYS);
    cJSON_Delete(s);
}

static void test_announce_periodic_and_on_request(void **state) {
    (void)state;
    pthread_mutex_lock(&g_mu);
    int before = g_announces;
    pthread_mutex_unlock(&g_mu);
    assert_true(before >= 1); /* the start-up announcement */
    usleep(700 * 1000);       /* the interval is 300 ms in this test */
    pthread_mutex_lock(&g_mu);
    assert_true(g_announces >= before + 1);
    pthread_mutex_unlock(&g_mu);
    natsMsg *reply = NULL;
    assert_int_equal(bus_request(g_bus, SUBJ_TOOL_ANNOUNCE, NULL, 0, 5000, &reply), BUS_OK);
    Upsquad__Internal__V1__ToolAnnounce *a = upsquad__internal__v1__tool_announce__unpack(
        NULL, (size_t)natsMsg_GetDataLength(reply), (const uint8_t *)natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    assert_non_null(a);
    assert_string_equal(a->provider, "devtools");
    assert_int_equal(a->n_tools, 3);
    upsquad__internal__v1__tool_announce__free_unpacked(a, NULL);
}

/* Last: beyond the bound the least recently used keys are forgotten (and counted). */
static void test_dedup_bound_evicts_lru(void **state) {
    (void)state;
    char first[96], key[96];
    new_key(first, sizeof first);
    resp_t *r = invoke("platform", "list_pending_approvals", first, NULL);
    resp_free(r);
    for (int i = 0; i < DEDUP_KEYS; i++) {
        new_key(key, sizeof key);
        r = invoke("platform", "list_pending_approvals", key, NULL);
        assert_true(r->ok);
        resp_free(r);
    }
    cJSON *s = stats(NULL);
    assert_int_equal((int)num(s, "keys"), DEDUP_KEYS);
    assert_true(num(s, "evicted") >= 1);
    cJSON_Delete(s);
    char q[160];
    snprintf(q, sizeof q, "{\"key\":\"%s\"}", first);
    s = stats(q);
    assert_true(cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(s, "record")));
    cJSON_Delete(s);
}

static int setup(void **state) {
    (void)state;
    const char *url = getenv("UPSQUAD_NATS_URL");
    char err[256], bin[512];
    if (bus_connect(url, "test_devtools", &g_bus, err, sizeof err) != BUS_OK) return -1;
    if (bus_subscribe(g_bus, SUBJ_TOOL_ANNOUNCE, NULL, on_announce, NULL, &g_announce_sub, err,
                      sizeof err) != BUS_OK ||
        bus_flush(g_bus, 5000) != BUS_OK)
        return -1;
    const char *b = getenv("BUILD");
    snprintf(bin, sizeof bin, "%s/bin/devtools", b ? b : "build");
    snprintf(g_stats, sizeof g_stats, "devtools.stats.t%d", (int)getpid());
    static char e_stats[160], e_keys[64], e_workers[64], e_queue[64];
    snprintf(e_stats, sizeof e_stats, "UPSQUAD_DEVTOOLS_STATS_SUBJECT=%s", g_stats);
    snprintf(e_keys, sizeof e_keys, "UPSQUAD_DEVTOOLS_DEDUP_KEYS=%d", DEDUP_KEYS);
    snprintf(e_workers, sizeof e_workers, "UPSQUAD_DEVTOOLS_WORKERS=%d", TEST_WORKERS);
    snprintf(e_queue, sizeof e_queue, "UPSQUAD_DEVTOOLS_QUEUE=%d", TEST_QUEUE);
    const char *env[] = {
        e_stats, e_keys, e_workers, e_queue, "UPSQUAD_DEVTOOLS_ANNOUNCE_INTERVAL=300ms", NULL};
    if (readyproc_start(&g_proc, bin, env, 10000) != 0) return -1;
    /* the start-up announcement was published before "ready"; let it arrive */
    for (int i = 0; i < 50; i++) {
        pthread_mutex_lock(&g_mu);
        int n = g_announces;
        pthread_mutex_unlock(&g_mu);
        if (n) break;
        usleep(20 * 1000);
    }
    return 0;
}

static int teardown(void **state) {
    (void)state;
    int rc = readyproc_stop(&g_proc) == 0 ? 0 : -1; /* a clean exit on SIGTERM */
    bus_unsubscribe(g_announce_sub);
    bus_close(g_bus);
    return rc;
}

int main(void) {
    const char *url = getenv("UPSQUAD_NATS_URL");
    if (!url || !*url) {
        printf("SKIP test_devtools: UPSQUAD_NATS_URL is not set\n");
        return 0;
    }
    log_init("test_devtools", LOG_ERROR);
    srand((unsigned)time(NULL) ^ (unsigned)getpid());
    snprintf(g_run, sizeof g_run, "run-%d-%d", (int)getpid(), rand() % 100000);
    snprintf(g_catalog, sizeof g_catalog, "services/workflow-engine/catalog/tools.json");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_catalogued_action_answers),
        cmocka_unit_test(test_fixture_templated_with_input),
        cmocka_unit_test(test_dedup_replays_recorded_result),
        cmocka_unit_test(test_fail_is_permanent_and_recorded),
        cmocka_unit_test(test_fail_times_then_succeeds),
        cmocka_unit_test(test_cue_inside_string_argument),
        cmocka_unit_test(test_result_override),
        cmocka_unit_test(test_pending_laps_of_a_poll),
        cmocka_unit_test(test_sleep_delays_and_does_not_block_others),
        cmocka_unit_test(test_duplicate_of_running_key_in_progress),
        cmocka_unit_test(test_sleep_beyond_timeout_gives_up),
        cmocka_unit_test(test_late_reply_then_retry_replays),
        cmocka_unit_test(test_batch),
        cmocka_unit_test(test_batch_delayed_calls_run_concurrently),
        cmocka_unit_test(test_a_waiting_batch_holds_up_no_other_subscription),
        cmocka_unit_test(test_batch_duplicate_key_runs_once),
        cmocka_unit_test(test_batch_beyond_the_queue_runs_inline),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_stats_by_run),
        cmocka_unit_test(test_announce_periodic_and_on_request),
        cmocka_unit_test(test_dedup_bound_evicts_lru),
    };
    int failed = cmocka_run_group_tests(tests, setup, teardown);
    bus_library_shutdown();
    return failed;
}
