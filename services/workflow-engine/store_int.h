/* Internals shared by the workflow engine's store files (store.c: transactions, workflows,
 * schedules, audit, runs, a tick's reads; store_actions.c: actions, governance rows,
 * deliveries, agent steps; store_queue.c: the run queue, the outbox; store_gates.c: human
 * gates; store_approvals.c: agent sessions' approvals): the statement helpers and the select
 * lists more than one of them reads with. Tables are schema-qualified: no reliance on the
 * role's search_path. */
#ifndef WF_STORE_INT_H
#define WF_STORE_INT_H

#include "store.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define S "workflow_engine."
#define MS(x) "(extract(epoch from " x ") * 1000)::bigint"
#define US_TS(p) "(timestamptz 'epoch' + (" p ")::bigint * interval '1 microsecond')"

static inline int ex(db_tx *tx, const char *sql, int n, const char *const *p, PGresult **out,
                     char *err, size_t errlen) {
    return db_exec(db_tx_conn(tx), sql, n, p, out, err, errlen);
}

static inline const char *nz(const char *s) {
    return s && s[0] ? s : NULL;
}

static inline void i64s(char *buf, size_t n, int64_t v) {
    snprintf(buf, n, "%" PRId64, v);
}

static inline void ms_or_null(char *buf, size_t n, int64_t ms, const char **slot) {
    if (ms > 0) {
        i64s(buf, n, ms);
        *slot = buf;
    } else {
        *slot = NULL;
    }
}

/* ---- a run with its workflow's scope (st_run_load, st_tick_head): RL_* columns ---- */

#define RL_SELECT                                                                                  \
    "SELECT r.id, r.org_id, r.workflow_id, r.triggered_by, r.status, r.context::text, "            \
    "r.definition::text, r.display_name, r.event_seq, r.cost_usd, " MS("r.started_at") ", " MS(    \
        "r.completed_at") ", w.name, w.team_id, w.visibility, w.created_by, "                      \
                          "w.data_classification, w.deleted_at IS NOT NULL, r.trace_id, "          \
                          "r.actions_count FROM " S "runs r JOIN " S                               \
                          "workflows w ON w.id = r.workflow_id WHERE r.id = $1::uuid"

/* ---- the lease check (st_queue_fence, st_tick_head) ---- */

#define FENCE_SQL                                                                                  \
    "UPDATE " S "run_queue SET lease_until = clock_timestamp() + $3::bigint * "                    \
    "interval '1 millisecond' WHERE run_id = $1::uuid AND lease_owner = $2 "                       \
    "AND lease_until > clock_timestamp() RETURNING 1"

/* ---- a run's actions as WorkflowAction rows (AC_*): st_actions_of, st_actions_by_ids ---- */

#define AC_SELECT                                                                                  \
    "SELECT a.id, a.run_id, a.org_id, a.step_name, a.agent_id, a.status, "                         \
    "       coalesce(a.input::text, ''), coalesce(a.output::text, ''), a.decided_by, "             \
    "       " MS("a.decided_at") ", " MS(                                                          \
        "a.created_at") ", a.approval_id, a.cost_usd, "                                            \
                        "       CASE WHEN a.started_at IS NULL THEN 0 ELSE (extract(epoch from "   \
                        "         coalesce(a.finished_at, clock_timestamp()) - a.started_at) * "   \
                        "1000)::bigint "                                                           \
                        "END, "                                                                    \
                        "       a.blocked_by, a.iteration, a.step_type, w.data_classification "    \
                        "FROM " S "actions a JOIN " S "runs ar ON ar.id = a.run_id JOIN " S        \
                        "workflows w ON w.id = ar.workflow_id "

/* The interpreter's columns (IA_*), as a select list: MS() timestamps in milliseconds. */
#define IA_DEADLINE_MS MS("deadline_at")
#define IA_NEXT_POLL_MS MS("next_poll_at")
#define IA_STARTED_MS MS("started_at")
#define IA_SELECT_INPUT(input)                                                                     \
    "SELECT id, step_name, step_type, lap_key, iteration, status, attempt, "                       \
    "coalesce(idempotency_key, ''), " input ", coalesce(output::text, ''), "                       \
    "coalesce(result::text, ''), feedback, polls, " IA_DEADLINE_MS ", " IA_NEXT_POLL_MS            \
    ", cost_usd, blocked_by, " IA_STARTED_MS ", approval_id FROM " S "actions "
#define IA_SELECT IA_SELECT_INPUT("coalesce(input::text, '')")

/* What a tick reads of a run's actions: the latest (step, lap) of each step of the run's
 * definition, one index probe per step (actions_latest), in creation order. The walk never
 * looks behind a step's latest lap (a loop walks on from its current lap; an earlier lap ended
 * settled, every action in it terminal), and the run state's view of a step is its latest lap
 * (interp__state_put), so this is everything a tick needs, and its cost follows the
 * definition's size, not the run's length. A settled action's input is not read: nothing
 * walks it again (a save leaves a NULL input as stored), and a long run of large steps would
 * otherwise parse every one of them at every tick. */
#define IA_FRONTIER                                                                                \
    "WITH latest AS (SELECT (SELECT x.id FROM " S "actions x WHERE x.run_id = r.id"                \
    " AND x.step_name = s.name ORDER BY x.created_at DESC, x.id DESC LIMIT 1) AS id FROM " S       \
    "runs r, jsonb_object_keys(r.definition->'steps') AS s(name) WHERE r.id = "                    \
    "$1::uuid) " IA_SELECT_INPUT(                                                                  \
        "CASE WHEN status IN ('approved', 'completed', 'skipped', 'rejected', "                    \
        "'failed') THEN '' ELSE coalesce(input::text, '') END") "WHERE run_id = $1::uuid AND id "  \
                                                                "IN (SELECT id FROM latest) "      \
                                                                "ORDER BY created_at, id"

#endif
