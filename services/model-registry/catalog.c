/* Parsing and validation of the model catalogue data file. */
#include "catalog.h"
#include "ids.h"
#include "util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MR_TEXT_MAX 4096 /* longest free-text field (score_basis, note, url) */

#define fail(err, errlen, ...) util_errf((err), (errlen), -1, __VA_ARGS__)

/* ---- dates (proleptic Gregorian, days since 1970-01-01) ---- */

static int64_t days_from_civil(int64_t y, unsigned m, unsigned d) {
    y -= m <= 2;
    const int64_t era = (y >= 0 ? y : y - 399) / 400;
    const unsigned yoe = (unsigned)(y - era * 400);
    const unsigned doy = (153 * (m + (m > 2 ? -3 : 9)) + 2) / 5 + d - 1;
    const unsigned doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    return era * 146097 + (int64_t)doe - 719468;
}

static void civil_from_days(int64_t z, int *y, unsigned *m, unsigned *d) {
    z += 719468;
    const int64_t era = (z >= 0 ? z : z - 146096) / 146097;
    const unsigned doe = (unsigned)(z - era * 146097);
    const unsigned yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    const unsigned doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    const unsigned mp = (5 * doy + 2) / 153;
    *d = doy - (153 * mp + 2) / 5 + 1;
    *m = mp < 10 ? mp + 3 : mp - 9;
    *y = (int)((int64_t)yoe + era * 400 + (*m <= 2));
}

static int is_leap(int y) {
    return (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
}

int mr_date_parse(const char *s, int32_t *days) {
    if (!s || strlen(s) != 10 || s[4] != '-' || s[7] != '-') return -1;
    int v[8], k = 0;
    for (int i = 0; i < 10; i++) {
        if (i == 4 || i == 7) continue;
        if (s[i] < '0' || s[i] > '9') return -1;
        v[k++] = s[i] - '0';
    }
    int y = v[0] * 1000 + v[1] * 100 + v[2] * 10 + v[3];
    unsigned m = (unsigned)(v[4] * 10 + v[5]), d = (unsigned)(v[6] * 10 + v[7]);
    static const unsigned mdays[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    if (y < 1970 || m < 1 || m > 12 || d < 1) return -1;
    unsigned dim = mdays[m - 1] + (m == 2 && is_leap(y));
    if (d > dim) return -1;
    *days = (int32_t)days_from_civil(y, m, d);
    return 0;
}

void mr_date_format(int32_t days, char buf[11]) {
    int y;
    unsigned m, d;
    civil_from_days(days, &y, &m, &d);
    unsigned uy = y < 0 ? 0u : (unsigned)y % 10000u;
    const unsigned v[8] = {uy / 1000,   uy / 100 % 10, uy / 10 % 10, uy % 10,
                           m / 10 % 10, m % 10,        d / 10 % 10,  d % 10};
    for (int i = 0, k = 0; i < 10; i++)
        buf[i] = (i == 4 || i == 7) ? '-' : (char)('0' + v[k++]);
    buf[10] = '\0';
}

int32_t mr_day_of(int64_t unix_seconds) {
    int64_t d = unix_seconds / 86400;
    if (unix_seconds < 0 && unix_seconds % 86400) d--;
    return (int32_t)d;
}

/* ---- prices ---- */

const mr_price *mr_model_price_at(const mr_model *m, int32_t day) {
    const mr_price *best = NULL;
    for (size_t i = 0; i < m->n_prices; i++) {
        if (m->prices[i].effective_from > day) break;
        best = &m->prices[i];
    }
    return best;
}

int32_t mr_model_next_change(const mr_model *m, int32_t day) {
    for (size_t i = 0; i < m->n_prices; i++)
        if (m->prices[i].effective_from > day) return m->prices[i].effective_from;
    return MR_DATE_NONE;
}

double mr_blended_price(double in, double out) {
    return (3.0 * in + out) / 4.0;
}

double mr_cost_efficiency(double in, double out) {
    /* Bounds of the log scale: $0.10/M scores 1, $100/M scores 0. */
    const double lo = 0.1, hi = 100.0;
    double b = mr_blended_price(in, out);
    if (b <= lo) return 1.0;
    if (b >= hi) return 0.0;
    return (log10(hi) - log10(b)) / (log10(hi) - log10(lo));
}

int mr_version_cmp(const char *a, const char *b) {
    while (*a && *b) {
        if (*a >= '0' && *a <= '9' && *b >= '0' && *b <= '9') {
            while (*a == '0')
                a++;
            while (*b == '0')
                b++;
            size_t la = 0, lb = 0;
            while (a[la] >= '0' && a[la] <= '9')
                la++;
            while (b[lb] >= '0' && b[lb] <= '9')
                lb++;
            if (la != lb) return la < lb ? -1 : 1;
            int c = strncmp(a, b, la);
            if (c) return c;
            a += la;
            b += lb;
            continue;
        }
        if (*a != *b) return (unsigned char)*a < (unsigned char)*b ? -1 : 1;
        a++;
        b++;
    }
    return *a ? 1 : *b ? -1 : 0;
}

const char *mr_status_name(int status) {
    switch (status) {
    case MR_STATUS_ACTIVE:
        return "active";
    case MR_STATUS_DEPRECATED:
        return "deprecated";
    case MR_STATUS_RETIRED:
        return "retired";
    default:
        return "unknown";
    }
}

int mr_status_parse(const char *s, int *status) {
    static const char *names[] = {"active", "deprecated", "retired"};
    for (int i = 0; i < 3; i++)
        if (s && strcmp(s, names[i]) == 0) {
            *status = i;
            return 0;
        }
    return -1;
}

int mr_lower_trim(const char *s, size_t len, char *buf, size_t cap) {
    while (len && (*s == ' ' || *s == '\t'))
        s++, len--;
    while (len && (s[len - 1] == ' ' || s[len - 1] == '\t'))
        len--;
    if (len + 1 > cap) return -1;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        buf[i] = (c >= 'A' && c <= 'Z') ? (char)(c - 'A' + 'a') : c;
    }
    buf[len] = '\0';
    return (int)len;
}

/* ---- allocation ---- */

int mr_catalog_alloc(mr_catalog *c, size_t n) {
    c->models = n ? calloc(n, sizeof *c->models) : NULL;
    if (n && !c->models) return -1;
    c->n = n;
    return 0;
}

int mr_model_alloc_prices(mr_model *m, size_t n) {
    m->prices = n ? calloc(n, sizeof *m->prices) : NULL;
    if (n && !m->prices) return -1;
    m->n_prices = n;
    return 0;
}

void mr_catalog_free(mr_catalog *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n; i++) {
        mr_model *m = &c->models[i];
        free(m->model_id);
        free(m->provider);
        free(m->display_name);
        free(m->evidence);
        free(m->score_basis);
        free(m->successor);
        for (size_t j = 0; j < m->n_prices; j++) {
            free(m->prices[j].source_url);
            free(m->prices[j].note);
        }
        free(m->prices);
    }
    free(c->models);
    free(c->catalog_version);
    memset(c, 0, sizeof *c);
}

/* ---- validation ---- */

static int valid_id(const char *s, size_t max, int allow_dot_us) {
    size_t n = s ? strlen(s) : 0;
    if (n == 0 || n >= max) return 0;
    if (!((s[0] >= 'a' && s[0] <= 'z') || (s[0] >= '0' && s[0] <= '9'))) return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-' ||
                 (allow_dot_us && (c == '.' || c == '_'));
        if (!ok) return 0;
    }
    return 1;
}

static int valid_text(const char *s, size_t max, int allow_empty) {
    if (!s) return 0;
    size_t n = strlen(s);
    if ((!allow_empty && n == 0) || n > max) return 0;
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20) return 0;
    return 1;
}

static int unit_score(double v) {
    return isfinite(v) && v >= 0.0 && v <= 1.0;
}

static int validate_prices(const mr_model *m, size_t i, char *err, size_t errlen) {
    if (m->n_prices == 0 || m->n_prices > MR_MAX_PRICES)
        return fail(err, errlen, "models[%zu].prices: expected 1..%d price rows", i, MR_MAX_PRICES);
    for (size_t j = 0; j < m->n_prices; j++) {
        const mr_price *p = &m->prices[j];
        if (j && p->effective_from <= m->prices[j - 1].effective_from)
            return fail(err, errlen,
                        "models[%zu].prices[%zu].effective_from: rows must be in strictly "
                        "ascending date order",
                        i, j);
        if (!isfinite(p->input_per_million) || p->input_per_million < 0 ||
            p->input_per_million > 10000)
            return fail(err, errlen, "models[%zu].prices[%zu].input_per_million: out of 0..10000",
                        i, j);
        if (!isfinite(p->output_per_million) || p->output_per_million < 0 ||
            p->output_per_million > 10000)
            return fail(err, errlen, "models[%zu].prices[%zu].output_per_million: out of 0..10000",
                        i, j);
        if (!valid_text(p->source_url, 512, 0) || strncmp(p->source_url, "https://", 8) != 0)
            return fail(err, errlen, "models[%zu].prices[%zu].source_url: expected an https URL", i,
                        j);
        if (p->verified_on == MR_DATE_NONE)
            return fail(err, errlen, "models[%zu].prices[%zu].verified_on: required", i, j);
        if (!valid_text(p->note, 512, 1))
            return fail(err, errlen, "models[%zu].prices[%zu].note: invalid text", i, j);
    }
    return 0;
}

static int validate_lifecycle(const mr_model *m, size_t i, char *err, size_t errlen) {
    if (m->status < MR_STATUS_ACTIVE || m->status > MR_STATUS_RETIRED)
        return fail(err, errlen, "models[%zu].lifecycle.status: invalid", i);
    if (m->status == MR_STATUS_ACTIVE &&
        (m->deprecated_on != MR_DATE_NONE || m->shutdown_on != MR_DATE_NONE || m->successor))
        return fail(err, errlen,
                    "models[%zu].lifecycle: an active model has no deprecation date, shutdown "
                    "date or successor",
                    i);
    if (m->status == MR_STATUS_RETIRED && m->shutdown_on == MR_DATE_NONE)
        return fail(err, errlen, "models[%zu].lifecycle.shutdown_on: required for a retired model",
                    i);
    if (m->deprecated_on != MR_DATE_NONE && m->shutdown_on != MR_DATE_NONE &&
        m->shutdown_on < m->deprecated_on)
        return fail(err, errlen, "models[%zu].lifecycle.shutdown_on: before deprecated_on", i);
    if (m->successor && !valid_id(m->successor, MR_ID_MAX, 1))
        return fail(err, errlen, "models[%zu].lifecycle.successor: not a model id", i);
    if (m->successor && strcmp(m->successor, m->model_id) == 0)
        return fail(err, errlen, "models[%zu].lifecycle.successor: a model cannot succeed itself",
                    i);
    return 0;
}

static int validate_model(const mr_model *m, size_t i, char *err, size_t errlen) {
    if (!valid_id(m->model_id, MR_ID_MAX, 1))
        return fail(err, errlen,
                    "models[%zu].model_id: expected 1..%d characters of [a-z0-9._-] starting "
                    "with a letter or digit",
                    i, MR_ID_MAX - 1);
    if (!valid_id(m->provider, MR_PROVIDER_MAX, 0))
        return fail(err, errlen, "models[%zu].provider: expected 1..%d characters of [a-z0-9-]", i,
                    MR_PROVIDER_MAX - 1);
    if (!valid_text(m->display_name, 128, 0))
        return fail(err, errlen, "models[%zu].display_name: expected 1..128 characters", i);
    if (m->max_context_tokens <= 0)
        return fail(err, errlen, "models[%zu].max_context_tokens: must be positive", i);
    if (!unit_score(m->tool_use_quality))
        return fail(err, errlen, "models[%zu].tool_use_quality: out of 0..1", i);
    if (!m->supports_tool_use && m->tool_use_quality != 0.0)
        return fail(err, errlen,
                    "models[%zu].tool_use_quality: must be 0 when supports_tool_use is false", i);
    const double *sc[4] = {&m->reasoning, &m->code_generation, &m->structured_ops,
                           &m->long_context};
    static const char *names[4] = {"reasoning", "code_generation", "structured_ops",
                                   "long_context"};
    for (int k = 0; k < 4; k++)
        if (!unit_score(*sc[k]))
            return fail(err, errlen, "models[%zu].capabilities.%s: out of 0..1", i, names[k]);
    if (!m->evidence ||
        (strcmp(m->evidence, "benchmarks") != 0 && strcmp(m->evidence, "family-position") != 0))
        return fail(err, errlen, "models[%zu].evidence: expected benchmarks or family-position", i);
    if (!valid_text(m->score_basis, MR_TEXT_MAX, 0))
        return fail(err, errlen, "models[%zu].score_basis: required text", i);
    if (validate_lifecycle(m, i, err, errlen)) return -1;
    return validate_prices(m, i, err, errlen);
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

int mr_catalog_validate(const mr_catalog *c, bool check_successors, char *err, size_t errlen) {
    int rc = -1;
    const char **ids = NULL;
    if (!valid_text(c->catalog_version, 64, 0))
        return fail(err, errlen, "catalog_version: expected 1..64 characters");
    if (c->n > MR_MAX_MODELS)
        return fail(err, errlen, "models: more than %d models", MR_MAX_MODELS);
    for (size_t i = 0; i < c->n; i++)
        if (validate_model(&c->models[i], i, err, errlen)) return -1;
    if (c->n == 0) return 0;
    ids = malloc(c->n * sizeof *ids);
    if (!ids) return fail(err, errlen, "out of memory");
    for (size_t i = 0; i < c->n; i++)
        ids[i] = c->models[i].model_id;
    qsort(ids, c->n, sizeof *ids, cmp_str_ptr);
    for (size_t i = 1; i < c->n; i++)
        if (strcmp(ids[i], ids[i - 1]) == 0) {
            fail(err, errlen, "models: duplicate model_id \"%s\"", ids[i]);
            goto done;
        }
    if (check_successors)
        for (size_t i = 0; i < c->n; i++) {
            const char *s = c->models[i].successor;
            if (s && !bsearch(&s, ids, c->n, sizeof *ids, cmp_str_ptr)) {
                fail(err, errlen,
                     "models[%zu].lifecycle.successor: \"%s\" is not a model of the catalogue", i,
                     s);
                goto done;
            }
        }
    rc = 0;
done:
    free(ids);
    return rc;
}

/* ---- JSON ---- */

/* Refuses members other than `allowed` (NULL-terminated) so a misspelt key is an error. */
static int only_keys(const cJSON *obj, const char *const *allowed, const char *where, char *err,
                     size_t errlen) {
    for (const cJSON *it = obj->child; it; it = it->next) {
        int ok = 0;
        for (const char *const *k = allowed; *k; k++)
            if (it->string && strcmp(it->string, *k) == 0) ok = 1;
        if (!ok)
            return fail(err, errlen, "%s.%s: unknown key", where, it->string ? it->string : "");
    }
    return 0;
}

static int get_string(const cJSON *obj, const char *key, int nullable, char **out,
                      const char *where, char *err, size_t errlen) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (nullable && (!v || cJSON_IsNull(v))) return 0;
    if (!cJSON_IsString(v)) return fail(err, errlen, "%s.%s: expected a string", where, key);
    *out = strdup(v->valuestring);
    if (!*out) return fail(err, errlen, "out of memory");
    return 0;
}

static int get_date(const cJSON *obj, const char *key, int nullable, int32_t *out,
                    const char *where, char *err, size_t errlen) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = MR_DATE_NONE;
    if (nullable && (!v || cJSON_IsNull(v))) return 0;
    if (!cJSON_IsString(v) || mr_date_parse(v->valuestring, out))
        return fail(err, errlen, "%s.%s: not a YYYY-MM-DD date", where, key);
    return 0;
}

static int get_number(const cJSON *obj, const char *key, double *out, const char *where, char *err,
                      size_t errlen) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsNumber(v)) return fail(err, errlen, "%s.%s: expected a number", where, key);
    *out = v->valuedouble;
    return 0;
}

static int get_bool(const cJSON *obj, const char *key, bool *out, const char *where, char *err,
                    size_t errlen) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!cJSON_IsBool(v)) return fail(err, errlen, "%s.%s: expected true or false", where, key);
    *out = cJSON_IsTrue(v);
    return 0;
}

static int parse_price(const cJSON *jp, mr_price *p, const char *where, char *err, size_t errlen) {
    static const char *const keys[] = {"effective_from",
                                       "input_per_million",
                                       "output_per_million",
                                       "source_url",
                                       "verified_on",
                                       "note",
                                       NULL};
    if (!cJSON_IsObject(jp)) return fail(err, errlen, "%s: expected an object", where);
    if (only_keys(jp, keys, where, err, errlen)) return -1;
    if (get_date(jp, "effective_from", 0, &p->effective_from, where, err, errlen)) return -1;
    if (get_number(jp, "input_per_million", &p->input_per_million, where, err, errlen)) return -1;
    if (get_number(jp, "output_per_million", &p->output_per_million, where, err, errlen)) return -1;
    if (get_string(jp, "source_url", 0, &p->source_url, where, err, errlen)) return -1;
    if (get_date(jp, "verified_on", 0, &p->verified_on, where, err, errlen)) return -1;
    const cJSON *note = cJSON_GetObjectItemCaseSensitive(jp, "note");
    if (note && !cJSON_IsNull(note)) return get_string(jp, "note", 0, &p->note, where, err, errlen);
    p->note = strdup("");
    return p->note ? 0 : fail(err, errlen, "out of memory");
}

static int parse_capabilities(const cJSON *jm, mr_model *m, const char *where, char *err,
                              size_t errlen) {
    static const char *const keys[] = {"reasoning", "code_generation", "structured_ops",
                                       "long_context", NULL};
    char w[64];
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(jm, "capabilities");
    snprintf(w, sizeof w, "%s.capabilities", where);
    if (!cJSON_IsObject(c)) return fail(err, errlen, "%s: expected an object", w);
    if (cJSON_GetObjectItemCaseSensitive(c, "cost_efficiency"))
        return fail(err, errlen,
                    "%s.cost_efficiency: derived from the price by the service, not stored", w);
    if (only_keys(c, keys, w, err, errlen)) return -1;
    if (get_number(c, "reasoning", &m->reasoning, w, err, errlen)) return -1;
    if (get_number(c, "code_generation", &m->code_generation, w, err, errlen)) return -1;
    if (get_number(c, "structured_ops", &m->structured_ops, w, err, errlen)) return -1;
    return get_number(c, "long_context", &m->long_context, w, err, errlen);
}

static int parse_lifecycle(const cJSON *jm, mr_model *m, const char *where, char *err,
                           size_t errlen) {
    static const char *const keys[] = {"status", "deprecated_on", "shutdown_on", "successor", NULL};
    char w[64];
    const cJSON *l = cJSON_GetObjectItemCaseSensitive(jm, "lifecycle");
    snprintf(w, sizeof w, "%s.lifecycle", where);
    if (!cJSON_IsObject(l)) return fail(err, errlen, "%s: expected an object", w);
    if (only_keys(l, keys, w, err, errlen)) return -1;
    const cJSON *st = cJSON_GetObjectItemCaseSensitive(l, "status");
    if (!cJSON_IsString(st) || mr_status_parse(st->valuestring, &m->status))
        return fail(err, errlen, "%s.status: expected active, deprecated or retired", w);
    if (get_date(l, "deprecated_on", 1, &m->deprecated_on, w, err, errlen)) return -1;
    if (get_date(l, "shutdown_on", 1, &m->shutdown_on, w, err, errlen)) return -1;
    return get_string(l, "successor", 1, &m->successor, w, err, errlen);
}

static int parse_model(const cJSON *jm, mr_model *m, size_t i, char *err, size_t errlen) {
    static const char *const keys[] = {"model_id",
                                       "provider",
                                       "display_name",
                                       "released_on",
                                       "max_context_tokens",
                                       "supports_streaming",
                                       "supports_tool_use",
                                       "tool_use_quality",
                                       "capabilities",
                                       "evidence",
                                       "score_basis",
                                       "lifecycle",
                                       "prices",
                                       NULL};
    char w[48];
    snprintf(w, sizeof w, "models[%zu]", i);
    m->released_on = m->deprecated_on = m->shutdown_on = MR_DATE_NONE;
    if (!cJSON_IsObject(jm)) return fail(err, errlen, "%s: expected an object", w);
    if (only_keys(jm, keys, w, err, errlen)) return -1;
    if (get_string(jm, "model_id", 0, &m->model_id, w, err, errlen)) return -1;
    if (get_string(jm, "provider", 0, &m->provider, w, err, errlen)) return -1;
    if (get_string(jm, "display_name", 0, &m->display_name, w, err, errlen)) return -1;
    if (get_date(jm, "released_on", 1, &m->released_on, w, err, errlen)) return -1;
    const cJSON *ctx = cJSON_GetObjectItemCaseSensitive(jm, "max_context_tokens");
    if (!cJSON_IsNumber(ctx) || ctx->valuedouble != floor(ctx->valuedouble) ||
        ctx->valuedouble < 1 || ctx->valuedouble > INT32_MAX)
        return fail(err, errlen, "%s.max_context_tokens: expected an integer in 1..%d", w,
                    INT32_MAX);
    m->max_context_tokens = (int32_t)ctx->valuedouble;
    if (get_bool(jm, "supports_streaming", &m->supports_streaming, w, err, errlen)) return -1;
    if (get_bool(jm, "supports_tool_use", &m->supports_tool_use, w, err, errlen)) return -1;
    if (get_number(jm, "tool_use_quality", &m->tool_use_quality, w, err, errlen)) return -1;
    if (parse_capabilities(jm, m, w, err, errlen)) return -1;
    if (get_string(jm, "evidence", 0, &m->evidence, w, err, errlen)) return -1;
    if (get_string(jm, "score_basis", 0, &m->score_basis, w, err, errlen)) return -1;
    if (parse_lifecycle(jm, m, w, err, errlen)) return -1;
    const cJSON *prices = cJSON_GetObjectItemCaseSensitive(jm, "prices");
    if (!cJSON_IsArray(prices)) return fail(err, errlen, "%s.prices: expected an array", w);
    int np = cJSON_GetArraySize(prices);
    if (np < 1 || np > MR_MAX_PRICES)
        return fail(err, errlen, "%s.prices: expected 1..%d price rows", w, MR_MAX_PRICES);
    if (mr_model_alloc_prices(m, (size_t)np)) return fail(err, errlen, "out of memory");
    size_t j = 0;
    for (const cJSON *jp = prices->child; jp; jp = jp->next, j++) {
        char pw[64];
        snprintf(pw, sizeof pw, "%s.prices[%zu]", w, j);
        if (parse_price(jp, &m->prices[j], pw, err, errlen)) return -1;
    }
    return 0;
}

static int check_methodology(const cJSON *root, char *err, size_t errlen) {
    /* The data file must keep its methodology: the scores are only defensible with it. */
    static const char *const scales[] = {"reasoning",
                                         "code_generation",
                                         "structured_ops",
                                         "long_context",
                                         "tool_use_quality",
                                         "cost_efficiency",
                                         NULL};
    const cJSON *m = cJSON_GetObjectItemCaseSensitive(root, "methodology");
    if (!cJSON_IsObject(m)) return fail(err, errlen, "methodology: expected an object");
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(m, "scales");
    if (!cJSON_IsObject(s)) return fail(err, errlen, "methodology.scales: expected an object");
    for (const char *const *k = scales; *k; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(s, *k);
        if (!cJSON_IsString(v) || !v->valuestring[0])
            return fail(err, errlen, "methodology.scales.%s: the derivation must be documented",
                        *k);
    }
    return 0;
}

static int parse_root(const cJSON *root, mr_catalog *out, char *err, size_t errlen) {
    static const char *const keys[] = {"schema", "catalog_version", "methodology", "models", NULL};
    if (!cJSON_IsObject(root)) return fail(err, errlen, "top level: expected an object");
    if (only_keys(root, keys, "(top level)", err, errlen)) return -1;
    const cJSON *schema = cJSON_GetObjectItemCaseSensitive(root, "schema");
    if (!cJSON_IsString(schema) || strcmp(schema->valuestring, MR_CATALOG_SCHEMA) != 0)
        return fail(err, errlen, "schema: expected \"%s\"", MR_CATALOG_SCHEMA);
    if (get_string(root, "catalog_version", 0, &out->catalog_version, "(top level)", err, errlen))
        return -1;
    if (check_methodology(root, err, errlen)) return -1;
    const cJSON *models = cJSON_GetObjectItemCaseSensitive(root, "models");
    if (!cJSON_IsArray(models)) return fail(err, errlen, "models: expected an array");
    int n = cJSON_GetArraySize(models);
    if (n > MR_MAX_MODELS) return fail(err, errlen, "models: more than %d models", MR_MAX_MODELS);
    if (mr_catalog_alloc(out, (size_t)n)) return fail(err, errlen, "out of memory");
    size_t i = 0;
    for (const cJSON *jm = models->child; jm; jm = jm->next, i++)
        if (parse_model(jm, &out->models[i], i, err, errlen)) return -1;
    return 0;
}

int mr_catalog_parse(const char *json, size_t len, mr_catalog *out, char *err, size_t errlen) {
    int rc = -1;
    memset(out, 0, sizeof *out);
    cJSON *root = cJSON_ParseWithLength(json, len);
    if (!root) {
        const char *at = cJSON_GetErrorPtr();
        long off = (at && at >= json && at <= json + len) ? (long)(at - json) : -1;
        fail(err, errlen, "not valid JSON (near byte %ld)", off);
        goto done;
    }
    if (parse_root(root, out, err, errlen)) goto done;
    if (mr_catalog_validate(out, true, err, errlen)) goto done;
    rc = 0;
done:
    cJSON_Delete(root);
    if (rc) mr_catalog_free(out);
    return rc;
}

int mr_catalog_load_file(const char *path, mr_catalog *out, unsigned char *sha256_out, char *err,
                         size_t errlen) {
    int rc = -1;
    char *buf = NULL;
    size_t len = 0;
    memset(out, 0, sizeof *out);
    if (util_read_file(path, MR_MAX_FILE_BYTES, &buf, &len, err, errlen) != 0) return -1;
    if (sha256_out && ids_sha256_raw(buf, len, sha256_out) != 0) {
        fail(err, errlen, "sha256 failed");
        goto done;
    }
    char perr[256];
    if (mr_catalog_parse(buf, len, out, perr, sizeof perr)) {
        fail(err, errlen, "%s: %s", path, perr);
        goto done;
    }
    rc = 0;
done:
    free(buf);
    return rc;
}
