/* The fan-out of node I/O (fanout_int.h; the rules at the top of fanout.c): live frames per
 * clearance class, de-duplicated against the snapshot by (session, seq), StreamGaps for what
 * is missing, and the transcript snapshot with the open prompts. */
#include "fanout_int.h"

#include <stdio.h>
#include <string.h>

#include "log.h"
#include "redact.h"

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

/* ---- node I/O ---- */

/* A frame dropped into a pending gap is kept, the newest only: when no frame follows (the
 * node's last, e.g. its final status), the maintenance pass sends the gap and this frame
 * once the queue has room (fanout__io_gap_tail), rather than leave the subscriber without
 * the gap and the end of the node's output until a frame that may never come. A gap whose
 * only refused frame is the kept one loses nothing: that frame goes late, and no StreamGap
 * (spec: frames "were dropped") before it. The frame it replaces is lost (gap_lost). */
static void keep_tail(hub_sub *s, rpc_frame *f, int64_t seq) {
    if (s->gap_tail) s->gap_lost = 1;
    rpc_frame_unref(s->gap_tail);
    s->gap_tail = rpc_frame_ref(f);
    s->gap_tail_seq = seq;
}

/* The gap is closed: sent, or not needed. */
static void gap_closed(hub_sub *s) {
    rpc_frame_unref(s->gap_tail);
    s->gap_tail = NULL;
    s->gap = s->gap_lost = 0;
}

/* Queues the pending StreamGap, to_seq `to` (the frame that follows it); counted when queued. */
static int push_gap(hub_sub *s, int64_t to) {
    rpc_frame *g = gap_frame(s->gap_node, s->gap_from, to);
    int rc = g ? fanout__push(s, g) : RPC_ENOMEM;
    rpc_frame_unref(g);
    if (rc == RPC_OK) metric_inc(s->h->m_gaps);
    return rc;
}

/* Sends the kept frame, after a StreamGap up to it when another frame was lost (then `need`
 * counts the gap's slot too); topic->mu held, s the stream's one producer, so the room checked
 * here only grows until the pushes. 1 sent (the gap closed), 0 not (no room: nothing sent). */
static int send_tail(hub_sub *s, size_t room_after) {
    size_t need = (s->gap_lost ? 2 : 1) + room_after;
    if (rpc_stream_room(s->call) < need) return 0;
    if (s->gap_lost && push_gap(s, s->gap_tail_seq) != RPC_OK) return 0;
    if (fanout__push(s, s->gap_tail) == RPC_OK) s->last_seq = s->gap_tail_seq;
    gap_closed(s);
    return 1;
}

/* Delivers one live frame to a LIVE subscriber: de-duplicated against the snapshot (by
 * session_id, seq), and preceded by a StreamGap when frames are missing before it, whether the
 * publisher skipped them (a jump in the session's seq) or this subscriber's full queue
 * dropped them. f NULL: a frame this subscriber's clearance class is not sent (nothing
 * structural is left in it, redact_frame_sendable). It counts as seen, not as lost: the
 * session's seq moves past it and no StreamGap covers it; a jump in the seq around it is still
 * one, from the last seq the client has (spec StreamGap: from_seq "the last seq the client saw
 * before the gap"). */
void fanout__io_deliver(hub_sub *s, const char *session, const char *node, int64_t seq,
                        rpc_frame *f) {
    seen *sn = fanout__seen_get(&s->seen, session, 1);
    if (!sn) return;
    if (sn->seq && seq <= sn->seq) return; /* the snapshot (or the client, resuming) has it */
    /* a frame after the snapshot's last transcript event may follow token frames the
     * snapshot never holds: no gap then; a jump seen live (or after a resume) is one */
    if (sn->seq && !sn->in_set && seq > sn->seq + 1) {
        if (!s->gap) {
            s->gap = 1;
            s->gap_from = sn->skipped ? sn->had : sn->seq;
            snprintf(s->gap_node, sizeof s->gap_node, "%s", node);
        }
        s->gap_lost = 1;
    }
    if (!sn->skipped) sn->had = sn->seq;
    sn->skipped = f == NULL;
    sn->seq = seq;
    sn->in_set = 0;
    if (!f) return; /* a pending gap waits for the next frame sent */
    if (s->gap && s->gap_tail && !s->gap_lost) {
        /* only the kept frame was refused: it goes first, with room for this one after it;
         * else this one is kept instead, and the one before is lost (keep_tail) */
        if (!send_tail(s, 1)) {
            keep_tail(s, f, seq);
            fanout__push_dropped(s);
            return;
        }
    }
    if (s->gap) {
        /* spec StreamGap.to_seq "is the first seq that will be delivered after the gap": the
         * gap goes only with room for the frame it names too (this is the stream's one
         * producer, under topic->mu, and room only grows meanwhile); else both wait, this
         * frame dropped into the gap */
        if (rpc_stream_room(s->call) < 2) {
            keep_tail(s, f, seq);
            fanout__push_dropped(s);
            return;
        }
        if (push_gap(s, seq) != RPC_OK) { /* still full: this frame is dropped too */
            keep_tail(s, f, seq);
            return;
        }
        gap_closed(s); /* the gap covers the kept frame */
    }
    int rc = fanout__push(s, f);
    if (rc == RPC_OK) {
        s->last_seq = seq;
    } else if (rc == RPC_EFULL) {
        s->gap = 1; /* gap_lost only once another frame is lost too */
        s->gap_from = s->last_seq;
        snprintf(s->gap_node, sizeof s->gap_node, "%s", node);
        keep_tail(s, f, seq);
    }
}

void fanout__io_gap_tail(hub_sub *s) {
    if (s->gap && s->gap_tail && s->state == SS_LIVE) send_tail(s, 0);
}

/* Holds a live frame while the snapshot is sent (topic->mu held). A run of consecutive frames
 * this subscriber is not sent (f NULL: tokens below its clearance floor) takes one entry: a
 * token flood during a slow snapshot would otherwise fill UPSQUAD_HUB_PENDING_MAX with frames
 * that carry nothing for it, and the frames refused after that end in a StreamGap. Such an
 * entry may take one slot past the bound, so a full hold ends in a StreamGap only when a
 * frame this subscriber is sent was refused, never over token frames alone. */
static void io_hold(hub_sub *s, rpc_frame *f, int64_t seq, const char *session, const char *node) {
    if (!f && s->n_pending) {
        pend *p = &s->pending[s->n_pending - 1];
        int64_t end = p->seq_to ? p->seq_to : p->seq;
        if (!p->f && seq == end + 1 && strcmp(p->key, session) == 0 && strcmp(p->node, node) == 0) {
            p->seq_to = seq;
            return;
        }
    }
    fanout__pending_add(s, f, NULL, seq, session, node, 0, f == NULL);
}

void fanout__on_io_msg(bus *b, natsMsg *m, void *ud) {
    (void)b;
    hub_topic *t = ud;
    rpc_frame *full = NULL, *lean = NULL;
    int more = fanout__burst_more(t), fanned = 0;
    NodeIOEvent *ev = upsquad__internal__v1__node_ioevent__unpack(
        NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    if (!ev) {
        log_warn("hub.decode", "undecodable node I/O event on %s", natsMsg_GetSubject(m));
        fanout__batch_skip(t, more);
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
    fanout__batch_begin(t, more);
    for (hub_sub *s = t->subs; s; s = s->next) {
        if (s->node[0] && strcmp(s->node, fr->node_id) != 0) continue;
        rpc_frame *f = redact_full(s->clearance) ? full : lean; /* NULL: seen, not sent */
        if (s->state == SS_SNAP)
            io_hold(s, f, fr->seq, fr->session_id, fr->node_id);
        else if (s->state == SS_LIVE)
            fanout__io_deliver(s, fr->session_id, fr->node_id, fr->seq, f);
    }
    fanout__batch_end(t); /* the subscribers this frame skipped included */
    pthread_mutex_unlock(&t->mu);
    fanned = 1;
done:
    if (!fanned) fanout__batch_skip(t, more);
    rpc_frame_unref(full);
    rpc_frame_unref(lean);
    upsquad__internal__v1__node_ioevent__free_unpacked(ev, NULL);
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
            seen *sn = fanout__seen_get(&s->seen, f->session_id, 1);
            if (sn && f->seq > sn->seq) sn->seq = f->seq;
            if (sn) sn->in_set = 1;
            IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
            r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_LIVE;
            r.live = f;
            rc = fanout__send_msg(s, &r.base);
        }
        if (f) upsquad__workflow__v1__node_ioframe__free_unpacked(f, NULL);
    }
    hs_blobs_free(&pf);
    return rc;
}

int fanout__snapshot_io(hub_sub *s) {
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
        seen *sn = fanout__seen_get(&s->seen, te->session_id, 1);
        if (sn && te->seq > sn->seq) sn->seq = te->seq;
        if (sn) sn->in_set = 1; /* io: seeded by the snapshot (see fanout__io_deliver) */
        redact_transcript(te, s->clearance, NULL, NULL, NULL);
        IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
        r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_EVENT;
        r.snapshot_event = te;
        rc = fanout__send_msg(s, &r.base);
        upsquad__workflow__v1__transcript_event__free_unpacked(te, NULL);
    }
    hs_blobs_free(&b);
    if (rc) return -1;
    IOResp done = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
    done.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_DONE;
    done.snapshot_done = 1;
    if (fanout__send_msg(s, &done.base) != 0) return -1;
    return snapshot_prompts(s);
}
