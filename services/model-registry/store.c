/* The model registry's SQL: loading the data file into model_registry, reading it back. */
#include "store.h"
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tables are schema-qualified: no reliance on the role's search_path. */
#define S "model_registry."

/* Serialises loads across replicas (transaction-scoped, released at COMMIT/ROLLBACK). */
#define SQL_LOCK "SELECT pg_advisory_xact_lock(hashtext('model_registry.catalog_load'))"

#define SQL_PREV_VERSION                                                                           \
    "SELECT catalog_version FROM " S "catalog_loads ORDER BY load_id DESC LIMIT 1"

#define SQL_NEW_LOAD                                                                               \
    "INSERT INTO " S "catalog_loads (catalog_version, file_sha256, source, loaded_by) "            \
    "VALUES ($1, $2, $3, $4) RETURNING load_id"

#define MODEL_COLS                                                                                 \
    "provider, display_name, released_on, max_context_tokens, supports_streaming, "                \
    "supports_tool_use, tool_use_quality, reasoning, code_generation, structured_ops, "            \
    "long_context, evidence, score_basis, status, deprecated_on, shutdown_on, successor"

/* One model: insert, or update when anything differs; the difference goes to catalog_changes
 * with the row before and after. `old` reads the row as it was before this statement. */
#define SQL_UPSERT_MODEL                                                                           \
    "WITH old AS (SELECT to_jsonb(m) - '{first_loaded_at,updated_at}'::text[] AS j "               \
    "             FROM " S "models m WHERE model_id = $1), "                                       \
    "up AS (INSERT INTO " S "models AS m (model_id, " MODEL_COLS ") "                              \
    "  VALUES ($1, $2, $3, $4::date, $5::integer, $6::boolean, $7::boolean, $8::float8, "          \
    "          $9::float8, $10::float8, $11::float8, $12::float8, $13, $14, $15, $16::date, "      \
    "          $17::date, $18) "                                                                   \
    "  ON CONFLICT (model_id) DO UPDATE SET (" MODEL_COLS ", listed, updated_at) = "               \
    "    (EXCLUDED.provider, EXCLUDED.display_name, EXCLUDED.released_on, "                        \
    "     EXCLUDED.max_context_tokens, EXCLUDED.supports_streaming, EXCLUDED.supports_tool_use, "  \
    "     EXCLUDED.tool_use_quality, EXCLUDED.reasoning, EXCLUDED.code_generation, "               \
    "     EXCLUDED.structured_ops, EXCLUDED.long_context, EXCLUDED.evidence, "                     \
    "     EXCLUDED.score_basis, EXCLUDED.status, EXCLUDED.deprecated_on, EXCLUDED.shutdown_on, "   \
    "     EXCLUDED.successor, true, now()) "                                                       \
    "  WHERE (m.provider, m.display_name, m.released_on, m.max_context_tokens, "                   \
    "         m.supports_streaming, m.supports_tool_use, m.tool_use_quality, m.reasoning, "        \
    "         m.code_generation, m.structured_ops, m.long_context, m.evidence, m.score_basis, "    \
    "         m.status, m.deprecated_on, m.shutdown_on, m.successor, m.listed) "                   \
    "    IS DISTINCT FROM "                                                                        \
    "        (EXCLUDED.provider, EXCLUDED.display_name, EXCLUDED.released_on, "                    \
    "         EXCLUDED.max_context_tokens, EXCLUDED.supports_streaming, "                          \
    "         EXCLUDED.supports_tool_use, EXCLUDED.tool_use_quality, EXCLUDED.reasoning, "         \
    "         EXCLUDED.code_generation, EXCLUDED.structured_ops, EXCLUDED.long_context, "          \
    "         EXCLUDED.evidence, EXCLUDED.score_basis, EXCLUDED.status, "                          \
    "         EXCLUDED.deprecated_on, EXCLUDED.shutdown_on, EXCLUDED.successor, true) "            \
    "  RETURNING to_jsonb(m) - '{first_loaded_at,updated_at}'::text[] AS j, "                      \
    "            (m.xmax = 0) AS inserted) "                                                       \
    "INSERT INTO " S "catalog_changes (load_id, model_id, kind, before, after) "                   \
    "SELECT $19::bigint, $1, "                                                                     \
    "       CASE WHEN up.inserted THEN 'model.added' "                                             \
    "            WHEN (SELECT (j->>'listed')::boolean FROM old) = false THEN 'model.relisted' "    \
    "            ELSE 'model.updated' END, "                                                       \
    "       CASE WHEN up.inserted THEN NULL ELSE (SELECT j FROM old) END, up.j "                   \
    "FROM up"

/* One price row, keyed by (model_id, effective_from). New amounts for an existing date are a
 * correction; the row before stays in catalog_changes. */
#define SQL_UPSERT_PRICE                                                                           \
    "WITH old AS (SELECT to_jsonb(p) - 'recorded_at' AS j FROM " S "model_prices p "               \
    "             WHERE model_id = $1 AND effective_from = $2::date), "                            \
    "up AS (INSERT INTO " S "model_prices AS p (model_id, effective_from, input_per_million, "     \
    "         output_per_million, source_url, verified_on, note) "                                 \
    "  VALUES ($1, $2::date, $3::numeric, $4::numeric, $5, $6::date, $7) "                         \
    "  ON CONFLICT (model_id, effective_from) DO UPDATE SET (input_per_million, "                  \
    "    output_per_million, source_url, verified_on, note, withdrawn_at) = "                      \
    "    (EXCLUDED.input_per_million, EXCLUDED.output_per_million, EXCLUDED.source_url, "          \
    "     EXCLUDED.verified_on, EXCLUDED.note, NULL) "                                             \
    "  WHERE (p.input_per_million, p.output_per_million, p.source_url, p.verified_on, p.note, "    \
    "         p.withdrawn_at) IS DISTINCT FROM (EXCLUDED.input_per_million, "                      \
    "         EXCLUDED.output_per_million, EXCLUDED.source_url, EXCLUDED.verified_on, "            \
    "         EXCLUDED.note, NULL::timestamptz) "                                                  \
    "  RETURNING to_jsonb(p) - 'recorded_at' AS j, (p.xmax = 0) AS inserted) "                     \
    "INSERT INTO " S "catalog_changes (load_id, model_id, kind, before, after) "                   \
    "SELECT $8::bigint, $1, "                                                                      \
    "       CASE WHEN up.inserted THEN 'price.added' "                                             \
    "            WHEN (SELECT j->>'withdrawn_at' FROM old) IS NOT NULL THEN 'price.restored' "     \
    "            WHEN (SELECT ROW((j->>'input_per_million')::numeric, "                            \
    "                             (j->>'output_per_million')::numeric) FROM old) "                 \
    "                 IS DISTINCT FROM ROW($3::numeric, $4::numeric) THEN 'price.corrected' "      \
    "            ELSE 'price.reverified' END, "                                                    \
    "       CASE WHEN up.inserted THEN NULL ELSE (SELECT j FROM old) END, up.j "                   \
    "FROM up"

/* Price rows of a model that the file no longer has are withdrawn, never deleted. */
#define SQL_WITHDRAW_PRICES                                                                        \
    "WITH w AS (UPDATE " S "model_prices p SET withdrawn_at = now() "                              \
    "  WHERE model_id = $1 AND withdrawn_at IS NULL AND NOT (effective_from = ANY ($2::date[])) "  \
    "  RETURNING to_jsonb(p) - 'recorded_at' AS j) "                                               \
    "INSERT INTO " S "catalog_changes (load_id, model_id, kind, before, after) "                   \
    "SELECT $3::bigint, $1, 'price.withdrawn', NULL, j FROM w"

/* Models that left the file are unlisted (kept with their history, no longer served). */
#define SQL_UNLIST_MODELS                                                                          \
    "WITH u AS (UPDATE " S "models m SET listed = false, updated_at = now() "                      \
    "  WHERE listed AND NOT (model_id = ANY ($1::text[])) "                                        \
    "  RETURNING model_id, to_jsonb(m) - '{first_loaded_at,updated_at}'::text[] AS j) "            \
    "INSERT INTO " S "catalog_changes (load_id, model_id, kind, before, after) "                   \
    "SELECT $2::bigint, model_id, 'model.unlisted', NULL, j FROM u"

#define SQL_FINISH_LOAD                                                                            \
    "UPDATE " S "catalog_loads SET changes = $2::integer WHERE load_id = $1::bigint"
#define SQL_DROP_LOAD "DELETE FROM " S "catalog_loads WHERE load_id = $1::bigint"

#define SQL_READ_MODELS                                                                            \
    "SELECT model_id, provider, display_name, to_char(released_on, 'YYYY-MM-DD'), "                \
    "       max_context_tokens, supports_streaming, supports_tool_use, tool_use_quality, "         \
    "       reasoning, code_generation, structured_ops, long_context, evidence, score_basis, "     \
    "       status, to_char(deprecated_on, 'YYYY-MM-DD'), to_char(shutdown_on, 'YYYY-MM-DD'), "    \
    "       successor "                                                                            \
    "FROM " S "models WHERE listed ORDER BY model_id COLLATE \"C\""

#define SQL_READ_PRICES                                                                            \
    "SELECT p.model_id, to_char(p.effective_from, 'YYYY-MM-DD'), p.input_per_million, "            \
    "       p.output_per_million, p.source_url, to_char(p.verified_on, 'YYYY-MM-DD'), p.note "     \
    "FROM " S "model_prices p JOIN " S "models m USING (model_id) "                                \
    "WHERE m.listed AND p.withdrawn_at IS NULL "                                                   \
    "ORDER BY p.model_id COLLATE \"C\", p.effective_from"

#define SQL_LAST_LOAD                                                                              \
    "SELECT load_id, catalog_version FROM " S "catalog_loads ORDER BY load_id DESC LIMIT 1"

#define fail(code, err, errlen, ...) util_errf((err), (errlen), (code), __VA_ARGS__)

/* Adds the rows a data-modifying statement reported (the catalog_changes it wrote). */
static int exec_count(PGconn *c, const char *sql, int n, const char *const *params, int *count,
                      char *err, size_t errlen) {
    PGresult *res = NULL;
    int rc = db_exec(c, sql, n, params, &res, err, errlen);
    if (rc == DB_OK) {
        *count += atoi(PQcmdTuples(res));
        PQclear(res);
    }
    return rc;
}

static const char *date_or_null(int32_t d, char buf[11]) {
    if (d == MR_DATE_NONE) return NULL;
    mr_date_format(d, buf);
    return buf;
}

static int upsert_model(PGconn *c, const mr_model *m, const char *load_id, int *changes, char *err,
                        size_t errlen) {
    char rel[11], dep[11], shut[11], ctx[16], tq[32], r[32], cg[32], so[32], lc[32];
    snprintf(ctx, sizeof ctx, "%d", (int)m->max_context_tokens);
    snprintf(tq, sizeof tq, "%.17g", m->tool_use_quality);
    snprintf(r, sizeof r, "%.17g", m->reasoning);
    snprintf(cg, sizeof cg, "%.17g", m->code_generation);
    snprintf(so, sizeof so, "%.17g", m->structured_ops);
    snprintf(lc, sizeof lc, "%.17g", m->long_context);
    const char *params[19] = {
        m->model_id,
        m->provider,
        m->display_name,
        date_or_null(m->released_on, rel),
        ctx,
        m->supports_streaming ? "true" : "false",
        m->supports_tool_use ? "true" : "false",
        tq,
        r,
        cg,
        so,
        lc,
        m->evidence,
        m->score_basis,
        mr_status_name(m->status),
        date_or_null(m->deprecated_on, dep),
        date_or_null(m->shutdown_on, shut),
        m->successor,
        load_id,
    };
    return exec_count(c, SQL_UPSERT_MODEL, 19, params, changes, err, errlen);
}

static int upsert_prices(PGconn *c, const mr_model *m, const char *load_id, int *changes, char *err,
                         size_t errlen) {
    /* dates of the file's rows, as a Postgres array literal ("{2026-01-01,...}") */
    char dates[MR_MAX_PRICES * 11 + 3];
    size_t dl = 0;
    dates[dl++] = '{';
    for (size_t j = 0; j < m->n_prices; j++) {
        const mr_price *p = &m->prices[j];
        char eff[11], ver[11], in[40], out[40];
        mr_date_format(p->effective_from, eff);
        mr_date_format(p->verified_on, ver);
        snprintf(in, sizeof in, "%.6f", p->input_per_million);
        snprintf(out, sizeof out, "%.6f", p->output_per_million);
        const char *params[8] = {m->model_id, eff, in, out, p->source_url, ver, p->note, load_id};
        int rc = exec_count(c, SQL_UPSERT_PRICE, 8, params, changes, err, errlen);
        if (rc != DB_OK) return rc;
        if (j) dates[dl++] = ',';
        memcpy(dates + dl, eff, 10);
        dl += 10;
    }
    dates[dl++] = '}';
    dates[dl] = '\0';
    const char *wp[3] = {m->model_id, dates, load_id};
    return exec_count(c, SQL_WITHDRAW_PRICES, 3, wp, changes, err, errlen);
}

static int unlist_missing(PGconn *c, const mr_catalog *cat, const char *load_id, int *changes,
                          char *err, size_t errlen) {
    size_t cap = 3;
    for (size_t i = 0; i < cat->n; i++)
        cap += strlen(cat->models[i].model_id) + 1;
    char *ids = malloc(cap);
    if (!ids) return fail(DB_ENOMEM, err, errlen, "out of memory");
    /* model ids are [a-z0-9._-]: no array-literal quoting is needed */
    size_t l = 0;
    ids[l++] = '{';
    for (size_t i = 0; i < cat->n; i++) {
        if (i) ids[l++] = ',';
        size_t n = strlen(cat->models[i].model_id);
        memcpy(ids + l, cat->models[i].model_id, n);
        l += n;
    }
    ids[l++] = '}';
    ids[l] = '\0';
    const char *params[2] = {ids, load_id};
    int rc = exec_count(c, SQL_UNLIST_MODELS, 2, params, changes, err, errlen);
    free(ids);
    return rc;
}

/* Starts the load record, unless the database holds a newer version (out->stale). */
static int begin_load(PGconn *c, const mr_catalog *cat, const char *sha, const char *source,
                      const char *instance, char load_id[24], mr_load_result *out, char *err,
                      size_t errlen) {
    PGresult *res = NULL;
    int rc = db_exec(c, SQL_LOCK, 0, NULL, NULL, err, errlen);
    if (rc != DB_OK) return rc;
    rc = db_exec(c, SQL_PREV_VERSION, 0, NULL, &res, err, errlen);
    if (rc != DB_OK) return rc;
    if (PQntuples(res) == 1)
        snprintf(out->db_version, sizeof out->db_version, "%s", PQgetvalue(res, 0, 0));
    PQclear(res);
    if (out->db_version[0] && mr_version_cmp(cat->catalog_version, out->db_version) < 0) {
        out->stale = 1;
        return DB_OK;
    }
    const char *params[4] = {cat->catalog_version, sha, source, instance};
    rc = db_exec(c, SQL_NEW_LOAD, 4, params, &res, err, errlen);
    if (rc != DB_OK) return rc;
    snprintf(load_id, 24, "%s", PQgetvalue(res, 0, 0));
    PQclear(res);
    return DB_OK;
}

int mr_store_apply(db_pool *p, const mr_catalog *cat, const char *sha256_hex, const char *source,
                   const char *instance, mr_load_result *out, char *err, size_t errlen) {
    db_tx *tx = NULL;
    char load_id[24];
    int changes = 0;
    memset(out, 0, sizeof *out);
    int rc = db_tx_begin(p, NULL, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    PGconn *c = db_tx_conn(tx);
    rc = begin_load(c, cat, sha256_hex, source, instance, load_id, out, err, errlen);
    if (rc == DB_OK && out->stale) {
        db_tx_rollback(tx);
        return DB_OK;
    }
    int same_version = strcmp(out->db_version, cat->catalog_version) == 0;
    for (size_t i = 0; rc == DB_OK && i < cat->n; i++)
        rc = upsert_model(c, &cat->models[i], load_id, &changes, err, errlen);
    for (size_t i = 0; rc == DB_OK && i < cat->n; i++)
        rc = upsert_prices(c, &cat->models[i], load_id, &changes, err, errlen);
    if (rc == DB_OK) rc = unlist_missing(c, cat, load_id, &changes, err, errlen);
    if (rc == DB_OK) {
        char n[16];
        snprintf(n, sizeof n, "%d", changes);
        const char *params[2] = {load_id, n};
        /* a load that changed nothing leaves no trace: restarts do not grow the history */
        int keep = changes > 0 || !same_version;
        rc = db_exec(c, keep ? SQL_FINISH_LOAD : SQL_DROP_LOAD, keep ? 2 : 1, params, NULL, err,
                     errlen);
        if (keep) out->load_id = atoll(load_id);
    }
    if (rc != DB_OK) {
        db_tx_rollback(tx);
        out->load_id = 0;
        return rc;
    }
    rc = db_tx_commit(tx, err, errlen);
    if (rc != DB_OK) {
        out->load_id = 0;
        return rc;
    }
    out->changes = changes;
    return DB_OK;
}

/* ---- reading ---- */

static char *dup_value(PGresult *r, int row, int col) {
    if (PQgetisnull(r, row, col)) return NULL;
    return strdup(PQgetvalue(r, row, col));
}

static int32_t date_value(PGresult *r, int row, int col) {
    int32_t d = MR_DATE_NONE;
    if (!PQgetisnull(r, row, col) && mr_date_parse(PQgetvalue(r, row, col), &d)) d = MR_DATE_NONE;
    return d;
}

static double num_value(PGresult *r, int row, int col) {
    return strtod(PQgetvalue(r, row, col), NULL);
}

static int read_model(PGresult *r, int row, mr_model *m) {
    m->model_id = dup_value(r, row, 0);
    m->provider = dup_value(r, row, 1);
    m->display_name = dup_value(r, row, 2);
    m->released_on = date_value(r, row, 3);
    m->max_context_tokens = (int32_t)atol(PQgetvalue(r, row, 4));
    m->supports_streaming = PQgetvalue(r, row, 5)[0] == 't';
    m->supports_tool_use = PQgetvalue(r, row, 6)[0] == 't';
    m->tool_use_quality = num_value(r, row, 7);
    m->reasoning = num_value(r, row, 8);
    m->code_generation = num_value(r, row, 9);
    m->structured_ops = num_value(r, row, 10);
    m->long_context = num_value(r, row, 11);
    m->evidence = dup_value(r, row, 12);
    m->score_basis = dup_value(r, row, 13);
    if (mr_status_parse(PQgetvalue(r, row, 14), &m->status)) m->status = -1;
    m->deprecated_on = date_value(r, row, 15);
    m->shutdown_on = date_value(r, row, 16);
    m->successor = dup_value(r, row, 17);
    return m->model_id && m->provider && m->display_name && m->evidence && m->score_basis ? 0 : -1;
}

/* Distributes the price rows (ordered like the models) over the models. */
static int read_prices(PGresult *r, mr_catalog *cat, char *err, size_t errlen) {
    int rows = PQntuples(r), row = 0;
    for (size_t i = 0; i < cat->n; i++) {
        mr_model *m = &cat->models[i];
        int first = row;
        while (row < rows && strcmp(PQgetvalue(r, row, 0), m->model_id) == 0)
            row++;
        if (mr_model_alloc_prices(m, (size_t)(row - first)))
            return fail(DB_ENOMEM, err, errlen, "out of memory");
        for (int k = first; k < row; k++) {
            mr_price *p = &m->prices[k - first];
            p->effective_from = date_value(r, k, 1);
            p->input_per_million = num_value(r, k, 2);
            p->output_per_million = num_value(r, k, 3);
            p->source_url = dup_value(r, k, 4);
            p->verified_on = date_value(r, k, 5);
            p->note = dup_value(r, k, 6);
            if (!p->source_url || !p->note) return fail(DB_ENOMEM, err, errlen, "out of memory");
        }
    }
    if (row != rows)
        return fail(DB_EINVAL, err, errlen, "price rows out of model order at row %d", row);
    return DB_OK;
}

static int read_all(PGconn *c, mr_catalog *out, long long *last_load_id, char *err, size_t errlen) {
    PGresult *models = NULL, *prices = NULL, *last = NULL;
    int rc = db_exec(c, SQL_READ_MODELS, 0, NULL, &models, err, errlen);
    if (rc == DB_OK) rc = db_exec(c, SQL_READ_PRICES, 0, NULL, &prices, err, errlen);
    if (rc == DB_OK) rc = db_exec(c, SQL_LAST_LOAD, 0, NULL, &last, err, errlen);
    if (rc != DB_OK) goto done;
    int have_load = PQntuples(last) == 1;
    *last_load_id = have_load ? atoll(PQgetvalue(last, 0, 0)) : 0;
    out->catalog_version = strdup(have_load ? PQgetvalue(last, 0, 1) : "none");
    if (!out->catalog_version || mr_catalog_alloc(out, (size_t)PQntuples(models))) {
        rc = fail(DB_ENOMEM, err, errlen, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < out->n; i++)
        if (read_model(models, (int)i, &out->models[i])) {
            rc = fail(DB_ENOMEM, err, errlen, "out of memory");
            goto done;
        }
    rc = read_prices(prices, out, err, errlen);
done:
    PQclear(models);
    PQclear(prices);
    PQclear(last);
    return rc;
}

int mr_store_read(db_pool *p, mr_catalog *out, long long *last_load_id, char *err, size_t errlen) {
    db_tx *tx = NULL;
    char verr[256];
    memset(out, 0, sizeof *out);
    *last_load_id = 0;
    int rc = db_tx_begin_ex(p, NULL, DB_TX_REPEATABLE_READ | DB_TX_READ_ONLY, &tx, err, errlen);
    if (rc != DB_OK) return rc;
    rc = read_all(db_tx_conn(tx), out, last_load_id, err, errlen);
    db_tx_rollback(tx); /* read-only: nothing to commit */
    if (rc == DB_OK && mr_catalog_validate(out, false, verr, sizeof verr))
        rc = fail(DB_EINVAL, err, errlen, "stored catalogue is invalid: %s", verr);
    if (rc != DB_OK) mr_catalog_free(out);
    return rc;
}

int mr_store_last_load(db_pool *p, long long *last_load_id, char *err, size_t errlen) {
    PGconn *c = NULL;
    PGresult *res = NULL;
    *last_load_id = 0;
    int rc = db_acquire(p, -1, &c);
    if (rc != DB_OK) return fail(rc, err, errlen, "database: %s", db_strerror(rc));
    rc = db_exec(c, SQL_LAST_LOAD, 0, NULL, &res, err, errlen);
    if (rc == DB_OK) {
        if (PQntuples(res) == 1) *last_load_id = atoll(PQgetvalue(res, 0, 0));
        PQclear(res);
    }
    db_release(p, c);
    return rc;
}
