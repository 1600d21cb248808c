/* Turn leases: renewal and reclaim (lease.h). */
#include "lease.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "store.h"

/* stale leases ended per statement round; a longer backlog is worked through batch by batch
 * in the same round */
#define RECLAIM_BATCH 64
#define RECLAIM_ROUND_MAX 1024

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static orch_lease *head; /* the leases this replica holds */
static size_t nheld;
static int stopping, started;
static pthread_t thread;
static orch *O;
static metric *m_reclaimed;

void orch_lease_hold(orch_lease *l, const char *action_id) {
    snprintf(l->action_id, sizeof l->action_id, "%s", action_id);
    pthread_mutex_lock(&mu);
    l->prev = NULL;
    l->next = head;
    if (head) head->prev = l;
    head = l;
    l->held = 1;
    nheld++;
    pthread_mutex_unlock(&mu);
}

void orch_lease_drop(orch_lease *l) {
    pthread_mutex_lock(&mu);
    if (l->held) {
        if (l->prev)
            l->prev->next = l->next;
        else
            head = l->next;
        if (l->next) l->next->prev = l->prev;
        l->held = 0;
        nheld--;
    }
    pthread_mutex_unlock(&mu);
}

/* Renews every lease held now, in one statement. A lease dropped after the copy is renewed
 * once more or not at all: its turn's end deleted it, so the update finds nothing. */
static void renew(void) {
    char err[256];
    pthread_mutex_lock(&mu);
    size_t n = nheld;
    char(*ids)[37] = n ? malloc(n * sizeof *ids) : NULL;
    size_t i = 0;
    for (orch_lease *l = head; ids && l && i < n; l = l->next)
        memcpy(ids[i++], l->action_id, sizeof ids[0]);
    pthread_mutex_unlock(&mu);
    if (n && !ids) {
        log_error("lease.renew", "out of memory renewing %zu turn leases", n);
        return;
    }
    if (i && orch_store_turn_leases_renew(O->pool, (const char(*)[37])ids, i, err, sizeof err))
        log_warn("lease.renew", "%zu turn leases not renewed: %s", i, err);
    free(ids);
}

/* Ends the turns whose leases went stale (their replica is gone, or cut off from the database
 * past the bound). Every replica sweeps; the reclaim of each lease is one transaction that
 * re-checks it under the session row's lock, so each dead turn is ended exactly once. */
static void reclaim(void) {
    orch_turn_lease batch[RECLAIM_BATCH];
    char err[512];
    size_t n = 0, done = 0;
    int64_t ttl = O->cfg->turn_lease_ttl_ms;
    do {
        if (orch_store_turn_leases_stale(O->pool, ttl, RECLAIM_BATCH, batch, &n, err, sizeof err)) {
            log_warn("lease.sweep", "reading stale turn leases: %s", err);
            return;
        }
        for (size_t i = 0; i < n; i++) {
            int reclaimed = 0;
            orch_pause pz = {0};
            if (orch_store_turn_reclaim(O->pool, &batch[i], ttl, O->instance, &reclaimed, &pz, err,
                                        sizeof err)) {
                log_warn("lease.reclaim", "session %s turn %s: %s", batch[i].session_id,
                         batch[i].action_id, err);
                return; /* the next round tries again */
            }
            if (!reclaimed) continue;
            metric_inc(m_reclaimed);
            log_warn("turn.reclaimed",
                     "session %s org %s: turn %s ended, its replica stopped renewing its "
                     "lease%s",
                     batch[i].session_id, batch[i].org_id, batch[i].action_id,
                     pz.committed ? "; the pending pause committed" : "");
        }
        done += n;
    } while (n == RECLAIM_BATCH && done < RECLAIM_ROUND_MAX);
}

static void *keeper(void *arg) {
    (void)arg;
    /* a third of the bound: one renewal may be lost (a slow query, a reconnect) before the
     * lease counts as stale */
    int64_t period = O->cfg->turn_lease_ttl_ms / 3;
    pthread_mutex_lock(&mu);
    while (!stopping) {
        pthread_mutex_unlock(&mu);
        renew();
        reclaim();
        pthread_mutex_lock(&mu);
        struct timespec at;
        clock_gettime(CLOCK_REALTIME, &at);
        at.tv_sec += period / 1000;
        at.tv_nsec += (long)(period % 1000) * 1000000L;
        if (at.tv_nsec >= 1000000000L) {
            at.tv_sec++;
            at.tv_nsec -= 1000000000L;
        }
        while (!stopping && pthread_cond_timedwait(&cv, &mu, &at) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&mu);
    return NULL;
}

int orch_lease_start(orch *o) {
    O = o;
    if (!m_reclaimed)
        m_reclaimed = metrics_counter("orchestrator_turns_reclaimed_total",
                                      "chat turns of a dead replica ended by this one", NULL);
    stopping = 0;
    if (pthread_create(&thread, NULL, keeper, NULL)) return -1;
    started = 1;
    return 0;
}

void orch_lease_stop(void) {
    if (!started) return;
    pthread_mutex_lock(&mu);
    stopping = 1;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
    pthread_join(thread, NULL);
    started = 0;
}
