/*
 * A JSON Schema (draft 2020-12) interpreter for the keywords the definition schema uses:
 * type, enum, const, minimum/maximum (and exclusive), minLength/maxLength, pattern,
 * properties, patternProperties, additionalProperties, required, minProperties/maxProperties,
 * items, minItems/maxItems, uniqueItems, $ref (local), $defs, allOf, anyOf, oneOf, not,
 * if/then/else and boolean schemas.
 *
 * Output contract: only innermost violations. In-place applicators (allOf, $ref, if/then/else,
 * a failed anyOf/oneOf) contribute the violations of the subschemas they apply and never one of
 * their own; `if` is evaluated silently. For each instance node, the schemas that apply to it are
 * first gathered into one set, its own violations reported, then its children visited in
 * document order with the subschemas that apply to each, so the output is in document
 * (pre-)order without sorting.
 */
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <regex.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_internal.h"

enum {
    T_NULL = 1 << 0,
    T_BOOLEAN = 1 << 1,
    T_OBJECT = 1 << 2,
    T_ARRAY = 1 << 3,
    T_NUMBER = 1 << 4,
    T_STRING = 1 << 5,
    T_INTEGER = 1 << 6,
};

typedef struct sch_node sch_node;

typedef struct {
    const char *name; /* borrowed from the schema document */
    uint32_t hash;
    sch_node *node;
} sch_prop;

/* Anchored patterns made of character classes with quantifiers, ^[..]{m,n}[..]*$, are matched
 * without the regex engine (the common shape for names and keys, and the hot one). */
#define SEQ_MAX 8
#define SEQ_MAX_TEXT 1024
typedef struct class_seq {
    size_t n;
    struct {
        uint8_t set[16]; /* ASCII bitmap */
        long min, max;   /* max -1: unbounded */
    } tok[SEQ_MAX];
} class_seq;

typedef struct {
    regex_t re;
    const char *src;
    class_seq *fast;
    sch_node *node;
} sch_pat;

struct sch_node {
    int boolean; /* -1: an object schema; 0: `false`; 1: `true` */
    unsigned types;
    const cJSON *enum_vals;
    const cJSON *const_val;
    bool has_min, has_max, has_xmin, has_xmax;
    double min, max, xmin, xmax;
    long min_len, max_len, min_items, max_items, min_props, max_props; /* -1: absent */
    bool unique_items;
    bool has_pattern;
    regex_t pattern;
    const char *pattern_src;
    struct class_seq *fast; /* the pattern as a class sequence, when it is one */
    sch_prop *props;
    size_t n_props;
    sch_pat *pats;
    size_t n_pats;
    sch_node *additional;
    const char **required;
    size_t n_required;
    sch_node *items;
    sch_node **all_of, **any_of, **one_of;
    size_t n_all_of, n_any_of, n_one_of;
    sch_node *not_, *if_, *then_, *else_;
    sch_node *ref;
    const cJSON *src;
    /* allOf made only of `if {required [k], properties {k: const/enum of strings}} then S`:
     * the ifs are decided by one member lookup instead of one silent validation each. The
     * decision is the same as evaluating every `if`. */
    const char *disc_key;
    const cJSON **disc_vals; /* per allOf entry: the const string, or the enum array */
};

struct defn__schema {
    cJSON *doc;
    sch_node *root;
    sch_node **nodes; /* every node, for lookup while compiling and for freeing */
    size_t n_nodes, cap_nodes;
};

/* FNV-1a: member names are matched against `properties` by hash first. */
static uint32_t name_hash(const char *s) {
    uint32_t h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

/* ------------------------------------------------------------------ compile */

typedef struct {
    defn__schema *s;
    char *err;
    size_t errlen;
} comp;

static int comp_fail(comp *c, const char *where, const char *what) {
    snprintf(c->err, c->errlen, "schema %s: %s", where, what);
    return DEFN_ERR_LOAD;
}

static int compile_node(comp *c, const cJSON *src, const char *where, sch_node **out);

static int compile_list(comp *c, const cJSON *arr, const char *where, sch_node ***out, size_t *n) {
    if (!cJSON_IsArray(arr) || cJSON_GetArraySize(arr) == 0)
        return comp_fail(c, where, "must be a non-empty array of schemas");
    size_t cnt = (size_t)cJSON_GetArraySize(arr);
    *out = calloc(cnt, sizeof(**out));
    if (!*out) return DEFN_ERR_NOMEM;
    *n = cnt;
    size_t i = 0;
    for (const cJSON *e = arr->child; e; e = e->next, i++) {
        int rc = compile_node(c, e, where, &(*out)[i]);
        if (rc != 0) return rc;
    }
    return 0;
}

static int type_bit(const char *name, unsigned *bit) {
    static const struct {
        const char *name;
        unsigned bit;
    } map[] = {{"null", T_NULL},      {"boolean", T_BOOLEAN}, {"object", T_OBJECT},
               {"array", T_ARRAY},    {"number", T_NUMBER},   {"string", T_STRING},
               {"integer", T_INTEGER}};
    for (size_t i = 0; i < sizeof(map) / sizeof(map[0]); i++)
        if (strcmp(name, map[i].name) == 0) {
            *bit = map[i].bit;
            return 0;
        }
    return -1;
}

static int get_count(comp *c, const cJSON *v, const char *where, long *out) {
    if (!cJSON_IsNumber(v) || v->valuedouble < 0 || v->valuedouble != floor(v->valuedouble) ||
        v->valuedouble > 1e9)
        return comp_fail(c, where, "must be a non-negative integer");
    *out = (long)v->valuedouble;
    return 0;
}

static int get_number(comp *c, const cJSON *v, const char *where, double *out) {
    if (!cJSON_IsNumber(v)) return comp_fail(c, where, "must be a number");
    *out = v->valuedouble;
    return 0;
}

static bool seq_char(const char **p, unsigned char *out) {
    unsigned char ch = (unsigned char)**p;
    if (ch == '\\' || ch == '[' || ch == ']' || ch == '\0' || ch >= 0x80) return false;
    *out = ch;
    (*p)++;
    return true;
}

/* Parses src as a class sequence; NULL (use the regex engine) for anything else. */
static class_seq *parse_class_seq(const char *src) {
    size_t len = strlen(src);
    if (len < 2 || src[0] != '^' || src[len - 1] != '$') return NULL;
    class_seq *q = calloc(1, sizeof(*q));
    if (!q) return NULL;
    const char *p = src + 1, *end = src + len - 1;
    while (p < end) {
        if (*p != '[' || q->n == SEQ_MAX || p[1] == '^') goto no;
        p++;
        uint8_t *set = q->tok[q->n].set;
        bool first = true;
        while (p < end && *p != ']') {
            unsigned char lo, hi;
            if (*p == '-' && (first || p[1] == ']')) {
                lo = '-';
                p++;
            } else if (!seq_char(&p, &lo)) {
                goto no;
            }
            hi = lo;
            if (*p == '-' && p[1] != ']') {
                p++;
                if (!seq_char(&p, &hi) || hi < lo) goto no;
            }
            for (unsigned c = lo; c <= hi; c++)
                set[c / 8] |= (uint8_t)(1u << (c % 8));
            first = false;
        }
        if (p >= end || first) goto no;
        p++; /* ] */
        long mn = 1, mx = 1;
        if (p < end && *p == '*') {
            mn = 0;
            mx = -1;
            p++;
        } else if (p < end && *p == '+') {
            mx = -1;
            p++;
        } else if (p < end && *p == '{') {
            char *e;
            mn = strtol(p + 1, &e, 10);
            if (e == p + 1 || mn < 0 || mn > SEQ_MAX_TEXT) goto no;
            mx = mn;
            if (*e == ',') {
                const char *f = e + 1;
                mx = strtol(f, &e, 10);
                if (e == f || mx < mn || mx > SEQ_MAX_TEXT) goto no;
            }
            if (*e != '}') goto no;
            p = e + 1;
        }
        q->tok[q->n].min = mn;
        q->tok[q->n].max = mx;
        q->n++;
    }
    return q;
no:
    free(q);
    return NULL;
}

/* Positions reachable after each token; the text matches when its end is reachable. */
static bool seq_match(const class_seq *q, const char *text, size_t len) {
    bool cur[SEQ_MAX_TEXT + 1], next[SEQ_MAX_TEXT + 1];
    int diff[SEQ_MAX_TEXT + 2];
    memset(cur, 0, (len + 1) * sizeof(bool));
    cur[0] = true;
    for (size_t t = 0; t < q->n; t++) {
        memset(diff, 0, (len + 2) * sizeof(int));
        size_t run_end = 0; /* first position >= p whose byte is outside the class */
        for (size_t p = 0; p <= len; p++) {
            if (run_end < p) run_end = p;
            while (run_end < len) {
                unsigned char c = (unsigned char)text[run_end];
                if (c >= 0x80 || !(q->tok[t].set[c / 8] & (1u << (c % 8)))) break;
                run_end++;
            }
            if (!cur[p]) continue;
            size_t lo = p + (size_t)q->tok[t].min;
            size_t hi = run_end;
            if (q->tok[t].max >= 0 && p + (size_t)q->tok[t].max < hi)
                hi = p + (size_t)q->tok[t].max;
            if (lo > hi) continue;
            diff[lo]++;
            diff[hi + 1]--;
        }
        int acc = 0;
        bool any = false;
        for (size_t p = 0; p <= len; p++) {
            acc += diff[p];
            next[p] = acc > 0;
            any = any || next[p];
        }
        if (!any) return false;
        memcpy(cur, next, (len + 1) * sizeof(bool));
    }
    return cur[len];
}

static bool pattern_match(const regex_t *re, const class_seq *fast, const char *text) {
    size_t len = strlen(text);
    if (fast && len <= SEQ_MAX_TEXT) return seq_match(fast, text, len);
    return regexec(re, text, 0, NULL, 0) == 0;
}

static int compile_regex(comp *c, regex_t *re, const char *src, const char *where) {
    /* The schema's patterns are written in the common subset of ECMA-262 and POSIX ERE, so a
     * client validating with an ECMA engine reads them the same way. */
    if (regcomp(re, src, REG_EXTENDED | REG_NOSUB) != 0)
        return comp_fail(c, where, "pattern does not compile as a POSIX extended regex");
    return 0;
}

static int compile_type(comp *c, sch_node *n, const cJSON *v) {
    unsigned bit;
    if (cJSON_IsString(v)) {
        if (type_bit(v->valuestring, &bit) != 0) return comp_fail(c, "type", v->valuestring);
        n->types = bit;
        return 0;
    }
    if (!cJSON_IsArray(v)) return comp_fail(c, "type", "must be a string or an array");
    for (const cJSON *e = v->child; e; e = e->next) {
        if (!cJSON_IsString(e) || type_bit(e->valuestring, &bit) != 0)
            return comp_fail(c, "type", "unknown type name");
        n->types |= bit;
    }
    return 0;
}

static int compile_props(comp *c, sch_node *n, const cJSON *v, bool patterns) {
    if (!cJSON_IsObject(v)) return comp_fail(c, "properties", "must be an object");
    size_t cnt = (size_t)cJSON_GetArraySize(v);
    if (cnt == 0) return 0;
    if (patterns) {
        n->pats = calloc(cnt, sizeof(*n->pats));
        if (!n->pats) return DEFN_ERR_NOMEM;
    } else {
        n->props = calloc(cnt, sizeof(*n->props));
        if (!n->props) return DEFN_ERR_NOMEM;
    }
    for (const cJSON *e = v->child; e; e = e->next) {
        sch_node *child;
        int rc = compile_node(c, e, e->string, &child);
        if (rc != 0) return rc;
        if (patterns) {
            sch_pat *p = &n->pats[n->n_pats];
            rc = compile_regex(c, &p->re, e->string, "patternProperties");
            if (rc != 0) return rc;
            p->fast = parse_class_seq(e->string);
            p->src = e->string;
            p->node = child;
            n->n_pats++;
        } else {
            n->props[n->n_props].name = e->string;
            n->props[n->n_props].hash = name_hash(e->string);
            n->props[n->n_props].node = child;
            n->n_props++;
        }
    }
    return 0;
}

static int resolve_ref(comp *c, sch_node *n, const cJSON *v) {
    if (!cJSON_IsString(v) || v->valuestring[0] != '#')
        return comp_fail(c, "$ref", "only local references (#...) are supported");
    const cJSON *target = defn__resolve(c->s->doc, v->valuestring + 1);
    if (!target) return comp_fail(c, "$ref", v->valuestring);
    return compile_node(c, target, v->valuestring, &n->ref);
}

/* Keywords that carry no assertion; everything else unknown is a load error. */
static bool is_annotation(const char *k) {
    static const char *const names[] = {"$schema",    "$id",         "$comment", "$defs",
                                        "title",      "description", "default",  "examples",
                                        "deprecated", "readOnly",    "writeOnly"};
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
        if (strcmp(k, names[i]) == 0) return true;
    return false;
}

static int compile_keyword(comp *c, sch_node *n, const cJSON *kw) {
    const char *k = kw->string;
    if (strcmp(k, "type") == 0) return compile_type(c, n, kw);
    if (strcmp(k, "enum") == 0) {
        if (!cJSON_IsArray(kw) || !kw->child) return comp_fail(c, k, "must be a non-empty array");
        n->enum_vals = kw;
        return 0;
    }
    if (strcmp(k, "const") == 0) {
        n->const_val = kw;
        return 0;
    }
    if (strcmp(k, "minimum") == 0) return n->has_min = true, get_number(c, kw, k, &n->min);
    if (strcmp(k, "maximum") == 0) return n->has_max = true, get_number(c, kw, k, &n->max);
    if (strcmp(k, "exclusiveMinimum") == 0)
        return n->has_xmin = true, get_number(c, kw, k, &n->xmin);
    if (strcmp(k, "exclusiveMaximum") == 0)
        return n->has_xmax = true, get_number(c, kw, k, &n->xmax);
    if (strcmp(k, "minLength") == 0) return get_count(c, kw, k, &n->min_len);
    if (strcmp(k, "maxLength") == 0) return get_count(c, kw, k, &n->max_len);
    if (strcmp(k, "minItems") == 0) return get_count(c, kw, k, &n->min_items);
    if (strcmp(k, "maxItems") == 0) return get_count(c, kw, k, &n->max_items);
    if (strcmp(k, "minProperties") == 0) return get_count(c, kw, k, &n->min_props);
    if (strcmp(k, "maxProperties") == 0) return get_count(c, kw, k, &n->max_props);
    if (strcmp(k, "uniqueItems") == 0) {
        if (!cJSON_IsBool(kw)) return comp_fail(c, k, "must be a boolean");
        n->unique_items = cJSON_IsTrue(kw);
        return 0;
    }
    if (strcmp(k, "pattern") == 0) {
        if (!cJSON_IsString(kw)) return comp_fail(c, k, "must be a string");
        n->pattern_src = kw->valuestring;
        int rc = compile_regex(c, &n->pattern, kw->valuestring, k);
        if (rc != 0) return rc;
        n->has_pattern = true;
        n->fast = parse_class_seq(kw->valuestring);
        return 0;
    }
    if (strcmp(k, "properties") == 0) return compile_props(c, n, kw, false);
    if (strcmp(k, "patternProperties") == 0) return compile_props(c, n, kw, true);
    if (strcmp(k, "additionalProperties") == 0) return compile_node(c, kw, k, &n->additional);
    if (strcmp(k, "required") == 0) {
        if (!cJSON_IsArray(kw)) return comp_fail(c, k, "must be an array of strings");
        size_t cnt = (size_t)cJSON_GetArraySize(kw);
        n->required = calloc(cnt ? cnt : 1, sizeof(*n->required));
        if (!n->required) return DEFN_ERR_NOMEM;
        for (const cJSON *e = kw->child; e; e = e->next) {
            if (!cJSON_IsString(e)) return comp_fail(c, k, "must be an array of strings");
            n->required[n->n_required++] = e->valuestring;
        }
        return 0;
    }
    if (strcmp(k, "items") == 0) return compile_node(c, kw, k, &n->items);
    if (strcmp(k, "allOf") == 0) return compile_list(c, kw, k, &n->all_of, &n->n_all_of);
    if (strcmp(k, "anyOf") == 0) return compile_list(c, kw, k, &n->any_of, &n->n_any_of);
    if (strcmp(k, "oneOf") == 0) return compile_list(c, kw, k, &n->one_of, &n->n_one_of);
    if (strcmp(k, "not") == 0) return compile_node(c, kw, k, &n->not_);
    if (strcmp(k, "if") == 0) return compile_node(c, kw, k, &n->if_);
    if (strcmp(k, "then") == 0) return compile_node(c, kw, k, &n->then_);
    if (strcmp(k, "else") == 0) return compile_node(c, kw, k, &n->else_);
    if (strcmp(k, "$ref") == 0) return resolve_ref(c, n, kw);
    if (is_annotation(k)) return 0;
    return comp_fail(c, k, "keyword not supported by this validator");
}

static int register_node(defn__schema *s, sch_node *n) {
    if (s->n_nodes == s->cap_nodes) {
        size_t cap = s->cap_nodes ? s->cap_nodes * 2 : 64;
        sch_node **nodes = realloc(s->nodes, cap * sizeof(*nodes));
        if (!nodes) return DEFN_ERR_NOMEM;
        s->nodes = nodes;
        s->cap_nodes = cap;
    }
    s->nodes[s->n_nodes++] = n;
    return 0;
}

/* Compiles src once: a schema object reached again (through $ref, possibly recursively) maps to
 * the node already registered for it, which is what makes recursive schemas finite. */
static int compile_node(comp *c, const cJSON *src, const char *where, sch_node **out) {
    for (size_t i = 0; i < c->s->n_nodes; i++)
        if (c->s->nodes[i]->src == src) {
            *out = c->s->nodes[i];
            return 0;
        }
    if (!cJSON_IsBool(src) && !cJSON_IsObject(src))
        return comp_fail(c, where, "a schema must be an object or a boolean");
    sch_node *n = calloc(1, sizeof(*n));
    if (!n) return DEFN_ERR_NOMEM;
    n->src = src;
    n->boolean = cJSON_IsBool(src) ? (cJSON_IsTrue(src) ? 1 : 0) : -1;
    n->min_len = n->max_len = n->min_items = n->max_items = n->min_props = n->max_props = -1;
    if (register_node(c->s, n) != 0) {
        free(n);
        return DEFN_ERR_NOMEM;
    }
    *out = n;
    if (n->boolean >= 0) return 0;
    /* if/then/else are compiled by compile_keyword; then/else without if are inert, as in the
     * specification. */
    for (const cJSON *kw = src->child; kw; kw = kw->next) {
        int rc = compile_keyword(c, n, kw);
        if (rc != 0) return rc;
    }
    return 0;
}

/* The allOf-entry's discriminating key and value set, or NULL when it is not of that shape. */
/* No assertion keyword of its own (applicators are checked by the callers). */
static bool no_assertions(const sch_node *n) {
    return n->boolean < 0 && !n->types && !n->enum_vals && !n->const_val && !n->has_min &&
           !n->has_max && !n->has_xmin && !n->has_xmax && n->min_len < 0 && n->max_len < 0 &&
           !n->has_pattern && n->min_items < 0 && n->max_items < 0 && !n->unique_items &&
           n->min_props < 0 && n->max_props < 0 && !n->n_props && !n->n_pats && !n->additional &&
           !n->n_required && !n->items;
}

static bool no_applicators(const sch_node *n) {
    return !n->ref && !n->n_all_of && !n->n_any_of && !n->n_one_of && !n->not_ && !n->if_;
}

/* The allOf entry's discriminating key and value set, or NULL when it is not of that shape:
 * {"if": {"type": "object", "required": [k], "properties": {k: {"const"|"enum": strings}}},
 *  "then": ...}. */
static const char *disc_shape(const sch_node *e, const cJSON **vals) {
    if (!e->if_ || !e->then_ || e->else_ || !no_assertions(e) || e->ref || e->n_all_of ||
        e->n_any_of || e->n_one_of || e->not_)
        return NULL;
    const sch_node *c = e->if_;
    if (c->boolean >= 0 || !no_applicators(c) || c->types != T_OBJECT || c->n_required != 1 ||
        c->n_props != 1 || strcmp(c->required[0], c->props[0].name) != 0 || c->enum_vals ||
        c->const_val || c->n_pats || c->additional || c->min_props >= 0 || c->max_props >= 0)
        return NULL;
    const sch_node *v = c->props[0].node;
    if (!no_applicators(v) || (!v->const_val == !v->enum_vals)) return NULL;
    sch_node bare = *v;
    bare.const_val = NULL;
    bare.enum_vals = NULL;
    if (!no_assertions(&bare)) return NULL;
    if (v->const_val) {
        if (!cJSON_IsString(v->const_val)) return NULL;
        *vals = v->const_val;
    } else {
        for (const cJSON *x = v->enum_vals->child; x; x = x->next)
            if (!cJSON_IsString(x)) return NULL;
        *vals = v->enum_vals;
    }
    return c->required[0];
}

static int find_discriminators(defn__schema *s) {
    for (size_t i = 0; i < s->n_nodes; i++) {
        sch_node *n = s->nodes[i];
        if (n->n_all_of < 2) continue;
        const cJSON **vals = calloc(n->n_all_of, sizeof(*vals));
        if (!vals) return DEFN_ERR_NOMEM;
        const char *key = NULL;
        bool ok = true;
        for (size_t k = 0; k < n->n_all_of && ok; k++) {
            const char *kk = disc_shape(n->all_of[k], &vals[k]);
            ok = kk && (!key || strcmp(key, kk) == 0);
            key = kk;
        }
        if (ok) {
            n->disc_key = key;
            n->disc_vals = vals;
        } else {
            free((void *)vals);
        }
    }
    return 0;
}

int defn__schema_compile(cJSON *doc, defn__schema **out, char *err, size_t errlen) {
    defn__schema *s = calloc(1, sizeof(*s));
    if (!s) {
        cJSON_Delete(doc);
        snprintf(err, errlen, "out of memory");
        return DEFN_ERR_NOMEM;
    }
    s->doc = doc;
    comp c = {.s = s, .err = err, .errlen = errlen};
    int rc = compile_node(&c, doc, "root", &s->root);
    if (rc == 0) rc = find_discriminators(s);
    if (rc != 0) {
        if (rc == DEFN_ERR_NOMEM) snprintf(err, errlen, "out of memory");
        defn__schema_free(s);
        return rc;
    }
    *out = s;
    return 0;
}

void defn__schema_free(defn__schema *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n_nodes; i++) {
        sch_node *n = s->nodes[i];
        if (n->has_pattern) regfree(&n->pattern);
        free(n->fast);
        for (size_t k = 0; k < n->n_pats; k++) {
            regfree(&n->pats[k].re);
            free(n->pats[k].fast);
        }
        free(n->pats);
        free(n->props);
        free((void *)n->required);
        free(n->all_of);
        free(n->any_of);
        free(n->one_of);
        free((void *)n->disc_vals);
        free(n);
    }
    free(s->nodes);
    cJSON_Delete(s->doc);
    free(s);
}

/* ------------------------------------------------------------------ validate */

/* Schemas applying to one instance node. Bounded: the definition schema applies at most a
 * handful per node; a schema needing more is rejected as an error rather than truncated. */
#define SET_MAX 48

typedef struct {
    const sch_node *n[SET_MAX];
    size_t len;
} sch_set;

typedef struct {
    defn_violations *out;
    defn__ptr ptr;
    int nomem;
    const char *key; /* member name of the instance being visited, NULL for items/root */
} vctx;

static bool validate(vctx *v, const cJSON *inst, const sch_set *roots, bool silent);

static bool check_one(vctx *v, const cJSON *inst, const sch_node *n) {
    sch_set s; /* not zero-initialised: only n[0..len) is read */
    s.n[0] = n;
    s.len = 1;
    const char *key = v->key;
    bool ok = validate(v, inst, &s, true);
    v->key = key;
    return ok;
}

static unsigned inst_types(const cJSON *inst) {
    if (cJSON_IsNull(inst)) return T_NULL;
    if (cJSON_IsBool(inst)) return T_BOOLEAN;
    if (cJSON_IsObject(inst)) return T_OBJECT;
    if (cJSON_IsArray(inst)) return T_ARRAY;
    if (cJSON_IsString(inst)) return T_STRING;
    if (cJSON_IsNumber(inst)) {
        double d = inst->valuedouble;
        return isfinite(d) && d == floor(d) ? (T_NUMBER | T_INTEGER) : T_NUMBER;
    }
    return 0;
}

static const char *inst_type_name(const cJSON *inst) {
    unsigned t = inst_types(inst);
    if (t & T_INTEGER) return "integer";
    if (t & T_NUMBER) return "number";
    if (t & T_STRING) return "string";
    if (t & T_OBJECT) return "object";
    if (t & T_ARRAY) return "array";
    if (t & T_BOOLEAN) return "boolean";
    return "null";
}

static int report(vctx *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int report(vctx *v, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (defn__add(v->out, v->ptr.buf, "%s", msg) != 0) v->nomem = 1;
    return 0;
}

/* Compact JSON text of a schema value for a message; "..." when it does not fit. */
static void json_text(const cJSON *j, char *buf, size_t len) {
    char *t = cJSON_PrintUnformatted(j);
    if (!t) {
        snprintf(buf, len, "...");
        return;
    }
    if (strlen(t) >= len) {
        snprintf(buf, len, "%.*s...", (int)(len - 4), t);
    } else {
        snprintf(buf, len, "%s", t);
    }
    cJSON_free(t);
}

static void report_type(vctx *v, const cJSON *inst, unsigned want) {
    static const char *const names[] = {"null",   "boolean", "object", "array",
                                        "number", "string",  "integer"};
    char list[128] = "";
    size_t used = 0;
    for (unsigned b = 0; b < 7; b++) {
        if (!(want & (1u << b))) continue;
        int w = snprintf(list + used, sizeof(list) - used, "%s%s", used ? " or " : "", names[b]);
        if (w > 0) used += (size_t)w;
        if (used >= sizeof(list)) break;
    }
    report(v, "expected %s, but got %s", list, inst_type_name(inst));
}

static void report_enum(vctx *v, const cJSON *vals) {
    char msg[900];
    size_t used = 0;
    for (const cJSON *e = vals->child; e && used < sizeof(msg) - 8; e = e->next) {
        char one[256];
        json_text(e, one, sizeof(one));
        int w = snprintf(msg + used, sizeof(msg) - used, "%s%s", used ? ", " : "", one);
        if (w < 0) break;
        used += (size_t)w;
    }
    report(v, "value must be one of %s", msg);
}

static const char *plural(long n, const char *one, const char *many) {
    return n == 1 ? one : many;
}

static bool member_known(const sch_node *n, const char *name) {
    uint32_t h = name_hash(name);
    for (size_t i = 0; i < n->n_props; i++)
        if (n->props[i].hash == h && strcmp(n->props[i].name, name) == 0) return true;
    for (size_t i = 0; i < n->n_pats; i++)
        if (pattern_match(&n->pats[i].re, n->pats[i].fast, name)) return true;
    return false;
}

/* Assertions of one schema on the node itself; returns false on the first failure if silent. */
static bool check_local(vctx *v, const cJSON *inst, const sch_node *n, bool silent) {
    bool ok = true;
#define FAIL(...)                                                                                  \
    do {                                                                                           \
        ok = false;                                                                                \
        if (silent) return false;                                                                  \
        report(v, __VA_ARGS__);                                                                    \
    } while (0)
    if (n->boolean == 0) {
        if (v->key)
            FAIL("property \"%s\" is not allowed here", v->key);
        else
            FAIL("is not allowed here");
        return ok;
    }
    if (n->boolean == 1) return true;
    unsigned t = inst_types(inst);
    if (n->types && !(n->types & t)) {
        ok = false;
        if (silent) return false;
        report_type(v, inst, n->types);
    }
    if (n->const_val && !defn__json_equal(inst, n->const_val)) {
        if (silent) return false;
        char txt[256];
        json_text(n->const_val, txt, sizeof(txt));
        FAIL("value must be %s", txt);
    }
    if (n->enum_vals) {
        bool found = false;
        for (const cJSON *e = n->enum_vals->child; e && !found; e = e->next)
            found = defn__json_equal(inst, e);
        if (!found) {
            ok = false;
            if (silent) return false;
            report_enum(v, n->enum_vals);
        }
    }
    char a[64];
    if (t & T_NUMBER) {
        double d = inst->valuedouble;
        if (n->has_min && !(d >= n->min)) {
            if (silent) return false;
            defn__fmt_num(n->min, a, sizeof(a));
            FAIL("must be >= %s", a);
        }
        if (n->has_max && !(d <= n->max)) {
            if (silent) return false;
            defn__fmt_num(n->max, a, sizeof(a));
            FAIL("must be <= %s", a);
        }
        if (n->has_xmin && !(d > n->xmin)) {
            if (silent) return false;
            defn__fmt_num(n->xmin, a, sizeof(a));
            FAIL("must be > %s", a);
        }
        if (n->has_xmax && !(d < n->xmax)) {
            if (silent) return false;
            defn__fmt_num(n->xmax, a, sizeof(a));
            FAIL("must be < %s", a);
        }
    }
    if (t & T_STRING) {
        long len =
            (n->min_len >= 0 || n->max_len >= 0) ? (long)defn__utf8_len(inst->valuestring) : 0;
        if (n->min_len >= 0 && len < n->min_len)
            FAIL("length must be >= %ld, but got %ld", n->min_len, len);
        if (n->max_len >= 0 && len > n->max_len)
            FAIL("length must be <= %ld, but got %ld", n->max_len, len);
        if (n->has_pattern && !pattern_match(&n->pattern, n->fast, inst->valuestring))
            FAIL("does not match pattern \"%s\"", n->pattern_src);
    }
    if (t & T_ARRAY) {
        long cnt = (n->min_items >= 0 || n->max_items >= 0) ? cJSON_GetArraySize(inst) : 0;
        if (n->min_items >= 0 && cnt < n->min_items)
            FAIL("must have at least %ld %s, but has %ld", n->min_items,
                 plural(n->min_items, "item", "items"), cnt);
        if (n->max_items >= 0 && cnt > n->max_items)
            FAIL("must have at most %ld %s, but has %ld", n->max_items,
                 plural(n->max_items, "item", "items"), cnt);
        if (n->unique_items) {
            long i = 0;
            for (const cJSON *x = inst->child; x; x = x->next, i++) {
                long j = i + 1;
                for (const cJSON *y = x->next; y; y = y->next, j++)
                    if (defn__json_equal(x, y)) FAIL("items at %ld and %ld are equal", i, j);
            }
        }
    }
    if (t & T_OBJECT) {
        for (size_t i = 0; i < n->n_required; i++)
            if (!cJSON_GetObjectItemCaseSensitive(inst, n->required[i]))
                FAIL("missing required property \"%s\"", n->required[i]);
        long cnt = (n->min_props >= 0 || n->max_props >= 0) ? cJSON_GetArraySize(inst) : 0;
        if (n->min_props >= 0 && cnt < n->min_props)
            FAIL("must have at least %ld %s, but has %ld", n->min_props,
                 plural(n->min_props, "property", "properties"), cnt);
        if (n->max_props >= 0 && cnt > n->max_props)
            FAIL("must have at most %ld %s, but has %ld", n->max_props,
                 plural(n->max_props, "property", "properties"), cnt);
        if (n->additional && n->additional->boolean == 0)
            for (const cJSON *m = inst->child; m; m = m->next)
                if (!member_known(n, m->string)) FAIL("property \"%s\" is not allowed", m->string);
    }
#undef FAIL
    return ok;
}

static bool set_add(sch_set *s, const sch_node *n, vctx *v) {
    for (size_t i = 0; i < s->len; i++)
        if (s->n[i] == n) return true;
    if (s->len == SET_MAX) {
        v->nomem = 1; /* a schema this entangled is a build defect; fail loudly */
        return false;
    }
    s->n[s->len++] = n;
    return true;
}

/* Adds n and every schema it applies in place to the same instance. */
static bool expand(vctx *v, const cJSON *inst, sch_set *s, const sch_node *n, bool silent,
                   bool *ok) {
    size_t before = s->len;
    if (!set_add(s, n, v)) return false;
    if (s->len == before) return true;
    if (n->ref && !expand(v, inst, s, n->ref, silent, ok)) return false;
    if (n->disc_key) {
        const cJSON *m =
            cJSON_IsObject(inst) ? cJSON_GetObjectItemCaseSensitive(inst, n->disc_key) : NULL;
        for (size_t i = 0; cJSON_IsString(m) && i < n->n_all_of; i++) {
            const cJSON *vals = n->disc_vals[i];
            bool hit = false;
            if (cJSON_IsString(vals))
                hit = strcmp(vals->valuestring, m->valuestring) == 0;
            else
                for (const cJSON *x = vals->child; x && !hit; x = x->next)
                    hit = strcmp(x->valuestring, m->valuestring) == 0;
            if (hit && !expand(v, inst, s, n->all_of[i]->then_, silent, ok)) return false;
        }
    } else {
        for (size_t i = 0; i < n->n_all_of; i++)
            if (!expand(v, inst, s, n->all_of[i], silent, ok)) return false;
    }
    if (n->if_) {
        const sch_node *branch = check_one(v, inst, n->if_) ? n->then_ : n->else_;
        if (branch && !expand(v, inst, s, branch, silent, ok)) return false;
    }
    if (n->n_any_of) {
        bool any = false;
        for (size_t i = 0; i < n->n_any_of && !any; i++)
            any = check_one(v, inst, n->any_of[i]);
        /* None holds: every alternative's own violations are the innermost explanation. */
        for (size_t i = 0; !any && i < n->n_any_of; i++)
            if (!expand(v, inst, s, n->any_of[i], silent, ok)) return false;
    }
    if (n->n_one_of) {
        size_t matched = 0;
        for (size_t i = 0; i < n->n_one_of; i++)
            matched += check_one(v, inst, n->one_of[i]);
        if (matched == 0) {
            for (size_t i = 0; i < n->n_one_of; i++)
                if (!expand(v, inst, s, n->one_of[i], silent, ok)) return false;
        } else if (matched > 1) {
            *ok = false;
            if (!silent) report(v, "must match exactly one alternative, but matches %zu", matched);
        }
    }
    if (n->not_ && check_one(v, inst, n->not_)) {
        *ok = false;
        if (!silent) report(v, "must not match the excluded schema");
    }
    return true;
}

static bool validate_member(vctx *v, const cJSON *m, const sch_set *s, bool silent) {
    sch_set child;
    child.len = 0;
    uint32_t h = name_hash(m->string);
    for (size_t i = 0; i < s->len; i++) {
        const sch_node *n = s->n[i];
        if (n->boolean >= 0) continue;
        bool matched = false;
        for (size_t k = 0; k < n->n_props; k++)
            if (n->props[k].hash == h && strcmp(n->props[k].name, m->string) == 0) {
                matched = true;
                if (!set_add(&child, n->props[k].node, v)) return false;
            }
        for (size_t k = 0; k < n->n_pats; k++)
            if (pattern_match(&n->pats[k].re, n->pats[k].fast, m->string)) {
                matched = true;
                if (!set_add(&child, n->pats[k].node, v)) return false;
            }
        /* A `false` additionalProperties was reported on the parent (where the property
         * appears); the value itself is not visited further. */
        if (!matched && n->additional && n->additional->boolean != 0)
            if (!set_add(&child, n->additional, v)) return false;
    }
    if (child.len == 0) return true;
    size_t mark = v->ptr.len;
    if (defn__ptr_push_key(&v->ptr, m->string) == (size_t)-1) {
        v->nomem = 1;
        return false;
    }
    v->key = m->string;
    bool ok = validate(v, m, &child, silent);
    v->key = NULL;
    defn__ptr_pop(&v->ptr, mark);
    return ok;
}

static bool validate_children(vctx *v, const cJSON *inst, const sch_set *s, bool silent) {
    bool ok = true;
    if (cJSON_IsObject(inst)) {
        for (const cJSON *m = inst->child; m && !v->nomem; m = m->next) {
            if (!validate_member(v, m, s, silent)) {
                ok = false;
                if (silent) return false;
            }
        }
        return ok;
    }
    if (!cJSON_IsArray(inst)) return true;
    sch_set child;
    child.len = 0;
    for (size_t i = 0; i < s->len; i++)
        if (s->n[i]->boolean < 0 && s->n[i]->items && !set_add(&child, s->n[i]->items, v))
            return false;
    if (child.len == 0) return true;
    size_t idx = 0;
    for (const cJSON *e = inst->child; e && !v->nomem; e = e->next, idx++) {
        size_t mark = v->ptr.len;
        if (defn__ptr_push_index(&v->ptr, idx) == (size_t)-1) {
            v->nomem = 1;
            return false;
        }
        v->key = NULL;
        bool iok = validate(v, e, &child, silent);
        defn__ptr_pop(&v->ptr, mark);
        if (!iok) {
            ok = false;
            if (silent) return false;
        }
    }
    return ok;
}

/* Drops a violation identical to one already reported on the same node (two schemas in the
 * set asserting the same thing). */
static void dedupe(defn_violations *out, size_t from) {
    for (size_t i = from + 1; i < out->n; i++) {
        for (size_t k = from; k < i; k++) {
            if (strcmp(out->items[i].message, out->items[k].message) == 0 &&
                strcmp(out->items[i].instance_location, out->items[k].instance_location) == 0) {
                free(out->items[i].instance_location);
                free(out->items[i].message);
                memmove(&out->items[i], &out->items[i + 1],
                        (out->n - i - 1) * sizeof(out->items[0]));
                out->n--;
                i--;
                break;
            }
        }
    }
}

static bool validate(vctx *v, const cJSON *inst, const sch_set *roots, bool silent) {
    sch_set s;
    s.len = 0;
    bool ok = true;
    const char *key = v->key;
    size_t first = v->out ? v->out->n : 0;
    for (size_t i = 0; i < roots->len; i++)
        if (!expand(v, inst, &s, roots->n[i], silent, &ok)) return false;
    if (!ok && silent) return false;
    v->key = key;
    for (size_t i = 0; i < s.len; i++) {
        if (!check_local(v, inst, s.n[i], silent)) {
            ok = false;
            if (silent) return false;
        }
    }
    if (!silent) dedupe(v->out, first);
    if (!validate_children(v, inst, &s, silent)) ok = false;
    return ok && !v->nomem;
}

int defn__schema_validate(const defn__schema *s, const cJSON *instance, defn_violations *out) {
    vctx v = {.out = out};
    if (defn__ptr_init(&v.ptr) != 0) return DEFN_ERR_NOMEM;
    size_t before = out->n + out->dropped;
    sch_set roots = {.n = {s->root}, .len = 1};
    validate(&v, instance, &roots, false);
    defn__ptr_free(&v.ptr);
    if (v.nomem) return DEFN_ERR_NOMEM;
    return out->n + out->dropped > before ? DEFN_INVALID : DEFN_OK;
}
