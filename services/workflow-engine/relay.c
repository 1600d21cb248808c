/* The outbox relay (interp.h; docs/workflow-engine.md "Events").
 *
 * One replica relays at a time (a transaction-scoped advisory lock, st_outbox_fetch). A round
 * reads up to UPSQUAD_WF_RELAY_BATCH rows in id order, publishes them to JetStream with their
 * message ids, deletes the rows whose publish was acknowledged and commits. A row is deleted
 * only once the stream acked it, so nothing is lost while NATS is down (the row stays and the
 * next round publishes it again; the message id makes a re-sent copy a duplicate).
 *
 * Batches. A run's events between two other rows go as one message, a RunEventBatch (the rows'
 * payloads framed as its repeated field: no decode, no re-encode), up to WF_RELAY_BATCH_EVENTS
 * events and WF_RELAY_BATCH_BYTES; readers de-duplicate by (run, seq), so a batch re-sent with
 * other rows than its first copy is harmless (docs/workflow-engine.md "Events").
 *
 * Order. Events of a run must reach the bus in seq order (outbox id order). The round's
 * messages are published in waves, each wave one pipelined batch of asynchronous publishes
 * with one wait for all its acks (bus_js_publish_batch, at most BUS_JS_BATCH_MAX
 * unacknowledged): a run has at most one message per wave, so a run's later message is sent
 * only after its earlier one was acked. Every other row (agent dispatches and cancels, approval
 * decisions) is a barrier: its own message, alone in its wave, after every earlier row was
 * acked and before any later row is sent, which keeps the strict outbox order the relay always
 * had for them. A wave with a failed message ends the round (the rest stays for the next
 * round), so a failure never lets a later event of a run overtake an earlier one.
 *
 * Rounds. A commit wakes the relay (wf_engine_kick_relay); a round starts at most once per
 * UPSQUAD_WF_RELAY_LINGER, so under load the events of several ticks share one round (one
 * transaction, one message per run) instead of a round per tick; an idle relay answers a kick at
 * once. */
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

/* The framing of one event in a RunEventBatch: field 16 (events), length-delimited. */
#define BATCH_TAG0 0x82
#define BATCH_TAG1 0x01

static size_t varint_len(size_t v) {
    size_t n = 1;
    while (v >= 0x80) {
        v >>= 7;
        n++;
    }
    return n;
}

static size_t event_framed_len(int len) {
    return 2 + varint_len((size_t)len) + (size_t)len;
}

int wf_relay_plan(const char *const *subjects, const int *lens, int n, int *msg, int *wave) {
    size_t cap = 16;
    while (cap < (size_t)n * 2)
        cap *= 2;
    const char **keys = calloc(cap, sizeof *keys);
    int *open = calloc(cap, sizeof *open); /* the key's last message */
    int *count = calloc((size_t)n + 1, sizeof *count);
    size_t *bytes = calloc((size_t)n + 1, sizeof *bytes);
    int top = -1, after = 0; /* highest wave so far; first wave allowed after the last barrier */
    int nmsg = -1;
    if (!keys || !open || !count || !bytes) goto done;
    nmsg = 0;
    for (int i = 0; i < n; i++) {
        const char *k = run_key(subjects[i]);
        if (!k) { /* a barrier: its own message, its own wave */
            msg[i] = nmsg;
            wave[nmsg++] = ++top;
            after = top + 1;
            continue;
        }
        size_t fl = event_framed_len(lens[i]);
        size_t h = (size_t)key_hash(k) & (cap - 1);
        while (keys[h] && strcmp(keys[h], k))
            h = (h + 1) & (cap - 1);
        int prev = keys[h] ? open[h] : -1, m;
        if (prev >= 0 && wave[prev] >= after && count[prev] < WF_RELAY_BATCH_EVENTS &&
            bytes[prev] + fl <= WF_RELAY_BATCH_BYTES) {
            m = prev; /* the run's message since the last barrier has room */
        } else {      /* a new message, in a wave after the run's previous one */
            m = nmsg++;
            wave[m] = prev >= 0 && wave[prev] + 1 > after ? wave[prev] + 1 : after;
            keys[h] = k;
            open[h] = m;
            if (wave[m] > top) top = wave[m];
        }
        msg[i] = m;
        count[m]++;
        bytes[m] += fl;
    }
done:
    free(keys);
    free(open);
    free(count);
    free(bytes);
    return nmsg;
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

/* One planned message: the run's events framed as a RunEventBatch (heap, caller frees), or a
 * barrier row's payload as it is (borrowed from r). */
typedef struct relay_msg {
    bus_js_msg js;
    char *buf;
    char id[160];
} relay_msg;

/* Builds message m from its rows (rows[0..k), in id order). 0 or -1 (out of memory). */
static int build_msg(PGresult *r, const int *rows, int k, relay_msg *out) {
    int first = rows[0];
    out->js = (bus_js_msg){.subject = PQgetvalue(r, first, 1),
                           .data = PQgetvalue(r, first, 3),
                           .len = PQgetlength(r, first, 3),
                           .msg_id = PQgetvalue(r, first, 2),
                           .trace_id = PQgetvalue(r, first, 4)};
    out->buf = NULL;
    if (!run_key(out->js.subject)) return 0; /* a barrier: the row as it is */
    size_t total = 0;
    for (int j = 0; j < k; j++) {
        total += event_framed_len(PQgetlength(r, rows[j], 3));
        /* status and log lines of a run together go on its status subject (the org's
         * subscribers read only status); log lines alone on its log subject */
        if (!strncmp(PQgetvalue(r, rows[j], 1), SUBJ_WF_STATUS ".", sizeof SUBJ_WF_STATUS))
            out->js.subject = PQgetvalue(r, rows[j], 1);
    }
    unsigned char *p = malloc(total ? total : 1);
    if (!p) return -1;
    out->buf = (char *)p;
    for (int j = 0; j < k; j++) {
        size_t len = (size_t)PQgetlength(r, rows[j], 3);
        *p++ = BATCH_TAG0;
        *p++ = BATCH_TAG1;
        for (size_t v = len;; v >>= 7) {
            *p++ = (unsigned char)(v >= 0x80 ? (v & 0x7f) | 0x80 : v);
            if (v < 0x80) break;
        }
        memcpy(p, PQgetvalue(r, rows[j], 3), len);
        p += len;
    }
    out->js.data = out->buf;
    out->js.len = (int)total;
    /* JetStream's de-duplication id: the first event's for one event, the first's and the
     * count for more (a re-sent identical batch is a duplicate; one of other rows is not, and
     * readers de-duplicate its events by (run, seq)) */
    if (k > 1) {
        snprintf(out->id, sizeof out->id, "%s+%d", PQgetvalue(r, first, 2), k);
        out->js.msg_id = out->id;
    }
    return 0;
}

/* Publishes the fetched rows as planned (wf_relay_plan), wave by wave, each wave's messages
 * pipelined (at most BUS_JS_BATCH_MAX unacknowledged); acked[i] set for each row whose message
 * the stream acknowledged. Returns the number of rows acknowledged. */
static int publish_rows(wf_engine *e, PGresult *r, int n, char *acked) {
    int *msg = malloc((size_t)n * sizeof *msg), *wave = malloc((size_t)n * sizeof *wave);
    int *rows = malloc((size_t)n * sizeof *rows), *mstart = calloc((size_t)n + 1, sizeof *mstart);
    int *order = malloc((size_t)n * sizeof *order), *wstart = NULL;
    const char **subjects = malloc((size_t)n * sizeof *subjects);
    int *lens = malloc((size_t)n * sizeof *lens);
    relay_msg *batch = calloc(BUS_JS_BATCH_MAX, sizeof *batch);
    int nmsg = -1, waves = 0, done = 0;
    char err[512];
    if (msg && wave && rows && mstart && order && subjects && lens && batch) {
        for (int i = 0; i < n; i++) {
            subjects[i] = PQgetvalue(r, i, 1);
            lens[i] = PQgetlength(r, i, 3);
        }
        nmsg = wf_relay_plan(subjects, lens, n, msg, wave);
    }
    for (int m = 0; m < nmsg; m++)
        if (wave[m] + 1 > waves) waves = wave[m] + 1;
    if (nmsg < 0 || !(wstart = calloc((size_t)waves + 1, sizeof *wstart))) {
        log_warn("outbox.publish", "out of memory");
        goto out;
    }
    for (int i = 0; i < n; i++) /* each message's rows, in id order */
        mstart[msg[i] + 1]++;
    for (int m = 0; m < nmsg; m++)
        mstart[m + 1] += mstart[m];
    {
        int *fill = calloc((size_t)nmsg + (size_t)waves + 1, sizeof *fill);
        if (!fill) goto out;
        for (int i = 0; i < n; i++)
            rows[mstart[msg[i]] + fill[msg[i]]++] = i;
        for (int m = 0; m < nmsg; m++) /* messages grouped by wave */
            wstart[wave[m] + 1]++;
        for (int w = 0; w < waves; w++)
            wstart[w + 1] += wstart[w];
        int *wfill = fill + nmsg;
        for (int m = 0; m < nmsg; m++)
            order[wstart[wave[m]] + wfill[wave[m]]++] = m;
        free(fill);
    }
    /* a wave larger than one batch goes in consecutive batches: its messages are of different
     * runs, so their order does not matter */
    int w = 0, k0 = 0, failed = 0; /* next wave, next message of `order` */
    while (w < waves && !e->stop && !failed) {
        if (k0 == wstart[w + 1]) {
            w++;
            continue;
        }
        int b = 0;
        for (; k0 < wstart[w + 1] && b < BUS_JS_BATCH_MAX; k0++, b++) {
            int m = order[k0];
            if (build_msg(r, rows + mstart[m], mstart[m + 1] - mstart[m], &batch[b]) != 0) {
                log_warn("outbox.publish", "out of memory");
                failed = 1;
                break;
            }
        }
        bus_js_msg js[BUS_JS_BATCH_MAX];
        for (int j = 0; j < b; j++)
            js[j] = batch[j].js;
        int rc = b ? bus_js_publish_batch(e->bus, js, b, err, sizeof err) : BUS_OK;
        for (int j = 0; j < b; j++) {
            int m = order[k0 - b + j];
            if (js[j].rc == BUS_OK)
                for (int q = mstart[m]; q < mstart[m + 1]; q++) {
                    acked[rows[q]] = 1;
                    done++;
                }
            free(batch[j].buf);
            batch[j].buf = NULL;
        }
        if (rc != BUS_OK) { /* keep order: the rest waits for the next round */
            log_warn("outbox.publish", "%s", err);
            break;
        }
    }
out:
    free(msg);
    free(wave);
    free(rows);
    free(mstart);
    free(order);
    free(wstart);
    free(subjects);
    free(lens);
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
