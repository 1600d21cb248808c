/* Crash recovery: the sweeper (docs/orchestrator.md, "Crash recovery"; spec runtime.proto,
 * Heartbeat: "the Orchestrator uses missed heartbeats to detect crashed workers", and
 * InitWorkerSessionRequest's resume path).
 *
 * Every replica runs one sweeper thread. Each UPSQUAD_WORKER_HEARTBEAT_INTERVAL it claims, in
 * Postgres, the live sessions of workers whose last heartbeat is older than
 * interval x UPSQUAD_WORKER_HEARTBEAT_MISSES (a lease per session: exactly one replica acts on
 * each, and a replica that dies while acting leaves it to another once the lease expires), and
 * for each one calls InitWorkerSession on another live worker with the session's latest
 * checkpoint. Success: the session lives there (session_recovered audit row). The worker's
 * success=false (a checkpoint it cannot load): the session is crashed (session_crashed audit
 * row, reset: ended, AgentStatus ERROR, no worker). No live worker or a failed call: the claim
 * is given back and the next sweep tries again. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "orch.h"
#include "session.h"
#include "store.h"
#include "util.h"

#define SWEEP_BATCH 64 /* sessions claimed per round; the rest wait for the next round */

struct orch_sweeper {
    orch *o;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int stop;
    pthread_t thread;
};

/* Recovers one claimed session. */
static void recover_one(orch *o, const orch_recovery *rv) {
    orch_session s = {0};
    SessionSnapshot *snap = NULL;
    unsigned char *ck = NULL;
    size_t cklen = 0;
    int loop = -1, rc;
    char err[512], msg[512], worker[128] = "";
    rc = orch_store_session_get(o->pool, rv->org_id, rv->session_id, 1, &s, err, sizeof err);
    if (rc != DB_OK) goto release;
    rc = orch_store_checkpoint_latest(o->pool, rv->org_id, rv->session_id, &loop, &ck, &cklen, err,
                                      sizeof err);
    if (rc == ORCH_ENOTFOUND)
        loop = -1; /* no checkpoint yet: a fresh init, prior turns carry on */
    else if (rc != DB_OK)
        goto release;
    snap = (SessionSnapshot *)protobuf_c_message_unpack(
        &upsquad__runtime__v1__session_snapshot__descriptor, NULL, s.snapshot_len, s.snapshot);
    if (!snap) {
        snprintf(err, sizeof err, "the stored snapshot does not decode");
        goto crash_with_err;
    }
    orch_worker_init wi = {.snapshot = snap,
                           .avoid = orch_workers_find(o->workers, rv->worker),
                           .checkpoint = ck,
                           .checkpoint_len = cklen,
                           .loop = loop < 0 ? 0 : loop,
                           /* the call ends well inside the lease: no second replica acts */
                           .timeout_ms = (int)(o->cfg->recovery_lease_ms / 2)};
    rc = orch_session_init_worker(o, &wi, worker, msg, sizeof msg);
    if (rc == RPC_OK) {
        rc = orch_store_session_placed(o->pool, rv->org_id, rv->session_id, rv->worker, worker,
                                       loop, err, sizeof err);
        if (rc == DB_OK) {
            metric_inc(o->m_recovered);
            log_info("recovery.recovered",
                     "session %s org %s: worker %s is dead; resumed on %s from loop %d",
                     rv->session_id, rv->org_id, rv->worker, worker, loop);
        } else if (rc != ORCH_ESTATE) {
            log_error("recovery.store", "session %s: %s", rv->session_id, err);
        }
        goto done;
    }
    if (rc == RPC_FAILED_PRECONDITION) {
        snprintf(err, sizeof err, "%s", msg);
        goto crash_with_err;
    }
    log_warn("recovery.deferred", "session %s of dead worker %s: %s; tried again next sweep",
             rv->session_id, rv->worker, msg);
    orch_store_recovery_release(o->pool, o->instance, rv->session_id, err, sizeof err);
    goto done;
crash_with_err : {
    char why[600];
    snprintf(why, sizeof why, "crash recovery failed: %s", err);
    rc = orch_store_session_crashed(o->pool, rv->org_id, rv->session_id, rv->worker, loop, why, err,
                                    sizeof err);
    if (rc == DB_OK) {
        metric_inc(o->m_crashed);
        log_warn("recovery.crashed", "session %s org %s: %s", rv->session_id, rv->org_id, why);
    } else if (rc != ORCH_ESTATE) {
        log_error("recovery.store", "session %s: %s", rv->session_id, err);
    }
    goto done;
}
release:
    log_error("recovery.store", "session %s: %s", rv->session_id, err);
    orch_store_recovery_release(o->pool, o->instance, rv->session_id, err, sizeof err);
done:
    if (snap) protobuf_c_message_free_unpacked(&snap->base, NULL);
    free(ck);
    orch_session_clear(&s);
}

static void sweep(orch *o) {
    orch_recovery *list = NULL;
    size_t n = 0;
    char err[512];
    int64_t dead_after = o->cfg->worker_hb_interval_ms * o->cfg->worker_hb_misses;
    /* nowhere to move a session: claiming would only give the claims back */
    if (orch_workers_live(o->workers) == 0) return;
    if (orch_store_recovery_claim(o->pool, o->instance, dead_after, o->cfg->recovery_lease_ms,
                                  SWEEP_BATCH, &list, &n, err, sizeof err) != DB_OK) {
        log_warn("recovery.claim", "%s", err);
        return;
    }
    for (size_t i = 0; i < n; i++)
        recover_one(o, &list[i]);
    free(list);
}

static void *sweeper_main(void *arg) {
    orch_sweeper *sw = arg;
    pthread_mutex_lock(&sw->mu);
    while (!sw->stop) {
        pthread_mutex_unlock(&sw->mu);
        sweep(sw->o);
        pthread_mutex_lock(&sw->mu);
        struct timespec ts;
        util_deadline(&ts, sw->o->cfg->worker_hb_interval_ms);
        if (!sw->stop) pthread_cond_timedwait(&sw->cv, &sw->mu, &ts);
    }
    pthread_mutex_unlock(&sw->mu);
    return NULL;
}

int orch_recovery_start(orch *o, char *err, size_t errlen) {
    orch_sweeper *sw = calloc(1, sizeof *sw);
    if (!sw) return util_errf(err, errlen, -1, "out of memory");
    sw->o = o;
    pthread_mutex_init(&sw->mu, NULL);
    util_cond_init_monotonic(&sw->cv);
    if (pthread_create(&sw->thread, NULL, sweeper_main, sw)) {
        pthread_cond_destroy(&sw->cv);
        pthread_mutex_destroy(&sw->mu);
        free(sw);
        return util_errf(err, errlen, -1, "cannot start the recovery sweeper");
    }
    o->sweeper = sw;
    return 0;
}

void orch_recovery_stop(orch *o) {
    orch_sweeper *sw = o->sweeper;
    if (!sw) return;
    pthread_mutex_lock(&sw->mu);
    sw->stop = 1;
    pthread_cond_broadcast(&sw->cv);
    pthread_mutex_unlock(&sw->mu);
    pthread_join(sw->thread, NULL);
    pthread_cond_destroy(&sw->cv);
    pthread_mutex_destroy(&sw->mu);
    free(sw);
    o->sweeper = NULL;
}
