/* LifecycleService (spec: upsquad/runtime/v1/lifecycle.proto; docs/orchestrator.md).
 * Tenant and user always come from the verified token; another org's session reads as
 * NOT_FOUND (row-level security makes it invisible). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <strings.h>
#include <time.h>

#include "autonomy.h"
#include "chat.h"
#include "fields.h"
#include "ids.h"
#include "lease.h"
#include "log.h"
#include "pause.h"
#include "pbjson.h"
#include "session.h"
#include "util.h"

typedef Upsquad__Runtime__V1__SendMessageRequest SendMessageRequest;
typedef Upsquad__Runtime__V1__CreateSessionRequest CreateSessionRequest;
typedef Upsquad__Runtime__V1__CreateSessionResponse CreateSessionResponse;
typedef Upsquad__Runtime__V1__GetSessionRequest GetSessionRequest;
typedef Upsquad__Runtime__V1__GetSessionResponse GetSessionResponse;
typedef Upsquad__Runtime__V1__ListSessionsRequest ListSessionsRequest;
typedef Upsquad__Runtime__V1__ListSessionsResponse ListSessionsResponse;
typedef Upsquad__Runtime__V1__TerminateLifecycleSessionRequest TerminateRequest;
typedef Upsquad__Runtime__V1__TerminateLifecycleSessionResponse TerminateResponse;

#define DEFAULT_PAGE 20
#define MAX_PAGE 100

static const char *bearer_of(rpc_call *call) {
    const char *h = rpc_metadata(call, "authorization");
    if (!h) return NULL;
    while (*h == ' ')
        h++;
    if (!strncasecmp(h, "bearer ", 7)) h += 7;
    return h;
}

static int mode_field(rpc_call *call, int mode) {
    if (mode < 0 || mode > 3)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "execution_mode: unknown value %d", mode);
    return RPC_OK;
}

static void session_msg(rpc_call *call, const orch_session *s, GetSessionResponse *out) {
    upsquad__runtime__v1__get_session_response__init(out);
    out->session_id = rpc_strdup(call, s->session_id);
    out->agent_id = rpc_strdup(call, s->agent_id);
    out->status = (Upsquad__Runtime__V1__AgentStatus)s->agent_status;
    out->loop_count = s->loop_count;
    out->max_loops = s->max_loops;
    out->started_at = orch_ts_ms(call, s->started_ms);
    if (s->last_heartbeat_ms) out->last_heartbeat = orch_ts_ms(call, s->last_heartbeat_ms);
    out->snapshot_hash = rpc_strdup(call, s->snapshot_hash);
    out->model_id = rpc_strdup(call, s->model_id);
}

/* ---- CreateSession ---- */

static int create_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud) {
    orch *o = ud;
    const CreateSessionRequest *rq = (const CreateSessionRequest *)req;
    CreateSessionResponse *out = (CreateSessionResponse *)resp;
    const auth_identity *id;
    char sid[37], hash[65], msg[768];
    int rc;
    if ((rc = rpc_tenant(call, 0, &id)) ||
        (rc = orch_uuid_field(call, "agent_id", rq->agent_id, 1)) ||
        (rc = mode_field(call, rq->execution_mode)))
        return rc;
    if (strlen(rq->model_override) > 96)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "model_override: longer than 96 bytes");
    orch_new_session n = {.org = id->org_id,
                          .user = id->sub,
                          .agent_id = rq->agent_id,
                          .model_override = rq->model_override,
                          .kind = "chat",
                          .mode = rq->execution_mode,
                          .bearer = bearer_of(call),
                          .init_worker = 1};
    rc = orch_session_start(o, &n, sid, hash, msg, sizeof msg);
    if (rc != RPC_OK) return rpc_error(call, rc, "%s", msg);
    out->session_id = rpc_strdup(call, sid);
    out->snapshot_hash = rpc_strdup(call, hash);
    out->status = UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_UNSPECIFIED;
    log_info("session.created", "session %s agent %s org %s", sid, rq->agent_id, id->org_id);
    return RPC_OK;
}

/* ---- GetSession ---- */

static int get_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                       void *ud) {
    orch *o = ud;
    const GetSessionRequest *rq = (const GetSessionRequest *)req;
    const auth_identity *id;
    orch_session s;
    char err[512];
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "session_id", rq->session_id, 1))) return rc;
    rc = orch_store_session_get(o->pool, id->org_id, rq->session_id, 0, &s, err, sizeof err);
    if (rc == ORCH_ENOTFOUND)
        return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
    if (rc != DB_OK) return orch_store_failed(call, "reading the session", err);
    session_msg(call, &s, (GetSessionResponse *)resp);
    orch_session_clear(&s);
    return RPC_OK;
}

/* ---- ListSessions ---- */

/* status_filter: a lifecycle state (initializing, active, suspended, terminated, error,
 * crashed) or an AgentStatus (thinking, acting, complete, suspended, or AGENT_STATUS_*),
 * case-insensitive. */
static int parse_filter(const char *f, const char **state, int *status) {
    static const char *states[] = {"initializing", "active", "terminated", "crashed"};
    static const char *statuses[] = {"unspecified", "thinking", "acting",
                                     "complete",    "error",    "suspended"};
    *state = NULL;
    *status = -1;
    if (!f || !f[0]) return 0;
    const char *g = f;
    if (!strncasecmp(g, "AGENT_STATUS_", 13)) {
        g += 13;
        for (int i = 0; i < 6; i++)
            if (!strcasecmp(g, statuses[i])) return *status = i, 0;
        return -1;
    }
    for (size_t i = 0; i < sizeof states / sizeof *states; i++)
        if (!strcasecmp(g, states[i])) return *state = states[i], 0;
    for (int i = 1; i < 6; i++)
        if (!strcasecmp(g, statuses[i])) return *status = i, 0;
    return -1;
}

/* page_token: "<started_at ms>_<session uuid>" of the last row served. */
static int parse_token(const char *t, int64_t *ms, char id[37]) {
    char *end;
    long long v = strtoll(t, &end, 10);
    if (end == t || *end != '_' || v <= 0 || strlen(end + 1) != 36 || !ids_uuid_valid(end + 1))
        return -1;
    *ms = v;
    memcpy(id, end + 1, 37);
    return 0;
}

static int list_sessions(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud) {
    orch *o = ud;
    const ListSessionsRequest *rq = (const ListSessionsRequest *)req;
    ListSessionsResponse *out = (ListSessionsResponse *)resp;
    orch_list_query q = {.agent_status = -1};
    const auth_identity *id;
    char after[37] = "", err[512];
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "agent_id", rq->agent_id, 0))) return rc;
    if (parse_filter(rq->status_filter, &q.state, &q.agent_status))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "status_filter: unknown status \"%.64s\" (one of initializing, active, "
                         "suspended, terminated, error, crashed, thinking, acting, complete)",
                         rq->status_filter);
    if (rq->page_size < 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "page_size: must not be negative");
    q.page_size = rq->page_size == 0         ? DEFAULT_PAGE
                  : rq->page_size > MAX_PAGE ? MAX_PAGE
                                             : rq->page_size;
    if (rq->page_token[0] && parse_token(rq->page_token, &q.after_ms, after))
        return rpc_error(call, RPC_INVALID_ARGUMENT, "page_token: not a token this service issued");
    q.agent_id = rq->agent_id;
    q.after_id = after;
    orch_session *rows = NULL;
    size_t n = 0;
    int more = 0;
    int64_t total = 0;
    rc =
        orch_store_session_list(o->pool, id->org_id, &q, &rows, &n, &more, &total, err, sizeof err);
    if (rc != DB_OK) return orch_store_failed(call, "listing sessions", err);
    out->sessions = rpc_alloc(call, (n ? n : 1) * sizeof *out->sessions);
    for (size_t i = 0; i < n && out->sessions; i++) {
        out->sessions[i] = rpc_alloc(call, sizeof *out->sessions[i]);
        if (!out->sessions[i]) break;
        session_msg(call, &rows[i], out->sessions[i]);
        out->n_sessions++;
    }
    if (more && n)
        out->next_page_token =
            rpc_sprintf(call, "%lld_%s", (long long)rows[n - 1].started_ms, rows[n - 1].session_id);
    out->total_count = total > INT32_MAX ? INT32_MAX : (int32_t)total;
    free(rows);
    return RPC_OK;
}

/* ---- TerminateSession ---- */

void orch_session_tell_end(orch *o, const char *org, const char *worker, const char *sid,
                           const char *reason) {
    orch_worker *k = worker && worker[0] ? orch_workers_find(o->workers, worker) : NULL;
    if (!k) {
        k = orch_workers_pick(o->workers, NULL);
        if (!k) return;
        orch_workers_done(o->workers, k);
    }
    Upsquad__Runtime__V1__TerminateSessionRequest rq =
        UPSQUAD__RUNTIME__V1__TERMINATE_SESSION_REQUEST__INIT;
    rq.session_id = (char *)sid;
    rq.reason = (char *)reason;
    ProtobufCMessage *resp = NULL;
    char *bearer = orch_mint_call_token(o, org);
    rpc_call_opts opts = {.timeout_ms = 3000, .bearer = bearer};
    int code = rpc_unary_call(
        k->ch, "/upsquad.runtime.v1.RuntimeService/TerminateSession", &rq.base,
        &upsquad__runtime__v1__terminate_session_response__descriptor, &opts, &resp, NULL);
    if (code != 0)
        log_warn("session.terminate_worker",
                 "worker %s did not confirm the end of session %s "
                 "(status %d); it releases it on its own",
                 k->addr, sid, code);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    free(bearer);
}

static int terminate_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                             void *ud) {
    orch *o = ud;
    const TerminateRequest *rq = (const TerminateRequest *)req;
    TerminateResponse *out = (TerminateResponse *)resp;
    const auth_identity *id;
    char state[16] = "", err[512];
    int was = 0;
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "session_id", rq->session_id, 1)) ||
        (rc = orch_text_field(call, "reason", rq->reason, 1024)))
        return rc;
    const char *org = id->org_id;
    rc = orch_store_session_terminate(o->pool, org, rq->session_id,
                                      rq->reason[0] ? rq->reason : "terminated by the user", &was,
                                      state, err, sizeof err);
    if (rc == ORCH_ENOTFOUND)
        return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", rq->session_id);
    if (rc != DB_OK) return orch_store_failed(call, "terminating the session", err);
    orch_session s;
    if (orch_store_session_get(o->pool, org, rq->session_id, 0, &s, err, sizeof err) == DB_OK) {
        out->status = (Upsquad__Runtime__V1__AgentStatus)s.agent_status;
        /* the worker of its last turn (no affinity: else any live one) releases it */
        if (!was) orch_session_tell_end(o, org, s.worker, rq->session_id, rq->reason);
        orch_session_clear(&s);
    }
    out->success = 1;
    return RPC_OK;
}

/* ---- SendMessage ---- */

static int send_message(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    orch *o = ud;
    const SendMessageRequest *rq = (const SendMessageRequest *)req;
    const auth_identity *id;
    char sid[37], hash[65], msg[768], err[512], parent[37] = "", state[16] = "";
    orch_session s = {0};
    orch_turn *turns = NULL;
    size_t nturns = 0;
    int rc;
    if ((rc = rpc_tenant(call, 0, &id)) ||
        (rc = orch_uuid_field(call, "session_id", rq->session_id, 0)) ||
        (rc = orch_uuid_field(call, "agent_id", rq->agent_id, !rq->session_id[0])) ||
        (rc = mode_field(call, rq->execution_mode)))
        return rc;
    if (!rq->message[0]) return rpc_error(call, RPC_INVALID_ARGUMENT, "message: required");
    if ((long long)strlen(rq->message) > o->cfg->message_max)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "message: longer than %lld bytes",
                         o->cfg->message_max);
    /* no live worker: refuse before anything changes */
    if (orch_workers_live(o->workers) == 0) {
        metric_inc(o->m_no_worker);
        return rpc_error(call, RPC_UNAVAILABLE,
                         "no live worker: the agent runtime is not reachable; try again shortly");
    }
    if (!rq->session_id[0]) {
        orch_new_session n = {.org = id->org_id,
                              .user = id->sub,
                              .agent_id = rq->agent_id,
                              .kind = "chat",
                              .mode = rq->execution_mode,
                              .bearer = bearer_of(call),
                              .init_worker = 1};
        rc = orch_session_start(o, &n, sid, hash, msg, sizeof msg);
        if (rc != RPC_OK) return rpc_error(call, rc, "%s", msg);
    } else {
        snprintf(sid, sizeof sid, "%s", rq->session_id);
    }
    rc = orch_store_session_get(o->pool, id->org_id, sid, 1, &s, err, sizeof err);
    if (rc == ORCH_ENOTFOUND)
        return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", sid);
    if (rc != DB_OK) return orch_store_failed(call, "reading the session", err);
    if (rq->agent_id[0] && strcasecmp(rq->agent_id, s.agent_id)) {
        rc = rpc_error(call, RPC_INVALID_ARGUMENT, "agent_id: session %s belongs to agent %s", sid,
                       s.agent_id);
        goto done;
    }
    /* spec EXECUTION_MODE_AUTONOMOUS: the orchestrator-side plan loop drives the turn */
    int mode = rq->execution_mode ? (int)rq->execution_mode : s.execution_mode;
    int autonomous = mode == UPSQUAD__RUNTIME__V1__EXECUTION_MODE__EXECUTION_MODE_AUTONOMOUS;
    if (autonomous && (rc = orch_auto_busy(o, call, id->org_id, sid)) != RPC_OK) goto done;
    int64_t left = rpc_deadline_ms(call);
    int64_t timeout = o->cfg->step_timeout_ms;
    if (left < timeout) timeout = left > 0 ? left : 1;
    /* in flight until its end is stored, which comes after the step's timeout */
    rc = orch_store_turn_begin(o->pool, id->org_id, sid, rq->message, (int)o->cfg->prior_turns,
                               (size_t)o->cfg->prior_bytes, timeout + ORCH_TURN_END_SLACK_MS,
                               o->instance, &turns, &nturns, parent, state, err, sizeof err);
    if (rc == ORCH_ESTATE) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION, "session %s is %s: it takes no messages", sid,
                       state);
        goto done;
    }
    if (rc == ORCH_ENOTFOUND) {
        rc = rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", sid);
        goto done;
    }
    if (rc != DB_OK) {
        rc = orch_store_failed(call, "recording the message", err);
        goto done;
    }
    orch_chat_turn t = {.org = id->org_id,
                        .sid = sid,
                        .s = &s,
                        .requester = id->sub,
                        .message = rq->message,
                        .mode = rq->execution_mode,
                        .turns = turns,
                        .nturns = nturns,
                        .parent = parent,
                        /* affinity: the worker that holds the session's state (its last turn's,
                         * or the one a resume or a recovery initialised), when it is live */
                        .prefer_worker = s.worker,
                        .timeout_ms = timeout};
    int parked = 0;
    if (autonomous)
        rc = orch_auto_run(o, call, &t, &parked);
    else
        rc = orch_chat_run(o, call, &t, &parked);
    /* parked (its own gate, or a pause asked for during the turn): the stream waits for the
     * resume; a gate's decision resumes the turn on it */
    if (parked) orch_chat_park(o, call, id->org_id, sid);
done:
    orch_turns_free(turns, nturns);
    orch_session_clear(&s);
    return rc;
}

/* ---- registration (PauseSession, ResumeSession, GetProvenanceChain: pause.c; the subagent
 * tree methods: tree.c) ---- */

#define SVC "/upsquad.runtime.v1.LifecycleService/"
#define DESC(x) &upsquad__runtime__v1__##x##__descriptor

int orch_lifecycle_register(rpc_server *srv, orch *o) {
    const rpc_method methods[] = {
        {SVC "SendMessage", RPC_SERVER_STREAM, RPC_AUTH_REQUIRED, DESC(send_message_request),
         DESC(agent_event), NULL, send_message, o},
        {SVC "CreateSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(create_session_request),
         DESC(create_session_response), create_session, NULL, o, .flags = RPC_BLOCKING},
        {SVC "GetSession", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(get_session_request),
         DESC(get_session_response), get_session, NULL, o, .flags = RPC_BLOCKING},
        {SVC "ListSessions", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(list_sessions_request),
         DESC(list_sessions_response), list_sessions, NULL, o, .flags = RPC_BLOCKING},
        {SVC "TerminateSession", RPC_UNARY, RPC_AUTH_REQUIRED,
         DESC(terminate_lifecycle_session_request), DESC(terminate_lifecycle_session_response),
         terminate_session, NULL, o, .flags = RPC_BLOCKING},
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
