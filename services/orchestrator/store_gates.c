/* The orchestrator's SQL: chat sessions parked on a human (store.h; docs/orchestrator.md,
 * "Approvals and prompts on the chat path"; migration 008_session_gates.sql). */
#include "store_int.h"

#include <cjson/cJSON.h>

int orch_store_gate_record(db_pool *p, const char *org, const char *session_id,
                           const orch_gate_row *g, char *err, size_t errlen) {
    char cl[16];
    snprintf(cl, sizeof cl, "%d", g->clearance);
    TX_BEGIN(org);
    /* the gated turn's message: the newest user turn carrying it (its turn began it) */
    const int lens[] = {0, 0, 0, 0, 0, 0, 0, (int)g->frozen_len, 0};
    const int fmts[] = {0, 0, 0, 0, 0, 0, 0, 1, 0};
    const char *vals[] = {
        g->approval_id,  session_id, g->kind, g->tool,
        g->tool_call_id, g->message, cl,      g->frozen_len ? (const char *)g->frozen : NULL,
        g->holder};
    PGresult *r = NULL;
    rc = db_exec_bin(c,
                     "INSERT INTO session_gates (approval_id, session_id, org_id, kind, tool,"
                     " tool_call_id, message_turn, clearance, frozen, stream_holder)"
                     " SELECT $1::uuid, $2::uuid, current_org(), $3, $4, $5,"
                     "  coalesce((SELECT max(turn_no) FROM turns WHERE session_id = $2::uuid"
                     "            AND role = 1 AND text = $6),"
                     "           (SELECT max(turn_no) FROM turns WHERE session_id = $2::uuid"
                     "            AND role = 1)),"
                     "  $7::int, $8, left($9, 160)"
                     " ON CONFLICT (approval_id) DO NOTHING",
                     9, vals, lens, fmts, 0, &r, err, errlen);
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_gate_unhold(db_pool *p, const char *org, const char *session_id, const char *holder,
                           char *err, size_t errlen) {
    TX_BEGIN(org);
    rc = db_exec(c,
                 "UPDATE session_gates SET stream_holder = NULL"
                 " WHERE session_id = $1::uuid AND stream_holder = left($2, 160)",
                 2, (const char *[]){session_id, holder}, NULL, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_gate_decided(db_pool *p, const char *org, const char *approval_id,
                            const char *decision_json, int *where, char holder[161],
                            char session_id[37], char *err, size_t errlen) {
    PGresult *r = NULL;
    *where = ORCH_GATE_UNKNOWN;
    holder[0] = session_id[0] = 0;
    TX_BEGIN(org);
    /* first write wins: a redelivery keeps the decision that arrived first */
    rc = db_exec(c,
                 "UPDATE session_gates g SET decision = coalesce(g.decision, $2::jsonb)"
                 " FROM sessions s WHERE g.approval_id = $1::uuid AND s.session_id = g.session_id"
                 " RETURNING g.session_id, coalesce(g.stream_holder, ''), g.taken_at IS NOT NULL,"
                 "  s.state, s.pause_correlation_id = g.approval_id::text",
                 2, (const char *[]){approval_id, decision_json}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        const char *state = PQgetvalue(r, 0, 3);
        copy(session_id, 37, PQgetvalue(r, 0, 0));
        copy(holder, 161, PQgetvalue(r, 0, 1));
        if (PQgetvalue(r, 0, 2)[0] == 't' || terminal(state))
            *where = ORCH_GATE_DONE;
        else if (!strcmp(state, "suspended") && PQgetvalue(r, 0, 4)[0] == 't')
            *where = ORCH_GATE_PARKED;
        else
            *where = ORCH_GATE_EARLY; /* the turn that opened it has not parked yet */
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

void orch_gate_take_clear(orch_gate_take *t) {
    free(t->message);
    free(t->decision);
    if (t->frozen) PQfreemem(t->frozen);
    orch_turns_free(t->turns, t->nturns);
    memset(t, 0, sizeof *t);
}

/* The take's reads, the session row and the gate locked: ORCH_ESTATE unless the session is
 * parked on this gate, the decision arrived and no resume took it yet. */
static int take_read_tx(PGconn *c, const char *approval_id, orch_gate_take *out, int *turn,
                        char *err, size_t errlen) {
    PGresult *r = NULL;
    int rc =
        db_exec(c,
                "SELECT g.session_id, s.agent_id, g.kind, g.tool, g.tool_call_id, g.message_turn,"
                "  g.decision::text, g.frozen, t.text"
                " FROM session_gates g JOIN sessions s ON s.session_id = g.session_id"
                " LEFT JOIN turns t ON t.session_id = g.session_id AND t.turn_no = g.message_turn"
                " WHERE g.approval_id = $1::uuid AND g.taken_at IS NULL AND g.decision IS NOT NULL"
                "  AND s.state = 'suspended' AND s.pause_correlation_id = g.approval_id::text"
                " FOR UPDATE OF g, s",
                1, (const char *[]){approval_id}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ESTATE;
    if (rc == DB_OK) {
        copy(out->approval_id, sizeof out->approval_id, approval_id);
        copy(out->session_id, sizeof out->session_id, PQgetvalue(r, 0, 0));
        copy(out->agent_id, sizeof out->agent_id, PQgetvalue(r, 0, 1));
        copy(out->kind, sizeof out->kind, PQgetvalue(r, 0, 2));
        copy(out->tool, sizeof out->tool, PQgetvalue(r, 0, 3));
        copy(out->tool_call_id, sizeof out->tool_call_id, PQgetvalue(r, 0, 4));
        *turn = atoi(PQgetvalue(r, 0, 5));
        out->decision = strdup(PQgetvalue(r, 0, 6));
        out->message = strdup(PQgetvalue(r, 0, 8));
        /* bytea in the text format (hex), NULL (no frozen turn) as "" */
        out->frozen = PQunescapeBytea((const unsigned char *)PQgetvalue(r, 0, 7), &out->frozen_len);
        if (!out->decision || !out->message || !out->frozen) rc = DB_ENOMEM;
    }
    PQclear(r);
    return rc;
}

int orch_store_gate_take(db_pool *p, const char *org, const char *approval_id, int max_turns,
                         size_t max_bytes, int64_t timeout_ms, const char *owner,
                         orch_gate_take *out, char *err, size_t errlen) {
    PGresult *r = NULL;
    char key[64] = "", tmo[32], loop[16];
    int turn = 0;
    memset(out, 0, sizeof *out);
    snprintf(tmo, sizeof tmo, "%lld", (long long)(timeout_ms > 0 ? timeout_ms : 1));
    TX_BEGIN(org);
    rc = take_read_tx(c, approval_id, out, &turn, err, errlen);
    if (rc == DB_OK)
        rc = orch_store__prior_turns_tx(c, out->session_id, turn, max_turns, max_bytes, &out->turns,
                                        &out->nturns, err, errlen);
    if (rc == DB_OK)
        rc = orch_store__latest_checkpoint_tx(c, out->session_id, key, &out->resumed_loop, err,
                                              errlen);
    snprintf(loop, sizeof loop, "%d", out->resumed_loop);
    /* the park lifts and the turn counts in flight again, as a turn's beginning does; the
     * gate's taken_at and the session's resumed_at are one value (the waiting stream tells a
     * resume by this approval by it) */
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE sessions SET state = 'active', agent_status = 1,"
                     " paused_at = NULL, pause_pending = false,"
                     " resumed_at = date_trunc('milliseconds', now()), resumed_at_loop = $2::int,"
                     " turns_running = CASE WHEN turn_deadline IS NULL OR turn_deadline < now()"
                     "                      THEN 1 ELSE turns_running + 1 END,"
                     " turn_deadline = greatest(coalesce(turn_deadline, now()),"
                     "                          now() + $3::bigint * interval '1 millisecond')"
                     " WHERE session_id = $1::uuid"
                     " RETURNING floor(extract(epoch FROM resumed_at) * 1000)::bigint",
                     3, (const char *[]){out->session_id, loop, tmo}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) out->resumed_ms = to_ms(PQgetvalue(r, 0, 0));
    PQclear(r);
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE session_gates SET taken_at = s.resumed_at, frozen = NULL,"
                     " stream_holder = NULL FROM sessions s"
                     " WHERE approval_id = $1::uuid AND s.session_id = session_gates.session_id",
                     1, &approval_id, NULL, err, errlen);
    if (rc == DB_OK) {
        char *detail = NULL;
        cJSON *d = cJSON_CreateObject(), *dec = cJSON_Parse(out->decision);
        cJSON_AddStringToObject(d, "reason", "resumed by the approval's decision");
        cJSON_AddStringToObject(d, "approval_id", approval_id);
        cJSON_AddStringToObject(d, "kind", out->kind);
        cJSON_AddStringToObject(d, "status",
                                cJSON_GetStringValue(cJSON_GetObjectItem(dec, "status"))
                                    ? cJSON_GetStringValue(cJSON_GetObjectItem(dec, "status"))
                                    : "");
        cJSON_AddNumberToObject(d, "resumed_at_loop", out->resumed_loop);
        cJSON_AddStringToObject(d, "checkpoint_key", key);
        detail = cJSON_PrintUnformatted(d);
        cJSON_Delete(d);
        cJSON_Delete(dec);
        rc = detail ? orch_store__audit_tx(c, out->session_id, "session_resumed", out->agent_id,
                                           NULL, detail, out->action_id, err, errlen)
                    : DB_ENOMEM;
        free(detail);
    }
    /* the resumed turn's lease is named by its session_resumed row */
    if (rc == DB_OK)
        rc = orch_store__lease_tx(c, out->action_id, out->session_id, owner, err, errlen);
    rc = tx_end(tx, rc, err, errlen);
    if (rc != DB_OK) orch_gate_take_clear(out);
    return rc;
}

int orch_store_park_look(db_pool *p, const char *org, const char *session_id, orch_park_look *out,
                         char *err, size_t errlen) {
    PGresult *r = NULL;
    memset(out, 0, sizeof *out);
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT s.state, coalesce(floor(extract(epoch FROM s.resumed_at) * 1000)"
                 "::bigint, 0), s.resumed_at_loop,"
                 " coalesce((SELECT g.approval_id::text FROM session_gates g"
                 "  WHERE g.session_id = s.session_id AND s.state = 'suspended'"
                 "  AND g.approval_id::text = s.pause_correlation_id"
                 "  AND g.decision IS NOT NULL AND g.taken_at IS NULL), ''),"
                 " coalesce((SELECT g.approval_id::text FROM session_gates g"
                 "  WHERE g.session_id = s.session_id AND g.taken_at = s.resumed_at"
                 "  LIMIT 1), '')"
                 " FROM sessions s WHERE s.session_id = $1::uuid",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        copy(out->state, sizeof out->state, PQgetvalue(r, 0, 0));
        out->resumed_ms = to_ms(PQgetvalue(r, 0, 1));
        out->resumed_loop = atoi(PQgetvalue(r, 0, 2));
        copy(out->ready_gate, sizeof out->ready_gate, PQgetvalue(r, 0, 3));
        copy(out->resumed_by, sizeof out->resumed_by, PQgetvalue(r, 0, 4));
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_checkpoint_since(db_pool *p, const char *org, const char *session_id,
                                int64_t since_ms, char key[64], char *err, size_t errlen) {
    PGresult *r = NULL;
    char since[32];
    key[0] = 0;
    snprintf(since, sizeof since, "%lld", (long long)since_ms);
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT loop_iteration FROM checkpoints WHERE session_id = $1::uuid"
                 " AND created_at >= to_timestamp($2::bigint / 1000.0)"
                 " ORDER BY loop_iteration DESC LIMIT 1",
                 2, (const char *[]){session_id, since}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1)
        snprintf(key, 64, "%s:%s", session_id, PQgetvalue(r, 0, 0));
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}
