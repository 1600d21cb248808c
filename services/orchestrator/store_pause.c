/* The orchestrator's SQL: pause, resume and provenance (store.h). */
#include "store_int.h"

/* ---- pause, resume, provenance ---- */

/* the newest checkpoint of a session: its key "<session_id>:<loop_iteration>" and iteration
 * ("" and 0 when it has none) */
int orch_store__latest_checkpoint_tx(PGconn *c, const char *session_id, char key[64], int *loop,
                                     char *err, size_t errlen) {
    PGresult *r = NULL;
    key[0] = 0;
    *loop = 0;
    int rc = db_exec(c,
                     "SELECT loop_iteration FROM checkpoints WHERE session_id = $1::uuid"
                     " ORDER BY loop_iteration DESC LIMIT 1",
                     1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        *loop = atoi(PQgetvalue(r, 0, 0));
        snprintf(key, 64, "%s:%d", session_id, *loop);
    }
    PQclear(r);
    return rc;
}

static const char *source_name(int source) {
    static const char *names[] = {"PAUSE_SOURCE_UNSPECIFIED", "PAUSE_SOURCE_OPERATOR",
                                  "PAUSE_SOURCE_APPROVAL",    "PAUSE_SOURCE_POLICY",
                                  "PAUSE_SOURCE_DELEGATION",  "PAUSE_SOURCE_DELEGATION_APPROVAL"};
    return source >= 0 && source <= 5 ? names[source] : "PAUSE_SOURCE_UNSPECIFIED";
}

/* Commits a pause on the locked session row: suspended, AgentStatus SUSPENDED (the previous
 * status kept for the resume), the newest checkpoint's key, audit session_paused. pz: reason,
 * source and correlation id in; checkpoint key and time out. */
int orch_store__pause_commit_tx(PGconn *c, const char *session_id, const char *agent,
                                const char *parent, orch_pause *pz, char *err, size_t errlen) {
    PGresult *r = NULL;
    char src[16], loopbuf[16];
    int loop = 0;
    int rc =
        orch_store__latest_checkpoint_tx(c, session_id, pz->checkpoint_key, &loop, err, errlen);
    snprintf(src, sizeof src, "%d", pz->source);
    if (rc == DB_OK) {
        const char *v[] = {session_id, pz->reason, src, pz->correlation_id, pz->checkpoint_key};
        rc = db_exec(c,
                     "UPDATE sessions SET state = 'suspended', pre_pause_status = agent_status,"
                     " agent_status = 5, paused_at = now(), pause_pending = false,"
                     " pause_reason = $2, pause_source = $3::int, pause_correlation_id = $4,"
                     " pause_checkpoint_key = $5, turns_running = 0, turn_deadline = NULL"
                     " WHERE session_id = $1::uuid"
                     " RETURNING floor(extract(epoch FROM paused_at) * 1000)::bigint",
                     5, v, &r, err, errlen);
        if (rc == DB_OK && PQntuples(r) == 1) pz->paused_ms = to_ms(PQgetvalue(r, 0, 0));
        PQclear(r);
    }
    if (rc != DB_OK) return rc;
    char *reason = orch_store__json_str(pz->reason, 1024),
         *corr = orch_store__json_str(pz->correlation_id, 256);
    char *detail = NULL;
    snprintf(loopbuf, sizeof loopbuf, "%d", loop);
    if (!reason || !corr ||
        asprintf(&detail,
                 "{\"reason\":%s,\"pause_source\":\"%s\",\"correlation_id\":%s,"
                 "\"checkpoint_key\":\"%s\"}",
                 reason, source_name(pz->source), corr, pz->checkpoint_key) < 0) {
        detail = NULL;
        rc = DB_ENOMEM;
    }
    if (rc == DB_OK)
        rc = orch_store__audit_tx(c, session_id, "session_paused", agent, parent, detail, NULL, err,
                                  errlen);
    free(reason);
    free(corr);
    free(detail);
    return rc;
}

int orch_store_pause(db_pool *p, const char *org, const char *session_id, const char *reason,
                     int source, const char *correlation_id, int *outcome, orch_pause *out,
                     char *state_out, char *err, size_t errlen) {
    PGresult *r = NULL;
    memset(out, 0, sizeof *out);
    *outcome = ORCH_PAUSE_PENDING;
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT state, kind, agent_id, pause_pending,"
                 "  turns_running > 0 AND turn_deadline > now(),"
                 "  pause_reason, pause_source, pause_correlation_id, pause_checkpoint_key,"
                 "  coalesce(floor(extract(epoch FROM paused_at) * 1000)::bigint, 0)"
                 " FROM sessions WHERE session_id = $1::uuid FOR UPDATE",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    char agent[37] = "";
    int pending = 0, in_flight = 0;
    if (rc == DB_OK) {
        copy(state_out, 16, PQgetvalue(r, 0, 0));
        copy(agent, sizeof agent, PQgetvalue(r, 0, 2));
        pending = PQgetvalue(r, 0, 3)[0] == 't';
        in_flight = PQgetvalue(r, 0, 4)[0] == 't';
        if (!strcmp(state_out, "suspended")) {
            *outcome = ORCH_PAUSE_ALREADY;
            copy(out->reason, sizeof out->reason, PQgetvalue(r, 0, 5));
            out->source = atoi(PQgetvalue(r, 0, 6));
            copy(out->correlation_id, sizeof out->correlation_id, PQgetvalue(r, 0, 7));
            copy(out->checkpoint_key, sizeof out->checkpoint_key, PQgetvalue(r, 0, 8));
            out->paused_ms = to_ms(PQgetvalue(r, 0, 9));
        } else if (strcmp(state_out, "active")) {
            rc = ORCH_ESTATE;
        } else if (!strcmp(PQgetvalue(r, 0, 1), "step")) {
            copy(state_out, 16, "step"); /* a workflow step's session: its run is paused */
            rc = ORCH_ESTATE;
        } else if (pending) {
            /* the first request's reason, source and correlation id stand */
            copy(out->reason, sizeof out->reason, PQgetvalue(r, 0, 5));
            out->source = atoi(PQgetvalue(r, 0, 6));
            copy(out->correlation_id, sizeof out->correlation_id, PQgetvalue(r, 0, 7));
        } else {
            copy(out->reason, sizeof out->reason, reason);
            out->source = source;
            copy(out->correlation_id, sizeof out->correlation_id, correlation_id);
        }
    }
    PQclear(r);
    if (rc == DB_OK && *outcome == ORCH_PAUSE_PENDING) {
        if (!in_flight) {
            /* at a boundary now (or the turn counted in flight is past its bound: its replica
             * is gone) */
            rc = orch_store__pause_commit_tx(c, session_id, agent, NULL, out, err, errlen);
            if (rc == DB_OK) *outcome = ORCH_PAUSED;
        } else if (!pending) {
            char src[16];
            snprintf(src, sizeof src, "%d", source);
            const char *v[] = {session_id, reason, src, correlation_id};
            rc = db_exec(c,
                         "UPDATE sessions SET pause_pending = true, pause_reason = $2,"
                         " pause_source = $3::int, pause_correlation_id = $4"
                         " WHERE session_id = $1::uuid",
                         4, v, NULL, err, errlen);
        }
    }
    return tx_end(tx, rc, err, errlen);
}

/* Inside the caller's transaction: ORCH_EGATED with the approval id when a suspended session
 * waits on a human gate of its own: parked (PauseSource APPROVAL or DELEGATION_APPROVAL) on the
 * approval or prompt its turn opened (session_gates, or the interrupt_required audit row that
 * names it), so a governed tool call stays governed. A pause a caller asked for with PauseSession
 * (an approval engine pausing under an approval of its own) is that caller's to resume. */
static int resume_gate_tx(PGconn *c, const char *session_id, char gate[65], char *err,
                          size_t errlen) {
    PGresult *r = NULL;
    gate[0] = 0;
    int rc = db_exec(c,
                     "SELECT s.pause_correlation_id FROM sessions s"
                     " WHERE s.session_id = $1::uuid AND s.state = 'suspended'"
                     " AND s.pause_source IN (2, 5) AND (EXISTS (SELECT 1 FROM session_gates g"
                     "  WHERE g.session_id = s.session_id"
                     "  AND g.approval_id::text = s.pause_correlation_id)"
                     " OR EXISTS (SELECT 1 FROM audit_log a"
                     "  WHERE a.session_id = s.session_id AND a.action_type = 'interrupt_required'"
                     "  AND a.detail->>'approval_id' = s.pause_correlation_id))",
                     1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        copy(gate, 65, PQgetvalue(r, 0, 0));
        rc = ORCH_EGATED;
    }
    PQclear(r);
    return rc;
}

int orch_store_resume_gate(db_pool *p, const char *org, const char *session_id, char gate[65],
                           char *err, size_t errlen) {
    TX_BEGIN(org);
    rc = resume_gate_tx(c, session_id, gate, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_park_state(db_pool *p, const char *org, const char *session_id, char *state,
                          int64_t *resumed_ms, int *resumed_loop, char *err, size_t errlen) {
    PGresult *r = NULL;
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT state, coalesce(floor(extract(epoch FROM resumed_at) * 1000)::bigint, 0),"
                 " resumed_at_loop FROM sessions WHERE session_id = $1::uuid",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        copy(state, 16, PQgetvalue(r, 0, 0));
        *resumed_ms = to_ms(PQgetvalue(r, 0, 1));
        *resumed_loop = atoi(PQgetvalue(r, 0, 2));
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_pause_pending(db_pool *p, const char *org, const char *session_id, int *pending,
                             int *ended, char *err, size_t errlen) {
    PGresult *r = NULL;
    *pending = 0;
    if (ended) *ended = 0;
    TX_BEGIN(org);
    rc = db_exec(c, "SELECT pause_pending, state FROM sessions WHERE session_id = $1::uuid", 1,
                 &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        *pending = PQgetvalue(r, 0, 0)[0] == 't';
        if (ended) *ended = terminal(PQgetvalue(r, 0, 1));
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_resume(db_pool *p, const char *org, const char *session_id, const char *reason,
                      const char *operator_input, orch_resume *out, char *state_out, char *err,
                      size_t errlen) {
    PGresult *r = NULL;
    char key[64] = "", agent[37] = "";
    int turns = 0;
    memset(out, 0, sizeof *out);
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT state, agent_id, turns FROM sessions WHERE session_id = $1::uuid"
                 " FOR UPDATE",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        copy(state_out, 16, PQgetvalue(r, 0, 0));
        copy(agent, sizeof agent, PQgetvalue(r, 0, 1));
        turns = atoi(PQgetvalue(r, 0, 2));
        if (strcmp(state_out, "suspended")) rc = ORCH_ESTATE;
    }
    PQclear(r);
    r = NULL;
    /* re-checked under the row lock: a park may have changed since the caller looked */
    if (rc == DB_OK) rc = resume_gate_tx(c, session_id, out->gate, err, errlen);
    if (rc == DB_OK)
        rc = orch_store__latest_checkpoint_tx(c, session_id, key, &out->resumed_at_loop, err,
                                              errlen);
    if (rc == DB_OK) {
        char loop[16];
        snprintf(loop, sizeof loop, "%d", out->resumed_at_loop);
        /* resumed_at at millisecond precision: what ResumeSession answers and the waiting
         * stream's SessionResumedEvent repeats (orch_store_park_state) are one value */
        rc =
            db_exec(c,
                    "UPDATE sessions SET state = 'active', agent_status = pre_pause_status,"
                    " paused_at = NULL, pause_pending = false,"
                    " resumed_at = date_trunc('milliseconds', now()), resumed_at_loop = $2::int"
                    " WHERE session_id = $1::uuid"
                    " RETURNING agent_status, floor(extract(epoch FROM resumed_at) * 1000)::bigint",
                    2, (const char *[]){session_id, loop}, &r, err, errlen);
        if (rc == DB_OK && PQntuples(r) == 1) {
            out->agent_status = atoi(PQgetvalue(r, 0, 0));
            out->resumed_ms = to_ms(PQgetvalue(r, 0, 1));
        }
        PQclear(r);
    }
    /* operator_input: a system-tagged turn, so the next turn's prior_turns carry it */
    if (rc == DB_OK && operator_input && operator_input[0]) {
        char no[16], *text = NULL;
        snprintf(no, sizeof no, "%d", turns + 1);
        if (asprintf(&text, "[system] operator_input: %s", operator_input) < 0) {
            text = NULL;
            rc = DB_ENOMEM;
        }
        if (rc == DB_OK)
            rc = db_exec(c,
                         "INSERT INTO turns (session_id, turn_no, org_id, role, text)"
                         " VALUES ($1, $2, current_org(), 1, $3)",
                         3, (const char *[]){session_id, no, text}, NULL, err, errlen);
        if (rc == DB_OK)
            rc = db_exec(c, "UPDATE sessions SET turns = turns + 1 WHERE session_id = $1::uuid", 1,
                         &session_id, NULL, err, errlen);
        free(text);
    }
    if (rc == DB_OK) {
        char *why = orch_store__json_str(reason, 1024), *detail = NULL;
        if (!why || asprintf(&detail,
                             "{\"reason\":%s,\"resumed_at_loop\":%d,\"checkpoint_key\":\"%s\","
                             "\"operator_input_bytes\":%zu}",
                             why, out->resumed_at_loop, key,
                             operator_input ? strlen(operator_input) : 0) < 0) {
            detail = NULL;
            rc = DB_ENOMEM;
        }
        if (rc == DB_OK)
            rc = orch_store__audit_tx(c, session_id, "session_resumed", agent, NULL, detail, NULL,
                                      err, errlen);
        free(why);
        free(detail);
    }
    return tx_end(tx, rc, err, errlen);
}

/* A row verifies when its hash recomputes from its fields (orch_store__audit_tx's formula) and its
 * prev_hash is the hash of the session's previous row (64 zeros for the first). */
#define AUDIT_VERIFIED                                                                             \
    "coalesce(a.hash = encode(sha256(convert_to(concat_ws('|', a.prev_hash, a.seq::text,"          \
    "  a.action_id::text, a.action_type, coalesce(a.parent_action_id::text, ''),"                  \
    "  a.detail::text), 'UTF8')), 'hex')"                                                          \
    " AND a.prev_hash = CASE WHEN a.seq = 1 THEN '" ZERO_HASH "'"                                  \
    "   ELSE (SELECT b.hash FROM audit_log b WHERE b.session_id = a.session_id"                    \
    "         AND b.seq = a.seq - 1) END, false)"

int orch_store_audit_chain(db_pool *p, const char *org, const char *session_id,
                           const char *action_id, size_t max, orch_audit_link *out, size_t *n,
                           char *err, size_t errlen) {
    PGresult *r = NULL;
    char lim[16];
    *n = 0;
    snprintf(lim, sizeof lim, "%zu", max);
    TX_BEGIN(org);
    /* the walk stays in the session, and the depth bound ends a cycle (never written: a
     * parent is always an earlier row) */
    rc = db_exec(c,
                 "WITH RECURSIVE walk (action_id, depth) AS ("
                 "  SELECT action_id, 1 FROM audit_log"
                 "   WHERE session_id = $1::uuid AND action_id = $2::uuid"
                 "  UNION ALL"
                 "  SELECT x.parent_action_id, w.depth + 1 FROM walk w"
                 "    JOIN audit_log x ON x.action_id = w.action_id"
                 "    JOIN audit_log y ON y.action_id = x.parent_action_id"
                 "                    AND y.session_id = $1::uuid"
                 "   WHERE w.depth < $3::int)"
                 " SELECT a.action_id, a.session_id, coalesce(a.agent_id::text, ''),"
                 "  coalesce(a.parent_action_id::text, ''), a.action_type,"
                 "  floor(extract(epoch FROM a.created_at) * 1000)::bigint, " AUDIT_VERIFIED
                 " FROM walk w JOIN audit_log a ON a.action_id = w.action_id ORDER BY w.depth",
                 3, (const char *[]){session_id, action_id, lim}, &r, err, errlen);
    for (int i = 0; rc == DB_OK && i < PQntuples(r) && (size_t)i < max; i++) {
        orch_audit_link *l = &out[i];
        memset(l, 0, sizeof *l);
        copy(l->action_id, sizeof l->action_id, PQgetvalue(r, i, 0));
        copy(l->session_id, sizeof l->session_id, PQgetvalue(r, i, 1));
        copy(l->agent_id, sizeof l->agent_id, PQgetvalue(r, i, 2));
        copy(l->parent_action_id, sizeof l->parent_action_id, PQgetvalue(r, i, 3));
        copy(l->action_type, sizeof l->action_type, PQgetvalue(r, i, 4));
        l->created_ms = to_ms(PQgetvalue(r, i, 5));
        l->verified = PQgetvalue(r, i, 6)[0] == 't';
        (*n)++;
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_audit_anchor(db_pool *p, const char *org, const char *session_id, char parent[37],
                            char anchor_action[37], int *anchor_ok, char *err, size_t errlen) {
    PGresult *r = NULL;
    parent[0] = anchor_action[0] = 0;
    *anchor_ok = 0;
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT coalesce(s.parent_session_id::text, ''), coalesce(a.action_id::text, ''),"
                 "  a.action_id IS NOT NULL AND (s.spawn_anchor_hash IS NULL"
                 "                               OR a.hash = s.spawn_anchor_hash)"
                 "  AND " AUDIT_VERIFIED " FROM sessions s LEFT JOIN LATERAL ("
                 "   SELECT * FROM audit_log x WHERE x.session_id = s.parent_session_id"
                 "    AND (x.action_id = s.spawn_action_id"
                 "         OR (s.spawn_action_id IS NULL AND x.created_at <= s.started_at))"
                 "    ORDER BY x.seq DESC LIMIT 1) a ON true"
                 " WHERE s.session_id = $1::uuid",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        copy(parent, 37, PQgetvalue(r, 0, 0));
        copy(anchor_action, 37, PQgetvalue(r, 0, 1));
        *anchor_ok = PQgetvalue(r, 0, 2)[0] == 't';
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}
