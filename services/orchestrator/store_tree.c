/* The orchestrator's SQL: workflow agent steps and subagent trees (store.h). */
#include "store_int.h"

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
        rc = orch_store__session_end_tx(c, e[i].session_id, PQgetvalue(r, i, 2), reason, err,
                                        errlen);
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

/* ---- delegation (docs/orchestrator.md, "Delegation") ---- */

int orch_store_delegation_link(db_pool *p, const char *org, const char *parent, const char *child,
                               const char *role, const char *spawn_action, int max_depth,
                               int max_children, char invocation_id[37], int *depth, char *err,
                               size_t errlen) {
    PGresult *r = NULL;
    invocation_id[0] = 0;
    *depth = 0;
    TX_BEGIN(org);
    /* the parent locked: two delegations of one turn count each other against the fan-out */
    rc = db_exec(c,
                 "SELECT s.delegation_depth + 1, coalesce(s.root_session_id, s.session_id),"
                 " (SELECT count(*) FROM subagent_invocations i"
                 "   WHERE i.parent_session_id = s.session_id)"
                 " FROM sessions s WHERE s.session_id = $1::uuid FOR UPDATE",
                 1, &parent, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 0) rc = ORCH_ENOTFOUND;
    char root[37] = "";
    if (rc == DB_OK) {
        *depth = atoi(PQgetvalue(r, 0, 0));
        copy(root, sizeof root, PQgetvalue(r, 0, 1));
        if (*depth > max_depth)
            rc = util_errf(err, errlen, ORCH_ESTATE, "delegation depth %d is over the limit %d",
                           *depth, max_depth);
        else if (atoi(PQgetvalue(r, 0, 2)) >= max_children)
            rc = util_errf(err, errlen, ORCH_ESTATE,
                           "session %s delegated %d times already (the limit)", parent,
                           max_children);
    }
    PQclear(r);
    r = NULL;
    if (rc == DB_OK && !child) return tx_end(tx, rc, err, errlen); /* a check only */
    if (rc == DB_OK) {
        char dep[16];
        snprintf(dep, sizeof dep, "%d", *depth);
        rc =
            db_exec(c,
                    "UPDATE sessions SET parent_session_id = $2::uuid, root_session_id = $3::uuid,"
                    " delegation_depth = $4::int, spawn_action_id = nullif($5, '')::uuid"
                    " WHERE session_id = $1::uuid",
                    5, (const char *[]){child, parent, root, dep, spawn_action ? spawn_action : ""},
                    NULL, err, errlen);
    }
    if (rc == DB_OK)
        rc = db_exec(c,
                     "INSERT INTO subagent_invocations (org_id, parent_session_id,"
                     " child_session_id, subagent_role) VALUES (current_org(), $1::uuid, $2::uuid,"
                     " left($3, 64)) RETURNING id",
                     3, (const char *[]){parent, child, role}, &r, err, errlen);
    if (rc == DB_OK && PQntuples(r) == 1) copy(invocation_id, 37, PQgetvalue(r, 0, 0));
    PQclear(r);
    return tx_end(tx, rc, err, errlen);
}

int orch_store_delegation_done(db_pool *p, const char *org, const char *invocation_id,
                               const char *status, const char *error_code, char *err,
                               size_t errlen) {
    TX_BEGIN(org);
    rc = db_exec(
        c,
        "UPDATE subagent_invocations SET status = $2, error_code = nullif(left($3, 128), ''),"
        " finished_at = now() WHERE id = $1::uuid AND status = 'pending'",
        3, (const char *[]){invocation_id, status, error_code ? error_code : ""}, NULL, err,
        errlen);
    return tx_end(tx, rc, err, errlen);
}
