/* Cues (how a test makes an invocation fail or stall) and fixture templates. */
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "devtools.h"
#include "ids.h"
#include "util.h"

/* ---- cues ---- */

enum {
    CUE_FAIL,
    CUE_FAIL_TIMES,
    CUE_SLEEP_MS,
    CUE_SLEEP_TIMES,
    CUE_REPLY_DELAY_MS,
    CUE_RESULT,
    CUE_PENDING
};
static const char *const cue_names[] = {"fail",           "fail_times", "sleep_ms", "sleep_times",
                                        "reply_delay_ms", "result",     "pending"};
#define N_CUES (sizeof cue_names / sizeof cue_names[0])

static int cue_index(const char *name, size_t len) {
    for (size_t i = 0; i < N_CUES; i++)
        if (strlen(cue_names[i]) == len && strncmp(cue_names[i], name, len) == 0) return (int)i;
    return -1;
}

static int set_count(long long v, long long max, long long *dst) {
    if (v < 0 || v > max) return -1;
    *dst = v;
    return 0;
}

/* Applies one cue whose value is given as text (string cues) or JSON (top-level members). */
static int apply_num(dt_cues *c, int cue, long long v) {
    long long tmp = 0;
    switch (cue) {
    case CUE_FAIL_TIMES:
        if (set_count(v, 1000000, &tmp) != 0) return -1;
        c->fail_times = (int)tmp;
        return 0;
    case CUE_SLEEP_TIMES:
        if (set_count(v, 1000000, &tmp) != 0) return -1;
        c->sleep_times = (int)tmp;
        return 0;
    case CUE_PENDING:
        if (set_count(v, 1000000, &tmp) != 0) return -1;
        c->pending = (int)tmp;
        return 0;
    case CUE_SLEEP_MS:
        return set_count(v, DT_CUE_MAX_MS, &c->sleep_ms);
    case CUE_REPLY_DELAY_MS:
        return set_count(v, DT_CUE_MAX_MS, &c->reply_delay_ms);
    default:
        return -1;
    }
}

static int set_fail(dt_cues *c, const char *code, size_t len) {
    c->fail = 1;
    if (!len) {
        snprintf(c->fail_code, sizeof c->fail_code, "provider_error");
        return 0;
    }
    if (len >= sizeof c->fail_code) return -1;
    snprintf(c->fail_code, sizeof c->fail_code, "%.*s", (int)len, code);
    return 0;
}

static int set_result(dt_cues *c, cJSON *obj) {
    if (!cJSON_IsObject(obj)) {
        cJSON_Delete(obj);
        return -1;
    }
    cJSON_Delete(c->result);
    c->result = obj;
    return 0;
}

/* A top-level `__name` member. */
static int apply_member(dt_cues *c, int cue, cJSON *v) {
    if (cue == CUE_RESULT) return set_result(c, cJSON_Duplicate(v, 1));
    if (cue == CUE_FAIL) {
        if (cJSON_IsFalse(v)) return 0;
        if (cJSON_IsTrue(v)) return set_fail(c, NULL, 0);
        if (cJSON_IsString(v)) return set_fail(c, v->valuestring, strlen(v->valuestring));
        return -1;
    }
    if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble)) return -1;
    return apply_num(c, cue, (long long)v->valuedouble);
}

/* `__name[=value]` tokens in free text. Text that merely contains `__something` which is not
 * a cue (Python's __init__) is left alone; a cue with a bad value is an error. */
static int scan_text(dt_cues *c, const char *s, char *err, size_t errlen) {
    for (const char *p = strstr(s, "__"); p; p = strstr(p, "__")) {
        if (p > s && (isalnum((unsigned char)p[-1]) || p[-1] == '_')) {
            p += 2;
            continue;
        }
        const char *name = p + 2, *q = name;
        while (islower((unsigned char)*q) || *q == '_')
            q++;
        int cue = cue_index(name, (size_t)(q - name));
        p = q;
        if (cue < 0) continue;
        const char *val = *q == '=' ? q + 1 : NULL, *end = val;
        int rc = 0;
        if (cue == CUE_RESULT) {
            end = val && *val == '{' ? util_json_object_end(val) : NULL;
            rc = end ? set_result(c, cJSON_ParseWithLength(val, (size_t)(end - val))) : -1;
        } else if (cue == CUE_FAIL) {
            while (end && (isalnum((unsigned char)*end) || *end == '_' || *end == '-'))
                end++;
            rc = set_fail(c, val, val ? (size_t)(end - val) : 0);
        } else {
            while (end && isdigit((unsigned char)*end))
                end++;
            rc = val && end > val && end - val < 12 ? apply_num(c, cue, atoll(val)) : -1;
        }
        if (rc != 0) return util_errf(err, errlen, -1, "cue __%s: bad value", cue_names[cue]);
        if (end) p = end;
    }
    return 0;
}

static int scan_tree(dt_cues *c, const cJSON *v, char *err, size_t errlen) {
    if (cJSON_IsString(v)) return scan_text(c, v->valuestring, err, errlen);
    for (const cJSON *e = (cJSON_IsObject(v) || cJSON_IsArray(v)) ? v->child : NULL; e; e = e->next)
        if (scan_tree(c, e, err, errlen) != 0) return -1;
    return 0;
}

int dt_cues_parse(cJSON *args, dt_cues *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!cJSON_IsObject(args)) return 0;
    /* Top-level members first, removed so that fixtures never echo them; then text cues. */
    cJSON *e = args->child;
    while (e) {
        cJSON *next = e->next;
        if (strncmp(e->string, "__", 2) == 0) {
            int cue = cue_index(e->string + 2, strlen(e->string + 2));
            if (cue < 0) return util_errf(err, errlen, -1, "arguments.%s: unknown cue", e->string);
            if (apply_member(out, cue, e) != 0)
                return util_errf(err, errlen, -1, "arguments.%s: bad value", e->string);
            cJSON_Delete(cJSON_DetachItemViaPointer(args, e));
        }
        e = next;
    }
    return scan_tree(out, args, err, errlen);
}

void dt_cues_free(dt_cues *c) {
    cJSON_Delete(c->result);
    c->result = NULL;
}

/* ---- templates ---- */

typedef struct sbuf {
    char *p;
    size_t len, cap;
    int oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 64;
        while (cap < b->len + n + 1)
            cap *= 2;
        char *np = realloc(b->p, cap);
        if (!np) {
            b->oom = 1;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

/* Deterministic values derived from the key, so the same invocation renders the same. */
static cJSON *ctx_value(const dt_ctx *x, const char *name) {
    char hex[65], buf[64];
    ids_sha256_hex(x->key, strlen(x->key), hex);
    if (strcmp(name, "key") == 0) return cJSON_CreateString(x->key);
    if (strcmp(name, "org_id") == 0) return cJSON_CreateString(x->org_id);
    if (strcmp(name, "run_id") == 0) return cJSON_CreateString(x->run_id);
    if (strcmp(name, "step_name") == 0) return cJSON_CreateString(x->step_name);
    if (strcmp(name, "tool") == 0) return cJSON_CreateString(x->tool);
    if (strcmp(name, "action") == 0) return cJSON_CreateString(x->action);
    if (strcmp(name, "iteration") == 0) return cJSON_CreateNumber(x->iteration);
    if (strcmp(name, "lap") == 0) return cJSON_CreateNumber(x->lap);
    if (strcmp(name, "n") == 0) { /* an issue or pull-request number: 100..9999 */
        char h4[5] = {hex[0], hex[1], hex[2], hex[3], 0};
        return cJSON_CreateNumber(100 + (double)(strtoul(h4, NULL, 16) % 9900));
    }
    if (strcmp(name, "sha") == 0) {
        hex[40] = '\0';
        return cJSON_CreateString(hex);
    }
    if (strcmp(name, "uuid") == 0) {
        snprintf(buf, sizeof buf, "%.8s-%.4s-4%.3s-8%.3s-%.12s", hex, hex + 8, hex + 12, hex + 15,
                 hex + 18);
        return cJSON_CreateString(buf);
    }
    return NULL;
}

/* The value a `name` or `name|default` template refers to (new tree; NULL when absent and
 * without a default). */
static cJSON *lookup(const char *ref, size_t len, const cJSON *args, const dt_ctx *x) {
    char name[256];
    const char *bar = memchr(ref, '|', len);
    size_t nlen = bar ? (size_t)(bar - ref) : len;
    if (nlen >= sizeof name) return NULL;
    memcpy(name, ref, nlen);
    name[nlen] = '\0';
    cJSON *v = NULL;
    if (name[0] == '@') {
        v = ctx_value(x, name + 1);
    } else {
        const cJSON *a = cJSON_GetObjectItemCaseSensitive(args, name);
        if (a && !cJSON_IsNull(a)) v = cJSON_Duplicate(a, 1);
    }
    if (!v && bar) {
        /* a default that parses as JSON keeps its type (|3, |true); otherwise it is text */
        v = cJSON_ParseWithLength(bar + 1, len - nlen - 1);
        if (!v) {
            char *s = strndup(bar + 1, len - nlen - 1);
            v = s ? cJSON_CreateString(s) : NULL;
            free(s);
        }
    }
    return v;
}

static void sb_add_value(sbuf *b, const cJSON *v) {
    char num[64];
    if (!v || cJSON_IsNull(v)) return;
    if (cJSON_IsString(v)) {
        sb_add(b, v->valuestring, strlen(v->valuestring));
    } else if (cJSON_IsBool(v)) {
        sb_add(b, cJSON_IsTrue(v) ? "true" : "false", cJSON_IsTrue(v) ? 4 : 5);
    } else if (cJSON_IsNumber(v)) {
        double d = v->valuedouble;
        if (d == floor(d) && fabs(d) < 1e15)
            snprintf(num, sizeof num, "%.0f", d);
        else
            snprintf(num, sizeof num, "%.17g", d);
        sb_add(b, num, strlen(num));
    } else {
        char *s = cJSON_PrintUnformatted(v);
        if (s)
            sb_add(b, s, strlen(s));
        else
            b->oom = 1;
        free(s);
    }
}

static cJSON *render_string(const char *s, const cJSON *args, const dt_ctx *x) {
    size_t n = strlen(s);
    /* exactly one template: the referenced value itself, with its type */
    if (n > 3 && strncmp(s, "${", 2) == 0 && s[n - 1] == '}' && !memchr(s + 2, '}', n - 3)) {
        cJSON *v = lookup(s + 2, n - 3, args, x);
        return v ? v : cJSON_CreateNull();
    }
    sbuf b = {0};
    sb_add(&b, "", 0);
    const char *p = s;
    for (const char *t = strstr(p, "${"); t; t = strstr(p, "${")) {
        const char *end = strchr(t + 2, '}');
        if (!end) break;
        sb_add(&b, p, (size_t)(t - p));
        cJSON *v = lookup(t + 2, (size_t)(end - t - 2), args, x);
        sb_add_value(&b, v);
        cJSON_Delete(v);
        p = end + 1;
    }
    sb_add(&b, p, strlen(p));
    cJSON *out = b.oom ? NULL : cJSON_CreateString(b.p);
    free(b.p);
    return out;
}

cJSON *dt_render(const cJSON *t, const cJSON *args, const dt_ctx *x) {
    if (cJSON_IsString(t)) return render_string(t->valuestring, args, x);
    if (!cJSON_IsObject(t) && !cJSON_IsArray(t)) return cJSON_Duplicate(t, 0);
    cJSON *out = cJSON_IsObject(t) ? cJSON_CreateObject() : cJSON_CreateArray();
    for (const cJSON *e = t->child; e && out; e = e->next) {
        cJSON *v = dt_render(e, args, x);
        if (!v) {
            cJSON_Delete(out);
            return NULL;
        }
        if (cJSON_IsObject(t))
            cJSON_AddItemToObject(out, e->string, v);
        else
            cJSON_AddItemToArray(out, v);
    }
    return out;
}
