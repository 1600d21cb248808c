/* Agent definition documents: validation, snapshot freezing, the canonical hash (agentdef.h). */
#include "agentdef.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ids.h"
#include "util.h"

typedef Upsquad__Runtime__V1__FallbackChain FallbackChain;
typedef Upsquad__Runtime__V1__SecurityConfigProto SecurityConfig;
typedef Upsquad__Runtime__V1__ContentPatternProto ContentPattern;
typedef Upsquad__Runtime__V1__SessionSnapshot__RbacGrantsEntry RbacEntry;
typedef Upsquad__Runtime__V1__SessionSnapshot__McpServersEntry McpEntry;
typedef Upsquad__Runtime__V1__McpServerRef McpRef;

#define fail(...) util_errf(err, errlen, -1, __VA_ARGS__)

/* ---- validation ---- */

static int is_str(const cJSON *v, size_t min, size_t max) {
    if (!cJSON_IsString(v)) return 0;
    size_t n = strlen(v->valuestring);
    return n >= min && n <= max && util_utf8_valid(v->valuestring);
}

static int role_ok(const char *s) {
    size_t n = strlen(s);
    if (n < 1 || n > 64 || !(s[0] >= 'a' && s[0] <= 'z')) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' || c == '-')) return 0;
    }
    return 1;
}

static int str_list(const cJSON *v, const char *name, char *err, size_t errlen) {
    if (!cJSON_IsArray(v)) return fail("/%s: must be an array of strings", name);
    int n = cJSON_GetArraySize(v);
    if (n > AGENTDEF_LIST_MAX) return fail("/%s: at most %d entries", name, AGENTDEF_LIST_MAX);
    int i = 0;
    for (const cJSON *e = v->child; e; e = e->next, i++)
        if (!is_str(e, 1, AGENTDEF_ITEM_MAX))
            return fail("/%s/%d: must be a non-empty string of at most %d bytes", name, i,
                        AGENTDEF_ITEM_MAX);
    return 0;
}

static int num_in(const cJSON *v, double lo, double hi, int integer) {
    if (!cJSON_IsNumber(v) || !isfinite(v->valuedouble)) return 0;
    if (integer && v->valuedouble != floor(v->valuedouble)) return 0;
    return v->valuedouble >= lo && v->valuedouble <= hi;
}

static int filter_mode_ok(const char *s) {
    return !strcmp(s, "strict") || !strcmp(s, "standard") || !strcmp(s, "permissive") ||
           !strcmp(s, "disabled");
}

static int patterns_ok(const cJSON *v, const char *name, char *err, size_t errlen) {
    if (!cJSON_IsArray(v)) return fail("/security_config/%s: must be an array", name);
    if (cJSON_GetArraySize(v) > 64) return fail("/security_config/%s: at most 64 patterns", name);
    int i = 0;
    for (const cJSON *p = v->child; p; p = p->next, i++) {
        if (!cJSON_IsObject(p)) return fail("/security_config/%s/%d: must be an object", name, i);
        for (const cJSON *m = p->child; m; m = m->next) {
            if (strcmp(m->string, "id") && strcmp(m->string, "regex") &&
                strcmp(m->string, "severity") && strcmp(m->string, "category") &&
                strcmp(m->string, "description"))
                return fail("/security_config/%s/%d/%s: unknown member", name, i, m->string);
            if (!is_str(m, 0, 1024))
                return fail("/security_config/%s/%d/%s: must be a string of at most 1024 bytes",
                            name, i, m->string);
        }
        const cJSON *re = cJSON_GetObjectItemCaseSensitive(p, "regex");
        if (!re || !re->valuestring[0])
            return fail("/security_config/%s/%d/regex: required", name, i);
        const cJSON *sev = cJSON_GetObjectItemCaseSensitive(p, "severity");
        if (sev && strcmp(sev->valuestring, "block") && strcmp(sev->valuestring, "redact") &&
            strcmp(sev->valuestring, "log_only"))
            return fail("/security_config/%s/%d/severity: one of block, redact, log_only", name, i);
    }
    return 0;
}

/* tool_policies: {"<tool>": {"requires_approval": bool, "required_clearance": 1..5}} */
static int policies_ok(const cJSON *v, char *err, size_t errlen) {
    if (!cJSON_IsObject(v)) return fail("/tool_policies: an object of tool -> policy");
    if (cJSON_GetArraySize(v) > AGENTDEF_LIST_MAX)
        return fail("/tool_policies: at most %d tools", AGENTDEF_LIST_MAX);
    for (const cJSON *t = v->child; t; t = t->next) {
        if (!t->string[0] || strlen(t->string) > 200)
            return fail("/tool_policies: a tool name of 1..200 bytes");
        if (!cJSON_IsObject(t)) return fail("/tool_policies/%s: must be an object", t->string);
        for (const cJSON *m = t->child; m; m = m->next) {
            if (!strcmp(m->string, "requires_approval")) {
                if (!cJSON_IsBool(m))
                    return fail("/tool_policies/%s/requires_approval: a boolean", t->string);
            } else if (!strcmp(m->string, "required_clearance")) {
                if (!num_in(m, 1, 5, 1))
                    return fail("/tool_policies/%s/required_clearance: an integer in 1..5",
                                t->string);
            } else {
                return fail("/tool_policies/%s/%s: unknown member", t->string, m->string);
            }
        }
    }
    return 0;
}

int agentdef_tool_clearance(const cJSON *doc, const char *tool) {
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(doc, "tool_policies"), tool ? tool : "");
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(p, "required_clearance");
    if (cJSON_IsNumber(c) && c->valueint >= 1 && c->valueint <= 5) return c->valueint;
    c = cJSON_GetObjectItemCaseSensitive(doc, "approval_clearance");
    if (cJSON_IsNumber(c) && c->valueint >= 1 && c->valueint <= 5) return c->valueint;
    return AGENTDEF_CLEARANCE_DEFAULT;
}

void agentdef_tool_policy(const char *definition, const char *tool, agentdef_policy *out) {
    cJSON *doc = cJSON_Parse(definition ? definition : "{}");
    const cJSON *p = cJSON_GetObjectItemCaseSensitive(
        cJSON_GetObjectItemCaseSensitive(doc, "tool_policies"), tool ? tool : "");
    out->clearance = agentdef_tool_clearance(doc, tool);
    out->names_clearance =
        cJSON_IsNumber(cJSON_GetObjectItemCaseSensitive(p, "required_clearance"));
    out->requires_approval = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(p, "requires_approval"));
    cJSON_Delete(doc);
}

static int security_ok(const cJSON *v, char *err, size_t errlen) {
    if (!cJSON_IsObject(v)) return fail("/security_config: must be an object");
    for (const cJSON *m = v->child; m; m = m->next) {
        const char *k = m->string;
        if (!strcmp(k, "input_filter_mode") || !strcmp(k, "output_filter_mode")) {
            if (!cJSON_IsString(m) || !filter_mode_ok(m->valuestring))
                return fail("/security_config/%s: one of strict, standard, permissive, disabled",
                            k);
        } else if (!strcmp(k, "schema_validation_mode")) {
            if (!cJSON_IsString(m) ||
                (strcmp(m->valuestring, "log_only") && strcmp(m->valuestring, "warn") &&
                 strcmp(m->valuestring, "block")))
                return fail("/security_config/%s: one of log_only, warn, block", k);
        } else if (!strcmp(k, "redact_secrets") || !strcmp(k, "redact_pii") ||
                   !strcmp(k, "redact_system_prompt") || !strcmp(k, "tool_scan_enabled")) {
            if (!cJSON_IsBool(m)) return fail("/security_config/%s: must be true or false", k);
        } else if (!strcmp(k, "tool_result_max_bytes")) {
            if (!num_in(m, 0, 16777216, 1))
                return fail("/security_config/%s: an integer in 0..16777216", k);
        } else if (!strcmp(k, "custom_block_patterns") || !strcmp(k, "custom_pii_patterns")) {
            if (patterns_ok(m, k, err, errlen)) return -1;
        } else {
            return fail("/security_config/%s: unknown member", k);
        }
    }
    return 0;
}

static int mcp_ok(const cJSON *v, char *err, size_t errlen) {
    if (!cJSON_IsObject(v))
        return fail("/mcp_servers: must be an object of server id -> {prefix, unit_id}");
    if (cJSON_GetArraySize(v) > 64) return fail("/mcp_servers: at most 64 servers");
    for (const cJSON *s = v->child; s; s = s->next) {
        if (!s->string[0] || strlen(s->string) > 128)
            return fail("/mcp_servers: a server id must have 1..128 bytes");
        if (!cJSON_IsObject(s)) return fail("/mcp_servers/%s: must be an object", s->string);
        for (const cJSON *m = s->child; m; m = m->next) {
            if (strcmp(m->string, "prefix") && strcmp(m->string, "unit_id"))
                return fail("/mcp_servers/%s/%s: unknown member", s->string, m->string);
            if (!is_str(m, 1, 128))
                return fail("/mcp_servers/%s/%s: a string of 1..128 bytes", s->string, m->string);
        }
    }
    return 0;
}

int agentdef_validate(const cJSON *doc, char *err, size_t errlen) {
    if (!cJSON_IsObject(doc)) return fail(": an agent definition must be a JSON object");
    for (const cJSON *m = doc->child; m; m = m->next) {
        const char *k = m->string;
        for (const cJSON *o = doc->child; o != m; o = o->next)
            if (!strcmp(o->string, k)) return fail("/%s: duplicate member", k);
        if (!strcmp(k, "id")) {
            if (!cJSON_IsString(m) || !ids_uuid_valid(m->valuestring))
                return fail("/id: must be a UUID");
        } else if (!strcmp(k, "role")) {
            if (!cJSON_IsString(m) || !role_ok(m->valuestring))
                return fail("/role: 1..64 of a-z 0-9 _ -, starting with a letter");
        } else if (!strcmp(k, "display_name")) {
            if (!is_str(m, 1, 128)) return fail("/display_name: a string of 1..128 bytes");
        } else if (!strcmp(k, "model")) {
            if (!is_str(m, 1, 96)) return fail("/model: a model id of 1..96 bytes");
        } else if (!strcmp(k, "fallback_chain")) {
            if (str_list(m, k, err, errlen)) return -1;
            if (cJSON_GetArraySize(m) > 2)
                return fail("/fallback_chain: at most 2 models (secondary, tertiary)");
        } else if (!strcmp(k, "temperature")) {
            if (!num_in(m, 0, 2, 0)) return fail("/temperature: a number in 0..2");
        } else if (!strcmp(k, "max_tokens")) {
            if (!num_in(m, 1, 1000000, 1)) return fail("/max_tokens: an integer in 1..1000000");
        } else if (!strcmp(k, "persona")) {
            if (!is_str(m, 0, AGENTDEF_PERSONA_MAX))
                return fail("/persona: a string of at most %d bytes", AGENTDEF_PERSONA_MAX);
        } else if (!strcmp(k, "tools") || !strcmp(k, "guardrail_hashes")) {
            if (str_list(m, k, err, errlen)) return -1;
        } else if (!strcmp(k, "rbac_grants")) {
            if (!cJSON_IsObject(m)) return fail("/rbac_grants: an object of pattern -> actions");
            if (cJSON_GetArraySize(m) > AGENTDEF_LIST_MAX)
                return fail("/rbac_grants: at most %d grants", AGENTDEF_LIST_MAX);
            for (const cJSON *g = m->child; g; g = g->next)
                if (!g->string[0] || !is_str(g, 1, AGENTDEF_ITEM_MAX))
                    return fail("/rbac_grants/%s: a non-empty string of at most %d bytes",
                                g->string, AGENTDEF_ITEM_MAX);
        } else if (!strcmp(k, "max_loops")) {
            if (!num_in(m, 1, 100, 1)) return fail("/max_loops: an integer in 1..100");
        } else if (!strcmp(k, "execution_mode")) {
            if (!cJSON_IsString(m) ||
                (strcmp(m->valuestring, "single_turn") && strcmp(m->valuestring, "multi_turn") &&
                 strcmp(m->valuestring, "autonomous")))
                return fail("/execution_mode: one of single_turn, multi_turn, autonomous");
        } else if (!strcmp(k, "runtime")) {
            if (!cJSON_IsString(m) ||
                (strcmp(m->valuestring, "langgraph") && strcmp(m->valuestring, "claude_sdk")))
                return fail("/runtime: one of langgraph, claude_sdk");
        } else if (!strcmp(k, "llm_base_url") || !strcmp(k, "context_engine_address")) {
            if (!is_str(m, 0, 512)) return fail("/%s: a string of at most 512 bytes", k);
            if (!strcmp(k, "llm_base_url") && m->valuestring[0] &&
                strncmp(m->valuestring, "https://", 8) && strncmp(m->valuestring, "http://", 7))
                return fail("/llm_base_url: an http(s) URL");
        } else if (!strcmp(k, "mcp_servers")) {
            if (mcp_ok(m, err, errlen)) return -1;
        } else if (!strcmp(k, "security_config")) {
            if (security_ok(m, err, errlen)) return -1;
        } else if (!strcmp(k, "tool_policies")) {
            if (policies_ok(m, err, errlen)) return -1;
        } else if (!strcmp(k, "approval_clearance")) {
            if (!num_in(m, 1, 5, 1)) return fail("/approval_clearance: an integer in 1..5");
        } else {
            return fail("/%s: unknown member", k);
        }
    }
    if (!cJSON_GetObjectItemCaseSensitive(doc, "role")) return fail("/role: required");
    if (!cJSON_GetObjectItemCaseSensitive(doc, "display_name"))
        return fail("/display_name: required");
    if (!cJSON_GetObjectItemCaseSensitive(doc, "model")) return fail("/model: required");
    return 0;
}

void agentdef_id(const cJSON *doc, const char *org_id, char out[37]) {
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(doc, "id");
    if (cJSON_IsString(id)) {
        snprintf(out, 37, "%s", id->valuestring);
        for (char *p = out; *p; p++)
            if (*p >= 'A' && *p <= 'F') *p = (char)(*p - 'A' + 'a');
        return;
    }
    const cJSON *role = cJSON_GetObjectItemCaseSensitive(doc, "role");
    ids_sha256 h;
    unsigned char d[32];
    char hex[33];
    memset(d, 0, sizeof d);
    if (ids_sha256_init(&h) == 0) {
        ids_sha256_update_str(&h, "upsquad-agent:");
        ids_sha256_update_str(&h, org_id);
        ids_sha256_update_str(&h, ":");
        ids_sha256_update_str(&h, cJSON_IsString(role) ? role->valuestring : "");
        ids_sha256_final_raw(&h, d);
    }
    d[6] = (unsigned char)((d[6] & 0x0f) | 0x50); /* version 5-style: name-derived */
    d[8] = (unsigned char)((d[8] & 0x3f) | 0x80);
    ids_hex(d, 16, hex);
    snprintf(out, 37, "%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8, hex + 12, hex + 16, hex + 20);
}

int agentdef_mode(const cJSON *doc) {
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(doc, "execution_mode");
    if (!cJSON_IsString(m)) return 1;
    if (!strcmp(m->valuestring, "multi_turn")) return 2;
    if (!strcmp(m->valuestring, "autonomous")) return 3;
    return 1;
}

/* ---- freezing ---- */

static const char *str_of(const cJSON *doc, const char *k, const char *def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(doc, k);
    return cJSON_IsString(v) ? v->valuestring : def;
}

static double num_of(const cJSON *doc, const char *k, double def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(doc, k);
    return cJSON_IsNumber(v) ? v->valuedouble : def;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* A sorted, de-duplicated copy of a string array: the frozen set does not depend on the
 * order an operator wrote it in. */
static char **strings(orch_arena *a, const cJSON *arr, size_t *n) {
    *n = 0;
    int cnt = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : 0;
    char **out = orch_arena_alloc(a, (size_t)(cnt ? cnt : 1) * sizeof *out);
    if (!out) return NULL;
    for (const cJSON *e = cnt ? arr->child : NULL; e; e = e->next)
        if (cJSON_IsString(e)) out[(*n)++] = orch_arena_strdup(a, e->valuestring);
    qsort(out, *n, sizeof *out, cmp_str);
    size_t w = 0;
    for (size_t i = 0; i < *n; i++)
        if (w == 0 || strcmp(out[w - 1], out[i])) out[w++] = out[i];
    *n = w;
    return out;
}

static ContentPattern **patterns(orch_arena *a, const cJSON *arr, size_t *n) {
    *n = 0;
    int cnt = cJSON_IsArray(arr) ? cJSON_GetArraySize(arr) : 0;
    ContentPattern **out = orch_arena_alloc(a, (size_t)(cnt ? cnt : 1) * sizeof *out);
    if (!out) return NULL;
    for (const cJSON *p = cnt ? arr->child : NULL; p; p = p->next) {
        ContentPattern *c = orch_arena_alloc(a, sizeof *c);
        if (!c) return NULL;
        upsquad__runtime__v1__content_pattern_proto__init(c);
        c->id = orch_arena_strdup(a, str_of(p, "id", ""));
        c->regex = orch_arena_strdup(a, str_of(p, "regex", ""));
        c->severity = orch_arena_strdup(a, str_of(p, "severity", "block"));
        c->category = orch_arena_strdup(a, str_of(p, "category", "custom"));
        c->description = orch_arena_strdup(a, str_of(p, "description", ""));
        out[(*n)++] = c;
    }
    return out;
}

static int bool_of(const cJSON *o, const char *k, int def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

/* Platform defaults where the document says nothing (docs/orchestrator.md). */
static SecurityConfig *security(orch_arena *a, const cJSON *doc) {
    const cJSON *o = cJSON_GetObjectItemCaseSensitive(doc, "security_config");
    SecurityConfig *s = orch_arena_alloc(a, sizeof *s);
    if (!s) return NULL;
    upsquad__runtime__v1__security_config_proto__init(s);
    s->input_filter_mode = orch_arena_strdup(a, str_of(o, "input_filter_mode", "standard"));
    s->output_filter_mode = orch_arena_strdup(a, str_of(o, "output_filter_mode", "standard"));
    s->redact_secrets = bool_of(o, "redact_secrets", 1);
    s->redact_pii = bool_of(o, "redact_pii", 0);
    s->redact_system_prompt = bool_of(o, "redact_system_prompt", 1);
    s->schema_validation_mode =
        orch_arena_strdup(a, str_of(o, "schema_validation_mode", "log_only"));
    s->tool_scan_enabled = bool_of(o, "tool_scan_enabled", 1);
    s->tool_result_max_bytes = (int32_t)num_of(o, "tool_result_max_bytes", 65536);
    s->custom_block_patterns =
        patterns(a, cJSON_GetObjectItemCaseSensitive(o, "custom_block_patterns"),
                 &s->n_custom_block_patterns);
    s->custom_pii_patterns = patterns(a, cJSON_GetObjectItemCaseSensitive(o, "custom_pii_patterns"),
                                      &s->n_custom_pii_patterns);
    return s;
}

SessionSnapshot *agentdef_freeze(orch_arena *a, const cJSON *doc, const char *session_id,
                                 const char *org_id, const char *agent_id,
                                 const char *model_override, int mode) {
    SessionSnapshot *s = orch_arena_alloc(a, sizeof *s);
    FallbackChain *fc = orch_arena_alloc(a, sizeof *fc);
    if (!s || !fc) return NULL;
    upsquad__runtime__v1__session_snapshot__init(s);
    upsquad__runtime__v1__fallback_chain__init(fc);
    const char *model =
        model_override && model_override[0] ? model_override : str_of(doc, "model", "");
    s->session_id = orch_arena_strdup(a, session_id);
    s->tenant_id = orch_arena_strdup(a, org_id);
    s->agent_id = orch_arena_strdup(a, agent_id);
    s->model_id = orch_arena_strdup(a, model);
    s->temperature = num_of(doc, "temperature", 0.2);
    if (s->temperature == 0) s->temperature = 0; /* -0 -> +0 */
    s->max_tokens = (int32_t)num_of(doc, "max_tokens", 4096);
    s->tools = strings(a, cJSON_GetObjectItemCaseSensitive(doc, "tools"), &s->n_tools);
    s->guardrail_hashes = strings(a, cJSON_GetObjectItemCaseSensitive(doc, "guardrail_hashes"),
                                  &s->n_guardrail_hashes);
    const cJSON *g = cJSON_GetObjectItemCaseSensitive(doc, "rbac_grants");
    int ng = cJSON_IsObject(g) ? cJSON_GetArraySize(g) : 0;
    s->rbac_grants = orch_arena_alloc(a, (size_t)(ng ? ng : 1) * sizeof *s->rbac_grants);
    for (const cJSON *e = ng ? g->child : NULL; e && s->rbac_grants; e = e->next) {
        RbacEntry *r = orch_arena_alloc(a, sizeof *r);
        if (!r) return NULL;
        upsquad__runtime__v1__session_snapshot__rbac_grants_entry__init(r);
        r->key = orch_arena_strdup(a, e->string);
        r->value = orch_arena_strdup(a, cJSON_IsString(e) ? e->valuestring : "");
        s->rbac_grants[s->n_rbac_grants++] = r;
    }
    s->persona = orch_arena_strdup(a, str_of(doc, "persona", ""));
    s->max_loops = (int32_t)num_of(doc, "max_loops", 10);
    s->execution_mode = (Upsquad__Runtime__V1__ExecutionMode)(mode ? mode : agentdef_mode(doc));
    const cJSON *chain = cJSON_GetObjectItemCaseSensitive(doc, "fallback_chain");
    fc->primary_model = s->model_id;
    fc->secondary_model = orch_arena_strdup(
        a, cJSON_GetArraySize(chain) > 0 ? cJSON_GetArrayItem(chain, 0)->valuestring : "");
    fc->tertiary_model = orch_arena_strdup(
        a, cJSON_GetArraySize(chain) > 1 ? cJSON_GetArrayItem(chain, 1)->valuestring : "");
    s->fallback_chain = fc;
    s->context_engine_address = orch_arena_strdup(a, str_of(doc, "context_engine_address", ""));
    s->security_config = security(a, doc);
    s->runtime = orch_arena_strdup(a, str_of(doc, "runtime", "langgraph"));
    s->llm_base_url = orch_arena_strdup(a, str_of(doc, "llm_base_url", ""));
    s->org_version_seq = 0;
    const cJSON *mcp = cJSON_GetObjectItemCaseSensitive(doc, "mcp_servers");
    int nm = cJSON_IsObject(mcp) ? cJSON_GetArraySize(mcp) : 0;
    s->mcp_servers = orch_arena_alloc(a, (size_t)(nm ? nm : 1) * sizeof *s->mcp_servers);
    /* Only servers that survive the freeze, i.e. present in tools[] as "mcp:<server_id>". */
    for (const cJSON *e = nm ? mcp->child : NULL; e && s->mcp_servers; e = e->next) {
        char want[160];
        int present = 0;
        snprintf(want, sizeof want, "mcp:%s", e->string);
        for (size_t i = 0; i < s->n_tools; i++)
            if (s->tools[i] && !strcmp(s->tools[i], want)) present = 1;
        if (!present) continue;
        McpEntry *me = orch_arena_alloc(a, sizeof *me);
        McpRef *ref = orch_arena_alloc(a, sizeof *ref);
        if (!me || !ref) return NULL;
        upsquad__runtime__v1__session_snapshot__mcp_servers_entry__init(me);
        upsquad__runtime__v1__mcp_server_ref__init(ref);
        me->key = orch_arena_strdup(a, e->string);
        ref->prefix = orch_arena_strdup(a, str_of(e, "prefix", ""));
        ref->unit_id = orch_arena_strdup(a, str_of(e, "unit_id", ""));
        me->value = ref;
        s->mcp_servers[s->n_mcp_servers++] = me;
    }
    if (a->failed) return NULL;
    char hash[65];
    if (agentdef_hash(s, hash)) return NULL;
    s->snapshot_hash = orch_arena_strdup(a, hash);
    return a->failed ? NULL : s;
}

/* ---- canonical encoding ---- */

typedef struct buf {
    unsigned char *p;
    size_t n, cap;
    int oom;
} buf;

static void put(buf *b, const void *d, size_t n) {
    if (b->oom) return;
    if (b->n + n > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 1024;
        while (cap < b->n + n)
            cap *= 2;
        unsigned char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->n, d, n);
    b->n += n;
}

static void put_u8(buf *b, unsigned v) {
    unsigned char c = (unsigned char)v;
    put(b, &c, 1);
}

static void put_u32(buf *b, uint32_t v) {
    unsigned char c[4] = {(unsigned char)(v >> 24), (unsigned char)(v >> 16),
                          (unsigned char)(v >> 8), (unsigned char)v};
    put(b, c, 4);
}

static void put_u64(buf *b, uint64_t v) {
    put_u32(b, (uint32_t)(v >> 32));
    put_u32(b, (uint32_t)v);
}

static void put_str(buf *b, unsigned field, const char *s) {
    size_t n = s ? strlen(s) : 0;
    put_u8(b, field);
    put_u32(b, (uint32_t)n);
    put(b, s ? s : "", n);
}

static void put_int(buf *b, unsigned field, int64_t v) {
    put_u8(b, field);
    put_u64(b, (uint64_t)v);
}

static void put_double(buf *b, unsigned field, double d) {
    uint64_t u;
    if (d == 0) d = 0; /* -0 and +0 encode alike */
    memcpy(&u, &d, sizeof u);
    put_u8(b, field);
    put_u64(b, u);
}

static void put_bool(buf *b, unsigned field, int v) {
    put_u8(b, field);
    put_u8(b, v ? 1 : 0);
}

static void put_strs(buf *b, unsigned field, char **s, size_t n) {
    put_u8(b, field);
    put_u32(b, (uint32_t)n);
    for (size_t i = 0; i < n; i++) {
        size_t l = strlen(s[i]);
        put_u32(b, (uint32_t)l);
        put(b, s[i], l);
    }
}

static int cmp_entry(const void *x, const void *y) {
    const RbacEntry *a = *(RbacEntry *const *)x, *b = *(RbacEntry *const *)y;
    return strcmp(a->key, b->key);
}

static void put_pattern(buf *b, const ContentPattern *p) {
    put_str(b, 1, p->id);
    put_str(b, 2, p->regex);
    put_str(b, 3, p->severity);
    put_str(b, 4, p->category);
    put_str(b, 5, p->description);
}

int agentdef_canonical(const SessionSnapshot *s, unsigned char **out, size_t *len) {
    buf b = {0};
    /* v2: the configuration alone. 1 session_id and 2 tenant_id are the session's identity,
     * not its configuration: two sessions of one agent configuration hash alike (spec: "the
     * snapshot_hash ensures config drift detection"). 3 agent_id names the configuration. */
    static const char tag[] = "upsquad.snapshot.v2\n";
    put(&b, tag, sizeof tag - 1);
    put_str(&b, 3, s->agent_id);
    put_str(&b, 4, s->model_id);
    put_double(&b, 5, s->temperature);
    put_int(&b, 6, s->max_tokens);
    put_strs(&b, 7, s->tools, s->n_tools);
    put_strs(&b, 8, s->guardrail_hashes, s->n_guardrail_hashes);
    /* map<string,string>: entries sorted by key bytes (a map has no order on the wire) */
    RbacEntry **g = malloc((s->n_rbac_grants ? s->n_rbac_grants : 1) * sizeof *g);
    if (!g) {
        free(b.p);
        return -1;
    }
    if (s->n_rbac_grants) memcpy(g, s->rbac_grants, s->n_rbac_grants * sizeof *g);
    qsort(g, s->n_rbac_grants, sizeof *g, cmp_entry);
    put_u8(&b, 9);
    put_u32(&b, (uint32_t)s->n_rbac_grants);
    for (size_t i = 0; i < s->n_rbac_grants; i++) {
        size_t kl = strlen(g[i]->key), vl = strlen(g[i]->value);
        put_u32(&b, (uint32_t)kl);
        put(&b, g[i]->key, kl);
        put_u32(&b, (uint32_t)vl);
        put(&b, g[i]->value, vl);
    }
    free(g);
    put_str(&b, 10, s->persona);
    /* 11 snapshot_hash: excluded (it is the result) */
    put_int(&b, 12, s->max_loops);
    put_int(&b, 13, s->execution_mode);
    put_u8(&b, 14);
    if (s->fallback_chain) {
        put_u8(&b, 1);
        put_str(&b, 1, s->fallback_chain->primary_model);
        put_str(&b, 2, s->fallback_chain->secondary_model);
        put_str(&b, 3, s->fallback_chain->tertiary_model);
    } else {
        put_u8(&b, 0);
    }
    put_str(&b, 15, s->context_engine_address);
    put_u8(&b, 16);
    const SecurityConfig *c = s->security_config;
    if (c) {
        put_u8(&b, 1);
        put_str(&b, 1, c->input_filter_mode);
        put_str(&b, 2, c->output_filter_mode);
        put_bool(&b, 3, c->redact_secrets);
        put_bool(&b, 4, c->redact_pii);
        put_bool(&b, 5, c->redact_system_prompt);
        put_str(&b, 6, c->schema_validation_mode);
        put_bool(&b, 7, c->tool_scan_enabled);
        put_int(&b, 8, c->tool_result_max_bytes);
        put_u8(&b, 9);
        put_u32(&b, (uint32_t)c->n_custom_block_patterns);
        for (size_t i = 0; i < c->n_custom_block_patterns; i++)
            put_pattern(&b, c->custom_block_patterns[i]);
        put_u8(&b, 10);
        put_u32(&b, (uint32_t)c->n_custom_pii_patterns);
        for (size_t i = 0; i < c->n_custom_pii_patterns; i++)
            put_pattern(&b, c->custom_pii_patterns[i]);
    } else {
        put_u8(&b, 0);
    }
    put_str(&b, 17, s->runtime);
    put_str(&b, 18, s->llm_base_url);
    /* 19 org_version_seq and 20 mcp_servers: excluded, as the spec requires */
    if (b.oom) {
        free(b.p);
        return -1;
    }
    *out = b.p;
    *len = b.n;
    return 0;
}

int agentdef_hash(const SessionSnapshot *s, char out[65]) {
    unsigned char *p;
    size_t n;
    if (agentdef_canonical(s, &p, &n)) return -1;
    ids_sha256_hex(p, n, out);
    free(p);
    return 0;
}
