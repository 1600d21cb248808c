/* Role x goal scoring, ListModels filtering and CompareModels selection (pure functions). */
#include "score.h"
#include "util.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Weights: reasoning, code_generation, structured_ops, long_context, tool_use_quality. Each row
 * sums to 1 (asserted by the unit tests). Every role of an agent team runs as an agent with tools,
 * so every built-in role, the general fallback included, is an agent role. */
static const mr_role roles[] = {
    {"architect", 0.40, 0.20, 0.15, 0.15, 0.10, 1,
     "system design: reasoning first, then code and long context"},
    {"backend-sme", 0.20, 0.45, 0.15, 0.05, 0.15, 1, "server-side code generation"},
    {"frontend", 0.15, 0.50, 0.15, 0.05, 0.15, 1, "UI code generation"},
    {"qa-engineer", 0.20, 0.30, 0.20, 0.05, 0.25, 1, "test code and reliable tool runs"},
    {"devops", 0.20, 0.30, 0.15, 0.05, 0.30, 1, "infrastructure code and tool use"},
    {"reviewer", 0.35, 0.30, 0.10, 0.20, 0.05, 1, "reading large diffs critically"},
    {"planner", 0.45, 0.05, 0.25, 0.10, 0.15, 1, "reasoning and structured plans"},
    {"researcher", 0.35, 0.00, 0.10, 0.35, 0.20, 1, "reasoning over long sources with tools"},
    {"writer", 0.35, 0.00, 0.25, 0.30, 0.10, 1, "long documents with consistent structure"},
    {"general", 0.30, 0.20, 0.20, 0.15, 0.15, 1, "balanced across all dimensions"},
};
#define N_ROLES (sizeof roles / sizeof roles[0])
#define GENERAL (&roles[N_ROLES - 1])

static const struct {
    const char *alias, *role;
} aliases[] = {
    {"backend", "backend-sme"},
    {"backend-engineer", "backend-sme"},
    {"frontend-engineer", "frontend"},
    {"frontend-sme", "frontend"},
    {"qa", "qa-engineer"},
    {"tester", "qa-engineer"},
    {"sre", "devops"},
    {"code-reviewer", "reviewer"},
    {"technical-writer", "writer"},
    {"research", "researcher"},
};

/* Fills err and returns code (MR_EINVAL, MR_ENONE, MR_ENOTFOUND). */
#define fail(code, err, errlen, ...) util_errf((err), (errlen), (code), __VA_ARGS__)

/* ---- roles and goals ---- */

size_t mr_role_count(void) {
    return N_ROLES;
}

const mr_role *mr_role_at(size_t i) {
    return i < N_ROLES ? &roles[i] : NULL;
}

const mr_role *mr_role_general(void) {
    return GENERAL;
}

const mr_role *mr_role_find(const char *name, size_t len) {
    char key[MR_ROLE_MAX + 1];
    if (!name || mr_lower_trim(name, len, key, sizeof key) <= 0) return NULL;
    for (char *p = key; *p; p++)
        if (*p == '_' || *p == ' ') *p = '-';
    for (size_t i = 0; i < sizeof aliases / sizeof aliases[0]; i++)
        if (strcmp(key, aliases[i].alias) == 0) {
            snprintf(key, sizeof key, "%s", aliases[i].role);
            break;
        }
    for (size_t i = 0; i < N_ROLES; i++)
        if (strcmp(key, roles[i].name) == 0) return &roles[i];
    return NULL;
}

int mr_goal_parse(const char *s, size_t len, int *goal) {
    char key[16];
    int n = s ? mr_lower_trim(s, len, key, sizeof key) : 0;
    if (n < 0) return -1;
    if (n == 0 || strcmp(key, "balanced") == 0)
        *goal = MR_GOAL_BALANCED;
    else if (strcmp(key, "quality") == 0)
        *goal = MR_GOAL_QUALITY;
    else if (strcmp(key, "cost") == 0)
        *goal = MR_GOAL_COST;
    else
        return -1;
    return 0;
}

const char *mr_goal_name(int goal) {
    return goal == MR_GOAL_QUALITY ? "quality" : goal == MR_GOAL_COST ? "cost" : "balanced";
}

double mr_goal_price_weight(int goal) {
    return goal == MR_GOAL_QUALITY ? 0.05 : goal == MR_GOAL_COST ? 0.50 : 0.20;
}

double mr_quality(const mr_role *r, const mr_entry *e) {
    const mr_model *m = e->m;
    return r->w_reasoning * m->reasoning + r->w_code * m->code_generation +
           r->w_structured * m->structured_ops + r->w_long_context * m->long_context +
           r->w_tool_use * m->tool_use_quality;
}

/* ---- ranking ---- */

static int better(const mr_ranked *a, const mr_ranked *b) {
    if (a->score != b->score) return a->score > b->score;
    if (a->quality != b->quality) return a->quality > b->quality;
    if (a->e->blended != b->e->blended) return a->e->blended < b->e->blended;
    return strcmp(a->e->m->model_id, b->e->m->model_id) < 0;
}

/* Keeps the k best in top[0..*n) in rank order (insertion; k <= 1 + MR_MAX_ALTERNATIVES). */
static void top_insert(mr_ranked *top, size_t *n, size_t k, const mr_ranked *r) {
    size_t pos = *n;
    while (pos > 0 && better(r, &top[pos - 1]))
        pos--;
    if (pos >= k) return;
    size_t last = *n < k ? *n : k - 1;
    memmove(&top[pos + 1], &top[pos], (last - pos) * sizeof *top);
    top[pos] = *r;
    if (*n < k) (*n)++;
}

/* ---- bounded text helpers ---- */

typedef struct sbuf {
    char *p;
    size_t cap, len;
} sbuf;

static void sb_add(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_add(sbuf *b, const char *fmt, ...) {
    if (b->len + 1 >= b->cap) return;
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(b->p + b->len, b->cap - b->len, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < b->cap - b->len) {
        b->len += (size_t)n;
        return;
    }
    /* truncated: end on a character boundary, so the text stays valid UTF-8 */
    size_t keep = util_utf8_cut(b->p + b->len, b->cap - b->len - 1);
    b->len += keep;
    b->p[b->len] = '\0';
}

/* A request string quoted for a message: at most 48 bytes, cut on a character boundary,
 * control bytes and quotes as '?'. */
static void sb_quoted(sbuf *b, const char *s, size_t len) {
    char tmp[52];
    size_t n = util_utf8_cut(s, len < 48 ? len : 48), j = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        tmp[j++] = (c < 0x20 || c == '"' || c == '\\' || c == 0x7f) ? '?' : (char)c;
    }
    tmp[j] = '\0';
    sb_add(b, "\"%s%s\"", tmp, len > 48 ? "..." : "");
}

static const char *usd(double v, char *buf, size_t cap) {
    if (fabs(v * 100.0 - round(v * 100.0)) < 1e-9)
        snprintf(buf, cap, "%.2f", v);
    else
        snprintf(buf, cap, "%.4g", v);
    return buf;
}

/* ---- recommendation ---- */

typedef struct rec_ctx {
    const mr_snapshot *s;
    unsigned char allowed[MR_MAX_MODELS]; /* by index into s->providers */
    size_t n_allowed;
    int all_providers;
    char ignored[256]; /* connected providers not in the catalogue */
    size_t n_ignored;
    size_t considered, excl_deprecated, excl_no_tools;
} rec_ctx;

static int resolve_providers(rec_ctx *c, const mr_rec_request *rq, char *err, size_t errlen) {
    sbuf ig = {c->ignored, sizeof c->ignored, 0};
    c->all_providers = rq->n_providers == 0;
    if (rq->n_providers > MR_MAX_PROVIDERS_REQ)
        return fail(MR_EINVAL, err, errlen, "connected_providers: more than %d entries (got %zu)",
                    MR_MAX_PROVIDERS_REQ, rq->n_providers);
    for (size_t i = 0; i < rq->n_providers; i++) {
        const char *p = rq->providers[i] ? rq->providers[i] : "";
        size_t len = strlen(p);
        while (len && (*p == ' ' || *p == '\t'))
            p++, len--;
        while (len && (p[len - 1] == ' ' || p[len - 1] == '\t'))
            len--;
        if (len == 0)
            return fail(MR_EINVAL, err, errlen, "connected_providers[%zu]: empty provider name", i);
        const char *canon = mr_snapshot_provider(c->s, p, len);
        if (!canon) {
            sb_add(&ig, "%s", c->n_ignored++ ? ", " : "");
            sb_quoted(&ig, p, len);
            continue;
        }
        for (size_t k = 0; k < c->s->n_providers; k++)
            if (c->s->providers[k] == canon && !c->allowed[k]) {
                c->allowed[k] = 1;
                c->n_allowed++;
            }
    }
    return 0;
}

static int provider_allowed(const rec_ctx *c, const char *provider) {
    if (c->all_providers) return 1;
    for (size_t k = 0; k < c->s->n_providers; k++)
        if (c->allowed[k] && c->s->providers[k] == provider) return 1;
    return 0;
}

static void list_providers(const rec_ctx *c, sbuf *b, int only_allowed) {
    size_t shown = 0;
    for (size_t k = 0; k < c->s->n_providers; k++) {
        if (only_allowed && !c->allowed[k]) continue;
        sb_add(b, "%s%s", shown++ ? ", " : "", c->s->providers[k]);
    }
    if (!shown) sb_add(b, "none");
}

static int no_candidate(const rec_ctx *c, const mr_role *role, char *err, size_t errlen) {
    char buf[512];
    sbuf b = {buf, sizeof buf, 0};
    if (c->s->n == 0) return fail(MR_ENONE, err, errlen, "the model catalogue is empty");
    if (!c->all_providers && c->n_allowed == 0) {
        sb_add(&b, "none of connected_providers (%s) has models in the catalogue, which covers ",
               c->ignored);
        list_providers(c, &b, 0);
        return fail(MR_ENONE, err, errlen, "%s", buf);
    }
    sb_add(&b, "no model qualifies for the %s role among providers ", role->name);
    list_providers(c, &b, !c->all_providers);
    sb_add(&b,
           ": of %zu models, %zu are deprecated or retired and %zu lack tool use, which agent "
           "roles require",
           c->considered, c->excl_deprecated, c->excl_no_tools);
    return fail(MR_ENONE, err, errlen, "%s", buf);
}

static void write_reasoning(const rec_ctx *c, const mr_rec_request *rq, mr_rec_result *out,
                            size_t qualified, int role_known) {
    sbuf b = {out->reasoning, sizeof out->reasoning, 0};
    const mr_ranked *w = &out->best;
    double p = mr_goal_price_weight(out->goal);
    char in[32], outp[32];
    sb_add(&b,
           "%s is recommended for the %s role with the %s goal: score %.3f = %.2f x role quality "
           "%.3f + %.2f x cost efficiency %.3f (USD %s/%s per million input/output tokens)",
           w->e->m->model_id, out->role->name, mr_goal_name(out->goal), w->score, 1.0 - p,
           w->quality, p, w->e->cost_efficiency, usd(w->e->input_per_million, in, sizeof in),
           usd(w->e->output_per_million, outp, sizeof outp));
    if (out->n_alternatives)
        sb_add(&b, ", ahead of %s at %.3f", out->alternatives[0].e->m->model_id,
               out->alternatives[0].score);
    else
        sb_add(&b, ", the only qualifying model");
    sb_add(&b, "; %zu of %zu catalogued models qualified", qualified, c->s->n);
    if (c->all_providers) {
        sb_add(&b,
               "; connected_providers was empty, so all catalogued providers were considered (");
        list_providers(c, &b, 0);
        sb_add(&b, ")");
    } else {
        sb_add(&b, "; providers considered: ");
        list_providers(c, &b, 1);
    }
    if (c->n_ignored) sb_add(&b, "; ignored providers not in the catalogue: %s", c->ignored);
    if (!role_known) {
        const char *r = rq->agent_role ? rq->agent_role : "";
        char tmp[2];
        if (mr_lower_trim(r, strlen(r), tmp, sizeof tmp) == 0)
            sb_add(&b, "; agent_role was empty, so the general profile was used");
        else {
            sb_add(&b, "; agent_role ");
            sb_quoted(&b, r, strlen(r));
            sb_add(&b, " is not a known role, so the general profile was used");
        }
    }
    if (c->excl_deprecated || c->excl_no_tools)
        sb_add(&b, "; excluded %zu deprecated or retired and %zu without tool use",
               c->excl_deprecated, c->excl_no_tools);
    sb_add(&b, ".");
}

int mr_recommend(const mr_snapshot *s, const mr_rec_request *rq, mr_rec_result *out, char *err,
                 size_t errlen) {
    rec_ctx c;
    mr_ranked top[1 + MR_MAX_ALTERNATIVES];
    size_t n_top = 0, qualified = 0;
    size_t k = 1 + (rq->max_alternatives < MR_MAX_ALTERNATIVES ? rq->max_alternatives
                                                               : MR_MAX_ALTERNATIVES);
    memset(&c, 0, sizeof c);
    memset(out, 0, sizeof *out);
    c.s = s;
    const char *role_s = rq->agent_role ? rq->agent_role : "";
    if (strlen(role_s) > MR_ROLE_MAX)
        return fail(MR_EINVAL, err, errlen, "agent_role: longer than %d characters", MR_ROLE_MAX);
    const char *goal_s = rq->goal ? rq->goal : "";
    if (mr_goal_parse(goal_s, strlen(goal_s), &out->goal)) {
        char q[80];
        sbuf b = {q, sizeof q, 0};
        sb_quoted(&b, goal_s, strlen(goal_s));
        return fail(MR_EINVAL, err, errlen,
                    "optimization_goal: unknown goal %s; expected quality, cost or balanced "
                    "(empty means balanced)",
                    q);
    }
    if (resolve_providers(&c, rq, err, errlen)) return MR_EINVAL;
    const mr_role *known = mr_role_find(role_s, strlen(role_s));
    out->role = known ? known : GENERAL;
    double p = mr_goal_price_weight(out->goal);
    for (size_t i = 0; i < s->n; i++) {
        const mr_entry *e = &s->entries[i];
        if (!provider_allowed(&c, e->provider)) continue;
        c.considered++;
        if (e->deprecated) {
            c.excl_deprecated++;
            continue;
        }
        if (out->role->agent && !e->m->supports_tool_use) {
            c.excl_no_tools++;
            continue;
        }
        mr_ranked r = {e, mr_quality(out->role, e), 0};
        r.score = (1.0 - p) * r.quality + p * e->cost_efficiency;
        qualified++;
        top_insert(top, &n_top, k, &r);
    }
    if (n_top == 0) return no_candidate(&c, out->role, err, errlen);
    out->best = top[0];
    out->n_alternatives = n_top - 1;
    memcpy(out->alternatives, top + 1, (n_top - 1) * sizeof *top);
    write_reasoning(&c, rq, out, qualified, known != NULL);
    return MR_OK;
}

/* ---- ListModels / CompareModels ---- */

size_t mr_list(const mr_snapshot *s, const char *provider_filter, const mr_entry **out) {
    const char *f = provider_filter ? provider_filter : "";
    size_t flen = strlen(f), n = 0;
    char tmp[2];
    const char *canon = NULL;
    int all = mr_lower_trim(f, flen, tmp, sizeof tmp) == 0;
    if (!all && !(canon = mr_snapshot_provider(s, f, flen))) return 0;
    for (size_t i = 0; i < s->n; i++)
        if (all || s->entries[i].provider == canon) out[n++] = &s->entries[i];
    return n;
}

int mr_compare(const mr_snapshot *s, const char *const *ids, size_t n, const mr_entry **out,
               size_t *n_out, char *err, size_t errlen) {
    char unknown[MR_COMPARE_MAX][MR_ID_MAX + 1];
    size_t n_unknown = 0;
    char msg[1024];
    sbuf b = {msg, sizeof msg, 0};
    *n_out = 0;
    if (n == 0) return fail(MR_EINVAL, err, errlen, "model_ids: at least one model id is required");
    if (n > MR_COMPARE_MAX)
        return fail(MR_EINVAL, err, errlen, "model_ids: at most %d ids per request (got %zu)",
                    MR_COMPARE_MAX, n);
    for (size_t i = 0; i < n; i++) {
        const char *id = ids[i] ? ids[i] : "";
        size_t len = strlen(id);
        char key[MR_ID_MAX + 1];
        int kl = mr_lower_trim(id, len, key, sizeof key);
        if (kl == 0) return fail(MR_EINVAL, err, errlen, "model_ids[%zu]: empty model id", i);
        const mr_entry *e = kl > 0 ? mr_snapshot_find(s, id, len) : NULL;
        if (e) {
            int dup = 0;
            for (size_t j = 0; j < *n_out; j++)
                dup |= out[j] == e;
            if (!dup) out[(*n_out)++] = e;
            continue;
        }
        if (kl < 0) snprintf(key, sizeof key, "%.*s", MR_ID_MAX - 1, id); /* too long to match */
        int dup = 0;
        for (size_t j = 0; j < n_unknown; j++)
            dup |= strcmp(unknown[j], key) == 0;
        if (dup) continue;
        memcpy(unknown[n_unknown++], key, sizeof key);
        sb_add(&b, "%s", n_unknown > 1 ? ", " : "");
        sb_quoted(&b, id, len);
    }
    if (n_unknown) {
        *n_out = 0;
        return fail(MR_ENOTFOUND, err, errlen, "model_ids: unknown model%s: %s",
                    n_unknown > 1 ? "s" : "", msg);
    }
    return MR_OK;
}
