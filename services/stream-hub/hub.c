/* Configuration, start and stop of stream-hub (see hub.h). */
#include "hub.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "subjects.h"
#include "util.h"

static hub_config C;

static const cfg_var vars[] = {
    {"UPSQUAD_PG_DSN", CFG_STR, NULL,
     "Postgres connection string of the stream_hub login role (libpq keywords or URI)", &C.pg_dsn,
     0, 0, CFG_REQUIRED | CFG_SECRET},
    {"UPSQUAD_PG_MIGRATE_DSN", CFG_STR, NULL,
     "Postgres connection string of the stream_hub schema's owner role, used only to apply the "
     "migrations (at start or with --migrate); unset: they run as UPSQUAD_PG_DSN, which must "
     "then own the schema (make run and Kubernetes set both: the service logs in as a role that "
     "owns nothing)",
     &C.pg_migrate_dsn, 0, 0, CFG_SECRET},
    {"UPSQUAD_PG_POOL_SIZE", CFG_INT, "8",
     "Postgres connections at most (projection writers, snapshots, repairs, transcripts)",
     &C.pg_pool_size, 2, 200},
    {"UPSQUAD_NATS_URL", CFG_STR, NULL,
     "NATS server(s): the live inputs (core subjects) and the durable projection consumers",
     &C.nats_url, 0, 0, CFG_REQUIRED},
    {"UPSQUAD_MIGRATIONS_DIR", CFG_STR, "services/stream-hub/migrations",
     "folder of the schema migrations applied at start; `none`: do not migrate at start (run "
     "`stream-hub --migrate` as a Job instead)",
     &C.migrations_dir},
    {"UPSQUAD_HUB_PROJECTION_DURABLE", CFG_STR, DURABLE_HUB_PROJECTION,
     "durable JetStream consumer of run events (WF_EVENTS) shared by the replicas",
     &C.projection_durable},
    {"UPSQUAD_HUB_TRANSCRIPT_DURABLE", CFG_STR, DURABLE_HUB_TRANSCRIPTS,
     "durable JetStream consumer of node I/O (WFIO) shared by the replicas", &C.transcript_durable},
    {"UPSQUAD_HUB_PROJECTION_FROM", CFG_STR, "all",
     "where durable consumers this hub creates start: `all` (the streams' history: a new "
     "deployment projects what the streams still hold) or `new` (tests, throw-away stores)",
     &C.projection_from},
    {"UPSQUAD_HUB_STALL_LIMIT", CFG_MS, "10s",
     "a subscriber whose queue stays more than half full this long is ended with "
     "RESOURCE_EXHAUSTED",
     &C.stall_ms, 100, 600000},
    {"UPSQUAD_HUB_NEW_RUN_GRACE", CFG_MS, "3s",
     "an unknown run is looked up again for this long before NOT_FOUND: a client may subscribe "
     "the moment TriggerWorkflow returns, before the run's first event is projected",
     &C.new_run_grace_ms, 0, 60000},
    {"UPSQUAD_HUB_HOLE_WAIT", CFG_MS, "45s",
     "a run seq missing below one already stored is waited for until the event above it has "
     "been stored this long, then skipped (logged hub.hole); keep it above the projection's "
     "ack wait (30 s), after which a message a dead replica held is projected by another",
     &C.hole_wait_ms, 1000, 600000},
    {"UPSQUAD_HUB_PENDING_MAX", CFG_INT, "1024",
     "live frames held per subscriber while its snapshot is being sent (beyond: a gap, or a "
     "re-snapshot of visible runs)",
     &C.pending_max, 16, 65536},
    {"UPSQUAD_HUB_LOG_TAIL", CFG_INT, "1000",
     "StreamRunLogs snapshot: the newest log lines of the run sent before live lines", &C.log_tail,
     1, 100000},
    {"UPSQUAD_HUB_TRANSCRIPT_MAX", CFG_INT, "5000",
     "transcript events at most per GetNodeTranscript answer and StreamNodeIO snapshot",
     &C.transcript_max, 1, 100000},
    {"UPSQUAD_HUB_VISIBLE_MAX", CFG_INT, "500",
     "runs at most in a StreamVisibleRuns snapshot (newest first)", &C.visible_max, 1, 10000},
    {"UPSQUAD_HUB_DELIVERY_THREADS", CFG_INT, "2",
     "threads of the NATS delivery pool running every topic's fan-out", &C.delivery_threads, 1, 64},
    {"UPSQUAD_HUB_REPAIR_BATCH", CFG_INT, "128",
     "events read from the store per step when a subscriber is fed from it", &C.repair_batch, 1,
     4096},
    {"UPSQUAD_HUB_FANOUT_BATCH", CFG_INT, "16",
     "a burst (messages already waiting on a run's subscription): up to this many messages' "
     "frames are queued to the subscribers before their sends start, so they share writes "
     "(at most a quarter of UPSQUAD_RPC_STREAM_QUEUE; 1: every frame's sends start at once)",
     &C.fanout_batch, 1, 1024},
};

const cfg_var *hub_config_vars(size_t *n) {
    *n = sizeof vars / sizeof vars[0];
    return vars;
}

hub_config *hub_config_get(void) {
    return &C;
}

#define fail(err, errlen, ...) util_errf((err), (errlen), -1, __VA_ARGS__)

static int set(const char *s) {
    return s && s[0] && strcmp(s, "none") != 0;
}

int hub_migrate(const hub_config *cfg, char *err, size_t errlen) {
    db_pool *pool = NULL;
    int applied = 0;
    if (!set(cfg->migrations_dir)) return fail(err, errlen, "UPSQUAD_MIGRATIONS_DIR is none");
    if (db_pool_open(cfg->pg_dsn, 1, &pool, err, errlen) != DB_OK) return -1;
    int rc = db_migrate_as(pool, cfg->pg_migrate_dsn, HUB_SCHEMA, cfg->migrations_dir, &applied,
                           err, errlen);
    db_pool_close(pool);
    if (rc == DB_OK) log_info("hub.migrate", "%d migration(s) applied", applied);
    return rc == DB_OK ? 0 : -1;
}

static int ensure_streams(hub *h, char *err, size_t errlen) {
    const char *wf[2] = {STREAM_WF_EVENTS_SUBJECT_STATUS, STREAM_WF_EVENTS_SUBJECT_LOG};
    const char *io[1] = {STREAM_WFIO_SUBJECTS};
    if (bus_js_stream_ensure(h->bus, STREAM_WF_EVENTS, wf, 2, BUS_RETENTION_LIMITS,
                             STREAM_WF_EVENTS_MAX_AGE_S, NULL, err, errlen) != BUS_OK)
        return -1;
    if (bus_js_stream_ensure(h->bus, STREAM_WFIO, io, 1, BUS_RETENTION_LIMITS,
                             STREAM_WFIO_MAX_AGE_S, NULL, err, errlen) != BUS_OK)
        return -1;
    return 0;
}

int hub_start(hub *h, const hub_config *cfg, char *err, size_t errlen) {
    char name[128], host[64] = "";
    memset(h, 0, sizeof *h);
    h->cfg = cfg;
    pthread_mutex_init(&h->mu, NULL);
    util_cond_init_monotonic(&h->cv);
    hub_fanout_init(h);
    h->m_projected[0] = metrics_counter("stream_hub_projected_total",
                                        "events written to the projection", "kind=\"run\"");
    h->m_projected[1] = metrics_counter("stream_hub_projected_total",
                                        "events written to the projection", "kind=\"node\"");
    h->m_projected[2] = metrics_counter("stream_hub_projected_total",
                                        "events written to the projection", "kind=\"log\"");
    h->m_projected[3] = metrics_counter("stream_hub_projected_total",
                                        "events written to the projection", "kind=\"transcript\"");
    h->m_proj_errors = metrics_counter("stream_hub_projection_errors_total",
                                       "projection writes that failed (retried) or messages "
                                       "terminated as undecodable",
                                       NULL);
    if (db_pool_open(cfg->pg_dsn, (int)cfg->pg_pool_size, &h->pool, err, errlen) != DB_OK)
        goto fail;
    if (set(cfg->migrations_dir)) {
        int applied = 0;
        if (db_migrate_as(h->pool, cfg->pg_migrate_dsn, HUB_SCHEMA, cfg->migrations_dir, &applied,
                          err, errlen) != DB_OK)
            goto fail;
        if (applied) log_info("hub.migrate", "%d migration(s) applied", applied);
    }
    /* Every topic is one subscription: nats.c's shared delivery pool instead of a thread per
     * subscription (thousands of runs would otherwise be thousands of threads). */
    setenv("NATS_DEFAULT_TO_LIB_MSG_DELIVERY", "1", 0);
    gethostname(host, sizeof host - 1);
    snprintf(name, sizeof name, "stream-hub@%s:%d", host, (int)getpid());
    bus_opts o;
    bus_opts_default(&o);
    if (bus_connect_ex(cfg->nats_url, name, &o, &h->bus, err, errlen) != BUS_OK) goto fail;
    nats_SetMessageDeliveryPoolSize((int)cfg->delivery_threads);
    if (ensure_streams(h, err, errlen)) goto fail;
    int from_new = strcmp(cfg->projection_from, "new") == 0;
    if (!from_new && strcmp(cfg->projection_from, "all") != 0) {
        fail(err, errlen, "UPSQUAD_HUB_PROJECTION_FROM must be all or new");
        goto fail;
    }
    if (bus_js_pull_subscribe_ex(h->bus, STREAM_WF_EVENTS, cfg->projection_durable, "wf.>",
                                 HUB_PROJECTION_ACK_WAIT_MS, -1, from_new, &h->pull_events, err,
                                 errlen) != BUS_OK)
        goto fail;
    if (bus_js_pull_subscribe_ex(h->bus, STREAM_WFIO, cfg->transcript_durable, "wfio.>",
                                 HUB_PROJECTION_ACK_WAIT_MS, -1, from_new, &h->pull_io, err,
                                 errlen) != BUS_OK)
        goto fail;
    if (pthread_create(&h->proj_events, NULL, hub_proj_events_main, h) != 0) goto threads;
    if (pthread_create(&h->proj_io, NULL, hub_proj_io_main, h) != 0) {
        h->stopping = 1;
        pthread_join(h->proj_events, NULL);
        goto threads;
    }
    if (pthread_create(&h->maint, NULL, hub_maint_main, h) != 0) {
        h->stopping = 1;
        pthread_join(h->proj_events, NULL);
        pthread_join(h->proj_io, NULL);
        goto threads;
    }
    h->threads_started = 1;
    return 0;
threads:
    fail(err, errlen, "cannot start the hub's threads");
fail:
    hub_stop(h);
    return -1;
}

void hub_stop(hub *h) {
    h->stopping = 1;
    if (h->threads_started) {
        pthread_join(h->maint, NULL);
        pthread_join(h->proj_events, NULL);
        pthread_join(h->proj_io, NULL);
        h->threads_started = 0;
    }
    if (h->bus) hub_fanout_fini(h);
    bus_pull_close(h->pull_events);
    bus_pull_close(h->pull_io);
    h->pull_events = h->pull_io = NULL;
    bus_close(h->bus);
    h->bus = NULL;
    db_pool_close(h->pool);
    h->pool = NULL;
}

/* RunEventBatch.events: field 16, length-delimited; RunEvent reserves 16, so a message whose
 * first tag is this one is a batch (protobuf writes fields in number order, and a RunEvent's
 * first is scope, 1). */
#define EVIT_TAG0 0x82
#define EVIT_TAG1 0x01

void hub_evit_init(hub_evit *it, const uint8_t *data, size_t len) {
    it->p = data;
    it->end = data + len;
    it->batch = len >= 2 && data[0] == EVIT_TAG0 && data[1] == EVIT_TAG1;
}

int hub_evit_next(hub_evit *it, const uint8_t **ev, size_t *len) {
    if (it->p >= it->end) return 0;
    if (!it->batch) { /* a bare RunEvent: itself, once */
        *ev = it->p;
        *len = (size_t)(it->end - it->p);
        it->p = it->end;
        return 1;
    }
    if (it->end - it->p < 3 || it->p[0] != EVIT_TAG0 || it->p[1] != EVIT_TAG1) goto bad;
    const uint8_t *q = it->p + 2;
    uint64_t n = 0;
    for (int shift = 0;; shift += 7) {
        if (q >= it->end || shift > 28) goto bad; /* a length over 2^35: not ours */
        n |= (uint64_t)(*q & 0x7f) << shift;
        if (!(*q++ & 0x80)) break;
    }
    if (n > (uint64_t)(it->end - q)) goto bad;
    *ev = q;
    *len = (size_t)n;
    it->p = q + n;
    return 1;
bad:
    it->p = it->end;
    return -1;
}
