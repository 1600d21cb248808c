/* Recommendation: a deterministic, documented scoring of agent role x optimisation goal.
 *
 *   quality(m, role) = w_r*reasoning + w_c*code_generation + w_s*structured_ops
 *                    + w_l*long_context + w_t*tool_use_quality      (role weights sum to 1)
 *   score(m)         = (1 - p) * quality + p * cost_efficiency       (p = the goal's price weight:
 *                                                                     quality 0.10, balanced 0.35,
 *                                                                     cost 0.65)
 *
 * Qualifying models: of a connected provider (all providers when connected_providers is empty),
 * not deprecated or retired, and with tool use when the role is an agent role (every built-in
 * role is). Ranking: score desc, then quality desc, then blended price asc, then model_id asc,
 * so equal inputs always give the same answer. docs/model-registry.md has the full table. */
#ifndef UPSQUAD_MR_SCORE_H
#define UPSQUAD_MR_SCORE_H

#include <stddef.h>

#include "snapshot.h"

#define MR_ROLE_MAX 64          /* longest agent_role accepted */
#define MR_MAX_PROVIDERS_REQ 16 /* most connected_providers entries accepted */
#define MR_MAX_ALTERNATIVES 10  /* hard bound of the configurable alternatives count */
#define MR_REASONING_MAX 1024

typedef struct mr_role {
    const char *name; /* canonical, lowercase */
    double w_reasoning, w_code, w_structured, w_long_context, w_tool_use;
    int agent;         /* agent roles never get a model without tool use */
    const char *focus; /* what the weights favour, for docs and reasoning */
} mr_role;

enum { MR_GOAL_QUALITY = 0, MR_GOAL_BALANCED = 1, MR_GOAL_COST = 2 };

/* Role lookup: case-insensitive, surrounding spaces ignored, '_' and ' ' read as '-', and a few
 * aliases ("backend" -> backend-sme, "qa" -> qa-engineer, ...). NULL when unknown. */
const mr_role *mr_role_find(const char *name, size_t len);
const mr_role *mr_role_general(void);
size_t mr_role_count(void); /* built-in roles, general included */
const mr_role *mr_role_at(size_t i);

/* "" (or only spaces) -> balanced. Returns 0, or -1 for an unknown goal. */
int mr_goal_parse(const char *s, size_t len, int *goal);
const char *mr_goal_name(int goal);
double mr_goal_price_weight(int goal);

double mr_quality(const mr_role *r, const mr_entry *e);

typedef struct mr_rec_request {
    const char *agent_role; /* may be NULL/"" */
    const char *const *providers;
    size_t n_providers;
    const char *goal;        /* may be NULL/"" */
    size_t max_alternatives; /* clamped to MR_MAX_ALTERNATIVES */
} mr_rec_request;

typedef struct mr_ranked {
    const mr_entry *e;
    double quality, score;
} mr_ranked;

typedef struct mr_rec_result {
    mr_ranked best;
    size_t n_alternatives;
    mr_ranked alternatives[MR_MAX_ALTERNATIVES];
    const mr_role *role;
    int goal;
    char reasoning[MR_REASONING_MAX];
} mr_rec_result;

enum {
    MR_OK = 0,
    MR_EINVAL = -1,    /* a request field is invalid; err names it (INVALID_ARGUMENT) */
    MR_ENONE = -2,     /* nothing qualifies; err says why (FAILED_PRECONDITION) */
    MR_ENOTFOUND = -3, /* unknown ids; err names them (NOT_FOUND) */
};

/* Pure and thread-safe on an immutable snapshot. */
int mr_recommend(const mr_snapshot *s, const mr_rec_request *rq, mr_rec_result *out, char *err,
                 size_t errlen);

/* ---- ListModels and CompareModels ---- */

/* Most model_ids a CompareModels request may carry. The spec sets no limit; this one is a bound
 * on the work and the answer (every catalogue entry at once fits many times over) */
#define MR_COMPARE_MAX 100

/* Entries of `provider_filter` (case-insensitive, trimmed; "" = all) in ListModels order into
 * out (capacity s->n). An unknown provider yields 0 entries. Returns the count. */
size_t mr_list(const mr_snapshot *s, const char *provider_filter, const mr_entry **out);

/* Entries for `ids` in the order requested, duplicates (after case folding) collapsed to their
 * first position. out has room for MR_COMPARE_MAX. Returns MR_OK, MR_EINVAL (empty list, more
 * than MR_COMPARE_MAX entries, an empty id) or MR_ENOTFOUND (err lists every unknown id). */
int mr_compare(const mr_snapshot *s, const char *const *ids, size_t n, const mr_entry **out,
               size_t *n_out, char *err, size_t errlen);

#endif
