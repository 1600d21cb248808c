/* The outbox relay (interp.h; docs/workflow-engine.md "Events").
 *
 * One replica relays at a time (a transaction-scoped advisory lock, st_outbox_fetch). A round
 * reads up to UPSQUAD_WF_RELAY_BATCH rows in id order, publishes them to JetStream with their
 * message ids, deletes the rows whose publish was acknowledged and commits. A row is deleted
 * only once the stream acked it, so nothing is lost while NATS is down (the row stays and the
 * next round publishes it again; the message id makes a re-sent copy a duplicate).
 *
 * Order. Events of a run must reach the bus in seq order (outbox id order). The round's rows
 * are published in waves, each wave one pipelined batch with one wait for all its acks
 * (bus_js_publish_batch): a run's events (wf.status / wf.log, keyed by the run, the subject's
 * last token) go at most one per wave, in id order, so a run's later event is sent only after
 * its earlier one was acked. Every other row (agent dispatches and cancels, approval
 * decisions) is a barrier: it is alone in its wave, after every earlier row was acked and
 * before any later row is sent, which keeps the strict outbox order the relay always had for
 * them. A wave with a failed message ends the round (the rest stays for the next round), so a
 * failure never lets a later event of a run overtake an earlier one.
 *
 * Rounds. A commit wakes the relay (wf_engine_kick_relay); a round starts at most once per
 * UPSQUAD_WF_RELAY_LINGER, so under load the events of several ticks share one round (one
 * transaction, a few waves) instead of a round per tick; an idle relay answers a kick at once. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "interp.h"
#include "log.h"
#include "store.h"
#include "subjects.h"
#include "util.h"

/* The ordering key of an outbox subject: the run for a run event, NULL for a barrier. */
static const char *run_key(const char *subject) {
    static const char *events[] = {SUBJ_WF_STATUS ".", SUBJ_WF_LOG "."};
    for (size_t k = 0; k < sizeof events / sizeof events[0]; k++)
        if (!strncmp(subject, events[k], strlen(events[k]))) {
            const char *dot = strrchr(subject, '.');
            return dot && dot[1] ? dot + 1 : NULL;
        }
    return NULL;
}

static uint64_t key_hash(const char *s) {
    return util_fnv1a(UTIL_FNV1A_INIT, s, strlen(s));
}

int wf_relay_waves(const char *const *subjects, int n, int *wave) {
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    const char **keys = calloc(cap, sizeof *keys);
    int *last = calloc(cap, sizeof *last);
    int top = -1, after = 0; /* highest wave so far; first wave allowed after the last barrier */
    if (!keys || !last) {
        free(keys);
        free(last);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        const char *k = run_key(subjects[i]);
        if (!k) { /* a barrier */
            wave[i] = top + 1;
            top = wave[i];
            after = top + 1;
            continue;
        }
        size_t h = (size_t)key_hash(k) & (cap - 1);
        while (keys[h] && strcmp(keys[h], k))
            h = (h + 1) & (cap - 1);
        int w = keys[h] && last[h] + 1 > after ? last[h] + 1 : after;
        keys[h] = k;
        last[h] = w;
        wave[i] = w;
        if (w > top) top = w;
    }
    free(keys);
    free(last);
    return top + 1;
}

static int64_t row_int8(PGresult *r, int i, int col) { /* binary int8 */
    const unsigned char *b = (const unsigned char *)PQgetvalue(r, i, col);
    uint64_t v = 0;
    for (int k = 0; k < 8; k++)
        v = (v << 8) | b[k];
    return (int64_t)v;
}

static int64_t row_id(PGresult *r, int i) {
    return row_int8(r, i, 0);
}

/* Publishes the fetched rows wave by wave; acked[i] set for each row the stream acknowledged.
 * Returns the number acknowledged. */
static int publish_rows(wf_engine *e, PGresult *r, int n, char *acked) {
    int *wave = malloc((size_t)n * sizeof *wave), *order = malloc((size_t)n * sizeof *order);
    int *start = NULL;
    bus_js_msg *batch = malloc((size_t)n * sizeof *batch);
    const char **subjects = malloc((size_t)n * sizeof *subjects);
    for (int i = 0; subjects && i < n; i++)
        subjects[i] = PQgetvalue(r, i, 1);
    int waves = wave && order && batch && subjects ? wf_relay_waves(subjects, n, wave) : -1;
    int done = 0;
    char err[512];
    if (waves < 0 || !(start = calloc((size_t)waves + 1, sizeof *start))) {
        log_warn("outbox.publish", "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) /* rows grouped by wave, id order inside each */
        start[wave[i] + 1]++;
    for (int w = 0; w < waves; w++)
        start[w + 1] += start[w];
    int *fill = calloc((size_t)waves, sizeof *fill);
    if (!fill) goto out;
    for (int i = 0; i < n; i++)
        order[start[wave[i]] + fill[wave[i]]++] = i;
    free(fill);
    /* a wave larger than one batch goes in consecutive batches: its rows are of different
     * runs, so their order does not matter */
    int w = 0, k0 = 0; /* next wave, next row of `order` */
    while (w < waves && !e->stop) {
        if (k0 == start[w + 1]) {
            w++;
            continue;
        }
        int m = 0;
        for (; k0 < start[w + 1] && m < BUS_JS_BATCH_MAX; k0++) {
            int i = order[k0];
            batch[m++] = (bus_js_msg){.subject = PQgetvalue(r, i, 1),
                                      .data = PQgetvalue(r, i, 3),
                                      .len = PQgetlength(r, i, 3),
                                      .msg_id = PQgetvalue(r, i, 2),
                                      .trace_id = PQgetvalue(r, i, 4)};
        }
        int rc = bus_js_publish_batch(e->bus, batch, m, err, sizeof err);
        for (int k = 0; k < m; k++)
            if (batch[k].rc == BUS_OK) {
                acked[order[k0 - m + k]] = 1;
                done++;
            }
        if (rc != BUS_OK) { /* keep order: the rest waits for the next round */
            log_warn("outbox.publish", "%s", err);
            break;
        }
    }
out:
    free(subjects);
    free(wave);
    free(order);
    free(start);
    free(batch);
    return done;
}

/* One round; the number of rows published and deleted (0: none to publish, another replica
 * relays, or NATS / Postgres failed: the caller then waits before the next round). */
static int relay_round(wf_engine *e) {
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    char *acked = NULL, *ids = NULL;
    int locked = 0, n = 0, sent = 0;
    if (st_begin_service_ex(e->pool, DB_TX_PIPELINE, &tx, err, sizeof err) != DB_OK ||
        st_outbox_fetch(tx, (int)e->cfg->relay_batch, &locked, &r, err, sizeof err) != DB_OK) {
        if (tx) log_warn("outbox.fetch", "%s", err);
        goto done;
    }
    /* the lock holder reports the lag; the others 0, so the max over replicas is the lag */
    n = locked ? PQntuples(r) : 0;
    metric_set(e->m_outbox_lag, n > 0 ? (double)row_int8(r, 0, 5) / 1000.0 : 0.0);
    if (n == 0) goto done;
    acked = calloc((size_t)n, 1);
    ids = malloc((size_t)n * 21 + 3);
    if (!acked || !ids) goto done;
    sent = publish_rows(e, r, n, acked);
    if (sent == 0) goto done;
    size_t o = 0;
    ids[o++] = '{';
    for (int i = 0, k = 0; i < n; i++)
        if (acked[i])
            o += (size_t)sprintf(ids + o, "%s%lld", k++ ? "," : "", (long long)row_id(r, i));
    ids[o++] = '}';
    ids[o] = 0;
    /* the commit always ends tx; a failed delete leaves it to the rollback below */
    int rc = st_outbox_delete(tx, ids, err, sizeof err);
    if (rc == DB_OK) {
        rc = db_tx_commit(tx, err, sizeof err);
        tx = NULL;
    }
    if (rc == DB_OK) {
        metric_add(e->m_published, sent);
    } else {
        log_warn("outbox.delete", "%s", err); /* re-sent next round: duplicates by message id */
        sent = 0;
    }
done:
    db_tx_rollback(tx);
    PQclear(r);
    free(acked);
    free(ids);
    return sent;
}

void *wf_relay_thread(void *arg) {
    wf_engine *e = arg;
    while (!e->stop) {
        int64_t began = util_mono_ms();
        /* a full batch published: more rows may be waiting; anything less (drained, or a
         * failure) waits for the linger and a kick, so a failing NATS is not hammered */
        if (relay_round(e) >= (int)e->cfg->relay_batch) continue;
        /* the linger: kicks meanwhile only set the flag (no wake-up), the next round takes
         * their rows */
        long long left = e->cfg->relay_linger_ms - (util_mono_ms() - began);
        if (left > 0) {
            struct timespec d = {left / 1000, (left % 1000) * 1000000L};
            while (nanosleep(&d, &d) != 0 && errno == EINTR) {
            }
        }
        /* then sleep until a commit kicks us (or the poll interval: another replica's rows) */
        struct timespec ts;
        util_deadline(&ts, e->cfg->idle_poll_ms);
        pthread_mutex_lock(&e->mu);
        e->relay_waiting = 1;
        while (!e->stop && !e->relay_kick &&
               pthread_cond_timedwait(&e->relay_cv, &e->mu, &ts) != ETIMEDOUT) {
        }
        e->relay_waiting = 0;
        e->relay_kick = 0;
        pthread_mutex_unlock(&e->mu);
    }
    return NULL;
}
