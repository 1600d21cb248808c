/* Numbered SQL migrations applied under an advisory lock (see db_migrate in db.h). */
#include "db.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ids.h"
#include "log.h"
#include "util.h"

#define MIG_MAX_FILES 4096
#define MIG_MAX_BYTES (8L << 20) /* one migration file; larger ones are refused */
#define MIG_NAME_MAX 256

typedef struct mig_file {
    int version;
    char name[MIG_NAME_MAX];
    char *sql; /* NUL-terminated file content, owned */
    char sum[65];
} mig_file;

typedef struct mig_applied {
    int version;
    char sum[65];
} mig_applied;

typedef struct mig_run {
    PGconn *c;
    const char *schema;
    char table[96]; /* "schema".schema_migrations */
    char lock_key[96];
    mig_file *files;
    int nfiles;
    mig_applied *applied;
    int napplied;
} mig_run;

/* 1: a migration file name (version in *version); 0: not a .sql file (ignored);
 * -1: a .sql file that does not follow NNN_name.sql. */
static int mig_parse_name(const char *fn, int *version) {
    size_t n = strlen(fn);
    if (n < 4 || strcmp(fn + n - 4, ".sql") != 0) return 0;
    const char *q = fn;
    long v = 0;
    while (*q >= '0' && *q <= '9') {
        v = v * 10 + (*q - '0');
        if (v > INT_MAX) return -1;
        q++;
    }
    if (q == fn || *q != '_' || n >= MIG_NAME_MAX) return -1;
    *version = (int)v;
    return 1;
}

static int mig_read(const char *path, char **out, size_t *len, char *err, size_t errlen) {
    char *buf = NULL;
    if (util_read_file(path, MIG_MAX_BYTES, &buf, len, err, errlen) != 0) return DB_EIO;
    if (memchr(buf, '\0', *len)) {
        snprintf(err, errlen, "%s: contains a NUL byte", path);
        free(buf);
        return DB_EIO;
    }
    *out = buf;
    return DB_OK;
}

static int mig_cmp(const void *a, const void *b) {
    const mig_file *x = a, *y = b;
    return (x->version > y->version) - (x->version < y->version);
}

static void mig_free_files(mig_file *files, int n) {
    for (int i = 0; i < n; i++)
        free(files[i].sql);
    free(files);
}

/* Reads every NNN_name.sql of dir, sorted by version, with its checksum. */
static int mig_load_dir(const char *dir, mig_file **out, int *nout, char *err, size_t errlen) {
    int rc = DB_OK, n = 0;
    mig_file *files = calloc(MIG_MAX_FILES, sizeof *files);
    DIR *d = opendir(dir);
    if (!files || !d) {
        snprintf(err, errlen, "%s: %s", dir, files ? strerror(errno) : "out of memory");
        rc = files ? DB_EIO : DB_ENOMEM;
        goto done;
    }
    struct dirent *e;
    while (rc == DB_OK && (e = readdir(d)) != NULL) {
        int version = 0, kind = mig_parse_name(e->d_name, &version);
        if (kind == 0) continue;
        if (kind < 0 || n == MIG_MAX_FILES) {
            snprintf(err, errlen, "%s/%s: %s", dir, e->d_name,
                     kind < 0 ? "migration files are named NNN_name.sql" : "too many files");
            rc = DB_EINVAL;
            break;
        }
        mig_file *f = &files[n];
        f->version = version;
        snprintf(f->name, sizeof f->name, "%s", e->d_name);
        char path[PATH_MAX];
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        rc = mig_read(path, &f->sql, &len, err, errlen);
        if (rc == DB_OK) ids_sha256_hex(f->sql, len, f->sum);
        if (rc == DB_OK && f->sum[0] == 0) {
            snprintf(err, errlen, "sha256 failed");
            rc = DB_ENOMEM;
        }
        if (f->sql) n++;
    }
    if (rc != DB_OK) goto done;
    qsort(files, (size_t)n, sizeof *files, mig_cmp);
    for (int i = 1; i < n; i++) {
        if (files[i].version == files[i - 1].version) {
            snprintf(err, errlen, "%s: %s and %s share version %d", dir, files[i - 1].name,
                     files[i].name, files[i].version);
            rc = DB_EINVAL;
            goto done;
        }
    }
done:
    if (d) closedir(d);
    if (rc != DB_OK) {
        mig_free_files(files, n);
        return rc;
    }
    *out = files;
    *nout = n;
    return DB_OK;
}

static int mig_simple(mig_run *r, const char *sql, char *err, size_t errlen) {
    PGresult *res = PQexec(r->c, sql);
    int rc = db__status_of(res, r->c, err, errlen);
    PQclear(res);
    return rc;
}

/* BEGIN, no statement timeout (a migration or the wait for another replica's may be long),
 * then the migration lock. */
static int mig_begin_locked(mig_run *r, char *err, size_t errlen) {
    int rc = mig_simple(r, "BEGIN; SET LOCAL statement_timeout = 0", err, errlen);
    const char *key[] = {r->lock_key};
    if (rc == DB_OK)
        rc = db_exec(r->c, "SELECT pg_advisory_xact_lock(hashtext($1))", 1, key, NULL, err, errlen);
    return rc;
}

static int mig_commit(mig_run *r, char *err, size_t errlen) {
    PGresult *res = PQexec(r->c, "COMMIT");
    int rc = db__status_of(res, r->c, err, errlen);
    if (rc == DB_OK && strcmp(PQcmdStatus(res), "COMMIT") != 0) {
        snprintf(err, errlen, "commit rolled back");
        rc = DB_ERR;
    }
    PQclear(res);
    return rc;
}

/* Creates the schema (when missing) and the bookkeeping table, and reads what is applied. */
static int mig_prepare(mig_run *r, char *err, size_t errlen) {
    PGresult *res = NULL;
    char sql[1024];
    const char *schema[] = {r->schema};
    int rc = mig_begin_locked(r, err, errlen);
    if (rc == DB_OK)
        rc = db_exec(r->c, "SELECT 1 FROM pg_namespace WHERE nspname = $1", 1, schema, &res, err,
                     errlen);
    if (rc == DB_OK && PQntuples(res) == 0) {
        snprintf(sql, sizeof sql, "CREATE SCHEMA \"%s\"", r->schema);
        rc = mig_simple(r, sql, err, errlen);
    }
    PQclear(res);
    res = NULL;
    if (rc == DB_OK) {
        snprintf(sql, sizeof sql,
                 "CREATE TABLE IF NOT EXISTS %s (version int PRIMARY KEY, name text NOT NULL, "
                 "checksum text NOT NULL, applied_at timestamptz NOT NULL DEFAULT now())",
                 r->table);
        rc = mig_simple(r, sql, err, errlen);
    }
    /* the ledger is the owner's alone: the default privileges a schema grants its login role
     * (DML on every table) would let that role forge or erase the record of what ran, so
     * whatever write privilege another role holds on it is taken back (a no-op when the runner
     * does not own it: then nobody else was granted anything by it) */
    if (rc == DB_OK) {
        snprintf(sql, sizeof sql,
                 "DO $m$ DECLARE g record; BEGIN"
                 " FOR g IN SELECT DISTINCT grantee FROM information_schema.role_table_grants"
                 "  WHERE table_schema = '%s' AND table_name = 'schema_migrations'"
                 "  AND grantee NOT IN (current_user, 'PUBLIC')"
                 "  AND privilege_type IN ('INSERT', 'UPDATE', 'DELETE', 'TRUNCATE')"
                 " LOOP EXECUTE format('REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON %s FROM %%I',"
                 "  g.grantee); END LOOP; END $m$",
                 r->schema, r->table);
        rc = mig_simple(r, sql, err, errlen);
    }
    if (rc == DB_OK) {
        snprintf(sql, sizeof sql, "SELECT version, checksum FROM %s ORDER BY version", r->table);
        rc = db_exec(r->c, sql, 0, NULL, &res, err, errlen);
    }
    if (rc == DB_OK) {
        int n = PQntuples(res);
        r->applied = calloc((size_t)n + 1, sizeof *r->applied);
        if (!r->applied) {
            snprintf(err, errlen, "out of memory");
            rc = DB_ENOMEM;
        }
        for (int i = 0; rc == DB_OK && i < n; i++) {
            r->applied[i].version = atoi(PQgetvalue(res, i, 0));
            snprintf(r->applied[i].sum, sizeof r->applied[i].sum, "%s", PQgetvalue(res, i, 1));
        }
        r->napplied = rc == DB_OK ? n : 0;
    }
    PQclear(res);
    if (rc == DB_OK) rc = mig_commit(r, err, errlen);
    return rc;
}

static const mig_applied *mig_find(const mig_run *r, int version) {
    for (int i = 0; i < r->napplied; i++)
        if (r->applied[i].version == version) return &r->applied[i];
    return NULL;
}

static int mig_drift(const mig_file *f, const char *sum, char *err, size_t errlen) {
    if (strcmp(f->sum, sum) == 0) return DB_OK;
    snprintf(err, errlen,
             "migration %s was modified after it was applied (checksum %.12s, applied %.12s)",
             f->name, f->sum, sum);
    return DB_ECHECKSUM;
}

/* Refuses edited applied files and never-applied files older than the newest applied one. */
static int mig_verify(const mig_run *r, char *err, size_t errlen) {
    int newest = r->napplied ? r->applied[r->napplied - 1].version : -1;
    int known = 0;
    for (int i = 0; i < r->nfiles; i++) {
        const mig_file *f = &r->files[i];
        const mig_applied *a = mig_find(r, f->version);
        if (a) {
            known++;
            int rc = mig_drift(f, a->sum, err, errlen);
            if (rc != DB_OK) return rc;
        } else if (f->version < newest) {
            snprintf(err, errlen, "migration %s was never applied but version %d already is",
                     f->name, newest);
            return DB_EINVAL;
        }
    }
    if (known < r->napplied)
        log_warn("db.migrate.unknown", "schema %s has %d applied version(s) without a file here",
                 r->schema, r->napplied - known);
    return DB_OK;
}

/* One file in one transaction; re-checked under the lock since another replica may have
 * applied it since mig_prepare. *did = 1 when this call applied it. */
static int mig_apply(mig_run *r, const mig_file *f, int *did, char *err, size_t errlen) {
    char sql[256], vbuf[16];
    PGresult *res = NULL;
    *did = 0;
    snprintf(vbuf, sizeof vbuf, "%d", f->version);
    const char *ver[] = {vbuf};
    int rc = mig_begin_locked(r, err, errlen);
    if (rc == DB_OK) {
        snprintf(sql, sizeof sql, "SELECT checksum FROM %s WHERE version = $1", r->table);
        rc = db_exec(r->c, sql, 1, ver, &res, err, errlen);
    }
    if (rc == DB_OK && PQntuples(res) > 0) {
        rc = mig_drift(f, PQgetvalue(res, 0, 0), err, errlen);
        PQclear(res);
        if (rc == DB_OK) rc = mig_simple(r, "ROLLBACK", err, errlen);
        return rc;
    }
    PQclear(res);
    if (rc == DB_OK) {
        snprintf(sql, sizeof sql, "SET LOCAL search_path = \"%s\"", r->schema);
        rc = mig_simple(r, sql, err, errlen);
    }
    if (rc == DB_OK) {
        char inner[512];
        rc = mig_simple(r, f->sql, inner, sizeof inner);
        if (rc != DB_OK) snprintf(err, errlen, "migration %s: %s", f->name, inner);
    }
    if (rc == DB_OK) {
        const char *row[] = {vbuf, f->name, f->sum};
        snprintf(sql, sizeof sql, "INSERT INTO %s (version, name, checksum) VALUES ($1, $2, $3)",
                 r->table);
        rc = db_exec(r->c, sql, 3, row, NULL, err, errlen);
    }
    if (rc == DB_OK) rc = mig_commit(r, err, errlen);
    if (rc == DB_OK) *did = 1;
    return rc;
}

int db_migrate(db_pool *p, const char *schema, const char *dir, int *applied, char *err,
               size_t errlen) {
    char scratch[8];
    if (!err || errlen == 0) {
        err = scratch;
        errlen = sizeof scratch;
    }
    err[0] = '\0';
    if (applied) *applied = 0;
    if (!p || !dir || !db__ident_ok(schema)) {
        snprintf(err, errlen, "db_migrate: bad schema name or folder");
        return DB_EINVAL;
    }
    mig_run r = {.schema = schema};
    snprintf(r.table, sizeof r.table, "\"%s\".schema_migrations", schema);
    snprintf(r.lock_key, sizeof r.lock_key, "schema_migrations:%s", schema);
    int rc = mig_load_dir(dir, &r.files, &r.nfiles, err, errlen);
    if (rc != DB_OK) return rc;
    rc = db__acquire(p, -1, &r.c, err, errlen);
    if (rc == DB_OK) rc = mig_prepare(&r, err, errlen);
    if (rc == DB_OK) rc = mig_verify(&r, err, errlen);
    int count = 0;
    for (int i = 0; rc == DB_OK && i < r.nfiles; i++) {
        if (mig_find(&r, r.files[i].version)) continue;
        int did = 0;
        rc = mig_apply(&r, &r.files[i], &did, err, errlen);
        if (did) {
            count++;
            log_info("db.migrate.applied", "schema %s: %s", schema, r.files[i].name);
        }
    }
    if (applied) *applied = count;
    if (r.c) {
        /* A migration may have changed session state (SET, search_path): this connection is
         * not handed to anyone else. */
        db__discard(p, r.c);
    }
    mig_free_files(r.files, r.nfiles);
    free(r.applied);
    return rc;
}

int db_migrate_as(db_pool *p, const char *owner_dsn, const char *schema, const char *dir,
                  int *applied, char *err, size_t errlen) {
    if (!owner_dsn || !owner_dsn[0]) {
        if (!p) {
            if (err && errlen) snprintf(err, errlen, "db_migrate_as: no pool and no owner DSN");
            return DB_EINVAL;
        }
        return db_migrate(p, schema, dir, applied, err, errlen);
    }
    db_pool *owner = NULL;
    db_pool_opts o;
    db_pool_opts_default(&o);
    o.size = 1;
    o.application_name = "upsquad-migrate";
    int rc = db_pool_open_ex(owner_dsn, &o, &owner, err, errlen);
    if (rc == DB_OK) rc = db_migrate(owner, schema, dir, applied, err, errlen);
    db_pool_close(owner);
    return rc;
}
