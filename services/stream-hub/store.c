/* Every SQL statement of stream-hub (see store.h). */
#include "store.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ids.h"
#include "util.h"

#define fail(err, errlen, ...) util_errf((err), (errlen), DB_ERR, __VA_ARGS__)

void hs_blobs_free(hs_blobs *b) {
    for (size_t i = 0; i < b->n; i++)
        free(b->v[i].body);
    free(b->v);
    b->v = NULL;
    b->n = 0;
}

/* ---- writes ---- */

static const char SQL_PUT_EVENT[] =
    "INSERT INTO run_events (org_id, run_id, seq, kind, node_id, iteration, at, body) "
    "VALUES ($1, $2, $3, $4, $5, $6, CASE WHEN $7::float8 > 0 THEN to_timestamp($7::float8) "
    "ELSE now() END, $8) ON CONFLICT (run_id, seq) DO NOTHING";

/* Scope columns come with every event; the status group and the counters are only replaced by
 * a newer seq than the one that wrote them (replicas may project out of order). */
static const char SQL_PUT_RUN[] =
    "INSERT INTO runs AS r (org_id, run_id, workflow_id, workflow_name, team_id, visibility, "
    " owner_id, display_name, status, needs_input, needs_approval, prompt_kind, prompt_id, "
    " asked_by_role, is_waiting, status_seq, nodes_total, nodes_done, counters_seq, last_seq, "
    " workflow_deleted) "
    "VALUES ($1, $2, $3, $4, $5, CASE WHEN $6 = '' THEN 'team' ELSE $6 END, $7, $8, "
    " CASE WHEN $9 = '' THEN 'pending' ELSE $9 END, $10, $11, $12, $13, $14, $15, "
    " CASE WHEN $9 = '' THEN 0 ELSE $16::bigint END, $17, $18, "
    " CASE WHEN $19 THEN $16::bigint ELSE 0 END, $16::bigint, $20::boolean) "
    "ON CONFLICT (run_id) DO UPDATE SET "
    " workflow_id = CASE WHEN EXCLUDED.workflow_id <> '' THEN EXCLUDED.workflow_id "
    "   ELSE r.workflow_id END, "
    " workflow_name = CASE WHEN EXCLUDED.workflow_name <> '' THEN EXCLUDED.workflow_name "
    "   ELSE r.workflow_name END, "
    " team_id = CASE WHEN $5 <> '' THEN EXCLUDED.team_id ELSE r.team_id END, "
    " visibility = CASE WHEN $6 <> '' THEN EXCLUDED.visibility ELSE r.visibility END, "
    " owner_id = CASE WHEN EXCLUDED.owner_id <> '' THEN EXCLUDED.owner_id ELSE r.owner_id END, "
    " display_name = CASE WHEN EXCLUDED.display_name <> '' THEN EXCLUDED.display_name "
    "   ELSE r.display_name END, "
    " status = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint THEN EXCLUDED.status "
    "   ELSE r.status END, "
    " needs_input = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint THEN EXCLUDED.needs_input "
    "   ELSE r.needs_input END, "
    " needs_approval = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint "
    "   THEN EXCLUDED.needs_approval ELSE r.needs_approval END, "
    " prompt_kind = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint THEN EXCLUDED.prompt_kind "
    "   ELSE r.prompt_kind END, "
    " prompt_id = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint THEN EXCLUDED.prompt_id "
    "   ELSE r.prompt_id END, "
    " asked_by_role = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint "
    "   THEN EXCLUDED.asked_by_role ELSE r.asked_by_role END, "
    " is_waiting = CASE WHEN $9 <> '' AND r.status_seq < $16::bigint THEN EXCLUDED.is_waiting "
    "   ELSE r.is_waiting END, "
    " status_seq = CASE WHEN $9 <> '' THEN greatest(r.status_seq, $16::bigint) "
    "   ELSE r.status_seq END, "
    " nodes_total = CASE WHEN $19 AND r.counters_seq < $16::bigint THEN EXCLUDED.nodes_total "
    "   ELSE r.nodes_total END, "
    " nodes_done = CASE WHEN $19 AND r.counters_seq < $16::bigint THEN EXCLUDED.nodes_done "
    "   ELSE r.nodes_done END, "
    " counters_seq = CASE WHEN $19 THEN greatest(r.counters_seq, $16::bigint) "
    "   ELSE r.counters_seq END, "
    " last_seq = greatest(r.last_seq, $16::bigint), updated_at = now(), "
    /* sticky: a soft delete is not undone, whatever the order of the events */
    " workflow_deleted = r.workflow_deleted OR EXCLUDED.workflow_deleted";

/* The end of a run's first block of consecutive seqs, scanning from `start` (a seq known to be
 * in that block, or 0): the first seq whose successor is missing. An ordered index scan that
 * stops there ($1: the run). */
#define SQL_BLOCK_END(start)                                                                       \
    "(SELECT t.seq FROM (SELECT e.seq, lead(e.seq) OVER (ORDER BY e.seq) AS nxt "                  \
    " FROM run_events e WHERE e.run_id = $1 AND e.seq >= " start ") t "                            \
    " WHERE t.nxt IS DISTINCT FROM t.seq + 1 ORDER BY t.seq LIMIT 1)"

/* Keeps runs.first_seq and runs.contig_seq (migrations/003_contiguous.sql) for event $2 of run
 * $1: an event just after the prefix extends it (through any block it joins), an event below
 * the first seq starts it again from the bottom, a later one (a hole below it) changes
 * nothing; unknown (NULL, rows older than the columns) is computed once from run_events. */
#define CONTIG_FROM                                                                                \
    "CASE WHEN r.contig_seq IS NULL OR r.first_seq IS NULL OR $2::bigint < r.first_seq "           \
    " THEN 0 ELSE r.contig_seq END"
#define CONTIG_WALK SQL_BLOCK_END(CONTIG_FROM)
static const char SQL_PUT_CONTIG[] =
    "UPDATE runs r SET first_seq = least(coalesce(r.first_seq, $2::bigint), $2::bigint), "
    " contig_seq = coalesce(" CONTIG_WALK ", r.contig_seq) "
    "WHERE r.run_id = $1 AND (r.contig_seq IS NULL OR r.first_seq IS NULL "
    " OR $2::bigint < r.first_seq OR $2::bigint = r.contig_seq + 1)";

/* The node's newest state (migrations/004_run_nodes.sql): replaced only by a newer seq, so the
 * order replicas project in and redeliveries change nothing. */
static const char SQL_PUT_NODE[] =
    "INSERT INTO run_nodes AS x (org_id, run_id, node_id, iteration, seq, status, needs_input, "
    " needs_approval, prompt_kind, prompt_id, asked_by_role, is_waiting) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12) "
    "ON CONFLICT (run_id, node_id, iteration) DO UPDATE SET seq = EXCLUDED.seq, "
    " status = EXCLUDED.status, needs_input = EXCLUDED.needs_input, "
    " needs_approval = EXCLUDED.needs_approval, prompt_kind = EXCLUDED.prompt_kind, "
    " prompt_id = EXCLUDED.prompt_id, asked_by_role = EXCLUDED.asked_by_role, "
    " is_waiting = EXCLUDED.is_waiting WHERE x.seq < EXCLUDED.seq";

static const char *b(int v) {
    return v ? "t" : "f";
}

static const char *s(const char *v) {
    return v ? v : "";
}

int hs_put_run_event(db_pool *p, const hs_run_event *e, char *err, size_t errlen) {
    db_tx *tx = NULL;
    char seq[24], iter[16], at[40], kind[2] = {e->kind, 0}, pk[16], tot[16], done[16];
    int rc = db_tx_begin(p, e->org_id, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    snprintf(seq, sizeof seq, "%lld", (long long)e->seq);
    snprintf(iter, sizeof iter, "%d", e->iteration);
    snprintf(at, sizeof at, "%.6f", e->at_s);
    snprintf(pk, sizeof pk, "%d", e->prompt_kind);
    snprintf(tot, sizeof tot, "%d", e->nodes_total);
    snprintf(done, sizeof done, "%d", e->nodes_done);
    const char *ev[8] = {e->org_id,     e->run_id, seq, kind,
                         s(e->node_id), iter,      at,  (const char *)e->body};
    int lens[8] = {0, 0, 0, 0, 0, 0, 0, (int)e->len};
    int fmts[8] = {0, 0, 0, 0, 0, 0, 0, 1};
    rc = db_exec_bin(db_tx_conn(tx), SQL_PUT_EVENT, 8, ev, lens, fmts, 0, NULL, err, errlen);
    if (rc != DB_OK) goto done;
    if (e->kind == 'n' && e->node_id && e->node_id[0]) {
        const char *nv[12] = {
            e->org_id, e->run_id,         e->node_id,          iter,
            seq,       s(e->node_status), b(e->needs_input),   b(e->needs_approval),
            pk,        s(e->prompt_id),   s(e->asked_by_role), b(e->is_waiting)};
        rc = db_exec(db_tx_conn(tx), SQL_PUT_NODE, 12, nv, NULL, err, errlen);
        if (rc != DB_OK) goto done;
    }
    const char *rv[20] = {e->org_id,
                          e->run_id,
                          s(e->workflow_id),
                          s(e->workflow_name),
                          s(e->team_id),
                          s(e->visibility),
                          s(e->owner_id),
                          s(e->display_name),
                          s(e->status),
                          b(e->needs_input),
                          b(e->needs_approval),
                          pk,
                          s(e->prompt_id),
                          s(e->asked_by_role),
                          b(e->is_waiting),
                          seq,
                          tot,
                          done,
                          b(e->has_counters),
                          b(e->workflow_deleted)};
    rc = db_exec(db_tx_conn(tx), SQL_PUT_RUN, 20, rv, NULL, err, errlen);
    if (rc != DB_OK) goto done;
    /* after the upsert: the run row is locked until commit, so replicas projecting events of
     * this run advance its contiguous prefix one after the other, each seeing the others'
     * committed events (READ COMMITTED: every statement reads a fresh snapshot) */
    const char *cv[2] = {e->run_id, seq};
    rc = db_exec(db_tx_conn(tx), SQL_PUT_CONTIG, 2, cv, NULL, err, errlen);
done:
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        return rc;
    }
    return db_tx_commit(tx, err, errlen);
}

static const char SQL_PUT_TRANSCRIPT[] =
    "INSERT INTO session_events (org_id, run_id, step_name, action_id, iteration, session_id, "
    " seq, body) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) "
    "ON CONFLICT (run_id, session_id, seq) DO NOTHING";

int hs_put_transcript(db_pool *p, const hs_transcript_event *e, char *err, size_t errlen) {
    db_tx *tx = NULL;
    char iter[16], seq[16];
    int rc = db_tx_begin(p, e->org_id, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    snprintf(iter, sizeof iter, "%d", e->iteration);
    snprintf(seq, sizeof seq, "%d", e->seq);
    const char *v[8] = {e->org_id, e->run_id,        e->step_name, s(e->action_id),
                        iter,      s(e->session_id), seq,          (const char *)e->body};
    int lens[8] = {0, 0, 0, 0, 0, 0, 0, (int)e->len};
    int fmts[8] = {0, 0, 0, 0, 0, 0, 0, 1};
    rc = db_exec_bin(db_tx_conn(tx), SQL_PUT_TRANSCRIPT, 8, v, lens, fmts, 0, NULL, err, errlen);
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        return rc;
    }
    return db_tx_commit(tx, err, errlen);
}

static const char SQL_PUT_PROMPT_FRAME[] =
    "INSERT INTO prompt_frames (org_id, run_id, prompt_id, step_name, action_id, iteration, body) "
    "VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (run_id, prompt_id) DO NOTHING";

int hs_put_prompt_frame(db_pool *p, const hs_prompt_frame *e, char *err, size_t errlen) {
    db_tx *tx = NULL;
    char iter[16];
    int rc = db_tx_begin(p, e->org_id, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    snprintf(iter, sizeof iter, "%d", e->iteration);
    const char *v[7] = {e->org_id,       e->run_id, e->prompt_id,         s(e->step_name),
                        s(e->action_id), iter,      (const char *)e->body};
    int lens[7] = {0, 0, 0, 0, 0, 0, (int)e->len};
    int fmts[7] = {0, 0, 0, 0, 0, 0, 1};
    rc = db_exec_bin(db_tx_conn(tx), SQL_PUT_PROMPT_FRAME, 7, v, lens, fmts, 0, NULL, err, errlen);
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        return rc;
    }
    return db_tx_commit(tx, err, errlen);
}

/* ---- reads ---- */

static const char SQL_GET_RUN[] =
    "SELECT run_id, workflow_id, workflow_name, team_id, visibility, owner_id, display_name, "
    " status, prompt_id, asked_by_role, needs_input, needs_approval, prompt_kind, is_waiting, "
    " nodes_total, nodes_done, last_seq FROM runs";

/* A StreamVisibleRuns snapshot: the caller's visible runs (the spec's two arms: the workflow's
 * team is one of the caller's teams, or the caller owns the private workflow) under the status
 * filter, newest first, at most $5 -- chosen before anything is rolled up, so the roll-ups cost
 * per row sent, not per visible run. Each row has SQL_GET_RUN's columns and describes the whole
 * run (spec VisibleRunEvent), rolled up from each node's newest state (run_nodes): nodes_total
 * and nodes_done (terminal: done or failed, the fold of WorkflowRun.nodes_done's set),
 * is_waiting (a node parked on a wait), open_prompt_count (nodes parked on a prompt or gate)
 * and the FRESHEST open gate, from which needs_input, needs_approval, prompt_kind, prompt_id
 * and asked_by_role are all co-derived. A run without node rows, or with a node whose state is
 * unknown (status '': keys backfilled by migration 004 for runs projected before it), keeps the
 * run row's columns. Its open_prompt_count (spec: "ABSENT = not determined ...; PRESENT =
 * authoritative, including present-and-0") is 0 for a run without node rows whose run row has
 * no gate open: no node transition of it was projected, so no gate is open on it. It is
 * undetermined (NULL) only where the store cannot count: a node of unknown state, or a gate
 * the run row has from a transition naming no node. */
static const char SQL_VISIBLE_RUNS[] =
    "SELECT r.run_id, r.workflow_id, r.workflow_name, r.team_id, r.visibility, r.owner_id, "
    " r.display_name, r.status, "
    " CASE WHEN n.nodes IS NULL THEN r.prompt_id ELSE coalesce(g.prompt_id, '') END, "
    " CASE WHEN n.nodes IS NULL THEN r.asked_by_role ELSE coalesce(g.asked_by_role, '') END, "
    " CASE WHEN n.nodes IS NULL THEN r.needs_input ELSE coalesce(g.needs_input, false) END, "
    " CASE WHEN n.nodes IS NULL THEN r.needs_approval ELSE coalesce(g.needs_approval, false) END, "
    " CASE WHEN n.nodes IS NULL THEN r.prompt_kind ELSE coalesce(g.prompt_kind, 0) END, "
    " coalesce(n.waiting, r.is_waiting), coalesce(n.nodes, r.nodes_total), "
    " coalesce(n.done, r.nodes_done), r.last_seq, "
    " CASE WHEN n.nodes IS NOT NULL THEN n.open "
    "  WHEN NOT (r.needs_input OR r.needs_approval OR r.prompt_kind <> 0) "
    "   AND NOT EXISTS (SELECT 1 FROM run_nodes z WHERE z.run_id = r.run_id) THEN 0 END "
    "FROM (SELECT * FROM runs r "
    "  WHERE ((r.visibility <> 'private' AND r.team_id = ANY($2::text[])) "
    "   OR (r.visibility = 'private' AND r.owner_id = $1)) "
    "  AND ($3::boolean OR r.status = ANY($4::text[])) AND NOT r.workflow_deleted "
    "  ORDER BY r.started_at DESC, r.run_id DESC LIMIT $5) r "
    "LEFT JOIN LATERAL (SELECT count(*)::int AS nodes, "
    "  count(*) FILTER (WHERE x.status IN ('done', 'failed'))::int AS done, "
    "  count(*) FILTER (WHERE x.needs_input OR x.needs_approval)::int AS open, "
    "  bool_or(x.is_waiting) AS waiting "
    "  FROM run_nodes x WHERE x.run_id = r.run_id "
    "  HAVING count(*) > 0 AND bool_and(x.status <> '')) n ON true "
    "LEFT JOIN LATERAL (SELECT y.prompt_id, y.asked_by_role, y.needs_input, y.needs_approval, "
    "  y.prompt_kind FROM run_nodes y WHERE y.run_id = r.run_id "
    "  AND (y.needs_input OR y.needs_approval) ORDER BY y.seq DESC LIMIT 1) g ON true "
    "ORDER BY r.started_at DESC, r.run_id DESC";

static void copy_field(char *dst, size_t cap, const char *v) {
    snprintf(dst, cap, "%s", v);
}

static void run_row(PGresult *res, int i, hs_run *r) {
    memset(r, 0, sizeof *r);
    copy_field(r->run_id, sizeof r->run_id, PQgetvalue(res, i, 0));
    copy_field(r->workflow_id, sizeof r->workflow_id, PQgetvalue(res, i, 1));
    copy_field(r->workflow_name, sizeof r->workflow_name, PQgetvalue(res, i, 2));
    copy_field(r->team_id, sizeof r->team_id, PQgetvalue(res, i, 3));
    copy_field(r->visibility, sizeof r->visibility, PQgetvalue(res, i, 4));
    copy_field(r->owner_id, sizeof r->owner_id, PQgetvalue(res, i, 5));
    copy_field(r->display_name, sizeof r->display_name, PQgetvalue(res, i, 6));
    copy_field(r->status, sizeof r->status, PQgetvalue(res, i, 7));
    copy_field(r->prompt_id, sizeof r->prompt_id, PQgetvalue(res, i, 8));
    copy_field(r->asked_by_role, sizeof r->asked_by_role, PQgetvalue(res, i, 9));
    r->needs_input = PQgetvalue(res, i, 10)[0] == 't';
    r->needs_approval = PQgetvalue(res, i, 11)[0] == 't';
    r->prompt_kind = atoi(PQgetvalue(res, i, 12));
    r->is_waiting = PQgetvalue(res, i, 13)[0] == 't';
    r->nodes_total = atoi(PQgetvalue(res, i, 14));
    r->nodes_done = atoi(PQgetvalue(res, i, 15));
    r->last_seq = strtoll(PQgetvalue(res, i, 16), NULL, 10);
    if (PQnfields(res) > 17 && !PQgetisnull(res, i, 17)) {
        r->has_open_prompt_count = 1;
        r->open_prompt_count = atoi(PQgetvalue(res, i, 17));
    }
}

/* Copies rows (seq, kind, body) of res into out. */
static int copy_blobs(PGresult *res, hs_blobs *out, char *err, size_t errlen) {
    int rows = PQntuples(res);
    out->v = calloc(rows ? (size_t)rows : 1, sizeof *out->v);
    if (!out->v) return fail(err, errlen, "out of memory");
    for (int i = 0; i < rows; i++) {
        hs_blob *bl = &out->v[out->n];
        size_t len = 0;
        unsigned char *raw = PQunescapeBytea((const unsigned char *)PQgetvalue(res, i, 2), &len);
        if (!raw) return fail(err, errlen, "out of memory");
        bl->body = malloc(len ? len : 1);
        if (!bl->body) {
            PQfreemem(raw);
            return fail(err, errlen, "out of memory");
        }
        memcpy(bl->body, raw, len);
        PQfreemem(raw);
        bl->len = len;
        bl->seq = strtoll(PQgetvalue(res, i, 0), NULL, 10);
        bl->kind = PQgetvalue(res, i, 1)[0];
        out->n++;
    }
    return DB_OK;
}

/* Runs one read-only statement in a transaction of `org`; the result rows are
 * (seq, kind, body) and are copied into out. With run non-NULL, the run row is read first in
 * the same REPEATABLE READ snapshot, so the rows and run->last_seq agree. */
static int read_blobs(db_pool *p, const char *org, const char *sql, int n, const char *const *v,
                      hs_blobs *out, hs_run *run, int *found, char *err, size_t errlen) {
    db_tx *tx = NULL;
    PGresult *res = NULL;
    char rsql[512];
    out->v = NULL;
    out->n = 0;
    if (found) *found = 0;
    int rc = db_tx_begin_ex(p, org, DB_TX_READ_ONLY | (run ? DB_TX_REPEATABLE_READ : 0), &tx, err,
                            errlen);
    if (rc != DB_OK) return rc;
    if (run) {
        snprintf(rsql, sizeof rsql, "%s WHERE run_id = $1", SQL_GET_RUN);
        rc = db_exec(db_tx_conn(tx), rsql, 1, v, &res, err, errlen);
        if (rc != DB_OK) goto done;
        if (PQntuples(res) == 1) {
            run_row(res, 0, run);
            *found = 1;
        }
        PQclear(res);
        res = NULL;
    }
    rc = db_exec(db_tx_conn(tx), sql, n, v, &res, err, errlen);
    if (rc == DB_OK) rc = copy_blobs(res, out, err, errlen);
done:
    PQclear(res);
    if (rc != DB_OK) {
        hs_blobs_free(out);
        db_tx_rollback(tx);
        return rc;
    }
    return db_tx_commit(tx, err, errlen);
}

int hs_get_run(db_pool *p, const char *org, const char *run_id, hs_run *out, int *found, char *err,
               size_t errlen) {
    db_tx *tx = NULL;
    PGresult *res = NULL;
    char sql[sizeof SQL_GET_RUN + 64];
    *found = 0;
    /* an id that is not a UUID names no run: NOT_FOUND, not a database error */
    if (!ids_uuid_valid(run_id)) return DB_OK;
    snprintf(sql, sizeof sql, "%s WHERE run_id = $1", SQL_GET_RUN);
    int rc = db_tx_begin_ex(p, org, DB_TX_READ_ONLY, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    const char *v[1] = {run_id};
    rc = db_exec(db_tx_conn(tx), sql, 1, v, &res, err, errlen);
    if (rc == DB_OK && PQntuples(res) == 1) {
        run_row(res, 0, out);
        *found = 1;
    }
    PQclear(res);
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        return rc;
    }
    return db_tx_commit(tx, err, errlen);
}

/* The end of the first contiguous block of the run's seqs: events are projected by several
 * replicas in parallel, so a later seq may be committed before an earlier one; a snapshot
 * covers only what has no hole below it (the rest comes from the store or live, in order). */
/* The last seq of the run without a hole below it: the projector's runs.contig_seq, or computed
 * from run_events for a run projected before that column existed. */
#define SQL_CONTIGUOUS                                                                             \
    "(SELECT coalesce((SELECT r.contig_seq FROM runs r WHERE r.run_id = $1), " SQL_BLOCK_END(      \
        "0") ", 0))"

int hs_node_fold(db_pool *p, const char *org, const char *run_id, hs_blobs *out, hs_run *run,
                 int *found, char *err, size_t errlen) {
    /* One row per (node, iteration) from run_nodes: its newest event, fetched by primary key,
     * when that is within the prefix (the usual case); otherwise (a hole below it) the key's
     * newest event within the prefix, probed backwards on run_events_node. No walk over the
     * run's events, so no plan that depends on how many the statistics think it has. */
    static const char sql[] =
        "WITH c AS (SELECT " SQL_CONTIGUOUS " AS upto) "
        "SELECT seq, k, body FROM (SELECT l.seq, 'n' AS k, l.body FROM run_nodes n, c, LATERAL "
        "  (SELECT e.seq, e.body FROM run_events e WHERE e.run_id = $1 AND e.seq = n.seq "
        "    AND n.seq <= c.upto "
        "   UNION ALL (SELECT e.seq, e.body FROM run_events e WHERE e.run_id = $1 "
        "    AND e.kind = 'n' AND e.node_id = n.node_id AND e.iteration = n.iteration "
        "    AND e.seq <= c.upto AND n.seq > c.upto ORDER BY e.seq DESC LIMIT 1)) l "
        "  WHERE n.run_id = $1 "
        " UNION ALL SELECT upto, 'u', ''::bytea FROM c) x ORDER BY k = 'u', seq";
    const char *v[1] = {run_id};
    return read_blobs(p, org, sql, 1, v, out, run, found, err, errlen);
}

int hs_events_after(db_pool *p, const char *org, const char *run_id, int64_t after, int limit,
                    hs_blobs *out, char *err, size_t errlen) {
    static const char sql[] = "SELECT seq, kind, body FROM run_events "
                              "WHERE run_id = $1 AND seq > $2 ORDER BY seq LIMIT $3";
    char a[24], l[16];
    snprintf(a, sizeof a, "%lld", (long long)after);
    snprintf(l, sizeof l, "%d", limit);
    const char *v[3] = {run_id, a, l};
    return read_blobs(p, org, sql, 3, v, out, NULL, NULL, err, errlen);
}

int hs_event_age_ms(db_pool *p, const char *org, const char *run_id, int64_t seq, int64_t *age_ms,
                    char *err, size_t errlen) {
    static const char sql[] =
        "SELECT greatest(0, (extract(epoch FROM clock_timestamp() - projected_at) * 1000)::bigint) "
        "FROM run_events WHERE run_id = $1 AND seq = $2";
    db_tx *tx = NULL;
    PGresult *res = NULL;
    char s[24];
    *age_ms = 0;
    snprintf(s, sizeof s, "%lld", (long long)seq);
    int rc = db_tx_begin_ex(p, org, DB_TX_READ_ONLY, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    const char *v[2] = {run_id, s};
    rc = db_exec(db_tx_conn(tx), sql, 2, v, &res, err, errlen);
    if (rc == DB_OK && PQntuples(res) == 1) *age_ms = strtoll(PQgetvalue(res, 0, 0), NULL, 10);
    PQclear(res);
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        return rc;
    }
    return db_tx_commit(tx, err, errlen);
}

int hs_log_tail(db_pool *p, const char *org, const char *run_id, int tail, hs_blobs *out,
                hs_run *run, int *found, char *err, size_t errlen) {
    static const char sql[] =
        "WITH c AS (SELECT " SQL_CONTIGUOUS " AS upto) "
        "SELECT seq, k, body FROM (SELECT seq, 'l' AS k, body FROM "
        " (SELECT seq, body FROM run_events, c WHERE run_id = $1 AND kind = 'l' "
        "  AND seq <= c.upto ORDER BY seq DESC LIMIT $2) t "
        " UNION ALL SELECT upto, 'u', ''::bytea FROM c) x ORDER BY k = 'u', seq";
    char l[16];
    snprintf(l, sizeof l, "%d", tail);
    const char *v[2] = {run_id, l};
    return read_blobs(p, org, sql, 2, v, out, run, found, err, errlen);
}

/* A read of one run's rows for a node filter ($2: '' = every node, else a step name or an
 * action id) with a row bound ($3); an id that is not a UUID has no rows. */
static int read_node_blobs(db_pool *p, const char *org, const char *sql, const char *run_id,
                           const char *node, int limit, hs_blobs *out, char *err, size_t errlen) {
    char l[16];
    out->v = NULL;
    out->n = 0;
    if (!ids_uuid_valid(run_id)) return DB_OK;
    snprintf(l, sizeof l, "%d", limit);
    const char *v[3] = {run_id, node ? node : "", l};
    return read_blobs(p, org, sql, 3, v, out, NULL, NULL, err, errlen);
}

/* spec GetNodeTranscriptRequest.node_id: a step name or a workflow_action UUID, and "both map
 * to the node's step_name", so an action id answers every attempt and every loop lap of its
 * step (each lap is an action of its own), not only the events captured under that action. */
int hs_transcript(db_pool *p, const char *org, const char *run_id, const char *node, int limit,
                  hs_blobs *out, char *err, size_t errlen) {
    static const char sql[] =
        "SELECT seq, 't', body FROM session_events WHERE run_id = $1 "
        " AND ($2 = '' OR step_name = $2 OR step_name = (SELECT a.step_name FROM session_events a "
        "  WHERE a.run_id = $1 AND a.action_id = $2 LIMIT 1)) "
        "ORDER BY session_id, seq, created_at LIMIT $3";
    return read_node_blobs(p, org, sql, run_id, node, limit, out, err, errlen);
}

int hs_prompt_frames(db_pool *p, const char *org, const char *run_id, const char *node, int limit,
                     hs_blobs *out, char *err, size_t errlen) {
    static const char sql[] =
        "SELECT 0, 'p', body FROM (SELECT body, created_at, prompt_id FROM prompt_frames f "
        " WHERE run_id = $1 AND ($2 = '' OR step_name = $2 OR action_id = $2) "
        " AND EXISTS (SELECT 1 FROM run_nodes n WHERE n.run_id = $1 AND n.needs_input "
        "  AND n.prompt_id = f.prompt_id) "
        " ORDER BY created_at DESC, prompt_id LIMIT $3) x ORDER BY created_at, prompt_id";
    return read_node_blobs(p, org, sql, run_id, node, limit, out, err, errlen);
}

/* A Postgres text[] literal of ids: {"a","b"} with " and \ escaped. *out: caller frees. */
static char *array_literal(const char *const *v, size_t n) {
    size_t cap = 3;
    for (size_t i = 0; i < n; i++)
        cap += 2 * strlen(v[i]) + 3;
    char *o = malloc(cap), *w = o;
    if (!o) return NULL;
    *w++ = '{';
    for (size_t i = 0; i < n; i++) {
        if (i) *w++ = ',';
        *w++ = '"';
        for (const char *c = v[i]; *c; c++) {
            if (*c == '"' || *c == '\\') *w++ = '\\';
            *w++ = *c;
        }
        *w++ = '"';
    }
    *w++ = '}';
    *w = 0;
    return o;
}

int hs_runs_behind(db_pool *p, const char *org, const char *const *run_ids, const int64_t *seqs,
                   size_t n, int *behind, char *err, size_t errlen) {
    static const char sql[] =
        "SELECT count(*) FROM unnest($1::uuid[], $2::bigint[]) AS t(run_id, seq) "
        "LEFT JOIN runs r ON r.run_id = t.run_id WHERE coalesce(r.last_seq, 0) < t.seq";
    db_tx *tx = NULL;
    PGresult *res = NULL;
    char **nums = calloc(n ? n : 1, sizeof *nums);
    char *ids = array_literal(run_ids, n), *sq = NULL;
    int rc = DB_OK;
    *behind = 0;
    for (size_t i = 0; nums && i < n; i++) {
        nums[i] = malloc(24);
        if (nums[i]) snprintf(nums[i], 24, "%lld", (long long)seqs[i]);
    }
    if (nums) sq = array_literal((const char *const *)nums, n);
    if (!ids || !sq) {
        rc = fail(err, errlen, "out of memory");
        goto done;
    }
    rc = db_tx_begin_ex(p, org, DB_TX_READ_ONLY, &tx, err, errlen);
    if (rc != DB_OK) goto done;
    const char *v[2] = {ids, sq};
    rc = db_exec(db_tx_conn(tx), sql, 2, v, &res, err, errlen);
    if (rc == DB_OK) *behind = atoi(PQgetvalue(res, 0, 0));
    PQclear(res);
    if (rc != DB_OK)
        db_tx_rollback(tx);
    else
        rc = db_tx_commit(tx, err, errlen);
done:
    for (size_t i = 0; nums && i < n; i++)
        free(nums[i]);
    free(nums);
    free(ids);
    free(sq);
    return rc;
}

int hs_visible_runs(db_pool *p, const char *org, const char *member, const char *const *teams,
                    size_t n_teams, const char *const *statuses, size_t n_statuses, int limit,
                    hs_run **out, size_t *n, char *err, size_t errlen) {
    db_tx *tx = NULL;
    PGresult *res = NULL;
    char l[16];
    char *ta = array_literal(teams, n_teams), *sa = array_literal(statuses, n_statuses);
    *out = NULL;
    *n = 0;
    int rc = DB_OK;
    if (!ta || !sa) {
        rc = fail(err, errlen, "out of memory");
        goto done;
    }
    snprintf(l, sizeof l, "%d", limit);
    rc = db_tx_begin_ex(p, org, DB_TX_READ_ONLY, &tx, err, errlen);
    if (rc != DB_OK) goto done;
    const char *v[5] = {member, ta, statuses ? "f" : "t", sa, l};
    rc = db_exec(db_tx_conn(tx), SQL_VISIBLE_RUNS, 5, v, &res, err, errlen);
    if (rc == DB_OK) {
        int rows = PQntuples(res);
        *out = calloc(rows ? (size_t)rows : 1, sizeof **out);
        if (!*out) {
            rc = fail(err, errlen, "out of memory");
        } else {
            for (int i = 0; i < rows; i++)
                run_row(res, i, &(*out)[i]);
            *n = (size_t)rows;
        }
    }
    PQclear(res);
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        free(*out);
        *out = NULL;
        *n = 0;
        goto done;
    }
    rc = db_tx_commit(tx, err, errlen);
done:
    free(ta);
    free(sa);
    return rc;
}
