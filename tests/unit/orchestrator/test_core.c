/* Orchestrator building blocks without a server: the snapshot hash (the documented test
 * vectors: org_version_seq and mcp_servers never change it, every other field does), agent
 * definition validation, the relay's budgets and clamps, and provider-key encryption. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../../services/orchestrator/agentdef.h"
#include "../../../services/orchestrator/autonomy.h"
#include "../../../services/orchestrator/keys.h"
#include "../../../services/orchestrator/relay.h"

/* The documented vector (docs/orchestrator.md, "snapshot_hash"). */
static const char *VECTOR_DOC =
    "{\"role\":\"assistant\",\"display_name\":\"A\",\"model\":\"claude-sonnet-4-6\","
    "\"temperature\":0.2,\"max_tokens\":1024,\"persona\":\"be brief\",\"tools\":[\"b\",\"a\","
    "\"mcp:gh\"],\"rbac_grants\":{\"repo:*\":\"read\"},\"max_loops\":5,"
    "\"mcp_servers\":{\"gh\":{\"prefix\":\"github\",\"unit_id\":\"u1\"}}}";
#define VECTOR_SESSION "00000000-0000-4000-8000-000000000001"
#define VECTOR_ORG "00000000-0000-4000-8000-0000000000aa"
#define VECTOR_AGENT "00000000-0000-4000-8000-0000000000bb"
#define VECTOR_HASH "3ab0f6019cb0db4eb313006e057fee4d5f496133882870364c09fcbc6a66d593"

static SessionSnapshot *freeze(orch_arena *a, const char *json) {
    cJSON *doc = cJSON_Parse(json);
    assert_non_null(doc);
    char err[256];
    assert_int_equal(agentdef_validate(doc, err, sizeof err), 0);
    SessionSnapshot *s = agentdef_freeze(a, doc, VECTOR_SESSION, VECTOR_ORG, VECTOR_AGENT, NULL, 0);
    assert_non_null(s);
    /* the snapshot borrows nothing from doc */
    cJSON_Delete(doc);
    return s;
}

static void hash_of(const SessionSnapshot *s, char out[65]) {
    assert_int_equal(agentdef_hash(s, out), 0);
}

static void test_vector(void **state) {
    (void)state;
    orch_arena a = {0};
    SessionSnapshot *s = freeze(&a, VECTOR_DOC);
    char h[65];
    hash_of(s, h);
    assert_string_equal(s->snapshot_hash, h);
    /* tools are frozen sorted and de-duplicated; only surviving MCP servers are mapped */
    assert_int_equal(s->n_tools, 3);
    assert_string_equal(s->tools[0], "a");
    assert_string_equal(s->tools[2], "mcp:gh");
    assert_int_equal(s->n_mcp_servers, 1);
    assert_string_equal(h, VECTOR_HASH);
    orch_arena_free(&a);
}

static void test_excluded_fields(void **state) {
    (void)state;
    orch_arena a = {0};
    SessionSnapshot *s = freeze(&a, VECTOR_DOC);
    char h0[65], h[65];
    hash_of(s, h0);
    s->org_version_seq = 12345;
    hash_of(s, h);
    assert_string_equal(h, h0);
    s->n_mcp_servers = 0;
    hash_of(s, h);
    assert_string_equal(h, h0);
    s->snapshot_hash = (char *)"anything";
    hash_of(s, h);
    assert_string_equal(h, h0);
    /* the session's identity is not configuration: another session of another org freezing
     * the same configuration hashes alike */
    s->session_id = (char *)"00000000-0000-4000-8000-000000000002";
    s->tenant_id = (char *)"00000000-0000-4000-8000-0000000000cc";
    hash_of(s, h);
    assert_string_equal(h, h0);
    orch_arena_free(&a);
}

/* Each mutation of an included field changes the hash. */
static void test_every_other_field(void **state) {
    (void)state;
    orch_arena a = {0};
    char h0[65], h[65];
    SessionSnapshot *base = freeze(&a, VECTOR_DOC);
    hash_of(base, h0);
    for (int f = 2; f < 27; f++) {
        SessionSnapshot *s = freeze(&a, VECTOR_DOC);
        switch (f) {
        case 2:
            s->agent_id = (char *)"x";
            break;
        case 3:
            s->model_id = (char *)"x";
            break;
        case 4:
            s->temperature = 0.3;
            break;
        case 5:
            s->max_tokens = 1;
            break;
        case 6:
            s->n_tools = 2;
            break;
        case 7:
            s->guardrail_hashes = s->tools, s->n_guardrail_hashes = 1;
            break;
        case 8:
            s->rbac_grants[0]->value = (char *)"write";
            break;
        case 9:
            s->persona = (char *)"be long";
            break;
        case 10:
            s->max_loops = 6;
            break;
        case 11:
            s->execution_mode = 2;
            break;
        case 12:
            s->fallback_chain->secondary_model = (char *)"gpt";
            break;
        case 13:
            s->context_engine_address = (char *)"ce:1";
            break;
        case 14:
            s->security_config->input_filter_mode = (char *)"strict";
            break;
        case 15:
            s->security_config->redact_pii = !s->security_config->redact_pii;
            break;
        case 16:
            s->security_config->tool_result_max_bytes = 1;
            break;
        case 17:
            s->runtime = (char *)"claude_sdk";
            break;
        case 18:
            s->llm_base_url = (char *)"https://x";
            break;
        case 19:
            s->fallback_chain = NULL;
            break;
        case 20:
            s->security_config->output_filter_mode = (char *)"strict";
            break;
        case 21:
            s->security_config->redact_secrets = !s->security_config->redact_secrets;
            break;
        case 22:
            s->security_config->schema_validation_mode = (char *)"block";
            break;
        case 23:
            s->security_config->tool_scan_enabled = !s->security_config->tool_scan_enabled;
            break;
        case 24:
            s->security_config->redact_system_prompt = !s->security_config->redact_system_prompt;
            break;
        case 25:
            s->rbac_grants[0]->key = (char *)"repo:x";
            break;
        case 26:
            s->security_config = NULL;
            break;
        }
        hash_of(s, h);
        if (strcmp(h, h0) == 0) fail_msg("mutation %d left the hash unchanged", f);
    }
    orch_arena_free(&a);
}

static void test_validation(void **state) {
    (void)state;
    static const struct {
        const char *doc, *want;
    } bad[] = {
        {"[]", "JSON object"},
        {"{\"display_name\":\"a\",\"model\":\"m\"}", "/role: required"},
        {"{\"role\":\"Bad\",\"display_name\":\"a\",\"model\":\"m\"}", "/role"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"temperature\":2.5}",
         "/temperature"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"tools\":[1]}", "/tools/0"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"colour\":1}", "/colour"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"max_loops\":0}", "/max_loops"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"security_config\":"
         "{\"input_filter_mode\":\"lax\"}}",
         "/security_config/input_filter_mode"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"fallback_chain\":"
         "[\"a\",\"b\",\"c\"]}",
         "/fallback_chain"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"id\":\"nope\"}", "/id"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"tool_policies\":"
         "{\"gh.merge\":{\"required_clearance\":0}}}",
         "/tool_policies/gh.merge/required_clearance"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"tool_policies\":"
         "{\"gh.merge\":{\"clearance\":3}}}",
         "/tool_policies/gh.merge/clearance: unknown member"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"tool_policies\":[]}",
         "/tool_policies"},
        {"{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\",\"approval_clearance\":6}",
         "/approval_clearance"},
    };
    char err[256];
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        cJSON *d = cJSON_Parse(bad[i].doc);
        assert_int_equal(agentdef_validate(d, err, sizeof err), -1);
        if (!strstr(err, bad[i].want)) fail_msg("%s: %s lacks %s", bad[i].doc, err, bad[i].want);
        cJSON_Delete(d);
    }
}

/* A gated tool's clearance: its policy, else the agent's, else the highest tier (never 0). */
static void test_tool_clearance(void **state) {
    (void)state;
    char err[256];
    cJSON *d = cJSON_Parse("{\"role\":\"a\",\"display_name\":\"a\",\"model\":\"m\","
                           "\"tool_policies\":{\"gh.merge\":{\"requires_approval\":true,"
                           "\"required_clearance\":2},\"db.drop\":{\"requires_approval\":true}}}");
    assert_int_equal(agentdef_validate(d, err, sizeof err), 0);
    assert_int_equal(agentdef_tool_clearance(d, "gh.merge"), 2);
    assert_int_equal(agentdef_tool_clearance(d, "db.drop"), AGENTDEF_CLEARANCE_DEFAULT);
    assert_int_equal(agentdef_tool_clearance(d, "other"), 5);
    assert_int_equal(agentdef_tool_clearance(d, NULL), 5);
    cJSON_AddNumberToObject(d, "approval_clearance", 3);
    assert_int_equal(agentdef_validate(d, err, sizeof err), 0);
    assert_int_equal(agentdef_tool_clearance(d, "db.drop"), 3);
    assert_int_equal(agentdef_tool_clearance(d, "gh.merge"), 2);
    cJSON_Delete(d);
}

/* The PLAN step's decomposition as the plan: trimmed, empty titles dropped, stable-sorted by
 * ordering, clamped, re-indexed; nothing left: the goal as the one seed todo. */
static void test_auto_plan(void **state) {
    (void)state;
    Upsquad__Runtime__V1__TodoSpec t[5];
    Upsquad__Runtime__V1__TodoSpec *tp[5];
    const char *titles[] = {" b ", "", "a", "c", "d"};
    const uint32_t ord[] = {1, 0, 0, 1, 2};
    for (int i = 0; i < 5; i++) {
        upsquad__runtime__v1__todo_spec__init(&t[i]);
        t[i].id = "worker-id";
        t[i].title = (char *)titles[i];
        t[i].ordering = ord[i];
        tp[i] = &t[i];
    }
    Upsquad__Runtime__V1__DecompositionEvent d = UPSQUAD__RUNTIME__V1__DECOMPOSITION_EVENT__INIT;
    d.todos = tp;
    d.n_todos = 5;
    int n = 0;
    char *j = orch_auto_plan(&d, "the goal", 3, &n);
    assert_int_equal(n, 3);
    assert_string_equal(j, "[{\"id\":\"todo-1\",\"title\":\"a\",\"done\":false},"
                           "{\"id\":\"todo-2\",\"title\":\"b\",\"done\":false},"
                           "{\"id\":\"todo-3\",\"title\":\"c\",\"done\":false}]");
    free(j);
    d.n_todos = 2; /* " b " and "": one left */
    t[0].title = "  ";
    j = orch_auto_plan(&d, "the goal", 3, &n);
    assert_int_equal(n, 1);
    assert_string_equal(j, "[{\"id\":\"todo-1\",\"title\":\"the goal\",\"done\":false}]");
    free(j);
    j = orch_auto_plan(NULL, "only", 20, &n);
    assert_int_equal(n, 1);
    free(j);
}

static void test_answer_budgets(void **state) {
    (void)state;
    StructuredAnswerEvent s = UPSQUAD__RUNTIME__V1__STRUCTURED_ANSWER_EVENT__INIT;
    const char *why;
    char big[5000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = 0;
    s.summary = (char *)"ok";
    assert_int_equal(relay_answer_ok(&s, &why), 0);
    big[4096] = 0;
    s.summary = big;
    assert_int_equal(relay_answer_ok(&s, &why), 0); /* exactly 4 KiB */
    big[4096] = 'x';
    big[4097] = 0;
    assert_int_equal(relay_answer_ok(&s, &why), -1);
    assert_non_null(strstr(why, "summary"));
    s.summary = (char *)"ok";
    char *f[9] = {"a", "b", "c", "d", "e", "f", "g", "h", "i"};
    s.followups = f;
    s.n_followups = 9;
    assert_int_equal(relay_answer_ok(&s, &why), -1);
    s.n_followups = 8;
    assert_int_equal(relay_answer_ok(&s, &why), 0);
}

static void test_clamp_utf8(void **state) {
    (void)state;
    /* "é" is 2 bytes: a cut at an odd byte backs off to the character boundary */
    assert_int_equal(relay_clamp_len("\xc3\xa9\xc3\xa9\xc3\xa9", 3), 2);
    assert_int_equal(relay_clamp_len("abc", 10), 3);
    assert_int_equal(relay_clamp_len("abcdef", 4), 4);
}

static void test_keys(void **state) {
    (void)state;
    keys_ring r;
    char err[256], *plain = NULL;
    size_t plen = 0, ctlen = 0;
    unsigned char nonce[12], *ct = NULL;
    const char *kid = NULL;
    const char *spec = "new:"
                       "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
                       ",old:"
                       "ffeeddccbbaa99887766554433221100ffeeddccbbaa99887766554433221100";
    assert_int_equal(keys_ring_parse(spec, &r, err, sizeof err), 0);
    assert_int_equal(r.n, 2);
    assert_int_equal(keys_encrypt(&r, "org", "anthropic", (const unsigned char *)"sk-secret", 9,
                                  nonce, &ct, &ctlen, &kid),
                     0);
    assert_string_equal(kid, "new");
    assert_int_equal(ctlen, 9 + 16);
    assert_null(memmem(ct, ctlen, "sk-secret", 9));
    assert_int_equal(keys_decrypt(&r, "new", "org", "anthropic", nonce, ct, ctlen, &plain, &plen),
                     0);
    assert_string_equal(plain, "sk-secret");
    free(plain);
    /* bound to its org and provider (AAD), and to its kek */
    assert_int_equal(keys_decrypt(&r, "new", "org2", "anthropic", nonce, ct, ctlen, &plain, &plen),
                     -1);
    assert_int_equal(keys_decrypt(&r, "new", "org", "openai", nonce, ct, ctlen, &plain, &plen), -1);
    assert_int_equal(keys_decrypt(&r, "old", "org", "anthropic", nonce, ct, ctlen, &plain, &plen),
                     -1);
    assert_int_equal(keys_decrypt(&r, "gone", "org", "anthropic", nonce, ct, ctlen, &plain, &plen),
                     -1);
    ct[0] ^= 1;
    assert_int_equal(keys_decrypt(&r, "new", "org", "anthropic", nonce, ct, ctlen, &plain, &plen),
                     -1);
    free(ct);
    assert_int_equal(keys_ring_parse("k:1234", &r, err, sizeof err), -1);
    assert_null(strstr(err, "1234"));
    assert_int_equal(keys_ring_parse("", &r, err, sizeof err), -1);
    keys_ring_wipe(&r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vector),
        cmocka_unit_test(test_excluded_fields),
        cmocka_unit_test(test_every_other_field),
        cmocka_unit_test(test_validation),
        cmocka_unit_test(test_tool_clearance),
        cmocka_unit_test(test_auto_plan),
        cmocka_unit_test(test_answer_budgets),
        cmocka_unit_test(test_clamp_utf8),
        cmocka_unit_test(test_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
