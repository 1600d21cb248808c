/* Per-thread cache of encoded recommendations (see reccache.h). */
#include "reccache.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

typedef struct entry {
    const void *owner;
    uint64_t version;
    size_t klen, len;
    uint8_t bytes[]; /* key, then response */
} entry;

typedef struct table {
    entry *slot[MR_RECCACHE_SLOTS];
} table;

static _Thread_local table *tls_table;
static pthread_key_t table_key;
static pthread_once_t table_once = PTHREAD_ONCE_INIT;
static int table_key_ok;

/* Thread exit: the table and every entry in it. */
static void table_free(void *p) {
    table *t = p;
    for (size_t i = 0; i < MR_RECCACHE_SLOTS; i++)
        free(t->slot[i]);
    free(t);
}

static void table_key_init(void) {
    table_key_ok = pthread_key_create(&table_key, table_free) == 0;
}

/* NULL when the table cannot be allocated or registered for freeing (no caching then). */
static table *table_get(void) {
    if (tls_table) return tls_table;
    pthread_once(&table_once, table_key_init);
    if (!table_key_ok) return NULL;
    table *t = calloc(1, sizeof *t);
    if (t && pthread_setspecific(table_key, t) != 0) {
        free(t);
        t = NULL;
    }
    return tls_table = t;
}

static size_t slot_of(const void *owner, uint64_t version, const void *key, size_t klen) {
    uint64_t h = 1469598103934665603ull ^ version ^ (uint64_t)(uintptr_t)owner; /* FNV-1a */
    const unsigned char *p = key;
    for (size_t i = 0; i < klen; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return (size_t)(h % MR_RECCACHE_SLOTS);
}

int mr_reccache_get(const void *owner, uint64_t version, const void *key, size_t klen,
                    const uint8_t **data, size_t *len) {
    table *t = tls_table; /* a thread without a table has cached nothing */
    if (t == NULL || klen > MR_RECCACHE_KEY_MAX) return -1;
    const entry *e = t->slot[slot_of(owner, version, key, klen)];
    if (e == NULL || e->owner != owner || e->version != version || e->klen != klen ||
        memcmp(e->bytes, key, klen) != 0)
        return -1;
    *data = e->bytes + klen;
    *len = e->len;
    return 0;
}

int mr_reccache_put(const void *owner, uint64_t version, const void *key, size_t klen, size_t len,
                    uint8_t **data) {
    if (klen > MR_RECCACHE_KEY_MAX || len > MR_RECCACHE_ENTRY_MAX - klen) return -1;
    table *t = table_get();
    if (t == NULL) return -1;
    entry **slot = &t->slot[slot_of(owner, version, key, klen)];
    free(*slot);
    entry *e = *slot = malloc(sizeof *e + klen + len);
    if (e == NULL) return -1;
    e->owner = owner;
    e->version = version;
    e->klen = klen;
    e->len = len;
    memcpy(e->bytes, key, klen);
    *data = e->bytes + klen;
    return 0;
}
