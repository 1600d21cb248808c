/*
 * The rules of the definition language that a JSON Schema cannot express. They run only on a
 * structurally valid definition, yet read it defensively: the schema file is data and may be
 * loosened without this file changing.
 *
 * Scopes. Steps form scopes: the top level (entered at `start`), each loop body, each arm of a
 * condition and each parallel branch (entered at the step the container names). Within a scope,
 * steps are wired by next / on_approve / on_reject / option next; the wiring must be acyclic
 * (repetition is what loops are for), every step belongs to exactly one scope, and every step
 * is reachable from `start`. A scope that runs out of wiring hands control back to its container,
 * which continues at its own `next`.
 *
 * State. Templates (${/pointer}) and condition paths read the run state:
 *   /trigger/<field>...            the trigger context
 *   /steps/<name>/output/...       a step's output envelope (also /steps/<name>/status)
 *   /loop/iteration, /loop/max_iterations   the innermost enclosing loop (inside its body)
 *   /run/id, /run/workflow_id, /run/triggered_by, /run/started_at
 * A step may read another step only if that step can have run before it on some path.
 */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_internal.h"

typedef enum {
    K_OTHER,
    K_AGENT,
    K_TOOL,
    K_APPROVAL,
    K_USER_INPUT,
    K_QUESTION,
    K_WAIT,
    K_LOOP,
    K_CONDITION,
    K_PARALLEL,
} kind;

static const struct {
    const char *name;
    kind k;
} kinds[] = {{"agent_action", K_AGENT},
             {"tool_action", K_TOOL},
             {"approval_gate", K_APPROVAL},
             {"user_input", K_USER_INPUT},
             {"question", K_QUESTION},
             {"wait", K_WAIT},
             {"loop", K_LOOP},
             {"condition", K_CONDITION},
             {"parallel", K_PARALLEL}};

/* A reference to a step written somewhere in a step: its location is
 * /steps/<owner>/<field>[/<index>[/<sub>]]. */
typedef struct {
    const char *target_name;
    int target; /* -1: no such step */
    const char *field;
    int index; /* -1: none */
    const char *sub;
} ref;

#define MAX_REFS 48 /* 20 options + next + a few; the schema bounds options at 20 */

typedef struct {
    const char *name;
    const cJSON *node;
    kind k;
    int region;
    int color; /* DFS: 0 white, 1 on the stack, 2 done */
    ref *flow; /* resolved flow_refs, owned */
    size_t n_flow;
    ref *scope; /* resolved scope_refs, owned */
    size_t n_scope;
} step;

typedef struct {
    int owner; /* container step, -1 for the top level */
    const char *slot;
    int slot_index;
    int entry;
    int depth;
    int loop;  /* innermost loop whose body encloses this scope, -1 */
    long laps; /* worst-case laps of this scope: product of the enclosing max_iterations */
} region;

typedef enum {
    AT_ENTRY, /* before the step runs: only earlier steps */
    AT_SELF,  /* while judging the step's own output: itself too */
    AT_AFTER, /* after a loop's iteration: its body steps too */
} position;

typedef struct {
    const defn_ctx *ctx;
    const cJSON *doc;
    defn_violations *out;
    step *steps;
    size_t n;
    int *by_name; /* step indices sorted by name */
    region *regions;
    size_t n_regions, cap_regions;
    const cJSON *trigger_fields; /* NULL: the trigger context is undeclared */
    uint64_t **reach;            /* per step, lazily: graph nodes reachable after it ran */
    uint64_t *closure;           /* per graph node, its reachable nodes; NULL if cyclic */
    int **succ;                  /* flow graph, adjacency lists terminated by -1 */
    size_t words;
    defn__ptr ptr;
    int rc;
} sem;

/* ------------------------------------------------------------------ helpers */

static const cJSON *get(const cJSON *o, const char *k) {
    return cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL;
}

static const char *get_str(const cJSON *o, const char *k) {
    const cJSON *v = get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static int find_step(const sem *s, const char *name) {
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(s->steps[s->by_name[mid]].name, name);
        if (c == 0) return s->by_name[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return -1;
}

static const char *kind_name(const cJSON *step) {
    const char *t = get_str(step, "type");
    return t ? t : "step";
}

/* Builds /steps/<step>[/a[/idx][/b]] in s->ptr and returns it (valid until the next call). */
static const char *loc(sem *s, int i, const char *a, int idx, const char *b) {
    defn__ptr_pop(&s->ptr, 0);
    size_t ok = defn__ptr_push_key(&s->ptr, "steps");
    if (ok != (size_t)-1 && i >= 0) ok = defn__ptr_push_key(&s->ptr, s->steps[i].name);
    if (ok != (size_t)-1 && a) ok = defn__ptr_push_key(&s->ptr, a);
    if (ok != (size_t)-1 && idx >= 0) ok = defn__ptr_push_index(&s->ptr, (size_t)idx);
    if (ok != (size_t)-1 && b) ok = defn__ptr_push_key(&s->ptr, b);
    if (ok == (size_t)-1) s->rc = DEFN_ERR_NOMEM;
    return s->ptr.buf;
}

static void add(sem *s, const char *where, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void add(sem *s, const char *where, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (defn__add(s->out, where, "%s", msg) != 0) s->rc = DEFN_ERR_NOMEM;
}

static const char *ref_loc(sem *s, int i, const ref *r) {
    return loc(s, i, r->field, r->index, r->sub);
}

static void add_ref(ref *refs, size_t *n, const cJSON *v, const char *field, int index,
                    const char *sub) {
    if (!cJSON_IsString(v) || *n >= MAX_REFS) return;
    refs[(*n)++] = (ref){v->valuestring, -1, field, index, sub};
}

/* The wiring that stays within the step's scope, in field order. */
static size_t flow_refs(const step *st, ref *refs) {
    size_t n = 0;
    const cJSON *node = st->node;
    switch (st->k) {
    case K_APPROVAL:
        add_ref(refs, &n, get(node, "on_approve"), "on_approve", -1, NULL);
        add_ref(refs, &n, get(node, "on_reject"), "on_reject", -1, NULL);
        return n;
    case K_USER_INPUT:
    case K_QUESTION: {
        int idx = 0;
        const cJSON *opts = get(node, "options");
        for (const cJSON *o = cJSON_IsArray(opts) ? opts->child : NULL; o; o = o->next, idx++)
            add_ref(refs, &n, get(o, "next"), "options", idx, "next");
        break;
    }
    default:
        break;
    }
    add_ref(refs, &n, get(node, "next"), "next", -1, NULL);
    return n;
}

/* The entries of the scopes a container opens. */
static size_t scope_refs(const step *st, ref *refs) {
    size_t n = 0;
    const cJSON *node = st->node;
    if (st->k == K_LOOP) add_ref(refs, &n, get(node, "body"), "body", -1, NULL);
    if (st->k == K_CONDITION) {
        add_ref(refs, &n, get(node, "then"), "then", -1, NULL);
        add_ref(refs, &n, get(node, "else"), "else", -1, NULL);
    }
    if (st->k == K_PARALLEL) {
        int idx = 0;
        const cJSON *br = get(node, "branches");
        for (const cJSON *b = cJSON_IsArray(br) ? br->child : NULL; b; b = b->next, idx++)
            add_ref(refs, &n, b, "branches", idx, NULL);
    }
    return n;
}

static void resolve(const sem *s, ref *refs, size_t n) {
    for (size_t k = 0; k < n; k++)
        refs[k].target = find_step(s, refs[k].target_name);
}

/* ------------------------------------------------------------------ steps and references */

static void index_steps(sem *s) {
    const cJSON *steps = get(s->doc, "steps");
    s->n = cJSON_IsObject(steps) ? (size_t)cJSON_GetArraySize(steps) : 0;
    s->steps = calloc(s->n ? s->n : 1, sizeof(*s->steps));
    if (!s->steps) {
        s->rc = DEFN_ERR_NOMEM;
        s->n = 0;
        return;
    }
    size_t i = 0;
    for (const cJSON *st = s->n ? steps->child : NULL; st; st = st->next, i++) {
        s->steps[i] = (step){.name = st->string, .node = st, .k = K_OTHER, .region = -1};
        const char *t = get_str(st, "type");
        for (size_t k = 0; t && k < sizeof(kinds) / sizeof(kinds[0]); k++)
            if (strcmp(t, kinds[k].name) == 0) s->steps[i].k = kinds[k].k;
        size_t len = defn__utf8_len(st->string);
        bool ctl = false;
        for (const unsigned char *p = (const unsigned char *)st->string; *p; p++)
            ctl = ctl || *p < 0x20 || *p == 0x7f;
        if (len == 0 || len > DEFN_MAX_STEP_NAME || ctl)
            add(s, loc(s, (int)i, NULL, -1, NULL),
                "step name must be 1 to %d characters without control characters",
                DEFN_MAX_STEP_NAME);
    }
}

static int cmp_by_name(const void *a, const void *b, void *arg) {
    const step *steps = arg;
    return strcmp(steps[*(const int *)a].name, steps[*(const int *)b].name);
}

static ref *copy_refs(const ref *refs, size_t n) {
    ref *r = malloc((n ? n : 1) * sizeof(*r));
    if (r) memcpy(r, refs, n * sizeof(*r));
    return r;
}

/* Name index (for lookups) and each step's resolved wiring, computed once. */
static void index_refs(sem *s) {
    s->by_name = malloc((s->n ? s->n : 1) * sizeof(int));
    if (!s->by_name) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    for (size_t i = 0; i < s->n; i++)
        s->by_name[i] = (int)i;
    qsort_r(s->by_name, s->n, sizeof(int), cmp_by_name, s->steps);
    ref refs[MAX_REFS];
    for (size_t i = 0; i < s->n && s->rc == 0; i++) {
        step *st = &s->steps[i];
        st->n_flow = flow_refs(st, refs);
        resolve(s, refs, st->n_flow);
        st->flow = copy_refs(refs, st->n_flow);
        st->n_scope = scope_refs(st, refs);
        resolve(s, refs, st->n_scope);
        st->scope = copy_refs(refs, st->n_scope);
        if (!st->flow || !st->scope) s->rc = DEFN_ERR_NOMEM;
    }
}

static void report_unknown(sem *s, int i, const ref *refs, size_t n) {
    for (size_t k = 0; k < n; k++)
        if (refs[k].target < 0)
            add(s, ref_loc(s, i, &refs[k]), "unknown step \"%s\"", refs[k].target_name);
}

static void check_references(sem *s) {
    for (size_t i = 0; i < s->n && s->rc == 0; i++) {
        const step *st = &s->steps[i];
        ref asked[1];
        size_t n = 0;
        report_unknown(s, (int)i, st->flow, st->n_flow);
        report_unknown(s, (int)i, st->scope, st->n_scope);
        add_ref(asked, &n, get(st->node, "asked_by"), "asked_by", -1, NULL);
        resolve(s, asked, n);
        report_unknown(s, (int)i, asked, n);
    }
}

/* ------------------------------------------------------------------ scopes */

static void describe_region(const sem *s, const region *r, char *buf, size_t len) {
    if (r->owner < 0) {
        snprintf(buf, len, "the top level");
        return;
    }
    const char *owner = s->steps[r->owner].name;
    if (strcmp(r->slot, "body") == 0)
        snprintf(buf, len, "the body of loop \"%s\"", owner);
    else if (strcmp(r->slot, "branches") == 0)
        snprintf(buf, len, "branch %d of parallel \"%s\"", r->slot_index, owner);
    else
        snprintf(buf, len, "the \"%s\" arm of condition \"%s\"", r->slot, owner);
}

static void add_region(sem *s, int owner, const ref *entry, int depth, int loop, long laps) {
    if (s->n_regions == s->cap_regions) {
        size_t cap = s->cap_regions ? s->cap_regions * 2 : 16;
        region *r = realloc(s->regions, cap * sizeof(*r));
        if (!r) {
            s->rc = DEFN_ERR_NOMEM;
            return;
        }
        s->regions = r;
        s->cap_regions = cap;
    }
    s->regions[s->n_regions++] = (region){owner,
                                          entry ? entry->field : NULL,
                                          entry ? entry->index : -1,
                                          entry ? entry->target : -1,
                                          depth,
                                          loop,
                                          laps};
}

static void claim_conflict(sem *s, int from, const ref *r) {
    char where[300];
    describe_region(s, &s->regions[s->steps[r->target].region], where, sizeof(where));
    add(s, from >= 0 ? ref_loc(s, from, r) : "/start",
        "step \"%s\" already belongs to %s; a step can be entered from one scope only",
        r->target_name, where);
}

/* Opens the scopes of a container just claimed by region r. */
static void open_scopes(sem *s, int i, int r) {
    const ref *refs = s->steps[i].scope;
    size_t n = s->steps[i].n_scope;
    int depth = s->regions[r].depth + 1;
    if (n && depth > DEFN_MAX_SCOPE_DEPTH)
        add(s, loc(s, i, NULL, -1, NULL), "scopes nest deeper than %d levels",
            DEFN_MAX_SCOPE_DEPTH);
    int loop = s->steps[i].k == K_LOOP ? i : s->regions[r].loop;
    long laps = s->regions[r].laps;
    if (s->steps[i].k == K_LOOP) {
        const cJSON *m = get(s->steps[i].node, "max_iterations");
        laps *= cJSON_IsNumber(m) && m->valuedouble >= 1 ? (long)m->valuedouble : 1;
        /* reported once, at the loop that first crosses the budget; deeper loops stay quiet */
        if (laps > DEFN_MAX_RUN_LAPS && s->regions[r].laps <= DEFN_MAX_RUN_LAPS)
            add(s, loc(s, i, "max_iterations", -1, NULL),
                "loop \"%s\" can run %ld laps nested in its enclosing loops, more than the "
                "run budget of %d (the product of the nested loops' max_iterations)",
                s->steps[i].name, laps, DEFN_MAX_RUN_LAPS);
        if (laps > DEFN_MAX_RUN_LAPS) laps = (long)DEFN_MAX_RUN_LAPS + 1; /* no overflow */
    }
    for (size_t k = 0; k < n && s->rc == 0; k++) {
        if (refs[k].target < 0) continue;
        bool repeated = false;
        for (size_t j = 0; j < k && !repeated; j++)
            if (refs[j].target == refs[k].target) {
                if (refs[j].index >= 0)
                    add(s, ref_loc(s, i, &refs[k]), "step \"%s\" is already branch %d",
                        refs[k].target_name, refs[j].index);
                else
                    add(s, ref_loc(s, i, &refs[k]), "step \"%s\" is already the \"%s\" arm",
                        refs[k].target_name, refs[j].field);
                repeated = true;
            }
        if (!repeated) add_region(s, i, &refs[k], depth, loop, laps);
    }
}

static void report_cycle(sem *s, int from, const ref *r, const int *stack, size_t depth) {
    char path[900];
    size_t used = 0, k = 0;
    while (k < depth && stack[k] != r->target)
        k++;
    for (; k < depth && used < sizeof(path); k++) {
        int w = snprintf(path + used, sizeof(path) - used, "%s -> ", s->steps[stack[k]].name);
        if (w > 0) used += (size_t)w;
    }
    if (used < sizeof(path)) snprintf(path + used, sizeof(path) - used, "%s", r->target_name);
    add(s, ref_loc(s, from, r), "creates a cycle (%s); repeat steps with a loop step instead",
        path);
}

/* Depth-first walk of one scope: claims its steps, finds cycles, opens inner scopes. The
 * stack is explicit and bounded by the step count. */
static void walk_region(sem *s, int r, int *stack, size_t *edge_pos) {
    int entry = s->regions[r].entry;
    if (entry < 0) return;
    size_t depth = 0;
    s->steps[entry].region = r;
    s->steps[entry].color = 1;
    stack[depth] = entry;
    edge_pos[depth++] = 0;
    open_scopes(s, entry, r);
    while (depth > 0 && s->rc == 0) {
        int u = stack[depth - 1];
        const ref *refs = s->steps[u].flow;
        size_t n = s->steps[u].n_flow;
        if (edge_pos[depth - 1] >= n) {
            s->steps[u].color = 2;
            depth--;
            continue;
        }
        const ref *e = &refs[edge_pos[depth - 1]++];
        int t = e->target;
        if (t < 0) continue;
        if (s->steps[t].region < 0) {
            s->steps[t].region = r;
            s->steps[t].color = 1;
            stack[depth] = t;
            edge_pos[depth++] = 0;
            open_scopes(s, t, r);
        } else if (s->steps[t].region != r) {
            claim_conflict(s, u, e);
        } else if (s->steps[t].color == 1) {
            report_cycle(s, u, e, stack, depth);
        }
    }
}

static void assign_scopes(sem *s, int start) {
    int *stack = malloc((s->n + 1) * sizeof(*stack));
    size_t *edge_pos = malloc((s->n + 1) * sizeof(*edge_pos));
    if (!stack || !edge_pos) {
        s->rc = DEFN_ERR_NOMEM;
        goto done;
    }
    ref top = {NULL, start, NULL, -1, NULL};
    add_region(s, -1, &top, 0, -1, 1);
    for (size_t r = 0; r < s->n_regions && s->rc == 0; r++) {
        int entry = s->regions[r].entry;
        if (entry >= 0 && s->steps[entry].region >= 0) {
            ref e = {s->steps[entry].name, entry, s->regions[r].slot, s->regions[r].slot_index,
                     NULL};
            claim_conflict(s, s->regions[r].owner, &e);
            s->regions[r].entry = -1;
            continue;
        }
        walk_region(s, (int)r, stack, edge_pos);
    }
    for (size_t i = 0; i < s->n && s->rc == 0; i++)
        if (s->steps[i].region < 0)
            add(s, loc(s, (int)i, NULL, -1, NULL), "step is unreachable from start");
done:
    free(stack);
    free(edge_pos);
}

/* ------------------------------------------------------------------ "can run before" */

/* Graph nodes: 2i = step i starts, 2i+1 = step i has finished. */
static bool falls_out(const step *st) {
    if (st->k == K_APPROVAL) return !get(st->node, "on_approve") || !get(st->node, "on_reject");
    return !get(st->node, "next");
}

static int build_flow(sem *s) {
    size_t nodes = 2 * s->n;
    s->words = (nodes + 63) / 64;
    s->succ = calloc(nodes ? nodes : 1, sizeof(*s->succ));
    s->reach = calloc(s->n ? s->n : 1, sizeof(*s->reach));
    if (!s->succ || !s->reach) return DEFN_ERR_NOMEM;
    for (size_t i = 0; i < s->n; i++) {
        const step *st = &s->steps[i];
        const ref *refs = st->flow, *inner = st->scope;
        size_t nf = st->n_flow, ni = st->n_scope;
        int *start = malloc((ni + 2) * sizeof(int));
        int *fin = malloc((nf + 2) * sizeof(int));
        if (!start || !fin) {
            free(start);
            free(fin);
            return DEFN_ERR_NOMEM;
        }
        size_t a = 0, b = 0;
        for (size_t k = 0; k < ni; k++)
            if (inner[k].target >= 0) start[a++] = 2 * inner[k].target;
        /* A step without inner scopes finishes as it starts; so may a condition whose only
         * arm is not taken. Loops and parallels always run their scopes. */
        if (ni == 0 || (st->k == K_CONDITION && !get(st->node, "else")))
            start[a++] = 2 * (int)i + 1;
        start[a] = -1;
        for (size_t k = 0; k < nf; k++)
            if (refs[k].target >= 0) fin[b++] = 2 * refs[k].target;
        if (falls_out(st) && st->region >= 0 && s->regions[st->region].owner >= 0)
            fin[b++] = 2 * s->regions[st->region].owner + 1;
        fin[b] = -1;
        s->succ[2 * i] = start;
        s->succ[2 * i + 1] = fin;
    }
    return 0;
}

/* The reachability of every graph node at once, in reverse topological order, when the graph
 * is acyclic (every valid definition's is); a cyclic one (already reported) is searched per
 * step instead. One pass of bit-set unions instead of one search per referenced step. */
static int build_closure(sem *s) {
    size_t nodes = 2 * s->n;
    int rc = 0;
    int *indeg = calloc(nodes ? nodes : 1, sizeof(int));
    int *order = malloc((nodes ? nodes : 1) * sizeof(int));
    uint64_t *cl = NULL;
    if (!indeg || !order) {
        rc = DEFN_ERR_NOMEM;
        goto done;
    }
    for (size_t u = 0; u < nodes; u++)
        for (const int *v = s->succ[u]; *v >= 0; v++)
            indeg[*v]++;
    size_t head = 0, tail = 0;
    for (size_t u = 0; u < nodes; u++)
        if (indeg[u] == 0) order[tail++] = (int)u;
    while (head < tail) {
        int u = order[head++];
        for (const int *v = s->succ[u]; *v >= 0; v++)
            if (--indeg[*v] == 0) order[tail++] = *v;
    }
    if (tail < nodes) goto done; /* a cycle: keep the per-step search */
    cl = calloc(nodes * s->words + 1, sizeof(uint64_t));
    if (!cl) {
        rc = DEFN_ERR_NOMEM;
        goto done;
    }
    for (size_t k = nodes; k-- > 0;) {
        int u = order[k];
        uint64_t *ru = cl + (size_t)u * s->words;
        for (const int *v = s->succ[u]; *v >= 0; v++) {
            const uint64_t *rv = cl + (size_t)*v * s->words;
            for (size_t w = 0; w < s->words; w++)
                ru[w] |= rv[w];
            ru[*v / 64] |= 1ull << (*v % 64);
        }
    }
    s->closure = cl;
done:
    free(indeg);
    free(order);
    return rc;
}

/* Whether step x can have finished before graph node target is reached. */
static bool runs_before(sem *s, int x, int target) {
    if (s->closure) {
        const uint64_t *r = s->closure + (size_t)(2 * x + 1) * s->words;
        return (r[target / 64] >> (target % 64)) & 1;
    }
    if (!s->reach[x]) {
        uint64_t *seen = calloc(s->words, sizeof(uint64_t));
        int *queue = malloc((2 * s->n + 1) * sizeof(int));
        if (!seen || !queue) {
            free(seen);
            free(queue);
            s->rc = DEFN_ERR_NOMEM;
            return true;
        }
        size_t head = 0, tail = 0;
        queue[tail++] = 2 * x + 1;
        while (head < tail) {
            int u = queue[head++];
            for (const int *v = s->succ[u]; *v >= 0; v++) {
                if (seen[*v / 64] & (1ull << (*v % 64))) continue;
                seen[*v / 64] |= 1ull << (*v % 64);
                queue[tail++] = *v;
            }
        }
        free(queue);
        s->reach[x] = seen;
    }
    return (s->reach[x][target / 64] >> (target % 64)) & 1;
}

/* ------------------------------------------------------------------ state pointers */

typedef struct {
    int step;         /* the step whose field is checked */
    position pos;     /* when it is evaluated */
    const char *what; /* "template ${...}: " prefix, or "" for condition paths */
} reader;

static bool in_loop(const sem *s, const reader *rd) {
    const step *st = &s->steps[rd->step];
    if (rd->pos == AT_AFTER && st->k == K_LOOP) return true;
    return st->region >= 0 && s->regions[st->region].loop >= 0;
}

/* Splits the next reference token of p (after a '/') into tok; returns the rest or NULL on a
 * malformed escape. */
static const char *next_token(const char *p, const char *end, char *tok, size_t cap) {
    size_t w = 0;
    for (; p < end && *p != '/'; p++) {
        char c = *p;
        if (c == '~') {
            if (p + 1 >= end || (p[1] != '0' && p[1] != '1')) return NULL;
            c = p[1] == '0' ? '~' : '/';
            p++;
        }
        if (w + 1 < cap) tok[w++] = c;
    }
    tok[w] = '\0';
    return p;
}

static bool one_of(const char *v, const char *const *set) {
    for (; *set; set++)
        if (strcmp(v, *set) == 0) return true;
    return false;
}

/* Checks one pointer into the run state (len bytes at p), reporting at where. */
static void check_state_ptr(sem *s, const reader *rd, const char *p, size_t len,
                            const char *where) {
    static const char *const run_keys[] = {"id", "workflow_id", "triggered_by", "started_at", NULL};
    static const char *const loop_keys[] = {"iteration", "max_iterations", NULL};
    static const char *const env_keys[] = {"output", "status", NULL};
    const char *end = p + len, *q;
    char root[256], t1[512], t2[256];
    if (len == 0 || *p != '/') {
        add(s, where, "%smust be a JSON pointer starting with / such as /trigger/...", rd->what);
        return;
    }
    q = next_token(p + 1, end, root, sizeof(root));
    const char *q2 = q && q < end ? next_token(q + 1, end, t1, sizeof(t1)) : q;
    if (q2 == q) t1[0] = '\0';
    const char *q3 = q2 && q2 < end ? next_token(q2 + 1, end, t2, sizeof(t2)) : q2;
    if (q3 == q2) t2[0] = '\0';
    if (!q || !q2 || !q3) {
        add(s, where, "%smalformed JSON pointer escape (use ~0 for ~ and ~1 for /)", rd->what);
        return;
    }
    bool has1 = q < end, has2 = q2 < end;
    if (strcmp(root, "trigger") == 0) {
        if (has1 && s->trigger_fields && !get(s->trigger_fields, t1))
            add(s, where, "%strigger field \"%s\" is not declared in /trigger/fields", rd->what,
                t1);
    } else if (strcmp(root, "run") == 0) {
        if (!has1 || !one_of(t1, run_keys))
            add(s, where, "%s/run has id, workflow_id, triggered_by and started_at", rd->what);
    } else if (strcmp(root, "loop") == 0) {
        if (!in_loop(s, rd))
            add(s, where, "%s/loop is only defined inside a loop body", rd->what);
        else if (!has1 || !one_of(t1, loop_keys))
            add(s, where, "%s/loop has iteration and max_iterations", rd->what);
    } else if (strcmp(root, "steps") == 0) {
        int x = has1 ? find_step(s, t1) : -1;
        if (!has1) {
            add(s, where, "%s/steps needs a step name, as in /steps/<name>/output", rd->what);
        } else if (x < 0) {
            add(s, where, "%sreads unknown step \"%s\"", rd->what, t1);
        } else if (has2 && !one_of(t2, env_keys)) {
            add(s, where, "%sa step's envelope has only \"output\" and \"status\"", rd->what);
        } else if (x == rd->step && rd->pos != AT_SELF) {
            add(s, where, "%sreads the output of its own step, which does not exist yet", rd->what);
        } else if (x != rd->step && s->steps[rd->step].region >= 0) {
            int target = rd->pos == AT_AFTER ? 2 * rd->step + 1 : 2 * rd->step;
            if (!runs_before(s, x, target))
                add(s, where, "%sreads step \"%s\", which cannot have run before this point",
                    rd->what, t1);
        }
    } else {
        add(s, where, "%sunknown state root \"%s\"; the roots are /trigger, /steps, /loop and /run",
            rd->what, root);
    }
}

/* Finds the templates of str (from `from`): returns the offset of "${" or -1. "$${" is an
 * escaped, literal "${". */
static long next_template(const char *str, size_t from) {
    for (size_t i = from; str[i]; i++) {
        if (str[i] == '$' && str[i + 1] == '$' && str[i + 2] == '{') {
            i += 2;
            continue;
        }
        if (str[i] == '$' && str[i + 1] == '{') return (long)i;
    }
    return -1;
}

static bool has_template(const char *str) {
    return next_template(str, 0) >= 0;
}

/* The whole string is one template: its value keeps its JSON type when substituted. */
static bool whole_template(const char *str) {
    if (str[0] != '$' || str[1] != '{') return false;
    const char *close = strchr(str, '}');
    return close && close[1] == '\0';
}

static void check_templates(sem *s, int i, const char *str, const char *where, position pos) {
    long at = 0;
    while ((at = next_template(str, (size_t)at)) >= 0) {
        const char *open = str + at + 2;
        const char *close = strchr(open, '}');
        if (!close) {
            add(s, where, "template at character %ld is not closed with }",
                (long)defn__utf8_len(str) - (long)defn__utf8_len(str + at));
            return;
        }
        char what[300];
        snprintf(what, sizeof(what),
                 "template ${%.*s}: ", (int)((close - open) > 200 ? 200 : close - open), open);
        reader rd = {i, pos, what};
        check_state_ptr(s, &rd, open, (size_t)(close - open), where);
        at = close - str + 1;
    }
}

/* The template-bearing string field f of step i (absent is fine). */
static void check_template_field(sem *s, int i, const cJSON *obj, const char *f, const char *sub,
                                 position pos) {
    const char *str = get_str(obj, sub ? sub : f);
    if (!str) return;
    char where[1024];
    snprintf(where, sizeof(where), "%s", loc(s, i, f, -1, sub));
    check_templates(s, i, str, where, pos);
}

/* ------------------------------------------------------------------ conditions */

static void check_condition(sem *s, int i, const cJSON *c, defn__ptr *at, position pos) {
    const char *op = get_str(c, "op");
    if (!op) return;
    const cJSON *of = get(c, "of");
    if (cJSON_IsArray(of)) {
        size_t idx = 0;
        for (const cJSON *e = of->child; e && s->rc == 0; e = e->next, idx++) {
            size_t m1 = defn__ptr_push_key(at, "of");
            size_t m2 = m1 == (size_t)-1 ? m1 : defn__ptr_push_index(at, idx);
            if (m2 == (size_t)-1) {
                s->rc = DEFN_ERR_NOMEM;
                return;
            }
            check_condition(s, i, e, at, pos);
            defn__ptr_pop(at, m1);
        }
        return;
    }
    const char *path = get_str(c, "path");
    if (!path) return;
    size_t m = defn__ptr_push_key(at, "path");
    if (m == (size_t)-1) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    reader rd = {i, pos, ""};
    check_state_ptr(s, &rd, path, strlen(path), at->buf);
    defn__ptr_pop(at, m);
}

static void check_condition_field(sem *s, int i, const cJSON *c, const char *f, const char *sub,
                                  position pos) {
    if (!c) return;
    defn__ptr at;
    if (defn__ptr_init(&at) != 0) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    if (defn__ptr_set(&at, loc(s, i, f, -1, sub)) != 0) {
        s->rc = DEFN_ERR_NOMEM;
        defn__ptr_free(&at);
        return;
    }
    check_condition(s, i, c, &at, pos);
    defn__ptr_free(&at);
}

/* ------------------------------------------------------------------ tools */

static bool arg_type_ok(const char *type, const cJSON *v) {
    if (strcmp(type, "string") == 0) return cJSON_IsString(v);
    if (strcmp(type, "boolean") == 0) return cJSON_IsBool(v);
    if (strcmp(type, "object") == 0) return cJSON_IsObject(v);
    if (strcmp(type, "array") == 0) return cJSON_IsArray(v);
    if (strcmp(type, "number") == 0) return cJSON_IsNumber(v);
    if (strcmp(type, "integer") == 0)
        return cJSON_IsNumber(v) && v->valuedouble == (double)(long long)v->valuedouble;
    return false;
}

static const char *json_type(const cJSON *v) {
    if (cJSON_IsString(v)) return "string";
    if (cJSON_IsNumber(v)) return "number";
    if (cJSON_IsBool(v)) return "boolean";
    if (cJSON_IsObject(v)) return "object";
    if (cJSON_IsArray(v)) return "array";
    return "null";
}

/* Every string inside an argument value may carry templates. */
static void check_value_templates(sem *s, int i, const cJSON *v, defn__ptr *at) {
    if (cJSON_IsString(v)) {
        size_t len = defn__utf8_len(v->valuestring);
        if (len > DEFN_MAX_TEMPLATE)
            add(s, at->buf, "length must be <= %d, but got %zu", DEFN_MAX_TEMPLATE, len);
        else
            check_templates(s, i, v->valuestring, at->buf, AT_ENTRY);
        return;
    }
    size_t idx = 0;
    for (const cJSON *c = v->child; c && s->rc == 0; c = c->next, idx++) {
        size_t m =
            cJSON_IsObject(v) ? defn__ptr_push_key(at, c->string) : defn__ptr_push_index(at, idx);
        if (m == (size_t)-1) {
            s->rc = DEFN_ERR_NOMEM;
            return;
        }
        check_value_templates(s, i, c, at);
        defn__ptr_pop(at, m);
    }
}

static void check_args(sem *s, int i, const char *prefix, const cJSON *with, const defn_tool *tool,
                       const defn_tool_action *act) {
    defn__ptr at;
    if (defn__ptr_init(&at) != 0) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    char base[1024];
    snprintf(base, sizeof(base), "%s",
             prefix ? loc(s, i, prefix, -1, "with") : loc(s, i, "with", -1, NULL));
    for (const cJSON *a = cJSON_IsObject(with) ? with->child : NULL; a && s->rc == 0; a = a->next) {
        if (defn__ptr_set(&at, base) != 0) {
            s->rc = DEFN_ERR_NOMEM;
            break;
        }
        if (defn__ptr_push_key(&at, a->string) == (size_t)-1) {
            s->rc = DEFN_ERR_NOMEM;
            break;
        }
        const defn_tool_arg *arg = NULL;
        for (size_t k = 0; k < act->n_args && !arg; k++)
            if (strcmp(act->args[k].name, a->string) == 0) arg = &act->args[k];
        if (!arg) {
            add(s, at.buf, "\"%s.%s\" has no argument \"%s\"", tool->tool, act->action, a->string);
            continue;
        }
        bool tmpl = cJSON_IsString(a) && has_template(a->valuestring);
        if (arg->pinned_literal && tmpl) {
            add(s, at.buf, "argument \"%s\" is pinned: it must be a literal, not a template",
                arg->name);
            continue;
        }
        if (!(tmpl && whole_template(a->valuestring)) && !arg_type_ok(arg->type, a)) {
            if (tmpl)
                add(s, at.buf,
                    "argument \"%s\" must be %s; a template must then be the whole value",
                    arg->name, arg->type);
            else
                add(s, at.buf, "argument \"%s\" must be %s, but got %s", arg->name, arg->type,
                    json_type(a));
            continue;
        }
        check_value_templates(s, i, a, &at);
    }
    for (size_t k = 0; k < act->n_args && s->rc == 0; k++)
        if (act->args[k].required && !get(with, act->args[k].name))
            add(s, cJSON_IsObject(with) ? base : loc(s, i, prefix, -1, NULL),
                "missing required argument \"%s\" of \"%s.%s\"", act->args[k].name, tool->tool,
                act->action);
    defn__ptr_free(&at);
}

static void list_tools(const sem *s, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < s->ctx->catalog.n_tools && used < len; k++) {
        const defn_tool *t = &s->ctx->catalog.tools[k];
        int w = snprintf(buf + used, len - used, "%s\"%s\"", used ? ", " : "", t->tool);
        if (w > 0) used += (size_t)w;
    }
}

static void list_observations(const sem *s, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < s->ctx->catalog.n_observations && used < len; k++) {
        const defn_poll_observation *o = &s->ctx->catalog.observations[k];
        int w =
            snprintf(buf + used, len - used, "%s\"%s.%s\"", used ? ", " : "", o->tool, o->action);
        if (w > 0) used += (size_t)w;
    }
}

/* Resolves (tool, action) of step i, under prefix (NULL for the step itself, "poll" for a
 * poll-mode wait), reports what is not catalogued, then checks the arguments. */
static void check_tool_call(sem *s, int i, const cJSON *obj, const char *prefix, bool observation) {
    const char *tname = get_str(obj, "tool"), *aname = get_str(obj, "action");
    if (!tname || !aname) return;
    char list[600];
    const defn__catalog *cat = &s->ctx->catalog;
    if (observation) {
        bool tool_ok = false, pair_ok = false;
        for (size_t k = 0; k < cat->n_observations; k++) {
            tool_ok = tool_ok || strcmp(cat->observations[k].tool, tname) == 0;
            pair_ok = pair_ok || (strcmp(cat->observations[k].tool, tname) == 0 &&
                                  strcmp(cat->observations[k].action, aname) == 0);
        }
        if (!pair_ok) {
            list_observations(s, list, sizeof(list));
            if (!tool_ok)
                add(s, loc(s, i, prefix, -1, "tool"),
                    "\"%s\" has no admitted poll observation; admitted: %s", tname, list);
            else
                add(s, loc(s, i, prefix, -1, "action"),
                    "\"%s.%s\" is not an admitted poll observation; admitted: %s", tname, aname,
                    list);
            return;
        }
    }
    const char *tool_field = prefix ? prefix : "tool";
    const char *tool_sub = prefix ? "tool" : NULL;
    const defn_tool *t = defn__catalog_tool(cat, tname);
    if (!t) {
        list_tools(s, list, sizeof(list));
        add(s, loc(s, i, tool_field, -1, tool_sub), "unknown tool \"%s\"; catalogued tools: %s",
            tname, list);
        return;
    }
    /* A tool whose gate is off is checked like any other: the create-time whitelist is the
     * catalogue, gate or not (spec GetToolCatalogResponse.tools: a node built from a gated-off
     * tool "would validate at create, render on the canvas, and then fail closed at dispatch").
     * The gate only hides it from GetToolCatalog and fails the step when the run reaches it. */
    const defn_tool_action *act = defn__catalog_action(t, aname);
    if (!act) {
        add(s, loc(s, i, prefix ? prefix : "action", -1, prefix ? "action" : NULL),
            "tool \"%s\" has no action \"%s\"", tname, aname);
        return;
    }
    check_args(s, i, prefix, get(obj, "with"), t, act);
}

/* ------------------------------------------------------------------ per kind */

static void check_timeout_pair(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    if (get(node, "on_timeout") && !get(node, "timeout_minutes"))
        add(s, loc(s, i, "on_timeout", -1, NULL), "on_timeout needs timeout_minutes");
}

static void check_asked_by(sem *s, int i) {
    const char *name = get_str(s->steps[i].node, "asked_by");
    int x = name ? find_step(s, name) : -1;
    if (x < 0) return; /* unknown: reported with the references */
    if (s->steps[x].k != K_AGENT)
        add(s, loc(s, i, "asked_by", -1, NULL), "must name an agent_action step; \"%s\" is a %s",
            name, kind_name(s->steps[x].node));
    else if (s->steps[i].region >= 0 && !runs_before(s, x, 2 * i))
        add(s, loc(s, i, "asked_by", -1, NULL), "step \"%s\" cannot have run before this step asks",
            name);
}

/* Duplicate option tokens and a default that is not one of them. */
static void check_options(sem *s, int i, const char *field, const char *dflt_field,
                          const char *what) {
    const cJSON *node = s->steps[i].node;
    const cJSON *opts = get(node, "options");
    int idx = 0;
    for (const cJSON *o = cJSON_IsArray(opts) ? opts->child : NULL; o; o = o->next, idx++) {
        const char *v = get_str(o, field);
        if (!v) continue;
        int j = 0;
        for (const cJSON *p = opts->child; p != o; p = p->next, j++) {
            const char *w = get_str(p, field);
            if (w && strcmp(v, w) == 0) {
                add(s, loc(s, i, "options", idx, field),
                    "duplicate option %s \"%s\" (option %d has it)", what, v, j);
                break;
            }
        }
    }
    const char *dflt = get_str(node, dflt_field);
    if (dflt) {
        bool found = false;
        for (const cJSON *o = cJSON_IsArray(opts) ? opts->child : NULL; o && !found; o = o->next) {
            const char *v = get_str(o, field);
            found = v && strcmp(v, dflt) == 0;
        }
        if (!found)
            add(s, loc(s, i, dflt_field, -1, NULL), "\"%s\" is not one of the option %ss", dflt,
                what);
    }
    const char *on_timeout = get_str(node, "on_timeout");
    if (on_timeout && strcmp(on_timeout, "default") == 0 && !dflt)
        add(s, loc(s, i, "on_timeout", -1, NULL), "on_timeout \"default\" needs %s", dflt_field);
}

static bool non_empty(const cJSON *v) {
    return v && v->child;
}

static void check_user_input(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_options(s, i, "value", "default_choice", "value");
    bool text = cJSON_IsTrue(get(node, "allow_text"));
    if (!non_empty(get(node, "options")) && !text)
        add(s, loc(s, i, NULL, -1, NULL), "a prompt needs options or allow_text: true");
    if (get(node, "text_placeholder") && !text)
        add(s, loc(s, i, "text_placeholder", -1, NULL), "text_placeholder needs allow_text: true");
    check_timeout_pair(s, i);
    check_asked_by(s, i);
    check_template_field(s, i, node, "question", NULL, AT_ENTRY);
}

static void check_question(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_options(s, i, "key", "default_option_key", "key");
    if (!non_empty(get(node, "options")) && !non_empty(get(node, "answer")))
        add(s, loc(s, i, NULL, -1, NULL), "a question needs options or answer fields");
    check_timeout_pair(s, i);
    check_asked_by(s, i);
    check_template_field(s, i, node, "prompt", NULL, AT_ENTRY);
}

static void check_agent(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_template_field(s, i, node, "prompt", NULL, AT_ENTRY);
    const cJSON *acc = get(node, "acceptance");
    if (!acc) return;
    if (!non_empty(get(node, "expects")) && !get(acc, "check"))
        add(s, loc(s, i, "acceptance", -1, NULL),
            "acceptance needs expects or a check to judge the output by");
    check_condition_field(s, i, get(acc, "check"), "acceptance", "check", AT_SELF);
    check_template_field(s, i, acc, "acceptance", "feedback", AT_SELF);
}

static void check_wait(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_timeout_pair(s, i);
    const cJSON *poll = get(node, "poll");
    if (!poll) return;
    check_tool_call(s, i, poll, "poll", true);
    check_condition_field(s, i, get(poll, "until"), "poll", "until", AT_SELF);
}

static void check_step(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    switch (s->steps[i].k) {
    case K_AGENT:
        check_agent(s, i);
        break;
    case K_TOOL:
        check_tool_call(s, i, node, NULL, false);
        break;
    case K_APPROVAL:
        check_timeout_pair(s, i);
        check_template_field(s, i, node, "summary", NULL, AT_ENTRY);
        break;
    case K_USER_INPUT:
        check_user_input(s, i);
        break;
    case K_QUESTION:
        check_question(s, i);
        break;
    case K_WAIT:
        check_wait(s, i);
        break;
    case K_LOOP:
        check_condition_field(s, i, get(node, "until"), "until", NULL, AT_AFTER);
        break;
    case K_CONDITION:
        check_condition_field(s, i, get(node, "if"), "if", NULL, AT_ENTRY);
        break;
    default:
        break;
    }
}

/* ------------------------------------------------------------------ ordering */

typedef struct {
    const cJSON *node;
    size_t order;
} node_order;

static int cmp_node(const void *a, const void *b) {
    const node_order *x = a, *y = b;
    return (uintptr_t)x->node < (uintptr_t)y->node ? -1 : (uintptr_t)x->node > (uintptr_t)y->node;
}

static void number_nodes(const cJSON *n, node_order *tab, size_t *k) {
    tab[*k].node = n;
    tab[*k].order = *k;
    (*k)++;
    for (const cJSON *c = n->child; c; c = c->next)
        number_nodes(c, tab, k);
}

static size_t count_nodes(const cJSON *n) {
    size_t k = 1;
    for (const cJSON *c = n->child; c; c = c->next)
        k += count_nodes(c);
    return k;
}

typedef struct {
    size_t order, seq;
    defn_violation v;
} ranked;

static int cmp_ranked(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->order != y->order) return x->order < y->order ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

/* Puts the semantic violations (from index first) in document order of their locations; the
 * passes above find them graph-first. Only runs when there is something to sort. */
static int sort_violations(sem *s, size_t first) {
    size_t n = s->out->n - first;
    if (n < 2) return 0;
    size_t total = count_nodes(s->doc), k = 0;
    node_order *tab = malloc(total * sizeof(*tab));
    ranked *r = malloc(n * sizeof(*r));
    if (!tab || !r) {
        free(tab);
        free(r);
        return DEFN_ERR_NOMEM;
    }
    number_nodes(s->doc, tab, &k);
    qsort(tab, total, sizeof(*tab), cmp_node);
    for (size_t i = 0; i < n; i++) {
        defn_violation *v = &s->out->items[first + i];
        const cJSON *node = defn__resolve(s->doc, v->instance_location);
        node_order key = {node, 0},
                   *hit = node ? bsearch(&key, tab, total, sizeof(*tab), cmp_node) : NULL;
        r[i] = (ranked){hit ? hit->order : total, i, *v};
    }
    qsort(r, n, sizeof(*r), cmp_ranked);
    for (size_t i = 0; i < n; i++)
        s->out->items[first + i] = r[i].v;
    free(tab);
    free(r);
    return 0;
}

/* ------------------------------------------------------------------ entry */

int defn__semantic_check(const defn_ctx *ctx, const cJSON *doc, defn_violations *out) {
    sem s = {.ctx = ctx, .doc = doc, .out = out};
    size_t first = out->n, first_total = out->n + out->dropped;
    if (defn__ptr_init(&s.ptr) != 0) return DEFN_ERR_NOMEM;
    s.trigger_fields = get(get(doc, "trigger"), "fields");
    index_steps(&s);
    if (s.rc == 0) index_refs(&s);
    if (s.rc == 0) check_references(&s);
    const char *start = get_str(doc, "start");
    int start_idx = start ? find_step(&s, start) : -1;
    if (start && start_idx < 0) add(&s, "/start", "unknown step \"%s\"", start);
    /* Without a start every step would read as unreachable: report the cause only. */
    if (s.rc == 0 && start_idx >= 0) assign_scopes(&s, start_idx);
    if (s.rc == 0) s.rc = build_flow(&s);
    if (s.rc == 0) s.rc = build_closure(&s);
    for (size_t i = 0; i < s.n && s.rc == 0; i++)
        check_step(&s, (int)i);
    if (s.rc == 0) s.rc = sort_violations(&s, first);
    for (size_t i = 0; s.succ && i < 2 * s.n; i++)
        free(s.succ[i]);
    for (size_t i = 0; s.reach && i < s.n; i++)
        free(s.reach[i]);
    free(s.succ);
    free(s.reach);
    free(s.closure);
    for (size_t i = 0; s.steps && i < s.n; i++) {
        free(s.steps[i].flow);
        free(s.steps[i].scope);
    }
    free(s.by_name);
    free(s.regions);
    free(s.steps);
    defn__ptr_free(&s.ptr);
    if (s.rc != 0) return s.rc;
    return out->n + out->dropped > first_total ? DEFN_INVALID : DEFN_OK;
}
