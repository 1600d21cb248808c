/* The workflow engine's SQL (store.h). Tables are schema-qualified: no reliance on the role's
 * search_path. */
#include "store.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

#define S "workflow_engine."
#define MS(x) "(extract(epoch from " x ") * 1000)::bigint"
#define US_TS(p) "(timestamptz 'epoch' + (" p ")::bigint * interval '1 microsecond')"

static int ex(db_tx *tx, const char *sql, int n, const char *const *p, PGresult **out, char *err,
              size_t errlen) {
    return db_exec(db_tx_conn(tx), sql, n, p, out, err, errlen);
}

static const char *nz(const char *s) {
    return s && s[0] ? s : NULL;
}

static void i64s(char *buf, size_t n, int64_t v) {
    snprintf(buf, n, "%" PRId64, v);
}

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

#define RL_SELECT                                                                                  \
    "SELECT r.id, r.org_id, r.workflow_id, r.triggered_by, r.status, r.context::text, "            \
    "r.definition::text, r.display_name, r.event_seq, r.cost_usd, " MS("r.started_at") ", " MS(    \
        "r.completed_at") ", w.name, w.team_id, w.visibility, w.created_by, "                      \
                          "w.data_classification, w.deleted_at IS NOT NULL, r.trace_id, "          \
                          "r.actions_count FROM " S "runs r JOIN " S                               \
                          "workflows w ON w.id = r.workflow_id WHERE r.id = $1::uuid"

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

/* ---- actions ---- */

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

int st_actions_of(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {run_id};
    return ex(tx, AC_SELECT "WHERE a.run_id = $1::uuid ORDER BY a.created_at, a.iteration, a.id", 1,
              p, out, err, errlen);
}

int st_action_get(db_tx *tx, const char *run_id, const char *action_id, PGresult **out, char *err,
                  size_t errlen) {
    const char *p[] = {run_id, action_id};
    return ex(tx, AC_SELECT "WHERE a.run_id = $1::uuid AND a.id = $2::uuid", 2, p, out, err,
              errlen);
}

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

int st_actions_load(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {run_id};
    return ex(tx, IA_FRONTIER, 1, p, out, err, errlen);
}

static void ms_or_null(char *buf, size_t n, int64_t ms, const char **slot) {
    if (ms > 0) {
        i64s(buf, n, ms);
        *slot = buf;
    } else {
        *slot = NULL;
    }
}

int st_action_insert(db_tx *tx, const st_action_w *a, char *err, size_t errlen) {
    char it[16], at[16], dl[32], np[32];
    snprintf(it, sizeof it, "%d", a->iteration);
    snprintf(at, sizeof at, "%d", a->attempt);
    const char *p[16];
    p[0] = a->id, p[1] = a->org, p[2] = a->run, p[3] = a->step, p[4] = a->type, p[5] = a->lap;
    p[6] = it, p[7] = a->status, p[8] = at, p[9] = nz(a->key), p[10] = nz(a->input);
    p[11] = a->blocked_by ? a->blocked_by : "", p[12] = nz(a->approval_id);
    ms_or_null(dl, sizeof dl, a->deadline_ms, &p[13]);
    ms_or_null(np, sizeof np, a->next_poll_ms, &p[14]);
    p[15] = nz(a->output);
    /* the run's action count (the run budget) follows in the same statement: the tick holds
     * the run row locked */
    return ex(tx,
              "WITH i AS (INSERT INTO " S
              "actions (id, org_id, run_id, step_name, step_type, lap_key, "
              "iteration, status, attempt, idempotency_key, input, blocked_by, approval_id, "
              "deadline_at, next_poll_at, output, started_at, finished_at) VALUES ($1, $2, $3, "
              "$4, $5, $6, $7::int, $8, $9::int, $10, $11::jsonb, $12, $13::uuid, "
              "to_timestamp($14::bigint / 1000.0), to_timestamp($15::bigint / 1000.0), "
              "$16::jsonb, "
              "CASE WHEN $8 IN ('pending', 'skipped') THEN NULL ELSE clock_timestamp() END, "
              "CASE WHEN $8 IN ('completed', 'skipped', 'failed') THEN clock_timestamp() END) "
              "RETURNING run_id) UPDATE " S "runs SET actions_count = actions_count + 1 "
              "WHERE id = (SELECT run_id FROM i)",
              16, p, NULL, err, errlen);
}

int st_action_update(db_tx *tx, const st_action_w *a, char *err, size_t errlen) {
    char at[16], pl[16], dl[32], np[32], cost[64], ti[32], to[32];
    snprintf(at, sizeof at, "%d", a->attempt);
    snprintf(pl, sizeof pl, "%d", a->polls);
    snprintf(cost, sizeof cost, "%.17g", a->add_cost);
    i64s(ti, sizeof ti, a->add_in_tokens);
    i64s(to, sizeof to, a->add_out_tokens);
    const char *p[18];
    p[0] = a->id, p[1] = a->status, p[2] = at, p[3] = nz(a->key), p[4] = nz(a->input);
    p[5] = nz(a->output), p[6] = a->feedback ? a->feedback : "";
    p[7] = a->blocked_by ? a->blocked_by : "", p[8] = nz(a->approval_id);
    p[9] = pl;
    ms_or_null(dl, sizeof dl, a->deadline_ms, &p[10]);
    ms_or_null(np, sizeof np, a->next_poll_ms, &p[11]);
    p[12] = a->clear_result ? "t" : "f", p[13] = a->started ? "t" : "f";
    p[14] = a->finished ? "t" : "f", p[15] = cost, p[16] = ti, p[17] = to;
    int rc = ex(tx,
                "UPDATE " S "actions SET status = $2, attempt = $3::int, idempotency_key = $4, "
                "input = coalesce($5::jsonb, input), output = coalesce($6::jsonb, output), "
                "feedback = $7, blocked_by = $8, approval_id = coalesce($9::uuid, approval_id), "
                "polls = $10::int, deadline_at = to_timestamp($11::bigint / 1000.0), "
                "next_poll_at = to_timestamp($12::bigint / 1000.0), "
                "result = CASE WHEN $13::boolean THEN NULL ELSE result END, "
                "started_at = CASE WHEN $14::boolean THEN coalesce(started_at, "
                "  clock_timestamp()) ELSE started_at END, "
                "finished_at = CASE WHEN $15::boolean THEN clock_timestamp() ELSE finished_at END, "
                "cost_usd = cost_usd + $16::float8, input_tokens = input_tokens + $17::bigint, "
                "output_tokens = output_tokens + $18::bigint, "
                "agent_id = CASE WHEN $19 = '' THEN agent_id ELSE $19 END "
                "WHERE id = $1::uuid",
                19,
                (const char *const[]){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7], p[8], p[9],
                                      p[10], p[11], p[12], p[13], p[14], p[15], p[16], p[17],
                                      a->agent_id ? a->agent_id : ""},
                NULL, err, errlen);
    return rc;
}

int st_action_put_result(db_tx *tx, const char *action_id, const char *key, const char *result_json,
                         int *applied, char *err, size_t errlen) {
    const char *p[] = {action_id, key, result_json};
    PGresult *r = NULL;
    int rc =
        ex(tx,
           "UPDATE " S "actions SET result = $3::jsonb WHERE id = $1::uuid "
           "AND idempotency_key = $2 AND status IN ('in_progress', 'waiting') AND result IS NULL "
           "RETURNING run_id",
           3, p, &r, err, errlen);
    if (rc == DB_OK) *applied = PQntuples(r) > 0;
    PQclear(r);
    return rc;
}

int st_governance_insert(db_tx *tx, const char *id, const char *org, const char *run,
                         const char *action, const char *kind, int clearance, const char *spec_json,
                         char *err, size_t errlen) {
    char c[16];
    snprintf(c, sizeof c, "%d", clearance);
    const char *p[] = {id, org, run, action, kind, c, spec_json};
    return ex(tx,
              "INSERT INTO " S "governance (id, org_id, run_id, action_id, kind, "
              "required_clearance, spec, expires_at) VALUES ($1, $2, $3, $4, $5, $6::int, "
              "$7::jsonb, now() + interval '24 hours')",
              7, p, NULL, err, errlen);
}

int st_governance_expire(db_tx *tx, const char *id, char *err, size_t errlen) {
    const char *p[] = {id};
    return ex(tx,
              "UPDATE " S "governance SET status = 'expired' WHERE id = $1::uuid "
              "AND status = 'pending'",
              1, p, NULL, err, errlen);
}

int st_governance_close(db_tx *tx, const char *run, char *err, size_t errlen) {
    const char *p[] = {run};
    return ex(tx,
              "UPDATE " S "governance SET status = 'closed' WHERE run_id = $1::uuid "
              "AND status = 'pending'",
              1, p, NULL, err, errlen);
}

/* ---- external events ---- */

int st_delivery_insert(db_tx *tx, const char *org, const char *run, const char *key,
                       const char *delivery, const char *payload_json, int *inserted, char *err,
                       size_t errlen) {
    const char *p[] = {org, run, key, delivery, payload_json};
    PGresult *r = NULL;
    int rc = ex(tx,
                "INSERT INTO " S "event_deliveries (org_id, run_id, event_key, delivery_id, "
                "payload) VALUES ($1, $2, $3, $4, $5::jsonb) ON CONFLICT DO NOTHING RETURNING 1",
                5, p, &r, err, errlen);
    if (rc == DB_OK) *inserted = PQntuples(r) > 0;
    PQclear(r);
    return rc;
}

int st_delivery_take(db_tx *tx, const char *run, const char *key, const char *action_id,
                     char **payload, char *err, size_t errlen) {
    const char *p[] = {run, key, action_id};
    PGresult *r = NULL;
    *payload = NULL;
    int rc = ex(tx,
                "UPDATE " S "event_deliveries d SET consumed_by = $3::uuid "
                "WHERE (d.org_id, d.run_id, d.event_key, d.delivery_id) = ("
                "  SELECT org_id, run_id, event_key, delivery_id FROM " S "event_deliveries "
                "  WHERE run_id = $1::uuid AND event_key = $2 AND consumed_by IS NULL "
                "  ORDER BY received_at LIMIT 1 FOR UPDATE) "
                "RETURNING d.payload::text",
                3, p, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) > 0) *payload = strdup(st_s(r, 0, 0));
    PQclear(r);
    return rc;
}

/* ---- run queue ---- */

int st_queue_insert(db_tx *tx, const char *run, const char *org, char *err, size_t errlen) {
    const char *p[] = {run, org};
    return ex(tx,
              "INSERT INTO " S "run_queue (run_id, org_id, wake_at) VALUES ($1, $2, now()) "
              "ON CONFLICT (run_id) DO UPDATE SET wake_at = now(), "
              "wake_gen = " S "run_queue.wake_gen + 1",
              2, p, NULL, err, errlen);
}

int st_queue_wake(db_tx *tx, const char *run, char *err, size_t errlen) {
    const char *p[] = {run};
    return ex(tx,
              "UPDATE " S "run_queue SET wake_at = now(), wake_gen = wake_gen + 1 "
              "WHERE run_id = $1::uuid",
              1, p, NULL, err, errlen);
}

int st_queue_delete(db_tx *tx, const char *run, char *err, size_t errlen) {
    const char *p[] = {run};
    return ex(tx, "DELETE FROM " S "run_queue WHERE run_id = $1::uuid", 1, p, NULL, err, errlen);
}

int st_queue_claim(db_tx *tx, const char *owner, int64_t lease_ms, int limit, PGresult **out,
                   char *err, size_t errlen) {
    char l[32], n[16];
    i64s(l, sizeof l, lease_ms);
    snprintf(n, sizeof n, "%d", limit);
    const char *p[] = {owner, l, n};
    /* Fair across orgs: a due run's turn is its org's runs already leased plus its place
     * among the org's due runs, so the org with the least in flight goes first and a flood
     * of one org's runs queues behind its own, not behind every other org's (FIFO by wake_at
     * within a turn). The lease conditions are repeated on the locked row: a concurrent claim
     * may have leased it since the snapshot. */
    return ex(tx,
              "WITH busy AS (SELECT org_id, count(*) AS n FROM " S "run_queue "
              "  WHERE lease_until >= clock_timestamp() GROUP BY org_id), "
              "ranked AS (SELECT d.run_id, d.wake_at, coalesce(b.n, 0) + row_number() "
              "  OVER (PARTITION BY d.org_id ORDER BY d.wake_at) AS turn FROM " S "run_queue d "
              "  LEFT JOIN busy b ON b.org_id = d.org_id WHERE d.wake_at <= now() "
              "  AND (d.lease_until IS NULL OR d.lease_until < clock_timestamp())) "
              "UPDATE " S "run_queue q SET lease_owner = $1, "
              "lease_until = clock_timestamp() + $2::bigint * interval '1 millisecond' "
              "WHERE q.run_id IN (SELECT r.run_id FROM ranked k JOIN " S "run_queue r "
              "  ON r.run_id = k.run_id WHERE r.wake_at <= now() "
              "  AND (r.lease_until IS NULL OR r.lease_until < clock_timestamp()) "
              "  ORDER BY k.turn, k.wake_at LIMIT $3::int FOR UPDATE OF r SKIP LOCKED) "
              "RETURNING q.run_id, q.org_id, q.wake_gen",
              3, p, out, err, errlen);
}

#define FENCE_SQL                                                                                  \
    "UPDATE " S "run_queue SET lease_until = clock_timestamp() + $3::bigint * "                    \
    "interval '1 millisecond' WHERE run_id = $1::uuid AND lease_owner = $2 "                       \
    "AND lease_until > clock_timestamp() RETURNING 1"

int st_queue_fence(db_tx *tx, const char *run, const char *owner, int64_t lease_ms, int *held,
                   char *err, size_t errlen) {
    char l[32];
    i64s(l, sizeof l, lease_ms);
    const char *p[] = {run, owner, l};
    PGresult *r = NULL;
    int rc = ex(tx, FENCE_SQL, 3, p, &r, err, errlen);
    if (rc == DB_OK) *held = PQntuples(r) > 0;
    PQclear(r);
    return rc;
}

int st_queue_release(db_tx *tx, const char *run, const char *owner, int64_t gen, int64_t wake_ms,
                     char *err, size_t errlen) {
    char g[32], w[32];
    i64s(g, sizeof g, gen);
    const char *ws = NULL;
    ms_or_null(w, sizeof w, wake_ms, &ws);
    const char *p[] = {run, owner, g, ws};
    return ex(tx,
              "UPDATE " S "run_queue SET lease_owner = NULL, lease_until = NULL, "
              "wake_at = CASE WHEN wake_gen <> $3::bigint THEN now() "
              "  ELSE to_timestamp($4::bigint / 1000.0) END "
              "WHERE run_id = $1::uuid AND lease_owner = $2",
              4, p, NULL, err, errlen);
}

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

/* ---- outbox ---- */

int st_outbox_put(db_tx *tx, const char *org, const char *subject, const char *msg_id,
                  const void *payload, size_t len, const char *trace, char *err, size_t errlen) {
    const char *p[] = {org, subject, msg_id, payload, trace ? trace : ""};
    int lens[] = {0, 0, 0, (int)len, 0};
    int fmts[] = {0, 0, 0, 1, 0};
    return db_exec_bin(db_tx_conn(tx),
                       "INSERT INTO " S "outbox (org_id, subject, msg_id, payload, trace_id) "
                       "VALUES ($1, $2, $3, $4::bytea, left($5, 64))",
                       5, p, lens, fmts, 0, NULL, err, errlen);
}

int st_events_put(db_tx *tx, const char *org, const char *run, int64_t seq, const char *subjects,
                  const char *msg_ids, const char *payloads_hex, const char *trace, char *err,
                  size_t errlen) {
    char n[32];
    i64s(n, sizeof n, seq);
    const char *p[] = {org, run, n, subjects, msg_ids, payloads_hex, trace ? trace : ""};
    return ex(tx,
              "WITH s AS (UPDATE " S "runs SET event_seq = $3::bigint WHERE id = $2::uuid) "
              "INSERT INTO " S "outbox (org_id, subject, msg_id, payload, trace_id) "
              "SELECT $1::uuid, e.subject, e.msg_id, decode(e.hex, 'hex'), left($7, 64) "
              "FROM unnest($4::text[], $5::text[], $6::text[]) AS e(subject, msg_id, hex)",
              7, p, NULL, err, errlen);
}

int st_outbox_fetch(db_tx *tx, int limit, int *locked, PGresult **out, char *err, size_t errlen) {
    PGresult *r = NULL, *rows = NULL;
    PGconn *c = db_tx_conn(tx);
    char l[16];
    snprintf(l, sizeof l, "%d", limit);
    const char *p[] = {l};
    const int fmts[] = {0};
    *out = NULL;
    *locked = 0;
    /* One relay at a time keeps each run's events in outbox (seq) order on the bus. */
#define RELAY_LOCK "pg_try_advisory_xact_lock(hashtext('workflow_engine.outbox_relay'))"
    const char *lock = "SELECT " RELAY_LOCK;
    /* The outbox is a queue: nearly empty when vacuumed, thousands of dead rows a few seconds
     * later. A plan made while it looked empty (a sequential scan and a sort, cached for the
     * connection) then reads every dead row of the heap each round, and the delete by ids was
     * planned afresh each round for the same reason: in the relay's transaction the fetch and
     * the delete always walk the primary key, with plans kept per connection. */
    const char *plan = "SELECT set_config('enable_seqscan', 'off', true), "
                       "set_config('plan_cache_mode', 'force_generic_plan', true)";
    /* pipelined, the fetch is sent with the lock attempt before its answer is known: it
     * takes the lock again (re-entrant for the holder; evaluated once), so a replica without
     * the lock reads no rows, not a batch of payloads it would throw away */
    /* age_ms: how long the row has waited, for the lag gauge (the oldest row comes first) */
    const char *fetch = "SELECT id, subject, msg_id, payload, trace_id, "
                        "(extract(epoch FROM clock_timestamp() - created_at) * 1000)::int8 "
                        "FROM " S "outbox "
                        "WHERE (SELECT " RELAY_LOCK ") ORDER BY id LIMIT $1::int";
#undef RELAY_LOCK
    if (db_pipe_active(c)) { /* all behind one sync; the rows count only under the lock */
        int rc = db_pipe_send(c, lock, 0, NULL, NULL, NULL, 0, &r, err, errlen);
        if (rc == DB_OK) rc = db_pipe_send(c, plan, 0, NULL, NULL, NULL, 0, NULL, err, errlen);
        if (rc == DB_OK) rc = db_pipe_send(c, fetch, 1, p, NULL, fmts, 1, &rows, err, errlen);
        if (rc == DB_OK) rc = db_pipe_flush(c, err, errlen);
        if (rc == DB_OK && (*locked = st_b(r, 0, 0))) {
            *out = rows;
            rows = NULL;
        }
        PQclear(r);
        PQclear(rows);
        return rc;
    }
    int rc = ex(tx, lock, 0, NULL, &r, err, errlen);
    if (rc != DB_OK) return rc;
    *locked = st_b(r, 0, 0);
    PQclear(r);
    if (!*locked) return DB_OK;
    if ((rc = ex(tx, plan, 0, NULL, NULL, err, errlen)) != DB_OK) return rc;
    return db_exec_bin(c, fetch, 1, p, NULL, NULL, 1, out, err, errlen);
}

int st_outbox_delete(db_tx *tx, const char *ids, char *err, size_t errlen) {
    const char *p[] = {ids};
    return ex(tx, "DELETE FROM " S "outbox WHERE id = ANY ($1::bigint[])", 1, p, NULL, err, errlen);
}

int st_wf_row(db_tx *tx, const char *id, PGresult **out, char *err, size_t errlen) {
    return wf_by_id(tx, id, out, err, errlen);
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

/* ---- agent step bookkeeping ---- */

void st_agent_state_clear(st_agent_state *s) {
    free(s->checkpoint);
    free(s->answer);
    memset(s, 0, sizeof *s);
}

/* An int4 column of a binary-format result (network byte order). */
static int bin_int4(const PGresult *r, int row, int col) {
    const unsigned char *v = (const unsigned char *)PQgetvalue(r, row, col);
    return (int)((uint32_t)v[0] << 24 | (uint32_t)v[1] << 16 | (uint32_t)v[2] << 8 | v[3]);
}

int st_agent_state_get(db_tx *tx, const char *action_id, st_agent_state *out, char *err,
                       size_t errlen) {
    PGresult *r = NULL;
    const char *p[] = {action_id};
    memset(out, 0, sizeof *out);
    /* binary results: the checkpoint's bytes as they are (the counters as int4) */
    int rc = db_exec_bin(db_tx_conn(tx),
                         "SELECT retries, resumes, tool_call_id, checkpoint, answer, gated FROM " S
                         "agent_steps WHERE action_id = $1::uuid",
                         1, p, NULL, NULL, 1, &r, err, errlen);
    if (rc != DB_OK || PQntuples(r) == 0) goto done;
    out->retries = bin_int4(r, 0, 0);
    out->resumes = bin_int4(r, 0, 1);
    int n = PQgetlength(r, 0, 2);
    if (n >= (int)sizeof out->tool_call_id) n = (int)sizeof out->tool_call_id - 1;
    memcpy(out->tool_call_id, PQgetvalue(r, 0, 2), (size_t)n);
    out->tool_call_id[n] = 0;
    if (!PQgetisnull(r, 0, 3)) {
        out->checkpoint_len = (size_t)PQgetlength(r, 0, 3);
        out->checkpoint = malloc(out->checkpoint_len ? out->checkpoint_len : 1);
        if (!out->checkpoint)
            rc = DB_ENOMEM;
        else
            memcpy(out->checkpoint, PQgetvalue(r, 0, 3), out->checkpoint_len);
    }
    if (rc == DB_OK && !PQgetisnull(r, 0, 4)) {
        out->answer = strndup(PQgetvalue(r, 0, 4), (size_t)PQgetlength(r, 0, 4));
        if (!out->answer) rc = DB_ENOMEM;
    }
    out->gated = PQgetvalue(r, 0, 5)[0] != 0; /* binary bool: one byte */
done:
    PQclear(r);
    if (rc != DB_OK) st_agent_state_clear(out);
    return rc;
}

int st_agent_retry_take(db_tx *tx, const char *org, const char *run, const char *action_id, int max,
                        int *taken, char *err, size_t errlen) {
    PGresult *r = NULL;
    char m[16];
    snprintf(m, sizeof m, "%d", max);
    const char *p[] = {action_id, org, run, m};
    *taken = 0;
    int rc = ex(tx,
                "INSERT INTO " S "agent_steps AS a (action_id, org_id, run_id, retries) "
                "SELECT $1::uuid, $2::uuid, $3::uuid, 1 WHERE $4::int > 0 "
                "ON CONFLICT (action_id) DO UPDATE SET retries = a.retries + 1 "
                "WHERE a.retries < $4::int RETURNING retries",
                4, p, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) *taken = (int)st_i(r, 0, 0);
    PQclear(r);
    return rc;
}

int st_agent_ask_put(db_tx *tx, const char *org, const char *run, const char *action_id,
                     const char *tool_call_id, const uint8_t *checkpoint, size_t len, int gated,
                     char *err, size_t errlen) {
    const char *p[] = {
        action_id, org, run, tool_call_id, (const char *)checkpoint, gated ? "true" : "false"};
    int lens[] = {0, 0, 0, 0, (int)len, 0};
    int fmts[] = {0, 0, 0, 0, 1, 0};
    return db_exec_bin(db_tx_conn(tx),
                       "INSERT INTO " S "agent_steps AS a (action_id, org_id, run_id, "
                       "tool_call_id, checkpoint, gated) VALUES ($1::uuid, $2::uuid, $3::uuid, "
                       "$4, $5::bytea, $6::boolean) ON CONFLICT (action_id) DO UPDATE SET "
                       "tool_call_id = $4, checkpoint = $5::bytea, answer = NULL, gated = $6",
                       6, p, lens, fmts, 0, NULL, err, errlen);
}

int st_agent_resume_put(db_tx *tx, const char *org, const char *run, const char *action_id,
                        const char *answer_json, char *err, size_t errlen) {
    const char *p[] = {action_id, org, run, answer_json};
    return ex(tx,
              "INSERT INTO " S "agent_steps AS a (action_id, org_id, run_id, resumes, answer) "
              "VALUES ($1::uuid, $2::uuid, $3::uuid, 1, $4) ON CONFLICT (action_id) DO UPDATE "
              "SET resumes = a.resumes + 1, answer = $4",
              4, p, NULL, err, errlen);
}

int st_agent_ask_clear(db_tx *tx, const char *action_id, char *err, size_t errlen) {
    const char *p[] = {action_id};
    return ex(tx,
              "UPDATE " S "agent_steps SET checkpoint = NULL, answer = NULL, gated = false "
              "WHERE action_id = $1::uuid AND (checkpoint IS NOT NULL OR answer IS NOT NULL)",
              1, p, NULL, err, errlen);
}

/* ---- a tick's reads in one round trip ---- */

int st_tick_head(db_tx *tx, const char *run, const char *owner, int64_t lease_ms,
                 PGresult **run_row, int *held, PGresult **acts, char *err, size_t errlen) {
    PGconn *c = db_tx_conn(tx);
    PGresult *fence = NULL;
    char l[32];
    i64s(l, sizeof l, lease_ms);
    const char *pr[] = {run};
    const char *pf[] = {run, owner, l};
    *run_row = *acts = NULL;
    *held = 0;
    if (!db_pipe_active(c)) { /* not pipelined: the same three statements one by one */
        int rc = st_run_load(tx, run, 1, run_row, err, errlen);
        if (rc == DB_OK) rc = st_queue_fence(tx, run, owner, lease_ms, held, err, errlen);
        if (rc == DB_OK) rc = st_actions_load(tx, run, acts, err, errlen);
        return rc;
    }
    /* sent in the lock order of every tick: the run row, its queue row, then its actions */
    int rc =
        db_pipe_send(c, RL_SELECT " FOR UPDATE OF r", 1, pr, NULL, NULL, 0, run_row, err, errlen);
    if (rc == DB_OK) rc = db_pipe_send(c, FENCE_SQL, 3, pf, NULL, NULL, 0, &fence, err, errlen);
    if (rc == DB_OK) rc = db_pipe_send(c, IA_FRONTIER, 1, pr, NULL, NULL, 0, acts, err, errlen);
    if (rc == DB_OK) rc = db_pipe_flush(c, err, errlen);
    if (rc == DB_OK) *held = PQntuples(fence) > 0;
    PQclear(fence);
    return rc;
}
