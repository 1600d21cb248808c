/* libcommon/db pipelining (db.h "Pipelining") against the real Postgres of the test runtime
 * (UPSQUAD_PG_ADMIN_DSN): deferred writes in a DB_TX_PIPELINE transaction, errors reported at
 * the next read or at commit with nothing committed, the DB_PIPE_MAX bound, rollback, the
 * connection's reuse afterwards, and an explicit batch of reads. Works in a throw-away table
 * dropped at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ctx.h"
#include "db.h"
#include "log.h"

static const char *g_dsn;
static char g_table[64];
static db_pool *g_pool; /* two connections: one for the transaction under test, one to look */

static void exec_ok(PGconn *c, const char *sql) {
    char err[256];
    int rc = db_exec(c, sql, 0, NULL, NULL, err, sizeof err);
    if (rc != DB_OK) print_error("%s: %s\n", sql, err);
    assert_int_equal(rc, DB_OK);
}

/* Rows of the table seen from outside any pipeline (a fresh, plain transaction). */
static long rows(const char *where) {
    char sql[256], err[256];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s WHERE %s", g_table, where);
    assert_int_equal(db_tx_begin(g_pool, NULL, &tx, err, sizeof err), DB_OK);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, &r, err, sizeof err), DB_OK);
    long n = atol(PQgetvalue(r, 0, 0));
    PQclear(r);
    db_tx_rollback(tx);
    return n;
}

static int insert(db_tx *tx, int id, const char *v, char *err, size_t errlen) {
    char sql[128], ids[16];
    snprintf(sql, sizeof sql, "INSERT INTO %s (id, v) VALUES ($1::int, $2)", g_table);
    snprintf(ids, sizeof ids, "%d", id);
    const char *p[] = {ids, v};
    return db_exec(db_tx_conn(tx), sql, 2, p, NULL, err, errlen);
}

static int setup(void **state) {
    (void)state;
    char err[256];
    snprintf(g_table, sizeof g_table, "public.t_db_pipe_%d", (int)getpid());
    if (db_pool_open(g_dsn, 2, &g_pool, err, sizeof err) != DB_OK) {
        fprintf(stderr, "pool: %s\n", err);
        return -1;
    }
    PGconn *c = NULL;
    if (db_acquire(g_pool, 1000, &c) != DB_OK) return -1;
    char sql[160];
    snprintf(sql, sizeof sql, "CREATE TABLE %s (id int PRIMARY KEY, v text NOT NULL)", g_table);
    int rc = db_exec(c, sql, 0, NULL, NULL, err, sizeof err);
    db_release(g_pool, c);
    return rc == DB_OK ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    char sql[160], err[256];
    PGconn *c = NULL;
    if (db_acquire(g_pool, 1000, &c) == DB_OK) {
        snprintf(sql, sizeof sql, "DROP TABLE IF EXISTS %s", g_table);
        db_exec(c, sql, 0, NULL, NULL, err, sizeof err);
        db_release(g_pool, c);
    }
    db_pool_close(g_pool);
    return 0;
}

/* Writes are deferred, a read sees them (same transaction, send order), COMMIT lands them. */
static void test_deferred_writes_commit(void **state) {
    (void)state;
    char err[256], sql[160];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    assert_int_equal(db_tx_begin_ex(g_pool, NULL, DB_TX_PIPELINE, &tx, err, sizeof err), DB_OK);
    assert_true(db_pipe_active(db_tx_conn(tx)));
    assert_int_equal(insert(tx, 1, "a", err, sizeof err), DB_OK);
    assert_int_equal(insert(tx, 2, "b", err, sizeof err), DB_OK);
    snprintf(sql, sizeof sql, "SELECT count(*), current_setting('transaction_isolation') FROM %s",
             g_table);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, &r, err, sizeof err), DB_OK);
    assert_string_equal(PQgetvalue(r, 0, 0), "2");
    PQclear(r);
    assert_int_equal(rows("true"), 0); /* not committed: invisible outside */
    assert_int_equal(insert(tx, 3, "c", err, sizeof err), DB_OK);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    assert_int_equal(rows("id IN (1, 2, 3)"), 3);
}

/* A deferred write that fails: its error comes back from the next read, the commit fails,
 * nothing of the transaction is kept, and the connection serves the next transaction. */
static void test_deferred_error_rolls_back(void **state) {
    (void)state;
    char err[256], sql[160];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    assert_int_equal(db_tx_begin_ex(g_pool, NULL, DB_TX_PIPELINE, &tx, err, sizeof err), DB_OK);
    assert_int_equal(insert(tx, 10, "x", err, sizeof err), DB_OK);
    assert_int_equal(insert(tx, 1, "dup", err, sizeof err), DB_OK); /* sent: not yet known */
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s", g_table);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, &r, err, sizeof err), DB_EUNIQUE);
    assert_null(r);
    assert_string_equal(db_sqlstate(), "23505");
    assert_int_not_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    assert_int_equal(rows("id = 10"), 0);

    /* the same, found only by the commit */
    assert_int_equal(db_tx_begin_ex(g_pool, NULL, DB_TX_PIPELINE, &tx, err, sizeof err), DB_OK);
    assert_int_equal(insert(tx, 11, "y", err, sizeof err), DB_OK);
    assert_int_equal(insert(tx, 2, "dup", err, sizeof err), DB_OK);
    assert_int_equal(insert(tx, 12, "z", err, sizeof err), DB_OK);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_EUNIQUE);
    assert_int_equal(rows("id IN (11, 12)"), 0);
    assert_int_equal(rows("true"), 3); /* the connection is clean and reused */
}

/* More writes than DB_PIPE_MAX wait for a sync: the send syncs on the way; all land. */
static void test_bound_and_rollback(void **state) {
    (void)state;
    char err[256];
    db_tx *tx = NULL;
    int n = DB_PIPE_MAX * 2 + 7;
    assert_int_equal(db_tx_begin_ex(g_pool, NULL, DB_TX_PIPELINE, &tx, err, sizeof err), DB_OK);
    for (int i = 0; i < n; i++)
        assert_int_equal(insert(tx, 1000 + i, "bulk", err, sizeof err), DB_OK);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    assert_int_equal(rows("v = 'bulk'"), n);

    /* rollback with writes still in flight: none kept, connection reusable */
    assert_int_equal(db_tx_begin_ex(g_pool, NULL, DB_TX_PIPELINE, &tx, err, sizeof err), DB_OK);
    for (int i = 0; i < 10; i++)
        assert_int_equal(insert(tx, 5000 + i, "gone", err, sizeof err), DB_OK);
    db_tx_rollback(tx);
    assert_int_equal(rows("v = 'gone'"), 0);
    PGconn *c = NULL;
    assert_int_equal(db_acquire(g_pool, 1000, &c), DB_OK);
    assert_false(db_pipe_active(c));
    exec_ok(c, "SELECT 1");
    db_release(g_pool, c);
}

/* An explicit batch: several reads behind one sync, results in their slots; a failing batch
 * hands out none; the connection leaves pipeline mode with db_pipe_end. */
static void test_explicit_batch(void **state) {
    (void)state;
    char err[256];
    PGconn *c = NULL;
    PGresult *a = NULL, *b = NULL, *d = NULL;
    assert_int_equal(db_acquire(g_pool, 1000, &c), DB_OK);
    assert_int_equal(db_pipe_begin(c, err, sizeof err), DB_OK);
    assert_int_equal(db_pipe_begin(c, err, sizeof err), DB_OK); /* idempotent on the same */
    const char *p[] = {"41"};
    assert_int_equal(
        db_pipe_send(c, "SELECT $1::int + 1", 1, p, NULL, NULL, 0, &a, err, sizeof err), DB_OK);
    assert_int_equal(db_pipe_send(c, "SELECT 'x'", 0, NULL, NULL, NULL, 0, NULL, err, sizeof err),
                     DB_OK);
    assert_int_equal(db_pipe_send(c, "SELECT 'two'", 0, NULL, NULL, NULL, 0, &b, err, sizeof err),
                     DB_OK);
    assert_null(a);
    assert_int_equal(db_pipe_flush(c, err, sizeof err), DB_OK);
    assert_non_null(a);
    assert_non_null(b);
    assert_string_equal(PQgetvalue(a, 0, 0), "42");
    assert_string_equal(PQgetvalue(b, 0, 0), "two");
    PQclear(a);
    PQclear(b);
    a = b = NULL;
    assert_int_equal(db_pipe_send(c, "SELECT 1", 0, NULL, NULL, NULL, 0, &a, err, sizeof err),
                     DB_OK);
    assert_int_equal(db_pipe_send(c, "SELECT 1/0", 0, NULL, NULL, NULL, 0, &b, err, sizeof err),
                     DB_OK);
    assert_int_equal(db_pipe_send(c, "SELECT 3", 0, NULL, NULL, NULL, 0, &d, err, sizeof err),
                     DB_OK);
    assert_int_equal(db_pipe_flush(c, err, sizeof err), DB_ERR);
    assert_string_equal(db_sqlstate(), "22012");
    assert_null(a);
    assert_null(b);
    assert_null(d);
    assert_int_equal(db_pipe_end(c, err, sizeof err), DB_OK);
    assert_false(db_pipe_active(c));
    exec_ok(c, "SELECT 1"); /* plain mode again */
    db_release(g_pool, c);
}

/* A caller's deadline bounds the pipelined transaction's statements (statement_timeout, local
 * to it), and deadlines that differ call after call do not each leave a prepared statement
 * behind on the connection: the timeout is a parameter, not part of the statement's text. */
static void test_deadline_is_a_parameter(void **state) {
    (void)state;
    char err[256];
    db_pool *one = NULL;
    assert_int_equal(db_pool_open(g_dsn, 1, &one, err, sizeof err), DB_OK);
    long prepared[6] = {0};
    for (int i = 0; i < 6; i++) {
        db_tx *tx = NULL;
        PGresult *r = NULL;
        ctx_set_deadline_ms(20000 + 137 * i);
        assert_int_equal(db_tx_begin_ex(one, NULL, DB_TX_PIPELINE, &tx, err, sizeof err), DB_OK);
        assert_int_equal(db_exec(db_tx_conn(tx),
                                 "SELECT current_setting('statement_timeout'), "
                                 "(SELECT count(*) FROM pg_prepared_statements)",
                                 0, NULL, &r, err, sizeof err),
                         DB_OK);
        ctx_clear();
        const char *t = PQgetvalue(r, 0, 0); /* e.g. "20s" or "19998ms": never the default 0 */
        assert_true(strcmp(t, "0") != 0 && (strstr(t, "ms") || strchr(t, 's')));
        prepared[i] = atol(PQgetvalue(r, 0, 1));
        PQclear(r);
        assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    }
    for (int i = 2; i < 6; i++)
        assert_int_equal(prepared[i], prepared[1]);
    db_pool_close(one);
}

int main(void) {
    g_dsn = getenv("UPSQUAD_PG_ADMIN_DSN");
    if (!g_dsn || !*g_dsn) {
        printf("SKIP test_db_pipe: UPSQUAD_PG_ADMIN_DSN is not set\n");
        return 0;
    }
    log_init("test_db_pipe", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_deferred_writes_commit),
        cmocka_unit_test(test_deferred_error_rolls_back),
        cmocka_unit_test(test_bound_and_rollback),
        cmocka_unit_test(test_explicit_batch),
        cmocka_unit_test(test_deadline_is_a_parameter),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
