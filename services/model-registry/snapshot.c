/* Immutable catalogue snapshots and the holder that swaps them. */
#include "snapshot.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int fail(char *err, size_t errlen, const char *msg) {
    if (err && errlen) snprintf(err, errlen, "%s", msg);
    return -1;
}

/* ListModels order: provider, then active before deprecated, then model_id. */
static int cmp_list_order(const void *a, const void *b) {
    const mr_entry *x = a, *y = b;
    int c = strcmp(x->m->provider, y->m->provider);
    if (c) return c;
    if (x->deprecated != y->deprecated) return x->deprecated ? 1 : -1;
    return strcmp(x->m->model_id, y->m->model_id);
}

static int cmp_by_id(const void *a, const void *b) {
    const mr_entry *x = *(const mr_entry *const *)a, *y = *(const mr_entry *const *)b;
    return strcmp(x->m->model_id, y->m->model_id);
}

static void fill_entries(mr_snapshot *s) {
    s->valid_until = MR_DATE_NONE;
    for (size_t i = 0; i < s->cat.n; i++) {
        const mr_model *m = &s->cat.models[i];
        int32_t next = mr_model_next_change(m, s->day);
        if (next != MR_DATE_NONE && (s->valid_until == MR_DATE_NONE || next < s->valid_until))
            s->valid_until = next;
        const mr_price *p = mr_model_price_at(m, s->day);
        if (!p) { /* announced ahead of its first price: served from that day on */
            s->n_pending++;
            continue;
        }
        mr_entry *e = &s->entries[s->n++];
        e->m = m;
        e->input_per_million = p->input_per_million;
        e->output_per_million = p->output_per_million;
        e->blended = mr_blended_price(p->input_per_million, p->output_per_million);
        e->cost_efficiency = mr_cost_efficiency(p->input_per_million, p->output_per_million);
        e->deprecated = m->status != MR_STATUS_ACTIVE;
    }
}

static void fill_providers(mr_snapshot *s) {
    /* entries are sorted by provider first, so distinct names are adjacent */
    for (size_t i = 0; i < s->n; i++) {
        const char *p = s->entries[i].m->provider;
        if (s->n_providers == 0 || strcmp(s->providers[s->n_providers - 1], p) != 0)
            s->providers[s->n_providers++] = p;
        s->entries[i].provider = s->providers[s->n_providers - 1];
    }
}

int mr_snapshot_build(mr_catalog *cat, int32_t day, mr_snapshot **out, char *err, size_t errlen) {
    mr_snapshot *s = calloc(1, sizeof *s);
    *out = NULL;
    if (!s) {
        mr_catalog_free(cat);
        return fail(err, errlen, "out of memory");
    }
    s->cat = *cat;
    memset(cat, 0, sizeof *cat);
    atomic_init(&s->refs, 1);
    s->day = day;
    size_t cap = s->cat.n ? s->cat.n : 1;
    s->entries = calloc(cap, sizeof *s->entries);
    s->by_id = calloc(cap, sizeof *s->by_id);
    s->providers = calloc(cap, sizeof *s->providers);
    if (!s->entries || !s->by_id || !s->providers) {
        mr_snapshot_unref(s);
        return fail(err, errlen, "out of memory");
    }
    fill_entries(s);
    qsort(s->entries, s->n, sizeof *s->entries, cmp_list_order);
    for (size_t i = 0; i < s->n; i++)
        s->by_id[i] = &s->entries[i];
    qsort(s->by_id, s->n, sizeof *s->by_id, cmp_by_id);
    fill_providers(s);
    *out = s;
    return 0;
}

mr_snapshot *mr_snapshot_ref(mr_snapshot *s) {
    if (s) atomic_fetch_add_explicit(&s->refs, 1, memory_order_relaxed);
    return s;
}

void mr_snapshot_unref(mr_snapshot *s) {
    if (!s) return;
    if (atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) != 1) return;
    free(s->entries);
    free(s->by_id);
    free(s->providers);
    mr_catalog_free(&s->cat);
    free(s);
}

const mr_entry *mr_snapshot_find(const mr_snapshot *s, const char *id, size_t len) {
    char key[MR_ID_MAX];
    if (mr_lower_trim(id, len, key, sizeof key) <= 0) return NULL;
    size_t lo = 0, hi = s->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(key, s->by_id[mid]->m->model_id);
        if (c == 0) return s->by_id[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

const char *mr_snapshot_provider(const mr_snapshot *s, const char *name, size_t len) {
    char key[MR_PROVIDER_MAX];
    if (mr_lower_trim(name, len, key, sizeof key) <= 0) return NULL;
    for (size_t i = 0; i < s->n_providers; i++)
        if (strcmp(key, s->providers[i]) == 0) return s->providers[i];
    return NULL;
}

void mr_holder_init(mr_holder *h) {
    pthread_mutex_init(&h->mu, NULL);
    h->cur = NULL;
    h->next_version = 1;
}

void mr_holder_destroy(mr_holder *h) {
    mr_snapshot_unref(h->cur);
    h->cur = NULL;
    pthread_mutex_destroy(&h->mu);
}

mr_snapshot *mr_holder_get(mr_holder *h) {
    pthread_mutex_lock(&h->mu);
    mr_snapshot *s = mr_snapshot_ref(h->cur);
    pthread_mutex_unlock(&h->mu);
    return s;
}

void mr_holder_swap(mr_holder *h, mr_snapshot *s) {
    pthread_mutex_lock(&h->mu);
    mr_snapshot *old = h->cur;
    s->version = h->next_version++;
    h->cur = s;
    pthread_mutex_unlock(&h->mu);
    /* outside the lock: freeing a large snapshot must not stall readers */
    mr_snapshot_unref(old);
}
