/* The orchestrator's SQL: worker liveness and crash recovery (store.h; migration 007). */
#include "store_int.h"

int orch_store_worker_seen(db_pool *p, const char *worker_id, int active_sessions, char *err,
                           size_t errlen) {
    char n[16];
    snprintf(n, sizeof n, "%d", active_sessions);
    TX_BEGIN(NULL);
    rc = db_exec(c,
                 "INSERT INTO worker_liveness (worker_id, last_seen, active_sessions)"
                 " VALUES ($1, now(), $2::int) ON CONFLICT (worker_id) DO UPDATE"
                 " SET last_seen = now(), active_sessions = EXCLUDED.active_sessions",
                 2, (const char *[]){worker_id, n}, NULL, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_recovery_claim(db_pool *p, const char *owner, int64_t dead_after_ms,
                              int64_t lease_ms, size_t max, orch_recovery **out, size_t *n,
                              char *err, size_t errlen) {
    char dead[24], lease[24], lim[24];
    PGresult *r = NULL;
    *out = NULL;
    *n = 0;
    snprintf(dead, sizeof dead, "%lld", (long long)dead_after_ms);
    snprintf(lease, sizeof lease, "%lld", (long long)lease_ms);
    snprintf(lim, sizeof lim, "%zu", max);
    TX_BEGIN(NULL);
    /* SKIP LOCKED: two replicas sweeping at once split the rows instead of queueing on them;
     * the lease condition makes a claim exclusive until it expires or is released */
    rc = db_exec(c,
                 "UPDATE session_placement sp SET lease_owner = $1,"
                 " lease_until = now() + $3::bigint * interval '1 millisecond'"
                 " WHERE sp.session_id IN (SELECT s.session_id FROM session_placement s"
                 "   JOIN worker_liveness w ON w.worker_id = s.worker"
                 "   WHERE s.live AND s.worker <> ''"
                 "   AND w.last_seen < now() - $2::bigint * interval '1 millisecond'"
                 "   AND (s.lease_until IS NULL OR s.lease_until < now())"
                 "   LIMIT $4::int FOR UPDATE OF s SKIP LOCKED)"
                 " RETURNING sp.session_id, sp.org_id, sp.worker",
                 4, (const char *[]){owner, dead, lease, lim}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) > 0) {
        *out = calloc((size_t)PQntuples(r), sizeof **out);
        if (!*out) rc = util_errf(err, errlen, DB_ENOMEM, "out of memory");
        for (int i = 0; *out && i < PQntuples(r); i++) {
            copy((*out)[i].session_id, sizeof(*out)[i].session_id, PQgetvalue(r, i, 0));
            copy((*out)[i].org_id, sizeof(*out)[i].org_id, PQgetvalue(r, i, 1));
            copy((*out)[i].worker, sizeof(*out)[i].worker, PQgetvalue(r, i, 2));
            (*n)++;
        }
    }
    PQclear(r);
    rc = tx_end(tx, rc, err, errlen);
    if (rc != DB_OK) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
    return rc;
}

static int release_tx(PGconn *c, const char *owner, const char *session_id, char *err,
                      size_t errlen) {
    return db_exec(c,
                   "UPDATE session_placement SET lease_owner = NULL, lease_until = NULL"
                   " WHERE session_id = $1::uuid AND lease_owner = $2",
                   2, (const char *[]){session_id, owner}, NULL, err, errlen);
}

int orch_store_recovery_release(db_pool *p, const char *owner, const char *session_id, char *err,
                                size_t errlen) {
    TX_BEGIN(NULL);
    rc = release_tx(c, owner, session_id, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

/* Locks the session row; ORCH_ESTATE unless it is live. agent: its agent id. */
static int live_tx(PGconn *c, const char *session_id, char agent[37], char *err, size_t errlen) {
    PGresult *r = NULL;
    int rc =
        db_exec(c, "SELECT state, agent_id FROM sessions WHERE session_id = $1::uuid FOR UPDATE", 1,
                &session_id, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    if (rc == DB_OK && strcmp(PQgetvalue(r, 0, 0), "active") &&
        strcmp(PQgetvalue(r, 0, 0), "initializing"))
        rc = ORCH_ESTATE;
    if (rc == DB_OK) copy(agent, 37, PQgetvalue(r, 0, 1));
    PQclear(r);
    return rc;
}

int orch_store_session_placed(db_pool *p, const char *org, const char *session_id, const char *from,
                              const char *worker, int loop, char *err, size_t errlen) {
    char agent[37], detail[2048];
    TX_BEGIN(org);
    rc = live_tx(c, session_id, agent, err, errlen);
    if (rc == DB_OK)
        rc = db_exec(c, "UPDATE sessions SET worker = $2 WHERE session_id = $1::uuid", 2,
                     (const char *[]){session_id, worker}, NULL, err, errlen);
    if (rc == DB_OK && from) {
        char *f = orch_store__json_str(from, 128), *t = orch_store__json_str(worker, 128);
        if (!f || !t)
            rc = util_errf(err, errlen, DB_ENOMEM, "out of memory");
        else
            snprintf(detail, sizeof detail,
                     "{\"from_worker\":%s,\"to_worker\":%s,\"loop_iteration\":%d}", f, t, loop);
        free(f);
        free(t);
        if (rc == DB_OK)
            rc = orch_store__audit_tx(c, session_id, "session_recovered", agent, NULL, detail, NULL,
                                      err, errlen);
    }
    /* whoever holds the lease, the session is placed: a sweep of a slower replica whose lease
     * expired finds it on a live worker */
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE session_placement SET lease_owner = NULL, lease_until = NULL"
                     " WHERE session_id = $1::uuid",
                     1, &session_id, NULL, err, errlen);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_session_crashed(db_pool *p, const char *org, const char *session_id,
                               const char *worker, int loop, const char *why, char *err,
                               size_t errlen) {
    char agent[37], *detail = NULL;
    TX_BEGIN(org);
    rc = live_tx(c, session_id, agent, err, errlen);
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE sessions SET state = 'crashed', agent_status = 4, last_error = $2,"
                     " worker = '', ended_at = now() WHERE session_id = $1::uuid",
                     2, (const char *[]){session_id, why}, NULL, err, errlen);
    if (rc == DB_OK) {
        char *w = orch_store__json_str(worker, 128), *y = orch_store__json_str(why, 512);
        if (!w || !y ||
            asprintf(&detail, "{\"worker\":%s,\"loop_iteration\":%d,\"reason\":%s}", w, loop, y) <
                0) {
            detail = NULL;
            rc = util_errf(err, errlen, DB_ENOMEM, "out of memory");
        }
        free(w);
        free(y);
    }
    if (rc == DB_OK)
        rc = orch_store__audit_tx(c, session_id, "session_crashed", agent, NULL, detail, NULL, err,
                                  errlen);
    if (rc == DB_OK)
        rc = db_exec(c,
                     "UPDATE session_placement SET lease_owner = NULL, lease_until = NULL"
                     " WHERE session_id = $1::uuid",
                     1, &session_id, NULL, err, errlen);
    free(detail);
    return tx_end(tx, rc, err, errlen);
}
