/* The workflow engine's SQL of a run's actions (store.h): the actions a tick walks and writes,
 * the governance rows its gates open, the external events delivered to its waits, and the
 * agent steps' bookkeeping (migrations/004_agent_steps.sql). */
#include "store_int.h"

/* ---- actions ---- */

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

int st_actions_load(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen) {
    const char *p[] = {run_id};
    return ex(tx, IA_FRONTIER, 1, p, out, err, errlen);
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
