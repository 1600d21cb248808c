/* Every SQL statement of the orchestrator (store.h). */
#include "store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "ids.h"
#include "util.h"

#define ZERO_HASH "0000000000000000000000000000000000000000000000000000000000000000"

static void copy(char *dst, size_t cap, const char *src) {
    snprintf(dst, cap, "%s", src ? src : "");
}

static int64_t to_ms(const char *ms) {
    return ms && ms[0] ? (int64_t)atoll(ms) : 0;
}

/* Runs fn inside one transaction scoped to org; commits when it returns DB_OK. */
#define TX_BEGIN(org)                                                                              \
    db_tx *tx = NULL;                                                                              \
    int rc = db_tx_begin(p, (org), &tx, err, errlen);                                              \
    if (rc != DB_OK) return rc;                                                                    \
    PGconn *c = db_tx_conn(tx)

/* Every transaction ends here: committed on DB_OK, else rolled back (a not-found, a refused
 * state or a replay changes nothing) with rc passed up. */
static int tx_end(db_tx *tx, int rc, char *err, size_t errlen) {
    if (rc == DB_OK) return db_tx_commit(tx, err, errlen);
    db_tx_rollback(tx);
    return rc;
}

/* ---- audit ---- */

/* The chain: hash = sha256(prev_hash | seq | action_id | action_type | parent | detail::text),
 * '|'-joined, with the session row locked so appends of one session are serialised. FOR NO KEY
 * UPDATE, the lock an UPDATE of the row takes: it serialises appends all the same, and does not
 * conflict with the key-share lock a checkpoint's insert takes on the row through its foreign
 * key (FOR UPDATE did: a turn's end, having updated the row, then waited on a checkpoint that
 * was waiting on that update, a deadlock that lost the turn's end). */
static const char *SQL_AUDIT =
    "WITH s AS (SELECT session_id FROM sessions WHERE session_id = $1::uuid"
    " FOR NO KEY UPDATE),"
    " last AS (SELECT seq, hash FROM audit_log WHERE session_id = $1::uuid"
    "          ORDER BY seq DESC LIMIT 1),"
    " v AS (SELECT coalesce((SELECT seq FROM last), 0) + 1 AS seq,"
    "              coalesce((SELECT hash FROM last), '" ZERO_HASH "') AS prev,"
    "              $6::jsonb AS detail)"
    " INSERT INTO audit_log (action_id, session_id, seq, org_id, action_type, agent_id,"
    "                        parent_action_id, detail, prev_hash, hash)"
    " SELECT $2::uuid, s.session_id, v.seq, current_org(), $3::text, nullif($4::text, '')::uuid,"
    "        nullif($5::text, '')::uuid, v.detail, v.prev,"
    "        encode(sha256(convert_to(concat_ws('|', v.prev, v.seq::text, $2::text, $3::text,"
    "                                           $5::text, v.detail::text), 'UTF8')), 'hex')"
    " FROM s, v RETURNING seq";

static int audit_tx(PGconn *c, const char *sid, const char *type, const char *agent_id,
                    const char *parent, const char *detail, char *action_id, char *err,
                    size_t errlen) {
    char id[37];
    PGresult *r = NULL;
    if (ids_uuid_v7(id)) return util_errf(err, errlen, DB_ERR, "no randomness for an action id");
    const char *v[] = {sid,
                       id,
                       type,
                       agent_id ? agent_id : "",
                       parent ? parent : "",
                       detail && detail[0] ? detail : "{}"};
    int rc = db_exec(c, SQL_AUDIT, 6, v, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) != 1) rc = util_errf(err, errlen, ORCH_ENOTFOUND, "no session");
    PQclear(r);
    if (rc == DB_OK && action_id) memcpy(action_id, id, 37);
    return rc;
}

int orch_store_audit(db_pool *p, const char *org, const char *session_id, const char *type,
                     const char *agent_id, const char *parent_action_id, const char *detail_json,
                     char *action_id, char *err, size_t errlen) {
    TX_BEGIN(org);
    rc = audit_tx(c, session_id, type, agent_id, parent_action_id, detail_json, action_id, err,
                  errlen);
    return tx_end(tx, rc, err, errlen);
}

/* ---- agents ---- */

int orch_store_agent_upsert(db_pool *p, const char *org, const char *agent_id, const char *role,
                            const char *display_name, const char *model, const char *def_json,
                            int *created, char *err, size_t errlen) {
    PGresult *r = NULL;
    TX_BEGIN(org);
    const char *v[] = {agent_id, role, display_name, model, def_json};
    rc = db_exec(c,
                 "INSERT INTO agents (agent_id, org_id, role, display_name, model, definition)"
                 " VALUES ($1, current_org(), $2, $3, $4, $5::jsonb)"
                 " ON CONFLICT (agent_id) DO UPDATE SET role = EXCLUDED.role,"
                 "   display_name = EXCLUDED.display_name, model = EXCLUDED.model,"
                 "   definition = EXCLUDED.definition, updated_at = now()"
                 "   WHERE agents.org_id = current_org()"
                 " RETURNING (xmax = 0)",
                 5, v, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) != 1)
        rc = util_errf(err, errlen, ORCH_ECONFLICT, "agent id %s belongs to another org", agent_id);
    if (rc == DB_OK && created) *created = PQgetvalue(r, 0, 0)[0] == 't';
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

static const char *AGENT_COLS =
    "SELECT agent_id, role, display_name, model, definition::text,"
    " to_char(updated_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"') FROM agents ";

static void agent_row(PGresult *r, int i, orch_agent_row *out) {
    copy(out->agent_id, sizeof out->agent_id, PQgetvalue(r, i, 0));
    copy(out->role, sizeof out->role, PQgetvalue(r, i, 1));
    copy(out->display_name, sizeof out->display_name, PQgetvalue(r, i, 2));
    copy(out->model, sizeof out->model, PQgetvalue(r, i, 3));
    out->definition = strdup(PQgetvalue(r, i, 4));
    copy(out->updated_at, sizeof out->updated_at, PQgetvalue(r, i, 5));
}

static int agent_one(db_pool *p, const char *org, const char *where, const char *arg,
                     orch_agent_row *out, char *err, size_t errlen) {
    PGresult *r = NULL;
    char sql[512];
    snprintf(sql, sizeof sql, "%s%s", AGENT_COLS, where);
    TX_BEGIN(org);
    rc = db_exec(c, sql, 1, &arg, &r, err, errlen);
    if (rc == DB_OK) {
        if (PQntuples(r) == 0) {
            rc = ORCH_ENOTFOUND;
        } else {
            agent_row(r, 0, out);
            if (!out->definition) rc = DB_ENOMEM;
        }
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_agent_get(db_pool *p, const char *org, const char *agent_id, orch_agent_row *out,
                         char *err, size_t errlen) {
    return agent_one(p, org, "WHERE agent_id = $1::uuid", agent_id, out, err, errlen);
}

int orch_store_agent_by_role(db_pool *p, const char *org, const char *role, orch_agent_row *out,
                             char *err, size_t errlen) {
    return agent_one(p, org, "WHERE role = $1", role, out, err, errlen);
}

int orch_store_agent_list(db_pool *p, const char *org,
                          void (*fn)(const orch_agent_row *r, void *ud), void *ud, char *err,
                          size_t errlen) {
    PGresult *r = NULL;
    char sql[512];
    snprintf(sql, sizeof sql, "%sORDER BY role", AGENT_COLS);
    TX_BEGIN(org);
    rc = db_exec(c, sql, 0, NULL, &r, err, errlen);
    for (int i = 0; rc == DB_OK && i < PQntuples(r); i++) {
        orch_agent_row a;
        agent_row(r, i, &a);
        fn(&a, ud);
        free(a.definition);
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

/* ---- provider keys ---- */

int orch_store_key_set(db_pool *p, const char *org, const char *provider, const char *kid,
                       const unsigned char *nonce, const unsigned char *ct, size_t ctlen, char *err,
                       size_t errlen) {
    TX_BEGIN(org);
    const char *v[] = {provider, kid, (const char *)nonce, (const char *)ct};
    int len[] = {0, 0, 12, (int)ctlen}, fmt[] = {0, 0, 1, 1};
    rc = db_exec_bin(c,
                     "INSERT INTO provider_keys (org_id, provider, kek_id, nonce, ciphertext)"
                     " VALUES (current_org(), $1, $2, $3, $4)"
                     " ON CONFLICT (org_id, provider) DO UPDATE SET kek_id = EXCLUDED.kek_id,"
                     "   nonce = EXCLUDED.nonce, ciphertext = EXCLUDED.ciphertext,"
                     "   updated_at = now()",
                     4, v, len, fmt, 0, NULL, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_keys_get(db_pool *p, const char *org, orch_key_row **rows, size_t *n, char *err,
                        size_t errlen) {
    PGresult *r = NULL;
    *rows = NULL;
    *n = 0;
    TX_BEGIN(org);
    rc = db_exec_bin(c,
                     "SELECT provider, kek_id, nonce, ciphertext FROM provider_keys"
                     " ORDER BY provider",
                     0, NULL, NULL, NULL, 1, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) > 0) {
        int m = PQntuples(r);
        orch_key_row *out = calloc((size_t)m, sizeof *out);
        if (!out) rc = DB_ENOMEM;
        for (int i = 0; rc == DB_OK && i < m; i++) {
            snprintf(out[i].provider, sizeof out[i].provider, "%.*s", PQgetlength(r, i, 0),
                     PQgetvalue(r, i, 0));
            snprintf(out[i].kid, sizeof out[i].kid, "%.*s", PQgetlength(r, i, 1),
                     PQgetvalue(r, i, 1));
            if (PQgetlength(r, i, 2) == 12) memcpy(out[i].nonce, PQgetvalue(r, i, 2), 12);
            out[i].ctlen = (size_t)PQgetlength(r, i, 3);
            out[i].ct = malloc(out[i].ctlen ? out[i].ctlen : 1);
            if (!out[i].ct)
                rc = DB_ENOMEM;
            else
                memcpy(out[i].ct, PQgetvalue(r, i, 3), out[i].ctlen);
        }
        if (rc == DB_OK) {
            *rows = out;
            *n = (size_t)m;
        } else {
            orch_store_keys_free(out, (size_t)m);
        }
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

void orch_store_keys_free(orch_key_row *rows, size_t n) {
    for (size_t i = 0; rows && i < n; i++)
        free(rows[i].ct);
    free(rows);
}

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
        rc = audit_tx(c, n->session_id, "session_started", n->agent_id, NULL, detail, action_id,
                      err, errlen);
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

static int terminal(const char *state) {
    return !strcmp(state, "terminated") || !strcmp(state, "error") || !strcmp(state, "crashed");
}

/* s as a JSON string literal (heap, caller frees; NULL out of memory), at most max bytes of it,
 * cut on a character boundary: audit details are jsonb, which refuses a split UTF-8 sequence. */
static char *json_str(const char *s, size_t max) {
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
 * reason (json_str, at most 1024 bytes). TerminateSession and the tree cascade share it. */
static int session_end_tx(PGconn *c, const char *session_id, const char *agent, const char *reason,
                          char *err, size_t errlen) {
    int rc = db_exec(c,
                     "UPDATE sessions SET state = 'terminated', ended_at = now(),"
                     " agent_status = CASE WHEN agent_status IN (0, 1, 2, 5) THEN 3"
                     "                     ELSE agent_status END"
                     " WHERE session_id = $1::uuid",
                     1, &session_id, NULL, err, errlen);
    char *why = json_str(reason, 1024), *detail = NULL;
    if (rc == DB_OK && (!why || asprintf(&detail, "{\"reason\":%s}", why) < 0)) {
        detail = NULL;
        rc = DB_ENOMEM;
    }
    if (rc == DB_OK)
        rc = audit_tx(c, session_id, "session_terminated", agent, NULL, detail, NULL, err, errlen);
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
            rc = session_end_tx(c, session_id, agent, reason, err, errlen);
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

int orch_store_turn_begin(db_pool *p, const char *org, const char *session_id, const char *message,
                          int max_turns, size_t max_bytes, int64_t timeout_ms, orch_turn **turns,
                          size_t *n, char *action_id, char *final_state, char *err, size_t errlen) {
    PGresult *r = NULL;
    char lim[16], tmo[32];
    *turns = NULL;
    *n = 0;
    snprintf(lim, sizeof lim, "%d", max_turns);
    snprintf(tmo, sizeof tmo, "%lld", (long long)(timeout_ms > 0 ? timeout_ms : 1));
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT state, turns, agent_id, pause_pending FROM sessions"
                 " WHERE session_id = $1::uuid FOR UPDATE",
                 1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    char agent[37] = "";
    int turn_no = 0;
    if (rc == DB_OK) {
        copy(final_state, 16, PQgetvalue(r, 0, 0));
        turn_no = atoi(PQgetvalue(r, 0, 1));
        copy(agent, sizeof agent, PQgetvalue(r, 0, 2));
        if (terminal(final_state) || !strcmp(final_state, "suspended")) rc = ORCH_ESTATE;
        /* a pause waits for the turns in flight: no new one starts meanwhile (spec: the pause
         * commits at the next message boundary) */
        if (rc == DB_OK && PQgetvalue(r, 0, 3)[0] == 't') {
            copy(final_state, 16, "pausing");
            rc = ORCH_ESTATE;
        }
    }
    PQclear(r);
    r = NULL;
    /* prior turns: newest first from the database, kept while within the byte bound, then
     * returned oldest first (the current turn is not stored yet, so it is never included) */
    if (rc == DB_OK && max_turns > 0) {
        const char *v[] = {session_id, lim};
        rc = db_exec(c,
                     "SELECT role, text FROM turns WHERE session_id = $1::uuid"
                     " ORDER BY turn_no DESC LIMIT $2::int",
                     2, v, &r, err, errlen);
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
    }
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
        rc = audit_tx(c, session_id, "message_received", agent, NULL, detail, action_id, err,
                      errlen);
    }
    if (rc != DB_OK) {
        orch_turns_free(*turns, *n);
        *turns = NULL;
        *n = 0;
    }
    return tx_end(tx, rc, err, errlen);
}

static int pause_commit_tx(PGconn *c, const char *session_id, const char *agent, const char *parent,
                           orch_pause *pz, char *err, size_t errlen);

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
        char *code = json_str(e->error_code, 64), *msg = json_str(e->error_msg, 512);
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
            rc = audit_tx(c, session_id, e->ok ? "completion" : "error", agent, parent_action_id,
                          detail, NULL, err, errlen);
        }
        free(code);
        free(msg);
        free(detail);
    }
    /* the message boundary: the last turn in flight ending commits a pending pause (a session
     * terminated meanwhile drops it) */
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
        rc = db_exec(c,
                     "UPDATE sessions SET turns_running = greatest(turns_running - 1, 0),"
                     " turn_deadline = CASE WHEN turns_running <= 1 THEN NULL"
                     "                      ELSE turn_deadline END,"
                     " pause_pending = pause_pending AND state = 'active'"
                     " WHERE session_id = $1::uuid"
                     " RETURNING pause_pending AND turns_running = 0, pause_reason, pause_source,"
                     "           pause_correlation_id",
                     1, &session_id, &r, err, errlen);
        orch_pause pz = {0};
        int commit = rc == DB_OK && PQntuples(r) == 1 && PQgetvalue(r, 0, 0)[0] == 't';
        if (commit) {
            copy(pz.reason, sizeof pz.reason, PQgetvalue(r, 0, 1));
            pz.source = atoi(PQgetvalue(r, 0, 2));
            copy(pz.correlation_id, sizeof pz.correlation_id, PQgetvalue(r, 0, 3));
        }
        PQclear(r);
        r = NULL;
        if (commit) rc = pause_commit_tx(c, session_id, agent, NULL, &pz, err, errlen);
        if (rc == DB_OK && commit && e->paused) {
            *e->paused = pz;
            e->paused->committed = 1;
        }
    }
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

/* ---- pause, resume, provenance ---- */

/* the newest checkpoint of a session: its key "<session_id>:<loop_iteration>" and iteration
 * ("" and 0 when it has none) */
static int latest_checkpoint_tx(PGconn *c, const char *session_id, char key[64], int *loop,
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
static int pause_commit_tx(PGconn *c, const char *session_id, const char *agent, const char *parent,
                           orch_pause *pz, char *err, size_t errlen) {
    PGresult *r = NULL;
    char src[16], loopbuf[16];
    int loop = 0;
    int rc = latest_checkpoint_tx(c, session_id, pz->checkpoint_key, &loop, err, errlen);
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
    char *reason = json_str(pz->reason, 1024), *corr = json_str(pz->correlation_id, 256);
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
        rc = audit_tx(c, session_id, "session_paused", agent, parent, detail, NULL, err, errlen);
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
            rc = pause_commit_tx(c, session_id, agent, NULL, out, err, errlen);
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
                             char *err, size_t errlen) {
    PGresult *r = NULL;
    *pending = 0;
    TX_BEGIN(org);
    rc = db_exec(c, "SELECT pause_pending FROM sessions WHERE session_id = $1::uuid", 1,
                 &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) *pending = PQgetvalue(r, 0, 0)[0] == 't';
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
    if (rc == DB_OK)
        rc = latest_checkpoint_tx(c, session_id, key, &out->resumed_at_loop, err, errlen);
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
        char *why = json_str(reason, 1024), *detail = NULL;
        if (!why || asprintf(&detail,
                             "{\"reason\":%s,\"resumed_at_loop\":%d,\"checkpoint_key\":\"%s\","
                             "\"operator_input_bytes\":%zu}",
                             why, out->resumed_at_loop, key,
                             operator_input ? strlen(operator_input) : 0) < 0) {
            detail = NULL;
            rc = DB_ENOMEM;
        }
        if (rc == DB_OK)
            rc = audit_tx(c, session_id, "session_resumed", agent, NULL, detail, NULL, err, errlen);
        free(why);
        free(detail);
    }
    return tx_end(tx, rc, err, errlen);
}

/* A row verifies when its hash recomputes from its fields (audit_tx's formula) and its
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

/* ---- workflow agent steps ---- */

int orch_store_step_claim(db_pool *p, const char *org, const char *key, const char *run_id,
                          unsigned char **result, size_t *len, char *err, size_t errlen) {
    PGresult *r = NULL;
    *result = NULL;
    *len = 0;
    TX_BEGIN(org);
    const char *v[] = {key, run_id};
    rc = db_exec(c,
                 "INSERT INTO step_results (idempotency_key, org_id, run_id, state)"
                 " VALUES ($1, current_org(), $2, 'running') ON CONFLICT DO NOTHING",
                 2, v, NULL, err, errlen);
    if (rc == DB_OK)
        rc = db_exec_bin(c,
                         "SELECT state, result FROM step_results WHERE idempotency_key = $1"
                         " FOR UPDATE",
                         1, v, NULL, NULL, 1, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1 && !strncmp(PQgetvalue(r, 0, 0), "done", 4) &&
        !PQgetisnull(r, 0, 1)) {
        *len = (size_t)PQgetlength(r, 0, 1);
        *result = malloc(*len ? *len : 1);
        if (!*result)
            rc = DB_ENOMEM;
        else {
            memcpy(*result, PQgetvalue(r, 0, 1), *len);
            rc = ORCH_EREPLAY;
        }
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_step_finish(db_pool *p, const char *org, const char *key, const char *session_id,
                           const unsigned char *result, size_t len, char *err, size_t errlen) {
    TX_BEGIN(org);
    const char *v[] = {key, session_id && session_id[0] ? session_id : NULL, (const char *)result};
    int lens[] = {0, 0, (int)len}, fmt[] = {0, 0, 1};
    rc = db_exec_bin(c,
                     "UPDATE step_results SET state = 'done', session_id = $2::uuid, result = $3,"
                     " finished_at = now() WHERE idempotency_key = $1",
                     3, v, lens, fmt, 0, NULL, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

/* ---- subagent trees (ListChildren, GetParentSession, GetSubagentTree,
 *      TerminateSubagentTree; migrations/004_subagents.sql) ---- */

/* started_at in whole microseconds (timestamptz's resolution): the keyset of ListChildren's
 * page tokens compares this very expression */
#define US_STARTED "(extract(epoch FROM s.started_at) * 1000000)::bigint"
/* a SubagentLink: the sessions row s joined with its bridge row b (link_row's 12 columns) */
// clang-format off
#define LINK_COLS                                                                                  \
    "s.session_id::text, coalesce(s.parent_session_id::text, ''),"                                 \
    " coalesce(s.root_session_id, s.session_id)::text, s.delegation_depth, s.agent_id::text,"      \
    " s.state, " US_STARTED ","                                                                    \
    " coalesce((extract(epoch FROM s.ended_at) * 1000000)::bigint, 0),"                            \
    " coalesce(b.id::text, ''), coalesce(b.subagent_role, ''), coalesce(b.status, ''),"            \
    " CASE WHEN b.status <> 'ok' THEN coalesce(b.error_code, '') ELSE '' END"
// clang-format on
#define LINK_FROM                                                                                  \
    " FROM sessions s LEFT JOIN subagent_invocations b ON b.child_session_id = s.session_id"

static void link_row(PGresult *r, int i, int col, orch_link *l) {
    memset(l, 0, sizeof *l);
    copy(l->session_id, sizeof l->session_id, PQgetvalue(r, i, col));
    copy(l->parent_session_id, sizeof l->parent_session_id, PQgetvalue(r, i, col + 1));
    copy(l->root_session_id, sizeof l->root_session_id, PQgetvalue(r, i, col + 2));
    l->depth = atoi(PQgetvalue(r, i, col + 3));
    copy(l->agent_id, sizeof l->agent_id, PQgetvalue(r, i, col + 4));
    copy(l->state, sizeof l->state, PQgetvalue(r, i, col + 5));
    l->started_us = to_ms(PQgetvalue(r, i, col + 6));
    l->ended_us = to_ms(PQgetvalue(r, i, col + 7));
    copy(l->invocation_id, sizeof l->invocation_id, PQgetvalue(r, i, col + 8));
    copy(l->role, sizeof l->role, PQgetvalue(r, i, col + 9));
    copy(l->result_status, sizeof l->result_status, PQgetvalue(r, i, col + 10));
    copy(l->error_code, sizeof l->error_code, PQgetvalue(r, i, col + 11));
}

int orch_store_parent_get(db_pool *p, const char *org, const char *session_id, int *is_root,
                          orch_link *parent, char *err, size_t errlen) {
    PGresult *r = NULL;
    *is_root = 0;
    memset(parent, 0, sizeof *parent);
    TX_BEGIN(org);
    /* the parent's own row (s), and the bridge row of the edge parent -> this session (b) */
    rc = db_exec(
        c,
        "SELECT q.parent_session_id IS NULL, coalesce(q.parent_session_id::text, ''), " LINK_COLS
        " FROM sessions q"
        " LEFT JOIN sessions s ON s.session_id = q.parent_session_id"
        " LEFT JOIN subagent_invocations b ON b.child_session_id = q.session_id"
        " WHERE q.session_id = $1::uuid",
        1, &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        *is_root = PQgetvalue(r, 0, 0)[0] == 't';
        if (!*is_root) {
            link_row(r, 0, 2, parent);
            /* a parent row no longer readable still names its id */
            if (!parent->session_id[0])
                copy(parent->session_id, sizeof parent->session_id, PQgetvalue(r, 0, 1));
        }
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_children(db_pool *p, const char *org, const char *parent_id, int64_t after_us,
                        const char *after_id, int limit, orch_link **rows, size_t *n, int *more,
                        int64_t *total, char *err, size_t errlen) {
    PGresult *r = NULL;
    char us[32], lim[16];
    *rows = NULL;
    *n = 0;
    *more = 0;
    *total = 0;
    snprintf(us, sizeof us, "%lld", (long long)after_us);
    snprintf(lim, sizeof lim, "%d", limit + 1);
    TX_BEGIN(org);
    rc = db_exec(c,
                 "SELECT EXISTS (SELECT 1 FROM sessions WHERE session_id = $1::uuid),"
                 " (SELECT count(*) FROM sessions WHERE parent_session_id = $1::uuid)",
                 1, &parent_id, &r, err, errlen);
    if (rc == DB_OK && PQgetvalue(r, 0, 0)[0] != 't') rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) *total = atoll(PQgetvalue(r, 0, 1));
    PQclear(r);
    r = NULL;
    if (rc == DB_OK) {
        const char *v[] = {parent_id, after_id && after_id[0] ? us : NULL,
                           after_id && after_id[0] ? after_id : NULL, lim};
        rc = db_exec(c,
                     "SELECT " LINK_COLS LINK_FROM " WHERE s.parent_session_id = $1::uuid"
                     " AND ($2::bigint IS NULL"
                     "      OR (" US_STARTED ", s.session_id) > ($2::bigint, $3::uuid))"
                     " ORDER BY " US_STARTED ", s.session_id LIMIT $4::int",
                     4, v, &r, err, errlen);
    }
    if (rc == DB_OK) {
        int m = PQntuples(r);
        if (m > limit) {
            *more = 1;
            m = limit;
        }
        orch_link *out = calloc((size_t)(m ? m : 1), sizeof *out);
        if (!out) rc = DB_ENOMEM;
        for (int i = 0; out && i < m; i++)
            link_row(r, i, 0, &out[i]);
        *rows = out;
        *n = out ? (size_t)m : 0;
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

/* One statement: a recursive walk, one level per step, that reads at most fanout + 1 children
 * of each node (the extra one only marks the cut and is never descended into), stops at
 * max_depth, and orders the nodes depth-first by the path of sibling ranks. A level's nodes
 * past its first max_nodes in that order are pruned (they and their subtrees come after the
 * first max_nodes of the DFS order), so a step reads at most max_nodes * (fanout + 1) rows
 * whatever the size of the tree. Columns: over (the fan-out cut happened anywhere), cut (a
 * node at max_depth that has children), then the link. */
int orch_store_tree(db_pool *p, const char *org, const char *session_id, int max_depth, int fanout,
                    int max_nodes, orch_link **rows, size_t *n, int *cut_depth, int *cut_fanout,
                    char *err, size_t errlen) {
    PGresult *r = NULL;
    char depth[16], fan[16], cap[16];
    *rows = NULL;
    *n = 0;
    *cut_depth = 0;
    *cut_fanout = 0;
    snprintf(depth, sizeof depth, "%d", max_depth);
    snprintf(fan, sizeof fan, "%d", fanout);
    snprintf(cap, sizeof cap, "%d", max_nodes + 1);
    TX_BEGIN(org);
    const char *v[] = {session_id, depth, fan, cap};
    rc = db_exec(c,
                 "WITH RECURSIVE t AS ("
                 "   SELECT session_id, 0 AS lvl, ARRAY[]::bigint[] AS path, false AS over,"
                 "          false AS pruned"
                 "   FROM sessions WHERE session_id = $1::uuid"
                 " UNION ALL"
                 "   SELECT k.session_id, t.lvl + 1, t.path || k.rn, k.rn > $3::int,"
                 "          row_number() OVER (ORDER BY k.rn > $3::int, t.path || k.rn)"
                 "            > $4::int - 1"
                 "   FROM t CROSS JOIN LATERAL ("
                 "     SELECT x.session_id, row_number() OVER (ORDER BY x.started_at,"
                 "            x.session_id) AS rn"
                 "     FROM sessions x WHERE x.parent_session_id = t.session_id"
                 "     ORDER BY x.started_at, x.session_id LIMIT $3::int + 1) k"
                 "   WHERE t.lvl < $2::int AND NOT t.over AND NOT t.pruned)"
                 " SELECT (SELECT bool_or(over) FROM t),"
                 "   t.lvl = $2::int AND EXISTS (SELECT 1 FROM sessions y"
                 "                               WHERE y.parent_session_id = t.session_id),"
                 "   " LINK_COLS " FROM t JOIN sessions s ON s.session_id = t.session_id"
                 " LEFT JOIN subagent_invocations b ON b.child_session_id = s.session_id"
                 " WHERE NOT t.over AND NOT t.pruned ORDER BY t.path LIMIT $4::int",
                 4, v, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK) {
        int m = PQntuples(r);
        /* the node bound cuts the DFS order like a fan-out cut: the caller pages on */
        if (m > max_nodes) {
            m = max_nodes;
            *cut_fanout = 1;
        }
        if (PQgetvalue(r, 0, 0)[0] == 't') *cut_fanout = 1;
        orch_link *out = calloc((size_t)m, sizeof *out);
        if (!out) rc = DB_ENOMEM;
        for (int i = 0; out && i < m; i++) {
            if (PQgetvalue(r, i, 1)[0] == 't') *cut_depth = max_depth;
            link_row(r, i, 2, &out[i]);
        }
        *rows = out;
        *n = out ? (size_t)m : 0;
    }
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

/* The subtree (cycle-safe: UNION drops a session met again; the walk stops once it has found
 * one session more than the bound, $3 being the bound + 1, with the node itself), its rows
 * locked in one order (parents before children, then by start) so two overlapping cascades
 * queue rather than deadlock. */
static const char *SQL_SUBTREE =
    "WITH RECURSIVE d AS ("
    "   SELECT $1::uuid AS session_id"
    " UNION"
    "   SELECT x.session_id FROM sessions x JOIN d ON x.parent_session_id = d.session_id)"
    " SELECT s.session_id, s.state, s.agent_id, s.worker FROM sessions s"
    " WHERE s.session_id IN (SELECT session_id FROM d LIMIT $3::int + 1)"
    "   AND ($2::bool OR s.session_id <> $1::uuid)"
    " ORDER BY s.delegation_depth, s.started_at, s.session_id LIMIT $3::int FOR UPDATE OF s";

int orch_store_tree_terminate(db_pool *p, const char *org, const char *session_id, int include_root,
                              const char *reason, int max_sessions, orch_ended **out, size_t *n,
                              int *bridge_rows, char *err, size_t errlen) {
    PGresult *r = NULL, *b = NULL;
    char lim[16];
    char *ids = NULL;
    size_t idlen = 0;
    FILE *f = NULL;
    orch_ended *e = NULL;
    *out = NULL;
    *n = 0;
    *bridge_rows = 0;
    snprintf(lim, sizeof lim, "%d", max_sessions + 1);
    TX_BEGIN(org);
    rc = db_exec(c, "SELECT 1 FROM sessions WHERE session_id = $1::uuid", 1, &session_id, &r, err,
                 errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    PQclear(r);
    r = NULL;
    if (rc != DB_OK) goto done;
    const char *v[] = {session_id, include_root ? "true" : "false", lim};
    rc = db_exec(c, SQL_SUBTREE, 3, v, &r, err, errlen);
    if (rc != DB_OK) goto done;
    int m = PQntuples(r);
    if (m > max_sessions) {
        rc = util_errf(err, errlen, ORCH_ESTATE,
                       "the tree has more than %d sessions: terminate its subtrees first",
                       max_sessions);
        goto done;
    }
    e = calloc((size_t)(m ? m : 1), sizeof *e);
    f = open_memstream(&ids, &idlen);
    if (!e || !f) {
        rc = DB_ENOMEM;
        goto done;
    }
    fputc('{', f);
    int ended = 0;
    for (int i = 0; rc == DB_OK && i < m; i++) {
        copy(e[i].session_id, sizeof e[i].session_id, PQgetvalue(r, i, 0));
        copy(e[i].worker, sizeof e[i].worker, PQgetvalue(r, i, 3));
        if (terminal(PQgetvalue(r, i, 1))) continue; /* skipped: already over */
        e[i].terminated = 1;
        rc = session_end_tx(c, e[i].session_id, PQgetvalue(r, i, 2), reason, err, errlen);
        fprintf(f, "%s%s", ended++ ? "," : "", e[i].session_id);
    }
    fputc('}', f);
    fclose(f);
    f = NULL;
    /* the invocations still waiting on a session this call ended will never get a result */
    if (rc == DB_OK && ended) {
        const char *bv[] = {ids};
        rc = db_exec(c,
                     "UPDATE subagent_invocations SET status = 'cancelled', finished_at = now()"
                     " WHERE status = 'pending' AND child_session_id = ANY ($1::uuid[])",
                     1, bv, &b, err, errlen);
        if (rc == DB_OK) *bridge_rows = atoi(PQcmdTuples(b));
    }
    if (rc == DB_OK) {
        *out = e;
        *n = (size_t)m;
        e = NULL;
    }
done:
    if (f) fclose(f);
    free(ids);
    free(e);
    PQclear(b);
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}
