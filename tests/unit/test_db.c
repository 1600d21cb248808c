/* libcommon/db against the real Postgres of the test runtime (UPSQUAD_PG_ADMIN_DSN).
 *
 * The test creates its own login role (not a superuser, so row-level security applies to it)
 * and throw-away schemas owned by that role, and drops them all at the end. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "db.h"
#include "log.h"

#define FIXTURES "tests/fixtures/migrations"
#define BASIC_FILES 4 /* .sql files in db_basic */

static const char *g_admin_dsn;
static char g_role[64]; /* test login role, also the prefix of the test schemas */
static char g_password[33];
static char *g_role_dsn;
static PGconn *g_admin;

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Runs admin SQL; fails the test on error. Returns the result when want_res, else NULL. */
static PGresult *admin(const char *sql, int want_res) {
    PGresult *res = PQexec(g_admin, sql);
    ExecStatusType st = PQresultStatus(res);
    if (st != PGRES_COMMAND_OK && st != PGRES_TUPLES_OK) {
        print_error("admin SQL failed: %s: %s\n", sql, PQresultErrorMessage(res));
        PQclear(res);
        fail();
    }
    if (want_res) return res;
    PQclear(res);
    return NULL;
}

/* Creates schema <role>_<suffix> owned by the test role; returns its name (static buffer
 * per call site is not needed: the caller passes one). */
static void make_schema(const char *suffix, char *out, size_t outlen) {
    char sql[256];
    snprintf(out, outlen, "%s_%s", g_role, suffix);
    snprintf(sql, sizeof sql, "CREATE SCHEMA %s AUTHORIZATION %s", out, g_role);
    admin(sql, 0);
}

static long scalar_long(PGconn *c, const char *sql) {
    PGresult *res = NULL;
    char err[256];
    int rc = db_exec(c, sql, 0, NULL, &res, err, sizeof err);
    if (rc != DB_OK) print_error("%s: %s\n", sql, err);
    assert_int_equal(rc, DB_OK);
    assert_int_equal(PQntuples(res), 1);
    long v = atol(PQgetvalue(res, 0, 0));
    PQclear(res);
    return v;
}

static int group_setup(void **state) {
    (void)state;
    unsigned char rnd[16];
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(rnd, 1, sizeof rnd, f) != sizeof rnd) return -1;
    fclose(f);
    for (int i = 0; i < 16; i++)
        snprintf(g_password + 2 * i, 3, "%02x", rnd[i]);
    snprintf(g_role, sizeof g_role, "t_db_%d_%02x%02x", (int)getpid(), rnd[0], rnd[1]);
    g_admin = PQconnectdb(g_admin_dsn);
    if (PQstatus(g_admin) != CONNECTION_OK) {
        fprintf(stderr, "admin connect: %s\n", PQerrorMessage(g_admin));
        return -1;
    }
    char sql[256];
    snprintf(sql, sizeof sql, "CREATE ROLE %s LOGIN PASSWORD '%s' NOSUPERUSER NOBYPASSRLS", g_role,
             g_password);
    PQclear(PQexec(g_admin, "SET client_min_messages = warning"));
    PGresult *res = PQexec(g_admin, sql);
    int ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    PQclear(res);
    if (!ok) return -1;
    char err[256];
    if (db_conninfo_as(g_admin_dsn, g_role, g_password, &g_role_dsn, err, sizeof err) != DB_OK) {
        fprintf(stderr, "conninfo: %s\n", err);
        return -1;
    }
    return 0;
}

static int group_teardown(void **state) {
    (void)state;
    char sql[512];
    snprintf(sql, sizeof sql,
             "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = '%s'", g_role);
    PQclear(PQexec(g_admin, sql));
    PGresult *res = NULL;
    snprintf(sql, sizeof sql, "SELECT nspname FROM pg_namespace WHERE nspname LIKE '%s\\_%%'",
             g_role);
    res = PQexec(g_admin, sql);
    for (int i = 0; i < PQntuples(res); i++) {
        snprintf(sql, sizeof sql, "DROP SCHEMA %s CASCADE", PQgetvalue(res, i, 0));
        PQclear(PQexec(g_admin, sql));
    }
    PQclear(res);
    snprintf(sql, sizeof sql, "DROP OWNED BY %s; DROP ROLE %s", g_role, g_role);
    res = PQexec(g_admin, sql);
    int ok = PQresultStatus(res) == PGRES_COMMAND_OK;
    if (!ok) fprintf(stderr, "teardown: %s\n", PQresultErrorMessage(res));
    PQclear(res);
    PQfinish(g_admin);
    free(g_role_dsn);
    return ok ? 0 : -1;
}

/* ---- statements and error classes ---- */

static void test_exec_and_sqlstate(void **state) {
    (void)state;
    db_pool *p = NULL;
    char err[256];
    assert_int_equal(db_pool_open(g_admin_dsn, 2, &p, err, sizeof err), DB_OK);
    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);

    PGresult *res = NULL;
    const char *params[] = {"41", NULL};
    assert_int_equal(
        db_exec(c, "SELECT $1::int + 1, $2::text IS NULL", 2, params, &res, err, sizeof err),
        DB_OK);
    assert_string_equal(PQgetvalue(res, 0, 0), "42");
    assert_string_equal(PQgetvalue(res, 0, 1), "t");
    PQclear(res);

    assert_int_equal(db_exec(c, "CREATE TEMP TABLE u (k int PRIMARY KEY, v int CHECK (v > 0))", 0,
                             NULL, NULL, err, sizeof err),
                     DB_OK);
    assert_int_equal(db_exec(c, "INSERT INTO u VALUES (1, 1)", 0, NULL, NULL, err, sizeof err),
                     DB_OK);
    res = (PGresult *)1;
    assert_int_equal(db_exec(c, "INSERT INTO u VALUES (1, 1)", 0, NULL, &res, err, sizeof err),
                     DB_EUNIQUE);
    assert_null(res);
    assert_string_equal(db_sqlstate(), "23505");
    assert_non_null(strstr(err, "duplicate key"));
    assert_int_equal(db_exec(c, "INSERT INTO u VALUES (2, -1)", 0, NULL, NULL, err, sizeof err),
                     DB_ECHECK);
    assert_string_equal(db_sqlstate(), "23514");
    assert_int_equal(db_exec(c, "SELEC 1", 0, NULL, NULL, err, sizeof err), DB_ERR);
    assert_string_equal(db_sqlstate(), "42601");
    assert_non_null(strstr(err, "42601"));
    assert_int_equal(db_exec(c, "SELECT 1", 1, NULL, NULL, err, sizeof err), DB_EINVAL);

    /* binary parameters: bytes with NULs survive the round trip */
    const char blob[4] = {'a', 0, 'b', 0};
    const char *vals[] = {blob};
    int lens[] = {4}, fmts[] = {1};
    assert_int_equal(
        db_exec_bin(c, "SELECT $1::bytea", 1, vals, lens, fmts, 1, &res, err, sizeof err), DB_OK);
    assert_int_equal(PQgetlength(res, 0, 0), 4);
    assert_memory_equal(PQgetvalue(res, 0, 0), blob, 4);
    PQclear(res);

    db_release(p, c);
    db_pool_close(p);
}

static void test_statement_timeout(void **state) {
    (void)state;
    db_pool_opts o;
    db_pool_opts_default(&o);
    o.size = 1;
    o.statement_timeout_ms = 100;
    db_pool *p = NULL;
    char err[256];
    assert_int_equal(db_pool_open_ex(g_admin_dsn, &o, &p, err, sizeof err), DB_OK);
    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    double t0 = now_ms();
    assert_int_equal(db_exec(c, "SELECT pg_sleep(2)", 0, NULL, NULL, err, sizeof err),
                     DB_ECANCELED);
    assert_true(now_ms() - t0 < 1500);
    assert_string_equal(db_sqlstate(), "57014");
    db_release(p, c);
    db_pool_close(p);
}

static void test_conninfo_and_bad_password(void **state) {
    (void)state;
    char *ci = NULL, err[256];
    assert_int_equal(db_conninfo_as("host=h port=5 user=x password=y dbname=d", "it's", "p\\w", &ci,
                                    err, sizeof err),
                     DB_OK);
    assert_non_null(strstr(ci, "user='it\\'s'"));
    assert_non_null(strstr(ci, "password='p\\\\w'"));
    assert_non_null(strstr(ci, "dbname='d'"));
    free(ci);
    assert_int_equal(db_conninfo_as("host=h bogus_key=1", "u", NULL, &ci, err, sizeof err),
                     DB_EINVAL);
    assert_null(ci);

    assert_int_equal(db_conninfo_as(g_admin_dsn, g_role, "wrong-password", &ci, err, sizeof err),
                     DB_OK);
    db_pool *p = NULL;
    assert_int_equal(db_pool_open(ci, 1, &p, err, sizeof err), DB_ECONN);
    assert_null(p);
    assert_non_null(strstr(err, "password authentication failed"));
    assert_null(strstr(err, "wrong-password"));
    free(ci);
}

/* ---- pool ---- */

typedef struct {
    db_pool *p;
    int rc;
    double waited_ms;
} waiter;

static void *acquire_thread(void *arg) {
    waiter *w = arg;
    PGconn *c = NULL;
    double t0 = now_ms();
    w->rc = db_acquire(w->p, 3000, &c);
    w->waited_ms = now_ms() - t0;
    if (w->rc == DB_OK) db_release(w->p, c);
    return NULL;
}

static void test_pool_exhaustion(void **state) {
    (void)state;
    db_pool *p = NULL;
    char err[256];
    assert_int_equal(db_pool_open(g_admin_dsn, 2, &p, err, sizeof err), DB_OK);
    PGconn *a = NULL, *b = NULL, *c = NULL;
    assert_int_equal(db_acquire(p, 100, &a), DB_OK);
    assert_int_equal(db_acquire(p, 100, &b), DB_OK);
    assert_ptr_not_equal(a, b);
    int open = 0, used = 0;
    db_pool_stats(p, &open, &used);
    assert_int_equal(open, 2);
    assert_int_equal(used, 2);

    double t0 = now_ms();
    assert_int_equal(db_acquire(p, 200, &c), DB_ETIMEOUT);
    double waited = now_ms() - t0;
    assert_null(c);
    assert_true(waited >= 190 && waited < 1000);

    /* A waiter is woken by a release, long before its timeout. */
    waiter w = {.p = p};
    pthread_t th;
    pthread_create(&th, NULL, acquire_thread, &w);
    sleep_ms(150);
    db_release(p, a);
    pthread_join(th, NULL);
    assert_int_equal(w.rc, DB_OK);
    assert_true(w.waited_ms >= 100 && w.waited_ms < 1500);

    assert_int_equal(db_acquire(p, 100, &a), DB_OK);
    db_release(p, a);
    db_release(p, b);
    db_tx *tx = NULL;
    assert_int_equal(db_tx_begin(p, "org", &tx, err, sizeof err), DB_OK);
    db_tx_rollback(tx);
    db_pool_close(p);
}

static void test_pool_exhausted_tx(void **state) {
    (void)state;
    db_pool_opts o;
    db_pool_opts_default(&o);
    o.size = 1;
    o.acquire_timeout_ms = 100;
    db_pool *p = NULL;
    char err[256] = "";
    assert_int_equal(db_pool_open_ex(g_admin_dsn, &o, &p, err, sizeof err), DB_OK);
    db_tx *t1 = NULL, *t2 = NULL;
    assert_int_equal(db_tx_begin(p, "a", &t1, err, sizeof err), DB_OK);
    assert_int_equal(db_tx_begin(p, "a", &t2, err, sizeof err), DB_ETIMEOUT);
    assert_null(t2);
    assert_non_null(strstr(err, "exhausted"));
    db_tx_rollback(t1);
    db_pool_close(p);
}

static int backend_pid(PGconn *c) {
    return (int)scalar_long(c, "SELECT pg_backend_pid()");
}

static void terminate_and_wait(int pid) {
    char sql[200];
    snprintf(sql, sizeof sql, "SELECT pg_terminate_backend(%d)", pid);
    admin(sql, 0);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM pg_stat_activity WHERE pid = %d", pid);
    for (int i = 0; i < 200; i++) {
        PGresult *res = admin(sql, 1);
        int gone = strcmp(PQgetvalue(res, 0, 0), "0") == 0;
        PQclear(res);
        if (gone) return;
        sleep_ms(10);
    }
    fail_msg("backend %d did not exit", pid);
}

static void test_broken_connection_recovery(void **state) {
    (void)state;
    db_pool *p = NULL;
    char err[256];
    assert_int_equal(db_pool_open(g_admin_dsn, 1, &p, err, sizeof err), DB_OK);

    /* killed while idle in the pool: the next acquire hands out a fresh connection */
    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    int pid1 = backend_pid(c);
    db_release(p, c);
    terminate_and_wait(pid1);
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    int pid2 = backend_pid(c);
    assert_int_not_equal(pid1, pid2);

    /* killed while in use: the statement fails as a connection error, the release drops the
     * connection, and a transaction afterwards works */
    terminate_and_wait(pid2);
    assert_int_equal(db_exec(c, "SELECT 1", 0, NULL, NULL, err, sizeof err), DB_ECONN);
    db_release(p, c);
    db_tx *tx = NULL;
    assert_int_equal(db_tx_begin(p, "org-x", &tx, err, sizeof err), DB_OK);
    assert_int_not_equal(backend_pid(db_tx_conn(tx)), pid2);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    db_pool_close(p);
}

static void test_release_rolls_back(void **state) {
    (void)state;
    db_pool *p = NULL;
    char err[256];
    assert_int_equal(db_pool_open(g_admin_dsn, 1, &p, err, sizeof err), DB_OK);
    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    int pid = backend_pid(c);
    assert_int_equal(db_exec(c, "CREATE TEMP TABLE r (k int)", 0, NULL, NULL, err, sizeof err),
                     DB_OK);
    assert_int_equal(db_exec(c, "BEGIN", 0, NULL, NULL, err, sizeof err), DB_OK);
    assert_int_equal(db_exec(c, "INSERT INTO r VALUES (1)", 0, NULL, NULL, err, sizeof err), DB_OK);
    db_release(p, c); /* left inside a transaction */
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    assert_int_equal(backend_pid(c), pid); /* same connection, kept */
    assert_int_equal(PQtransactionStatus(c), PQTRANS_IDLE);
    assert_int_equal(scalar_long(c, "SELECT count(*) FROM r"), 0);
    db_release(p, c);
    db_pool_close(p);
}

static void test_commit_after_failed_statement(void **state) {
    (void)state;
    db_pool *p = NULL;
    char err[256], schema[96], sql[256];
    make_schema("commit", schema, sizeof schema);
    assert_int_equal(db_pool_open(g_role_dsn, 1, &p, err, sizeof err), DB_OK);
    db_tx *tx = NULL;
    assert_int_equal(db_tx_begin(p, NULL, &tx, err, sizeof err), DB_OK);
    snprintf(sql, sizeof sql, "CREATE TABLE %s.k (v int PRIMARY KEY)", schema);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, NULL, err, sizeof err), DB_OK);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);

    assert_int_equal(db_tx_begin(p, NULL, &tx, err, sizeof err), DB_OK);
    snprintf(sql, sizeof sql, "INSERT INTO %s.k VALUES (1)", schema);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, NULL, err, sizeof err), DB_OK);
    assert_int_equal(db_exec(db_tx_conn(tx), "SELECT 1/0", 0, NULL, NULL, err, sizeof err), DB_ERR);
    assert_string_equal(db_sqlstate(), "22012");
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_ERR);
    assert_string_equal(db_sqlstate(), "25P02");

    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s.k", schema);
    assert_int_equal(scalar_long(c, sql), 0);
    db_release(p, c);

    /* isolation and access mode flags apply to the transaction */
    assert_int_equal(
        db_tx_begin_ex(p, NULL, DB_TX_SERIALIZABLE | DB_TX_READ_ONLY, &tx, err, sizeof err), DB_OK);
    PGresult *res = NULL;
    assert_int_equal(
        db_exec(db_tx_conn(tx), "SHOW transaction_isolation", 0, NULL, &res, err, sizeof err),
        DB_OK);
    assert_string_equal(PQgetvalue(res, 0, 0), "serializable");
    PQclear(res);
    snprintf(sql, sizeof sql, "INSERT INTO %s.k VALUES (2)", schema);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, NULL, err, sizeof err), DB_ERR);
    assert_string_equal(db_sqlstate(), "25006");
    db_tx_rollback(tx);
    assert_int_equal(db_tx_begin_ex(p, NULL, 99, &tx, err, sizeof err), DB_EINVAL);
    assert_int_equal(db_tx_begin(p, "", &tx, err, sizeof err), DB_EINVAL);
    assert_null(tx);
    db_pool_close(p);
}

/* ---- migrations ---- */

static void test_migrate_twice(void **state) {
    (void)state;
    char schema[96], err[512], sql[256];
    make_schema("twice", schema, sizeof schema);
    db_pool *p = NULL;
    assert_int_equal(db_pool_open(g_role_dsn, 2, &p, err, sizeof err), DB_OK);
    int applied = -1;
    int rc = db_migrate(p, schema, FIXTURES "/db_basic", &applied, err, sizeof err);
    if (rc != DB_OK) print_error("migrate: %s\n", err);
    assert_int_equal(rc, DB_OK);
    assert_int_equal(applied, BASIC_FILES);
    assert_int_equal(db_migrate(p, schema, FIXTURES "/db_basic", &applied, err, sizeof err), DB_OK);
    assert_int_equal(applied, 0);

    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    snprintf(sql, sizeof sql,
             "SELECT string_agg(version || ':' || length(checksum), ',' ORDER BY version) "
             "FROM %s.schema_migrations",
             schema);
    PGresult *res = NULL;
    assert_int_equal(db_exec(c, sql, 0, NULL, &res, err, sizeof err), DB_OK);
    assert_string_equal(PQgetvalue(res, 0, 0), "1:64,2:64,9:64,10:64");
    PQclear(res);
    /* numeric order: the view of 10 was built on the view of 9 */
    snprintf(sql, sizeof sql, "SELECT string_agg(file, ',') FROM %s.applied_log", schema);
    assert_int_equal(db_exec(c, sql, 0, NULL, &res, err, sizeof err), DB_OK);
    assert_string_equal(PQgetvalue(res, 0, 0),
                        "001_accounts,002_notes,9_note_view,10_note_view_lengths");
    PQclear(res);
    /* the migration connection is not returned with the migration's session state */
    assert_int_equal(db_exec(c, "SHOW statement_timeout", 0, NULL, &res, err, sizeof err), DB_OK);
    assert_string_equal(PQgetvalue(res, 0, 0), "30s");
    PQclear(res);
    db_release(p, c);

    assert_int_equal(db_migrate(p, "Bad-Name", FIXTURES "/db_basic", NULL, err, sizeof err),
                     DB_EINVAL);
    assert_int_equal(db_migrate(p, schema, FIXTURES "/no_such_dir", NULL, err, sizeof err), DB_EIO);
    assert_non_null(strstr(err, "no_such_dir"));
    db_pool_close(p);
}

static void copy_dir(const char *from, const char *to) {
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "cp %s/*.sql %s/", from, to);
    assert_int_equal(system(cmd), 0);
}

static void write_file(const char *dir, const char *name, const char *text, const char *mode) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, mode);
    assert_non_null(f);
    fputs(text, f);
    fclose(f);
}

static void test_migrate_checksum_drift(void **state) {
    (void)state;
    char schema[96], err[512], dir[] = "/tmp/upsquad-test-mig-XXXXXX";
    assert_non_null(mkdtemp(dir));
    copy_dir(FIXTURES "/db_basic", dir);
    make_schema("drift", schema, sizeof schema);
    db_pool *p = NULL;
    assert_int_equal(db_pool_open(g_role_dsn, 1, &p, err, sizeof err), DB_OK);
    int applied = 0;
    assert_int_equal(db_migrate(p, schema, dir, &applied, err, sizeof err), DB_OK);
    assert_int_equal(applied, BASIC_FILES);

    /* an applied file edited, a new one added: refused before the new one runs */
    write_file(dir, "002_notes.sql", "-- edited\n", "a");
    write_file(dir, "011_more.sql", "CREATE TABLE more (id int);\n", "w");
    assert_int_equal(db_migrate(p, schema, dir, &applied, err, sizeof err), DB_ECHECKSUM);
    assert_int_equal(applied, 0);
    assert_non_null(strstr(err, "002_notes.sql"));

    /* restored: the new file applies */
    copy_dir(FIXTURES "/db_basic", dir);
    assert_int_equal(db_migrate(p, schema, dir, &applied, err, sizeof err), DB_OK);
    assert_int_equal(applied, 1);

    /* a file older than the newest applied version that never ran is refused */
    write_file(dir, "3_late.sql", "CREATE TABLE late (id int);\n", "w");
    assert_int_equal(db_migrate(p, schema, dir, &applied, err, sizeof err), DB_EINVAL);
    assert_non_null(strstr(err, "3_late.sql"));
    assert_int_equal(applied, 0);

    /* two files with one version, a badly named .sql file */
    char path[600];
    snprintf(path, sizeof path, "%s/3_late.sql", dir);
    unlink(path);
    write_file(dir, "0011_again.sql", "SELECT 1;\n", "w");
    assert_int_equal(db_migrate(p, schema, dir, &applied, err, sizeof err), DB_EINVAL);
    assert_non_null(strstr(err, "share version 11"));
    snprintf(path, sizeof path, "%s/0011_again.sql", dir);
    unlink(path);
    write_file(dir, "v12.sql", "SELECT 1;\n", "w");
    assert_int_equal(db_migrate(p, schema, dir, &applied, err, sizeof err), DB_EINVAL);
    assert_non_null(strstr(err, "v12.sql"));

    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    assert_int_equal(system(cmd), 0);
    db_pool_close(p);
}

static void test_migrate_failure_is_atomic(void **state) {
    (void)state;
    char schema[96], err[512], sql[300];
    make_schema("bad", schema, sizeof schema);
    db_pool *p = NULL;
    assert_int_equal(db_pool_open(g_role_dsn, 1, &p, err, sizeof err), DB_OK);
    int applied = -1;
    assert_int_equal(db_migrate(p, schema, FIXTURES "/db_bad", &applied, err, sizeof err), DB_ERR);
    assert_int_equal(applied, 1);
    assert_non_null(strstr(err, "002_broken.sql"));
    assert_string_equal(db_sqlstate(), "42601");
    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    snprintf(sql, sizeof sql,
             "SELECT count(*) FROM pg_tables WHERE schemaname = '%s' AND tablename IN "
             "('kept', 'half_done', 'never_reached')",
             schema);
    assert_int_equal(scalar_long(c, sql), 1);
    snprintf(sql, sizeof sql, "SELECT max(version) FROM %s.schema_migrations", schema);
    assert_int_equal(scalar_long(c, sql), 1);
    db_release(p, c);
    db_pool_close(p);
}

typedef struct {
    const char *schema;
    pthread_barrier_t *go;
    int rc, applied;
    char err[512];
} migrator;

static void *migrate_thread(void *arg) {
    migrator *m = arg;
    db_pool *p = NULL;
    m->rc = db_pool_open(g_role_dsn, 1, &p, m->err, sizeof m->err);
    pthread_barrier_wait(m->go);
    if (m->rc == DB_OK)
        m->rc = db_migrate(p, m->schema, FIXTURES "/db_basic", &m->applied, m->err, sizeof m->err);
    db_pool_close(p);
    return NULL;
}

static void test_migrate_concurrent(void **state) {
    (void)state;
    char err[256], sql[256];
    for (int round = 0; round < 3; round++) {
        char schema[96], suffix[16];
        snprintf(suffix, sizeof suffix, "conc%d", round);
        make_schema(suffix, schema, sizeof schema);
        pthread_barrier_t go;
        pthread_barrier_init(&go, NULL, 2);
        migrator m[2] = {{.schema = schema, .go = &go}, {.schema = schema, .go = &go}};
        pthread_t th[2];
        for (int i = 0; i < 2; i++)
            pthread_create(&th[i], NULL, migrate_thread, &m[i]);
        for (int i = 0; i < 2; i++)
            pthread_join(th[i], NULL);
        pthread_barrier_destroy(&go);
        for (int i = 0; i < 2; i++) {
            if (m[i].rc != DB_OK) print_error("migrator %d: %s\n", i, m[i].err);
            assert_int_equal(m[i].rc, DB_OK);
        }
        assert_int_equal(m[0].applied + m[1].applied, BASIC_FILES);
        db_pool *p = NULL;
        assert_int_equal(db_pool_open(g_role_dsn, 1, &p, err, sizeof err), DB_OK);
        PGconn *c = NULL;
        assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
        snprintf(sql, sizeof sql,
                 "SELECT count(DISTINCT file) * 100 + count(*) FROM %s.applied_log", schema);
        assert_int_equal(scalar_long(c, sql), BASIC_FILES * 100 + BASIC_FILES);
        db_release(p, c);
        db_pool_close(p);
    }
}

/* ---- row-level security ---- */

static int insert_account(db_tx *tx, const char *schema, const char *org, const char *name,
                          char *err, size_t errlen) {
    char sql[256];
    snprintf(sql, sizeof sql, "INSERT INTO %s.accounts (org_id, name) VALUES ($1, $2)", schema);
    const char *params[] = {org, name};
    return db_exec(db_tx_conn(tx), sql, 2, params, NULL, err, errlen);
}

static void test_rls_tenant_isolation(void **state) {
    (void)state;
    char schema[96], err[512], sql[256];
    make_schema("rls", schema, sizeof schema);
    db_pool *p = NULL;
    /* one connection: every transaction below reuses it, so leaks would show */
    assert_int_equal(db_pool_open(g_role_dsn, 1, &p, err, sizeof err), DB_OK);
    assert_int_equal(db_migrate(p, schema, FIXTURES "/db_basic", NULL, err, sizeof err), DB_OK);

    db_tx *tx = NULL;
    assert_int_equal(db_tx_begin(p, "org-a", &tx, err, sizeof err), DB_OK);
    assert_int_equal(insert_account(tx, schema, "org-a", "alice", err, sizeof err), DB_OK);
    assert_int_equal(insert_account(tx, schema, "org-a", "anna", err, sizeof err), DB_OK);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    assert_int_equal(db_tx_begin(p, "org-b", &tx, err, sizeof err), DB_OK);
    assert_int_equal(insert_account(tx, schema, "org-b", "bob", err, sizeof err), DB_OK);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);

    /* org A sees its two rows only, even when asking for B's */
    assert_int_equal(db_tx_begin(p, "org-a", &tx, err, sizeof err), DB_OK);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s.accounts", schema);
    assert_int_equal(scalar_long(db_tx_conn(tx), sql), 2);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s.accounts WHERE org_id = 'org-b'", schema);
    assert_int_equal(scalar_long(db_tx_conn(tx), sql), 0);
    snprintf(sql, sizeof sql, "UPDATE %s.accounts SET name = 'x' WHERE org_id = 'org-b'", schema);
    PGresult *res = NULL;
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, &res, err, sizeof err), DB_OK);
    assert_string_equal(PQcmdTuples(res), "0");
    PQclear(res);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);

    /* org A cannot write rows for org B, nor move its rows to B (WITH CHECK) */
    assert_int_equal(db_tx_begin(p, "org-a", &tx, err, sizeof err), DB_OK);
    assert_int_equal(insert_account(tx, schema, "org-b", "mallory", err, sizeof err),
                     DB_EPRIVILEGE);
    assert_string_equal(db_sqlstate(), "42501");
    assert_non_null(strstr(err, "row-level security"));
    db_tx_rollback(tx);
    assert_int_equal(db_tx_begin(p, "org-a", &tx, err, sizeof err), DB_OK);
    snprintf(sql, sizeof sql, "UPDATE %s.accounts SET org_id = 'org-b'", schema);
    assert_int_equal(db_exec(db_tx_conn(tx), sql, 0, NULL, NULL, err, sizeof err), DB_EPRIVILEGE);
    db_tx_rollback(tx);

    /* the setting does not outlive its transaction on the pooled connection */
    assert_int_equal(db_tx_begin(p, NULL, &tx, err, sizeof err), DB_OK);
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s.accounts", schema);
    assert_int_equal(scalar_long(db_tx_conn(tx), sql), 0);
    assert_int_equal(scalar_long(db_tx_conn(tx),
                                 "SELECT coalesce(length(current_setting('app.org_id', true)), 0)"),
                     0);
    assert_int_equal(db_tx_commit(tx, err, sizeof err), DB_OK);
    PGconn *c = NULL;
    assert_int_equal(db_acquire(p, 1000, &c), DB_OK);
    assert_int_equal(scalar_long(c, sql), 0);
    db_release(p, c);
    assert_int_equal(db_tx_begin(p, "org-b", &tx, err, sizeof err), DB_OK);
    assert_int_equal(scalar_long(db_tx_conn(tx), sql), 1);
    db_tx_rollback(tx);

    /* the rows exist: the superuser (which bypasses RLS) counts all three */
    snprintf(sql, sizeof sql, "SELECT count(*) FROM %s.accounts", schema);
    res = admin(sql, 1);
    assert_string_equal(PQgetvalue(res, 0, 0), "3");
    PQclear(res);
    db_pool_close(p);
}

int main(void) {
    g_admin_dsn = getenv("UPSQUAD_PG_ADMIN_DSN");
    if (!g_admin_dsn || !*g_admin_dsn) {
        printf("SKIP test_db: UPSQUAD_PG_ADMIN_DSN is not set\n");
        return 0;
    }
    log_init("test_db", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_exec_and_sqlstate),
        cmocka_unit_test(test_statement_timeout),
        cmocka_unit_test(test_conninfo_and_bad_password),
        cmocka_unit_test(test_pool_exhaustion),
        cmocka_unit_test(test_pool_exhausted_tx),
        cmocka_unit_test(test_broken_connection_recovery),
        cmocka_unit_test(test_release_rolls_back),
        cmocka_unit_test(test_commit_after_failed_statement),
        cmocka_unit_test(test_migrate_twice),
        cmocka_unit_test(test_migrate_checksum_drift),
        cmocka_unit_test(test_migrate_failure_is_atomic),
        cmocka_unit_test(test_migrate_concurrent),
        cmocka_unit_test(test_rls_tenant_isolation),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
