/* Unit tests of the definition validator: the schema interpreter on small schemas, the limits,
 * the catalogue, the wire form, and a few semantic rules (the corpus in tests/workflow covers
 * the language case by case). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "../../../services/workflow-engine/defn.h"
#include "../../../services/workflow-engine/defn_pb.h"

#define SCHEMA_FILE "services/workflow-engine/schema/workflow-definition.schema.json"
#define CATALOG_FILE "services/workflow-engine/catalog/tools.json"

/* A catalogue small enough to write inline for the schema-interpreter tests. */
static const char *mini_catalog =
    "{\"tools\":[{\"tool\":\"t\",\"description\":\"d\",\"actions\":[{\"action\":\"a\","
    "\"description\":\"d\",\"args\":[]}]}],\"poll_observations\":[]}";

/* The repository root, found from the working directory upwards. */
static const char *repo_path(const char *rel, char *buf, size_t len) {
    for (int up = 0; up < 6; up++) {
        size_t used = 0;
        buf[0] = '\0';
        for (int k = 0; k < up; k++)
            used += (size_t)snprintf(buf + used, len - used, "../");
        snprintf(buf + used, len - used, "%s", rel);
        if (access(buf, R_OK) == 0) return buf;
    }
    return rel;
}

static defn_ctx *load_real(const defn_options *opts) {
    char s[512], c[512], err[256];
    defn_ctx *ctx = NULL;
    int rc = defn_ctx_load(repo_path(SCHEMA_FILE, s, sizeof(s)),
                           repo_path(CATALOG_FILE, c, sizeof(c)), opts, &ctx, err, sizeof(err));
    if (rc != 0) fail_msg("load: %s", err);
    return ctx;
}

static defn_ctx *load_schema(const char *schema) {
    char err[256];
    defn_ctx *ctx = NULL;
    int rc = defn_ctx_load_mem(schema, strlen(schema), mini_catalog, strlen(mini_catalog), NULL,
                               &ctx, err, sizeof(err));
    if (rc != 0) fail_msg("load: %s", err);
    return ctx;
}

/* Validates doc and compares "pointer|message" lines joined by '\n' with want ("" = valid). */
static void expect(const defn_ctx *ctx, const char *doc, const char *want) {
    defn_violations v;
    defn_violations_init(&v);
    int rc = defn_validate(ctx, doc, strlen(doc), &v);
    char got[8192];
    size_t used = 0;
    got[0] = '\0';
    for (size_t i = 0; i < v.n && used < sizeof(got); i++)
        used += (size_t)snprintf(got + used, sizeof(got) - used, "%s%s|%s", i ? "\n" : "",
                                 v.items[i].instance_location, v.items[i].message);
    assert_string_equal(got, want);
    assert_int_equal(rc, want[0] ? DEFN_INVALID : DEFN_OK);
    defn_violations_free(&v);
}

/* ------------------------------------------------------------------ schema interpreter */

static void test_scalar_keywords(void **state) {
    (void)state;
    defn_ctx *ctx = load_schema(
        "{\"type\":\"object\",\"properties\":{"
        "\"i\":{\"type\":\"integer\",\"minimum\":1,\"maximum\":25},"
        "\"x\":{\"exclusiveMinimum\":0,\"exclusiveMaximum\":1},"
        "\"s\":{\"type\":\"string\",\"minLength\":2,\"maxLength\":3,\"pattern\":\"^[a-z]+$\"},"
        "\"e\":{\"enum\":[\"a\",\"b\",1]},"
        "\"c\":{\"const\":{\"k\":[1,2]}},"
        "\"t\":{\"type\":[\"string\",\"null\"]}}}");
    expect(ctx, "{\"i\":3,\"x\":0.5,\"s\":\"ab\",\"e\":1,\"c\":{\"k\":[1,2.0]},\"t\":null}", "");
    expect(ctx, "{\"i\":26}", "/i|must be <= 25");
    expect(ctx, "{\"i\":0}", "/i|must be >= 1");
    expect(ctx, "{\"i\":2.5}", "/i|expected integer, but got number");
    expect(ctx, "{\"i\":\"3\"}", "/i|expected integer, but got string");
    expect(ctx, "{\"x\":0}", "/x|must be > 0");
    expect(ctx, "{\"x\":1}", "/x|must be < 1");
    /* Lengths count code points: "été" is 3. */
    expect(ctx, "{\"s\":\"\xc3\xa9t\xc3\xa9x\"}",
           "/s|length must be <= 3, but got 4\n"
           "/s|does not match pattern \"^[a-z]+$\"");
    expect(ctx, "{\"s\":\"A\"}",
           "/s|length must be >= 2, but got 1\n"
           "/s|does not match pattern \"^[a-z]+$\"");
    expect(ctx, "{\"e\":\"c\"}", "/e|value must be one of \"a\", \"b\", 1");
    expect(ctx, "{\"c\":{\"k\":[2,1]}}", "/c|value must be {\"k\":[1,2]}");
    expect(ctx, "{\"t\":5}", "/t|expected null or string, but got integer");
    expect(ctx, "[]", "|expected object, but got array");
    defn_ctx_free(ctx);
}

static void test_object_keywords_and_order(void **state) {
    (void)state;
    defn_ctx *ctx = load_schema(
        "{\"type\":\"object\",\"required\":[\"a\",\"b\"],\"maxProperties\":4,"
        "\"properties\":{\"a\":{\"type\":\"object\",\"properties\":{\"z\":{\"type\":\"string\"}},"
        "\"additionalProperties\":false},\"b\":{\"type\":\"array\",\"minItems\":1,\"maxItems\":2,"
        "\"uniqueItems\":true,\"items\":{\"type\":\"integer\"}}},"
        "\"patternProperties\":{\"^x_\":{\"type\":\"boolean\"}},"
        "\"additionalProperties\":{\"type\":\"number\"}}");
    expect(ctx, "{\"a\":{},\"b\":[1],\"x_1\":true,\"n\":2}", "");
    /* Parent violations come before the children's, children in document order. */
    expect(ctx, "{\"b\":[\"s\",1,1],\"a\":{\"y\":1,\"z\":2},\"x_a\":1,\"m\":\"q\",\"w\":1}",
           "|must have at most 4 properties, but has 5\n"
           "/b|must have at most 2 items, but has 3\n"
           "/b|items at 1 and 2 are equal\n"
           "/b/0|expected integer, but got string\n"
           "/a|property \"y\" is not allowed\n"
           "/a/z|expected string, but got integer\n"
           "/x_a|expected boolean, but got integer\n"
           "/m|expected number, but got string");
    defn_ctx_free(ctx);
}

static void test_pointer_escaping(void **state) {
    (void)state;
    defn_ctx *ctx = load_schema("{\"additionalProperties\":{\"type\":\"string\"}}");
    expect(ctx, "{\"a/b\":1,\"c~d\":2,\"~/\":3,\"\":4,\"\xe2\x98\x83\":5}",
           "/a~1b|expected string, but got integer\n"
           "/c~0d|expected string, but got integer\n"
           "/~0~1|expected string, but got integer\n"
           "/|expected string, but got integer\n"
           "/\xe2\x98\x83|expected string, but got integer");
    defn_ctx_free(ctx);
}

static void test_composition_reports_leaves_only(void **state) {
    (void)state;
    defn_ctx *ctx = load_schema(
        "{\"$defs\":{\"node\":{\"type\":\"object\",\"properties\":{\"kids\":{\"type\":\"array\","
        "\"items\":{\"$ref\":\"#/$defs/node\"}},\"v\":{\"type\":\"integer\"}}}},"
        "\"type\":\"object\",\"properties\":{"
        "\"tree\":{\"$ref\":\"#/$defs/node\"},"
        "\"any\":{\"anyOf\":[{\"type\":\"string\"},{\"type\":\"integer\",\"minimum\":5}]},"
        "\"one\":{\"oneOf\":[{\"type\":\"integer\"},{\"minimum\":0}]},"
        "\"not\":{\"not\":{\"type\":\"string\"}},"
        "\"cond\":{\"if\":{\"type\":\"object\",\"required\":[\"k\"],\"properties\":{\"k\":{"
        "\"const\":\"a\"}}},\"then\":{\"required\":[\"a\"]},\"else\":{\"required\":[\"b\"]}},"
        "\"all\":{\"allOf\":[{\"minimum\":1},{\"maximum\":0}]},"
        "\"never\":false}}");
    expect(ctx,
           "{\"tree\":{\"kids\":[{\"kids\":[{\"v\":1}]}]},\"any\":7,\"one\":-1,"
           "\"not\":1,\"cond\":{\"k\":\"a\",\"a\":1}}",
           "");
    expect(ctx,
           "{\"tree\":{\"kids\":[{\"kids\":[{\"v\":\"x\"}]}]},\"any\":2,\"one\":3,\"not\":\"s\","
           "\"cond\":{\"k\":\"b\"},\"all\":0.5,\"never\":0}",
           "/tree/kids/0/kids/0/v|expected integer, but got string\n"
           "/any|expected string, but got integer\n"
           "/any|must be >= 5\n"
           "/one|must match exactly one alternative, but matches 2\n"
           "/not|must not match the excluded schema\n"
           "/cond|missing required property \"b\"\n"
           "/all|must be >= 1\n"
           "/all|must be <= 0\n"
           "/never|property \"never\" is not allowed here");
    defn_ctx_free(ctx);
}

/* Class-sequence patterns take a fast path; it must agree with the regex engine, which the
 * parenthesised copies of the same patterns force. */
static void test_pattern_fast_path_agrees_with_regex(void **state) {
    (void)state;
    static const char *const pats[][2] = {
        {"^[a-z][a-z0-9_-]*$", "^([a-z][a-z0-9_-]*)$"},
        {"^[A-Za-z_][A-Za-z0-9_]{0,3}$", "^([A-Za-z_][A-Za-z0-9_]{0,3})$"},
        {"^[A-Za-z0-9_.:-]+$", "^([A-Za-z0-9_.:-]+)$"},
        {"^[ab]{2}[b]*[a]{1,2}$", "^([ab]{2}[b]*[a]{1,2})$"},
    };
    const char alphabet[] = "abzAZ09_-.:~ \xc3\xa9";
    unsigned seed = 12345;
    for (size_t k = 0; k < sizeof(pats) / sizeof(pats[0]); k++) {
        char schema[256];
        snprintf(schema, sizeof(schema),
                 "{\"properties\":{\"f\":{\"pattern\":\"%s\"},\"r\":{\"pattern\":\"%s\"}}}",
                 pats[k][0], pats[k][1]);
        defn_ctx *ctx = load_schema(schema);
        for (int i = 0; i < 3000; i++) {
            char text[16];
            seed = seed * 1103515245u + 12345u;
            int len = (int)((seed >> 16) % 8);
            for (int j = 0; j < len; j++) {
                seed = seed * 1103515245u + 12345u;
                text[j] = alphabet[(seed >> 16) % (sizeof(alphabet) - 3)];
            }
            text[len] = '\0';
            char doc[128];
            snprintf(doc, sizeof(doc), "{\"f\":\"%s\",\"r\":\"%s\"}", text, text);
            defn_violations v;
            defn_violations_init(&v);
            defn_validate(ctx, doc, strlen(doc), &v);
            bool f = false, r = false;
            for (size_t n = 0; n < v.n; n++) {
                f = f || strcmp(v.items[n].instance_location, "/f") == 0;
                r = r || strcmp(v.items[n].instance_location, "/r") == 0;
            }
            if (f != r) fail_msg("pattern %s disagrees on \"%s\"", pats[k][0], text);
            defn_violations_free(&v);
        }
        defn_ctx_free(ctx);
    }
}

static void test_schema_load_errors(void **state) {
    (void)state;
    static const char *const bad[] = {
        "{\"format\":\"email\"}",         /* unsupported keyword */
        "{\"$ref\":\"other.json#/x\"}",   /* non-local reference */
        "{\"$ref\":\"#/$defs/missing\"}", /* dangling reference */
        "{\"type\":\"text\"}",            /* unknown type */
        "{\"pattern\":\"([a-z\"}",        /* regex does not compile */
        "{\"properties\":{\"a\":3}}",     /* a schema must be object/bool */
        "{\"minLength\":-1}",             /* counts are non-negative */
        "not json",
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[256] = "";
        defn_ctx *ctx = NULL;
        int rc = defn_ctx_load_mem(bad[i], strlen(bad[i]), mini_catalog, strlen(mini_catalog), NULL,
                                   &ctx, err, sizeof(err));
        assert_int_equal(rc, DEFN_ERR_LOAD);
        assert_null(ctx);
        assert_true(err[0] != '\0');
    }
    char err[256];
    defn_ctx *ctx = NULL;
    assert_int_equal(defn_ctx_load("/nonexistent/schema.json", "/nonexistent/tools.json", NULL,
                                   &ctx, err, sizeof(err)),
                     DEFN_ERR_LOAD);
    assert_non_null(strstr(err, "/nonexistent/schema.json"));
}

/* ------------------------------------------------------------------ limits */

static void test_limits_refused_before_parsing(void **state) {
    (void)state;
    defn_ctx *ctx = load_real(NULL);
    /* Size: one byte past the limit. */
    size_t big = DEFN_MAX_BYTES + 1;
    char *doc = malloc(big + 1);
    assert_non_null(doc);
    memset(doc, ' ', big);
    doc[0] = '{';
    doc[big - 1] = '}';
    doc[big] = '\0';
    char want[128];
    snprintf(want, sizeof(want), "|definition is %zu bytes; the limit is %u bytes", big,
             DEFN_MAX_BYTES);
    expect(ctx, doc, want);
    free(doc);
    /* Depth: 200000 brackets must neither recurse nor crash; the limit names the byte. */
    size_t deep = 200000;
    doc = malloc(deep + 1);
    assert_non_null(doc);
    memset(doc, '[', deep);
    doc[deep] = '\0';
    expect(ctx, doc, "|definition nests deeper than 32 levels (byte 32)");
    free(doc);
    /* Brackets inside strings do not count. */
    expect(ctx,
           "{\"version\":1,\"start\":\"a\",\"steps\":{\"a\":{\"type\":\"agent_action\","
           "\"agent_role\":\"eng\",\"prompt\":\"[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[\\\"[[[\"}}}",
           "");
    expect(ctx, "{\"a\":\"\xff\"}", "|definition is not valid UTF-8 (byte 6)");
    expect(ctx, "{\"a\":\"\xed\xa0\x80\"}", "|definition is not valid UTF-8 (byte 6)");
    expect(ctx, "{\"a\":", "|definition is not valid JSON (byte 4)");
    expect(ctx, "", "|definition is not valid JSON (byte 0)");
    expect(ctx, "{} {}", "|definition is not valid JSON: text after the document (byte 3)");
    expect(ctx, "{\"steps\":{\"a\":1,\"b\":2,\"a\":3},\"steps\":{}}",
           "/steps|duplicate property \"steps\"\n/steps/a|duplicate property \"a\"");
    defn_ctx_free(ctx);
}

static void test_violation_cap(void **state) {
    (void)state;
    defn_ctx *ctx = load_schema("{\"items\":{\"type\":\"string\"}}");
    char doc[4096] = "[";
    for (int i = 0; i < 250; i++)
        strcat(doc, i ? ",1" : "1");
    strcat(doc, "]");
    defn_violations v;
    defn_violations_init(&v);
    assert_int_equal(defn_validate(ctx, doc, strlen(doc), &v), DEFN_INVALID);
    assert_int_equal(v.n, DEFN_MAX_VIOLATIONS);
    assert_int_equal(v.dropped, 51);
    assert_string_equal(v.items[198].instance_location, "/198");
    assert_string_equal(v.items[199].instance_location, "");
    assert_string_equal(v.items[199].message, "51 more violations not reported (at most 200 are)");
    char sum[256];
    defn_violations_summary(&v, sum, sizeof(sum));
    assert_string_equal(sum, "invalid workflow definition: /0: expected string, but got integer "
                             "(and 250 more violations)");
    defn_violations_free(&v);
    defn_ctx_free(ctx);
}

/* ------------------------------------------------------------------ wire form */

/* The detail must decode with the generated descriptor, exactly as a client reads it. */
static void test_encode_round_trip(void **state) {
    (void)state;
    defn_violations v;
    defn_violations_init(&v);
    defn_violation items[2] = {{(char *)"", (char *)"root problem"},
                               {(char *)"/steps/loop1/max_iterations", (char *)"must be <= 25"}};
    v.items = items;
    v.n = 2;
    defn_pb_error *m = NULL;
    assert_int_equal(defn_violations_to_pb(&v, &m), 0);
    size_t len = protobuf_c_message_get_packed_size(&m->base);
    uint8_t *buf = malloc(len);
    assert_non_null(buf);
    assert_int_equal(protobuf_c_message_pack(&m->base, buf), len);
    defn_violations_pb_free(m);
    defn_pb_error *back =
        upsquad__workflow__v1__definition_validation_error__unpack(NULL, len, buf);
    assert_non_null(back);
    assert_int_equal(back->n_violations, 2);
    assert_string_equal(back->violations[0]->instance_location, "");
    assert_string_equal(back->violations[0]->message, "root problem");
    assert_string_equal(back->violations[1]->instance_location, "/steps/loop1/max_iterations");
    assert_string_equal(back->violations[1]->message, "must be <= 25");
    upsquad__workflow__v1__definition_validation_error__free_unpacked(back, NULL);
    free(buf);
}

/* ------------------------------------------------------------------ catalogue */

static bool enable_all(const char *name, void *arg) {
    (void)name;
    (void)arg;
    return true;
}

static void test_catalog_views_and_gate(void **state) {
    (void)state;
    unsetenv("WF_CODE_EXEC_ENABLED");
    unsetenv("UPSQUAD_CODE_EXEC_ENABLED");
    defn_ctx *ctx = load_real(NULL);
    size_t n;
    const defn_tool *tools = defn_catalog_tools(ctx, &n);
    bool github = false, platform = false, code = false;
    for (size_t i = 0; i < n; i++) {
        if (strcmp(tools[i].tool, "github") == 0) {
            github = tools[i].enabled && tools[i].n_actions >= 8;
            const defn_tool_action *a = defn_catalog_find(ctx, "github", "get_issue");
            assert_non_null(a);
            assert_string_equal(a->args[0].name, "repo");
            assert_true(a->args[0].pinned_literal && a->args[0].required);
            assert_false(a->args[1].pinned_literal);
        }
        if (strcmp(tools[i].tool, "platform") == 0) platform = tools[i].enabled;
        if (strcmp(tools[i].tool, "code_exec") == 0) {
            code = !tools[i].enabled;
            assert_string_equal(tools[i].enabled_by, "WF_CODE_EXEC_ENABLED");
            assert_string_equal(tools[i].enabled_by_alias, "UPSQUAD_CODE_EXEC_ENABLED");
        }
    }
    assert_true(github && platform && code);
    assert_null(defn_catalog_find(ctx, "code_exec", "run"));
    const defn_poll_observation *obs = defn_catalog_observations(ctx, &n);
    assert_int_equal(n, 4);
    for (size_t i = 0; i < n; i++) {
        assert_non_null(defn_catalog_find(ctx, obs[i].tool, obs[i].action));
        assert_non_null(strstr(obs[i].rationale, "Read-only"));
        assert_non_null(strstr(obs[i].rationale, "Idempotent"));
    }
    /* The gated-off tool is still catalogued for the validator (defn_catalog_tool). */
    const defn_tool *ce = defn_catalog_tool(ctx, "code_exec");
    assert_non_null(ce);
    assert_false(ce->enabled);
    assert_null(defn_catalog_tool(ctx, "slack"));
    defn_ctx_free(ctx);
    /* The switch, through the environment by either name and through the options. */
    setenv("WF_CODE_EXEC_ENABLED", "true", 1);
    ctx = load_real(NULL);
    assert_non_null(defn_catalog_find(ctx, "code_exec", "run"));
    assert_true(defn_catalog_tool(ctx, "code_exec")->enabled);
    defn_ctx_free(ctx);
    setenv("WF_CODE_EXEC_ENABLED", "0", 1);
    ctx = load_real(NULL);
    assert_null(defn_catalog_find(ctx, "code_exec", "run"));
    defn_ctx_free(ctx);
    unsetenv("WF_CODE_EXEC_ENABLED");
    setenv("UPSQUAD_CODE_EXEC_ENABLED", "on", 1);
    ctx = load_real(NULL);
    assert_non_null(defn_catalog_find(ctx, "code_exec", "run"));
    defn_ctx_free(ctx);
    unsetenv("UPSQUAD_CODE_EXEC_ENABLED");
    defn_options opts = {.gate_enabled = enable_all};
    ctx = load_real(&opts);
    assert_non_null(defn_catalog_find(ctx, "code_exec", "run"));
    defn_ctx_free(ctx);
}

/* A tool behind a gate validates whether the gate is on or off (spec GetToolCatalogResponse
 * .tools: such a node "would validate at create ... and then fail closed at dispatch"), and its
 * action and arguments are checked either way, pinned literals included. */
static void test_gated_tool_validates_gate_on_or_off(void **state) {
    (void)state;
    unsetenv("WF_CODE_EXEC_ENABLED");
    unsetenv("UPSQUAD_CODE_EXEC_ENABLED");
    defn_options on = {.gate_enabled = enable_all};
    defn_ctx *ctxs[2] = {load_real(NULL), load_real(&on)};
    const char *good =
        "{\"version\":1,\"start\":\"run\",\"steps\":{\"run\":{\"type\":\"tool_action\","
        "\"tool\":\"code_exec\",\"action\":\"run\",\"with\":{\"language\":\"python\","
        "\"code\":\"print(1)\",\"input\":{\"n\":\"${/trigger/n}\"}}}}}";
    const char *bad =
        "{\"version\":1,\"start\":\"run\",\"steps\":{\"run\":{\"type\":\"tool_action\","
        "\"tool\":\"code_exec\",\"action\":\"run\",\"with\":{\"language\":\"python\","
        "\"code\":\"${/trigger/code}\",\"timeout_seconds\":\"9\",\"shell\":true},"
        "\"next\":\"nope\"},"
        "\"nope\":{\"type\":\"tool_action\",\"tool\":\"code_exec\",\"action\":\"eval\"}}}";
    for (int k = 0; k < 2; k++) {
        assert_int_equal(defn_catalog_tool(ctxs[k], "code_exec")->enabled, k == 1);
        expect(ctxs[k], good, "");
        expect(ctxs[k], bad,
               "/steps/run/with/code|argument \"code\" is pinned: it must be a literal, not a "
               "template\n"
               "/steps/run/with/timeout_seconds|argument \"timeout_seconds\" must be integer, but "
               "got string\n"
               "/steps/run/with/shell|\"code_exec.run\" has no argument \"shell\"\n"
               "/steps/nope/action|tool \"code_exec\" has no action \"eval\"");
        defn_ctx_free(ctxs[k]);
    }
}

static void test_catalog_load_errors(void **state) {
    (void)state;
    static const char *const bad[] = {
        "{\"tools\":[]}",
        "{\"tools\":[{\"tool\":\"t\",\"description\":\"d\",\"actions\":[{\"action\":\"a\","
        "\"description\":\"d\",\"args\":[{\"name\":\"n\",\"type\":\"integer\",\"required\":true,"
        "\"description\":\"d\",\"pinned_literal\":true}]}]}],\"poll_observations\":[]}",
        "{\"tools\":[{\"tool\":\"t\",\"description\":\"d\",\"actions\":[{\"action\":\"a\","
        "\"description\":\"d\",\"args\":[]}]}],\"poll_observations\":[{\"tool\":\"t\","
        "\"action\":\"b\",\"rationale\":\"r\"}]}",
        "{\"tools\":[{\"tool\":\"t\",\"description\":\"d\",\"actions\":[{\"action\":\"a\","
        "\"description\":\"d\",\"args\":[]}]},{\"tool\":\"t\",\"description\":\"d\","
        "\"actions\":[{\"action\":\"a\",\"description\":\"d\",\"args\":[]}]}],"
        "\"poll_observations\":[]}",
        "{\"tools\":[{\"tool\":\"t\",\"description\":\"d\",\"actions\":[{\"action\":\"a\","
        "\"description\":\"d\",\"args\":[{\"name\":\"n\",\"type\":\"date\",\"required\":true,"
        "\"description\":\"d\",\"pinned_literal\":false}]}]}],\"poll_observations\":[]}",
        "{\"tools\":[{\"tool\":\"t\",\"description\":\"d\",\"enabled_by_alias\":\"X\","
        "\"actions\":[{\"action\":\"a\",\"description\":\"d\",\"args\":[]}]}],"
        "\"poll_observations\":[]}",
    };
    const char *schema = "{\"type\":\"object\"}";
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        char err[256] = "";
        defn_ctx *ctx = NULL;
        assert_int_equal(defn_ctx_load_mem(schema, strlen(schema), bad[i], strlen(bad[i]), NULL,
                                           &ctx, err, sizeof(err)),
                         DEFN_ERR_LOAD);
        assert_non_null(strstr(err, "tool catalogue"));
    }
}

/* ------------------------------------------------------------------ semantics */

static void test_semantic_rules_point_at_values(void **state) {
    (void)state;
    defn_ctx *ctx = load_real(NULL);
    /* Step names with '/' and '~' are escaped in every pointer, including messages' targets. */
    expect(ctx,
           "{\"version\":1,\"start\":\"a/b\",\"steps\":{"
           "\"a/b\":{\"type\":\"agent_action\",\"agent_role\":\"eng\",\"prompt\":\"go\","
           "\"next\":\"c~d\"},"
           "\"c~d\":{\"type\":\"approval_gate\",\"required_clearance\":2,\"on_approve\":\"a/b\","
           "\"on_reject\":\"gone\"},"
           "\"island\":{\"type\":\"agent_action\",\"agent_role\":\"eng\",\"prompt\":\"x\"}}}",
           "/steps/c~0d/on_approve|creates a cycle (a/b -> c~d -> a/b); repeat steps with a loop "
           "step instead\n"
           "/steps/c~0d/on_reject|unknown step \"gone\"\n"
           "/steps/island|step is unreachable from start");
    /* The structure is reported alone: semantic rules wait for a well-formed definition. */
    expect(ctx, "{\"version\":2,\"start\":\"nowhere\",\"steps\":{}}",
           "/version|value must be 1\n/steps|must have at least 1 property, but has 0");
    defn_ctx_free(ctx);
}

static void test_concurrent_contexts_are_independent(void **state) {
    (void)state;
    /* Two contexts with different gates answer independently (no global state). */
    defn_options on = {.gate_enabled = enable_all};
    unsetenv("WF_CODE_EXEC_ENABLED");
    unsetenv("UPSQUAD_CODE_EXEC_ENABLED");
    defn_ctx *a = load_real(&on), *b = load_real(NULL);
    assert_non_null(defn_catalog_find(a, "code_exec", "run"));
    assert_null(defn_catalog_find(b, "code_exec", "run"));
    defn_ctx_free(a);
    defn_ctx_free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_keywords),
        cmocka_unit_test(test_object_keywords_and_order),
        cmocka_unit_test(test_pointer_escaping),
        cmocka_unit_test(test_composition_reports_leaves_only),
        cmocka_unit_test(test_pattern_fast_path_agrees_with_regex),
        cmocka_unit_test(test_schema_load_errors),
        cmocka_unit_test(test_limits_refused_before_parsing),
        cmocka_unit_test(test_violation_cap),
        cmocka_unit_test(test_encode_round_trip),
        cmocka_unit_test(test_catalog_views_and_gate),
        cmocka_unit_test(test_catalog_load_errors),
        cmocka_unit_test(test_gated_tool_validates_gate_on_or_off),
        cmocka_unit_test(test_semantic_rules_point_at_values),
        cmocka_unit_test(test_concurrent_contexts_are_independent),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
