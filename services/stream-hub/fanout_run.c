/* The fan-out of run status and logs (fanout_int.h; the rules at the top of fanout.c): a
 * run's live events delivered in seq order, a subscriber in REPAIR fed from the store until it
 * has caught up, and the run's snapshot. */
#include "fanout_int.h"

#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "pbjson.h"
#include "util.h"

/* ---- run status and logs ---- */

/* spec NodeStatusUpdate.elapsed_ms is "time spent in `running` so far ...; for `blocked`
 * nodes the time since the gate was hit": an event carries the value at its transition (`at`),
 * so a snapshot row of a node still running or blocked adds the time since then. */
static void elapsed_so_far(Upsquad__Workflow__V1__NodeStatusUpdate *u, int64_t now_ms) {
    if (!u->at || (strcmp(u->status, "running") != 0 && strcmp(u->status, "blocked") != 0)) return;
    int64_t since = now_ms - pbjson_ts_to_ms(u->at);
    if (since > 0) u->elapsed_ms += since;
}

/* The frame a run event becomes for `rpc` (NULL when it is not that stream's kind) and
 * whether it ends the run. body: the RunEvent bytes. now_ms: 0 for a live event; a snapshot
 * row's read time, so a node's elapsed_ms is brought up to it (elapsed_so_far). */
static int run_frame(const uint8_t *body, size_t len, int rpc, int64_t now_ms, int64_t *seq,
                     int *terminal, rpc_frame **out) {
    *out = NULL;
    *terminal = 0;
    RunEvent *ev = upsquad__internal__v1__run_event__unpack(NULL, len, body);
    if (!ev) return -1;
    *seq = ev->seq;
    if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_NODE && ev->node) {
        *terminal = hub_status_terminal(ev->node->run_status);
        if (rpc == HUB_RPC_STATUS && ev->node->update) {
            StatusResp r = UPSQUAD__WORKFLOW__V1__STREAM_RUN_STATUS_RESPONSE__INIT;
            r.update = ev->node->update;
            if (now_ms) elapsed_so_far(r.update, now_ms);
            r.run_seq = ev->seq; /* the resume point a client sends back (docs: resume) */
            *out = rpc_frame_encode(&r.base);
        }
    } else if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_RUN && ev->run) {
        *terminal = hub_status_terminal(ev->run->status);
    } else if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_LOG && ev->log) {
        if (rpc == HUB_RPC_LOGS) {
            LogsResp r = UPSQUAD__WORKFLOW__V1__STREAM_RUN_LOGS_RESPONSE__INIT;
            r.line = ev->log;
            r.run_seq = ev->seq;
            *out = rpc_frame_encode(&r.base);
        }
    }
    upsquad__internal__v1__run_event__free_unpacked(ev, NULL);
    return 0;
}

static void end_ok(hub_sub *s) {
    rpc_stream_finish(s->call, RPC_OK, NULL);
    s->state = SS_DONE;
}

/* Whether a hole below `above` (a stored seq, with last_seq + 1 .. above - 1 missing) is still
 * to be waited for. The missing events are usually being projected by another replica, or are
 * held by one that died with them fetched: JetStream gives those to another replica after the
 * projection's ack wait. So the wait runs until `above` has been stored UPSQUAD_HUB_HOLE_WAIT
 * (more than that ack wait), on the database's clock: not from this subscriber's first
 * sighting, which would skip events a dead replica held (an earlier 5 s from the sighting did)
 * and make every later subscriber wait again at a hole that will never fill. The age is read
 * once per hole; meanwhile the subscriber looks for the hole's filling at growing intervals
 * (50 ms doubling to 1 s: most holes fill within milliseconds, and 1,000 subscribers waiting
 * out a dead replica's 30 s must not read the store 20,000 times a second). */
static int hole_open(hub_sub *s, int64_t above) {
    int64_t now = util_mono_ms(), age = 0;
    char err[256];
    if (!s->hole_until) {
        if (hs_event_age_ms(s->h->pool, s->t->org, s->t->run, above, &age, err, sizeof err) !=
            DB_OK) {
            log_warn("hub.repair", "run %s: %s", s->t->run, err);
            return 1; /* looked at again on the next pass */
        }
        s->hole_until = now + (int64_t)s->h->cfg->hole_wait_ms - age;
        if (s->hole_until <= 0) s->hole_until = 1; /* 0 means "not read" */
    }
    if (now >= s->hole_until) return 0;
    s->hole_step = s->hole_step ? s->hole_step * 2 : 50;
    if (s->hole_step > 1000) s->hole_step = 1000;
    s->hole_next = now + s->hole_step;
    return 1;
}

void fanout__catch_up(hub_sub *s) {
    hub *h = s->h;
    char err[256];
    if (s->hole_until && util_mono_ms() < s->hole_next) return; /* waiting at a hole */
    for (;;) {
        hs_blobs b;
        int lim = (int)h->cfg->repair_batch;
        if (hs_events_after(h->pool, s->t->org, s->t->run, s->last_seq, lim, &b, err, sizeof err) !=
            DB_OK) {
            log_warn("hub.repair", "run %s: %s", s->t->run, err);
            return;
        }
        size_t got = b.n;
        for (size_t i = 0; i < b.n; i++) {
            rpc_frame *f;
            int64_t seq = 0;
            int term;
            if (b.v[i].seq > s->last_seq + 1 && s->last_seq > 0) {
                if (hole_open(s, b.v[i].seq)) {
                    hs_blobs_free(&b);
                    return;
                }
                log_warn("hub.hole", "run %s: seq %lld..%lld never arrived; skipped", s->t->run,
                         (long long)s->last_seq + 1, (long long)b.v[i].seq - 1);
            }
            s->hole_until = s->hole_next = s->hole_step = 0;
            /* the events themselves, as they were live (not a fold): their transition values */
            if (run_frame(b.v[i].body, b.v[i].len, s->rpc, 0, &seq, &term, &f) != 0) continue;
            if (f) {
                int rc = fanout__push_unlocked(s, f);
                rpc_frame_unref(f);
                if (rc != RPC_OK) {
                    hs_blobs_free(&b);
                    return;
                }
            }
            s->last_seq = b.v[i].seq;
            if (term && s->rpc == HUB_RPC_STATUS) {
                hs_blobs_free(&b);
                pthread_mutex_lock(&s->t->mu);
                end_ok(s);
                pthread_mutex_unlock(&s->t->mu);
                return;
            }
        }
        hs_blobs_free(&b);
        if (got < (size_t)lim) break;
    }
    pthread_mutex_lock(&s->t->mu);
    if (s->state == SS_REPAIR && s->t->max_seq <= s->last_seq) {
        s->state = SS_LIVE;
        if (!s->recheck_at) s->recheck_at = util_mono_ms() + 1000;
    }
    pthread_mutex_unlock(&s->t->mu);
}

static void to_repair(hub_sub *s) {
    s->state = SS_REPAIR;
    metric_inc(s->h->m_repairs);
    fanout__wake(s->h);
}

static void run_deliver(hub_topic *t, int64_t seq, int kind_ok_status, int kind_ok_logs,
                        rpc_frame *fs, rpc_frame *fl, int terminal) {
    for (hub_sub *s = t->subs; s; s = s->next) {
        if (s->state != SS_LIVE) continue;
        if (seq <= s->last_seq) continue; /* already sent from the snapshot or the store */
        if (seq > s->last_seq + 1) {      /* a hole: the store fills it */
            to_repair(s);
            continue;
        }
        rpc_frame *f =
            s->rpc == HUB_RPC_STATUS ? (kind_ok_status ? fs : NULL) : (kind_ok_logs ? fl : NULL);
        if (f) {
            int rc = fanout__push(s, f);
            if (rc == RPC_EFULL) {
                to_repair(s);
                continue;
            }
            if (rc != RPC_OK) continue;
        }
        s->last_seq = seq;
        if (terminal && s->rpc == HUB_RPC_STATUS) end_ok(s);
    }
}

/* One live event of a run message, decoded (outside topic->mu) for both stream kinds. */
typedef struct run_ev {
    rpc_frame *fs, *fl;
    int64_t seq;
    int term;
} run_ev;

void fanout__on_run_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    hub_topic *t = ud;
    hub_evit it;
    const uint8_t *data;
    size_t len, n = 0, cap = 0;
    run_ev one, *evs = &one;
    int more = fanout__burst_more(t), rc;
    hub_evit_init(&it, (const uint8_t *)natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m));
    while ((rc = hub_evit_next(&it, &data, &len)) == 1) {
        if (n == cap) { /* one event (a bare RunEvent) needs no allocation */
            size_t nc = cap ? cap * 2 : 1;
            run_ev *v = nc == 1 ? &one : malloc(nc * sizeof *v);
            if (!v) break;
            if (n) memcpy(v, evs, n * sizeof *v);
            if (evs != &one) free(evs);
            evs = v;
            cap = nc;
        }
        run_ev *e = &evs[n];
        int term2 = 0;
        memset(e, 0, sizeof *e);
        if (run_frame(data, len, HUB_RPC_STATUS, 0, &e->seq, &e->term, &e->fs) != 0 ||
            run_frame(data, len, HUB_RPC_LOGS, 0, &e->seq, &term2, &e->fl) != 0) {
            log_warn("hub.decode", "undecodable run event on %s", natsMsg_GetSubject(m));
            rpc_frame_unref(e->fs);
            rpc_frame_unref(e->fl);
            continue;
        }
        if (e->seq > 0) n++;
    }
    if (rc < 0) log_warn("hub.decode", "malformed run event batch on %s", natsMsg_GetSubject(m));
    if (n == 0) {
        fanout__batch_skip(t, more);
    } else {
        pthread_mutex_lock(&t->mu);
        fanout__batch_begin(t, more);
        for (size_t i = 0; i < n; i++) {
            if (evs[i].seq > t->max_seq) t->max_seq = evs[i].seq;
            run_deliver(t, evs[i].seq, evs[i].fs != NULL, evs[i].fl != NULL, evs[i].fs, evs[i].fl,
                        evs[i].term);
        }
        fanout__batch_end(t);
        pthread_mutex_unlock(&t->mu);
    }
    for (size_t i = 0; i < n; i++) {
        rpc_frame_unref(evs[i].fs);
        rpc_frame_unref(evs[i].fl);
    }
    if (evs != &one) free(evs);
}

int fanout__snapshot_run(hub_sub *s, int64_t *upto, int *terminal) {
    hub *h = s->h;
    char err[256];
    hs_blobs b;
    hs_run run;
    int found = 0, rc;
    if (s->rpc == HUB_RPC_STATUS)
        rc = hs_node_fold(h->pool, s->t->org, s->t->run, &b, &run, &found, err, sizeof err);
    else
        rc = hs_log_tail(h->pool, s->t->org, s->t->run, (int)h->cfg->log_tail, &b, &run, &found,
                         err, sizeof err);
    if (rc != DB_OK) {
        log_warn("hub.snapshot", "run %s: %s", s->t->run, err);
        return -1;
    }
    *upto = 0;
    /* the fold's read time on the wall clock (the events' `at` is): its running and blocked
     * rows count up to it */
    Google__Protobuf__Timestamp read_at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    pbjson_ts_now(&read_at);
    int64_t now = pbjson_ts_to_ms(&read_at);
    /* terminal only when the snapshot covers the run's last event */
    for (size_t i = 0; i < b.n; i++)
        if (b.v[i].kind == 'u') *upto = b.v[i].seq;
    *terminal = found && hub_status_terminal(run.status) && *upto >= run.last_seq;
    for (size_t i = 0; i < b.n; i++) {
        rpc_frame *f;
        if (b.v[i].kind == 'u') continue;
        int64_t seq;
        int term;
        if (run_frame(b.v[i].body, b.v[i].len, s->rpc, now, &seq, &term, &f) != 0 || !f) continue;
        int src = fanout__snap_stalled(s, rpc_stream_push_wait(s->call, f, h->cfg->stall_ms));
        rpc_frame_unref(f);
        if (src != 0) {
            hs_blobs_free(&b);
            return -1;
        }
    }
    hs_blobs_free(&b);
    return 0;
}

void fanout__recheck(hub_sub *s) {
    hs_blobs b;
    char err[256];
    s->recheck_at = -1;
    if (hs_events_after(s->h->pool, s->t->org, s->t->run, s->last_seq, 1, &b, err, sizeof err) !=
        DB_OK)
        return;
    size_t n = b.n;
    hs_blobs_free(&b);
    if (!n) return;
    pthread_mutex_lock(&s->t->mu);
    if (s->state == SS_LIVE) s->state = SS_REPAIR; /* it was published before we subscribed */
    pthread_mutex_unlock(&s->t->mu);
}
