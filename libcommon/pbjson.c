/* Struct <-> cJSON and Timestamp helpers: see pbjson.h. */
#include "pbjson.h"
#include "util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PBJSON__PATH_MAX 256
#define PBJSON__TS_MIN (-62135596800LL) /* 0001-01-01T00:00:00Z */
#define PBJSON__TS_MAX 253402300799LL   /* 9999-12-31T23:59:59Z */

typedef Google__Protobuf__Struct pb_struct;
typedef Google__Protobuf__Struct__FieldsEntry pb_entry;
typedef Google__Protobuf__Value pb_value;
typedef Google__Protobuf__ListValue pb_list;

/* The JSON pointer of the item being converted, for error messages. */
typedef struct pbjson__ctx {
    char path[PBJSON__PATH_MAX];
    size_t plen;
    char *err;
    size_t errlen;
    ProtobufCAllocator *a; /* NULL: malloc/free */
} pbjson__ctx;

/* Every node of a tree comes from the context's allocator (zeroed), or the heap. */
static void *pbjson__alloc(ProtobufCAllocator *a, size_t n) {
    void *p = a ? a->alloc(a->allocator_data, n) : malloc(n);
    if (p) memset(p, 0, n);
    return p;
}

static char *pbjson__strdup(ProtobufCAllocator *a, const char *s) {
    size_t n = strlen(s) + 1;
    char *p = pbjson__alloc(a, n);
    if (p) memcpy(p, s, n);
    return p;
}

static void pbjson__pfree(ProtobufCAllocator *a, void *p) {
    if (!a)
        free(p);
    else if (p)
        a->free(a->allocator_data, p);
}

static int pbjson__fail(pbjson__ctx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int pbjson__fail(pbjson__ctx *c, const char *fmt, ...) {
    if (c->err && c->errlen) {
        char msg[160];
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        snprintf(c->err, c->errlen, "%s: %s", c->plen ? c->path : "/", msg);
    }
    return -1;
}

/* Appends "/token" (RFC 6901: '~' -> "~0", '/' -> "~1"); silently truncated when long. */
static void pbjson__push(pbjson__ctx *c, const char *tok) {
    size_t p = c->plen;
    if (p + 1 < sizeof c->path) c->path[p++] = '/';
    for (; *tok && p + 2 < sizeof c->path; tok++) {
        if (*tok == '~' || *tok == '/') {
            c->path[p++] = '~';
            c->path[p++] = *tok == '~' ? '0' : '1';
        } else {
            c->path[p++] = *tok;
        }
    }
    c->path[p] = '\0';
    c->plen = p;
}

static void pbjson__pop(pbjson__ctx *c, size_t plen) {
    c->plen = plen;
    c->path[plen] = '\0';
}

/* ---- freeing heap trees ---- */

static void pbjson__free_list(ProtobufCAllocator *a, pb_list *l);
static void pbjson__free_struct(ProtobufCAllocator *a, pb_struct *s);

static void pbjson__free_value(ProtobufCAllocator *a, pb_value *v) {
    if (!v) return;
    switch (v->kind_case) {
    case GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE:
        pbjson__pfree(a, v->string_value);
        break;
    case GOOGLE__PROTOBUF__VALUE__KIND_STRUCT_VALUE:
        pbjson__free_struct(a, v->struct_value);
        break;
    case GOOGLE__PROTOBUF__VALUE__KIND_LIST_VALUE:
        pbjson__free_list(a, v->list_value);
        break;
    default:
        break;
    }
    pbjson__pfree(a, v);
}

static void pbjson__free_struct(ProtobufCAllocator *a, pb_struct *s) {
    if (!s) return;
    for (size_t i = 0; i < s->n_fields; i++) {
        if (!s->fields[i]) continue;
        pbjson__pfree(a, s->fields[i]->key);
        pbjson__free_value(a, s->fields[i]->value);
        pbjson__pfree(a, s->fields[i]);
    }
    pbjson__pfree(a, s->fields);
    pbjson__pfree(a, s);
}

static void pbjson__free_list(ProtobufCAllocator *a, pb_list *l) {
    if (!l) return;
    for (size_t i = 0; i < l->n_values; i++)
        pbjson__free_value(a, l->values[i]);
    pbjson__pfree(a, l->values);
    pbjson__pfree(a, l);
}

void pbjson_value_free(pb_value *v) {
    pbjson__free_value(NULL, v);
}

void pbjson_struct_free(pb_struct *s) {
    pbjson__free_struct(NULL, s);
}

/* ---- JSON -> protobuf ---- */

static int pbjson__value(pbjson__ctx *c, const cJSON *j, pb_value **out, int depth);

static int pbjson__keycmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int pbjson__check_keys(pbjson__ctx *c, const cJSON *obj, size_t n) {
    const char **keys;
    size_t i = 0;
    int rc = 0;
    if (n < 2) return 0;
    keys = malloc(n * sizeof *keys);
    if (!keys) return pbjson__fail(c, "out of memory");
    for (const cJSON *m = obj->child; m; m = m->next)
        keys[i++] = m->string;
    qsort(keys, n, sizeof *keys, pbjson__keycmp);
    for (i = 1; i < n && rc == 0; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0)
            rc = pbjson__fail(c, "duplicate key \"%.64s\"", keys[i]);
    free(keys);
    return rc;
}

static int pbjson__struct(pbjson__ctx *c, const cJSON *obj, pb_struct **out, int depth) {
    size_t n = 0, plen = c->plen;
    pb_struct *s;
    if (depth > PBJSON_MAX_DEPTH) return pbjson__fail(c, "nested deeper than %d", PBJSON_MAX_DEPTH);
    for (const cJSON *m = obj->child; m; m = m->next)
        n++;
    for (const cJSON *m = obj->child; m; m = m->next) {
        if (!m->string || !util_utf8_valid(m->string))
            return pbjson__fail(c, "member name is not valid UTF-8");
    }
    if (pbjson__check_keys(c, obj, n) != 0) return -1;
    s = pbjson__alloc(c->a, sizeof *s);
    if (!s) return pbjson__fail(c, "out of memory");
    google__protobuf__struct__init(s);
    if (n && !(s->fields = pbjson__alloc(c->a, n * sizeof *s->fields))) goto oom;
    for (const cJSON *m = obj->child; m; m = m->next) {
        pb_entry *e = pbjson__alloc(c->a, sizeof *e);
        if (!e) goto oom;
        google__protobuf__struct__fields_entry__init(e);
        s->fields[s->n_fields++] = e; /* linked first: a failure below frees it with s */
        if (!(e->key = pbjson__strdup(c->a, m->string))) goto oom;
        pbjson__push(c, m->string);
        int rc = pbjson__value(c, m, &e->value, depth);
        pbjson__pop(c, plen);
        if (rc != 0) goto fail;
    }
    *out = s;
    return 0;
oom:
    pbjson__fail(c, "out of memory");
fail:
    pbjson__free_struct(c->a, s);
    return -1;
}

static int pbjson__list(pbjson__ctx *c, const cJSON *arr, pb_list **out, int depth) {
    size_t n = 0, i = 0, plen = c->plen;
    pb_list *l;
    if (depth > PBJSON_MAX_DEPTH) return pbjson__fail(c, "nested deeper than %d", PBJSON_MAX_DEPTH);
    for (const cJSON *m = arr->child; m; m = m->next)
        n++;
    l = pbjson__alloc(c->a, sizeof *l);
    if (!l) return pbjson__fail(c, "out of memory");
    google__protobuf__list_value__init(l);
    if (n && !(l->values = pbjson__alloc(c->a, n * sizeof *l->values))) goto oom;
    for (const cJSON *m = arr->child; m; m = m->next, i++) {
        char idx[24];
        snprintf(idx, sizeof idx, "%zu", i);
        pbjson__push(c, idx);
        int rc = pbjson__value(c, m, &l->values[i], depth);
        pbjson__pop(c, plen);
        if (rc != 0) goto fail;
        l->n_values++;
    }
    *out = l;
    return 0;
oom:
    pbjson__fail(c, "out of memory");
fail:
    pbjson__free_list(c->a, l);
    return -1;
}

/* depth: containers already open above j. */
static int pbjson__value(pbjson__ctx *c, const cJSON *j, pb_value **out, int depth) {
    pb_value *v = pbjson__alloc(c->a, sizeof *v);
    int rc = 0;
    if (!v) return pbjson__fail(c, "out of memory");
    google__protobuf__value__init(v);
    if (cJSON_IsNull(j)) {
        v->kind_case = GOOGLE__PROTOBUF__VALUE__KIND_NULL_VALUE;
        v->null_value = GOOGLE__PROTOBUF__NULL_VALUE__NULL_VALUE;
    } else if (cJSON_IsBool(j)) {
        v->kind_case = GOOGLE__PROTOBUF__VALUE__KIND_BOOL_VALUE;
        v->bool_value = cJSON_IsTrue(j);
    } else if (cJSON_IsNumber(j)) {
        if (!isfinite(j->valuedouble)) {
            rc = pbjson__fail(c, "number is not finite");
        } else {
            v->kind_case = GOOGLE__PROTOBUF__VALUE__KIND_NUMBER_VALUE;
            v->number_value = j->valuedouble;
        }
    } else if (cJSON_IsString(j)) {
        if (!j->valuestring || !util_utf8_valid(j->valuestring)) {
            rc = pbjson__fail(c, "string is not valid UTF-8");
        } else if (!(v->string_value = pbjson__strdup(c->a, j->valuestring))) {
            rc = pbjson__fail(c, "out of memory");
        } else {
            v->kind_case = GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE;
        }
    } else if (cJSON_IsObject(j)) {
        rc = pbjson__struct(c, j, &v->struct_value, depth + 1);
        if (rc == 0) v->kind_case = GOOGLE__PROTOBUF__VALUE__KIND_STRUCT_VALUE;
    } else if (cJSON_IsArray(j)) {
        rc = pbjson__list(c, j, &v->list_value, depth + 1);
        if (rc == 0) v->kind_case = GOOGLE__PROTOBUF__VALUE__KIND_LIST_VALUE;
    } else {
        rc = pbjson__fail(c, "not a JSON value");
    }
    if (rc != 0) {
        pbjson__free_value(c->a, v);
        return -1;
    }
    *out = v;
    return 0;
}

int pbjson_struct_from_json(const cJSON *obj, pb_struct **out, char *err, size_t errlen) {
    return pbjson_struct_from_json_a(obj, NULL, out, err, errlen);
}

int pbjson_value_from_json(const cJSON *v, pb_value **out, char *err, size_t errlen) {
    return pbjson_value_from_json_a(v, NULL, out, err, errlen);
}

int pbjson_struct_from_json_a(const cJSON *obj, ProtobufCAllocator *alloc, pb_struct **out,
                              char *err, size_t errlen) {
    pbjson__ctx c = {.err = err, .errlen = errlen, .a = alloc};
    if (!out) return pbjson__fail(&c, "no output");
    if (!cJSON_IsObject(obj)) return pbjson__fail(&c, "not a JSON object");
    return pbjson__struct(&c, obj, out, 1);
}

int pbjson_value_from_json_a(const cJSON *v, ProtobufCAllocator *alloc, pb_value **out, char *err,
                             size_t errlen) {
    pbjson__ctx c = {.err = err, .errlen = errlen, .a = alloc};
    if (!out || !v) return pbjson__fail(&c, "no value");
    return pbjson__value(&c, v, out, 0);
}

/* ---- protobuf -> JSON ---- */

static cJSON *pbjson__to_value(const pb_value *v, int depth);

typedef struct pbjson__key {
    const char *key;
    size_t idx;
} pbjson__key;

static int pbjson__key_order(const void *a, const void *b) {
    const pbjson__key *x = a, *y = b;
    int r = strcmp(x->key, y->key);
    return r ? r : (x->idx < y->idx ? -1 : x->idx > y->idx);
}

/* Marks in skip[] every entry whose key appears again later (map semantics: last wins). */
static int pbjson__mark_repeats(const pb_struct *s, unsigned char *skip) {
    pbjson__key *k = malloc(s->n_fields * sizeof *k);
    if (!k) return -1;
    for (size_t i = 0; i < s->n_fields; i++) {
        const char *key = s->fields[i] ? s->fields[i]->key : NULL;
        k[i].key = key ? key : "";
        k[i].idx = i;
    }
    qsort(k, s->n_fields, sizeof *k, pbjson__key_order);
    for (size_t i = 0; i + 1 < s->n_fields; i++)
        if (strcmp(k[i].key, k[i + 1].key) == 0) skip[k[i].idx] = 1;
    free(k);
    return 0;
}

static cJSON *pbjson__to_struct(const pb_struct *s, int depth) {
    cJSON *o;
    unsigned char *skip = NULL;
    if (depth > PBJSON_MAX_DEPTH) return NULL;
    if (!(o = cJSON_CreateObject())) return NULL;
    if (!s || s->n_fields == 0) return o;
    if (s->n_fields > 1) {
        skip = calloc(s->n_fields, 1);
        if (!skip || pbjson__mark_repeats(s, skip) != 0) goto fail;
    }
    for (size_t i = 0; i < s->n_fields; i++) {
        const pb_entry *e = s->fields[i];
        cJSON *item;
        if (!e || (skip && skip[i])) continue;
        item = pbjson__to_value(e->value, depth);
        if (!item) goto fail;
        if (!cJSON_AddItemToObject(o, e->key ? e->key : "", item)) {
            cJSON_Delete(item);
            goto fail;
        }
    }
    free(skip);
    return o;
fail:
    free(skip);
    cJSON_Delete(o);
    return NULL;
}

static cJSON *pbjson__to_list(const pb_list *l, int depth) {
    cJSON *a;
    if (depth > PBJSON_MAX_DEPTH) return NULL;
    if (!(a = cJSON_CreateArray())) return NULL;
    for (size_t i = 0; l && i < l->n_values; i++) {
        cJSON *item = pbjson__to_value(l->values[i], depth);
        if (!item || !cJSON_AddItemToArray(a, item)) {
            cJSON_Delete(item);
            cJSON_Delete(a);
            return NULL;
        }
    }
    return a;
}

static cJSON *pbjson__to_value(const pb_value *v, int depth) {
    if (!v) return cJSON_CreateNull();
    switch (v->kind_case) {
    case GOOGLE__PROTOBUF__VALUE__KIND_NUMBER_VALUE:
        return isfinite(v->number_value) ? cJSON_CreateNumber(v->number_value) : cJSON_CreateNull();
    case GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE:
        return cJSON_CreateString(v->string_value ? v->string_value : "");
    case GOOGLE__PROTOBUF__VALUE__KIND_BOOL_VALUE:
        return cJSON_CreateBool(v->bool_value);
    case GOOGLE__PROTOBUF__VALUE__KIND_STRUCT_VALUE:
        return pbjson__to_struct(v->struct_value, depth + 1);
    case GOOGLE__PROTOBUF__VALUE__KIND_LIST_VALUE:
        return pbjson__to_list(v->list_value, depth + 1);
    default:
        return cJSON_CreateNull();
    }
}

cJSON *pbjson_struct_to_json(const pb_struct *s) {
    return pbjson__to_struct(s, 1);
}

cJSON *pbjson_value_to_json(const pb_value *v) {
    return pbjson__to_value(v, 0);
}

/* ---- timestamps ---- */

/* Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm). */
static int64_t pbjson__days_from_civil(int64_t y, unsigned m, unsigned d) {
    y -= m <= 2;
    int64_t era = (y >= 0 ? y : y - 399) / 400;
    unsigned yoe = (unsigned)(y - era * 400);
    unsigned doy = (153 * (m > 2 ? m - 3 : m + 9) + 2) / 5 + d - 1;
    unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (int64_t)doe - 719468;
}

static void pbjson__civil_from_days(int64_t z, int64_t *y, unsigned *m, unsigned *d) {
    z += 719468;
    int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    unsigned doe = (unsigned)(z - era * 146097);
    unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    unsigned mp = (5 * doy + 2) / 153;
    *d = doy - (153 * mp + 2) / 5 + 1;
    *m = mp < 10 ? mp + 3 : mp - 9;
    *y = (int64_t)yoe + era * 400 + (*m <= 2);
}

void pbjson_ts_now(Google__Protobuf__Timestamp *ts) {
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    google__protobuf__timestamp__init(ts);
    ts->seconds = now.tv_sec;
    ts->nanos = (int32_t)now.tv_nsec;
}

int64_t pbjson_ts_to_ms(const Google__Protobuf__Timestamp *ts) {
    if (ts->seconds > INT64_MAX / 1000 - 1) return INT64_MAX;
    if (ts->seconds < INT64_MIN / 1000 + 1) return INT64_MIN;
    return ts->seconds * 1000 + ts->nanos / 1000000;
}

void pbjson_ts_from_ms(Google__Protobuf__Timestamp *ts, int64_t ms) {
    int64_t s = ms / 1000, r = ms % 1000;
    if (r < 0) r += 1000, s -= 1;
    google__protobuf__timestamp__init(ts);
    ts->seconds = s;
    ts->nanos = (int32_t)(r * 1000000);
}

int pbjson_ts_to_rfc3339(const Google__Protobuf__Timestamp *ts, char *buf, size_t len) {
    int64_t days, secs, y;
    unsigned m, d;
    int n, nanos;
    if (!ts || !buf || len < PBJSON_TS_MAX) return -1;
    if (ts->seconds < PBJSON__TS_MIN || ts->seconds > PBJSON__TS_MAX || ts->nanos < 0 ||
        ts->nanos > 999999999)
        return -1;
    days = ts->seconds / 86400;
    secs = ts->seconds % 86400;
    if (secs < 0) secs += 86400, days -= 1;
    pbjson__civil_from_days(days, &y, &m, &d);
    n = snprintf(buf, len, "%04lld-%02u-%02uT%02d:%02d:%02d", (long long)y, m, d,
                 (int)(secs / 3600), (int)(secs / 60 % 60), (int)(secs % 60));
    nanos = ts->nanos;
    if (nanos % 1000000 == 0 && nanos)
        n += snprintf(buf + n, len - (size_t)n, ".%03d", nanos / 1000000);
    else if (nanos % 1000 == 0 && nanos)
        n += snprintf(buf + n, len - (size_t)n, ".%06d", nanos / 1000);
    else if (nanos)
        n += snprintf(buf + n, len - (size_t)n, ".%09d", nanos);
    snprintf(buf + n, len - (size_t)n, "Z");
    return 0;
}

static int pbjson__digits(const char *s, int n, int *out) {
    int v = 0;
    for (int i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9') return -1;
        v = v * 10 + (s[i] - '0');
    }
    *out = v;
    return 0;
}

int pbjson_ts_parse_rfc3339(const char *s, Google__Protobuf__Timestamp *ts) {
    static const unsigned char mdays[] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    int y, mo, d, h, mi, sec, nanos = 0, oh = 0, om = 0, sign = 0;
    const char *p;
    int64_t secs;
    if (!s || !ts || strlen(s) < 20) return -1;
    if (pbjson__digits(s, 4, &y) || s[4] != '-' || pbjson__digits(s + 5, 2, &mo) || s[7] != '-' ||
        pbjson__digits(s + 8, 2, &d) || (s[10] != 'T' && s[10] != 't') ||
        pbjson__digits(s + 11, 2, &h) || s[13] != ':' || pbjson__digits(s + 14, 2, &mi) ||
        s[16] != ':' || pbjson__digits(s + 17, 2, &sec))
        return -1;
    p = s + 19;
    if (*p == '.') {
        int nd = 0;
        for (p++; *p >= '0' && *p <= '9'; p++, nd++) {
            if (nd == 9) return -1;
            nanos = nanos * 10 + (*p - '0');
        }
        if (nd == 0) return -1;
        for (; nd < 9; nd++)
            nanos *= 10;
    }
    if (*p == 'Z' || *p == 'z') {
        p++;
    } else if (*p == '+' || *p == '-') {
        sign = *p == '+' ? 1 : -1;
        if (pbjson__digits(p + 1, 2, &oh) || p[3] != ':' || pbjson__digits(p + 4, 2, &om))
            return -1;
        if (oh > 23 || om > 59) return -1;
        p += 6;
    } else {
        return -1;
    }
    if (*p != '\0') return -1;
    if (y < 1 || mo < 1 || mo > 12 || d < 1 || h > 23 || mi > 59 || sec > 59) return -1;
    int leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    if (d > mdays[mo - 1] + (mo == 2 && leap)) return -1;
    secs = pbjson__days_from_civil(y, (unsigned)mo, (unsigned)d) * 86400 + h * 3600 + mi * 60 +
           sec - sign * (oh * 3600 + om * 60);
    if (secs < PBJSON__TS_MIN || secs > PBJSON__TS_MAX) return -1;
    google__protobuf__timestamp__init(ts);
    ts->seconds = secs;
    ts->nanos = nanos;
    return 0;
}
