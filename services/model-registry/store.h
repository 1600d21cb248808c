/* Every SQL statement of the model registry (schema model_registry, migrations/).
 *
 * Writes happen only when a data file is loaded: one transaction, under an advisory lock so
 * replicas loading at once apply one after the other, upserts each model and price row and
 * records every difference in catalog_changes. Loading the same file again changes nothing and
 * leaves no trace. Reads return the listed models with their non-withdrawn prices. */
#ifndef UPSQUAD_MR_STORE_H
#define UPSQUAD_MR_STORE_H

#include <stddef.h>

#include "catalog.h"
#include "db.h"

typedef struct mr_load_result {
    long long load_id;   /* 0 when the load changed nothing (no row is kept) */
    int changes;         /* rows of catalog_changes written */
    int stale;           /* 1: refused, the database holds a newer catalog_version */
    char db_version[65]; /* catalog_version of the latest load before this one ("" if none) */
} mr_load_result;

/* Upserts `c` (borrowed), unless the database already holds a newer catalog_version
 * (mr_version_cmp): then nothing changes and out->stale is set, so a replica restarting with an
 * old image cannot roll the catalogue back. sha256_hex: digest of the file's bytes; source: its
 * path; instance: who loaded it (host:pid). Returns DB_OK or a DB_E* code with err. */
int mr_store_apply(db_pool *p, const mr_catalog *c, const char *sha256_hex, const char *source,
                   const char *instance, mr_load_result *out, char *err, size_t errlen);

/* Reads the served catalogue (one REPEATABLE READ snapshot) into *out (caller frees with
 * mr_catalog_free) and the id of the latest load. An empty database gives an empty catalogue.
 * Returns DB_OK, DB_EINVAL when the rows fail validation, or a DB_E* code. */
int mr_store_read(db_pool *p, mr_catalog *out, long long *last_load_id, char *err, size_t errlen);

/* The id of the latest load (0 when none): a cheap poll for changes missed on the bus. */
int mr_store_last_load(db_pool *p, long long *last_load_id, char *err, size_t errlen);

#endif
