/* The fan-out's internals (hub.h "fan-out"), shared by fanout.c (topics, subscribers, pushing
 * and bursts, the handler's part, maintenance) and the stream kinds: fanout_run.c (run status
 * and logs), fanout_io.c (node I/O) and fanout_visible.c (visible runs). The ordering and
 * de-duplication rules of each kind and the lock order are at the top of fanout.c. */
#ifndef UPSQUAD_HUB_FANOUT_INT_H
#define UPSQUAD_HUB_FANOUT_INT_H

#include <stdint.h>

#include "hub.h"
#include "store.h"
#include "upsquad/internal/v1/node_io.pb-c.h"
#include "upsquad/internal/v1/run_events.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

typedef Upsquad__Internal__V1__RunEvent RunEvent;
typedef Upsquad__Internal__V1__NodeIOEvent NodeIOEvent;
typedef Upsquad__Workflow__V1__StreamRunStatusResponse StatusResp;
typedef Upsquad__Workflow__V1__StreamRunLogsResponse LogsResp;
typedef Upsquad__Workflow__V1__StreamNodeIOResponse IOResp;
typedef Upsquad__Workflow__V1__VisibleRunEvent VisEvent;
typedef Upsquad__Workflow__V1__StreamGap Gap;
typedef Upsquad__Workflow__V1__TranscriptEvent Transcript;

enum { TK_RUN = 0, TK_IO = 1, TK_ORG = 2 };
enum { SS_SNAP = 0, SS_REPAIR, SS_LIVE, SS_RESYNC, SS_DONE };

/* (key, seq) list: sessions (node I/O) or runs (visible runs). */
typedef struct seen {
    struct seen *next;
    char key[64];
    int64_t seq;
    int in_set;  /* visible: the run is in the subscriber's filtered set; io: seeded by the
                    snapshot, no gap before the session's next frame */
    int skipped; /* io: seq is a frame not sent to this subscriber (fanout__io_deliver) */
    int64_t had; /* io, while skipped: the session's last seq the client has */
} seen;

typedef struct pend {
    /* io: f NULL = a frame not sent to this subscriber (fanout__io_deliver) */
    rpc_frame *f, *f_leave;
    int64_t seq;
    int64_t seq_to; /* io, f NULL: the run of such frames goes on to here (0: this one only) */
    char key[64];
    char node[64];
    int match; /* visible: 1 in filter, 0 not, -1 unknown */
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
    int gap_lost; /* io: a frame the gap covers is lost (not only gap_tail, which still goes) */
    int64_t gap_from;
    char gap_node[64];
    rpc_frame *gap_tail;   /* io: the newest frame dropped into a pending gap (fanout_io.c) */
    int64_t gap_tail_seq;  /* its seq */
    int64_t stalled_since; /* ms; 0 = not stalled */
    int64_t recheck_at;    /* ms; run: look at the store once more after going live */
    int64_t hole_until;    /* ms; run: a hole below a stored seq is waited for until then */
    int64_t hole_next, hole_step; /* ms; run: the next look for the hole's filling */
    seen *seen;
    pend *pending;
    size_t n_pending, cap_pending;
    int pending_overflow;
};

/* ---- fanout.c ---- */

/* Wakes the maintenance thread (a subscriber needs the store, a topic may be idle). */
void fanout__wake(hub *h);
seen *fanout__seen_get(seen **head, const char *key, int create);
/* Drops the held frames and their memory (a live subscriber holds none). */
void fanout__pending_clear(hub_sub *s);
/* Holds a frame for a subscriber still sending its snapshot; beyond pending_max (+ slack, the
 * slots this frame may take past it) the overflow is remembered as a gap (node I/O) or a
 * re-snapshot (visible runs), and nothing more is held. */
void fanout__pending_add(hub_sub *s, rpc_frame *f, rpc_frame *f_leave, int64_t seq, const char *key,
                         const char *node, int match, int slack);
/* One frame to one subscriber; topic->mu held. Inside a burst the send waits for the burst's
 * end (fanout__batch_end). */
int fanout__push(hub_sub *s, rpc_frame *f);
/* A frame dropped without a push for want of room, counted as a full queue's (stall timer
 * included); topic->mu held. */
void fanout__push_dropped(hub_sub *s);
/* The same from the maintenance thread feeding a subscriber from the store, without topic->mu:
 * the state the outcome may set is written under it (found by the churn test under TSan). */
int fanout__push_unlocked(hub_sub *s, rpc_frame *f);
/* Whether messages wait behind this one on the topic's subscription (the burst goes on),
 * lingering a little while the topic's messages come back to back (see its definition). */
int fanout__burst_more(hub_topic *t);
/* Before a message's pushes; topic->mu held. more: messages wait behind this one. */
void fanout__batch_begin(hub_topic *t, int more);
/* After them: the burst goes on, or ends here and its sends start; topic->mu held. */
void fanout__batch_end(hub_topic *t);
/* A message that fanned nothing out: it still ends the burst when it is the last one. */
void fanout__batch_skip(hub_topic *t, int more);
/* A client that stops reading during its snapshot is held to the stall limit too: past it the
 * stream ends RESOURCE_EXHAUSTED and the stream worker it held is free again (docs: stall
 * limit), rather than waiting for the client's deadline. */
int fanout__snap_stalled(hub_sub *s, int rc);
/* Sends one snapshot message, waiting up to the stall limit: 0 sent, -1 not. */
int fanout__send_msg(hub_sub *s, const ProtobufCMessage *m);
/* Hands the frames held during the snapshot over and goes LIVE. topic->mu held. */
void fanout__flush_pending(hub_sub *s);

/* ---- fanout_run.c: run status and logs ---- */

/* A message of the run: its events in seq order (a batch's, or one bare RunEvent), decoded
 * first, then delivered under one hold of topic->mu as one step of the burst (the shape of a
 * bare event's message), each de-duplicated and checked for holes per subscriber by its own
 * seq (run_deliver). */
void fanout__on_run_msg(bus *b, natsMsg *m, void *ud);
/* The run's snapshot (the node fold, or the log tail) sent to s; *upto the last seq it
 * covers, *terminal when it covers the run's end. 0 sent, -1 not. */
int fanout__snapshot_run(hub_sub *s, int64_t *upto, int *terminal);
/* Feeds a REPAIR subscriber from the store; LIVE once it has caught up with the topic.
 * Runs on the handler's thread first, then on the maintenance thread; never blocks on the
 * client (a full queue leaves it in REPAIR for the next tick). */
void fanout__catch_up(hub_sub *s);
/* A LIVE subscriber's one look at the store after going live: back to REPAIR when an event
 * published before it subscribed is there. */
void fanout__recheck(hub_sub *s);

/* ---- fanout_io.c: node I/O ---- */

void fanout__on_io_msg(bus *b, natsMsg *m, void *ud);
/* Delivers one live frame (f NULL: one not sent at s's clearance) to a LIVE subscriber,
 * de-duplicated by (session, seq), a StreamGap first when frames are missing (see its
 * definition); topic->mu held. */
void fanout__io_deliver(hub_sub *s, const char *session, const char *node, int64_t seq,
                        rpc_frame *f);
/* The run's transcript (at s's clearance), snapshot_done, then the open prompts' frames.
 * 0 sent, -1 not. */
int fanout__snapshot_io(hub_sub *s);
/* A pending StreamGap whose next frame has not come: once s's queue has room, the newest frame
 * dropped into it, after the gap when another frame was lost too; topic->mu held. */
void fanout__io_gap_tail(hub_sub *s);

/* ---- fanout_visible.c: visible runs ---- */

/* A message of one of the org's runs: its events in seq order (a batch's, or one bare
 * RunEvent); each subscriber's set de-duplicates by (run, seq) (fanout__vis_apply). */
void fanout__on_org_msg(bus *b, natsMsg *m, void *ud);
/* Entry into and exit from the subscriber's filtered set. */
void fanout__vis_apply(hub_sub *s, const char *run_id, int64_t seq, int match, rpc_frame *f,
                       rpc_frame *leave);
/* The visible set from the store. Initial (handler): snapshot rows, blocking sends, the
 * marker. Resync (maintenance, after an overflow): the same rows as live deltas plus a leaving
 * event for each run that left the set meanwhile, never blocking. */
int fanout__snapshot_visible(hub_sub *s, int resync);
/* A subscriber in RESYNC re-snapshotted once the store has caught up with the topic (else left
 * for the next pass). */
void fanout__resync_visible(hub_sub *s);

#endif
