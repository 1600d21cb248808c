/* One chat turn relayed to its caller, and a stream's wait on a parked session (chat.h). */
#include "chat.h"

#include <cjson/cJSON.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "agentdef.h"
#include "delegate.h"
#include "gate.h"
#include "lease.h"
#include "log.h"
#include "pause.h"
#include "pbjson.h"
#include "relay.h"
#include "session.h"
#include "turn.h"
#include "util.h"

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
    /* an interrupt_required / input_required: the approval or prompt the session parks on
     * (spec: InterruptRequiredEvent.approval_id, the correlation id of the SessionPausedEvent
     * that follows), opened through ApprovalService when the event arrives */
    char approval_id[37];
    char gated_tool[129];
    char question[256]; /* a prompt's question, for the pause's reason */
    const char *requester, *message;
    int64_t started_ms;         /* wall clock: the frozen checkpoint is one stored since */
    const orch_chat_step *step; /* an autonomous cycle's hook, or NULL */
    const orch_envelope *env;   /* a delegated child's turn: its events go wrapped, or NULL */
    /* a delegate_to_agent call the worker suspended on (the turn delegates at its end) */
    char deleg_call[65];
    char *deleg_intent; /* heap */
    int deleg_gate;     /* the delegation waits for its approval (DELEGATION_APPROVAL) */
    /* a pause asked for while the turn runs (on any replica: read from the session row at
     * most every PAUSE_LOOK_MS, when the worker sends something) is announced once */
    int64_t pause_look_ms;
    int pause_told;
} chat;

#define PAUSE_LOOK_MS 250

/* spec DelegatedEventEnvelope: a child's AgentEvent, verbatim, inside one envelope per level
 * of delegation between it and the stream's own session (a grandchild's event: the
 * grandchild's envelope inside the child's). env NULL: sent as it is. */
int orch_chat_send(rpc_call *call, const orch_envelope *env, AgentEvent *ae) {
    if (!env) return rpc_stream_send(call, &ae->base);
    Upsquad__Runtime__V1__DelegatedEventEnvelope d =
        UPSQUAD__RUNTIME__V1__DELEGATED_EVENT_ENVELOPE__INIT;
    AgentEvent outer;
    upsquad__runtime__v1__agent_event__init(&outer);
    d.inner = ae;
    d.child_session_id = (char *)env->child_session_id;
    d.child_agent_id = (char *)env->child_agent_id;
    d.subagent_invocation_id = (char *)env->invocation_id;
    outer.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_DELEGATED;
    outer.delegated = &d;
    return orch_chat_send(call, env->outer, &outer);
}

/* The agent's policy asks an approval for delegate_to_agent (tool_policies). */
static int delegation_gated(chat *c) {
    orch_agent_row a = {0};
    char err[256];
    int gated = 0;
    if (orch_store_agent_get(c->o->pool, c->org, c->agent, &a, err, sizeof err) == DB_OK) {
        agentdef_policy pol;
        agentdef_tool_policy(a.definition, ORCH_DELEGATE_TOOL, &pol);
        gated = pol.requires_approval;
    }
    free(a.definition);
    return gated;
}

/* A delegate_to_agent call the worker suspended on: kept for the turn's end, which runs the
 * child (delegate.c); nothing is relayed for it (the SessionPaused(DELEGATION) tells it). */
static int note_delegation(chat *c, const Upsquad__Runtime__V1__InterruptRequired *ir) {
    free(c->deleg_intent);
    c->deleg_intent =
        strndup((const char *)ir->pending_tool_intent.data, ir->pending_tool_intent.len);
    snprintf(c->deleg_call, sizeof c->deleg_call, "%s", ir->tool_call_id ? ir->tool_call_id : "");
    return 0;
}

/* An interrupt_required / input_required: its approval or prompt opened through ApprovalService
 * and recorded, so the session parks on it at the turn's end (one per turn: the worker suspends
 * at the first). 1: opened; 0: refused (an ErrorEvent went out instead, the turn fails without
 * a park, and the gated call never runs); -1: the caller is gone. */
static int open_gate(chat *c, const ExecuteStepEvent *ev) {
    char msg[512];
    if (c->approval_id[0]) return 1;
    orch_gate_ask ask = {.org = c->org,
                         .sid = c->sid,
                         .agent_id = c->agent,
                         .requester = c->requester,
                         .message = c->message,
                         .holder = c->call ? c->o->instance : NULL};
    if (ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED) {
        const Upsquad__Runtime__V1__InterruptRequired *ir = ev->interrupt_required;
        ask.kind = "approval_gate";
        ask.tool = ir->tool_name;
        ask.tool_call_id = ir->tool_call_id;
        ask.idempotency_key = ir->idempotency_key;
        ask.intent = ir->pending_tool_intent.data;
        ask.intent_len = ir->pending_tool_intent.len;
    } else {
        const Upsquad__Runtime__V1__InputRequired *in = ev->input_required;
        ask.kind = "user_prompt";
        ask.tool = in->tool_name && in->tool_name[0] ? in->tool_name : "ask_user";
        ask.tool_call_id = in->tool_call_id;
        ask.idempotency_key = in->idempotency_key;
        ask.question = in->question_spec.data;
        ask.question_len = in->question_spec.len;
        ask.frozen = in->checkpoint.data;
        ask.frozen_len = in->checkpoint.len;
        cJSON *q =
            cJSON_ParseWithLength((const char *)in->question_spec.data, in->question_spec.len);
        const char *qt = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(q, "question"));
        qt = qt ? qt : "";
        snprintf(c->question, sizeof c->question, "%.*s",
                 (int)util_utf8_cut(qt, sizeof c->question - 1), qt);
        cJSON_Delete(q);
    }
    snprintf(c->gated_tool, sizeof c->gated_tool, "%s", ask.tool ? ask.tool : "");
    int rc = orch_gate_open(c->o, &ask, c->approval_id, msg, sizeof msg);
    if (rc == RPC_OK) return 1;
    c->approval_id[0] = 0;
    log_error("gate.open", "session %s: %s %s not opened: %s", c->sid, ask.kind, c->gated_tool,
              msg);
    c->ended = c->error_relayed = 1;
    if (c->call) {
        char text[640];
        snprintf(text, sizeof text, "the %s could not be opened (%s); the gated call did not run",
                 ask.kind[0] == 'a' ? "approval" : "prompt", msg);
        orch_chat_send_error(c->call, c->env, "APPROVAL_UNAVAILABLE", text, 1);
        if (rpc_cancelled(c->call)) return c->gone = 1, -1;
    }
    return 0;
}

/* spec StatusEvent.pending_pause: a pause was requested and the session finishes its current
 * step before it becomes SUSPENDED */
static int tell_pending_pause(chat *c) {
    char err[256];
    int pending = 0;
    int64_t now = util_mono_ms();
    if (c->pause_told || now < c->pause_look_ms || !c->call) return RPC_OK;
    c->pause_look_ms = now + PAUSE_LOOK_MS;
    if (orch_store_pause_pending(c->o->pool, c->org, c->sid, &pending, NULL, err, sizeof err) !=
            DB_OK ||
        !pending)
        return RPC_OK;
    c->pause_told = 1;
    return orch_chat_send_status(
        c->call, c->env, "a pause is pending: the session is suspended when this turn ends", 1);
}

int orch_chat_send_status(rpc_call *call, const orch_envelope *env, const char *detail,
                          int pending_pause) {
    Upsquad__Runtime__V1__StatusEvent st = UPSQUAD__RUNTIME__V1__STATUS_EVENT__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    pbjson_ts_now(&at);
    st.status = UPSQUAD__RUNTIME__V1__AGENT_STATUS__AGENT_STATUS_THINKING;
    st.detail = (char *)detail;
    st.timestamp = &at;
    st.pending_pause = pending_pause;
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_STATUS;
    ae.status = &st;
    return orch_chat_send(call, env, &ae);
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
        parent = call_parent(c, ev->input_required->tool_call_id);
        cJSON_AddStringToObject(d, "tool_call_id", ev->input_required->tool_call_id);
        cJSON_AddStringToObject(d, "prompt_id", c->approval_id);
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
    if (c->step && c->step->observe) c->step->observe(c->step->ud, ev);
    if (c->step && c->step->hold_completion &&
        ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION) {
        c->ended = 1; /* the cycle is over; the loop tells its own end */
        return 0;
    }
    if (ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED &&
        ev->interrupt_required->tool_name &&
        !strcmp(ev->interrupt_required->tool_name, ORCH_DELEGATE_TOOL)) {
        if (!delegation_gated(c)) {
            audit_event(c, ev);
            return note_delegation(c, ev->interrupt_required);
        }
        /* spec PauseSource DELEGATION_APPROVAL: the spawn waits for its approval, opened and
         * decided as any gated call's; approved, the child runs (gate.c) */
        c->deleg_gate = 1;
    }
    int fwd = relay_project(&c->a, ev, &ae, &why);
    if ((fwd && ae.event_case == UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_INTERRUPT_REQUIRED) ||
        ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED) {
        int rc = open_gate(c, ev);
        if (rc <= 0) return rc; /* refused: an ErrorEvent went out instead */
        if (fwd) ae.interrupt_required->approval_id = c->approval_id;
        audit_event(c, ev);
        if (!fwd) return 0;
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
    int rc = c->call ? orch_chat_send(c->call, c->env, &ae) : RPC_OK;
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
    return c->gone || (c->call && rpc_cancelled(c->call));
}

void orch_chat_send_error(rpc_call *call, const orch_envelope *env, const char *code,
                          const char *message, int retryable) {
    Upsquad__Runtime__V1__ErrorEvent e = UPSQUAD__RUNTIME__V1__ERROR_EVENT__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    e.code = (char *)code;
    e.message = (char *)message;
    e.retryable = retryable;
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_ERROR;
    ae.error = &e;
    orch_chat_send(call, env, &ae);
}

#define PARK_POLL_MS 250

int orch_chat_send_paused(rpc_call *call, const orch_envelope *env, const orch_pause *pz) {
    Upsquad__Runtime__V1__SessionPausedEvent e = UPSQUAD__RUNTIME__V1__SESSION_PAUSED_EVENT__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    if (pz->paused_ms > 0)
        pbjson_ts_from_ms(&at, pz->paused_ms);
    else
        pbjson_ts_now(&at);
    e.reason = (char *)pz->reason;
    e.pause_source = (Upsquad__Runtime__V1__PauseSource)pz->source;
    e.correlation_id = (char *)pz->correlation_id;
    e.checkpoint_key = (char *)pz->checkpoint_key;
    e.paused_at = &at;
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_SESSION_PAUSED;
    ae.session_paused = &e;
    return orch_chat_send(call, env, &ae);
}

void orch_chat_send_resumed(rpc_call *call, const orch_envelope *env, int64_t resumed_ms,
                            int resumed_loop, const char *approval_id) {
    Upsquad__Runtime__V1__SessionResumedEvent e = UPSQUAD__RUNTIME__V1__SESSION_RESUMED_EVENT__INIT;
    Google__Protobuf__Timestamp at = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    if (resumed_ms > 0)
        pbjson_ts_from_ms(&at, resumed_ms);
    else
        pbjson_ts_now(&at);
    e.resumed_at_loop = resumed_loop;
    e.resumed_at = &at;
    /* spec: "Populated when resumed_by_approval is true" */
    if (approval_id && approval_id[0]) {
        e.resumed_by_approval = 1;
        e.approval_id = (char *)approval_id;
    }
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_SESSION_RESUMED;
    ae.session_resumed = &e;
    orch_chat_send(call, env, &ae);
}

/* The stream waits for the session to leave SUSPENDED, reading its row every PARK_POLL_MS (the
 * resume may come to any replica): a decided gate of the park is resumed here, on this stream
 * (the decision consumer leaves it to the replica whose stream waits, for a moment); resumed
 * by ResumeSession or by a decision taken elsewhere -> SessionResumedEvent, then OK;
 * terminated (or gone) -> OK. The transport's keepalive pings keep the connection up. A waiting
 * stream holds a stream worker, so at most UPSQUAD_PAUSED_STREAMS wait per replica (beyond,
 * the stream ends after the pause event), and the caller's deadline or cancellation ends the
 * wait too. */
void orch_chat_park(orch *o, rpc_call *call, const char *org, const char *sid) {
    char err[256];
    /* the gate was opened naming this replica as the one whose stream waits (orch_gate_open),
     * so a decision arriving at once is left to this stream; a stream that does not wait
     * (over the bound) or stops waiting clears that mark: a decision is then resumed by any
     * replica, with nobody listening */
    if (atomic_fetch_add(&o->parked, 1) >= o->cfg->paused_streams) goto done;
    while (!rpc_cancelled(call) && rpc_deadline_ms(call) > PARK_POLL_MS) {
        usleep(PARK_POLL_MS * 1000);
        orch_park_look pl;
        int rc = orch_store_park_look(o->pool, org, sid, &pl, err, sizeof err);
        if (rc == ORCH_ENOTFOUND) break;
        if (rc != DB_OK) continue; /* the next look may find the database again */
        if (pl.ready_gate[0]) {
            if (rpc_cancelled(call)) break; /* gone: the turn resumes with nobody listening */
            int parked = 0;
            rc = orch_gate_resume(o, call, org, pl.ready_gate, &parked);
            if (rc == ORCH_ESTATE) continue; /* another replica took it: the next look tells */
            if (!parked) break;              /* the turn ended (or failed): the stream ends */
            continue;                        /* parked again, on a gate naming this stream */
        }
        if (!strcmp(pl.state, "suspended")) continue;
        if (!strcmp(pl.state, "active"))
            orch_chat_send_resumed(call, NULL, pl.resumed_ms, pl.resumed_loop, pl.resumed_by);
        break;
    }
done:
    if (orch_store_gate_unhold(o->pool, org, sid, o->instance, err, sizeof err) != DB_OK)
        log_warn("gate.unhold", "session %s: %s", sid, err);
    atomic_fetch_sub(&o->parked, 1);
}

/* The park of a turn that opened a gate waits for the worker's frozen checkpoint (its
 * reporter sends it just after the interrupt), so the SessionPausedEvent names the checkpoint
 * the resume starts from (spec: SessionPausedEvent.checkpoint_key). Bounded: past it the park
 * names the newest checkpoint there is. */
#define FROZEN_WAIT_MS 3000
#define FROZEN_POLL_MS 25

static void wait_frozen(orch *o, const char *org, const char *sid, int64_t since_ms) {
    char key[64] = "", err[256];
    for (int64_t t0 = util_mono_ms(); util_mono_ms() - t0 < FROZEN_WAIT_MS;) {
        if (orch_store_checkpoint_since(o->pool, org, sid, since_ms, key, err, sizeof err) !=
                DB_OK ||
            key[0])
            return;
        usleep(FROZEN_POLL_MS * 1000);
    }
    log_warn("gate.no_frozen", "session %s: no checkpoint since the gated turn began (%d ms)", sid,
             FROZEN_WAIT_MS);
}

static int64_t wall_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* One ExecuteStep of a turn already begun (its lease held by the caller), relayed; st keeps
 * what the turn's end needs. RPC status for call. */
int orch_chat_exec(orch *o, rpc_call *call, const orch_chat_turn *t, orch_turn_result *res,
                   orch_chat_state *st) {
    orch_arena a = {0};
    SessionSnapshot *snap = NULL;
    ExecuteStepRequest *ereq = NULL;
    int rc = RPC_OK;
    memset(st, 0, sizeof *st);
    memset(res, 0, sizeof *res);
    if (orch_request_build(o, &a, t->s, t->message, t->mode, t->turns, t->nturns, &ereq, &snap)) {
        res->outcome = TURN_FAILED;
        snprintf(res->error_code, sizeof res->error_code, "INTERNAL");
        res->error_message = strdup("the session snapshot could not be read");
        st->error_relayed = 1;
        rc = call ? rpc_error(call, RPC_INTERNAL, "the session snapshot could not be read")
                  : RPC_INTERNAL;
        goto done;
    }
    ereq->ask_user_resume = (Upsquad__Runtime__V1__AskUserResume *)t->resume;
    if (t->step && t->step->goal) ereq->step_goal = (char *)t->step->goal;
    /* no pause is pending when a turn starts (orch_store_turn_begin refuses then): the first
     * look is due PAUSE_LOOK_MS in, so short turns never look */
    chat c = {.o = o,
              .call = call,
              .org = t->org,
              .sid = t->sid,
              .agent = t->s->agent_id,
              .parent = t->parent,
              .requester = t->requester,
              .message = t->message,
              .started_ms = wall_ms(),
              .step = t->step,
              .env = t->env,
              .status = 1, /* THINKING: orch_store_turn_begin */
              .pause_look_ms = util_mono_ms() + PAUSE_LOOK_MS};
    orch_sink sink = {chat_event, chat_cancelled, &c};
    orch_turn_run_on(o, ereq, t->timeout_ms, &sink, t->prefer_worker, res);
    ereq->ask_user_resume = NULL; /* borrowed */
    ereq->step_goal = NULL;
    orch_request_wipe(ereq);
    orch_arena_free(&c.a);
    memcpy(st->approval_id, c.approval_id, sizeof st->approval_id);
    memcpy(st->gated_tool, c.gated_tool, sizeof st->gated_tool);
    memcpy(st->question, c.question, sizeof st->question);
    st->error_relayed = c.error_relayed;
    st->started_ms = c.started_ms;
    memcpy(st->deleg_call, c.deleg_call, sizeof st->deleg_call);
    st->deleg_gate = c.deleg_gate;
    st->deleg_intent = c.deleg_intent; /* handed over */
    snprintf(st->worker, sizeof st->worker, "%s", res->worker);
done:
    if (snap) protobuf_c_message_free_unpacked(&snap->base, NULL);
    orch_arena_free(&a);
    return rc;
}

/* The turn's end from its (last) step's result: stored (parking the session on a gate the step
 * opened), told to call. RPC status for call; *parked as orch_chat_run's. */
int orch_chat_finish(orch *o, rpc_call *call, const orch_chat_turn *t, orch_turn_result *res,
                     const orch_chat_state *st, int *parked) {
    char err[512], park_reason[320];
    int rc = RPC_OK;
    *parked = 0;
    orch_pause paused = {0};
    orch_turn_end e;
    orch_turn_end_of(res, t->s->loop_count, &e);
    e.paused = &paused;
    switch (res->outcome) {
    case TURN_COMPLETED:
        metric_inc(o->m_turns_ok);
        break;
    case TURN_CANCELLED:
        e.error_code = "CANCELLED";
        e.error_msg = "the caller went away; the worker call was cancelled";
        if (call) rc = rpc_error(call, RPC_CANCELLED, "cancelled");
        break;
    case TURN_NO_WORKER:
        e.error_code = "NO_WORKER";
        e.error_msg = "no live worker";
        if (call)
            rc = rpc_error(call, RPC_UNAVAILABLE,
                           "no live worker: the agent runtime is not reachable");
        break;
    case TURN_INTERRUPT:
    case TURN_INPUT_REQUIRED:
        /* the session parks on the gate opened when the event came (spec: the
         * InterruptRequiredEvent comes just before SessionPaused(PAUSE_SOURCE_APPROVAL); an
         * ask_user parks the same way on its prompt); none opened: the turn failed */
        e.error_code = res->outcome == TURN_INTERRUPT ? "APPROVAL_REQUIRED" : "INPUT_REQUIRED";
        e.error_msg = res->outcome == TURN_INTERRUPT ? "a tool call needs approval"
                                                     : "the agent asked the user";
        if (!st->approval_id[0]) {
            e.agent_status = 4; /* ERROR */
            break;
        }
        wait_frozen(o, t->org, t->sid, st->started_ms);
        e.park_source = st->deleg_gate
                            ? UPSQUAD__RUNTIME__V1__PAUSE_SOURCE__PAUSE_SOURCE_DELEGATION_APPROVAL
                            : UPSQUAD__RUNTIME__V1__PAUSE_SOURCE__PAUSE_SOURCE_APPROVAL;
        e.park_reason = park_reason;
        e.park_correlation = st->approval_id;
        if (res->outcome == TURN_INTERRUPT)
            snprintf(park_reason, sizeof park_reason, "tool call %s requires approval",
                     st->gated_tool);
        else
            snprintf(park_reason, sizeof park_reason, "user_prompt: %s", st->question);
        break;
    default:
        e.error_code = res->error_code;
        e.error_msg = res->error_message;
        if (!st->error_relayed && call)
            orch_chat_send_error(call, t->env, res->error_code, res->error_message, res->retryable);
        break;
    }
    if (res->outcome != TURN_COMPLETED) metric_inc(o->m_turns_failed);
    metric_add(o->m_in_tokens, (double)res->input_tokens);
    metric_add(o->m_out_tokens, (double)res->output_tokens);
    /* an end not stored leaves the lease unrenewed from here: a replica reclaims the turn */
    if (orch_store_turn_end(o->pool, t->org, t->sid, t->parent, &e, err, sizeof err) != DB_OK)
        log_error("store.turn_end", "session %s: %s", t->sid, err);
    /* a pause committed at the turn's end (its own gate, or one asked for meanwhile): the
     * stream says so; the caller waits for the resume (orch_chat_park) */
    if (paused.committed && res->outcome != TURN_CANCELLED &&
        (!call || orch_chat_send_paused(call, t->env, &paused) == RPC_OK))
        *parked = 1;
    else if (st->approval_id[0] && call &&
             orch_store_gate_unhold(o->pool, t->org, t->sid, o->instance, err, sizeof err) !=
                 DB_OK) /* no stream will wait on the gate it opened */
        log_warn("gate.unhold", "session %s: %s", t->sid, err);
    return rc;
}

int orch_chat_steps(orch *o, rpc_call *call, const orch_chat_turn *t, orch_turn_result *res,
                    orch_chat_state *st) {
    orch_chat_turn cur = *t;
    Upsquad__Runtime__V1__AskUserResume aur;
    char *answer = NULL;
    unsigned char *ck = NULL;
    int rc = orch_chat_exec(o, call, &cur, res, st);
    /* a delegation: the child runs, then the same turn goes on with its result (delegate.c) */
    while (rc == RPC_OK && res->outcome == TURN_INTERRUPT && st->deleg_intent) {
        size_t cklen = 0;
        char worker[128] = "";
        free(answer);
        free(ck);
        answer = NULL;
        ck = NULL;
        wait_frozen(o, t->org, t->sid, st->started_ms);
        if (orch_delegate(o, call, t, st, res, &answer, worker, &ck, &cklen) != RPC_OK) break;
        aur = (Upsquad__Runtime__V1__AskUserResume)UPSQUAD__RUNTIME__V1__ASK_USER_RESUME__INIT;
        aur.checkpoint.data = ck;
        aur.checkpoint.len = cklen;
        aur.answer_tool_result.data = (uint8_t *)answer;
        aur.answer_tool_result.len = strlen(answer);
        cur.resume = &aur;
        cur.prefer_worker = worker;
        orch_chat_state_clear(st);
        orch_turn_result_clear(res);
        rc = orch_chat_exec(o, call, &cur, res, st);
    }
    free(answer);
    free(ck);
    return rc;
}

void orch_chat_state_clear(orch_chat_state *st) {
    free(st->deleg_intent);
    memset(st, 0, sizeof *st);
}

int orch_chat_run(orch *o, rpc_call *call, const orch_chat_turn *t, int *parked) {
    orch_turn_result res;
    orch_chat_state st;
    orch_lease lease = {.held = 0};
    *parked = 0;
    /* renewed while this relay lives; dropped once the turn's end is stored */
    orch_lease_hold(&lease, t->parent);
    int rc = orch_chat_steps(o, call, t, &res, &st);
    int rc2 = orch_chat_finish(o, call, t, &res, &st, parked);
    orch_lease_drop(&lease);
    orch_turn_result_clear(&res);
    orch_chat_state_clear(&st);
    return rc != RPC_OK ? rc : rc2;
}
