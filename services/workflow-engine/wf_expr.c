/* Templates and conditions over the run state (wf_expr.h). */
#include "wf_expr.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_internal.h"

const cJSON *wf_expr_resolve(const cJSON *state, const char *ptr) {
    return defn__resolve(state, ptr);
}

typedef struct {
    char *b;
    size_t n, cap;
} sbuf;

static int sb_put(sbuf *s, const char *p, size_t n) {
    if (s->n + n + 1 > s->cap) {
        size_t cap = (s->cap ? s->cap * 2 : 64);
        while (cap < s->n + n + 1)
            cap *= 2;
        char *nb = realloc(s->b, cap);
        if (!nb) return -1;
        s->b = nb;
        s->cap = cap;
    }
    memcpy(s->b + s->n, p, n);
    s->n += n;
    s->b[s->n] = 0;
    return 0;
}

/* A template is exactly one `${...}` and nothing else: the value keeps its type. */
static int whole_template(const char *t, char *ptr, size_t len) {
    size_t n = strlen(t);
    if (n < 3 || strncmp(t, "${", 2) != 0 || t[n - 1] != '}') return 0;
    const char *close = strchr(t + 2, '}');
    if (close != t + n - 1 || (size_t)(close - t - 2) >= len) return 0;
    memcpy(ptr, t + 2, (size_t)(close - t - 2));
    ptr[close - t - 2] = 0;
    return 1;
}

size_t wf_expr_max_rendered = WF_EXPR_MAX_RENDERED_DEFAULT;

/* Bytes v takes as JSON text, near enough to bound memory (strings unescaped). */
static size_t json_size(const cJSON *v) {
    if (cJSON_IsString(v)) return strlen(v->valuestring) + 2;
    if (!cJSON_IsObject(v) && !cJSON_IsArray(v)) return 24;
    size_t n = 2;
    for (const cJSON *c = v->child; c; c = c->next)
        n += json_size(c) + (c->string ? strlen(c->string) + 4 : 1);
    return n;
}

static int over(size_t need, size_t *budget, char *err, size_t errlen) {
    if (need <= *budget) {
        *budget -= need;
        return 0;
    }
    snprintf(err, errlen,
             "rendered value exceeds %zu bytes (UPSQUAD_WF_MAX_RENDERED): templates expand "
             "to too much data",
             wf_expr_max_rendered);
    return -1;
}

/* One template against state; *budget is what this render may still produce (bytes). */
static cJSON *render(const cJSON *state, const char *tmpl, size_t *budget, char *err,
                     size_t errlen) {
    char ptr[1024];
    if (whole_template(tmpl, ptr, sizeof ptr)) {
        const cJSON *v = wf_expr_resolve(state, ptr);
        if (!v) {
            snprintf(err, errlen, "template ${%s} does not resolve", ptr);
            return NULL;
        }
        if (over(json_size(v), budget, err, errlen)) return NULL;
        return cJSON_Duplicate(v, 1);
    }
    sbuf s = {0};
    const char *p = tmpl;
    cJSON *out = NULL;
    sb_put(&s, "", 0);
    while (*p) {
        if (p[0] == '$' && p[1] == '$' && p[2] == '{') { /* $${ is a literal ${ */
            sb_put(&s, "${", 2);
            p += 3;
            continue;
        }
        if (p[0] == '$' && p[1] == '{') {
            const char *close = strchr(p + 2, '}');
            if (!close) {
                sb_put(&s, p, strlen(p));
                break;
            }
            size_t n = (size_t)(close - p - 2);
            if (n >= sizeof ptr) n = sizeof ptr - 1;
            memcpy(ptr, p + 2, n);
            ptr[n] = 0;
            const cJSON *v = wf_expr_resolve(state, ptr);
            if (!v) {
                snprintf(err, errlen, "template ${%s} does not resolve", ptr);
                goto done;
            }
            /* checked before copying: a template repeating a large value fails here, having
             * allocated no more than the limit */
            if (over(json_size(v), budget, err, errlen)) goto done;
            if (cJSON_IsString(v)) {
                sb_put(&s, v->valuestring, strlen(v->valuestring));
            } else {
                char *j = cJSON_PrintUnformatted(v);
                if (j) sb_put(&s, j, strlen(j));
                free(j);
            }
            p = close + 1;
            continue;
        }
        sb_put(&s, p, 1);
        p++;
    }
    out = cJSON_CreateString(s.b ? s.b : "");
done:
    free(s.b);
    return out;
}

cJSON *wf_expr_render(const cJSON *state, const char *tmpl, char *err, size_t errlen) {
    size_t budget = wf_expr_max_rendered;
    return render(state, tmpl, &budget, err, errlen);
}

static cJSON *render_tree(const cJSON *state, const cJSON *v, size_t *budget, char *err,
                          size_t errlen) {
    if (cJSON_IsString(v)) return render(state, v->valuestring, budget, err, errlen);
    if (cJSON_IsObject(v) || cJSON_IsArray(v)) {
        cJSON *out = cJSON_IsObject(v) ? cJSON_CreateObject() : cJSON_CreateArray();
        for (const cJSON *c = v->child; c && out; c = c->next) {
            cJSON *r = render_tree(state, c, budget, err, errlen);
            if (!r) {
                cJSON_Delete(out);
                return NULL;
            }
            if (cJSON_IsObject(v))
                cJSON_AddItemToObject(out, c->string, r);
            else
                cJSON_AddItemToArray(out, r);
        }
        return out;
    }
    return cJSON_Duplicate(v, 1);
}

/* The budget spans the whole tree: a `with` block of many small templates each naming the
 * same large value amplifies as much as one long template. */
cJSON *wf_expr_render_tree(const cJSON *state, const cJSON *v, char *err, size_t errlen) {
    size_t budget = wf_expr_max_rendered;
    return render_tree(state, v, &budget, err, errlen);
}

static bool num_cmp(const cJSON *a, const cJSON *b, const char *op) {
    if (!cJSON_IsNumber(a) || !cJSON_IsNumber(b)) return false;
    double x = a->valuedouble, y = b->valuedouble;
    if (!strcmp(op, "gt")) return x > y;
    if (!strcmp(op, "gte")) return x >= y;
    if (!strcmp(op, "lt")) return x < y;
    return x <= y;
}

static bool in_list(const cJSON *v, const cJSON *list) {
    const cJSON *c;
    cJSON_ArrayForEach(c, list) if (defn__json_equal(v, c)) return true;
    return false;
}

bool wf_expr_holds(const cJSON *state, const cJSON *cond) {
    const cJSON *opj = cJSON_GetObjectItemCaseSensitive(cond, "op");
    if (!cJSON_IsString(opj)) return false;
    const char *op = opj->valuestring;
    if (!strcmp(op, "all") || !strcmp(op, "any") || !strcmp(op, "none")) {
        const cJSON *of = cJSON_GetObjectItemCaseSensitive(cond, "of"), *c;
        int held = 0, n = 0;
        cJSON_ArrayForEach(c, of) {
            n++;
            held += wf_expr_holds(state, c) ? 1 : 0;
        }
        if (!strcmp(op, "all")) return held == n;
        if (!strcmp(op, "any")) return held > 0;
        return held == 0;
    }
    const cJSON *path = cJSON_GetObjectItemCaseSensitive(cond, "path");
    const cJSON *value = cJSON_GetObjectItemCaseSensitive(cond, "value");
    const cJSON *v = cJSON_IsString(path) ? wf_expr_resolve(state, path->valuestring) : NULL;
    if (!strcmp(op, "exists")) return v != NULL;
    if (!strcmp(op, "not_exists")) return v == NULL;
    if (!v) return false; /* a comparison on an absent value is false, ne/not_in included */
    if (!strcmp(op, "eq")) return defn__json_equal(v, value);
    if (!strcmp(op, "ne")) return !defn__json_equal(v, value);
    if (!strcmp(op, "gt") || !strcmp(op, "gte") || !strcmp(op, "lt") || !strcmp(op, "lte"))
        return num_cmp(v, value, op);
    if (!strcmp(op, "in")) return in_list(v, value);
    if (!strcmp(op, "not_in")) return !in_list(v, value);
    if (!strcmp(op, "contains")) {
        if (cJSON_IsArray(v)) return in_list(value, v);
        if (cJSON_IsString(v) && cJSON_IsString(value))
            return strstr(v->valuestring, value->valuestring) != NULL;
        return false;
    }
    return false;
}

static bool type_ok(const cJSON *v, const char *type) {
    if (!strcmp(type, "string")) return cJSON_IsString(v);
    if (!strcmp(type, "number")) return cJSON_IsNumber(v);
    if (!strcmp(type, "integer"))
        return cJSON_IsNumber(v) && floor(v->valuedouble) == v->valuedouble;
    if (!strcmp(type, "boolean")) return cJSON_IsBool(v);
    if (!strcmp(type, "object")) return cJSON_IsObject(v);
    if (!strcmp(type, "array")) return cJSON_IsArray(v);
    return true;
}

int wf_expr_check_fields(const cJSON *spec, const cJSON *obj, const char *what, char *err,
                         size_t errlen) {
    const cJSON *f;
    cJSON_ArrayForEach(f, spec) {
        const cJSON *type = cJSON_GetObjectItemCaseSensitive(f, "type");
        const cJSON *req = cJSON_GetObjectItemCaseSensitive(f, "required");
        const cJSON *v = obj ? cJSON_GetObjectItemCaseSensitive(obj, f->string) : NULL;
        if (!v || cJSON_IsNull(v)) {
            if (cJSON_IsTrue(req)) {
                snprintf(err, errlen, "%s.%s is required", what, f->string);
                return -1;
            }
            continue;
        }
        if (cJSON_IsString(type) && !type_ok(v, type->valuestring)) {
            snprintf(err, errlen, "%s.%s must be of type %s", what, f->string, type->valuestring);
            return -1;
        }
    }
    return 0;
}
