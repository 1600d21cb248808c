/* Postgres access on libpq: a bounded connection pool, transactions scoped to a tenant,
 * one error path for statements, and migrations.
 *
 * Pool
 *   At most `size` connections, opened lazily (the first one by db_pool_open, to fail fast on
 *   a bad DSN or password). db_acquire() waits up to its timeout for a free connection and
 *   then fails with DB_ETIMEOUT: a burst beyond the pool's size queues on a condition
 *   variable for that long and no longer. A connection found dead (its socket reports EOF, or
 *   a statement failed with the connection lost) is replaced on its next acquire, so a
 *   Postgres restart costs the callers in flight an error and nothing else.
 *   Every connection runs `SET statement_timeout` and `SET idle_in_transaction_session_timeout`
 *   from the pool options on connect, so no statement and no forgotten transaction holds locks
 *   forever.
 *
 * Tenancy
 *   db_tx_begin(pool, org_id, ...) runs BEGIN and `SELECT set_config('app.org_id', $1, true)`:
 *   the setting is transaction-local, so it never leaks to the next user of the pooled
 *   connection, and row-level security policies keyed on current_setting('app.org_id', true)
 *   confine every statement of the transaction to that org. org_id NULL means service-level
 *   work (migrations, catalogue loading): app.org_id is unset and tenant policies match no row.
 *   Callers must not change session state (SET without LOCAL, SET ROLE, LISTEN, prepared
 *   statements by name): connections are shared.
 *
 * Errors
 *   Functions return DB_OK (0) or a negative DB_E* code, with a message in err when they take
 *   one. A statement that Postgres refused also leaves its SQLSTATE in a thread-local slot read
 *   with db_sqlstate(); the common classes get their own codes (DB_EUNIQUE for 23505, ...) so
 *   that callers map them to gRPC statuses without string compares.
 *
 * Deadlines
 *   When the calling thread carries a deadline (ctx.h; the RPC server sets it for the handler
 *   of every unary call), db_tx_begin waits for a connection no longer than the time left, and
 *   sets the transaction's statement_timeout (SET LOCAL, so it ends with the transaction) to
 *   the time left when that is shorter than the pool's: a query never outlives its caller.
 *   A statement cut that way, a statement started after the deadline, and a begin that could
 *   not get a connection before it return DB_EDEADLINE (mapped to DEADLINE_EXCEEDED), distinct
 *   from DB_ECANCELED (the pool's own statement_timeout, lock_timeout).
 *
 * Thread safety: a pool may be shared by any number of threads; a PGconn or db_tx belongs to
 * the thread that acquired it until it is released. */
#ifndef UPSQUAD_DB_H
#define UPSQUAD_DB_H

#include <stddef.h>
#include <libpq-fe.h>

enum {
    DB_OK = 0,
    DB_ERR = -101,        /* statement failed; SQLSTATE in db_sqlstate() */
    DB_ETIMEOUT = -102,   /* no free pooled connection within the timeout */
    DB_ECONN = -103,      /* could not connect, or the connection was lost */
    DB_EINVAL = -104,     /* bad argument */
    DB_ENOMEM = -105,     /* allocation failed */
    DB_EUNIQUE = -106,    /* 23505 unique_violation */
    DB_EFOREIGN = -107,   /* 23503 foreign_key_violation */
    DB_ECHECK = -108,     /* 23514 check_violation, 23502 not_null_violation */
    DB_ESERIALIZE = -109, /* 40001 serialization_failure, 40P01 deadlock_detected: retry */
    DB_EPRIVILEGE = -110, /* 42501 insufficient_privilege, including RLS WITH CHECK refusals */
    DB_ECANCELED = -111,  /* 57014 query_canceled (statement_timeout, lock_timeout 55P03) */
    DB_ECHECKSUM = -112,  /* migrations: an applied file was edited */
    DB_EIO = -113,        /* migrations: a file or folder could not be read */
    DB_EDEADLINE = -114,  /* the caller's deadline (ctx.h) passed: statement cut or not run */
};

/* Short constant text of a DB_* code. */
const char *db_strerror(int code);

/* SQLSTATE ("23505") of the last statement this thread saw fail through db_exec*,
 * db_tx_*, db_migrate; "" when it failed without one (connection lost, bad argument). */
const char *db_sqlstate(void);

typedef struct db_pool db_pool;
typedef struct db_tx db_tx;

typedef struct db_pool_opts {
    int size;                     /* connections at most; 1..1000 (default 4) */
    int acquire_timeout_ms;       /* default wait of db_tx_begin for a connection (5000) */
    int statement_timeout_ms;     /* per statement; 0 = none (default 30000) */
    int idle_in_tx_timeout_ms;    /* server ends transactions idle longer; 0 = none (60000) */
    const char *application_name; /* shown in pg_stat_activity; NULL = "upsquad" */
} db_pool_opts;

/* Fills o with the defaults above. */
void db_pool_opts_default(db_pool_opts *o);

/* conninfo: a libpq keyword string or postgresql:// URI (copied). Opens one connection now.
 * On success *out is owned by the caller: db_pool_close. */
int db_pool_open(const char *conninfo, int size, db_pool **out, char *err, size_t errlen);
int db_pool_open_ex(const char *conninfo, const db_pool_opts *opts, db_pool **out, char *err,
                    size_t errlen);

/* Waits up to timeout_ms (< 0: the pool's acquire_timeout_ms) for a connection.
 * Returns DB_OK, DB_ETIMEOUT when the pool stayed exhausted, DB_ECONN when a fresh connection
 * could not be opened (the reason is logged). The connection is borrowed: db_release it. */
int db_acquire(db_pool *p, int timeout_ms, PGconn **out);

/* Returns a connection to the pool. A connection that is broken, inside a transaction that
 * cannot be rolled back, or busy with a query is closed and replaced on a later acquire; one
 * left inside a transaction is rolled back. c NULL is a no-op. */
void db_release(db_pool *p, PGconn *c);

/* Closes every connection. All connections must have been released. p NULL is a no-op. */
void db_pool_close(db_pool *p);

/* Connections the pool holds (open, in use or idle) and of those in use. */
void db_pool_stats(db_pool *p, int *open, int *in_use);

/* Transactions. flags: DB_TX_* (isolation and access mode, before any statement runs). */
enum {
    DB_TX_READ_COMMITTED = 0,
    DB_TX_REPEATABLE_READ = 1 << 0,
    DB_TX_SERIALIZABLE = 1 << 1,
    DB_TX_READ_ONLY = 1 << 2,
    DB_TX_PIPELINE = 1 << 3, /* the transaction's statements are pipelined ("Pipelining") */
};

/* Acquires a connection (the pool's acquire timeout), BEGINs and scopes the transaction to
 * org_id (copied; NULL = no tenant, "" is refused). A connection found dead is replaced and
 * BEGIN tried once more. On success the caller owns *out: end it with db_tx_commit or
 * db_tx_rollback, which release the connection and free the tx. */
int db_tx_begin(db_pool *p, const char *org_id, db_tx **out, char *err, size_t errlen);
int db_tx_begin_ex(db_pool *p, const char *org_id, int flags, db_tx **out, char *err,
                   size_t errlen);
/* Borrowed; valid until commit/rollback. */
PGconn *db_tx_conn(db_tx *tx);
/* COMMITs. Fails (and the work is rolled back) when a statement of the transaction failed,
 * or on a commit-time error such as a serialization failure (DB_ESERIALIZE) or a deferred
 * constraint. Always releases the connection and frees tx. */
int db_tx_commit(db_tx *tx, char *err, size_t errlen);
/* ROLLBACK, release, free. tx NULL is a no-op. */
void db_tx_rollback(db_tx *tx);

/* Runs one parameterised statement (text parameters, text results; params[i] NULL = SQL
 * NULL). On success and with out_res non-NULL, *out_res is owned by the caller (PQclear);
 * otherwise the result is cleared. On failure *out_res is NULL, err holds Postgres' message
 * and the return code its class. */
int db_exec(PGconn *c, const char *sql, int nparams, const char *const *params, PGresult **out_res,
            char *err, size_t errlen);

/* Same with binary parameters or results (bytea): lengths/formats as for PQexecParams
 * (NULL = all text), result_format 0 text, 1 binary. */
int db_exec_bin(PGconn *c, const char *sql, int nparams, const char *const *values,
                const int *lengths, const int *formats, int result_format, PGresult **out_res,
                char *err, size_t errlen);

/* Builds a conninfo string equal to `base` but connecting as `user` (with `password`, NULL =
 * taken from the environment / PGPASSFILE). *out is owned by the caller (free). */
int db_conninfo_as(const char *base, const char *user, const char *password, char **out, char *err,
                   size_t errlen);

/* Applies the migrations of folder `dir` to `schema`.
 *
 * Files are named NNN_name.sql (NNN: decimal version, any width) and applied in numeric
 * order, each in its own transaction with search_path = schema, so files use unqualified
 * names. A file must not contain transaction control (BEGIN/COMMIT, CREATE INDEX
 * CONCURRENTLY). Applied versions are recorded in <schema>.schema_migrations(version, name,
 * checksum = sha256 of the file, applied_at).
 *
 * Every transaction holds pg_advisory_xact_lock(hashtext('schema_migrations:' || schema)) and
 * re-reads what is applied under the lock, so replicas starting together apply each file
 * exactly once. Re-running is a no-op (*applied = 0). Refused, with nothing applied past the
 * problem: an applied file whose content changed (DB_ECHECKSUM), a file older than the newest
 * applied version that was never applied, two files with one version. Versions recorded in the
 * table without a file (a newer release ran first) are accepted. The schema is created when
 * missing and the role may.
 *
 * applied (NULL ok) receives the number of files applied by this call. */
int db_migrate(db_pool *p, const char *schema, const char *dir, int *applied, char *err,
               size_t errlen);

/* db_migrate as the schema's owner: over one connection of owner_dsn when it is set (the
 * service itself logs in as a role that owns nothing and cannot create, alter or drop, so it
 * cannot switch row-level security off), else over p (a role that owns the schema: tests,
 * single-role setups). p may be NULL when owner_dsn is set. */
int db_migrate_as(db_pool *p, const char *owner_dsn, const char *schema, const char *dir,
                  int *applied, char *err, size_t errlen);

/* Pipelining
 *   A transaction begun with DB_TX_PIPELINE puts its connection in libpq's pipeline mode:
 *   BEGIN, the tenant scope and every later statement run with out_res NULL (a write whose
 *   result nobody reads) are sent without waiting; a statement that wants its result
 *   (out_res non-NULL) sends a sync with it and waits for everything sent so far; COMMIT is
 *   sent behind the writes, so a tick of N writes costs one round trip instead of N + 2.
 *   Nothing is weakened: Postgres runs the statements in send order in the one transaction,
 *   and a deferred write that fails aborts the rest, so its error is returned by the next
 *   read or by db_tx_commit (which then rolls back) — a caller acts only on a commit that
 *   returned DB_OK, as before. What moves is where an error is reported: by a later call of
 *   the same transaction, not the write's own db_exec (which returned DB_OK on sending).
 *   Callers that branch on a write's own status (DB_EUNIQUE of an INSERT ... to take another
 *   path) must not use DB_TX_PIPELINE.
 *
 *   The db_pipe_* calls are the same machinery for a caller batching reads: send several
 *   statements with a result slot each, flush once, read them all. One pipeline per thread at
 *   a time; at most DB_PIPE_MAX statements wait for a sync (the next send syncs first). */
#define DB_PIPE_MAX 256
/* Enters pipeline mode on c (idle, borrowed). DB_EINVAL when this thread has another open. */
int db_pipe_begin(PGconn *c, char *err, size_t errlen);
/* 1 when c is this thread's pipelined connection. */
int db_pipe_active(const PGconn *c);
/* Queues one statement (arguments as db_exec_bin). slot NULL: the result is checked at the
 * flush and dropped; else *slot receives it at the flush (caller PQclears), NULL until then. */
int db_pipe_send(PGconn *c, const char *sql, int nparams, const char *const *values,
                 const int *lengths, const int *formats, int result_format, PGresult **slot,
                 char *err, size_t errlen);
/* Sends a sync and reads every queued statement's result. Returns the first failure (err,
 * db_sqlstate() as db_exec); on failure every slot of the batch is NULL (all or nothing). */
int db_pipe_flush(PGconn *c, char *err, size_t errlen);
/* Flushes and leaves pipeline mode. A no-op on a connection not pipelined. */
int db_pipe_end(PGconn *c, char *err, size_t errlen);

/* Internal, shared by db.c and db_migrate.c. */
int db__status_of(PGresult *res, PGconn *c, char *err, size_t errlen);
int db__ident_ok(const char *s);
int db__acquire(db_pool *p, int timeout_ms, PGconn **out, char *err, size_t errlen);
/* Closes a claimed connection instead of pooling it; its slot reconnects on a later acquire. */
void db__discard(db_pool *p, PGconn *c);
/* db_pipe.c: db_exec_bin on a pipelined connection; forgetting one that is being closed. */
int db__pipe_exec(PGconn *c, const char *sql, int nparams, const char *const *values,
                  const int *lengths, const int *formats, int result_format, PGresult **out_res,
                  char *err, size_t errlen);
void db__pipe_forget(PGconn *c);
/* Ends a pipeline whose statements' owners may be gone: results are read and dropped. */
void db__pipe_discard(PGconn *c);
void db__pipe_conn_closed(PGconn *c);

#endif
