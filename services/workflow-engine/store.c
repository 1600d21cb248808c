/* The workflow engine's SQL (store.h): the transactions and their scope, workflows, schedules,
 * audit and logs, runs. The other concepts' statements are in store_actions.c, store_queue.c,
 * store_gates.c and store_approvals.c (store_int.h). */
#include "store_int.h"

const char *st_s(const PGresult *r, int row, int col) {
    return PQgetisnull(r, row, col) ? "" : PQgetvalue(r, row, col);
}
int64_t st_i(const PGresult *r, int row, int col) {
    return PQgetisnull(r, row, col) ? 0 : strtoll(PQgetvalue(r, row, col), NULL, 10);
}
double st_d(const PGresult *r, int row, int col) {
    return PQgetisnull(r, row, col) ? 0 : strtod(PQgetvalue(r, row, col), NULL);
}
int st_b(const PGresult *r, int row, int col) {
    return !PQgetisnull(r, row, col) && PQgetvalue(r, row, col)[0] == 't';
}
int st_null(const PGresult *r, int row, int col) {
    return PQgetisnull(r, row, col);
}

int st_begin(db_pool *p, const char *org_id, const char *member_id, db_tx **out, char *err,
             size_t errlen) {
    return st_begin_ex(p, org_id, member_id, 0, out, err, errlen);
}

int st_begin_ex(db_pool *p, const char *org_id, const char *member_id, int flags, db_tx **out,
                char *err, size_t errlen) {
    int rc = db_tx_begin_ex(p, org_id, flags, out, err, errlen);
    if (rc != DB_OK || !member_id) return rc; /* the interpreter acts for no member */
    const char *pr[] = {member_id};
    rc = ex(*out, "SELECT set_config('app.member_id', $1, true)", 1, pr, NULL, err, errlen);
    if (rc != DB_OK) {
        db_tx_rollback(*out);
        *out = NULL;
    }
    return rc;
}

int st_begin_service(db_pool *p, db_tx **out, char *err, size_t errlen) {
    return st_begin_service_ex(p, 0, out, err, errlen);
}

int st_begin_service_ex(db_pool *p, int flags, db_tx **out, char *err, size_t errlen) {
    int rc = db_tx_begin_ex(p, NULL, flags, out, err, errlen);
    if (rc != DB_OK) return rc;
    rc = ex(*out, "SELECT set_config('app.service', 'on', true)", 0, NULL, NULL, err, errlen);
    if (rc != DB_OK) {
        db_tx_rollback(*out);
        *out = NULL;
    }
    return rc;
}

int st_scope_org(db_tx *tx, const char *org_id, char *err, size_t errlen) {
    const char *pr[] = {org_id};
    return ex(tx, "SELECT set_config('app.org_id', $1, true)", 1, pr, NULL, err, errlen);
}

/* ---- workflows ---- */

/* No roll-ups: the spec has GetWorkflow/ListWorkflows return last_run_status, last_run_at,
 * run_count and avg_cost_usd at their zero values ("ROLLUP — WF-25 computes it; 0 here"). */
#define WF_SELECT                                                                                  \
    "SELECT w.id, w.org_id, w.team_id, w.name, w.description, w.definition::text, w.created_by, "  \
    "       w.status, " MS("w.created_at") ", " MS(                                                \
        "w.deleted_at") ", w.trigger_type, w.enabled, "                                            \
                        "       " MS("w.updated_at") ", w.visibility, "                            \
                                                     "coalesce(w.trigger_config::text, ''), "      \
                                                     "       w.data_classification "               \
                                                     "FROM " S "workflows w "

/* Team workflows are visible org-wide (the spec's "today's universal behaviour"); a private
 * one only to its owner. */
#define WF_VISIBLE "w.deleted_at IS NULL AND (w.visibility = 'team' OR w.created_by = $2::uuid) "

static int wf_by_id(db_tx *tx, const char *id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {id};
    return ex(tx, WF_SELECT "WHERE w.id = $1::uuid", 1, p, out, err, errlen);
}

int st_wf_insert(db_tx *tx, const char *id, const char *org, const char *team, const char *name,
                 const char *desc, const char *def_json, const char *created_by,
                 const char *visibility, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {id, org, nz(team), name, desc ? desc : "", def_json, created_by, visibility};
    int rc = ex(tx,
                "INSERT INTO " S "workflows (id, org_id, team_id, name, description, definition, "
                "created_by, visibility) VALUES ($1, $2, $3, $4, $5, $6::jsonb, $7, $8)",
                8, p, NULL, err, errlen);
    return rc != DB_OK ? rc : wf_by_id(tx, id, out, err, errlen);
}

int st_wf_get(db_tx *tx, const char *id, const char *member, int lock, PGresult **out, char *err,
              size_t errlen) {
    const char *p[] = {id, member};
    return ex(tx,
              lock ? WF_SELECT "WHERE w.id = $1::uuid AND " WF_VISIBLE "FOR UPDATE OF w"
                   : WF_SELECT "WHERE w.id = $1::uuid AND " WF_VISIBLE,
              2, p, out, err, errlen);
}

/* A trigger and a delete of one workflow serialise on a transaction-scoped advisory lock, in a
 * statement of its own so the next statement's snapshot is taken after the wait: a trigger
 * (shared) that wins makes the delete wait for its run, which the delete's run list then has
 * (and tells the bus it left); a delete (exclusive) that wins makes the trigger find nothing.
 * A row lock (FOR SHARE) did the same but made every trigger of a busy workflow write a
 * multixact into its row, which cost the interpreter three quarters of its throughput. */
#define WF_TRIGGER_LOCK(mode)                                                                      \
    "SELECT pg_advisory_xact_lock" mode "(hashtext('workflow_engine.workflow_trigger'), "          \
    "hashtext($1::text))"

int st_wf_def(db_tx *tx, const char *id, const char *member, PGresult **out, char *err,
              size_t errlen) {
    const char *p[] = {id, member};
    int rc = ex(tx, WF_TRIGGER_LOCK("_shared"), 1, p, NULL, err, errlen);
    if (rc != DB_OK) return rc;
    return ex(tx,
              "SELECT w.status, w.definition::text FROM " S "workflows w "
              "WHERE w.id = $1::uuid AND " WF_VISIBLE,
              2, p, out, err, errlen);
}

int st_wf_list(db_tx *tx, const char *member, const char *team, const char *status, int limit,
               int offset, PGresult **out, int *total, char *err, size_t errlen) {
    char l[16], o[16];
    snprintf(l, sizeof l, "%d", limit);
    snprintf(o, sizeof o, "%d", offset);
    const char *p[] = {nz(team), member, nz(status), l, o};
    PGresult *cnt = NULL;
    int rc = ex(tx,
                "SELECT count(*) FROM " S "workflows w WHERE " WF_VISIBLE
                "AND ($1::uuid IS NULL OR w.team_id = $1::uuid) "
                "AND ($3::text IS NULL OR w.status = $3)",
                3, p, &cnt, err, errlen);
    if (rc != DB_OK) return rc;
    *total = (int)st_i(cnt, 0, 0);
    PQclear(cnt);
    return ex(tx,
              WF_SELECT "WHERE " WF_VISIBLE "AND ($1::uuid IS NULL OR w.team_id = $1::uuid) "
                        "AND ($3::text IS NULL OR w.status = $3) "
                        "ORDER BY w.created_at DESC, w.id DESC LIMIT $4::int OFFSET $5::int",
              5, p, out, err, errlen);
}

int st_wf_update_def(db_tx *tx, const char *id, const char *def_json, PGresult **out, char *err,
                     size_t errlen) {
    const char *p[] = {id, def_json};
    int rc = ex(tx, "UPDATE " S "workflows SET definition = $2::jsonb WHERE id = $1::uuid", 2, p,
                NULL, err, errlen);
    return rc != DB_OK ? rc : wf_by_id(tx, id, out, err, errlen);
}

int st_wf_update_status(db_tx *tx, const char *id, const char *status, PGresult **out, char *err,
                        size_t errlen) {
    const char *p[] = {id, status};
    /* archiving also stops the schedule: an archived workflow never fires */
    int rc = ex(tx,
                "UPDATE " S "workflows SET status = $2, "
                "enabled = CASE WHEN $2 = 'archived' THEN false ELSE enabled END "
                "WHERE id = $1::uuid",
                2, p, NULL, err, errlen);
    if (rc == DB_OK && !strcmp(status, "archived")) rc = st_schedule_drop(tx, id, err, errlen);
    return rc != DB_OK ? rc : wf_by_id(tx, id, out, err, errlen);
}

int st_wf_set_trigger(db_tx *tx, const char *id, int enabled, const char *trigger_type,
                      const char *trigger_config, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {id, enabled ? "true" : "false", trigger_type, nz(trigger_config)};
    int rc = ex(tx,
                "UPDATE " S "workflows SET enabled = $2::boolean, trigger_type = $3, "
                "trigger_config = $4::jsonb WHERE id = $1::uuid",
                4, p, NULL, err, errlen);
    return rc != DB_OK ? rc : wf_by_id(tx, id, out, err, errlen);
}

int st_wf_delete(db_tx *tx, const char *id, int *deleted, char *err, size_t errlen) {
    const char *p[] = {id};
    PGresult *r = NULL;
    *deleted = 0;
    int rc = ex(tx, WF_TRIGGER_LOCK(""), 1, p, NULL, err, errlen);
    if (rc != DB_OK) return rc;
    rc = ex(tx,
            "UPDATE " S "workflows SET deleted_at = now(), enabled = false "
            "WHERE id = $1::uuid AND deleted_at IS NULL RETURNING id",
            1, p, &r, err, errlen);
    *deleted = rc == DB_OK && PQntuples(r) == 1;
    PQclear(r);
    return rc;
}

int st_wf_run_ids(db_tx *tx, const char *wf, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {wf};
    /* by id: every deleter locks a workflow's runs in the same order */
    return ex(tx, "SELECT id FROM " S "runs WHERE workflow_id = $1::uuid ORDER BY id FOR UPDATE", 1,
              p, out, err, errlen);
}

int st_wf_row(db_tx *tx, const char *id, PGresult **out, char *err, size_t errlen) {
    return wf_by_id(tx, id, out, err, errlen);
}

/* ---- schedules ---- */

int st_schedule_put(db_tx *tx, const char *wf, const char *org, const char *spec_json,
                    int64_t next_fire_ms, char *err, size_t errlen) {
    char n[32];
    i64s(n, sizeof n, next_fire_ms);
    const char *p[] = {wf, org, spec_json, n};
    return ex(tx,
              "INSERT INTO " S "schedules (workflow_id, org_id, spec, next_fire_at) "
              "VALUES ($1, $2, $3::jsonb, to_timestamp($4::bigint / 1000.0)) "
              "ON CONFLICT (workflow_id) DO UPDATE SET spec = EXCLUDED.spec, "
              "next_fire_at = EXCLUDED.next_fire_at",
              4, p, NULL, err, errlen);
}

int st_schedule_drop(db_tx *tx, const char *wf, char *err, size_t errlen) {
    const char *p[] = {wf};
    return ex(tx, "DELETE FROM " S "schedules WHERE workflow_id = $1::uuid", 1, p, NULL, err,
              errlen);
}

int st_schedule_due(db_tx *tx, PGresult **out, char *err, size_t errlen) {
    return ex(tx,
              "SELECT workflow_id, org_id, spec::text, " MS(
                  "next_fire_at") " FROM " S
                                  "schedules WHERE next_fire_at <= now() ORDER BY next_fire_at "
                                  "LIMIT 1 FOR UPDATE SKIP LOCKED",
              0, NULL, out, err, errlen);
}

int st_schedule_advance(db_tx *tx, const char *wf, int64_t next_fire_ms, char *err, size_t errlen) {
    char n[32];
    i64s(n, sizeof n, next_fire_ms);
    const char *p[] = {wf, n};
    return ex(tx,
              "UPDATE " S "schedules SET next_fire_at = to_timestamp($2::bigint / 1000.0) "
              "WHERE workflow_id = $1::uuid",
              2, p, NULL, err, errlen);
}

int st_firing_insert(db_tx *tx, const char *org, const char *wf, int64_t slot_ms,
                     const char *run_id, int *inserted, char *err, size_t errlen) {
    char n[32];
    i64s(n, sizeof n, slot_ms);
    const char *p[] = {org, wf, n, run_id};
    PGresult *r = NULL;
    int rc = ex(tx,
                "INSERT INTO " S "schedule_firings (org_id, workflow_id, slot, run_id) "
                "VALUES ($1, $2, to_timestamp($3::bigint / 1000.0), $4) "
                "ON CONFLICT DO NOTHING RETURNING 1",
                4, p, &r, err, errlen);
    if (rc == DB_OK) *inserted = PQntuples(r) > 0;
    PQclear(r);
    return rc;
}

int st_cron_next(db_pool *pool, const char *mins, const char *hours, const char *doms,
                 const char *months, const char *dows, int dom_star, int dow_star, const char *tz,
                 int64_t after_ms, int64_t *next_ms, char *err, size_t errlen) {
    char a[32];
    i64s(a, sizeof a, after_ms);
    /* cron's rule: when both day fields are restricted, either may match. */
    const char *p[] = {mins, hours, doms, months, dows, dom_star ? "t" : "f", dow_star ? "t" : "f",
                       tz,   a};
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int rc = db_tx_begin(pool, NULL, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    rc = ex(tx,
            "WITH l AS (SELECT t, t AT TIME ZONE $8 AS lt FROM generate_series("
            "  date_trunc('minute', to_timestamp($9::bigint / 1000.0)) + interval '1 minute', "
            "  to_timestamp($9::bigint / 1000.0) + interval '400 days', interval '1 minute') t) "
            "SELECT " MS("t") " FROM l WHERE extract(minute FROM lt)::int = ANY ($1::int[]) "
                              "AND extract(hour FROM lt)::int = ANY ($2::int[]) "
                              "AND extract(month FROM lt)::int = ANY ($4::int[]) "
                              "AND CASE WHEN $6::boolean OR $7::boolean "
                              "  THEN extract(day FROM lt)::int = ANY ($3::int[]) "
                              "       AND extract(dow FROM lt)::int = ANY ($5::int[]) "
                              "  ELSE extract(day FROM lt)::int = ANY ($3::int[]) "
                              "       OR extract(dow FROM lt)::int = ANY ($5::int[]) END "
                              "ORDER BY t LIMIT 1",
            9, p, &r, err, errlen);
    if (rc == DB_OK) *next_ms = PQntuples(r) ? st_i(r, 0, 0) : -1;
    PQclear(r);
    db_tx_rollback(tx);
    return rc;
}

/* ---- audit and logs ---- */

int st_audit(db_tx *tx, const char *org, const char *member, const char *subject,
             const char *action, const char *reason, char *err, size_t errlen) {
    const char *p[] = {org, nz(member), subject, action, reason ? reason : ""};
    return ex(tx,
              "INSERT INTO " S "audit_log (org_id, member_id, subject_id, action, reason) "
              "VALUES ($1, $2, $3, $4, $5)",
              5, p, NULL, err, errlen);
}

int st_log(db_tx *tx, const char *org, const char *run, const char *action_id, const char *level,
           const char *message, char *err, size_t errlen) {
    const char *p[] = {org, run, nz(action_id), level, message};
    return ex(tx,
              "INSERT INTO " S "run_logs (org_id, run_id, action_id, level, message) "
              "VALUES ($1, $2, $3, $4, $5)",
              5, p, NULL, err, errlen);
}

/* ---- runs ---- */

int st_run_insert(db_tx *tx, const char *id, const char *org, const char *wf,
                  const char *triggered_by, const char *context_json, const char *def_json,
                  const char *trace, char *err, size_t errlen) {
    const char *p[] = {id, org, wf, nz(triggered_by), context_json, def_json, trace ? trace : ""};
    int rc = ex(tx,
                "INSERT INTO " S "runs (id, org_id, workflow_id, triggered_by, context, "
                "definition, trace_id) VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7)",
                7, p, NULL, err, errlen);
    return rc != DB_OK ? rc : st_queue_insert(tx, id, org, err, errlen);
}

int st_org_admission(db_tx *tx, const char *org, long long *active, long long *recent, char *err,
                     size_t errlen) {
    const char *p[] = {org};
    PGresult *r = NULL;
    int rc = ex(tx, "SELECT pg_advisory_xact_lock(hashtext('wf-admit:' || $1))", 1, p, NULL, err,
                errlen);
    if (!rc)
        rc = ex(tx,
                "SELECT (SELECT count(*) FROM " S "runs WHERE org_id = $1 "
                "  AND status IN ('pending', 'running')), "
                "(SELECT count(*) FROM " S "runs WHERE org_id = $1 "
                "  AND started_at > clock_timestamp() - interval '1 second')",
                1, p, &r, err, errlen);
    if (!rc) {
        *active = st_i(r, 0, 0);
        *recent = st_i(r, 0, 1);
    }
    PQclear(r);
    return rc;
}

int st_trigger_key_claim(db_tx *tx, const char *org, const char *key, const char *run_id,
                         const char *wf, const char *context_json, int *claimed, char *prior,
                         int *same, char *err, size_t errlen) {
    const char *p[] = {org, key, run_id};
    PGresult *r = NULL;
    *claimed = *same = 0;
    prior[0] = 0;
    int rc = ex(tx,
                "INSERT INTO " S "trigger_keys (org_id, idem_key, run_id) VALUES ($1, $2, $3) "
                "ON CONFLICT (org_id, idem_key) DO UPDATE SET run_id = EXCLUDED.run_id, "
                "created_at = now() "
                "WHERE " S "trigger_keys.created_at < now() - interval '24 hours' RETURNING 1",
                3, p, &r, err, errlen);
    if (rc) goto done;
    *claimed = PQntuples(r) == 1;
    PQclear(r);
    r = NULL;
    if (*claimed) goto done;
    const char *q[] = {org, key, wf, context_json};
    rc = ex(tx,
            "SELECT k.run_id, (r.workflow_id = $3::uuid AND r.context = $4::jsonb) FROM " S
            "trigger_keys k JOIN " S "runs r ON r.id = k.run_id "
            "WHERE k.org_id = $1 AND k.idem_key = $2",
            4, q, &r, err, errlen);
    if (rc) goto done;
    if (PQntuples(r) == 1) {
        snprintf(prior, 37, "%s", PQgetvalue(r, 0, 0));
        *same = !strcmp(PQgetvalue(r, 0, 1), "t");
    }
done:
    PQclear(r);
    return rc;
}

int st_run_load(db_tx *tx, const char *run_id, int lock, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {run_id};
    return ex(tx, lock ? RL_SELECT " FOR UPDATE OF r" : RL_SELECT, 1, p, out, err, errlen);
}

/* The raw action statuses counted as done (spec WorkflowRun.nodes_done: the ones that fold
 * to done or failed); waits and parks are not. */
#define DONE_STATUSES "('approved', 'completed', 'skipped', 'rejected', 'failed')"

#define RUN_SELECT                                                                                 \
    "SELECT r.id, r.workflow_id, r.org_id, r.triggered_by, r.status, r.context::text, "            \
    "       " MS("r.started_at") ", " MS("r.completed_at") ", " MS(                                \
        "r.created_at") ", "                                                                       \
                        "       r.cost_usd, " MS("r.paused_at") ", " MS(                           \
                            "r.cancelled_at") ", "                                                 \
                                              "       (SELECT count(*) FROM " S                    \
                                              "actions a WHERE a.run_id = r.id), "                 \
                                              "       (SELECT count(*) FROM " S                    \
                                              "actions a WHERE a.run_id = r.id AND a.status "      \
                                              "IN " DONE_STATUSES "), "                            \
                                              "       r.display_name, w.name, "                    \
                                              "       coalesce((SELECT g.kind FROM " S             \
                                              "governance g WHERE g.run_id = r.id "                \
                                              "                 AND g.status = 'pending' ORDER "   \
                                              "BY g.created_at DESC LIMIT 1), ''), "               \
                                              "       (SELECT count(*) FROM " S                    \
                                              "governance g WHERE g.run_id = r.id "                \
                                              "          AND g.status = 'pending'), "              \
                                              "       EXISTS (SELECT 1 FROM " S                    \
                                              "actions a WHERE a.run_id = r.id AND a.status = "    \
                                              "'waiting'), "                                       \
                                              "       (extract(epoch from r.started_at) * "        \
                                              "1000000)::bigint, w.data_classification "           \
                                              "FROM " S "runs r JOIN " S                           \
                                              "workflows w ON w.id = r.workflow_id "

int st_run_row(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {run_id};
    return ex(tx, RUN_SELECT "WHERE r.id = $1::uuid", 1, p, out, err, errlen);
}

int st_run_counts(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {run_id};
    /* the same counts as RUN_SELECT's, without its joins and governance lookups: a run's
     * status change in a tick plans and runs this cheaply */
    return ex(tx,
              "SELECT count(a.id), count(a.id) FILTER (WHERE a.status IN " DONE_STATUSES
              "), r.cost_usd, " MS("r.started_at") ", " MS(
                  "r.completed_at") " FROM " S "runs r LEFT JOIN " S "actions a ON a.run_id = r.id "
                                    "WHERE r.id = $1::uuid GROUP BY r.id",
              1, p, out, err, errlen);
}

int st_run_page(db_tx *tx, const char *wf, const char *member, const char *teams,
                const char *statuses, const char *after_us, const char *after_id, int limit,
                PGresult **out, char *err, size_t errlen) {
    char l[16];
    snprintf(l, sizeof l, "%d", limit + 1);
    const char *p[] = {nz(wf), member, teams ? teams : "{}", statuses, after_us, nz(after_id), l};
    /* across workflows (no $1): only "the runs whose parent workflow the CALLER may see", and a
     * soft-deleted workflow's runs are "UNDISCOVERABLE through the workflow" (spec); by an
     * explicit workflow_id they stay listable, as runs known by id stay readable */
    return ex(tx,
              RUN_SELECT
              "WHERE ($1::uuid IS NULL OR r.workflow_id = $1::uuid) "
              "AND ($1::uuid IS NOT NULL OR (w.deleted_at IS NULL AND ((w.visibility = 'team' "
              "     AND w.team_id = ANY ($3::uuid[])) OR (w.visibility = 'private' "
              "     AND w.created_by = $2::uuid)))) "
              "AND ($4::text[] IS NULL OR r.status = ANY ($4::text[])) "
              "AND ($6::uuid IS NULL OR (r.started_at, r.id) < (" US_TS(
                  "$5") ", $6::uuid)) "
                        "ORDER BY r.started_at DESC, r.id DESC LIMIT $7::int",
              7, p, out, err, errlen);
}

int st_run_set_status(db_tx *tx, const char *run_id, const char *status, const char *reason,
                      char *err, size_t errlen) {
    const char *p[] = {run_id, status, reason ? reason : ""};
    return ex(tx,
              "UPDATE " S "runs SET status = $2, "
              "reason = CASE WHEN $3 = '' THEN reason ELSE $3 END, "
              "completed_at = CASE WHEN $2 IN ('completed', 'failed', 'cancelled') "
              "  THEN coalesce(completed_at, now()) ELSE completed_at END, "
              "paused_at = CASE WHEN $2 = 'paused' THEN now() WHEN $2 = 'running' THEN NULL "
              "  ELSE paused_at END, "
              "cancelled_at = CASE WHEN $2 = 'cancelled' THEN now() ELSE cancelled_at END "
              "WHERE id = $1::uuid",
              3, p, NULL, err, errlen);
}

int st_run_set_seq(db_tx *tx, const char *run_id, int64_t seq, char *err, size_t errlen) {
    char n[32];
    i64s(n, sizeof n, seq);
    const char *p[] = {run_id, n};
    return ex(tx, "UPDATE " S "runs SET event_seq = $2::bigint WHERE id = $1::uuid", 2, p, NULL,
              err, errlen);
}

int st_run_add_cost(db_tx *tx, const char *run_id, double cost, char *err, size_t errlen) {
    char n[64];
    snprintf(n, sizeof n, "%.17g", cost);
    const char *p[] = {run_id, n};
    return ex(tx, "UPDATE " S "runs SET cost_usd = cost_usd + $2::float8 WHERE id = $1::uuid", 2, p,
              NULL, err, errlen);
}

/* ---- a tick's reads, queued for a group's one round trip ---- */

int st_tick_head_send(db_tx *tx, const char *run, const char *owner, int64_t lease_ms,
                      PGresult **run_row, PGresult **fence, PGresult **acts, char *err,
                      size_t errlen) {
    PGconn *c = db_tx_conn(tx);
    char l[32];
    i64s(l, sizeof l, lease_ms);
    const char *pr[] = {run};
    const char *pf[] = {run, owner, l};
    *run_row = *fence = *acts = NULL;
    if (!db_pipe_active(c)) {
        snprintf(err, errlen, "st_tick_head_send: the transaction is not pipelined");
        return DB_EINVAL;
    }
    /* sent in the lock order of every tick: the run row, its queue row, then its actions */
    int rc =
        db_pipe_send(c, RL_SELECT " FOR UPDATE OF r", 1, pr, NULL, NULL, 0, run_row, err, errlen);
    if (rc == DB_OK) rc = db_pipe_send(c, FENCE_SQL, 3, pf, NULL, NULL, 0, fence, err, errlen);
    if (rc == DB_OK) rc = db_pipe_send(c, IA_FRONTIER, 1, pr, NULL, NULL, 0, acts, err, errlen);
    return rc;
}
