/* The orchestrator's SQL: sessions, turns and the worker paths (heartbeats, checkpoints) (store.h).
 */
#include "store_int.h"

/* ---- sessions ---- */

void orch_session_clear(orch_session *s) {
    free(s->snapshot);
    s->snapshot = NULL;
}

/* started_at in whole milliseconds: what page tokens carry and the keyset compares */
#define STARTED_MS "floor(extract(epoch FROM started_at) * 1000)::bigint"
#define SESSION_COLS                                                                               \
    "session_id, org_id, agent_id, user_id, state, agent_status, execution_mode, model_id,"        \
    " snapshot_hash, loop_count, max_loops, turns, " STARTED_MS ","                                \
    " coalesce(floor(extract(epoch FROM last_heartbeat) * 1000)::bigint, 0), worker"

static void session_row(PGresult *r, int i, orch_session *o) {
    memset(o, 0, sizeof *o);
    copy(o->session_id, sizeof o->session_id, PQgetvalue(r, i, 0));
    copy(o->org_id, sizeof o->org_id, PQgetvalue(r, i, 1));
    copy(o->agent_id, sizeof o->agent_id, PQgetvalue(r, i, 2));
    copy(o->user_id, sizeof o->user_id, PQgetvalue(r, i, 3));
    copy(o->state, sizeof o->state, PQgetvalue(r, i, 4));
    o->agent_status = atoi(PQgetvalue(r, i, 5));
    o->execution_mode = atoi(PQgetvalue(r, i, 6));
    copy(o->model_id, sizeof o->model_id, PQgetvalue(r, i, 7));
    copy(o->snapshot_hash, sizeof o->snapshot_hash, PQgetvalue(r, i, 8));
    o->loop_count = atoi(PQgetvalue(r, i, 9));
    o->max_loops = atoi(PQgetvalue(r, i, 10));
    o->turns = atoi(PQgetvalue(r, i, 11));
    o->started_ms = to_ms(PQgetvalue(r, i, 12));
    o->last_heartbeat_ms = to_ms(PQgetvalue(r, i, 13));
    copy(o->worker, sizeof o->worker, PQgetvalue(r, i, 14));
}

int orch_store_session_create(db_pool *p, const orch_session_new *n, char *action_id, char *err,
                              size_t errlen) {
    char mode[16], loops[16], status[16], detail[512];
    snprintf(mode, sizeof mode, "%d", n->execution_mode);
    snprintf(loops, sizeof loops, "%d", n->max_loops);
    snprintf(status, sizeof status, "%d", n->agent_status);
    TX_BEGIN(n->org_id);
    const char *v[] = {n->session_id,
                       n->user_id,
                       n->agent_id,
                       mode,
                       n->model_id,
                       (const char *)n->snapshot,
                       n->snapshot_hash,
                       loops,
                       status,
                       n->kind ? n->kind : "chat",
                       n->worker ? n->worker : ""};
    int len[] = {0, 0, 0, 0, 0, (int)n->snapshot_len, 0, 0, 0, 0, 0};
    int fmt[] = {0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0};
    rc = db_exec_bin(c,
                     "INSERT INTO sessions (session_id, org_id, user_id, agent_id, state,"
                     " execution_mode, model_id, snapshot, snapshot_hash, max_loops, agent_status,"
                     " kind, root_session_id, worker, last_heartbeat)"
                     " VALUES ($1, current_org(), $2, $3, 'active', $4, $5, $6, $7, $8, $9, $10,"
                     " $1, $11, CASE WHEN $11 <> '' THEN now() END)",
                     11, v, len, fmt, 0, NULL, err, errlen);
    if (rc == DB_OK) {
        const char *d[] = {n->session_id};
        rc = db_exec(c,
                     "INSERT INTO session_directory (session_id, org_id)"
                     " VALUES ($1, current_org())",
                     1, d, NULL, err, errlen);
    }
    if (rc == DB_OK) {
        snprintf(detail, sizeof detail,
                 "{\"agent_id\":\"%s\",\"model_id\":\"%s\",\"snapshot_hash\":\"%s\","
                 "\"kind\":\"%s\"}",
                 n->agent_id, n->model_id, n->snapshot_hash, n->kind ? n->kind : "chat");
        rc = orch_store__audit_tx(c, n->session_id, "session_started", n->agent_id, NULL, detail,
                                  action_id, err, errlen);
    }
    return tx_end(tx, rc, err, errlen);
}

int orch_store_session_get(db_pool *p, const char *org, const char *session_id, int with_snapshot,
                           orch_session *out, char *err, size_t errlen) {
    PGresult *r = NULL;
    memset(out, 0, sizeof *out);
    TX_BEGIN(org);
    rc = db_exec(c, "SELECT " SESSION_COLS " FROM sessions WHERE session_id = $1::uuid", 1,
                 &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        session_row(r, 0, out);
    }
    PQclear(r);
    r = NULL;
    if (rc == DB_OK && with_snapshot) {
        rc = db_exec_bin(c, "SELECT snapshot FROM sessions WHERE session_id = $1::uuid", 1,
                         &session_id, NULL, NULL, 1, &r, err, errlen);
        if (rc == DB_OK && PQntuples(r) == 1) {
            out->snapshot_len = (size_t)PQgetlength(r, 0, 0);
            out->snapshot = malloc(out->snapshot_len ? out->snapshot_len : 1);
            if (!out->snapshot)
                rc = DB_ENOMEM;
            else
                memcpy(out->snapshot, PQgetvalue(r, 0, 0), out->snapshot_len);
        }
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_session_list(db_pool *p, const char *org, const orch_list_query *q,
                            orch_session **rows, size_t *n, int *more, int64_t *total, char *err,
                            size_t errlen) {
    PGresult *r = NULL;
    char status[16], limit[16], after[32];
    *rows = NULL;
    *n = 0;
    *more = 0;
    *total = 0;
    snprintf(status, sizeof status, "%d", q->agent_status);
    snprintf(limit, sizeof limit, "%d", q->page_size + 1);
    snprintf(after, sizeof after, "%lld", (long long)q->after_ms);
    const char *v[] = {q->agent_id && q->agent_id[0] ? q->agent_id : NULL,
                       q->state && q->state[0] ? q->state : NULL,
                       q->agent_status >= 0 ? status : NULL,
                       limit,
                       q->after_ms ? after : NULL,
                       q->after_id && q->after_id[0] ? q->after_id : NULL};
    static const char *FILTER = " WHERE ($1::uuid IS NULL OR agent_id = $1::uuid)"
                                "   AND ($2::text IS NULL OR state = $2)"
                                "   AND ($3::int IS NULL OR agent_status = $3)";
    char sql[1536];
    TX_BEGIN(org);
    snprintf(sql, sizeof sql,
             "SELECT " SESSION_COLS " FROM sessions%s"
             "   AND ($5::bigint IS NULL OR (" STARTED_MS ", session_id) < ($5::bigint, $6::uuid))"
             " ORDER BY " STARTED_MS " DESC, session_id DESC"
             " LIMIT $4::int",
             FILTER);
    rc = db_exec(c, sql, 6, v, &r, err, errlen);
    if (rc == DB_OK) {
        int m = PQntuples(r);
        if (m > q->page_size) {
            *more = 1;
            m = q->page_size;
        }
        orch_session *out = calloc((size_t)(m ? m : 1), sizeof *out);
        if (!out) {
            rc = DB_ENOMEM;
        } else {
            for (int i = 0; i < m; i++)
                session_row(r, i, &out[i]);
            *rows = out;
            *n = (size_t)m;
        }
    }
    PQclear(r);
    r = NULL;
    if (rc == DB_OK) {
        snprintf(sql, sizeof sql, "SELECT count(*) FROM sessions%s", FILTER);
        rc = db_exec(c, sql, 3, v, &r, err, errlen);
        if (rc == DB_OK) *total = atoll(PQgetvalue(r, 0, 0));
        PQclear(r);
    }
    if (rc != DB_OK) {
        free(*rows);
        *rows = NULL;
        *n = 0;
    }
    return tx_end(tx, rc, err, errlen);
}

/* s as a JSON string literal (heap, caller frees; NULL out of memory), at most max bytes of it,
 * cut on a character boundary: audit details are jsonb, which refuses a split UTF-8 sequence. */
char *orch_store__json_str(const char *s, size_t max) {
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    if (!f) return NULL;
    fputc('"', f);
    s = s ? s : "";
    size_t n = util_utf8_cut(s, max);
    for (const unsigned char *q = (const unsigned char *)s; q < (const unsigned char *)s + n; q++) {
        if (*q == '"' || *q == '\\')
            fprintf(f, "\\%c", *q);
        else if (*q < 0x20)
            fprintf(f, "\\u%04x", *q);
        else
            fputc(*q, f);
    }
    fputc('"', f);
    fclose(f);
    return out;
}

/* Ends one live session inside the caller's transaction (the row already locked): state
 * 'terminated', ended_at, a settled AgentStatus, and the session_terminated audit row with the
 * reason (orch_store__json_str, at most 1024 bytes). TerminateSession and the tree cascade share
 * it. */
int orch_store__session_end_tx(PGconn *c, const char *session_id, const char *agent,
                               const char *reason, char *err, size_t errlen) {
    int rc = db_exec(c,
                     "UPDATE sessions SET state = 'terminated', ended_at = now(),"
                     " agent_status = CASE WHEN agent_status IN (0, 1, 2, 5) THEN 3"
                     "                     ELSE agent_status END"
                     " WHERE session_id = $1::uuid",
                     1, &session_id, NULL, err, errlen);
    char *why = orch_store__json_str(reason, 1024), *detail = NULL;
    if (rc == DB_OK && (!why || asprintf(&detail, "{\"reason\":%s}", why) < 0)) {
        detail = NULL;
        rc = DB_ENOMEM;
    }
    if (rc == DB_OK)
        rc = orch_store__audit_tx(c, session_id, "session_terminated", agent, NULL, detail, NULL,
                                  err, errlen);
    free(why);
    free(detail);
    return rc;
}

int orch_store_session_terminate(db_pool *p, const char *org, const char *session_id,
                                 const char *reason, int *was_terminal, char *final_state,
                                 char *err, size_t errlen) {
    PGresult *r = NULL;
    *was_terminal = 0;
    TX_BEGIN(org);
    rc = db_exec(c, "SELECT state, agent_id FROM sessions WHERE session_id = $1::uuid FOR UPDATE",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        copy(final_state, 16, PQgetvalue(r, 0, 0));
        if (terminal(final_state)) {
            *was_terminal = 1;
        } else {
            char agent[37];
            copy(agent, sizeof agent, PQgetvalue(r, 0, 1));
            rc = orch_store__session_end_tx(c, session_id, agent, reason, err, errlen);
            if (rc == DB_OK) copy(final_state, 16, "terminated");
        }
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

void orch_turns_free(orch_turn *t, size_t n) {
    for (size_t i = 0; t && i < n; i++)
        free(t[i].text);
    free(t);
}

int orch_store__prior_turns_tx(PGconn *c, const char *session_id, int before, int max_turns,
                               size_t max_bytes, orch_turn **turns, size_t *n, char *err,
                               size_t errlen) {
    PGresult *r = NULL;
    char lim[16], bef[16];
    *turns = NULL;
    *n = 0;
    if (max_turns <= 0) return DB_OK;
    snprintf(lim, sizeof lim, "%d", max_turns);
    snprintf(bef, sizeof bef, "%d", before > 0 ? before : 0x7fffffff);
    /* newest first from the database, kept while within the byte bound, then returned oldest
     * first */
    int rc = db_exec(c,
                     "SELECT role, text FROM turns WHERE session_id = $1::uuid"
                     " AND turn_no < $3::int ORDER BY turn_no DESC LIMIT $2::int",
                     3, (const char *[]){session_id, lim, bef}, &r, err, errlen);
    if (rc == DB_OK) {
        int m = PQntuples(r), keep = 0;
        size_t bytes = 0;
        for (; keep < m; keep++) {
            size_t l = (size_t)PQgetlength(r, keep, 1);
            if (bytes + l > max_bytes) break;
            bytes += l;
        }
        orch_turn *t = calloc((size_t)(keep ? keep : 1), sizeof *t);
        if (!t) rc = DB_ENOMEM;
        for (int i = 0; rc == DB_OK && i < keep; i++) {
            orch_turn *o = &t[keep - 1 - i];
            o->role = atoi(PQgetvalue(r, i, 0));
            o->text = strdup(PQgetvalue(r, i, 1));
            if (!o->text) rc = DB_ENOMEM;
        }
        if (rc == DB_OK) {
            *turns = t;
            *n = (size_t)keep;
        } else {
            orch_turns_free(t, (size_t)keep);
        }
    }
    PQclear(r);
    return rc;
}

int orch_store__lease_tx(PGconn *c, const char *action_id, const char *session_id,
                         const char *owner, char *err, size_t errlen) {
    return db_exec(c,
                   "INSERT INTO turn_leases (action_id, session_id, org_id, owner)"
                   " VALUES ($1, $2, current_org(), left($3, 160))",
                   3, (const char *[]){action_id, session_id, owner ? owner : ""}, NULL, err,
                   errlen);
}

int orch_store_turn_begin(db_pool *p, const char *org, const char *session_id, const char *message,
                          int max_turns, size_t max_bytes, int64_t timeout_ms, const char *owner,
                          orch_turn **turns, size_t *n, char *action_id, char *final_state,
                          char *err, size_t errlen) {
    PGresult *r = NULL;
    char tmo[32];
    *turns = NULL;
    *n = 0;
    snprintf(tmo, sizeof tmo, "%lld", (long long)(timeout_ms > 0 ? timeout_ms : 1));
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT state, turns, agent_id, pause_pending,"
                 "  NOT (turns_running > 0 AND turn_deadline > now()),"
                 "  pause_reason, pause_source, pause_correlation_id FROM sessions"
                 " WHERE session_id = $1::uuid FOR UPDATE",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    char agent[37] = "";
    int turn_no = 0, overdue = 0;
    orch_pause pz = {0};
    if (rc == DB_OK) {
        copy(final_state, 16, PQgetvalue(r, 0, 0));
        turn_no = atoi(PQgetvalue(r, 0, 1));
        copy(agent, sizeof agent, PQgetvalue(r, 0, 2));
        if (terminal(final_state) || !strcmp(final_state, "suspended")) rc = ORCH_ESTATE;
        /* a pause waits for the turns in flight: no new one starts meanwhile (spec: the pause
         * commits at the next message boundary) */
        if (rc == DB_OK && PQgetvalue(r, 0, 3)[0] == 't') {
            /* nothing counts in flight any more (a turn left by a replica that died with no
             * lease to reclaim, past its bound): the boundary is now, and the pause commits
             * here rather than hold the session back until someone asks again */
            overdue = PQgetvalue(r, 0, 4)[0] == 't';
            copy(final_state, 16, overdue ? "suspended" : "pausing");
            copy(pz.reason, sizeof pz.reason, PQgetvalue(r, 0, 5));
            pz.source = atoi(PQgetvalue(r, 0, 6));
            copy(pz.correlation_id, sizeof pz.correlation_id, PQgetvalue(r, 0, 7));
            rc = ORCH_ESTATE;
        }
    }
    PQclear(r);
    r = NULL;
    if (overdue) {
        /* the turn it waited for ended without an outcome: the status kept for the resume is
         * ERROR, never THINKING (as the reclaim of a lease records it) */
        rc = db_exec(c,
                     "UPDATE sessions SET agent_status = 4 WHERE session_id = $1::uuid"
                     " AND agent_status IN (1, 2)",
                     1, &session_id, NULL, err, errlen);
        if (rc == DB_OK)
            rc = orch_store__pause_commit_tx(c, session_id, agent, NULL, &pz, err, errlen);
        rc = tx_end(tx, rc, err, errlen);
        return rc == DB_OK ? ORCH_ESTATE : rc;
    }
    /* prior turns (the current turn is not stored yet, so it is never included) */
    if (rc == DB_OK)
        rc = orch_store__prior_turns_tx(c, session_id, 0, max_turns, max_bytes, turns, n, err,
                                        errlen);
    if (rc == DB_OK) {
        char no[16];
        snprintf(no, sizeof no, "%d", turn_no + 1);
        const char *v[] = {session_id, no, message};
        rc = db_exec(c,
                     "INSERT INTO turns (session_id, turn_no, org_id, role, text)"
                     " VALUES ($1, $2, current_org(), 1, $3)",
                     3, v, NULL, err, errlen);
        /* in flight until its end, or its bound (a count a dead replica left behind stops
         * counting once its deadline passed) */
        if (rc == DB_OK)
            rc = db_exec(c,
                         "UPDATE sessions SET turns = turns + 1, agent_status = 1,"
                         " turns_running = CASE WHEN turn_deadline IS NULL OR turn_deadline < now()"
                         "                      THEN 1 ELSE turns_running + 1 END,"
                         " turn_deadline = greatest(coalesce(turn_deadline, now()),"
                         "                          now() + $2::bigint * interval '1 millisecond')"
                         " WHERE session_id = $1::uuid",
                         2, (const char *[]){session_id, tmo}, NULL, err, errlen);
    }
    if (rc == DB_OK) {
        char detail[64];
        snprintf(detail, sizeof detail, "{\"turn\":%d,\"bytes\":%zu}", turn_no + 1,
                 strlen(message));
        rc = orch_store__audit_tx(c, session_id, "message_received", agent, NULL, detail, action_id,
                                  err, errlen);
    }
    /* the turn's lease, named by its message_received row (what its end is handed): renewed
     * by this replica while the relay lives, reclaimed by any replica once it is not */
    if (rc == DB_OK) rc = orch_store__lease_tx(c, action_id, session_id, owner, err, errlen);
    if (rc != DB_OK) {
        orch_turns_free(*turns, *n);
        *turns = NULL;
        *n = 0;
    }
    return tx_end(tx, rc, err, errlen);
}

/* The message boundary of a chat turn, inside the caller's transaction: the turn stops counting
 * in flight (released 1; 0 when its lease was reclaimed already and the reclaim counted it out),
 * and when no turn is left in flight a pending pause commits (a session terminated meanwhile
 * drops it). paused (NULL: not wanted): the committed pause, committed = 1. Shared by a turn's
 * end and the reclaim of a dead one, so a pending pause commits whichever ends the turn. */
static int turn_boundary_tx(PGconn *c, const char *session_id, const char *agent, int released,
                            orch_pause *paused, char *err, size_t errlen) {
    PGresult *r = NULL;
    const char *v[] = {session_id, released ? "1" : "0"};
    int rc = db_exec(c,
                     "UPDATE sessions SET turns_running = greatest(turns_running - $2::int, 0),"
                     " turn_deadline = CASE WHEN turns_running <= $2::int THEN NULL"
                     "                      ELSE turn_deadline END,"
                     " pause_pending = pause_pending AND state = 'active'"
                     " WHERE session_id = $1::uuid"
                     " RETURNING pause_pending AND turns_running = 0, pause_reason, pause_source,"
                     "           pause_correlation_id",
                     2, v, &r, err, errlen);
    orch_pause pz = {0};
    int commit = rc == DB_OK && PQntuples(r) == 1 && PQgetvalue(r, 0, 0)[0] == 't';
    if (commit) {
        copy(pz.reason, sizeof pz.reason, PQgetvalue(r, 0, 1));
        pz.source = atoi(PQgetvalue(r, 0, 2));
        copy(pz.correlation_id, sizeof pz.correlation_id, PQgetvalue(r, 0, 3));
    }
    PQclear(r);
    if (commit) rc = orch_store__pause_commit_tx(c, session_id, agent, NULL, &pz, err, errlen);
    if (rc == DB_OK && commit && paused) {
        *paused = pz;
        paused->committed = 1;
    }
    return rc;
}

int orch_store_turn_end(db_pool *p, const char *org, const char *session_id,
                        const char *parent_action_id, const orch_turn_end *e, char *err,
                        size_t errlen) {
    PGresult *r = NULL;
    char status[16], loops[16], in[32], outt[32], cost[64];
    snprintf(status, sizeof status, "%d", e->agent_status);
    snprintf(loops, sizeof loops, "%d", e->loop_base + e->loop_iterations);
    snprintf(in, sizeof in, "%lld", (long long)e->input_tokens);
    snprintf(outt, sizeof outt, "%lld", (long long)e->output_tokens);
    snprintf(cost, sizeof cost, "%.9f", e->cost_usd);
    TX_BEGIN(org);
    const char *v[] = {session_id,
                       status,
                       loops,
                       in,
                       outt,
                       cost,
                       e->ok ? "" : (e->error_msg ? e->error_msg : ""),
                       e->worker ? e->worker : "",
                       e->worker_answered ? "t" : "f"};
    if (rc == DB_OK)
        rc = db_exec(c,
                     /* loop_count only grows to a count: the turn's iterations on top of the
                      * count it began with, or what the checkpoints already showed (they race
                      * the turn's end: orch_store_checkpoint), whichever is more. A session
                      * terminated while the turn ran keeps the status its termination
                      * reported ("the final session status"), a suspended one SUSPENDED. */
                     "UPDATE sessions SET agent_status = CASE WHEN state IN ('terminated', "
                     "'suspended')"
                     " THEN agent_status ELSE $2::int END,"
                     " last_heartbeat = CASE WHEN $9::bool THEN now() ELSE last_heartbeat END,"
                     " loop_count = greatest(loop_count, $3::int),"
                     " input_tokens = input_tokens + $4::bigint,"
                     " output_tokens = output_tokens + $5::bigint,"
                     " cost_usd = cost_usd + $6::float8,"
                     " last_error = CASE WHEN $7 = '' THEN last_error ELSE left($7, 1024) END,"
                     " worker = $8"
                     " WHERE session_id = $1::uuid RETURNING turns, agent_id",
                     9, v, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    char agent[37] = "";
    int turns = 0;
    if (rc == DB_OK) {
        turns = atoi(PQgetvalue(r, 0, 0));
        copy(agent, sizeof agent, PQgetvalue(r, 0, 1));
    }
    PQclear(r);
    if (rc == DB_OK && e->ok) {
        char no[16];
        snprintf(no, sizeof no, "%d", turns + 1);
        const char *t[] = {session_id, no, e->final_text ? e->final_text : ""};
        rc = db_exec(c,
                     "INSERT INTO turns (session_id, turn_no, org_id, role, text)"
                     " VALUES ($1, $2, current_org(), 2, $3)",
                     3, t, NULL, err, errlen);
        if (rc == DB_OK)
            rc = db_exec(c, "UPDATE sessions SET turns = turns + 1 WHERE session_id = $1::uuid", 1,
                         &session_id, NULL, err, errlen);
    }
    if (rc == DB_OK) {
        char *code = orch_store__json_str(e->error_code, 64),
             *msg = orch_store__json_str(e->error_msg, 512);
        char *detail = NULL;
        size_t dl = 0;
        FILE *f = open_memstream(&detail, &dl);
        if (!code || !msg || !f) {
            rc = DB_ENOMEM;
            if (f) fclose(f);
        } else {
            if (e->ok)
                fprintf(f,
                        "{\"loop_iterations\":%d,\"input_tokens\":%lld,\"output_tokens\":%lld,"
                        "\"cost_usd\":%.9f,\"bytes\":%zu}",
                        e->loop_iterations, (long long)e->input_tokens, (long long)e->output_tokens,
                        e->cost_usd, e->final_text ? strlen(e->final_text) : 0);
            else
                fprintf(f, "{\"code\":%s,\"message\":%s}", code, msg);
            fclose(f);
            rc = orch_store__audit_tx(c, session_id, e->ok ? "completion" : "error", agent,
                                      parent_action_id, detail, NULL, err, errlen);
        }
        free(code);
        free(msg);
        free(detail);
    }
    /* a turn parking the session (an approval) leaves a pause pending, which its own boundary
     * below commits when it is the last turn in flight */
    if (rc == DB_OK && parent_action_id && e->park_source > 0) {
        char src[16];
        snprintf(src, sizeof src, "%d", e->park_source);
        const char *v[] = {session_id, e->park_reason ? e->park_reason : "", src,
                           e->park_correlation ? e->park_correlation : ""};
        rc = db_exec(c,
                     "UPDATE sessions SET pause_pending = true, pause_reason = left($2, 1024),"
                     " pause_source = $3::int, pause_correlation_id = left($4, 256)"
                     " WHERE session_id = $1::uuid AND state = 'active'",
                     4, v, NULL, err, errlen);
    }
    if (rc == DB_OK && parent_action_id) {
        /* a lease already reclaimed (this replica was silent past the bound) was counted out
         * by the reclaim: the turn's result is stored all the same, its count is not dropped
         * twice */
        rc = db_exec(c, "DELETE FROM turn_leases WHERE action_id = $1::uuid RETURNING 1", 1,
                     &parent_action_id, &r, err, errlen);
        int held = rc == DB_OK && PQntuples(r) == 1;
        PQclear(r);
        r = NULL;
        if (rc == DB_OK) rc = turn_boundary_tx(c, session_id, agent, held, e->paused, err, errlen);
    }
    return tx_end(tx, rc, err, errlen);
}

/* ---- turn leases (docs/orchestrator.md, "Dead turns") ---- */

#define LEASE_STALE "renewed_at < now() - $2::bigint * interval '1 millisecond'"

int orch_store_turn_leases_renew(db_pool *p, const char (*action_ids)[37], size_t n, char *err,
                                 size_t errlen) {
    if (n == 0) return DB_OK;
    /* one statement for every lease this replica holds: an array literal of UUIDs */
    char *ids = malloc(n * 37 + 3);
    if (!ids) return DB_ENOMEM;
    size_t at = 0;
    ids[at++] = '{';
    for (size_t i = 0; i < n; i++) {
        if (i) ids[at++] = ',';
        size_t l = strnlen(action_ids[i], 36);
        memcpy(ids + at, action_ids[i], l);
        at += l;
    }
    ids[at++] = '}';
    ids[at] = 0;
    TX_BEGIN(NULL);
    rc = db_exec(c, "UPDATE turn_leases SET renewed_at = now() WHERE action_id = ANY($1::uuid[])",
                 1, (const char *[]){ids}, NULL, err, errlen);
    free(ids);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_turn_leases_stale(db_pool *p, int64_t ttl_ms, size_t max, orch_turn_lease *out,
                                 size_t *n, char *err, size_t errlen) {
    PGresult *r = NULL;
    char ttl[32], lim[16];
    *n = 0;
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_ms);
    snprintf(lim, sizeof lim, "%zu", max);
    TX_BEGIN(NULL);
    rc = db_exec(c,
                 "SELECT action_id, session_id, org_id FROM turn_leases WHERE " LEASE_STALE
                 " ORDER BY renewed_at LIMIT $1::int",
                 2, (const char *[]){lim, ttl}, &r, err, errlen);
    for (int i = 0; rc == DB_OK && i < PQntuples(r) && (size_t)i < max; i++) {
        copy(out[i].action_id, sizeof out[i].action_id, PQgetvalue(r, i, 0));
        copy(out[i].session_id, sizeof out[i].session_id, PQgetvalue(r, i, 1));
        copy(out[i].org_id, sizeof out[i].org_id, PQgetvalue(r, i, 2));
        (*n)++;
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_turn_reclaim(db_pool *p, const orch_turn_lease *l, int64_t ttl_ms, const char *by,
                            int *reclaimed, orch_pause *paused, char *err, size_t errlen) {
    PGresult *r = NULL;
    char ttl[32], agent[37] = "", owner[161] = "", why[512];
    long long silent = 0;
    *reclaimed = 0;
    snprintf(ttl, sizeof ttl, "%lld", (long long)ttl_ms);
    TX_BEGIN(l->org_id);
    /* the session row first, as a turn's end locks it: a reclaim and the end of the same turn
     * (its replica alive after all) serialise on it, and the lease goes to exactly one */
    rc = db_exec(c, "SELECT agent_id FROM sessions WHERE session_id = $1::uuid FOR UPDATE", 1,
                 (const char *[]){l->session_id}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) copy(agent, sizeof agent, PQgetvalue(r, 0, 0));
    PQclear(r);
    r = NULL;
    /* still stale now that the row is ours: renewed meanwhile, or ended, or reclaimed by
     * another replica, it is left alone */
    if (rc == DB_OK)
        rc = db_exec(c,
                     "DELETE FROM turn_leases WHERE action_id = $1::uuid AND " LEASE_STALE
                     " RETURNING owner,"
                     "  floor(extract(epoch FROM now() - renewed_at) * 1000)::bigint",
                     2, (const char *[]){l->action_id, ttl}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) {
        *reclaimed = 1;
        copy(owner, sizeof owner, PQgetvalue(r, 0, 0));
        silent = atoll(PQgetvalue(r, 0, 1));
    }
    PQclear(r);
    r = NULL;
    if (rc != DB_OK || !*reclaimed || !agent[0]) return tx_end(tx, rc, err, errlen);
    /* the turn ended without an outcome: ERROR ("the step ended with an error"), as a failed
     * turn's end sets it, unless another turn still runs or the session left 'active' (a
     * terminated one keeps its final status, a suspended one SUSPENDED) */
    snprintf(why, sizeof why,
             "the turn was reclaimed: replica %s relaying it stopped renewing its lease "
             "(silent %lld ms)",
             owner, silent);
    rc = db_exec(c,
                 "UPDATE sessions SET agent_status = CASE WHEN state = 'active'"
                 "   AND turns_running <= 1 AND agent_status IN (1, 2) THEN 4"
                 "   ELSE agent_status END,"
                 " last_error = left($2, 1024) WHERE session_id = $1::uuid",
                 2, (const char *[]){l->session_id, why}, NULL, err, errlen);
    if (rc == DB_OK) {
        char *o = orch_store__json_str(owner, 160), *b = orch_store__json_str(by, 160);
        char *detail = NULL;
        if (!o || !b ||
            asprintf(&detail, "{\"owner\":%s,\"silent_ms\":%lld,\"reclaimed_by\":%s}", o, silent,
                     b) < 0) {
            detail = NULL;
            rc = DB_ENOMEM;
        }
        /* a child of the turn's message_received, as the turn's own completion would be */
        if (rc == DB_OK)
            rc = orch_store__audit_tx(c, l->session_id, "turn_reclaimed", agent, l->action_id,
                                      detail, NULL, err, errlen);
        free(o);
        free(b);
        free(detail);
    }
    /* the turn's delegations still pending ran inside its call on the dead replica: their
     * bridge rows end as errors with the turn (the children's own turns are reclaimed alike) */
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE subagent_invocations i SET status = 'error',"
                     " error_code = 'parent_turn_reclaimed', finished_at = now()"
                     " FROM sessions s WHERE s.session_id = i.child_session_id"
                     " AND s.spawn_action_id = $2::uuid AND i.parent_session_id = $1::uuid"
                     " AND i.status = 'pending'",
                     2, (const char *[]){l->session_id, l->action_id}, NULL, err, errlen);
    if (rc == DB_OK) rc = turn_boundary_tx(c, l->session_id, agent, 1, paused, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_session_status(db_pool *p, const char *org, const char *session_id, int status,
                              char *err, size_t errlen) {
    char st[16];
    snprintf(st, sizeof st, "%d", status);
    TX_BEGIN(org);
    const char *v[] = {session_id, st};
    /* a terminated session keeps the status its termination reported, a suspended one
     * SUSPENDED */
    rc = db_exec(c,
                 "UPDATE sessions SET agent_status = $2::int"
                 " WHERE session_id = $1::uuid AND state NOT IN ('terminated', 'suspended')",
                 2, v, NULL, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

/* ---- worker paths ---- */

/* The org of a session, read without a tenant (session_directory has no tenant data); with
 * only_org set, a session of another org is ORCH_ENOTFOUND, as it would be under RLS. */
static int org_of(db_pool *p, const char *only_org, const char *session_id, char org[37], char *err,
                  size_t errlen) {
    PGresult *r = NULL;
    TX_BEGIN(NULL);
    rc = db_exec(c, "SELECT org_id FROM session_directory WHERE session_id = $1::uuid", 1,
                 &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) copy(org, 37, PQgetvalue(r, 0, 0));
    if (rc == DB_OK && only_org && strcasecmp(org, only_org) != 0) rc = ORCH_ENOTFOUND;
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_heartbeat(db_pool *p, const char *only_org, const char *session_id, char *err,
                         size_t errlen) {
    char org[37];
    PGresult *r = NULL;
    int rc0 = org_of(p, only_org, session_id, org, err, errlen);
    if (rc0 != DB_OK) return rc0;
    TX_BEGIN(org);
    rc = db_exec(c,
                 "UPDATE sessions SET last_heartbeat = now() WHERE session_id = $1::uuid"
                 " RETURNING 1",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_checkpoint(db_pool *p, const char *only_org, const char *session_id,
                          int loop_iteration, uint32_t schema_version, const unsigned char *state,
                          size_t len, const char *sha256_hex, int keep, char *err, size_t errlen) {
    char org[37], iter[16], ver[16], keeps[16];
    PGresult *r = NULL;
    int rc0 = org_of(p, only_org, session_id, org, err, errlen);
    if (rc0 != DB_OK) return rc0;
    snprintf(iter, sizeof iter, "%d", loop_iteration);
    snprintf(ver, sizeof ver, "%u", schema_version);
    snprintf(keeps, sizeof keeps, "%d", keep);
    TX_BEGIN(org);
    const char *v[] = {session_id, iter, ver, (const char *)state, sha256_hex};
    int lens[] = {0, 0, 0, (int)len, 0}, fmt[] = {0, 0, 0, 1, 0};
    rc = db_exec_bin(c,
                     "INSERT INTO checkpoints (session_id, loop_iteration, org_id, schema_version,"
                     " state, sha256) VALUES ($1, $2, current_org(), $3, $4, $5)"
                     " ON CONFLICT (session_id, loop_iteration) DO NOTHING RETURNING 1",
                     5, v, lens, fmt, 0, &r, err, errlen);
    int inserted = rc == DB_OK && PQntuples(r) == 1;
    PQclear(r);
    r = NULL;
    if (rc == DB_OK && !inserted) {
        const char *k[] = {session_id, iter};
        rc = db_exec(c,
                     "SELECT sha256 FROM checkpoints WHERE session_id = $1::uuid"
                     " AND loop_iteration = $2::int",
                     2, k, &r, err, errlen);
        if (rc == DB_OK)
            rc = PQntuples(r) == 1 && !strcmp(PQgetvalue(r, 0, 0), sha256_hex) ? ORCH_EREPLAY
                                                                               : ORCH_ECONFLICT;
        PQclear(r);
    }
    if (rc == DB_OK) {
        /* keep the newest N per session (by loop_iteration) */
        const char *k[] = {session_id, keeps};
        rc = db_exec(c,
                     "DELETE FROM checkpoints WHERE session_id = $1::uuid AND loop_iteration <"
                     " (SELECT min(loop_iteration) FROM (SELECT loop_iteration FROM checkpoints"
                     "   WHERE session_id = $1::uuid ORDER BY loop_iteration DESC"
                     "   LIMIT $2::int) k)",
                     2, k, NULL, err, errlen);
        /* loop_count counts completed iterations (spec: SessionInfo.loop_count) and
         * iterations count from 0, so iteration N means N + 1 completed. A max, like the
         * turn's end (orch_store_turn_end): a checkpoint arriving before or after the turn's
         * end gives the same count. */
        if (rc == DB_OK)
            rc = db_exec(c,
                         "UPDATE sessions SET loop_count = greatest(loop_count, $2::int + 1)"
                         " WHERE session_id = $1::uuid",
                         2, (const char *[]){session_id, iter}, NULL, err, errlen);
    }
    return tx_end(tx, rc, err, errlen);
}

int orch_store_checkpoint_latest(db_pool *p, const char *org, const char *session_id,
                                 int *loop_iteration, unsigned char **state, size_t *len, char *err,
                                 size_t errlen) {
    PGresult *r = NULL;
    *state = NULL;
    *len = 0;
    TX_BEGIN(org);
    rc = db_exec_bin(c,
                     "SELECT loop_iteration, state FROM checkpoints WHERE session_id = $1::uuid"
                     " ORDER BY loop_iteration DESC LIMIT 1",
                     1, &session_id, NULL, NULL, 1, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        const unsigned char *b = (const unsigned char *)PQgetvalue(r, 0, 0);
        *loop_iteration =
            (int)((uint32_t)b[0] << 24 | (uint32_t)b[1] << 16 | (uint32_t)b[2] << 8 | b[3]);
        *len = (size_t)PQgetlength(r, 0, 1);
        *state = malloc(*len ? *len : 1);
        if (!*state)
            rc = DB_ENOMEM;
        else
            memcpy(*state, PQgetvalue(r, 0, 1), *len);
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}
