/* Bounded string-keyed map with least-recently-used eviction: de-duplication windows and
 * small caches (idempotency records of devtools and the test consumers).
 *
 * Bounds and policy
 *   At most max_entries entries and max_bytes bytes (the sum of each entry's declared charge
 *   plus its key). An insert or a re-charge beyond either bound evicts the least recently
 *   used entries that are not pinned (the `pinned` callback, e.g. a record still being
 *   executed) until both bounds hold again; pinned entries are skipped, so a map of pinned
 *   entries only may exceed the bounds (callers bound those by their own in-flight limit).
 *   Evictions are counted (lru_evicted): a test can assert that nothing it relies on left.
 *
 * Not thread-safe: callers hold their own lock around every call.
 * Return codes: 0, or -1 (bad argument, key already present, out of memory). */
#ifndef UPSQUAD_LRU_H
#define UPSQUAD_LRU_H

#include <stddef.h>
#include <stdint.h>

typedef struct lru lru;

typedef struct lru_opts {
    size_t max_entries;             /* >= 1; the hash table is sized for it once */
    size_t max_bytes;               /* 0 = no byte bound */
    void (*free_val)(void *val);    /* called on eviction and lru_destroy (NULL: none) */
    int (*pinned)(const void *val); /* 1: never evicted now (NULL: nothing is pinned) */
} lru_opts;

/* *out owned by the caller: lru_destroy. */
int lru_create(const lru_opts *opts, lru **out);
/* Frees every value (free_val) and the map. l NULL: no-op. */
void lru_destroy(lru *l);

/* The value under key (borrowed; valid until it is evicted), made most recently used;
 * NULL when absent. */
void *lru_get(lru *l, const char *key);
/* Adds key (copied) with val (ownership taken, also on failure: free_val is then called)
 * charged `bytes`, as most recently used, then evicts to the bounds. -1 when key is present. */
int lru_insert(lru *l, const char *key, void *val, size_t bytes);
/* Changes the charge of key's entry (e.g. once its result is recorded), then evicts to the
 * bounds (never that entry itself). -1 when absent. */
int lru_recharge(lru *l, const char *key, size_t bytes);

size_t lru_count(const lru *l);
size_t lru_bytes(const lru *l);
uint64_t lru_evicted(const lru *l);

/* Calls fn for every entry, most recently used first, without changing the order. fn must not
 * modify the map. */
void lru_foreach(const lru *l, void (*fn)(const char *key, void *val, void *ud), void *ud);

#endif
