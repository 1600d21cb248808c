/* The orchestrator's SQL: the audit chain, agents, provider keys (store.h). */
#include "store_int.h"

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

int orch_store__audit_tx(PGconn *c, const char *sid, const char *type, const char *agent_id,
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
    rc = orch_store__audit_tx(c, session_id, type, agent_id, parent_action_id, detail_json,
                              action_id, err, errlen);
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
