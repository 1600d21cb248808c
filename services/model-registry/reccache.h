/* Encoded GetModelRecommendation responses kept per thread, so a repeated question is answered
 * with bytes already on hand instead of being scored, formatted, checked and encoded again.
 *
 * A recommendation is a pure function of the snapshot and the request (score.h), so an entry is
 * keyed by the snapshot it was computed on (its registry and version: a swap makes every older
 * entry miss) and by the request's fields; it is never stale and needs no invalidation. Each
 * thread that serves calls has its own table (no locks; with the default of one completion-queue
 * thread there is one table), direct-mapped by a hash of the key: a collision replaces the older
 * entry. Bounded: MR_RECCACHE_SLOTS entries of at most MR_RECCACHE_ENTRY_MAX bytes each per
 * thread, freed when the thread exits. */
#ifndef UPSQUAD_MR_RECCACHE_H
#define UPSQUAD_MR_RECCACHE_H

#include <stddef.h>
#include <stdint.h>

#define MR_RECCACHE_SLOTS 64
#define MR_RECCACHE_KEY_MAX 2048         /* longer keys are not cached */
#define MR_RECCACHE_ENTRY_MAX (16 << 10) /* key + response bytes; bigger ones are not cached */

/* The response bytes (borrowed: valid until the next mr_reccache_put on this thread) for
 * (owner, version, key); 0 on a hit, -1 on a miss. */
int mr_reccache_get(const void *owner, uint64_t version, const void *key, size_t klen,
                    const uint8_t **data, size_t *len);

/* A slot for len response bytes under (owner, version, key), replacing whatever the slot held;
 * the caller writes the bytes into *data (borrowed, as above). 0, or -1 when the entry is too
 * big or memory is short (nothing is kept then). */
int mr_reccache_put(const void *owner, uint64_t version, const void *key, size_t klen, size_t len,
                    uint8_t **data);

#endif
