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

#include "defn_semantic_int.h"

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

/* ------------------------------------------------------------------ helpers */

const cJSON *defn__sem_get(const cJSON *o, const char *k) {
    return cJSON_IsObject(o) ? cJSON_GetObjectItemCaseSensitive(o, k) : NULL;
}

const char *defn__sem_str(const cJSON *o, const char *k) {
    const cJSON *v = defn__sem_get(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

int defn__sem_find(const sem *s, const char *name) {
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

const char *defn__sem_kind_name(const cJSON *step) {
    const char *t = defn__sem_str(step, "type");
    return t ? t : "step";
}

/* Builds /steps/<step>[/a[/idx][/b]] in s->ptr and returns it (valid until the next call). */
const char *defn__sem_loc(sem *s, int i, const char *a, int idx, const char *b) {
    defn__ptr_pop(&s->ptr, 0);
    size_t ok = defn__ptr_push_key(&s->ptr, "steps");
    if (ok != (size_t)-1 && i >= 0) ok = defn__ptr_push_key(&s->ptr, s->steps[i].name);
    if (ok != (size_t)-1 && a) ok = defn__ptr_push_key(&s->ptr, a);
    if (ok != (size_t)-1 && idx >= 0) ok = defn__ptr_push_index(&s->ptr, (size_t)idx);
    if (ok != (size_t)-1 && b) ok = defn__ptr_push_key(&s->ptr, b);
    if (ok == (size_t)-1) s->rc = DEFN_ERR_NOMEM;
    return s->ptr.buf;
}

void defn__sem_add(sem *s, const char *where, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void defn__sem_add(sem *s, const char *where, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (defn__add(s->out, where, "%s", msg) != 0) s->rc = DEFN_ERR_NOMEM;
}

static const char *ref_loc(sem *s, int i, const ref *r) {
    return defn__sem_loc(s, i, r->field, r->index, r->sub);
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
        add_ref(refs, &n, defn__sem_get(node, "on_approve"), "on_approve", -1, NULL);
        add_ref(refs, &n, defn__sem_get(node, "on_reject"), "on_reject", -1, NULL);
        return n;
    case K_USER_INPUT:
    case K_QUESTION: {
        int idx = 0;
        const cJSON *opts = defn__sem_get(node, "options");
        for (const cJSON *o = cJSON_IsArray(opts) ? opts->child : NULL; o; o = o->next, idx++)
            add_ref(refs, &n, defn__sem_get(o, "next"), "options", idx, "next");
        break;
    }
    default:
        break;
    }
    add_ref(refs, &n, defn__sem_get(node, "next"), "next", -1, NULL);
    return n;
}

/* The entries of the scopes a container opens. */
static size_t scope_refs(const step *st, ref *refs) {
    size_t n = 0;
    const cJSON *node = st->node;
    if (st->k == K_LOOP) add_ref(refs, &n, defn__sem_get(node, "body"), "body", -1, NULL);
    if (st->k == K_CONDITION) {
        add_ref(refs, &n, defn__sem_get(node, "then"), "then", -1, NULL);
        add_ref(refs, &n, defn__sem_get(node, "else"), "else", -1, NULL);
    }
    if (st->k == K_PARALLEL) {
        int idx = 0;
        const cJSON *br = defn__sem_get(node, "branches");
        for (const cJSON *b = cJSON_IsArray(br) ? br->child : NULL; b; b = b->next, idx++)
            add_ref(refs, &n, b, "branches", idx, NULL);
    }
    return n;
}

static void resolve(const sem *s, ref *refs, size_t n) {
    for (size_t k = 0; k < n; k++)
        refs[k].target = defn__sem_find(s, refs[k].target_name);
}

/* ------------------------------------------------------------------ steps and references */

static void index_steps(sem *s) {
    const cJSON *steps = defn__sem_get(s->doc, "steps");
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
        const char *t = defn__sem_str(st, "type");
        for (size_t k = 0; t && k < sizeof(kinds) / sizeof(kinds[0]); k++)
            if (strcmp(t, kinds[k].name) == 0) s->steps[i].k = kinds[k].k;
        size_t len = defn__utf8_len(st->string);
        bool ctl = false;
        for (const unsigned char *p = (const unsigned char *)st->string; *p; p++)
            ctl = ctl || *p < 0x20 || *p == 0x7f;
        if (len == 0 || len > DEFN_MAX_STEP_NAME || ctl)
            defn__sem_add(s, defn__sem_loc(s, (int)i, NULL, -1, NULL),
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
            defn__sem_add(s, ref_loc(s, i, &refs[k]), "unknown step \"%s\"", refs[k].target_name);
}

static void check_references(sem *s) {
    for (size_t i = 0; i < s->n && s->rc == 0; i++) {
        const step *st = &s->steps[i];
        ref asked[1];
        size_t n = 0;
        report_unknown(s, (int)i, st->flow, st->n_flow);
        report_unknown(s, (int)i, st->scope, st->n_scope);
        add_ref(asked, &n, defn__sem_get(st->node, "asked_by"), "asked_by", -1, NULL);
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
    defn__sem_add(s, from >= 0 ? ref_loc(s, from, r) : "/start",
                  "step \"%s\" already belongs to %s; a step can be entered from one scope only",
                  r->target_name, where);
}

/* Opens the scopes of a container just claimed by region r. */
static void open_scopes(sem *s, int i, int r) {
    const ref *refs = s->steps[i].scope;
    size_t n = s->steps[i].n_scope;
    int depth = s->regions[r].depth + 1;
    if (n && depth > DEFN_MAX_SCOPE_DEPTH)
        defn__sem_add(s, defn__sem_loc(s, i, NULL, -1, NULL), "scopes nest deeper than %d levels",
                      DEFN_MAX_SCOPE_DEPTH);
    int loop = s->steps[i].k == K_LOOP ? i : s->regions[r].loop;
    long laps = s->regions[r].laps;
    if (s->steps[i].k == K_LOOP) {
        const cJSON *m = defn__sem_get(s->steps[i].node, "max_iterations");
        laps *= cJSON_IsNumber(m) && m->valuedouble >= 1 ? (long)m->valuedouble : 1;
        /* reported once, at the loop that first crosses the budget; deeper loops stay quiet */
        if (laps > DEFN_MAX_RUN_LAPS && s->regions[r].laps <= DEFN_MAX_RUN_LAPS)
            defn__sem_add(
                s, defn__sem_loc(s, i, "max_iterations", -1, NULL),
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
                    defn__sem_add(s, ref_loc(s, i, &refs[k]), "step \"%s\" is already branch %d",
                                  refs[k].target_name, refs[j].index);
                else
                    defn__sem_add(s, ref_loc(s, i, &refs[k]),
                                  "step \"%s\" is already the \"%s\" arm", refs[k].target_name,
                                  refs[j].field);
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
    defn__sem_add(s, ref_loc(s, from, r),
                  "creates a cycle (%s); repeat steps with a loop step instead", path);
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
            defn__sem_add(s, defn__sem_loc(s, (int)i, NULL, -1, NULL),
                          "step is unreachable from start");
done:
    free(stack);
    free(edge_pos);
}

/* ------------------------------------------------------------------ "can run before" */

/* Graph nodes: 2i = step i starts, 2i+1 = step i has finished. */
static bool falls_out(const step *st) {
    if (st->k == K_APPROVAL)
        return !defn__sem_get(st->node, "on_approve") || !defn__sem_get(st->node, "on_reject");
    return !defn__sem_get(st->node, "next");
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
        if (ni == 0 || (st->k == K_CONDITION && !defn__sem_get(st->node, "else")))
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
bool defn__sem_runs_before(sem *s, int x, int target) {
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
    s.trigger_fields = defn__sem_get(defn__sem_get(doc, "trigger"), "fields");
    index_steps(&s);
    if (s.rc == 0) index_refs(&s);
    if (s.rc == 0) check_references(&s);
    const char *start = defn__sem_str(doc, "start");
    int start_idx = start ? defn__sem_find(&s, start) : -1;
    if (start && start_idx < 0) defn__sem_add(&s, "/start", "unknown step \"%s\"", start);
    /* Without a start every step would read as unreachable: report the cause only. */
    if (s.rc == 0 && start_idx >= 0) assign_scopes(&s, start_idx);
    if (s.rc == 0) s.rc = build_flow(&s);
    if (s.rc == 0) s.rc = build_closure(&s);
    for (size_t i = 0; i < s.n && s.rc == 0; i++)
        defn__sem_check_step(&s, (int)i);
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
