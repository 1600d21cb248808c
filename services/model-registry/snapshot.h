/* The catalogue as served: an immutable, refcounted snapshot swapped atomically.
 *
 * A snapshot resolves every model's price in force on one UTC day, derives its cost efficiency,
 * and orders the models the way ListModels documents (provider, then active before deprecated,
 * then model_id; all byte-wise ascending). Readers take a reference (a few nanoseconds under a
 * mutex held only for the increment) and never block the writer for longer; the writer builds the
 * next snapshot without any lock and swaps the pointer. The last reference frees the snapshot. */
#ifndef UPSQUAD_MR_SNAPSHOT_H
#define UPSQUAD_MR_SNAPSHOT_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "catalog.h"

typedef struct mr_entry {
    const mr_model *m;    /* borrowed from the snapshot's catalogue */
    const char *provider; /* == one of snapshot->providers, so it compares by pointer */
    double input_per_million, output_per_million; /* the price in force on snapshot->day */
    double blended;                               /* mr_blended_price */
    double cost_efficiency;                       /* mr_cost_efficiency */
    bool deprecated;                              /* status deprecated or retired */
} mr_entry;

typedef struct mr_snapshot {
    atomic_int refs;
    uint64_t version;    /* increases with every swap of a holder */
    int32_t day;         /* UTC day the prices were resolved for */
    int32_t valid_until; /* first later day on which a price changes; MR_DATE_NONE if none */
    size_t n_pending;    /* models whose first price starts after `day` (not served yet) */
    mr_catalog cat;      /* owned */
    size_t n;
    mr_entry *entries;      /* ListModels order */
    const mr_entry **by_id; /* sorted by model_id */
    size_t n_providers;
    const char **providers; /* distinct provider names, ascending (borrowed from cat) */
} mr_snapshot;

/* Builds a snapshot of `cat` for `day`. Takes ownership of *cat (also on failure; *cat is
 * zeroed). Returns 0 with *out (refcount 1) or -1 with err. */
int mr_snapshot_build(mr_catalog *cat, int32_t day, mr_snapshot **out, char *err, size_t errlen);
mr_snapshot *mr_snapshot_ref(mr_snapshot *s);
void mr_snapshot_unref(mr_snapshot *s);

/* Exact lookup of a canonical model id, after lowercasing and trimming `id`; NULL if absent. */
const mr_entry *mr_snapshot_find(const mr_snapshot *s, const char *id, size_t len);
/* Canonical provider name (borrowed) matching `name` case-insensitively; NULL if none. */
const char *mr_snapshot_provider(const mr_snapshot *s, const char *name, size_t len);

/* The current snapshot, swapped atomically. */
typedef struct mr_holder {
    pthread_mutex_t mu;
    mr_snapshot *cur;
    uint64_t next_version;
} mr_holder;

void mr_holder_init(mr_holder *h);
/* Drops the holder's reference; readers still holding one keep their snapshot alive. */
void mr_holder_destroy(mr_holder *h);
/* A new reference to the current snapshot (caller unrefs), or NULL before the first swap. */
mr_snapshot *mr_holder_get(mr_holder *h);
/* Publishes s (takes its reference; stamps s->version) and releases the previous one. */
void mr_holder_swap(mr_holder *h, mr_snapshot *s);

#endif
