/* WorkflowService streaming RPCs and GetNodeTranscript (docs/stream-hub.md).
 *
 * Every stream: the org comes from the token; a run of another org, or an unknown run, is
 * NOT_FOUND before anything is sent. A reconnecting client may send the request metadata key
 * HUB_RESUME_KEY ("x-upsquad-resume-seq") with the last sequence it saw: run status and logs
 * resume after that run seq without the snapshot; node I/O takes "<session_id>:<seq>", skips
 * the transcript snapshot and reports frames it cannot replay as a StreamGap. */
#include "handlers.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ids.h"
#include "log.h"
#include "redact.h"
#include "store.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

typedef Upsquad__Workflow__V1__StreamRunStatusRequest StatusReq;
typedef Upsquad__Workflow__V1__StreamRunLogsRequest LogsReq;
typedef Upsquad__Workflow__V1__StreamNodeIORequest IOReq;
typedef Upsquad__Workflow__V1__StreamVisibleRunsRequest VisReq;
typedef Upsquad__Workflow__V1__GetNodeTranscriptRequest TranscriptReq;
typedef Upsquad__Workflow__V1__GetNodeTranscriptResponse TranscriptResp;
typedef Upsquad__Workflow__V1__TranscriptEvent Transcript;

#define SVC "/upsquad.workflow.v1.WorkflowService/"

/* The run, in the caller's org and visible to the caller (a private workflow's run only to its
 * owner), or NOT_FOUND (never PERMISSION_DENIED: another org's run does not exist for this
 * caller). */
static int find_run(rpc_call *call, hub *h, const char *run_id, hs_run *run) {
    char err[256];
    int found = 0;
    const auth_identity *who;
    int rc = rpc_tenant(call, 0, &who);
    if (rc != RPC_OK) return rc;
    if (!run_id || !run_id[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "run_id is required");
    /* spec: run_id is "the workflow run UUID (required)": a malformed one is bad input, as in
     * every WorkflowService RPC of the workflow-engine (GetWorkflowStatus, GetNodeIO, ...) */
    if (!ids_uuid_valid(run_id))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "run_id must be a UUID");
    /* a client that left while its stream waited for a worker costs no lookup */
    if (rpc_cancelled(call)) return RPC_CANCELLED;
    /* A run is known once its first event is projected, milliseconds after TriggerWorkflow
     * returns: an unknown run is looked up again for the grace period before NOT_FOUND. */
    long long waited = 0;
    for (;;) {
        if (hs_get_run(h->pool, who->org_id, run_id, run, &found, err, sizeof err) != DB_OK) {
            log_warn("hub.run", "%s", err);
            return rpc_error(call, RPC_UNAVAILABLE, "run lookup failed; retry");
        }
        if (found) break;
        if (waited >= h->cfg->new_run_grace_ms || rpc_cancelled(call) || h->stopping) break;
        struct timespec ts = {0, 50 * 1000000L};
        nanosleep(&ts, NULL);
        waited += 50;
    }
    /* runs follow their workflow's visibility, as the workflow-engine reads them (GetNodeIO,
     * GetWorkflowStatus; spec: GetNodeTranscript is "run-scoped fail-closed exactly like
     * GetNodeIO"): a private workflow's run is another member's to see only if they own it */
    if (found && (strcmp(run->visibility, "private") != 0 || strcmp(run->owner_id, who->sub) == 0))
        return RPC_OK;
    return rpc_error(call, RPC_NOT_FOUND, "run %s not found", run_id);
}

/* The resume point from the request metadata: RPC_OK with *resume 0 when absent. */
static int resume_point(rpc_call *call, int *resume, int64_t *seq, const char **session) {
    const char *v = rpc_metadata(call, HUB_RESUME_KEY);
    *resume = 0;
    *seq = 0;
    if (session) *session = "";
    if (!v) return RPC_OK;
    const char *num = v;
    const char *colon = strrchr(v, ':');
    if (colon && session) {
        *session = rpc_strndup(call, v, (size_t)(colon - v));
        num = colon + 1;
    }
    char *end = NULL;
    errno = 0;
    long long n = strtoll(num, &end, 10);
    if (!*num || *end || errno || n < 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "metadata %s must be a non-negative sequence%s", HUB_RESUME_KEY,
                         session ? " (or <session_id>:<seq>)" : "");
    *resume = 1;
    *seq = n;
    return RPC_OK;
}

static int serve_run(rpc_call *call, hub *h, const char *run_id, int rpc) {
    hs_run run;
    hub_sub_opts o = {.rpc = rpc, .who = rpc_identity(call), .run_id = run_id};
    int rc = find_run(call, h, run_id, &run);
    if (rc != RPC_OK) return rc;
    if ((rc = resume_point(call, &o.resume, &o.resume_seq, NULL)) != RPC_OK) return rc;
    /* a finished run the client has seen to the end: nothing more will come */
    if (o.resume && rpc == HUB_RPC_STATUS && hub_status_terminal(run.status) &&
        o.resume_seq >= run.last_seq)
        return RPC_OK;
    return hub_serve(h, call, &o, 0);
}

static int stream_run_status(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    return serve_run(call, ud, ((const StatusReq *)req)->run_id, HUB_RPC_STATUS);
}

static int stream_run_logs(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    return serve_run(call, ud, ((const LogsReq *)req)->run_id, HUB_RPC_LOGS);
}

static int stream_node_io(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    const IOReq *rq = (const IOReq *)req;
    hs_run run;
    hub_sub_opts o = {
        .rpc = HUB_RPC_IO, .who = rpc_identity(call), .run_id = rq->run_id, .node = rq->node_id};
    int rc = find_run(call, ud, rq->run_id, &run);
    if (rc != RPC_OK) return rc;
    if (strlen(rq->node_id) >= 128)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "node_id is longer than 127 bytes");
    if ((rc = resume_point(call, &o.resume, &o.resume_seq, &o.resume_session)) != RPC_OK) return rc;
    return hub_serve(ud, call, &o, 0);
}

static int stream_visible_runs(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    const VisReq *rq = (const VisReq *)req;
    hub_sub_opts o = {.rpc = HUB_RPC_VISIBLE};
    const int active =
        hub_status_bit("pending") | hub_status_bit("running") | hub_status_bit("paused");
    switch ((int)rq->status_filter) {
    case 0: /* UNSPECIFIED == ALL */
    case 4:
        o.status_mask = 0x3f;
        break;
    case 1:
        o.status_mask = active;
        break;
    case 2:
        o.status_mask = hub_status_bit("completed");
        break;
    case 3:
        o.status_mask = hub_status_bit("failed") | hub_status_bit("cancelled");
        break;
    default:
        return rpc_error(call, RPC_INVALID_ARGUMENT, "status_filter %d is not a RunStatusFilter",
                         (int)rq->status_filter);
    }
    int rc = rpc_tenant(call, 0, &o.who);
    if (rc != RPC_OK) return rc;
    return hub_serve(ud, call, &o, 0);
}

/* ---- GetNodeTranscript ---- */

static void *arena_alloc(void *ud, size_t n) {
    return rpc_alloc(ud, n);
}

static void arena_free(void *ud, void *p) {
    (void)ud;
    (void)p; /* freed with the call */
}

typedef struct removed {
    rpc_call *call;
    char **names;
    size_t n, cap;
} removed;

/* redacted_fields: stable (first seen first), de-duplicated. */
static void note_removed(const char *key, void *ud) {
    removed *r = ud;
    for (size_t i = 0; i < r->n; i++)
        if (strcmp(r->names[i], key) == 0) return;
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 4;
        char **v = rpc_alloc(r->call, cap * sizeof *v);
        if (!v) return;
        if (r->n) memcpy(v, r->names, r->n * sizeof *v);
        r->names = v;
        r->cap = cap;
    }
    r->names[r->n++] = rpc_strdup(r->call, key);
}

static int get_node_transcript(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                               void *ud) {
    const TranscriptReq *rq = (const TranscriptReq *)req;
    TranscriptResp *out = (TranscriptResp *)resp;
    hub *h = ud;
    hs_run run;
    hs_blobs b;
    char err[256];
    if (!rq->run_id[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "run_id is required");
    if (!rq->node_id[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "node_id is required");
    int rc = find_run(call, h, rq->run_id, &run);
    if (rc != RPC_OK) return rc;
    const auth_identity *who = rpc_identity(call);
    if (hs_transcript(h->pool, who->org_id, rq->run_id, rq->node_id, (int)h->cfg->transcript_max,
                      &b, err, sizeof err) != DB_OK) {
        log_warn("hub.transcript", "%s", err);
        return rpc_error(call, RPC_UNAVAILABLE, "transcript read failed; retry");
    }
    ProtobufCAllocator alloc = {arena_alloc, arena_free, call};
    removed rm = {.call = call};
    out->events = rpc_alloc(call, (b.n ? b.n : 1) * sizeof *out->events);
    if (!out->events) {
        hs_blobs_free(&b);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "transcript too large for this call");
    }
    for (size_t i = 0; i < b.n; i++) {
        Transcript *te =
            upsquad__workflow__v1__transcript_event__unpack(&alloc, b.v[i].len, b.v[i].body);
        if (!te) continue;
        redact_transcript(te, who->clearance, &alloc, note_removed, &rm);
        out->events[out->n_events++] = te;
    }
    hs_blobs_free(&b);
    out->redacted_fields = rm.names;
    out->n_redacted_fields = rm.n;
    out->session_missing = out->n_events == 0;
    return RPC_OK;
}

int hub_handlers_register(rpc_server *srv, hub *h) {
    const rpc_method m[] = {
        {SVC "StreamRunStatus", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED,
         &upsquad__workflow__v1__stream_run_status_request__descriptor,
         &upsquad__workflow__v1__stream_run_status_response__descriptor, NULL, stream_run_status,
         h},
        {SVC "StreamRunLogs", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED,
         &upsquad__workflow__v1__stream_run_logs_request__descriptor,
         &upsquad__workflow__v1__stream_run_logs_response__descriptor, NULL, stream_run_logs, h},
        {SVC "StreamNodeIO", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED,
         &upsquad__workflow__v1__stream_node_iorequest__descriptor,
         &upsquad__workflow__v1__stream_node_ioresponse__descriptor, NULL, stream_node_io, h},
        {SVC "StreamVisibleRuns", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED,
         &upsquad__workflow__v1__stream_visible_runs_request__descriptor,
         &upsquad__workflow__v1__visible_run_event__descriptor, NULL, stream_visible_runs, h},
        {SVC "GetNodeTranscript", RPC_UNARY, RPC_AUTH_REQUIRED,
         &upsquad__workflow__v1__get_node_transcript_request__descriptor,
         &upsquad__workflow__v1__get_node_transcript_response__descriptor, get_node_transcript,
         NULL, h, .flags = RPC_BLOCKING}, /* reads Postgres */
    };
    return rpc_server_add(srv, m, sizeof m / sizeof m[0]);
}
