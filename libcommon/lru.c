/* Bounded LRU map (see lru.h): a chained hash table sized once for max_entries, and a doubly
 * linked recency list (head = most recently used). */
#include "lru.h"

#include <stdlib.h>
#include <string.h>

typedef struct lru_ent {
    struct lru_ent *hnext;       /* hash chain */
    struct lru_ent *prev, *next; /* recency list */
    void *val;
    size_t bytes; /* declared charge + key length */
    uint32_t hash;
    char key[]; /* NUL-terminated copy */
} lru_ent;

struct lru {
    lru_opts o;
    lru_ent **table;
    size_t mask;
    lru_ent *head, *tail;
    size_t count, bytes;
    uint64_t evicted;
};

static uint32_t lru__hash(const char *s) {
    uint32_t h = 2166136261u; /* FNV-1a */
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h;
}

int lru_create(const lru_opts *opts, lru **out) {
    *out = NULL;
    if (!opts || opts->max_entries < 1 || opts->max_entries > (SIZE_MAX >> 4)) return -1;
    lru *l = calloc(1, sizeof *l);
    if (!l) return -1;
    l->o = *opts;
    size_t n = 16;
    while (n < opts->max_entries * 2)
        n <<= 1; /* load factor <= 0.5 at the bound */
    l->table = calloc(n, sizeof *l->table);
    if (!l->table) {
        free(l);
        return -1;
    }
    l->mask = n - 1;
    *out = l;
    return 0;
}

static void lru__unlink(lru *l, lru_ent *e) {
    if (e->prev)
        e->prev->next = e->next;
    else
        l->head = e->next;
    if (e->next)
        e->next->prev = e->prev;
    else
        l->tail = e->prev;
    e->prev = e->next = NULL;
}

static void lru__push_front(lru *l, lru_ent *e) {
    e->prev = NULL;
    e->next = l->head;
    if (l->head) l->head->prev = e;
    l->head = e;
    if (!l->tail) l->tail = e;
}

static lru_ent **lru__slot(const lru *l, const char *key, uint32_t h) {
    lru_ent **p = &l->table[h & l->mask];
    while (*p && ((*p)->hash != h || strcmp((*p)->key, key) != 0))
        p = &(*p)->hnext;
    return p;
}

static void lru__remove(lru *l, lru_ent *e) {
    lru_ent **p = lru__slot(l, e->key, e->hash);
    *p = e->hnext;
    lru__unlink(l, e);
    l->count--;
    l->bytes -= e->bytes;
    if (l->o.free_val) l->o.free_val(e->val);
    free(e);
}

static int lru__over(const lru *l) {
    return l->count > l->o.max_entries || (l->o.max_bytes && l->bytes > l->o.max_bytes);
}

/* Evicts from the cold end, skipping pinned entries and `keep`, until within bounds. */
static void lru__evict(lru *l, const lru_ent *keep) {
    lru_ent *e = l->tail;
    while (e && lru__over(l)) {
        lru_ent *prev = e->prev;
        if (e != keep && !(l->o.pinned && l->o.pinned(e->val))) {
            lru__remove(l, e);
            l->evicted++;
        }
        e = prev;
    }
}

void lru_destroy(lru *l) {
    if (!l) return;
    lru_ent *e = l->head;
    while (e) {
        lru_ent *next = e->next;
        if (l->o.free_val) l->o.free_val(e->val);
        free(e);
        e = next;
    }
    free(l->table);
    free(l);
}

void *lru_get(lru *l, const char *key) {
    if (!l || !key) return NULL;
    lru_ent *e = *lru__slot(l, key, lru__hash(key));
    if (!e) return NULL;
    if (l->head != e) {
        lru__unlink(l, e);
        lru__push_front(l, e);
    }
    return e->val;
}

int lru_insert(lru *l, const char *key, void *val, size_t bytes) {
    if (!l || !key) goto fail;
    uint32_t h = lru__hash(key);
    lru_ent **slot = lru__slot(l, key, h);
    if (*slot) goto fail;
    size_t klen = strlen(key);
    lru_ent *e = malloc(sizeof *e + klen + 1);
    if (!e) goto fail;
    memcpy(e->key, key, klen + 1);
    e->hash = h;
    e->val = val;
    e->bytes = bytes + klen;
    e->hnext = NULL;
    *slot = e;
    lru__push_front(l, e);
    l->count++;
    l->bytes += e->bytes;
    lru__evict(l, e);
    return 0;
fail:
    if (l && l->o.free_val) l->o.free_val(val);
    return -1;
}

int lru_recharge(lru *l, const char *key, size_t bytes) {
    if (!l || !key) return -1;
    lru_ent *e = *lru__slot(l, key, lru__hash(key));
    if (!e) return -1;
    l->bytes -= e->bytes;
    e->bytes = bytes + strlen(e->key);
    l->bytes += e->bytes;
    lru__evict(l, e);
    return 0;
}

size_t lru_count(const lru *l) {
    return l ? l->count : 0;
}

size_t lru_bytes(const lru *l) {
    return l ? l->bytes : 0;
}

uint64_t lru_evicted(const lru *l) {
    return l ? l->evicted : 0;
}

void lru_foreach(const lru *l, void (*fn)(const char *key, void *val, void *ud), void *ud) {
    for (const lru_ent *e = l ? l->head : NULL; e; e = e->next)
        fn(e->key, e->val, ud);
}
