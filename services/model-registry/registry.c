/* Configuration, loading, snapshot swaps and cross-replica propagation (see registry.h). */
#include "registry.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ids.h"
#include "log.h"
#include "store.h"
#include "util.h"

/* ---- configuration ---- */

static mr_config C;

static const cfg_var vars[] = {
    {"UPSQUAD_PG_DSN", CFG_STR, NULL,
     "Postgres connection string of the model_registry login role (libpq keywords or URI)",
     &C.pg_dsn, 0, 0, CFG_REQUIRED | CFG_SECRET},
    {"UPSQUAD_PG_MIGRATE_DSN", CFG_STR, NULL,
     "Postgres connection string of the model_registry schema's owner role, used only to apply the "
     "migrations (at start or with --migrate); unset: they run as UPSQUAD_PG_DSN, which must "
     "then own the schema (make run and Kubernetes set both: the service logs in as a role that "
     "owns nothing)",
     &C.pg_migrate_dsn, 0, 0, CFG_SECRET},
    {"UPSQUAD_PG_POOL_SIZE", CFG_INT, "2",
     "Postgres connections at most (only catalogue loads and reloads use them; calls never do)",
     &C.pg_pool_size, 1, 64},
    {"UPSQUAD_NATS_URL", CFG_STR, "",
     "NATS server(s) for catalogue-change notices between replicas; empty: replicas converge "
     "by polling only",
     &C.nats_url},
    {"UPSQUAD_MIGRATIONS_DIR", CFG_STR, "services/model-registry/migrations",
     "folder of the schema migrations applied at start; `none`: do not migrate at start (run "
     "`model-registry --migrate` as a Job instead)",
     &C.migrations_dir},
    {"UPSQUAD_MODEL_CATALOG_FILE", CFG_STR, "services/model-registry/catalog/models.json",
     "the reviewed catalogue data file loaded at start and on SIGHUP; `none`: serve what the "
     "database holds (changes arrive from the replica that loads the file)",
     &C.catalog_file},
    {"UPSQUAD_MODEL_CATALOG_POLL", CFG_MS, "30s",
     "how often a replica checks the database for a catalogue load it was not notified of",
     &C.poll_ms, 1000, 3600000},
    {"UPSQUAD_MODEL_ALTERNATIVES", CFG_INT, "4",
     "alternatives returned with a recommendation (next best, ranked)", &C.alternatives, 0, 10},
};

const cfg_var *mr_config_vars(size_t *n) {
    *n = sizeof vars / sizeof vars[0];
    return vars;
}

mr_config *mr_config_get(void) {
    return &C;
}

/* ---- helpers ---- */

#define fail(err, errlen, ...) util_errf((err), (errlen), -1, __VA_ARGS__)

/* Set, and not the explicit "none" (an empty variable counts as unset, so it cannot say no). */
static int set(const char *s) {
    return s && s[0] && strcmp(s, "none") != 0;
}

static int32_t today(void) {
    return mr_day_of((int64_t)time(NULL));
}

static void register_metrics(mr_registry *r) {
    r->m_reloads_ok = metrics_counter("model_registry_reloads_total",
                                      "catalogue snapshots built and swapped in", NULL);
    r->m_reloads_failed =
        metrics_counter("model_registry_reload_failures_total",
                        "reloads that failed (the previous snapshot stays)", NULL);
    r->m_file_loads =
        metrics_counter("model_registry_file_loads_total",
                        "data-file loads into the database that changed something", NULL);
    r->m_changes =
        metrics_counter("model_registry_catalog_changes_total",
                        "catalogue rows changed by this replica's data-file loads", NULL);
    r->m_models = metrics_gauge("model_registry_models", "models in the served snapshot", NULL);
    r->m_version =
        metrics_gauge("model_registry_snapshot_version",
                      "version of the served snapshot (increases with every swap)", NULL);
    r->m_load_id = metrics_gauge("model_registry_catalog_load_id",
                                 "database load the served snapshot reflects", NULL);
    r->m_bus_events = metrics_counter("model_registry_change_events_total",
                                      "catalogue-change notices received from NATS", NULL);
}

/* ---- loading ---- */

/* Reads the catalogue from Postgres and swaps in a snapshot for today. */
static int reload_from_db(mr_registry *r, const char *why, char *err, size_t errlen) {
    mr_catalog cat;
    mr_snapshot *s = NULL;
    long long load_id = 0;
    char e[512];
    int rc = mr_store_read(r->pool, &cat, &load_id, e, sizeof e);
    if (rc != DB_OK) {
        metric_inc(r->m_reloads_failed);
        return fail(err, errlen, "reading the catalogue: %s", e);
    }
    size_t n = cat.n;
    if (mr_snapshot_build(&cat, today(), &s, e, sizeof e)) {
        metric_inc(r->m_reloads_failed);
        return fail(err, errlen, "building the snapshot: %s", e);
    }
    mr_holder_swap(&r->holder, s); /* s->version is stamped by the swap */
    pthread_mutex_lock(&r->mu);
    r->last_load_id = load_id;
    pthread_mutex_unlock(&r->mu);
    metric_inc(r->m_reloads_ok);
    metric_set(r->m_models, (double)s->n);
    metric_set(r->m_load_id, (double)load_id);
    metric_set(r->m_version, (double)s->version);
    log_info("catalog.reloaded",
             "%s: snapshot %llu with %zu models (%zu stored, %zu not yet priced), load %lld", why,
             (unsigned long long)s->version, s->n, n, s->n_pending, load_id);
    return 0;
}

static void publish_change(mr_registry *r, const mr_load_result *lr, const char *version) {
    if (!r->bus) return;
    cJSON *o = cJSON_CreateObject();
    char *json = NULL;
    if (!o || !cJSON_AddStringToObject(o, "schema", MR_EVENT_SCHEMA) ||
        !cJSON_AddNumberToObject(o, "load_id", (double)lr->load_id) ||
        !cJSON_AddStringToObject(o, "catalog_version", version) ||
        !cJSON_AddStringToObject(o, "origin", r->instance) || !(json = cJSON_PrintUnformatted(o))) {
        log_error("catalog.notify", "out of memory building the change notice");
        goto done;
    }
    int rc = bus_publish(r->bus, MR_SUBJECT_CHANGED, json, (int)strlen(json));
    if (rc != BUS_OK)
        log_warn("catalog.notify",
                 "could not publish load %lld (code %d); other replicas will see it by polling",
                 lr->load_id, rc);
done:
    free(json);
    cJSON_Delete(o);
}

/* Parses the data file and upserts it; the caller then reloads from the database. */
static int load_file(mr_registry *r, char *err, size_t errlen) {
    mr_catalog cat;
    unsigned char sha[32];
    char hex[65], e[512];
    mr_load_result lr;
    if (!set(r->cfg->catalog_file))
        return fail(err, errlen, "UPSQUAD_MODEL_CATALOG_FILE is none: no data file to load");
    if (mr_catalog_load_file(r->cfg->catalog_file, &cat, sha, e, sizeof e))
        return fail(err, errlen, "data file rejected, nothing changed: %s", e);
    ids_hex(sha, sizeof sha, hex);
    int rc =
        mr_store_apply(r->pool, &cat, hex, r->cfg->catalog_file, r->instance, &lr, e, sizeof e);
    if (rc != DB_OK) {
        mr_catalog_free(&cat);
        return fail(err, errlen, "storing the catalogue failed, nothing changed: %s", e);
    }
    if (lr.stale) {
        /* an old image must not roll the catalogue back; serve the database's newer one */
        log_warn("catalog.stale",
                 "%s has catalog_version %s, older than %s in the database: not applied",
                 r->cfg->catalog_file, cat.catalog_version, lr.db_version);
        mr_catalog_free(&cat);
        return 0;
    }
    log_info("catalog.loaded", "%s (version %s, sha256 %.12s): %zu models, %d changes, load %lld",
             r->cfg->catalog_file, cat.catalog_version, hex, cat.n, lr.changes, lr.load_id);
    if (lr.load_id > 0) {
        metric_inc(r->m_file_loads);
        metric_add(r->m_changes, (double)lr.changes);
        publish_change(r, &lr, cat.catalog_version);
    }
    mr_catalog_free(&cat);
    return 0;
}

/* ---- the worker ---- */

/* Milliseconds until the next poll or the start of the day a scheduled price applies. */
static long long wait_ms(mr_registry *r) {
    long long ms = r->cfg->poll_ms;
    mr_snapshot *s = mr_holder_get(&r->holder);
    if (s && s->valid_until != MR_DATE_NONE) {
        long long until = (long long)s->valid_until * 86400000LL - (long long)time(NULL) * 1000LL;
        if (until < ms) ms = until < 0 ? 0 : until;
    }
    mr_snapshot_unref(s);
    return ms;
}

static void poll_db(mr_registry *r) {
    long long id = 0, mine;
    char e[256];
    mr_snapshot *s = mr_holder_get(&r->holder);
    int stale_day = s && s->valid_until != MR_DATE_NONE && today() >= s->valid_until;
    mr_snapshot_unref(s);
    if (stale_day) {
        if (reload_from_db(r, "scheduled price change", e, sizeof e))
            log_error("catalog.reload", "%s", e);
        return;
    }
    if (mr_store_last_load(r->pool, &id, e, sizeof e) != DB_OK) {
        log_warn("catalog.poll", "%s", e);
        return;
    }
    pthread_mutex_lock(&r->mu);
    mine = r->last_load_id;
    pthread_mutex_unlock(&r->mu);
    if (id != mine && reload_from_db(r, "newer load found by polling", e, sizeof e))
        log_error("catalog.reload", "%s", e);
}

static void *worker(void *arg) {
    mr_registry *r = arg;
    char e[768];
    pthread_mutex_lock(&r->mu);
    for (;;) {
        if (!(r->want & MR_WANT_STOP) && !(r->want & (MR_WANT_FILE | MR_WANT_DB))) {
            struct timespec ts;
            util_deadline(&ts, wait_ms(r));
            int w = 0;
            while (!r->want && w != ETIMEDOUT)
                w = pthread_cond_timedwait(&r->cv, &r->mu, &ts);
        }
        unsigned want = r->want;
        r->want &= MR_WANT_STOP;
        pthread_mutex_unlock(&r->mu);
        if (want & MR_WANT_STOP) return NULL;
        if (want & MR_WANT_FILE) {
            if (load_file(r, e, sizeof e)) log_error("catalog.load", "%s", e);
            want |= MR_WANT_DB;
        }
        if (want & MR_WANT_DB) {
            if (reload_from_db(r, want & MR_WANT_FILE ? "data file" : "change notice", e, sizeof e))
                log_error("catalog.reload", "%s", e);
        } else {
            poll_db(r);
        }
        pthread_mutex_lock(&r->mu);
    }
}

void mr_registry_request(mr_registry *r, unsigned want) {
    pthread_mutex_lock(&r->mu);
    r->want |= want;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
}

/* A notice from another replica (or our own): reload unless we already reflect that load. */
static void on_change(bus *b, natsMsg *msg, void *ud) {
    mr_registry *r = ud;
    (void)b;
    metric_inc(r->m_bus_events);
    cJSON *o = cJSON_ParseWithLength(natsMsg_GetData(msg), (size_t)natsMsg_GetDataLength(msg));
    const cJSON *id = o ? cJSON_GetObjectItemCaseSensitive(o, "load_id") : NULL;
    /* a double outside long long's range (or NaN) cannot be cast: UB; such an id is no id */
    long long load_id = -1;
    if (cJSON_IsNumber(id) && id->valuedouble >= 0 && id->valuedouble < 9223372036854775807.0)
        load_id = (long long)id->valuedouble;
    cJSON_Delete(o);
    pthread_mutex_lock(&r->mu);
    int known = load_id >= 0 && load_id <= r->last_load_id;
    pthread_mutex_unlock(&r->mu);
    if (!known) mr_registry_request(r, MR_WANT_DB);
}

/* ---- life cycle ---- */

int mr_registry_migrate(const mr_config *cfg, char *err, size_t errlen) {
    db_pool *pool = NULL;
    int applied = 0;
    if (!set(cfg->migrations_dir)) return fail(err, errlen, "UPSQUAD_MIGRATIONS_DIR is none");
    if (db_pool_open(cfg->pg_dsn, 1, &pool, err, errlen) != DB_OK) return -1;
    int rc = db_migrate_as(pool, cfg->pg_migrate_dsn, MR_SCHEMA, cfg->migrations_dir, &applied, err,
                           errlen);
    db_pool_close(pool);
    if (rc != DB_OK) return -1;
    log_info("catalog.migrated", "%d migration(s) applied from %s", applied, cfg->migrations_dir);
    return 0;
}

static int connect_bus(mr_registry *r, char *err, size_t errlen) {
    bus_opts o;
    if (!set(r->cfg->nats_url)) {
        log_warn("catalog.bus", "UPSQUAD_NATS_URL is empty: changes reach this replica by "
                                "polling only");
        return 0;
    }
    bus_opts_default(&o);
    o.connect_retry = 1;     /* NATS down at start must not stop the catalogue from serving */
    o.sub_pending_msgs = 64; /* notices coalesce: a handful pending is plenty */
    if (bus_connect_ex(r->cfg->nats_url, r->instance, &o, &r->bus, err, errlen) != BUS_OK)
        return -1;
    return bus_subscribe(r->bus, MR_SUBJECT_CHANGED, NULL, on_change, r, &r->sub, err, errlen) ==
                   BUS_OK
               ? 0
               : -1;
}

int mr_registry_start(mr_registry *r, const mr_config *cfg, char *err, size_t errlen) {
    char host[64] = "localhost";
    memset(r, 0, sizeof *r);
    r->cfg = cfg;
    mr_holder_init(&r->holder);
    pthread_mutex_init(&r->mu, NULL);
    util_cond_init_monotonic(&r->cv);
    gethostname(host, sizeof host - 1);
    snprintf(r->instance, sizeof r->instance, "%s:%d", host, (int)getpid());
    register_metrics(r);
    if (db_pool_open(cfg->pg_dsn, (int)cfg->pg_pool_size, &r->pool, err, errlen) != DB_OK)
        goto fail;
    if (set(cfg->migrations_dir)) {
        int applied = 0;
        if (db_migrate_as(r->pool, cfg->pg_migrate_dsn, MR_SCHEMA, cfg->migrations_dir, &applied,
                          err, errlen) != DB_OK)
            goto fail;
        if (applied) log_info("catalog.migrated", "%d migration(s) applied", applied);
    }
    /* the bus first, so the notice of our own start-up load is seen by the others at once */
    if (connect_bus(r, err, errlen)) goto fail;
    if (set(cfg->catalog_file) && load_file(r, err, errlen)) goto fail;
    if (reload_from_db(r, "start", err, errlen)) goto fail;
    if (pthread_create(&r->worker, NULL, worker, r) != 0) {
        fail(err, errlen, "cannot start the catalogue worker thread");
        goto fail;
    }
    r->worker_started = 1;
    return 0;
fail:
    mr_registry_stop(r);
    return -1;
}

void mr_registry_stop(mr_registry *r) {
    if (r->worker_started) {
        mr_registry_request(r, MR_WANT_STOP);
        pthread_join(r->worker, NULL);
        r->worker_started = 0;
    }
    bus_unsubscribe(r->sub);
    r->sub = NULL;
    bus_close(r->bus);
    r->bus = NULL;
    db_pool_close(r->pool);
    r->pool = NULL;
    if (r->cfg) {
        mr_holder_destroy(&r->holder);
        pthread_cond_destroy(&r->cv);
        pthread_mutex_destroy(&r->mu);
        r->cfg = NULL;
    }
}

mr_snapshot *mr_registry_snapshot(mr_registry *r) {
    return mr_holder_get(&r->holder);
}
