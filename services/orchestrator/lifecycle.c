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

#define CHAT_CALLS 16

typedef struct chat {
    orch *o;
    rpc_call *call;
    const char *org, *sid, *agent, *parent;
    orch_arena a;
    int error_relayed;
    int gone;
    int ended;  /* a completion or an error was relayed: the step is over for the caller */
    int status; /* the AgentStatus last stored (the turn began THINKING) */
    /* the turn's newest tool calls (a ring) and their audit rows: a tool's result and an
     * interrupt on it name the call as their parent (GetProvenanceChain walks it) */
    struct {
        char tool_call_id[65];
        char action_id[37];
    } calls[CHAT_CALLS];
    unsigned ncalls;
    /* an interrupt_required: the approval the session is parked on (spec: InterruptRequiredEvent
     * .approval_id, the correlation id of the SessionPausedEvent that follows) */
    char approval_id[37];
    char gated_tool[129];
    /* a pause asked for while the turn runs (on any replica: read from the session row at
     * most every PAUSE_LOOK_MS, when the worker sends something) is announced once */
    int64_t pause_look_ms;
    int pause_told;
} chat;

#define PAUSE_LOOK_MS 250

/* spec StatusEvent.pending_pause: a pause was requested and the session finishes its current
 * step before it becomes SUSPENDED */
static int tell_pending_pause(chat *c) {
    char err[256];
    int pending = 0;
    int64_t now = util_mono_ms();
    if (c->pause_told || now < c->pause_look_ms) return RPC_OK;
    c->pause_look_ms = now + PAUSE_LOOK_MS;
    if (orch_store_pause_pending(c->o->pool, c->org, c->sid, &pending, err, sizeof err) != DB_OK ||
        !pending)
        return RPC_OK;
    c->pause_told = 1;
    Upsquad__Runtime__V1__StatusEvent st = UPSQUAD__RUNTIME__V1__STATUS_EVENT__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    pbjson_ts_now(&at);
    st.status = UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_THINKING;
    st.detail = (char *)"a pause is pending: the session is suspended when this turn ends";
    st.timestamp = &at;
    st.pending_pause = 1;
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_STATUS;
    ae.status = &st;
    return rpc_stream_send(c->call, &ae.base);
}

/* The audit row of the turn's tool call id, else the turn's message_received. */
static const char *call_parent(const chat *c, const char *tool_call_id) {
    unsigned n = c->ncalls < CHAT_CALLS ? c->ncalls : CHAT_CALLS;
    for (unsigned i = 0; tool_call_id && tool_call_id[0] && i < n; i++) {
        unsigned k = (c->ncalls - 1 - i) % CHAT_CALLS;
        if (!strncmp(c->calls[k].tool_call_id, tool_call_id, sizeof c->calls[k].tool_call_id - 1))
            return c->calls[k].action_id;
    }
    return c->parent;
}

static void audit_event(chat *c, const ExecuteStepEvent *ev) {
    char err[256];
    cJSON *d = NULL;
    const char *type = NULL, *parent = c->parent, *call_id = NULL;
    switch (ev->event_case) {
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOKEN: /* the hot path: nothing */
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STATUS:
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION:
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_ERROR:
        return;
    default:
        break;
    }
    d = cJSON_CreateObject();
    switch (ev->event_case) {
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_CALL:
        type = "tool_call";
        call_id = ev->tool_call->tool_call_id;
        cJSON_AddStringToObject(d, "tool_name", ev->tool_call->tool_name);
        cJSON_AddStringToObject(d, "tool_call_id", ev->tool_call->tool_call_id);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT:
        type = "tool_result";
        parent = call_parent(c, ev->tool_result->tool_call_id);
        cJSON_AddStringToObject(d, "tool_name", ev->tool_result->tool_name);
        cJSON_AddStringToObject(d, "tool_call_id", ev->tool_result->tool_call_id);
        cJSON_AddBoolToObject(d, "is_error", ev->tool_result->is_error);
        cJSON_AddNumberToObject(d, "duration_ms", ev->tool_result->duration_ms);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_SECURITY:
        /* detail is kept inside the service (audit), never relayed */
        type = "security_event";
        metric_inc(c->o->m_security);
        cJSON_AddStringToObject(d, "violation_code", ev->security->violation_code);
        cJSON_AddStringToObject(d, "severity", ev->security->severity);
        cJSON_AddStringToObject(d, "pattern_id", ev->security->pattern_id);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED:
        type = "interrupt_required";
        parent = call_parent(c, ev->interrupt_required->tool_call_id);
        cJSON_AddStringToObject(d, "tool_name", ev->interrupt_required->tool_name);
        cJSON_AddStringToObject(d, "tool_call_id", ev->interrupt_required->tool_call_id);
        cJSON_AddStringToObject(d, "approval_id", c->approval_id);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED:
        type = "input_required";
        cJSON_AddStringToObject(d, "tool_call_id", ev->input_required->tool_call_id);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_METRICS:
        metric_add(c->o->m_cost, ev->metrics->cost_usd);
        break;
    default:
        break;
    }
    if (type) {
        char *json = cJSON_PrintUnformatted(d), action[37] = "";
        if (json && orch_store_audit(c->o->pool, c->org, c->sid, type, c->agent, parent, json,
                                     action, err, sizeof err) != DB_OK)
            log_error("audit.append", "session %s %s: %s", c->sid, type, err);
        else if (json && call_id && call_id[0]) {
            unsigned k = c->ncalls++ % CHAT_CALLS;
            snprintf(c->calls[k].tool_call_id, sizeof c->calls[k].tool_call_id, "%s", call_id);
            memcpy(c->calls[k].action_id, action, sizeof action);
        }
        free(json);
    }
    cJSON_Delete(d);
}

static int chat_event(void *ud, const ExecuteStepEvent *ev) {
    chat *c = ud;
    AgentEvent ae;
    const char *why;
    if (c->gone) return -1;
    /* "completion signals the step has finished": whatever a worker sends after its completion
     * (or a terminal error) never reaches the caller; a retryable error ("a recoverable or
     * terminal error") is relayed and the step's events go on */
    if (c->ended) {
        log_debug("relay.after_end", "session %s: event %d after the step's end dropped", c->sid,
                  (int)ev->event_case);
        return 0;
    }
    if (tell_pending_pause(c) != RPC_OK) {
        c->gone = 1;
        return -1;
    }
    int fwd = relay_project(&c->a, ev, &ae, &why);
    if (fwd && ae.event_case == UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_INTERRUPT_REQUIRED) {
        /* the session parks on this approval at the turn's end: one id per turn (the worker
         * suspends at the first gate) */
        if (!c->approval_id[0] && ids_uuid_v4(c->approval_id)) c->approval_id[0] = 0;
        snprintf(c->gated_tool, sizeof c->gated_tool, "%s", ae.interrupt_required->tool_name);
        ae.interrupt_required->approval_id = c->approval_id;
        audit_event(c, ev);
    }
    if (!fwd) {
        if (why &&
            ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STRUCTURED_ANSWER) {
            metric_inc(c->o->m_dropped);
            log_debug("relay.dropped", "session %s: structured answer dropped: %s", c->sid, why);
        }
        audit_event(c, ev);
        return 0;
    }
    int rc = rpc_stream_send(c->call, &ae.base);
    orch_arena_free(&c->a);
    if (rc != RPC_OK) {
        c->gone = 1;
        return -1;
    }
    if (ae.event_case == UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_ERROR) c->error_relayed = 1;
    if ((ae.event_case == UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_ERROR && !ae.error->retryable) ||
        ae.event_case == UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_COMPLETION)
        c->ended = 1;
    metric_inc(c->o->m_relayed);
    /* GetSession reports "the current session status": a transition the worker announces is
     * stored (a write per change; a turn has a handful) */
    if (ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STATUS &&
        (int)ev->status->status != c->status) {
        char err[256];
        c->status = (int)ev->status->status;
        if (orch_store_session_status(c->o->pool, c->org, c->sid, c->status, err, sizeof err) !=
            DB_OK)
            log_warn("store.status", "session %s: %s", c->sid, err);
    }
    return 1;
}

static int chat_cancelled(void *ud) {
    chat *c = ud;
    return c->gone || rpc_cancelled(c->call);
}

static void send_error(rpc_call *call, const char *code, const char *message, int retryable) {
    Upsquad__Runtime__V1__ErrorEvent e = UPSQUAD__RUNTIME__V1__ERROR_EVENT__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    e.code = (char *)code;
    e.message = (char *)message;
    e.retryable = retryable;
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_ERROR;
    ae.error = &e;
    rpc_stream_send(call, &ae.base);
}

#define PARK_POLL_MS 250

/* The transition's own values, as ResumeSession answered them (stored with the resume). */
static void send_resumed(rpc_call *call, int64_t resumed_ms, int resumed_loop) {
    Upsquad__Runtime__V1__SessionResumedEvent e = UPSQUAD__RUNTIME__V1__SESSION_RESUMED_EVENT__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    pbjson_ts_from_ms(&at, resumed_ms);
    e.resumed_at_loop = resumed_loop;
    e.resumed_at = &at;
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_SESSION_RESUMED;
    ae.session_resumed = &e;
    rpc_stream_send(call, &ae.base);
}

/* spec SessionPausedEvent: "After this event the stream stays open with keepalive pings until
 * a SessionResumedEvent or TerminateSession". The stream waits for the session to leave
 * SUSPENDED, reading its row every PARK_POLL_MS (the resume may come to any replica):
 * resumed -> SessionResumedEvent, then OK; terminated (or gone) -> OK. The transport's
 * keepalive pings keep the connection up. A waiting stream holds a stream worker, so at most
 * UPSQUAD_PAUSED_STREAMS wait per replica (beyond, the stream ends after the pause event), and
 * the caller's deadline or cancellation ends the wait too. */
static void park_stream(orch *o, rpc_call *call, const char *org, const char *sid) {
    char err[256];
    if (atomic_fetch_add(&o->parked, 1) >= o->cfg->paused_streams) goto done;
    while (!rpc_cancelled(call) && rpc_deadline_ms(call) > PARK_POLL_MS) {
        usleep(PARK_POLL_MS * 1000);
        char state[16];
        int64_t resumed_ms = 0;
        int loop = 0;
        int rc =
            orch_store_park_state(o->pool, org, sid, state, &resumed_ms, &loop, err, sizeof err);
        if (rc == ORCH_ENOTFOUND) break;
        if (rc != DB_OK) continue; /* the next look may find the database again */
        if (!strcmp(state, "suspended")) continue;
        if (!strcmp(state, "active")) send_resumed(call, resumed_ms, loop);
        break;
    }
done:
    atomic_fetch_sub(&o->parked, 1);
}

static int send_message(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    orch *o = ud;
    const SendMessageRequest *rq = (const SendMessageRequest *)req;
    const auth_identity *id;
    char sid[37], hash[65], msg[768], err[512], parent[37] = "", state[16] = "";
    orch_session s = {0};
    orch_turn *turns = NULL;
    size_t nturns = 0;
    orch_arena a = {0};
    SessionSnapshot *snap = NULL;
    ExecuteStepRequest *ereq = NULL;
    orch_turn_result res = {0};
    orch_lease lease = {.held = 0};
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
    /* renewed while this relay lives; dropped once the turn's end is stored */
    orch_lease_hold(&lease, parent);
    if (orch_request_build(o, &a, &s, rq->message, rq->execution_mode, turns, nturns, &ereq,
                           &snap)) {
        /* the turn began (it counts as in flight): it ends, failed, or a pause would wait for
         * it until its deadline */
        orch_turn_end e = {.agent_status = 4, /* ERROR */
                           .loop_base = s.loop_count,
                           .error_code = "INTERNAL",
                           .error_msg = "the session snapshot could not be read"};
        if (orch_store_turn_end(o->pool, id->org_id, sid, parent, &e, err, sizeof err) != DB_OK)
            log_error("store.turn_end", "session %s: %s", sid, err);
        orch_lease_drop(&lease);
        rc = rpc_error(call, RPC_INTERNAL, "the session snapshot could not be read");
        goto done;
    }
    /* no pause is pending when a turn starts (orch_store_turn_begin refuses then): the first
     * look is due PAUSE_LOOK_MS in, so short turns never look */
    chat c = {.o = o,
              .call = call,
              .org = id->org_id,
              .sid = sid,
              .agent = s.agent_id,
              .parent = parent,
              .status = 1, /* THINKING: orch_store_turn_begin */
              .pause_look_ms = util_mono_ms() + PAUSE_LOOK_MS};
    orch_sink sink = {chat_event, chat_cancelled, &c};
    orch_turn_run(o, ereq, timeout, &sink, &res);
    orch_request_wipe(ereq);
    orch_arena_free(&c.a);
    orch_pause paused = {0};
    char park_reason[192];
    orch_turn_end e;
    orch_turn_end_of(&res, s.loop_count, &e);
    e.paused = &paused;
    rc = RPC_OK;
    switch (res.outcome) {
    case TURN_COMPLETED:
        metric_inc(o->m_turns_ok);
        break;
    case TURN_CANCELLED:
        e.error_code = "CANCELLED";
        e.error_msg = "the caller went away; the worker call was cancelled";
        rc = rpc_error(call, RPC_CANCELLED, "cancelled");
        break;
    case TURN_NO_WORKER:
        e.error_code = "NO_WORKER";
        e.error_msg = "no live worker";
        rc = rpc_error(call, RPC_UNAVAILABLE, "no live worker: the agent runtime is not reachable");
        break;
    case TURN_INTERRUPT:
        /* relayed as InterruptRequiredEvent; the session parks on the approval (spec: the
         * InterruptRequiredEvent comes just before SessionPaused(PAUSE_SOURCE_APPROVAL)) */
        e.error_code = "APPROVAL_REQUIRED";
        e.error_msg = "a tool call needs approval";
        if (c.approval_id[0]) {
            e.park_source = UPSQUAD__RUNTIME__V1__PAUSE_SOURCE__PAUSE_SOURCE_APPROVAL;
            e.park_reason = park_reason;
            e.park_correlation = c.approval_id;
            snprintf(park_reason, sizeof park_reason, "tool call %s requires approval",
                     c.gated_tool);
        }
        break;
    case TURN_INPUT_REQUIRED:
        e.error_code = "INPUT_REQUIRED";
        e.error_msg = "the agent asked the user; prompts on the chat path are not served yet";
        send_error(call, e.error_code, e.error_msg, 0);
        break;
    default:
        e.error_code = res.error_code;
        e.error_msg = res.error_message;
        if (!c.error_relayed) send_error(call, res.error_code, res.error_message, res.retryable);
        break;
    }
    if (res.outcome != TURN_COMPLETED) metric_inc(o->m_turns_failed);
    metric_add(o->m_in_tokens, (double)res.input_tokens);
    metric_add(o->m_out_tokens, (double)res.output_tokens);
    /* an end not stored leaves the lease unrenewed from here: a replica reclaims the turn */
    if (orch_store_turn_end(o->pool, id->org_id, sid, parent, &e, err, sizeof err) != DB_OK)
        log_error("store.turn_end", "session %s: %s", sid, err);
    orch_lease_drop(&lease);
    /* a pause asked for during the turn committed at its end: the stream says so, then waits
     * for the resume (the caller then continues with a new SendMessage) */
    if (paused.committed && res.outcome != TURN_CANCELLED &&
        orch_pause_send_event(call, &paused) == RPC_OK)
        park_stream(o, call, id->org_id, sid);
done:
    orch_lease_drop(&lease);
    orch_turn_result_clear(&res);
    if (snap) protobuf_c_message_free_unpacked(&snap->base, NULL);
    orch_arena_free(&a);
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
