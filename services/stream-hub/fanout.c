/* Live fan-out: topics (one shared NATS subscription per run, or per org for visible runs, per
 * replica), subscribers with bounded queues, and the snapshot-then-live hand-over.
 *
 * Ordering and de-duplication (docs/stream-hub.md)
 *   Run status and logs (per-run seq, contiguous across wf.status and wf.log): a subscriber
 *   is LIVE only while the next event it sees is exactly last_seq + 1. Anything else (the
 *   snapshot, a resume, a hole because the projection had not caught up, a full queue) puts
 *   it in REPAIR: it is fed from the store (seq > last_seq) until it has caught up with what
 *   the topic has seen, then goes LIVE again. Nothing is skipped and nothing is sent twice.
 *   Node I/O (live frames are not all stored): frames arriving during the snapshot are held
 *   (at most pending_max), the snapshot is sent, then the held frames minus those the
 *   snapshot covered (by session_id, seq). A full queue drops frames and sends one StreamGap
 *   (from_seq = last delivered, to_seq = next delivered) before the next frame. A frame with
 *   nothing structural left at a subscriber's clearance (a token frame below 4) is not sent to
 *   it but counted as seen: no StreamGap for it.
 *   Visible runs: held during the snapshot as for node I/O, de-duplicated per run by seq; a
 *   full queue drops and schedules a re-snapshot of the visible set (entries and exits).
 *
 * Sharing writes (docs/stream-hub.md, "Bursts share writes")
 *   A frame pushed to an idle stream starts its send at once, and that send is written on its
 *   own: one frame to 1,000 idle streams was up to 1,000 write syscalls. While more messages
 *   already wait on the topic's subscription, a message's frames are queued without starting
 *   sends (rpc_stream_push_deferred); the message that ends the burst (none waiting, or
 *   fanout_batch messages) starts them for every subscriber of the topic, those its own frame
 *   skipped included (a node filter's), so every stream's queued frames go out together (each
 *   but the last with the write-buffer hint) and no frame waits for a message that may never
 *   come. A message that fans nothing out (undecodable, no frame) still ends the burst.
 *
 * Locks: hub->mu (tables, lists) before topic->mu (a topic's subscribers and their state);
 * rpc_stream_push takes the call's own lock inside. wake_mu is a leaf. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "hub.h"
#include "log.h"
#include "pbjson.h"
#include "redact.h"
#include "store.h"
#include "upsquad/internal/v1/node_io.pb-c.h"
#include "upsquad/internal/v1/run_events.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"
#include "util.h"

typedef Upsquad__Internal__V1__RunEvent RunEvent;
typedef Upsquad__Internal__V1__NodeIOEvent NodeIOEvent;
typedef Upsquad__Workflow__V1__StreamRunStatusResponse StatusResp;
typedef Upsquad__Workflow__V1__StreamRunLogsResponse LogsResp;
typedef Upsquad__Workflow__V1__StreamNodeIOResponse IOResp;
typedef Upsquad__Workflow__V1__VisibleRunEvent VisEvent;
typedef Upsquad__Workflow__V1__StreamGap Gap;
typedef Upsquad__Workflow__V1__TranscriptEvent Transcript;

enum { TK_RUN = 0, TK_IO = 1, TK_ORG = 2 };
/* How long a subscriber fed from the store waits for a missing seq before skipping it. */
#define HUB_HOLE_WAIT_MS 5000
/* The longest a burst's deferred frames wait when its end never comes (maintenance pass). */
#define HUB_BATCH_MAX_MS 100
enum { SS_SNAP = 0, SS_REPAIR, SS_LIVE, SS_RESYNC, SS_DONE };

static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;

/* (key, seq) list: sessions (node I/O) or runs (visible runs). */
typedef struct seen {
    struct seen *next;
    char key[64];
    int64_t seq;
    int in_set;  /* visible: the run is in the subscriber's filtered set; io: seeded by the
                    snapshot, no gap before the session's next frame */
    int skipped; /* io: seq is a frame not sent to this subscriber (io_deliver) */
    int64_t had; /* io, while skipped: the session's last seq the client has */
} seen;

typedef struct pend {
    rpc_frame *f, *f_leave; /* io: f NULL = a frame not sent to this subscriber (io_deliver) */
    int64_t seq;
    char key[64];
    char node[64];
    int match; /* visible: 1 in filter, 0 not, -1 unknown */
    int is_gap;
} pend;

struct hub_topic {
    hub_topic *next;
    hub *h;
    char key[160];
    int kind;
    char org[64], run[64];
    bus_sub *bsub;
    pthread_mutex_t mu;
    hub_sub *subs;
    size_t nsubs;
    int64_t max_seq;     /* TK_RUN: highest seq seen live */
    seen *runs;          /* TK_ORG: highest seq seen live per run (a re-snapshot waits for the
                            store to reach it); as many entries as runs the topic saw */
    int defer;           /* 1 while the callback holding mu queues without starting sends */
    int batch;           /* messages of this burst whose sends wait for its end */
    int64_t batch_since; /* ms: the burst's first deferred message (the maintenance bound) */
    int64_t last_us;     /* the previous message's arrival (burst_more; delivery thread only) */
};

struct hub_sub {
    hub_sub *next, *prev;   /* in the topic */
    hub_sub *hnext, *hprev; /* in the hub */
    int refs;               /* under hub->mu */
    hub *h;
    hub_topic *t;
    rpc_call *call;
    int detached;
    int rpc;
    int state;
    int clearance;
    char member[AUTH_ID_MAX];
    size_t n_teams;
    char (*teams)[AUTH_ID_MAX];
    char node[128];
    int status_mask;
    int64_t last_seq; /* run: last seq accounted; io: last seq delivered */
    int gap;
    int64_t gap_from;
    char gap_node[64];
    int64_t stalled_since; /* ms; 0 = not stalled */
    int64_t recheck_at;    /* ms; run: look at the store once more after going live */
    int64_t hole_since;    /* ms; run: waiting for a seq below one already projected */
    seen *seen;
    pend *pending;
    size_t n_pending, cap_pending;
    int pending_overflow;
};

static void wake(hub *h) {
    pthread_mutex_lock(&wake_mu);
    h->wake = 1;
    pthread_cond_signal(&h->cv);
    pthread_mutex_unlock(&wake_mu);
}

int hub_status_bit(const char *s) {
    static const char *const names[] = {"pending",   "running", "paused",
                                        "completed", "failed",  "cancelled"};
    for (int i = 0; i < 6; i++)
        if (strcmp(s, names[i]) == 0) return 1 << i;
    return 0;
}

int hub_status_terminal(const char *s) {
    return s &&
           (strcmp(s, "completed") == 0 || strcmp(s, "failed") == 0 || strcmp(s, "cancelled") == 0);
}

/* ---- small lists ---- */

static seen *seen_get(seen **head, const char *key, int create) {
    for (seen *s = *head; s; s = s->next)
        if (strcmp(s->key, key) == 0) return s;
    if (!create) return NULL;
    seen *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    snprintf(s->key, sizeof s->key, "%s", key);
    s->next = *head;
    *head = s;
    return s;
}

static void seen_free(seen *s) {
    while (s) {
        seen *n = s->next;
        free(s);
        s = n;
    }
}

/* Drops the held frames and their memory (a live subscriber holds none). */
static void pending_clear(hub_sub *s) {
    for (size_t i = 0; i < s->n_pending; i++) {
        rpc_frame_unref(s->pending[i].f);
        rpc_frame_unref(s->pending[i].f_leave);
    }
    free(s->pending);
    s->pending = NULL;
    s->n_pending = s->cap_pending = 0;
    s->pending_overflow = 0;
}

/* Holds a frame for a subscriber still sending its snapshot; beyond pending_max the overflow
 * is remembered as a gap (node I/O) or a re-snapshot (visible runs). */
static void pending_add(hub_sub *s, rpc_frame *f, rpc_frame *f_leave, int64_t seq, const char *key,
                        const char *node, int match, int is_gap) {
    if (s->n_pending >= (size_t)s->h->cfg->pending_max) {
        s->pending_overflow = 1;
        metric_inc(s->h->m_drops);
        return;
    }
    if (s->n_pending == s->cap_pending) { /* grows while a snapshot is sent, freed after */
        size_t cap = s->cap_pending ? s->cap_pending * 2 : 16;
        if (cap > (size_t)s->h->cfg->pending_max) cap = (size_t)s->h->cfg->pending_max;
        pend *v = realloc(s->pending, cap * sizeof *v);
        if (!v) {
            s->pending_overflow = 1;
            metric_inc(s->h->m_drops);
            return;
        }
        s->pending = v;
        s->cap_pending = cap;
    }
    pend *p = &s->pending[s->n_pending++];
    p->f = f ? rpc_frame_ref(f) : NULL;
    p->f_leave = f_leave ? rpc_frame_ref(f_leave) : NULL;
    p->seq = seq;
    snprintf(p->key, sizeof p->key, "%s", key ? key : "");
    snprintf(p->node, sizeof p->node, "%s", node ? node : "");
    p->match = match;
    p->is_gap = is_gap;
}

/* ---- pushing ---- */

static void stalled(hub_sub *s) {
    if (!s->stalled_since) s->stalled_since = util_mono_ms();
}

/* The outcome of one push, counted; topic->mu held (it guards the subscriber's state). */
static int pushed(hub_sub *s, int rc) {
    if (rc == RPC_OK) {
        metric_inc(s->h->m_delivered);
        s->stalled_since = 0;
    } else if (rc == RPC_EFULL) {
        metric_inc(s->h->m_drops);
        stalled(s);
    } else {
        s->state = SS_DONE;
    }
    return rc;
}

/* One frame to one subscriber; topic->mu held. Inside a burst the send waits for the burst's
 * end (batch_end). */
static int push(hub_sub *s, rpc_frame *f) {
    return pushed(s,
                  s->t->defer ? rpc_stream_push_deferred(s->call, f) : rpc_stream_push(s->call, f));
}

/* ---- bursts: sharing writes (see the top of the file) ---- */

/* Starts the sends every subscriber's deferred frames wait for; topic->mu held. A stream with a
 * send in flight (or nothing queued) is left as it is. */
static void batch_kick(hub_topic *t) {
    for (hub_sub *s = t->subs; s; s = s->next)
        rpc_stream_kick(s->call);
    t->batch = 0;
}

#define HUB_LINGER_WINDOW_US 1000 /* messages closer than this come as one stream */
#define HUB_LINGER_US 300         /* how long a message of such a stream waits for the next */

/* Whether messages wait behind this one on the topic's subscription (the burst goes on). A
 * message that finds none while the topic's messages come back to back (the previous one came
 * less than HUB_LINGER_WINDOW_US ago) looks again for up to HUB_LINGER_US: with a publisher a
 * little slower than the fan-out, every message would otherwise end its own burst and start a
 * write per subscriber (the slow mode, docs/benchmarks.md). An isolated message (paced
 * frames) waits for nothing. Called by the subscription's callback before it takes the topic
 * lock: a subscription's messages are delivered one at a time, so last_us has one writer. */
static int burst_more(hub_topic *t) {
    int64_t now = util_mono_us(), prev = t->last_us;
    t->last_us = now;
    if (bus_cb_pending() > 0) return 1;
    if (!prev || now - prev > HUB_LINGER_WINDOW_US) return 0;
    const struct timespec nap = {0, 20000};
    while (util_mono_us() - now < HUB_LINGER_US) {
        nanosleep(&nap, NULL);
        if (bus_cb_pending() > 0) return 1;
    }
    return 0;
}

/* Before a message's pushes; topic->mu held. more: messages wait behind this one. */
static void batch_begin(hub_topic *t, int more) {
    t->defer = more && t->batch + 1 < t->h->fanout_batch;
}

/* After them: the burst goes on, or ends here and its sends start; topic->mu held. */
static void batch_end(hub_topic *t) {
    if (t->defer) {
        t->defer = 0;
        if (t->batch++ == 0) t->batch_since = util_mono_ms();
        metric_inc(t->h->m_deferred);
    } else if (t->batch) {
        batch_kick(t);
    }
}

/* A message that fanned nothing out: it still ends the burst when it is the last one. */
static void batch_skip(hub_topic *t, int more) {
    if (more) return;
    pthread_mutex_lock(&t->mu);
    if (t->batch) batch_kick(t);
    pthread_mutex_unlock(&t->mu);
}

/* The same from the maintenance thread feeding a subscriber from the store, without topic->mu:
 * the state the outcome may set is written under it (found by the churn test under TSan). */
static int push_unlocked(hub_sub *s, rpc_frame *f) {
    int rc = rpc_stream_push(s->call, f);
    pthread_mutex_lock(&s->t->mu);
    pushed(s, rc);
    pthread_mutex_unlock(&s->t->mu);
    return rc;
}

static rpc_frame *gap_frame(const char *node, int64_t from, int64_t to) {
    Gap g = UPSQUAD__WORKFLOW__V1__STREAM_GAP__INIT;
    IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
    g.node_id = (char *)(node ? node : "");
    g.from_seq = from;
    g.to_seq = to;
    r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_GAP;
    r.gap = &g;
    return rpc_frame_encode(&r.base);
}

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

/* Feeds a REPAIR subscriber from the store; LIVE once it has caught up with the topic.
 * Runs on the handler's thread first, then on the maintenance thread; never blocks on the
 * client (a full queue leaves it in REPAIR for the next tick). */
static void catch_up(hub_sub *s) {
    hub *h = s->h;
    char err[256];
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
                /* a hole: the missing event is still being projected by another replica;
                 * wait for it, but not forever (an event lost upstream must not stall us) */
                int64_t now = util_mono_ms();
                if (!s->hole_since) s->hole_since = now;
                if (now - s->hole_since < HUB_HOLE_WAIT_MS) {
                    hs_blobs_free(&b);
                    return;
                }
                log_warn("hub.hole", "run %s: seq %lld..%lld never arrived; skipped", s->t->run,
                         (long long)s->last_seq + 1, (long long)b.v[i].seq - 1);
            }
            s->hole_since = 0;
            /* the events themselves, as they were live (not a fold): their transition values */
            if (run_frame(b.v[i].body, b.v[i].len, s->rpc, 0, &seq, &term, &f) != 0) continue;
            if (f) {
                int rc = push_unlocked(s, f);
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
    wake(s->h);
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
            int rc = push(s, f);
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

/* A message of the run: its events in seq order (a batch's, or one bare RunEvent), decoded
 * first, then delivered under one hold of topic->mu as one step of the burst (the shape of a
 * bare event's message), each de-duplicated and checked for holes per subscriber by its own
 * seq (run_deliver). */
static void on_run_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    hub_topic *t = ud;
    hub_evit it;
    const uint8_t *data;
    size_t len, n = 0, cap = 0;
    run_ev one, *evs = &one;
    int more = burst_more(t), rc;
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
        batch_skip(t, more);
    } else {
        pthread_mutex_lock(&t->mu);
        batch_begin(t, more);
        for (size_t i = 0; i < n; i++) {
            if (evs[i].seq > t->max_seq) t->max_seq = evs[i].seq;
            run_deliver(t, evs[i].seq, evs[i].fs != NULL, evs[i].fl != NULL, evs[i].fs, evs[i].fl,
                        evs[i].term);
        }
        batch_end(t);
        pthread_mutex_unlock(&t->mu);
    }
    for (size_t i = 0; i < n; i++) {
        rpc_frame_unref(evs[i].fs);
        rpc_frame_unref(evs[i].fl);
    }
    if (evs != &one) free(evs);
}

/* ---- node I/O ---- */

/* Delivers one live frame to a LIVE subscriber: de-duplicated against the snapshot (by
 * session_id, seq), and preceded by a StreamGap when frames are missing before it, whether the
 * publisher skipped them (a jump in the session's seq) or this subscriber's full queue
 * dropped them. f NULL: a frame this subscriber's clearance class is not sent (nothing
 * structural is left in it, redact_frame_sendable). It counts as seen, not as lost: the
 * session's seq moves past it and no StreamGap covers it; a jump in the seq around it is still
 * one, from the last seq the client has (spec StreamGap: from_seq "the last seq the client saw
 * before the gap"). */
static void io_deliver(hub_sub *s, const char *session, const char *node, int64_t seq,
                       rpc_frame *f) {
    seen *sn = seen_get(&s->seen, session, 1);
    if (!sn) return;
    if (sn->seq && seq <= sn->seq) return; /* the snapshot (or the client, resuming) has it */
    /* a frame after the snapshot's last transcript event may follow token frames the
     * snapshot never holds: no gap then; a jump seen live (or after a resume) is one */
    if (sn->seq && !sn->in_set && seq > sn->seq + 1 && !s->gap) {
        s->gap = 1;
        s->gap_from = sn->skipped ? sn->had : sn->seq;
        snprintf(s->gap_node, sizeof s->gap_node, "%s", node);
    }
    if (!sn->skipped) sn->had = sn->seq;
    sn->skipped = f == NULL;
    sn->seq = seq;
    sn->in_set = 0;
    if (!f) return; /* a pending gap waits for the next frame sent */
    if (s->gap) {
        rpc_frame *g = gap_frame(s->gap_node, s->gap_from, seq);
        int rc = g ? push(s, g) : RPC_ENOMEM;
        rpc_frame_unref(g);
        if (rc != RPC_OK) return; /* still full: this frame is dropped too */
        s->gap = 0;
        metric_inc(s->h->m_gaps);
    }
    int rc = push(s, f);
    if (rc == RPC_OK) {
        s->last_seq = seq;
    } else if (rc == RPC_EFULL) {
        s->gap = 1;
        s->gap_from = s->last_seq;
        snprintf(s->gap_node, sizeof s->gap_node, "%s", node);
    }
}

static void on_io_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    hub_topic *t = ud;
    rpc_frame *full = NULL, *lean = NULL;
    int more = burst_more(t), fanned = 0;
    NodeIOEvent *ev = upsquad__internal__v1__node_ioevent__unpack(
        NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    if (!ev) {
        log_warn("hub.decode", "undecodable node I/O event on %s", natsMsg_GetSubject(m));
        batch_skip(t, more);
        return;
    }
    Upsquad__Workflow__V1__NodeIOFrame *fr = ev->frame;
    if (!fr) goto done; /* a transcript-only record: nothing live */
    IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
    r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_LIVE;
    r.live = fr;
    /* one frame per clearance class, encoded once; a class whose frame has no arm left (a
     * token frame below the floor) gets none, and its subscribers count the seq as seen */
    int send_full = redact_frame_sendable(fr);
    if (send_full && !(full = rpc_frame_encode(&r.base))) goto done;
    redact_saved keep;
    if (redact_frame(fr, &keep)) {
        int send_lean = redact_frame_sendable(fr);
        if (send_lean) lean = rpc_frame_encode(&r.base);
        redact_frame_restore(fr, &keep);
        if (send_lean && !lean) goto done;
    } else {
        lean = full ? rpc_frame_ref(full) : NULL;
    }
    pthread_mutex_lock(&t->mu);
    batch_begin(t, more);
    for (hub_sub *s = t->subs; s; s = s->next) {
        if (s->node[0] && strcmp(s->node, fr->node_id) != 0) continue;
        rpc_frame *f = redact_full(s->clearance) ? full : lean; /* NULL: seen, not sent */
        if (s->state == SS_SNAP)
            pending_add(s, f, NULL, fr->seq, fr->session_id, fr->node_id, 0, 0);
        else if (s->state == SS_LIVE)
            io_deliver(s, fr->session_id, fr->node_id, fr->seq, f);
    }
    batch_end(t); /* the subscribers this frame skipped included */
    pthread_mutex_unlock(&t->mu);
    fanned = 1;
done:
    if (!fanned) batch_skip(t, more);
    rpc_frame_unref(full);
    rpc_frame_unref(lean);
    upsquad__internal__v1__node_ioevent__free_unpacked(ev, NULL);
}

/* ---- visible runs ---- */

static int sub_sees(const hub_sub *s, const char *visibility, const char *team, const char *owner) {
    if (visibility && strcmp(visibility, "private") == 0)
        return owner && owner[0] && strcmp(owner, s->member) == 0;
    if (!team || !team[0]) return 0;
    for (size_t i = 0; i < s->n_teams; i++)
        if (strcmp(s->teams[i], team) == 0) return 1;
    return 0;
}

/* Entry into and exit from the subscriber's filtered set. */
static void vis_apply(hub_sub *s, const char *run_id, int64_t seq, int match, rpc_frame *f,
                      rpc_frame *leave) {
    seen *v = seen_get(&s->seen, run_id, 1);
    if (!v) return;
    if (seq <= v->seq) return;
    v->seq = seq;
    if (match < 0) match = v->in_set; /* no run status on this event: membership unchanged */
    rpc_frame *out = NULL;
    if (match) {
        out = f;
        v->in_set = 1;
    } else if (v->in_set) {
        out = leave;
        v->in_set = 0;
    }
    if (!out) return;
    if (push(s, out) == RPC_EFULL) {
        s->state = SS_RESYNC; /* dropped: re-snapshot the set once the client drains */
        metric_inc(s->h->m_gaps);
        wake(s->h);
    }
}

/* One event of an org topic's message; more: events wait behind this one. */
static void org_event(hub_topic *t, const uint8_t *data, size_t len, int more,
                      const char *subject) {
    rpc_frame *f = NULL, *leave = NULL;
    int fanned = 0;
    RunEvent *ev = upsquad__internal__v1__run_event__unpack(NULL, len, data);
    if (!ev || !ev->scope) {
        log_warn("hub.decode", "undecodable run event on %s", subject);
        goto done;
    }
    const Upsquad__Internal__V1__RunScope *sc = ev->scope;
    VisEvent v = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    v.run_id = sc->run_id;
    v.workflow_id = sc->workflow_id;
    v.workflow_name = sc->workflow_name;
    const char *status = "";
    if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_NODE && ev->node) {
        Upsquad__Internal__V1__NodeTransition *n = ev->node;
        status = n->run_status;
        v.needs_input = n->needs_input;
        v.needs_approval = n->needs_approval;
        v.prompt_kind = n->prompt_kind;
        v.prompt_id = n->prompt_id;
        v.asked_by_role = n->asked_by_role;
        v.is_waiting = n->is_waiting;
        if (n->update) v.last_action_status = n->update->status;
    } else if (ev->event_case == UPSQUAD__INTERNAL__V1__RUN_EVENT__EVENT_RUN && ev->run) {
        status = ev->run->status;
    } else {
        goto done;
    }
    v.status = (char *)status;
    f = rpc_frame_encode(&v.base);
    VisEvent l = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    l.run_id = sc->run_id;
    l.workflow_id = sc->workflow_id;
    l.workflow_name = sc->workflow_name;
    l.status = (char *)status;
    l.leaving = 1;
    leave = rpc_frame_encode(&l.base);
    if (!f || !leave) goto done;
    int bit = status[0] ? hub_status_bit(status) : 0;
    /* a deleted workflow's run leaves every set for good (spec DeleteWorkflow: its runs
     * "become UNDISCOVERABLE through the workflow") */
    int gone = sc->workflow_deleted;
    pthread_mutex_lock(&t->mu);
    seen *tr = seen_get(&t->runs, sc->run_id, 1);
    if (tr && ev->seq > tr->seq) tr->seq = ev->seq;
    batch_begin(t, more);
    for (hub_sub *s = t->subs; s; s = s->next) {
        if (!sub_sees(s, sc->visibility, sc->team_id, sc->owner_id)) continue;
        int match = gone ? 0 : status[0] ? (s->status_mask & bit) != 0 : -1;
        if (s->state == SS_SNAP)
            pending_add(s, f, leave, ev->seq, sc->run_id, "", match, 0);
        else if (s->state == SS_LIVE)
            vis_apply(s, sc->run_id, ev->seq, match, f, leave);
    }
    batch_end(t);
    pthread_mutex_unlock(&t->mu);
    fanned = 1;
done:
    if (!fanned) batch_skip(t, more);
    rpc_frame_unref(f);
    rpc_frame_unref(leave);
    if (ev) upsquad__internal__v1__run_event__free_unpacked(ev, NULL);
}

/* A message of one of the org's runs: its events in seq order (a batch's, or one bare
 * RunEvent); each subscriber's set de-duplicates by (run, seq) (vis_apply). */
static void on_org_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    hub_topic *t = ud;
    hub_evit it;
    const uint8_t *ev;
    size_t len;
    int more = burst_more(t), rc;
    hub_evit_init(&it, (const uint8_t *)natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m));
    while ((rc = hub_evit_next(&it, &ev, &len)) == 1)
        org_event(t, ev, len, more, natsMsg_GetSubject(m));
    if (rc < 0) log_warn("hub.decode", "malformed run event batch on %s", natsMsg_GetSubject(m));
}

/* ---- topics ---- */

static unsigned hash(const char *s) {
    unsigned h = 2166136261u;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 16777619u;
    return h % HUB_TOPIC_BUCKETS;
}

/* Finds or creates the topic and links s into it (state SNAP). hub->mu held. */
static int topic_join(hub *h, hub_sub *s, int kind, const char *org, const char *run) {
    char key[160], subj[200];
    snprintf(key, sizeof key, "%d:%s:%s", kind, org, run ? run : "");
    unsigned b = hash(key);
    hub_topic *t;
    for (t = h->topics[b]; t; t = t->next)
        if (strcmp(t->key, key) == 0) break;
    if (!t) {
        if (!bus_token_valid(org) || (run && !bus_token_valid(run))) return -1;
        t = calloc(1, sizeof *t);
        if (!t) return -1;
        t->h = h;
        t->kind = kind;
        snprintf(t->key, sizeof t->key, "%s", key);
        snprintf(t->org, sizeof t->org, "%.*s", (int)sizeof t->org - 1, org); /* a UUID */
        snprintf(t->run, sizeof t->run, "%s", run ? run : "");
        pthread_mutex_init(&t->mu, NULL);
        bus_msg_cb cb;
        if (kind == TK_RUN) {
            snprintf(subj, sizeof subj, "wf.*.%s.%s", org, run); /* status and log */
            cb = on_run_msg;
        } else if (kind == TK_IO) {
            snprintf(subj, sizeof subj, "wfio.%s.%s", org, run);
            cb = on_io_msg;
        } else {
            snprintf(subj, sizeof subj, "wf.status.%s.*", org);
            cb = on_org_msg;
        }
        char err[256];
        if (bus_subscribe(h->bus, subj, NULL, cb, t, &t->bsub, err, sizeof err) != BUS_OK) {
            log_warn("hub.subscribe", "%s: %s", subj, err);
            pthread_mutex_destroy(&t->mu);
            free(t);
            return -1;
        }
        t->next = h->topics[b];
        h->topics[b] = t;
        metric_inc(h->m_topics);
    }
    pthread_mutex_lock(&t->mu);
    s->t = t;
    s->state = SS_SNAP;
    s->next = t->subs;
    if (t->subs) t->subs->prev = s;
    t->subs = s;
    t->nsubs++;
    pthread_mutex_unlock(&t->mu);
    return 0;
}

static void sub_unref(hub_sub *s) {
    hub *h = s->h;
    pthread_mutex_lock(&h->mu);
    int last = --s->refs == 0;
    pthread_mutex_unlock(&h->mu);
    if (!last) return;
    pending_clear(s);
    seen_free(s->seen);
    free(s->teams);
    if (s->detached) rpc_call_unref(s->call);
    free(s);
}

/* Unlinks s from its topic and from the hub (once). */
static void sub_leave(hub_sub *s) {
    hub *h = s->h;
    hub_topic *t = s->t;
    int was_linked = 0;
    if (t) {
        pthread_mutex_lock(&t->mu);
        if (s->prev || t->subs == s) {
            if (s->prev)
                s->prev->next = s->next;
            else
                t->subs = s->next;
            if (s->next) s->next->prev = s->prev;
            s->next = s->prev = NULL;
            t->nsubs--;
            was_linked = 1;
        }
        s->state = SS_DONE;
        pending_clear(s);
        pthread_mutex_unlock(&t->mu);
    }
    pthread_mutex_lock(&h->mu);
    if (s->hprev || h->subs == s) {
        if (s->hprev)
            s->hprev->hnext = s->hnext;
        else
            h->subs = s->hnext;
        if (s->hnext) s->hnext->hprev = s->hprev;
        s->hnext = s->hprev = NULL;
        h->n_subs--;
        metric_add(h->m_subs[s->rpc], -1);
    }
    pthread_mutex_unlock(&h->mu);
    if (was_linked) wake(h); /* the topic may be idle now */
}

static void on_stream_close(rpc_call *call, void *ud) {
    (void)call;
    hub_sub *s = ud;
    sub_leave(s);
    sub_unref(s);
}

/* ---- snapshots ---- */

/* A client that stops reading during its snapshot is held to the stall limit too: past it the
 * stream ends RESOURCE_EXHAUSTED and the stream worker it held is free again (docs: stall
 * limit), rather than waiting for the client's deadline. */
static int snap_stalled(hub_sub *s, int rc) {
    if (rc == RPC_EFULL) {
        rpc_stream_abort(
            s->call, RPC_RESOURCE_EXHAUSTED,
            "subscriber too slow: it stopped reading its snapshot past the stall limit");
        metric_inc(s->h->m_stalled);
    }
    return rc == RPC_OK ? 0 : -1;
}

static int send_msg(hub_sub *s, const ProtobufCMessage *m) {
    return snap_stalled(s, rpc_stream_send_wait(s->call, m, s->h->cfg->stall_ms));
}

static int snapshot_run(hub_sub *s, int64_t *upto, int *terminal) {
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
        int src = snap_stalled(s, rpc_stream_push_wait(s->call, f, h->cfg->stall_ms));
        rpc_frame_unref(f);
        if (src != 0) {
            hs_blobs_free(&b);
            return -1;
        }
    }
    hs_blobs_free(&b);
    return 0;
}

/* A subscriber that comes after a user_prompt opened still gets its "answer needed" frame
 * (spec: NodeIOFrame.user_prompt, delivered at every clearance so the card can render): each
 * captured prompt frame whose prompt the node is still parked on goes out as a live frame
 * right after snapshot_done (the snapshot arm carries transcript events only), its
 * (session_id, seq) marked seen so the same frame held during the snapshot is not sent twice.
 * The frame is structural (no clearance floor applies). A store error costs only this replay:
 * logged, and the stream goes on (GetRunPrompt on the node's blocked_by has the prompt). */
static int snapshot_prompts(hub_sub *s) {
    hub *h = s->h;
    char err[256];
    hs_blobs pf = {0};
    int rc = 0;
    if (hs_prompt_frames(h->pool, s->t->org, s->t->run, s->node, (int)h->cfg->transcript_max, &pf,
                         err, sizeof err) != DB_OK) {
        log_warn("hub.snapshot", "open prompts of run %s: %s", s->t->run, err);
        return 0;
    }
    for (size_t i = 0; i < pf.n && rc == 0; i++) {
        Upsquad__Workflow__V1__NodeIOFrame *f =
            upsquad__workflow__v1__node_ioframe__unpack(NULL, pf.v[i].len, pf.v[i].body);
        if (f && f->user_prompt) {
            seen *sn = seen_get(&s->seen, f->session_id, 1);
            if (sn && f->seq > sn->seq) sn->seq = f->seq;
            if (sn) sn->in_set = 1;
            IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
            r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_LIVE;
            r.live = f;
            rc = send_msg(s, &r.base);
        }
        if (f) upsquad__workflow__v1__node_ioframe__free_unpacked(f, NULL);
    }
    hs_blobs_free(&pf);
    return rc;
}

static int snapshot_io(hub_sub *s) {
    hub *h = s->h;
    char err[256];
    hs_blobs b;
    if (hs_transcript(h->pool, s->t->org, s->t->run, s->node, (int)h->cfg->transcript_max, &b, err,
                      sizeof err) != DB_OK) {
        log_warn("hub.snapshot", "run %s: %s", s->t->run, err);
        return -1;
    }
    int rc = 0;
    for (size_t i = 0; i < b.n && rc == 0; i++) {
        Transcript *te =
            upsquad__workflow__v1__transcript_event__unpack(NULL, b.v[i].len, b.v[i].body);
        if (!te) continue;
        seen *sn = seen_get(&s->seen, te->session_id, 1);
        if (sn && te->seq > sn->seq) sn->seq = te->seq;
        if (sn) sn->in_set = 1; /* io: seeded by the snapshot (see io_deliver) */
        redact_transcript(te, s->clearance, NULL, NULL, NULL);
        IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
        r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_EVENT;
        r.snapshot_event = te;
        rc = send_msg(s, &r.base);
        upsquad__workflow__v1__transcript_event__free_unpacked(te, NULL);
    }
    hs_blobs_free(&b);
    if (rc) return -1;
    IOResp done = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
    done.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_DONE;
    done.snapshot_done = 1;
    if (send_msg(s, &done.base) != 0) return -1;
    return snapshot_prompts(s);
}

static void vis_row(VisEvent *v, const hs_run *r, int is_snapshot) {
    v->run_id = (char *)r->run_id;
    v->workflow_id = (char *)r->workflow_id;
    v->workflow_name = (char *)r->workflow_name;
    v->status = (char *)r->status;
    v->nodes_total = r->nodes_total;
    v->nodes_done = r->nodes_done;
    v->needs_input = r->needs_input;
    v->needs_approval = r->needs_approval;
    v->asked_by_role = (char *)r->asked_by_role;
    v->prompt_id = (char *)r->prompt_id;
    v->is_snapshot = is_snapshot;
    v->display_name = (char *)r->display_name;
    v->prompt_kind = r->prompt_kind;
    v->is_waiting = r->is_waiting;
    /* spec: open_prompt_count is populated on snapshot rows only, with explicit presence
     * (present-and-0 is authoritative); absent when the store could not determine it */
    if (is_snapshot && r->has_open_prompt_count) {
        v->_open_prompt_count_case =
            UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT___OPEN_PROMPT_COUNT_OPEN_PROMPT_COUNT;
        v->open_prompt_count = r->open_prompt_count;
    }
}

/* The visible set from the store. Initial (handler): snapshot rows, blocking sends, the
 * marker. Resync (maintenance, after an overflow): the same rows as live deltas plus a leaving
 * event for each run that left the set meanwhile, never blocking. */
static int snapshot_visible(hub_sub *s, int resync) {
    hub *h = s->h;
    char err[256];
    static const char *const names[] = {"pending",   "running", "paused",
                                        "completed", "failed",  "cancelled"};
    const char *st[6], *teams[AUTH_MAX_TEAMS];
    size_t nst = 0;
    for (int i = 0; i < 6; i++)
        if (s->status_mask & (1 << i)) st[nst++] = names[i];
    for (size_t i = 0; i < s->n_teams; i++)
        teams[i] = s->teams[i];
    hs_run *rows = NULL;
    size_t n = 0;
    if (hs_visible_runs(h->pool, s->t->org, s->member, teams, s->n_teams, st, nst,
                        (int)h->cfg->visible_max, &rows, &n, err, sizeof err) != DB_OK) {
        log_warn("hub.snapshot", "visible runs: %s", err);
        return -1;
    }
    int rc = 0;
    if (resync)
        for (seen *v = s->seen; v; v = v->next)
            v->in_set = 0 - v->in_set; /* -1: was in */
    for (size_t i = 0; i < n && rc == 0; i++) {
        VisEvent v = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
        vis_row(&v, &rows[i], !resync);
        seen *sn = seen_get(&s->seen, rows[i].run_id, 1);
        if (sn) {
            if (rows[i].last_seq > sn->seq) sn->seq = rows[i].last_seq;
            sn->in_set = 1;
        }
        if (!resync) {
            rc = send_msg(s, &v.base);
        } else {
            rpc_frame *f = rpc_frame_encode(&v.base);
            rc = f && push_unlocked(s, f) == RPC_OK ? 0 : -1;
            rpc_frame_unref(f);
        }
    }
    for (seen *v = s->seen; resync && v && rc == 0; v = v->next) {
        if (v->in_set != -1) continue;
        v->in_set = 0;
        VisEvent l = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
        l.run_id = v->key;
        l.leaving = 1;
        rpc_frame *f = rpc_frame_encode(&l.base);
        rc = f && push_unlocked(s, f) == RPC_OK ? 0 : -1;
        rpc_frame_unref(f);
    }
    for (seen *v = s->seen; v; v = v->next)
        if (v->in_set < 0) v->in_set = 1; /* not told yet: retried by the next resync */
    free(rows);
    if (rc || resync) return rc;
    VisEvent done = UPSQUAD__WORKFLOW__V1__VISIBLE_RUN_EVENT__INIT;
    done.snapshot_done = 1;
    return send_msg(s, &done.base);
}

/* Hands the frames held during the snapshot over and goes LIVE. topic->mu held. */
static void flush_pending(hub_sub *s) {
    s->state = SS_LIVE;
    if (s->pending_overflow && s->rpc == HUB_RPC_IO && !s->gap) {
        s->gap = 1;
        s->gap_from = s->last_seq;
    }
    for (size_t i = 0; i < s->n_pending && s->state == SS_LIVE; i++) {
        pend *p = &s->pending[i];
        if (s->rpc == HUB_RPC_IO)
            io_deliver(s, p->key, p->node, p->seq, p->f);
        else
            vis_apply(s, p->key, p->seq, p->match, p->f, p->f_leave);
    }
    if (s->pending_overflow && s->rpc == HUB_RPC_VISIBLE && s->state == SS_LIVE) {
        s->state = SS_RESYNC;
        wake(s->h);
    }
    pending_clear(s);
}

/* ---- the handler's part ---- */

int hub_serve(hub *h, rpc_call *call, const hub_sub_opts *o, int64_t snapshot_seq) {
    (void)snapshot_seq;
    hub_sub *s = calloc(1, sizeof *s);
    int kind = o->rpc == HUB_RPC_IO ? TK_IO : o->rpc == HUB_RPC_VISIBLE ? TK_ORG : TK_RUN;
    int rc = RPC_OK;
    if (!s) return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    s->h = h;
    s->refs = 1; /* the handler's; on_close takes it over after detaching */
    s->call = call;
    s->rpc = o->rpc;
    s->clearance = o->who->clearance;
    snprintf(s->member, sizeof s->member, "%s", o->who->sub);
    snprintf(s->node, sizeof s->node, "%s", o->node ? o->node : "");
    s->status_mask = o->status_mask;
    if (o->who->n_teams) s->teams = calloc(o->who->n_teams, sizeof *s->teams);
    if (o->who->n_teams && !s->teams) {
        free(s);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    s->n_teams = o->who->n_teams;
    for (size_t i = 0; i < s->n_teams; i++)
        snprintf(s->teams[i], sizeof s->teams[i], "%s", o->who->teams[i]);

    /* 1. subscribe first: nothing published from here on is lost */
    pthread_mutex_lock(&h->mu);
    int jrc = topic_join(h, s, kind, o->who->org_id, kind == TK_ORG ? NULL : o->run_id);
    if (jrc == 0) {
        s->hnext = h->subs;
        if (h->subs) h->subs->hprev = s;
        h->subs = s;
        h->n_subs++;
        metric_inc(h->m_subs[s->rpc]);
    }
    pthread_mutex_unlock(&h->mu);
    if (jrc != 0) {
        sub_unref(s);
        return rpc_error(call, RPC_UNAVAILABLE, "live subscription failed; retry");
    }
    bus_flush(h->bus, 2000);   /* the server has our subscription before the snapshot is read */
    if (rpc_cancelled(call)) { /* the client left meanwhile: no snapshot for nobody */
        rc = RPC_CANCELLED;
        goto leave;
    }

    /* 2. the snapshot (or the resume point), then 3. live */
    if (kind == TK_RUN) {
        int64_t upto = 0;
        int terminal = 0;
        if (o->resume) {
            upto = o->resume_seq;
        } else if (snapshot_run(s, &upto, &terminal) != 0) {
            rc = rpc_cancelled(call) ? RPC_CANCELLED
                                     : rpc_error(call, RPC_UNAVAILABLE, "snapshot failed; retry");
            goto leave;
        }
        if (terminal && s->rpc == HUB_RPC_STATUS) goto leave; /* ended: OK after the frames */
        s->last_seq = upto;
        pthread_mutex_lock(&s->t->mu);
        s->state = SS_REPAIR;
        pthread_mutex_unlock(&s->t->mu);
        catch_up(s);
        if (s->state == SS_DONE) goto leave;
    } else {
        int src;
        if (kind == TK_IO && o->resume) {
            seen *sn = seen_get(&s->seen, o->resume_session ? o->resume_session : "", 1);
            if (sn) sn->seq = o->resume_seq;
            IOResp done = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
            done.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_DONE;
            done.snapshot_done = 1;
            src = send_msg(s, &done.base);
        } else {
            src = kind == TK_IO ? snapshot_io(s) : snapshot_visible(s, 0);
        }
        if (src != 0) {
            rc = rpc_cancelled(call) ? RPC_CANCELLED
                                     : rpc_error(call, RPC_UNAVAILABLE, "snapshot failed; retry");
            goto leave;
        }
        pthread_mutex_lock(&s->t->mu);
        flush_pending(s);
        pthread_mutex_unlock(&s->t->mu);
    }
    pthread_mutex_lock(&h->mu);
    s->refs++; /* on_close's */
    pthread_mutex_unlock(&h->mu);
    if (rpc_stream_detach(call, on_stream_close, s) == NULL) {
        pthread_mutex_lock(&h->mu);
        s->refs--;
        pthread_mutex_unlock(&h->mu);
        goto leave; /* the client left (or the stream ended) meanwhile */
    }
    pthread_mutex_lock(&h->mu); /* read by the maintenance pass under hub->mu */
    s->detached = 1;
    pthread_mutex_unlock(&h->mu);
    sub_unref(s); /* the handler's reference */
    return RPC_EDETACHED;
leave:
    sub_leave(s);
    sub_unref(s);
    return rc;
}

/* ---- maintenance ---- */

/* 1 when the store has not yet caught up with every run event the topic has seen (the
 * re-snapshot would miss what was dropped); topic->mu held by nobody. */
static int store_behind(hub_sub *s) {
    size_t n = 0, i = 0;
    int behind = 1;
    char err[256];
    pthread_mutex_lock(&s->t->mu);
    for (seen *v = s->t->runs; v; v = v->next)
        n++;
    const char **ids = calloc(n ? n : 1, sizeof *ids);
    int64_t *seqs = calloc(n ? n : 1, sizeof *seqs);
    char(*keys)[64] = calloc(n ? n : 1, sizeof *keys);
    for (seen *v = s->t->runs; v && ids && seqs && keys; v = v->next, i++) {
        memcpy(keys[i], v->key, sizeof keys[i]);
        ids[i] = keys[i];
        seqs[i] = v->seq;
    }
    pthread_mutex_unlock(&s->t->mu);
    if (ids && seqs && keys &&
        hs_runs_behind(s->h->pool, s->t->org, ids, seqs, n, &behind, err, sizeof err) != DB_OK) {
        log_warn("hub.resync", "%s", err);
        behind = 1;
    }
    free(ids);
    free(seqs);
    free(keys);
    return behind != 0;
}

static void resync_visible(hub_sub *s) {
    pthread_mutex_lock(&s->t->mu);
    if (s->state != SS_RESYNC) {
        pthread_mutex_unlock(&s->t->mu);
        return;
    }
    s->state = SS_SNAP; /* from here on, live events are held */
    pending_clear(s);
    pthread_mutex_unlock(&s->t->mu);
    int rc = store_behind(s) ? 1 : snapshot_visible(s, 1);
    pthread_mutex_lock(&s->t->mu);
    if (s->state == SS_SNAP) {
        if (rc == 0) {
            flush_pending(s);
        } else {
            pending_clear(s); /* the store lags (or the client is full again): next tick */
            s->state = SS_RESYNC;
        }
    }
    pthread_mutex_unlock(&s->t->mu);
}

static void recheck(hub_sub *s) {
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

static size_t queue_cap(void) {
    const char *v = getenv("UPSQUAD_RPC_STREAM_QUEUE");
    long n = v ? strtol(v, NULL, 10) : 0;
    return n > 0 ? (size_t)n : 256;
}

/* Queue-depth gauges: every subscriber's queue, once a second (not on every pass: each read
 * takes the call's lock, which the completion-queue threads and the fan-out take per frame). */
static void sample_queues(hub *h) {
    double depth = 0, depth_max = 0;
    pthread_mutex_lock(&h->mu);
    for (hub_sub *s = h->subs; s; s = s->hnext) {
        if (!s->detached) continue;
        size_t q = rpc_stream_queued(s->call);
        depth += (double)q;
        if ((double)q > depth_max) depth_max = (double)q;
    }
    pthread_mutex_unlock(&h->mu);
    metric_set(h->m_queue, depth);
    metric_set(h->m_queue_max, depth_max);
}

/* 1 when the maintenance pass has work for s; topic->mu held. */
static int sub_due(const hub_sub *s, int64_t now) {
    return s->detached && (s->state == SS_REPAIR || s->state == SS_RESYNC || s->gap ||
                           s->stalled_since || (s->recheck_at > 0 && now >= s->recheck_at));
}

/* One pass over this replica's subscribers: topic by topic, each topic's lock taken once for
 * all its subscribers. (Taking it per subscriber, 1,000 times per pass on a busy run, had the
 * pass and the run's fan-out, which holds that lock for a whole frame's pushes, hand it back
 * and forth: a futex wake-up and often a context switch per subscriber.) */
static void maint_pass(hub *h) {
    size_t n = 0, cap = 0, qcap = queue_cap();
    hub_sub **work = NULL;
    int64_t now = util_mono_ms();
    pthread_mutex_lock(&h->mu);
    cap = h->n_subs;
    work = cap ? calloc(cap, sizeof *work) : NULL;
    for (int b = 0; b < HUB_TOPIC_BUCKETS && work; b++) {
        for (hub_topic *t = h->topics[b]; t; t = t->next) {
            pthread_mutex_lock(&t->mu); /* hub -> topic: the lock order */
            /* a burst whose end never came (its last messages left with the subscription):
             * its deferred frames are sent now rather than wait for the next message */
            if (t->batch && now - t->batch_since >= HUB_BATCH_MAX_MS) batch_kick(t);
            for (hub_sub *s = t->subs; s && n < cap; s = s->next) {
                if (!sub_due(s, now)) continue;
                s->refs++; /* under hub->mu */
                work[n++] = s;
            }
            pthread_mutex_unlock(&t->mu);
        }
    }
    pthread_mutex_unlock(&h->mu);
    for (size_t i = 0; i < n; i++) {
        hub_sub *s = work[i];
        size_t q = rpc_stream_queued(s->call);
        pthread_mutex_lock(&s->t->mu);
        int state = s->state,
            stall = s->stalled_since && q > qcap / 2 && now - s->stalled_since > h->cfg->stall_ms;
        int recheck_due = state == SS_LIVE && s->recheck_at > 0 && now >= s->recheck_at;
        if (stall) {
            s->state = SS_DONE;
        } else if (q <= qcap / 2 && s->gap && s->stalled_since) {
            s->stalled_since = 0; /* draining again: the gap goes out before the next frame */
        }
        pthread_mutex_unlock(&s->t->mu);
        if (stall) {
            /* it stopped reading: end it and return its memory (docs: stall limit) */
            rpc_stream_abort(s->call, RPC_RESOURCE_EXHAUSTED,
                             "subscriber too slow: its queue stayed full past the stall limit");
            metric_inc(h->m_stalled);
        } else if (q <= qcap / 2) {
            if (state == SS_REPAIR)
                catch_up(s);
            else if (state == SS_RESYNC)
                resync_visible(s);
            else if (recheck_due)
                recheck(s);
        }
        sub_unref(s);
    }
    free(work);
}

/* Unsubscribes topics nobody reads any more. */
static void close_idle_topics(hub *h) {
    hub_topic *dead = NULL;
    pthread_mutex_lock(&h->mu);
    for (int b = 0; b < HUB_TOPIC_BUCKETS; b++) {
        hub_topic **pp = &h->topics[b];
        while (*pp) {
            hub_topic *t = *pp;
            pthread_mutex_lock(&t->mu);
            int idle = t->nsubs == 0;
            pthread_mutex_unlock(&t->mu);
            if (idle) {
                *pp = t->next;
                t->next = dead;
                dead = t;
                metric_add(h->m_topics, -1);
            } else {
                pp = &t->next;
            }
        }
    }
    pthread_mutex_unlock(&h->mu);
    while (dead) {
        hub_topic *t = dead;
        dead = t->next;
        bus_unsubscribe(t->bsub); /* waits for a running callback */
        seen_free(t->runs);
        pthread_mutex_destroy(&t->mu);
        free(t);
    }
}

void *hub_maint_main(void *arg) {
    hub *h = arg;
    int64_t last_close = 0, last_sample = 0;
    while (!h->stopping) {
        pthread_mutex_lock(&wake_mu);
        if (!h->wake) {
            struct timespec ts;
            util_deadline(&ts, 50);
            pthread_cond_timedwait(&h->cv, &wake_mu, &ts);
        }
        h->wake = 0;
        pthread_mutex_unlock(&wake_mu);
        if (h->stopping) break;
        maint_pass(h);
        int64_t now = util_mono_ms();
        if (now - last_sample >= 1000) {
            sample_queues(h);
            last_sample = now;
        }
        if (now - last_close >= 200) {
            close_idle_topics(h);
            last_close = now;
        }
    }
    return NULL;
}

void hub_fanout_init(hub *h) {
    static const char *const rpcs[] = {"StreamRunStatus", "StreamRunLogs", "StreamNodeIO",
                                       "StreamVisibleRuns"};
    char labels[64];
    for (int i = 0; i < 4; i++) {
        snprintf(labels, sizeof labels, "rpc=\"%s\"", rpcs[i]);
        h->m_subs[i] =
            metrics_gauge("stream_hub_subscribers", "live subscribers on this replica", labels);
    }
    h->m_topics = metrics_gauge("stream_hub_topics",
                                "shared NATS subscriptions (runs, orgs) on this replica", NULL);
    h->m_queue = metrics_gauge("stream_hub_queue_depth",
                               "frames queued to subscribers, summed (sampled)", NULL);
    h->m_queue_max =
        metrics_gauge("stream_hub_queue_depth_max", "deepest subscriber queue (sampled)", NULL);
    h->m_gaps = metrics_counter("stream_hub_gaps_total",
                                "StreamGaps sent and visible-run re-snapshots after drops", NULL);
    h->m_drops =
        metrics_counter("stream_hub_dropped_frames_total",
                        "frames not queued live because a subscriber's queue was full", NULL);
    h->m_stalled = metrics_counter("stream_hub_stalled_total",
                                   "subscribers ended RESOURCE_EXHAUSTED by the stall limit", NULL);
    h->m_delivered =
        metrics_counter("stream_hub_frames_total", "frames queued to subscribers", NULL);
    h->m_deferred = metrics_counter("stream_hub_fanout_deferred_total",
                                    "messages whose frames were queued to wait for the end of "
                                    "their burst (their sends started together)",
                                    NULL);
    /* a burst's deferred frames take room in every subscriber's queue: a quarter at most */
    h->fanout_batch = (int)h->cfg->fanout_batch;
    if ((size_t)h->fanout_batch > queue_cap() / 4) h->fanout_batch = (int)(queue_cap() / 4);
    if (h->fanout_batch < 1) h->fanout_batch = 1;
    h->m_repairs = metrics_counter("stream_hub_repairs_total",
                                   "run subscribers fed from the store after a hole or a full "
                                   "queue",
                                   NULL);
}

void hub_fanout_fini(hub *h) {
    close_idle_topics(h);
}
