/* The SQL of agent sessions' approvals and prompts (store.h; migrations/010_session_approvals.sql):
 * governance rows that belong to a session instead of a run, and their expiry timers. */
#include "store_int.h"

int st_session_gate_open(db_tx *tx, const st_session_gate *g, int *created, char *id_out, char *err,
                         size_t errlen) {
    char c[16], t[32];
    snprintf(c, sizeof c, "%d", g->clearance);
    snprintf(t, sizeof t, "%" PRId64, g->timeout_s);
    const char *p[] = {g->id,
                       g->org,
                       g->session,
                       g->agent,
                       g->kind,
                       g->tool,
                       g->tool_call_id,
                       g->requested_by,
                       g->key,
                       (const char *)g->intent,
                       c,
                       g->spec_json,
                       t};
    int lens[13] = {0}, fmts[13] = {0};
    lens[9] = (int)g->intent_len;
    fmts[9] = 1;
    if (!g->intent_len) p[9] = NULL;
    PGresult *r = NULL;
    *created = 0;
    /* ON CONFLICT names the partial unique index by its columns and predicate */
    int rc =
        db_exec_bin(db_tx_conn(tx),
                    "INSERT INTO " S "governance (id, org_id, session_id, agent_id, kind, tool, "
                    "tool_call_id, requested_by, correlation_key, pending_tool_intent, "
                    "required_clearance, spec, expires_at) VALUES ($1::uuid, $2::uuid, "
                    "$3::uuid, $4::uuid, $5, $6, $7, $8::uuid, $9, $10::bytea, $11::int, "
                    "$12::jsonb, now() + $13::bigint * interval '1 second') "
                    "ON CONFLICT (org_id, session_id, correlation_key) "
                    "WHERE session_id IS NOT NULL DO NOTHING RETURNING id",
                    13, p, lens, fmts, 0, &r, err, errlen);
    if (rc != DB_OK) goto done;
    if (PQntuples(r) == 1) {
        *created = 1;
        snprintf(id_out, 37, "%s", g->id);
        const char *pt[] = {g->id, g->org, t};
        rc = db_exec(db_tx_conn(tx),
                     "INSERT INTO " S "approval_timers (approval_id, org_id, due_at) VALUES "
                     "($1::uuid, $2::uuid, now() + $3::bigint * interval '1 second')",
                     3, pt, NULL, err, errlen);
        goto done;
    }
    PQclear(r);
    r = NULL;
    const char *pk[] = {g->org, g->session, g->key};
    rc = db_exec(db_tx_conn(tx),
                 "SELECT id FROM " S "governance WHERE org_id = $1::uuid AND session_id = $2::uuid "
                 "AND correlation_key = $3",
                 3, pk, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        snprintf(id_out, 37, "%s", PQgetvalue(r, 0, 0));
    } else if (rc == DB_OK) {
        snprintf(err, errlen, "correlation key conflict without a row");
        rc = DB_ERR;
    }
done:
    PQclear(r);
    return rc;
}

int st_session_gate_intent(db_tx *tx, const char *id, uint8_t **out, size_t *len, char *err,
                           size_t errlen) {
    const char *p[] = {id};
    PGresult *r = NULL;
    *out = NULL;
    *len = 0;
    int rc = db_exec_bin(db_tx_conn(tx),
                         "SELECT pending_tool_intent FROM " S "governance WHERE id = $1::uuid", 1,
                         p, NULL, NULL, 1, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1 && !PQgetisnull(r, 0, 0) && PQgetlength(r, 0, 0) > 0) {
        *len = (size_t)PQgetlength(r, 0, 0);
        *out = malloc(*len);
        if (*out) {
            memcpy(*out, PQgetvalue(r, 0, 0), *len);
        } else {
            *len = 0;
            rc = DB_ENOMEM;
        }
    }
    PQclear(r);
    return rc;
}

int st_approval_timer_delete(db_tx *tx, const char *id, char *err, size_t errlen) {
    const char *p[] = {id};
    return db_exec(db_tx_conn(tx), "DELETE FROM " S "approval_timers WHERE approval_id = $1::uuid",
                   1, p, NULL, err, errlen);
}

int st_approval_timer_due(db_tx *tx, int limit, PGresult **out, char *err, size_t errlen) {
    char l[16];
    snprintf(l, sizeof l, "%d", limit);
    const char *p[] = {l};
    return db_exec(db_tx_conn(tx),
                   "SELECT approval_id, org_id FROM " S "approval_timers WHERE due_at <= now() "
                   "ORDER BY due_at LIMIT $1::int",
                   1, p, out, err, errlen);
}
