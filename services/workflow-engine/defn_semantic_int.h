/* Internals of the definition language's semantic rules (defn_semantic.c: steps, references,
 * scopes, "can run before", the ordering of violations and the entry; defn_checks.c: the
 * checks of each step: state pointers, templates, conditions, tool calls, per kind). */
#ifndef WF_DEFN_SEMANTIC_INT_H
#define WF_DEFN_SEMANTIC_INT_H

#include <stdbool.h>
#include <stdint.h>

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

const cJSON *defn__sem_get(const cJSON *o, const char *k);
const char *defn__sem_str(const cJSON *o, const char *k);
/* The index of the step named name, -1 when none. */
int defn__sem_find(const sem *s, const char *name);
const char *defn__sem_kind_name(const cJSON *step);
/* "/steps/<name>/<a>[/<idx>[/<b>]]" in the checker's scratch buffer. */
const char *defn__sem_loc(sem *s, int i, const char *a, int idx, const char *b);
/* Records a violation at where. */
void defn__sem_add(sem *s, const char *where, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* Whether step x can have run before target (on some path). */
bool defn__sem_runs_before(sem *s, int x, int target);
/* Every check of step i (defn_checks.c). */
void defn__sem_check_step(sem *s, int i);

#endif
