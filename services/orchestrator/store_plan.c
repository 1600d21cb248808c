/* The orchestrator's SQL: the autonomous loop's plan (store.h; migration 009_plans.sql). */
#include "store_int.h"

void orch_plan_clear(orch_plan *pl) {
    free(pl->goal);
    free(pl->todos);
    memset(pl, 0, sizeof *pl);
}

int orch_store_plan_get(db_pool *p, const char *org, const char *session_id, orch_plan *out,
                        char *err, size_t errlen) {
    PGresult *r = NULL;
    memset(out, 0, sizeof *out);
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT goal, todos::text, cursor, cycles, stall, last_hash, state, reason,"
                 " coalesce(gate_id::text, '')"
                 " FROM session_plans WHERE session_id = $1::uuid",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        out->goal = strdup(PQgetvalue(r, 0, 0));
        out->todos = strdup(PQgetvalue(r, 0, 1));
        out->cursor = atoi(PQgetvalue(r, 0, 2));
        out->cycles = atoi(PQgetvalue(r, 0, 3));
        out->stall = atoi(PQgetvalue(r, 0, 4));
        copy(out->last_hash, sizeof out->last_hash, PQgetvalue(r, 0, 5));
        out->ended = !strcmp(PQgetvalue(r, 0, 6), "ended");
        copy(out->reason, sizeof out->reason, PQgetvalue(r, 0, 7));
        copy(out->gate, sizeof out->gate, PQgetvalue(r, 0, 8));
        if (!out->goal || !out->todos) rc = DB_ENOMEM;
    }
    PQclear(r);
    rc = tx_end(tx, rc, err, errlen);
    if (rc != DB_OK) orch_plan_clear(out);
    return rc;
}

int orch_store_plan_save(db_pool *p, const char *org, const char *session_id, const orch_plan *pl,
                         int loop_count, const char *audit_type, const char *agent,
                         const char *parent, const char *detail, char *err, size_t errlen) {
    char cur[16], cyc[16], st[16], lc[16];
    snprintf(cur, sizeof cur, "%d", pl->cursor);
    snprintf(cyc, sizeof cyc, "%d", pl->cycles);
    snprintf(st, sizeof st, "%d", pl->stall);
    snprintf(lc, sizeof lc, "%d", loop_count);
    TX_BEGIN(org);
    const char *v[] = {session_id, pl->goal, pl->todos,     cur,
                       cyc,        st,       pl->last_hash, pl->ended ? "ended" : "running",
                       pl->reason, pl->gate};
    rc =
        db_exec(c,
                "INSERT INTO session_plans (session_id, org_id, goal, todos, cursor, cycles, stall,"
                " last_hash, state, reason, gate_id)"
                " VALUES ($1::uuid, current_org(), $2, $3::jsonb, $4::int, $5::int, $6::int, $7,"
                "  $8, $9, nullif($10, '')::uuid)"
                " ON CONFLICT (session_id) DO UPDATE SET goal = $2, todos = $3::jsonb,"
                "  cursor = $4::int, cycles = $5::int, stall = $6::int, last_hash = $7,"
                "  state = $8, reason = $9, gate_id = nullif($10, '')::uuid, updated_at = now()",
                10, v, NULL, err, errlen);
    /* GetSession's loop_count follows the cycles as they run (spec: "the number of
     * think-act-observe iterations completed") */
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE sessions SET loop_count = greatest(loop_count, $2::int)"
                     " WHERE session_id = $1::uuid",
                     2, (const char *[]){session_id, lc}, NULL, err, errlen);
    if (rc == DB_OK && audit_type)
        rc = orch_store__audit_tx(c, session_id, audit_type, agent, parent, detail, NULL, err,
                                  errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_plan_busy(db_pool *p, const char *org, const char *session_id, const char *mine,
                         int64_t ttl_ms, int *busy, char *err, size_t errlen) {
    PGresult *r = NULL;
    char ttl[32];
    *busy = 0;
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_ms);
    TX_BEGIN(org);
    /* another turn of the session whose lease is alive (a stale one is being reclaimed) */
    rc = db_exec(c,
                 "SELECT count(*) FROM turn_leases WHERE session_id = $1::uuid"
                 " AND action_id <> $3::uuid"
                 " AND renewed_at >= now() - $2::bigint * interval '1 millisecond'",
                 3, (const char *[]){session_id, ttl, mine}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) *busy = atoi(PQgetvalue(r, 0, 0)) > 0;
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}
