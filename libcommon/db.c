/* Postgres pool, tenant-scoped transactions and statement helpers (see db.h). */
#include "db.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctx.h"
#include "log.h"
#include "util.h"

#define DB__SIZE_MAX 1000
/* statement_timeout fires on the server's clock a little before or after ours */
#define DB__DEADLINE_SLACK_MS 5

typedef struct db__slot {
    PGconn *conn; /* NULL until first use, or after it was found broken */
    int in_use;
} db__slot;

struct db_pool {
    char *conninfo;
    db_pool_opts o;
    char app[64];
    pthread_mutex_t mu;
    pthread_cond_t cv; /* signalled on every release; CLOCK_MONOTONIC */
    db__slot *slots;
    int size;
};

struct db_tx {
    db_pool *p;
    PGconn *c;
};

static _Thread_local char db__state[6];

const char *db_sqlstate(void) {
    return db__state;
}

const char *db_strerror(int code) {
    switch (code) {
    case DB_OK:
        return "ok";
    case DB_ERR:
        return "statement failed";
    case DB_ETIMEOUT:
        return "no database connection available in time";
    case DB_ECONN:
        return "database connection failed";
    case DB_EINVAL:
        return "invalid argument";
    case DB_ENOMEM:
        return "out of memory";
    case DB_EUNIQUE:
        return "unique violation";
    case DB_EFOREIGN:
        return "foreign key violation";
    case DB_ECHECK:
        return "check violation";
    case DB_ESERIALIZE:
        return "serialization failure";
    case DB_EPRIVILEGE:
        return "insufficient privilege";
    case DB_ECANCELED:
        return "statement canceled";
    case DB_ECHECKSUM:
        return "applied migration was modified";
    case DB_EIO:
        return "migration file unreadable";
    case DB_EDEADLINE:
        return "deadline exceeded";
    default:
        return "unknown database error";
    }
}

static void db__set_state(const char *s) {
    snprintf(db__state, sizeof db__state, "%s", s ? s : "");
}

/* libpq messages end with a newline; keep err on one line. */
static void db__msg(char *err, size_t errlen, const char *prefix, const char *msg) {
    if (!err || errlen == 0) return;
    snprintf(err, errlen, "%s%s", prefix, msg ? msg : "");
    size_t n = strlen(err);
    while (n > 0 && (err[n - 1] == '\n' || err[n - 1] == ' '))
        err[--n] = '\0';
    for (char *q = err; *q; q++)
        if (*q == '\n') *q = ' ';
}

static int db__code_of_state(const char *st) {
    if (!st || !*st) return DB_ERR;
    if (strcmp(st, "23505") == 0) return DB_EUNIQUE;
    if (strcmp(st, "23503") == 0) return DB_EFOREIGN;
    if (strcmp(st, "23514") == 0 || strcmp(st, "23502") == 0) return DB_ECHECK;
    if (strcmp(st, "40001") == 0 || strcmp(st, "40P01") == 0) return DB_ESERIALIZE;
    if (strcmp(st, "42501") == 0) return DB_EPRIVILEGE;
    if (strcmp(st, "57014") == 0 || strcmp(st, "55P03") == 0) return DB_ECANCELED;
    if (strncmp(st, "08", 2) == 0 || strncmp(st, "57P", 3) == 0) return DB_ECONN;
    return DB_ERR;
}

int db__status_of(PGresult *res, PGconn *c, char *err, size_t errlen) {
    if (!res) {
        db__set_state("");
        if (PQstatus(c) != CONNECTION_OK) {
            db__msg(err, errlen, "connection lost: ", PQerrorMessage(c));
            return DB_ECONN;
        }
        db__msg(err, errlen, "", PQerrorMessage(c));
        return DB_ENOMEM;
    }
    ExecStatusType st = PQresultStatus(res);
    if (st == PGRES_COMMAND_OK || st == PGRES_TUPLES_OK) return DB_OK;
    const char *state = PQresultErrorField(res, PG_DIAG_SQLSTATE);
    db__set_state(state);
    if (PQstatus(c) != CONNECTION_OK) {
        db__msg(err, errlen, "connection lost: ", PQerrorMessage(c));
        return DB_ECONN;
    }
    const char *primary = PQresultErrorField(res, PG_DIAG_MESSAGE_PRIMARY);
    if (err && errlen) {
        char buf[512];
        snprintf(buf, sizeof buf, "%s (SQLSTATE %s)", primary ? primary : PQresStatus(st),
                 state ? state : "none");
        db__msg(err, errlen, "", buf);
    }
    int rc = state ? db__code_of_state(state) : DB_ERR;
    /* query_canceled once the caller's deadline has (all but) passed: our SET LOCAL
     * statement_timeout from that deadline cut it, not the pool's own timeout */
    if (rc == DB_ECANCELED && ctx_deadline_ms() <= DB__DEADLINE_SLACK_MS) rc = DB_EDEADLINE;
    return rc;
}

int db__ident_ok(const char *s) {
    if (!s || !*s || strlen(s) > 63) return 0;
    if (!((*s >= 'a' && *s <= 'z') || *s == '_')) return 0;
    for (const char *q = s; *q; q++)
        if (!((*q >= 'a' && *q <= 'z') || (*q >= '0' && *q <= '9') || *q == '_')) return 0;
    return 1;
}

int db_exec_bin(PGconn *c, const char *sql, int nparams, const char *const *values,
                const int *lengths, const int *formats, int result_format, PGresult **out_res,
                char *err, size_t errlen) {
    if (out_res) *out_res = NULL;
    if (!c || !sql || nparams < 0 || (nparams > 0 && !values)) {
        db__set_state("");
        db__msg(err, errlen, "", "db_exec: bad argument");
        return DB_EINVAL;
    }
    if (ctx_expired()) { /* nobody waits for this statement's result any more */
        db__set_state("57014");
        db__msg(err, errlen, "", "deadline exceeded before the statement ran");
        return DB_EDEADLINE;
    }
    if (db_pipe_active(c)) /* DB_TX_PIPELINE: sent now, waited for at the next read */
        return db__pipe_exec(c, sql, nparams, values, lengths, formats, result_format, out_res, err,
                             errlen);
    PGresult *res =
        PQexecParams(c, sql, nparams, NULL, values, lengths, formats, result_format ? 1 : 0);
    int rc = db__status_of(res, c, err, errlen);
    if (rc == DB_OK && out_res) {
        *out_res = res;
        return DB_OK;
    }
    PQclear(res);
    return rc;
}

int db_exec(PGconn *c, const char *sql, int nparams, const char *const *params, PGresult **out_res,
            char *err, size_t errlen) {
    return db_exec_bin(c, sql, nparams, params, NULL, NULL, 0, out_res, err, errlen);
}

/* ---- pool ---- */

/* Closes a connection the pool had handed out: its prepared statements go with it. */
static void db__finish(PGconn *c) {
    db__pipe_conn_closed(c);
    PQfinish(c);
}

void db_pool_opts_default(db_pool_opts *o) {
    memset(o, 0, sizeof *o);
    o->size = 4;
    o->acquire_timeout_ms = 5000;
    o->statement_timeout_ms = 30000;
    o->idle_in_tx_timeout_ms = 60000;
}

/* Server notices (e.g. "relation already exists, skipping") go to the debug log, not to
 * stderr where libpq would print them. */
static void db__notice(void *arg, const char *message) {
    (void)arg;
    char buf[512];
    db__msg(buf, sizeof buf, "", message);
    log_debug("db.notice", "%s", buf);
}

static PGconn *db__connect(db_pool *p, char *err, size_t errlen) {
    const char *keys[] = {"dbname", "fallback_application_name", NULL};
    const char *vals[] = {p->conninfo, p->app, NULL};
    PGconn *c = PQconnectdbParams(keys, vals, 1);
    if (!c) {
        db__msg(err, errlen, "", "out of memory");
        return NULL;
    }
    if (PQstatus(c) != CONNECTION_OK) {
        db__msg(err, errlen, "connect: ", PQerrorMessage(c));
        PQfinish(c);
        return NULL;
    }
    PQsetNoticeProcessor(c, db__notice, NULL);
    char setup[160];
    snprintf(setup, sizeof setup,
             "SET statement_timeout = %d; SET idle_in_transaction_session_timeout = %d",
             p->o.statement_timeout_ms, p->o.idle_in_tx_timeout_ms);
    PGresult *res = PQexec(c, setup);
    int rc = db__status_of(res, c, err, errlen);
    PQclear(res);
    if (rc != DB_OK) {
        PQfinish(c);
        return NULL;
    }
    return c;
}

/* Cheap liveness check without a round trip. An idle pooled connection has nothing to read
 * (callers do not LISTEN); input there is a terminating backend's FATAL message, possibly not
 * yet followed by EOF, or EOF itself: either way the connection is not reused. */
static int db__conn_alive(PGconn *c) {
    if (PQstatus(c) != CONNECTION_OK || PQtransactionStatus(c) != PQTRANS_IDLE) return 0;
    struct pollfd pfd = {.fd = PQsocket(c), .events = POLLIN};
    int r = poll(&pfd, 1, 0);
    return r == 0 || (r < 0 && errno == EINTR);
}

int db_pool_open_ex(const char *conninfo, const db_pool_opts *opts, db_pool **out, char *err,
                    size_t errlen) {
    db_pool_opts o;
    if (opts) {
        o = *opts;
    } else {
        db_pool_opts_default(&o);
    }
    *out = NULL;
    if (!conninfo || o.size < 1 || o.size > DB__SIZE_MAX || o.statement_timeout_ms < 0 ||
        o.idle_in_tx_timeout_ms < 0 || o.acquire_timeout_ms < 0) {
        db__msg(err, errlen, "", "db_pool_open: bad conninfo or options");
        return DB_EINVAL;
    }
    db_pool *p = calloc(1, sizeof *p);
    if (!p) goto nomem;
    p->o = o;
    p->size = o.size;
    snprintf(p->app, sizeof p->app, "%s", o.application_name ? o.application_name : "upsquad");
    p->o.application_name = p->app;
    p->conninfo = strdup(conninfo);
    p->slots = calloc((size_t)o.size, sizeof *p->slots);
    if (!p->conninfo || !p->slots) goto nomem;
    pthread_mutex_init(&p->mu, NULL);
    util_cond_init_monotonic(&p->cv);
    p->slots[0].conn = db__connect(p, err, errlen);
    if (!p->slots[0].conn) {
        db_pool_close(p);
        return DB_ECONN;
    }
    *out = p;
    return DB_OK;
nomem:
    if (p) {
        free(p->conninfo);
        free(p->slots);
        free(p);
    }
    db__msg(err, errlen, "", "out of memory");
    return DB_ENOMEM;
}

int db_pool_open(const char *conninfo, int size, db_pool **out, char *err, size_t errlen) {
    db_pool_opts o;
    db_pool_opts_default(&o);
    o.size = size;
    return db_pool_open_ex(conninfo, &o, out, err, errlen);
}

void db_pool_close(db_pool *p) {
    if (!p) return;
    int leaked = 0;
    for (int i = 0; i < p->size; i++) {
        if (p->slots[i].in_use) {
            leaked++;
            continue; /* still used by someone: closing it under them would crash them */
        }
        if (p->slots[i].conn) db__finish(p->slots[i].conn);
    }
    if (leaked) log_error("db.pool.close", "%d connection(s) still in use were not closed", leaked);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->slots);
    free(p->conninfo);
    free(p);
}

void db_pool_stats(db_pool *p, int *open, int *in_use) {
    int o = 0, u = 0;
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->size; i++) {
        if (p->slots[i].conn) o++;
        if (p->slots[i].in_use) u++;
    }
    pthread_mutex_unlock(&p->mu);
    if (open) *open = o;
    if (in_use) *in_use = u;
}

/* Claims a free slot, preferring one with an open connection. -1 when none is free. */
static int db__claim(db_pool *p) {
    int empty = -1;
    for (int i = 0; i < p->size; i++) {
        if (p->slots[i].in_use) continue;
        if (p->slots[i].conn) {
            p->slots[i].in_use = 1;
            return i;
        }
        if (empty < 0) empty = i;
    }
    if (empty >= 0) p->slots[empty].in_use = 1;
    return empty;
}

/* Slot of c; the caller holds the lock. */
static int db__slot_of(db_pool *p, PGconn *c) {
    for (int i = 0; i < p->size; i++)
        if (p->slots[i].in_use && p->slots[i].conn == c) return i;
    return -1;
}

int db__acquire(db_pool *p, int timeout_ms, PGconn **out, char *err, size_t errlen) {
    *out = NULL;
    if (timeout_ms < 0) timeout_ms = p->o.acquire_timeout_ms;
    struct timespec dl;
    util_deadline(&dl, timeout_ms);
    pthread_mutex_lock(&p->mu);
    int i;
    while ((i = db__claim(p)) < 0) {
        if (pthread_cond_timedwait(&p->cv, &p->mu, &dl) == ETIMEDOUT) {
            i = db__claim(p);
            if (i >= 0) break;
            pthread_mutex_unlock(&p->mu);
            db__msg(err, errlen, "", "no database connection available in time (pool exhausted)");
            return DB_ETIMEOUT;
        }
    }
    PGconn *c = p->slots[i].conn;
    p->slots[i].conn = NULL; /* ours now; written back below */
    pthread_mutex_unlock(&p->mu);

    if (c && !db__conn_alive(c)) {
        log_warn("db.conn.dead", "replacing a pooled connection that the server closed");
        db__finish(c);
        c = NULL;
    }
    if (!c) c = db__connect(p, err, errlen);

    pthread_mutex_lock(&p->mu);
    p->slots[i].conn = c;
    if (!c) {
        p->slots[i].in_use = 0;
        pthread_cond_signal(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    if (!c) return DB_ECONN;
    *out = c;
    return DB_OK;
}

int db_acquire(db_pool *p, int timeout_ms, PGconn **out) {
    char err[256] = "";
    if (!p || !out) return DB_EINVAL;
    int rc = db__acquire(p, timeout_ms, out, err, sizeof err);
    if (rc == DB_ECONN) log_warn("db.connect.failed", "%s", err);
    return rc;
}

/* Puts c back in a reusable state, or closes it: returns what the slot should keep. */
static PGconn *db__settle(PGconn *c) {
    if (PQstatus(c) != CONNECTION_OK) goto drop;
    switch (PQtransactionStatus(c)) {
    case PQTRANS_IDLE:
        return c;
    case PQTRANS_INTRANS:
    case PQTRANS_INERROR: {
        PGresult *res = PQexec(c, "ROLLBACK");
        int ok = res && PQresultStatus(res) == PGRES_COMMAND_OK;
        PQclear(res);
        if (ok && PQtransactionStatus(c) == PQTRANS_IDLE) return c;
        goto drop;
    }
    default:
        goto drop; /* a query still running or unknown state */
    }
drop:
    db__finish(c);
    return NULL;
}

void db_release(db_pool *p, PGconn *c) {
    if (!p || !c) return;
    pthread_mutex_lock(&p->mu);
    int i = db__slot_of(p, c);
    pthread_mutex_unlock(&p->mu);
    if (i < 0) {
        log_error("db.release.foreign", "connection does not belong to this pool");
        return;
    }
    db__pipe_discard(c); /* drain, dropping results; settle rolls back */
    PGconn *keep = db__settle(c);
    pthread_mutex_lock(&p->mu);
    p->slots[i].conn = keep;
    p->slots[i].in_use = 0;
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
}

void db__discard(db_pool *p, PGconn *c) {
    if (!p || !c) return;
    db__pipe_forget(c);
    pthread_mutex_lock(&p->mu);
    int i = db__slot_of(p, c);
    if (i >= 0) {
        p->slots[i].conn = NULL;
        p->slots[i].in_use = 0;
        pthread_cond_signal(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    if (i >= 0) db__finish(c);
}

/* Replaces the claimed connection *c with a fresh one (same slot). */
static int db__reconnect(db_pool *p, PGconn **c, char *err, size_t errlen) {
    pthread_mutex_lock(&p->mu);
    int i = db__slot_of(p, *c);
    if (i >= 0) p->slots[i].conn = NULL;
    pthread_mutex_unlock(&p->mu);
    if (i < 0) return DB_EINVAL;
    db__pipe_forget(*c);
    db__finish(*c);
    *c = db__connect(p, err, errlen);
    pthread_mutex_lock(&p->mu);
    p->slots[i].conn = *c;
    if (!*c) {
        p->slots[i].in_use = 0;
        pthread_cond_signal(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    return *c ? DB_OK : DB_ECONN;
}

/* ---- transactions ---- */

static const char *db__begin_sql(int flags) {
    static const char *const sql[] = {
        "BEGIN",
        "BEGIN ISOLATION LEVEL REPEATABLE READ",
        "BEGIN ISOLATION LEVEL SERIALIZABLE",
        NULL,
        "BEGIN READ ONLY",
        "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY",
        "BEGIN ISOLATION LEVEL SERIALIZABLE READ ONLY",
    };
    if (flags < 0 || flags > 6) return NULL;
    return sql[flags];
}

/* BEGIN, and in the same round trip (one simple query) the statement_timeout the caller's
 * deadline leaves, when that is shorter than the pool's: SET LOCAL, so it ends with the
 * transaction. The value is a number we format: nothing of the caller's is spliced in. */
static int db__begin(db_pool *p, PGconn *c, const char *begin, char *err, size_t errlen) {
    int64_t left = ctx_deadline_ms();
    const char *orig = begin;
    char sql[160];
    if (left != CTX_NO_DEADLINE &&
        (p->o.statement_timeout_ms == 0 || left < p->o.statement_timeout_ms)) {
        if (left <= 0) {
            db__set_state("57014");
            db__msg(err, errlen, "", "deadline exceeded before the transaction began");
            return DB_EDEADLINE;
        }
        snprintf(sql, sizeof sql, "%s; SET LOCAL statement_timeout = %lld", begin, (long long)left);
        begin = sql;
    }
    if (db_pipe_active(c)) {
        /* pipelined statements are prepared by their text: the timeout goes as a parameter
         * (set_config(.., true) is SET LOCAL), so the text, and its one prepared statement
         * per connection, stay the same whatever the deadline */
        int rc = db_pipe_send(c, orig, 0, NULL, NULL, NULL, 0, NULL, err, errlen);
        if (rc == DB_OK && begin != orig) {
            char ms[24];
            snprintf(ms, sizeof ms, "%lld", (long long)left);
            const char *v[1] = {ms};
            rc = db_pipe_send(c, "SELECT set_config('statement_timeout', $1, true)", 1, v, NULL,
                              NULL, 0, NULL, err, errlen);
        }
        return rc;
    }
    PGresult *res = PQexec(c, begin);
    int rc = db__status_of(res, c, err, errlen);
    PQclear(res);
    return rc;
}

int db_tx_begin_ex(db_pool *p, const char *org_id, int flags, db_tx **out, char *err,
                   size_t errlen) {
    *out = NULL;
    const char *begin = db__begin_sql(flags & ~DB_TX_PIPELINE);
    if (!p || !begin || (org_id && !*org_id)) {
        db__set_state("");
        db__msg(err, errlen, "", !begin ? "db_tx_begin: bad flags" : "db_tx_begin: empty org_id");
        return DB_EINVAL;
    }
    PGconn *c = NULL;
    int64_t left = ctx_deadline_ms();
    int wait = p->o.acquire_timeout_ms;
    if (left <= 0) {
        db__set_state("");
        db__msg(err, errlen, "", "deadline exceeded before the transaction began");
        return DB_EDEADLINE;
    }
    if (left < wait) wait = (int)left;
    int rc = db__acquire(p, wait, &c, err, errlen);
    if (rc == DB_ETIMEOUT && wait < p->o.acquire_timeout_ms) {
        db__msg(err, errlen, "", "deadline exceeded waiting for a database connection");
        rc = DB_EDEADLINE;
    }
    if (rc != DB_OK) {
        db__set_state("");
        return rc;
    }
    if (flags & DB_TX_PIPELINE) rc = db_pipe_begin(c, err, errlen);
    if (rc == DB_OK) rc = db__begin(p, c, begin, err, errlen);
    if (rc == DB_ECONN) { /* died since the liveness check: nothing ran yet, retry once */
        rc = db__reconnect(p, &c, err, errlen);
        if (rc != DB_OK) return rc; /* the slot was freed */
        if (flags & DB_TX_PIPELINE) rc = db_pipe_begin(c, err, errlen);
        if (rc == DB_OK) rc = db__begin(p, c, begin, err, errlen);
    }
    if (rc == DB_OK && org_id) {
        const char *params[] = {org_id};
        rc = db_exec(c, "SELECT set_config('app.org_id', $1, true)", 1, params, NULL, err, errlen);
    }
    db_tx *tx = NULL;
    if (rc == DB_OK && !(tx = malloc(sizeof *tx))) {
        db__msg(err, errlen, "", "out of memory");
        rc = DB_ENOMEM;
    }
    if (rc != DB_OK) {
        db_release(p, c);
        return rc;
    }
    tx->p = p;
    tx->c = c;
    *out = tx;
    return DB_OK;
}

int db_tx_begin(db_pool *p, const char *org_id, db_tx **out, char *err, size_t errlen) {
    return db_tx_begin_ex(p, org_id, DB_TX_READ_COMMITTED, out, err, errlen);
}

PGconn *db_tx_conn(db_tx *tx) {
    return tx->c;
}

int db_tx_commit(db_tx *tx, char *err, size_t errlen) {
    if (!tx) { /* like db_tx_rollback(NULL): a caller's error path must not crash */
        db__set_state("");
        db__msg(err, errlen, "", "db_tx_commit: no transaction");
        return DB_EINVAL;
    }
    PGresult *res = NULL;
    int rc;
    if (db_pipe_active(tx->c)) { /* COMMIT behind the deferred writes: one round trip */
        rc = db_pipe_send(tx->c, "COMMIT", 0, NULL, NULL, NULL, 0, &res, err, errlen);
        int end = db_pipe_end(tx->c, err, errlen);
        if (rc == DB_OK) rc = end;
    } else {
        res = PQexec(tx->c, "COMMIT");
        rc = db__status_of(res, tx->c, err, errlen);
    }
    /* COMMIT of a transaction that saw an error succeeds as "ROLLBACK". */
    if (rc == DB_OK && res && strcmp(PQcmdStatus(res), "COMMIT") != 0) {
        db__set_state("25P02");
        db__msg(err, errlen, "", "transaction rolled back: a statement in it had failed");
        rc = DB_ERR;
    }
    PQclear(res);
    db_release(tx->p, tx->c);
    free(tx);
    return rc;
}

void db_tx_rollback(db_tx *tx) {
    if (!tx) return;
    db_release(tx->p, tx->c); /* db__settle rolls back */
    free(tx);
}

/* ---- conninfo ---- */

static int db__append(char **buf, size_t *len, size_t *cap, const char *s) {
    size_t n = strlen(s);
    if (*len + n + 1 > *cap) {
        size_t nc = (*cap ? *cap * 2 : 256) + n;
        char *nb = realloc(*buf, nc);
        if (!nb) return -1;
        *buf = nb;
        *cap = nc;
    }
    memcpy(*buf + *len, s, n + 1);
    *len += n;
    return 0;
}

/* key='value' with ' and \ escaped, as libpq's conninfo grammar wants. */
static int db__append_kv(char **buf, size_t *len, size_t *cap, const char *k, const char *v) {
    if (*len && db__append(buf, len, cap, " ")) return -1;
    if (db__append(buf, len, cap, k) || db__append(buf, len, cap, "='")) return -1;
    for (const char *q = v; *q; q++) {
        char ch[3] = {0};
        if (*q == '\'' || *q == '\\') {
            ch[0] = '\\';
            ch[1] = *q;
        } else {
            ch[0] = *q;
        }
        if (db__append(buf, len, cap, ch)) return -1;
    }
    return db__append(buf, len, cap, "'");
}

int db_conninfo_as(const char *base, const char *user, const char *password, char **out, char *err,
                   size_t errlen) {
    *out = NULL;
    char *perr = NULL;
    PQconninfoOption *opts = PQconninfoParse(base ? base : "", &perr);
    if (!opts) {
        db__msg(err, errlen, "conninfo: ", perr ? perr : "out of memory");
        PQfreemem(perr);
        return DB_EINVAL;
    }
    char *buf = NULL;
    size_t len = 0, cap = 0;
    int rc = DB_OK;
    for (PQconninfoOption *o = opts; o->keyword && rc == DB_OK; o++) {
        const char *v = o->val;
        if (strcmp(o->keyword, "user") == 0) v = user;
        if (strcmp(o->keyword, "password") == 0) v = password;
        if (v && db__append_kv(&buf, &len, &cap, o->keyword, v)) rc = DB_ENOMEM;
    }
    PQconninfoFree(opts);
    if (rc == DB_OK && !buf && db__append(&buf, &len, &cap, "")) rc = DB_ENOMEM;
    if (rc != DB_OK) {
        free(buf);
        db__msg(err, errlen, "", "out of memory");
        return rc;
    }
    *out = buf;
    return DB_OK;
}
