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
 * rpc_stream_push takes the call's own lock inside. wake_mu is a leaf.
 *
 * Here: topics and subscribers, pushing and bursts, the handler's part, maintenance. Each
 * stream kind's delivery, snapshot and repair: fanout_run.c, fanout_io.c, fanout_visible.c
 * (fanout_int.h). */
#include "fanout_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "pbjson.h"
#include "util.h"

/* The longest a burst's deferred frames wait when its end never comes (maintenance pass). */
#define HUB_BATCH_MAX_MS 100

static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;

void fanout__wake(hub *h) {
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

seen *fanout__seen_get(seen **head, const char *key, int create) {
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

void fanout__pending_clear(hub_sub *s) {
    for (size_t i = 0; i < s->n_pending; i++) {
        rpc_frame_unref(s->pending[i].f);
        rpc_frame_unref(s->pending[i].f_leave);
    }
    free(s->pending);
    s->pending = NULL;
    s->n_pending = s->cap_pending = 0;
    s->pending_overflow = 0;
}

void fanout__pending_add(hub_sub *s, rpc_frame *f, rpc_frame *f_leave, int64_t seq, const char *key,
                         const char *node, int match, int slack) {
    size_t max = (size_t)s->h->cfg->pending_max + (size_t)slack;
    if (s->pending_overflow || s->n_pending >= max) {
        s->pending_overflow = 1;
        metric_inc(s->h->m_drops);
        return;
    }
    if (s->n_pending == s->cap_pending) { /* grows while a snapshot is sent, freed after */
        size_t cap = s->cap_pending ? s->cap_pending * 2 : 16;
        if (cap > max) cap = max;
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
    p->seq_to = 0;
    snprintf(p->key, sizeof p->key, "%s", key ? key : "");
    snprintf(p->node, sizeof p->node, "%s", node ? node : "");
    p->match = match;
}

/* ---- pushing ---- */

static void stalled(hub_sub *s) {
    if (!s->stalled_since) s->stalled_since = util_mono_ms();
}

/* The outcome of one fanout__push, counted; topic->mu held (it guards the subscriber's state). */
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

int fanout__push(hub_sub *s, rpc_frame *f) {
    return pushed(s,
                  s->t->defer ? rpc_stream_push_deferred(s->call, f) : rpc_stream_push(s->call, f));
}

void fanout__push_dropped(hub_sub *s) {
    pushed(s, RPC_EFULL);
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
int fanout__burst_more(hub_topic *t) {
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

void fanout__batch_begin(hub_topic *t, int more) {
    t->defer = more && t->batch + 1 < t->h->fanout_batch;
}

void fanout__batch_end(hub_topic *t) {
    if (t->defer) {
        t->defer = 0;
        if (t->batch++ == 0) t->batch_since = util_mono_ms();
        metric_inc(t->h->m_deferred);
    } else if (t->batch) {
        batch_kick(t);
    }
}

void fanout__batch_skip(hub_topic *t, int more) {
    if (more) return;
    pthread_mutex_lock(&t->mu);
    if (t->batch) batch_kick(t);
    pthread_mutex_unlock(&t->mu);
}

int fanout__push_unlocked(hub_sub *s, rpc_frame *f) {
    int rc = rpc_stream_push(s->call, f);
    pthread_mutex_lock(&s->t->mu);
    pushed(s, rc);
    pthread_mutex_unlock(&s->t->mu);
    return rc;
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
            cb = fanout__on_run_msg;
        } else if (kind == TK_IO) {
            snprintf(subj, sizeof subj, "wfio.%s.%s", org, run);
            cb = fanout__on_io_msg;
        } else {
            snprintf(subj, sizeof subj, "wf.status.%s.*", org);
            cb = fanout__on_org_msg;
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
    fanout__pending_clear(s);
    rpc_frame_unref(s->gap_tail);
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
        fanout__pending_clear(s);
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
    if (was_linked) fanout__wake(h); /* the topic may be idle now */
}

static void on_stream_close(rpc_call *call, void *ud) {
    (void)call;
    hub_sub *s = ud;
    sub_leave(s);
    sub_unref(s);
}

/* ---- snapshots ---- */

int fanout__snap_stalled(hub_sub *s, int rc) {
    if (rc == RPC_EFULL) {
        rpc_stream_abort(
            s->call, RPC_RESOURCE_EXHAUSTED,
            "subscriber too slow: it stopped reading its snapshot past the stall limit");
        metric_inc(s->h->m_stalled);
    }
    return rc == RPC_OK ? 0 : -1;
}

int fanout__send_msg(hub_sub *s, const ProtobufCMessage *m) {
    return fanout__snap_stalled(s, rpc_stream_send_wait(s->call, m, s->h->cfg->stall_ms));
}

void fanout__flush_pending(hub_sub *s) {
    s->state = SS_LIVE;
    for (size_t i = 0; i < s->n_pending && s->state == SS_LIVE; i++) {
        pend *p = &s->pending[i];
        if (s->rpc != HUB_RPC_IO) {
            fanout__vis_apply(s, p->key, p->seq, p->match, p->f, p->f_leave);
            continue;
        }
        fanout__io_deliver(s, p->key, p->node, p->seq, p->f);
        for (int64_t q = p->seq + 1; q <= p->seq_to && s->state == SS_LIVE; q++)
            fanout__io_deliver(s, p->key, p->node, q, NULL);
    }
    /* node I/O: the frames refused for want of room came after every held one, so the
     * StreamGap goes before the next frame delivered (spec to_seq: "the first seq that will be
     * delivered after the gap"), not before the first held one */
    if (s->pending_overflow && s->rpc == HUB_RPC_IO && s->state == SS_LIVE) {
        if (!s->gap) {
            s->gap = 1;
            s->gap_from = s->last_seq;
            snprintf(s->gap_node, sizeof s->gap_node, "%.63s",
                     s->n_pending ? s->pending[s->n_pending - 1].node : s->node);
        }
        s->gap_lost = 1;
    }
    if (s->pending_overflow && s->rpc == HUB_RPC_VISIBLE && s->state == SS_LIVE) {
        s->state = SS_RESYNC;
        fanout__wake(s->h);
    }
    fanout__pending_clear(s);
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
        } else if (fanout__snapshot_run(s, &upto, &terminal) != 0) {
            rc = rpc_cancelled(call) ? RPC_CANCELLED
                                     : rpc_error(call, RPC_UNAVAILABLE, "snapshot failed; retry");
            goto leave;
        }
        if (terminal && s->rpc == HUB_RPC_STATUS) goto leave; /* ended: OK after the frames */
        s->last_seq = upto;
        pthread_mutex_lock(&s->t->mu);
        s->state = SS_REPAIR;
        pthread_mutex_unlock(&s->t->mu);
        fanout__catch_up(s);
        if (s->state == SS_DONE) goto leave;
    } else {
        int src;
        if (kind == TK_IO && o->resume) {
            seen *sn = fanout__seen_get(&s->seen, o->resume_session ? o->resume_session : "", 1);
            if (sn) sn->seq = o->resume_seq;
            IOResp done = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
            done.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_DONE;
            done.snapshot_done = 1;
            src = fanout__send_msg(s, &done.base);
        } else {
            src = kind == TK_IO ? fanout__snapshot_io(s) : fanout__snapshot_visible(s, 0);
        }
        if (src != 0) {
            rc = rpc_cancelled(call) ? RPC_CANCELLED
                                     : rpc_error(call, RPC_UNAVAILABLE, "snapshot failed; retry");
            goto leave;
        }
        pthread_mutex_lock(&s->t->mu);
        fanout__flush_pending(s);
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
        } else if (q <= qcap / 2 && s->gap) {
            s->stalled_since = 0; /* draining again: the gap goes out before the next frame */
            if (s->rpc == HUB_RPC_IO) fanout__io_gap_tail(s); /* or now, if none came */
        }
        pthread_mutex_unlock(&s->t->mu);
        if (stall) {
            /* it stopped reading: end it and return its memory (docs: stall limit) */
            rpc_stream_abort(s->call, RPC_RESOURCE_EXHAUSTED,
                             "subscriber too slow: its queue stayed full past the stall limit");
            metric_inc(h->m_stalled);
        } else if (q <= qcap / 2) {
            if (state == SS_REPAIR)
                fanout__catch_up(s);
            else if (state == SS_RESYNC)
                fanout__resync_visible(s);
            else if (recheck_due)
                fanout__recheck(s);
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
