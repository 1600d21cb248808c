/* The workflow engine's SQL of the run queue (leases, wakes, fencing), the outbox the relay
 * publishes from (store.h). */
#include "store_int.h"

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
     * may have leased it since the snapshot. The rows to lease are picked in a CTE, which
     * Postgres runs once: as an `IN (subquery ... LIMIT)` the subquery could be run again for
     * the update (its conditions read clock_timestamp(), and SKIP LOCKED sees other claims'
     * locks come and go), leasing more rows than LIMIT. */
    return ex(tx,
              "WITH busy AS (SELECT org_id, count(*) AS n FROM " S "run_queue "
              "  WHERE lease_until >= clock_timestamp() GROUP BY org_id), "
              "ranked AS (SELECT d.run_id, d.wake_at, coalesce(b.n, 0) + row_number() "
              "  OVER (PARTITION BY d.org_id ORDER BY d.wake_at) AS turn FROM " S "run_queue d "
              "  LEFT JOIN busy b ON b.org_id = d.org_id WHERE d.wake_at <= now() "
              "  AND (d.lease_until IS NULL OR d.lease_until < clock_timestamp())), "
              "picked AS MATERIALIZED (SELECT r.run_id FROM ranked k JOIN " S "run_queue r "
              "  ON r.run_id = k.run_id WHERE r.wake_at <= now() "
              "  AND (r.lease_until IS NULL OR r.lease_until < clock_timestamp()) "
              "  ORDER BY k.turn, k.wake_at LIMIT $3::int FOR UPDATE OF r SKIP LOCKED) "
              "UPDATE " S "run_queue q SET lease_owner = $1, "
              "lease_until = clock_timestamp() + $2::bigint * interval '1 millisecond' "
              "FROM picked WHERE q.run_id = picked.run_id "
              "RETURNING q.run_id, q.org_id, q.wake_gen",
              3, p, out, err, errlen);
}

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
