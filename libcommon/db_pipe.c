/* Pipelined statements on a pooled connection (db.h, "Pipelining").
 *
 * libpq facts this relies on (shared/notes, checked with PG 15): in pipeline mode results come
 * back in send order, each followed by a NULL; each PQpipelineSync gives one
 * PGRES_PIPELINE_SYNC not followed by NULL; after a failed statement the rest up to the sync
 * give PGRES_PIPELINE_ABORTED; PQexec is refused while the mode is on; and
 * PQexitPipelineMode fails until every result through the last sync was read. */
#include "db.h"
#include "util.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- statements prepared once per connection ----
 *
 * A pipelined statement is parsed and planned by Postgres once per connection: the first use
 * sends a Parse under a name derived from the SQL text (PQsendPrepare) ahead of its execution
 * in the same pipeline, later uses only execute it (PQsendQueryPrepared), and after five runs
 * the server keeps a generic plan. The names live here, per connection, and count only once
 * the Parse's own result came back OK: a Parse skipped because an earlier statement of its
 * batch failed is sent again next time. A connection's names are dropped when the pool
 * closes it (db__pipe_conn_closed), so a reconnect prepares afresh. Bounded: at most
 * DB__PREP_MAX names per connection, further statements run unnamed. */
#define DB__PREP_MAX 128

typedef struct db__prep {
    PGconn *c;
    int n;
    uint64_t h[DB__PREP_MAX];
    struct db__prep *next;
} db__prep;

static pthread_mutex_t db__prep_mu = PTHREAD_MUTEX_INITIALIZER;
static db__prep *db__preps;

static uint64_t db__hash(const char *s) {
    return util_fnv1a(UTIL_FNV1A_INIT, s, strlen(s));
}

static db__prep *db__prep_of(PGconn *c, int create) { /* db__prep_mu held */
    for (db__prep *e = db__preps; e; e = e->next)
        if (e->c == c) return e;
    if (!create) return NULL;
    db__prep *e = calloc(1, sizeof *e);
    if (!e) return NULL;
    e->c = c;
    e->next = db__preps;
    db__preps = e;
    return e;
}

/* 1 prepared, 0 not (yet), -1 not and no room for it. */
static int db__prep_known(PGconn *c, uint64_t h) {
    int known = 0;
    pthread_mutex_lock(&db__prep_mu);
    db__prep *e = db__prep_of(c, 0);
    if (e) {
        for (int i = 0; i < e->n && !known; i++)
            known = e->h[i] == h;
        if (!known && e->n == DB__PREP_MAX) known = -1;
    }
    pthread_mutex_unlock(&db__prep_mu);
    return known;
}

static void db__prep_add(PGconn *c, uint64_t h) {
    pthread_mutex_lock(&db__prep_mu);
    db__prep *e = db__prep_of(c, 1);
    if (e && e->n < DB__PREP_MAX) e->h[e->n++] = h;
    pthread_mutex_unlock(&db__prep_mu);
}

void db__pipe_conn_closed(PGconn *c) {
    pthread_mutex_lock(&db__prep_mu);
    for (db__prep **pp = &db__preps; *pp; pp = &(*pp)->next)
        if ((*pp)->c == c) {
            db__prep *e = *pp;
            *pp = e->next;
            free(e);
            break;
        }
    pthread_mutex_unlock(&db__prep_mu);
}

/* ---- the pipeline ----
 *
 * One pipelined connection per thread: a connection belongs to the thread that acquired it,
 * and a thread works one transaction at a time. */
typedef struct db__pipe {
    PGconn *c;
    int n;                         /* results awaited since the last sync */
    PGresult **slots[DB_PIPE_MAX]; /* where result i goes (NULL: dropped) */
    uint64_t prep[DB_PIPE_MAX];    /* result i is the Parse of this name (0: a statement) */
} db__pipe;

static _Thread_local db__pipe db__p;

static int db__pipe_pending_parse(uint64_t h) {
    for (int i = 0; i < db__p.n; i++)
        if (db__p.prep[i] == h) return 1;
    return 0;
}

static int db__pipe_fail(char *err, size_t errlen, int rc, const char *msg) {
    if (err && errlen) snprintf(err, errlen, "%s", msg);
    return rc;
}

int db_pipe_active(const PGconn *c) {
    return c && db__p.c == c;
}

int db_pipe_begin(PGconn *c, char *err, size_t errlen) {
    if (!c || (db__p.c && db__p.c != c))
        return db__pipe_fail(err, errlen, DB_EINVAL, "db_pipe_begin: a pipeline is open");
    if (db__p.c == c) return DB_OK;
    if (PQenterPipelineMode(c) != 1)
        return db__pipe_fail(err, errlen, PQstatus(c) != CONNECTION_OK ? DB_ECONN : DB_EINVAL,
                             "db_pipe_begin: cannot enter pipeline mode");
    db__p.c = c;
    db__p.n = 0;
    return DB_OK;
}

int db_pipe_send(PGconn *c, const char *sql, int nparams, const char *const *values,
                 const int *lengths, const int *formats, int result_format, PGresult **slot,
                 char *err, size_t errlen) {
    if (slot) *slot = NULL;
    if (!db_pipe_active(c) || !sql || nparams < 0 || (nparams > 0 && !values))
        return db__pipe_fail(err, errlen, DB_EINVAL, "db_pipe_send: bad argument");
    if (db__p.n >= DB_PIPE_MAX - 1) { /* bounded: a full pipeline is synced before the next send */
        int rc = db_pipe_flush(c, err, errlen);
        if (rc != DB_OK) return rc;
    }
    uint64_t h = db__hash(sql);
    char name[24];
    snprintf(name, sizeof name, "dbp_%016llx", (unsigned long long)h);
    int known = db__prep_known(c, h);
    if (known == 0 && !db__pipe_pending_parse(h)) {
        if (!PQsendPrepare(c, name, sql, nparams, NULL)) return db__status_of(NULL, c, err, errlen);
        db__p.prep[db__p.n] = h;
        db__p.slots[db__p.n++] = NULL;
    }
    int sent = known < 0 ? PQsendQueryParams(c, sql, nparams, NULL, values, lengths, formats,
                                             result_format ? 1 : 0)
                         : PQsendQueryPrepared(c, name, nparams, values, lengths, formats,
                                               result_format ? 1 : 0);
    if (!sent) return db__status_of(NULL, c, err, errlen);
    db__p.prep[db__p.n] = 0;
    db__p.slots[db__p.n++] = slot;
    return DB_OK;
}

int db_pipe_flush(PGconn *c, char *err, size_t errlen) {
    if (!db_pipe_active(c))
        return db__pipe_fail(err, errlen, DB_EINVAL, "db_pipe_flush: no pipeline");
    int n = db__p.n, i = 0, rc = DB_OK;
    db__p.n = 0;
    if (n == 0) return DB_OK;
    if (PQpipelineSync(c) != 1) { /* nothing to read up to: the connection is left unusable */
        rc = db__status_of(NULL, c, err, errlen);
        goto out;
    }
    while (rc != DB_ECONN) {
        PGresult *res = PQgetResult(c);
        if (!res) { /* the NULL after each statement's result; forever once the link is gone */
            if (PQstatus(c) != CONNECTION_OK) rc = db__status_of(NULL, c, err, errlen);
            continue;
        }
        ExecStatusType st = PQresultStatus(res);
        if (st == PGRES_PIPELINE_SYNC) {
            PQclear(res);
            break;
        }
        if (i < n && db__p.prep[i]) { /* a Parse: counts once it succeeded, whatever follows */
            if (st == PGRES_COMMAND_OK)
                db__prep_add(c, db__p.prep[i]);
            else if (st != PGRES_PIPELINE_ABORTED && rc == DB_OK)
                rc = db__status_of(res, c, err, errlen);
            i++;
        } else if (i < n) {
            if (st == PGRES_PIPELINE_ABORTED) {
                if (rc == DB_OK) rc = db__pipe_fail(err, errlen, DB_ERR, "pipeline aborted");
            } else if (rc == DB_OK) {
                rc = db__status_of(res, c, err, errlen); /* the first failure is the one told */
                if (rc == DB_OK && db__p.slots[i]) {
                    *db__p.slots[i] = res;
                    res = NULL;
                }
            }
            i++;
        }
        PQclear(res);
    }
out:
    if (rc != DB_OK) /* all or nothing: a failed batch hands out no results */
        for (int k = 0; k < n; k++)
            if (!db__p.prep[k] && db__p.slots[k]) {
                PQclear(*db__p.slots[k]);
                *db__p.slots[k] = NULL;
            }
    return rc;
}

int db_pipe_end(PGconn *c, char *err, size_t errlen) {
    if (!db_pipe_active(c)) return DB_OK;
    int rc = db_pipe_flush(c, err, errlen);
    db__p.c = NULL;
    db__p.n = 0;
    if (PQexitPipelineMode(c) != 1 && rc == DB_OK)
        rc = PQstatus(c) != CONNECTION_OK
                 ? db__status_of(NULL, c, err, errlen)
                 : db__pipe_fail(err, errlen, DB_ERR, "db_pipe_end: connection still busy");
    return rc;
}

void db__pipe_discard(PGconn *c) {
    if (!db_pipe_active(c)) return;
    /* the statements' owners may be gone (an error path returned before flushing): their
     * result slots point into dead frames, so results are dropped, never handed out */
    for (int k = 0; k < db__p.n; k++)
        db__p.slots[k] = NULL;
    db_pipe_end(c, NULL, 0);
}

void db__pipe_forget(PGconn *c) {
    if (db_pipe_active(c)) {
        db__p.c = NULL;
        db__p.n = 0;
    }
}

int db__pipe_exec(PGconn *c, const char *sql, int nparams, const char *const *values,
                  const int *lengths, const int *formats, int result_format, PGresult **out_res,
                  char *err, size_t errlen) {
    int rc = db_pipe_send(c, sql, nparams, values, lengths, formats, result_format, out_res, err,
                          errlen);
    if (rc == DB_OK && out_res) rc = db_pipe_flush(c, err, errlen);
    return rc;
}
