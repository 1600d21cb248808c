/* The model registry's moving parts: configuration, the Postgres store, the served snapshot and
 * the propagation of catalogue changes between replicas.
 *
 * How a change travels (docs/model-registry.md):
 *   1. An operator edits the data file and sends SIGHUP to one replica (or restarts it).
 *   2. That replica parses the file, upserts it into model_registry in one transaction (history
 *      kept) and, when something changed, publishes {"load_id":N,...} on the core NATS subject
 *      MR_SUBJECT_CHANGED after the commit.
 *   3. Every replica (the loader too) re-reads the catalogue from Postgres, builds a new
 *      snapshot and swaps it in; calls in flight finish on the snapshot they started with.
 *   A replica that missed the message (NATS down, reconnecting) notices the newer load_id within
 *   UPSQUAD_MODEL_CATALOG_POLL and reloads too. A price that takes effect on a later day is
 *   applied at that day's start (UTC) without any load.
 *
 * Threads: one worker thread does all loading and database reads; SIGHUP, NATS callbacks and
 * timers only set flags for it (never blocking, coalescing repeated requests), so a burst of
 * notifications costs one reload. */
#ifndef UPSQUAD_MR_REGISTRY_H
#define UPSQUAD_MR_REGISTRY_H

#include <pthread.h>
#include <stddef.h>

#include "bus.h"
#include "cfg.h"
#include "db.h"
#include "metrics.h"
#include "snapshot.h"

#define MR_SCHEMA "model_registry"
#define MR_SUBJECT_CHANGED "model_registry.catalog.changed"
#define MR_EVENT_SCHEMA "model_registry.catalog.changed/v1"

typedef struct mr_config {
    char *pg_dsn;
    long long pg_pool_size;
    char *nats_url;       /* NULL/"" = no bus: replicas converge by polling only */
    char *migrations_dir; /* "none" = do not migrate at start (a --migrate Job does) */
    char *pg_migrate_dsn; /* UPSQUAD_PG_MIGRATE_DSN: the schema owner (migrations only) */
    char *catalog_file;   /* "none" = serve what the database holds; never load a file */
    long long poll_ms;
    long long alternatives;
} mr_config;

/* The service's configuration table, filled into the returned config by cfg_load. */
const cfg_var *mr_config_vars(size_t *n);
mr_config *mr_config_get(void);

enum { MR_WANT_FILE = 1u << 0, MR_WANT_DB = 1u << 1, MR_WANT_STOP = 1u << 2 };

typedef struct mr_registry {
    const mr_config *cfg; /* borrowed */
    db_pool *pool;
    bus *bus;
    bus_sub *sub;
    mr_holder holder;
    char instance[128]; /* host:pid, names this replica in loads and events */

    pthread_t worker;
    int worker_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned want;          /* MR_WANT_* flags, under mu */
    long long last_load_id; /* the load the current snapshot reflects, under mu */

    metric *m_reloads_ok, *m_reloads_failed, *m_file_loads, *m_changes, *m_models;
    metric *m_version, *m_load_id, *m_bus_events;
} mr_registry;

/* Opens the store, migrates (when configured), loads the data file (when configured; a bad file
 * at start is fatal so a broken deploy never becomes ready), builds the first snapshot, connects
 * the bus and starts the worker. On failure everything opened is closed again. */
int mr_registry_start(mr_registry *r, const mr_config *cfg, char *err, size_t errlen);
/* Runs the migrations only (--migrate). */
int mr_registry_migrate(const mr_config *cfg, char *err, size_t errlen);
/* Asks the worker for a reload (MR_WANT_FILE re-reads the data file, MR_WANT_DB the database).
 * Never blocks; safe from signal handlers' threads and NATS callbacks. */
void mr_registry_request(mr_registry *r, unsigned want);
/* Stops the worker, unsubscribes, closes the bus and the store, drops the snapshot. Safe on a
 * registry that failed to start. */
void mr_registry_stop(mr_registry *r);

/* The snapshot to serve (a reference: mr_snapshot_unref), or NULL before the first one. */
mr_snapshot *mr_registry_snapshot(mr_registry *r);

#endif
