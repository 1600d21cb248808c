/* The workflow engine's SQL of human gates (store.h; gates.c; migration 002_gates.sql): the
 * governance rows of runs and sessions as the ApprovalService reads and decides them. */
#include "store_int.h"

int st_pending_gates(db_tx *tx, int64_t *n, double *oldest_s, char *err, size_t errlen) {
    PGresult *r = NULL;
    int rc = ex(tx,
                "SELECT count(*), coalesce(extract(epoch FROM now() - min(created_at)), 0)::float8"
                " FROM " S "pending_gates",
                0, NULL, &r, err, errlen);
    if (rc == DB_OK) {
        *n = st_i(r, 0, 0);
        *oldest_s = st_d(r, 0, 1);
    }
    PQclear(r);
    return rc;
}

/* ==== human gates (gates.c; migration 002_gates.sql) ==== */

/* timestamps in milliseconds (MS), one column per line */
// clang-format off
#define GT_SELECT                                                                                  \
    "SELECT g.id, g.org_id, coalesce(g.run_id::text, ''), coalesce(g.action_id::text, ''), "       \
    "       g.kind, g.status, g.required_clearance, "                                              \
    "       g.spec::text, " MS("g.created_at") ", " MS("g.expires_at") ", "                        \
    "       coalesce(g.decided_by, ''), " MS("g.decided_at") ", coalesce(g.answer::text, ''), "    \
    "       g.comment, g.escalations, "                                                            \
    "       coalesce(r.triggered_by::text, g.requested_by::text, ''), "                            \
    "       " MS("a.deadline_at") ", coalesce(a.status, ''), coalesce(a.output::text, ''), "       \
    "       coalesce(r.definition->'steps'->(g.spec->>'asked_by')->>'agent_role', ''), "           \
    "       coalesce((SELECT x.agent_id FROM " S "actions x WHERE x.run_id = g.run_id "            \
    "                 AND x.step_name = g.spec->>'asked_by' ORDER BY x.created_at DESC "           \
    "                 LIMIT 1), g.agent_id::text, ''), coalesce(w.name, ''), "                     \
    "       array_to_json(g.approvers)::text, coalesce(g.session_id::text, ''), "                  \
    "       coalesce(g.agent_id::text, ''), coalesce(g.tool, ''), coalesce(g.tool_call_id, ''), "  \
    "       coalesce(g.correlation_key, ''), "                                                     \
    "       (g.expires_at IS NOT NULL AND g.expires_at <= now()) "                                 \
    "FROM " S "governance g LEFT JOIN " S "actions a ON a.id = g.action_id "                       \
    "LEFT JOIN " S "runs r ON r.id = g.run_id LEFT JOIN " S "workflows w ON w.id = r.workflow_id "
// clang-format on

int st_gate_get(db_tx *tx, const char *id, int by_action, int lock, PGresult **out, char *err,
                size_t errlen) {
    const char *p[] = {id};
    /* a session's row has no action: its id is its action's (ListPendingApprovals) */
#define GT_BY_ACTION                                                                               \
    GT_SELECT "WHERE (g.action_id = $1::uuid OR (g.session_id IS NOT NULL AND g.id = $1::uuid)) "  \
              "ORDER BY g.created_at DESC LIMIT 1"
    const char *sql = by_action ? (lock ? GT_BY_ACTION " FOR UPDATE OF g" : GT_BY_ACTION)
                                : (lock ? GT_SELECT "WHERE g.id = $1::uuid FOR UPDATE OF g"
                                        : GT_SELECT "WHERE g.id = $1::uuid");
    return ex(tx, sql, 1, p, out, err, errlen);
}

int st_gate_decide(db_tx *tx, const char *id, const char *status, const char *member,
                   const char *answer_json, const char *comment, int *won, char *err,
                   size_t errlen) {
    const char *p[] = {id, status, member, answer_json, comment ? comment : ""};
    PGresult *r = NULL;
    /* first write wins: only a pending row moves */
    int rc = ex(tx,
                "UPDATE " S "governance SET status = $2, decided_by = $3, decided_at = now(), "
                "answer = $4::jsonb, comment = $5 WHERE id = $1::uuid AND status = 'pending' "
                "RETURNING 1",
                5, p, &r, err, errlen);
    if (rc == DB_OK) *won = PQntuples(r) > 0;
    PQclear(r);
    return rc;
}

int st_gate_escalate(db_tx *tx, const char *id, int floor, const char *comment, char *err,
                     size_t errlen) {
    char f[16];
    snprintf(f, sizeof f, "%d", floor);
    const char *p[] = {id, f, comment ? comment : ""};
    return ex(tx,
              "UPDATE " S "governance SET required_clearance = $2::int, escalations = "
              "escalations + 1, comment = $3 WHERE id = $1::uuid AND status = 'pending'",
              3, p, NULL, err, errlen);
}

int st_gate_escalate_by(db_tx *tx, const char *id, int step, int cap, const char *comment,
                        int *floor, char *err, size_t errlen) {
    char s[16], c[16];
    snprintf(s, sizeof s, "%d", step);
    snprintf(c, sizeof c, "%d", cap);
    const char *p[] = {id, s, c, comment ? comment : ""};
    PGresult *r = NULL;
    int rc = ex(tx,
                "UPDATE " S "governance SET required_clearance = LEAST(required_clearance + "
                "$2::int, $3::int), escalations = escalations + 1, comment = $4 "
                "WHERE id = $1::uuid AND status = 'pending' RETURNING required_clearance",
                4, p, &r, err, errlen);
    *floor = rc == DB_OK && PQntuples(r) > 0 ? (int)st_i(r, 0, 0) : 0;
    PQclear(r);
    return rc;
}

int st_action_decided(db_tx *tx, const char *action_id, const char *member, char *err,
                      size_t errlen) {
    const char *p[] = {action_id, member};
    return ex(tx,
              "UPDATE " S "actions SET decided_by = $2::uuid, decided_at = now() "
              "WHERE id = $1::uuid",
              2, p, NULL, err, errlen);
}

int st_actions_by_ids(db_tx *tx, const char *ids, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {ids};
    return ex(tx, AC_SELECT "WHERE a.id = ANY ($1::uuid[]) ORDER BY a.created_at, a.id", 1, p, out,
              err, errlen);
}

int st_gate_pending(db_tx *tx, const char *member, int clearance, const char *agent, int limit,
                    int offset, PGresult **out, char *err, size_t errlen) {
    char c[16], l[16], o[16];
    snprintf(c, sizeof c, "%d", clearance);
    snprintf(l, sizeof l, "%d", limit);
    snprintf(o, sizeof o, "%d", offset);
    const char *p[] = {member, c, agent ? agent : "", l, o};
    /* only what this caller may decide: a visible run, the floor cleared, the answer scope met;
     * a soft-deleted workflow's runs are "UNDISCOVERABLE" (spec), so their gates are not listed
     * here (they stay answerable by id). A session's rows (run_id NULL) are listed beside them
     * under the same floor and answer scope (answerable_by "requester": the asking member),
     * until their expiry. */
    return ex(tx,
              "WITH p AS ("
              "SELECT a.id, w.name, g.created_at, g.id AS gid, false AS session "
              "FROM " S "governance g "
              "JOIN " S "actions a ON a.id = g.action_id JOIN " S "runs r ON r.id = g.run_id "
              "JOIN " S "workflows w ON w.id = r.workflow_id "
              "WHERE g.status = 'pending' AND a.status IN ('awaiting_approval', 'escalated') "
              "AND w.deleted_at IS NULL "
              "AND (w.visibility = 'team' OR w.created_by = $1::uuid) "
              "AND g.required_clearance <= $2::int "
              "AND (coalesce(g.spec->>'answerable_by', '') <> 'requester' "
              "     OR r.triggered_by = $1::uuid) "
              "AND ($3 = '' OR a.agent_id = $3) "
              "UNION ALL "
              "SELECT g.id, '', g.created_at, g.id, true FROM " S "governance g "
              "WHERE g.session_id IS NOT NULL AND g.status = 'pending' "
              "AND (g.expires_at IS NULL OR g.expires_at > now()) "
              "AND g.required_clearance <= $2::int "
              "AND (coalesce(g.spec->>'answerable_by', '') <> 'requester' "
              "     OR g.requested_by = $1::uuid) "
              "AND ($3 = '' OR g.agent_id::text = $3)) "
              "SELECT id, name, count(*) OVER (), session FROM p "
              "ORDER BY created_at, gid LIMIT $4::int OFFSET $5::int",
              5, p, out, err, errlen);
}

int st_gate_get_many(db_tx *tx, const char *ids, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {ids};
    return ex(tx, GT_SELECT "WHERE g.id = ANY ($1::uuid[])", 1, p, out, err, errlen);
}

int st_gate_vote(db_tx *tx, const char *id, const char *member, int *added, char *err,
                 size_t errlen) {
    const char *p[] = {id, member};
    PGresult *r = NULL;
    /* a member counts once; only a pending row takes votes */
    int rc = ex(tx,
                "UPDATE " S "governance SET approvers = approvers || $2::text WHERE id = $1::uuid "
                "AND status = 'pending' AND NOT ($2::text = ANY (approvers)) RETURNING 1",
                2, p, &r, err, errlen);
    if (rc == DB_OK) *added = PQntuples(r) > 0;
    PQclear(r);
    return rc;
}

int st_action_brief(db_tx *tx, const char *action_id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {action_id};
    return ex(tx, "SELECT run_id, status FROM " S "actions WHERE id = $1::uuid", 1, p, out, err,
              errlen);
}
