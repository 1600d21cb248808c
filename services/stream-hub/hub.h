/* stream-hub's moving parts: configuration, the projection (durable JetStream consumers into
 * the stream_hub schema) and the live fan-out (one shared NATS subscription per run, or per
 * org for visible runs, per replica, with bounded per-subscriber queues).
 *
 * Threads
 *   - two projector threads fetch from the durable pull consumers (run events, node I/O) and
 *     write the store; replicas bind the same durables and share the work; writes are
 *     idempotent by sequence;
 *   - nats.c's global delivery pool (UPSQUAD_HUB_DELIVERY_THREADS) runs the topics'
 *     callbacks: decode once, encode once per variant, push the same bytes to every
 *     subscriber without blocking;
 *   - one maintenance thread repairs lagging subscribers from the store, re-snapshots visible
 *     runs after an overflow, ends stalled subscribers, closes idle topics and samples the
 *     queue metrics;
 *   - the RPC stream workers run the handlers: subscribe, snapshot, then detach. */
#ifndef UPSQUAD_HUB_H
#define UPSQUAD_HUB_H

#include <stdatomic.h>
#include <pthread.h>
#include <stdint.h>

#include "bus.h"
#include "cfg.h"
#include "db.h"
#include "metrics.h"
#include "rpc.h"

#define HUB_SCHEMA "stream_hub"
/* Request metadata key of a reconnecting client: the last sequence it saw (docs). */
#define HUB_RESUME_KEY "x-upsquad-resume-seq"
#define HUB_TOPIC_BUCKETS 1024

/* How long a message the projection fetched stays with the replica that fetched it before
 * JetStream hands it to another (a replica that died holding it): the bound a hole in a run's
 * stored seqs may last without an event being lost (UPSQUAD_HUB_HOLE_WAIT is above it). */
#define HUB_PROJECTION_ACK_WAIT_MS 30000

typedef struct hub_config {
    char *pg_dsn;
    long long pg_pool_size;
    char *nats_url;
    char *migrations_dir;
    char *pg_migrate_dsn; /* UPSQUAD_PG_MIGRATE_DSN: the schema owner (migrations only) */
    char *projection_durable;
    char *transcript_durable;
    char *projection_from;
    long long stall_ms;
    long long new_run_grace_ms;
    long long hole_wait_ms;
    long long pending_max;
    long long log_tail;
    long long transcript_max;
    long long visible_max;
    long long delivery_threads;
    long long repair_batch;
    long long fanout_batch;
} hub_config;

const cfg_var *hub_config_vars(size_t *n);
hub_config *hub_config_get(void);

typedef struct hub_topic hub_topic;
typedef struct hub_sub hub_sub;

typedef struct hub {
    const hub_config *cfg; /* borrowed */
    db_pool *pool;
    bus *bus;
    bus_pull *pull_events, *pull_io;
    pthread_t proj_events, proj_io, maint;
    int threads_started;
    atomic_int stopping; /* set at shutdown, read by every hub thread */

    pthread_mutex_t mu; /* topics table, subscriber list, close list, repair wake-up */
    pthread_cond_t cv;
    hub_topic *topics[HUB_TOPIC_BUCKETS];
    hub_sub *subs; /* every subscriber of this replica */
    size_t n_subs;
    int wake;

    metric *m_subs[4], *m_topics, *m_queue, *m_queue_max, *m_gaps, *m_drops, *m_stalled;
    metric *m_delivered, *m_repairs, *m_projected[4], *m_proj_errors, *m_deferred;
    int fanout_batch; /* messages per burst batch: the config's, bounded by the stream queue */
} hub;

int hub_start(hub *h, const hub_config *cfg, char *err, size_t errlen);
int hub_migrate(const hub_config *cfg, char *err, size_t errlen);
void hub_stop(hub *h);

/* ---- fan-out (fanout.c) ---- */
enum { HUB_RPC_STATUS = 0, HUB_RPC_LOGS = 1, HUB_RPC_IO = 2, HUB_RPC_VISIBLE = 3 };

/* What a stream handler subscribes with (strings copied). */
typedef struct hub_sub_opts {
    int rpc;
    const auth_identity *who;
    const char *run_id; /* status, logs, io */
    const char *node;   /* io: step-name filter ("" = all) */
    int status_mask;    /* visible: bit per public run status (hub_status_bit) */
    int resume;         /* 1: resume_seq is set */
    int64_t resume_seq;
    const char *resume_session; /* io: session the resume seq belongs to ("" = any) */
} hub_sub_opts;

int hub_status_bit(const char *status);
int hub_status_terminal(const char *status);

/* The events of a WF_EVENTS message (proto/upsquad/internal/v1/run_events.proto): a
 * RunEventBatch's events in order, or the message itself when it is a bare RunEvent (the
 * earlier one-event shape). Spans borrow the message. */
typedef struct hub_evit {
    const uint8_t *p, *end;
    int batch;
} hub_evit;
void hub_evit_init(hub_evit *it, const uint8_t *data, size_t len);
/* 1 with the next event's RunEvent bytes, 0 at the end, -1 when the batch is malformed (the
 * events before it were returned). */
int hub_evit_next(hub_evit *it, const uint8_t **ev, size_t *len);

/* Serves one stream from subscription to detachment: subscribes first, sends the snapshot,
 * then hands the stream to the fan-out. Returns the handler's status (RPC_EDETACHED once the
 * stream is live). The run must exist in the caller's org (checked by the caller). */
int hub_serve(hub *h, rpc_call *call, const hub_sub_opts *o, int64_t snapshot_seq);

void hub_fanout_init(hub *h);
void *hub_maint_main(void *arg);
/* Unsubscribes every topic (after the server stopped: no subscriber is left). */
void hub_fanout_fini(hub *h);

/* ---- projection (projector.c) ---- */
void *hub_proj_events_main(void *arg);
void *hub_proj_io_main(void *arg);

#endif
