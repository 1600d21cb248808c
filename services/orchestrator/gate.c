/* Human gates on the chat path (gate.h). */
#include "gate.h"

#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "agentdef.h"
#include "autonomy.h"
#include "auth_claims.h"
#include "chat.h"
#include "delegate.h"
#include "ids.h"
#include "log.h"
#include "pbjson.h"
#include "session.h"
#include "subjects.h"
#include "util.h"
#include "upsquad/approval/v1/approval.pb-c.h"

#define A(x) Upsquad__Approval__V1__##x

#define OPEN_METHOD "/upsquad.approval.v1.ApprovalService/OpenApproval"
#define OPEN_TIMEOUT_MS 5000
#define SUMMARY_MAX 2000
#define QUESTION_MAX 2000
#define OPTIONS_MAX 20
#define TEXT_MAX 200

/* The consumer: one durable (UPSQUAD_APPROVALS_DURABLE) shared by every replica; a message is
 * redelivered until acked. */
#define ACK_WAIT_MS 30000
/* a decision whose turn has not parked yet (its end is being stored) is looked at again this
 * often, at most EARLY_TRIES times (then dropped: its park never came, the turn failed) */
#define EARLY_DELAY_MS 250
#define EARLY_TRIES 40
/* the replica whose stream waits on the park sees the decision on its next look (every
 * 250 ms): it is left this long before any replica resumes the turn with nobody listening */
#define HOLDER_GRACE_MS 1500
#define HOLDER_DELIVERIES 3 /* deliveries left to a waiting stream (an early one counts too) */
/* resumes with nobody listening run on threads of their own, at most this many at once (a
 * decision beyond waits on the stream: redelivered after RESUME_BUSY_MS) */
#define RESUMES_MAX 16
#define RESUME_BUSY_MS 1000

/* ---- opening ---- */

/* The gate's clearance and the agent's name from its definition (agentdef_tool_clearance: the
 * tool's policy, else the agent's, else 5). A prompt needs the clearance its policy names for
 * ask_user, else 1 with answerable_by "requester": the member who chats answers their agent. */
static int gate_policy(orch *o, const orch_gate_ask *ask, int *clearance, int *explicit_prompt,
                       char name[129], char *msg, size_t msglen) {
    orch_agent_row a = {0};
    char err[256];
    int rc = orch_store_agent_get(o->pool, ask->org, ask->agent_id, &a, err, sizeof err);
    if (rc != DB_OK) {
        snprintf(msg, msglen, "the agent's definition is not readable: %s", err);
        return RPC_UNAVAILABLE;
    }
    agentdef_policy pol;
    agentdef_tool_policy(a.definition, ask->tool, &pol);
    snprintf(name, 129, "%s", a.display_name);
    *explicit_prompt = 0;
    if (!strcmp(ask->kind, "user_prompt")) {
        *explicit_prompt = pol.names_clearance;
        *clearance = *explicit_prompt ? pol.clearance : 1;
    } else {
        *clearance = pol.clearance;
    }
    free(a.definition);
    return RPC_OK;
}

/* A prompt's question_spec ({question, options[], allow_text, answerable_by}) onto the
 * request; options are strings or {value, label, description}. Strings live in the arena. */
static void prompt_fields(orch_arena *ar, const cJSON *q, A(OpenApprovalRequest) * rq,
                          int explicit_clearance) {
    const char *question = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(q, "question"));
    const cJSON *opts = cJSON_GetObjectItemCaseSensitive(q, "options");
    const cJSON *allow = cJSON_GetObjectItemCaseSensitive(q, "allow_text");
    const char *by = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(q, "answerable_by"));
    rq->question =
        orch_arena_strdup(ar, question && question[0] ? question : "The agent asks for your input");
    int n = cJSON_IsArray(opts) ? cJSON_GetArraySize(opts) : 0;
    if (n > OPTIONS_MAX) n = OPTIONS_MAX;
    rq->options = orch_arena_alloc(ar, (size_t)(n ? n : 1) * sizeof *rq->options);
    for (const cJSON *e = n ? opts->child : NULL; e && rq->options && (int)rq->n_options < n;
         e = e->next) {
        const char *v = cJSON_IsString(e)
                            ? e->valuestring
                            : cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "value"));
        if (!v || !v[0]) continue;
        A(ApprovalOption) *o = orch_arena_alloc(ar, sizeof *o);
        if (!o) break;
        upsquad__approval__v1__approval_option__init(o);
        o->value = orch_arena_strdup(ar, v);
        const char *l = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "label"));
        const char *d = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(e, "description"));
        o->label = orch_arena_strdup(ar, l ? l : "");
        o->description = orch_arena_strdup(ar, d ? d : "");
        rq->options[rq->n_options++] = o;
    }
    /* nothing to choose: free text (else nothing could answer it) */
    rq->allow_text = cJSON_IsBool(allow) ? cJSON_IsTrue(allow) : rq->n_options == 0;
    if (rq->n_options == 0) rq->allow_text = 1;
    /* without a clearance of its own, only the asker answers */
    rq->answerable_by =
        (char *)(by && (!strcmp(by, "anyone") || !strcmp(by, "requester")) && explicit_clearance
                     ? orch_arena_strdup(ar, by)
                     : "requester");
}

/* correlation_key: the worker's idempotency key, else sha256(session : tool_call_id : the
 * message) (the same ask re-delivered is the same approval) */
static void correlation(const orch_gate_ask *ask, char out[201]) {
    if (ask->idempotency_key && ask->idempotency_key[0]) {
        snprintf(out, 201, "%.*s", (int)util_utf8_cut(ask->idempotency_key, 200),
                 ask->idempotency_key);
        return;
    }
    ids_sha256 h;
    char hex[65];
    ids_sha256_init(&h);
    ids_sha256_update_str(&h, ask->sid);
    ids_sha256_update_str(&h, ":");
    ids_sha256_update_str(&h, ask->tool_call_id ? ask->tool_call_id : "");
    ids_sha256_update_str(&h, ":");
    ids_sha256_update_str(&h, ask->message ? ask->message : "");
    ids_sha256_final_hex(&h, hex);
    snprintf(out, 201, "%s", hex);
}

static char *cut(orch_arena *ar, const char *s, size_t max) {
    s = s ? s : "";
    return orch_arena_strndup(ar, s, util_utf8_cut(s, max));
}

int orch_gate_open(orch *o, const orch_gate_ask *ask, char approval_id[37], char *msg,
                   size_t msglen) {
    orch_arena ar = {0};
    A(OpenApprovalRequest) rq = UPSQUAD__APPROVAL__V1__OPEN_APPROVAL_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    char name[129] = "", key[201], err[256];
    int clearance = 5, explicit_prompt = 0, prompt = !strcmp(ask->kind, "user_prompt");
    int deleg = !prompt && ask->tool && !strcmp(ask->tool, ORCH_DELEGATE_TOOL);
    char *bearer = NULL;
    cJSON *q = NULL;
    approval_id[0] = 0;
    int rc = RPC_UNAVAILABLE;
    if (!o->approvals) {
        snprintf(msg, msglen, "no ApprovalService is configured (UPSQUAD_APPROVALS_ADDR)");
        goto done;
    }
    if ((rc = gate_policy(o, ask, &clearance, &explicit_prompt, name, msg, msglen)) != RPC_OK)
        goto done;
    correlation(ask, key);
    rq.org_id = (char *)ask->org;
    rq.session_id = (char *)ask->sid;
    rq.agent_id = (char *)ask->agent_id;
    rq.kind = (char *)ask->kind;
    rq.tool = cut(&ar, ask->tool, TEXT_MAX);
    rq.tool_call_id = cut(&ar, ask->tool_call_id, TEXT_MAX);
    rq.required_clearance = clearance;
    rq.requested_by = (char *)ask->requester;
    rq.correlation_key = key;
    rq.agent_name = cut(&ar, name, TEXT_MAX);
    rq.timeout_seconds = (int32_t)o->cfg->approval_timeout_s;
    if (prompt) {
        q = cJSON_ParseWithLength((const char *)ask->question, ask->question_len);
        prompt_fields(&ar, q, &rq, explicit_prompt);
        rq.question = cut(&ar, rq.question, QUESTION_MAX);
    } else {
        /* the raw intent goes to the approval row (returned on the decision, never to a
         * member); a worker that sent none still names the call */
        static const char none[] = "{}";
        rq.pending_tool_intent.data =
            ask->intent_len ? (uint8_t *)ask->intent : (uint8_t *)(uintptr_t)none;
        rq.pending_tool_intent.len = ask->intent_len ? ask->intent_len : 2;
        char sum[SUMMARY_MAX + 1];
        snprintf(sum, sizeof sum, "agent %s asks to run %s (call %s)", name, rq.tool,
                 rq.tool_call_id);
        rq.summary = cut(&ar, sum, SUMMARY_MAX);
    }
    if (ar.failed) {
        snprintf(msg, msglen, "out of memory");
        rc = RPC_RESOURCE_EXHAUSTED;
        goto done;
    }
    bearer = orch_mint_scoped_token(o, ask->org, AUTH_SCOPE_APPROVALS_OPEN);
    rpc_call_opts opts = {.timeout_ms = OPEN_TIMEOUT_MS, .bearer = bearer};
    rc = rpc_unary_call(o->approvals, OPEN_METHOD, &rq.base,
                        &upsquad__approval__v1__open_approval_response__descriptor, &opts, &resp,
                        &st);
    if (rc != RPC_OK) {
        snprintf(msg, msglen, "ApprovalService.OpenApproval: %s",
                 st.message ? st.message : "call failed");
        goto done;
    }
    const A(OpenApprovalResponse) *r = (const void *)resp;
    if (!r->approval || !r->approval->id || strlen(r->approval->id) != 36) {
        snprintf(msg, msglen, "ApprovalService.OpenApproval answered no approval id");
        rc = RPC_INTERNAL;
        goto done;
    }
    orch_gate_row g = {.approval_id = r->approval->id,
                       .kind = ask->kind,
                       .tool = rq.tool,
                       .tool_call_id = rq.tool_call_id,
                       .message = ask->message,
                       /* a prompt's frozen turn; a delegation's intent (run once approved) */
                       .frozen = prompt  ? ask->frozen
                                 : deleg ? ask->intent
                                         : NULL,
                       .frozen_len = prompt  ? ask->frozen_len
                                     : deleg ? ask->intent_len
                                             : 0,
                       .clearance = clearance,
                       .holder = ask->holder};
    if (orch_store_gate_record(o->pool, ask->org, ask->sid, &g, err, sizeof err) != DB_OK) {
        snprintf(msg, msglen, "recording the gate: %s", err);
        rc = RPC_UNAVAILABLE;
        goto done;
    }
    snprintf(approval_id, 37, "%s", r->approval->id);
    log_info("gate.opened", "session %s: %s %s for %s (clearance %d)", ask->sid, ask->kind,
             approval_id, rq.tool, clearance);
    rc = RPC_OK;
done:
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_status_clear(&st);
    free(bearer);
    cJSON_Delete(q);
    orch_arena_free(&ar);
    return rc;
}

/* ---- resuming ---- */

/* answer_tool_result {tool_call_id, result}, built deterministically from the decision alone
 * (the same bytes whichever replica or redelivery resumes the turn):
 *   a prompt: result = {choice, text, answered_by} of the recorded answer (spec AskUserResume);
 *   a rejected or expired approval: result = {denied: true, approval_id, status, decided_by,
 *   comment}, spliced as the gated call's result instead of running it.
 * Heap, caller frees; NULL for an approved call (it runs). */
static char *answer_of(const orch_gate_take *t) {
    cJSON *d = cJSON_Parse(t->decision), *out = cJSON_CreateObject(), *res = cJSON_CreateObject();
    const char *status = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(d, "status"));
    const char *by = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(d, "decided_by"));
    const char *comment = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(d, "comment"));
    const cJSON *pay = cJSON_GetObjectItemCaseSensitive(d, "response_payload");
    char *text = NULL;
    status = status ? status : "";
    if (!strcmp(t->kind, "user_prompt")) {
        const char *ch = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(pay, "choice"));
        const char *tx = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(pay, "text"));
        const char *ab = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(pay, "answered_by"));
        cJSON_AddStringToObject(res, "choice", ch ? ch : "");
        cJSON_AddStringToObject(res, "text", tx ? tx : "");
        cJSON_AddStringToObject(res, "answered_by", ab ? ab : (by ? by : ""));
    } else if (!strcmp(status, "approved")) {
        goto done;
    } else {
        cJSON_AddBoolToObject(res, "denied", 1);
        cJSON_AddStringToObject(res, "approval_id", t->approval_id);
        cJSON_AddStringToObject(res, "status", status);
        cJSON_AddStringToObject(res, "decided_by", by ? by : "");
        cJSON_AddStringToObject(res, "comment", comment ? comment : "");
    }
    cJSON_AddStringToObject(out, "tool_call_id", t->tool_call_id);
    cJSON_AddItemToObject(out, "result", res);
    res = NULL;
    text = cJSON_PrintUnformatted(out);
done:
    cJSON_Delete(res);
    cJSON_Delete(out);
    cJSON_Delete(d);
    return text;
}

/* Re-initialises a worker from the frozen checkpoint (the newest: nothing ran since the park):
 * the worker re-enters the suspended turn (spec: InitWorkerSession.resume_checkpoint). *ck
 * (heap) is handed back for an AskUserResume of a denial. */
int orch_gate_rehydrate(orch *o, const orch_session *s, char worker[128], unsigned char **ck,
                        size_t *cklen, char *msg, size_t msglen) {
    char err[256];
    int loop = 0;
    SessionSnapshot *snap = NULL;
    int rc = orch_store_checkpoint_latest(o->pool, s->org_id, s->session_id, &loop, ck, cklen, err,
                                          sizeof err);
    if (rc != DB_OK && rc != ORCH_ENOTFOUND) {
        snprintf(msg, msglen, "reading the frozen checkpoint: %s", err);
        return RPC_UNAVAILABLE;
    }
    snap = (SessionSnapshot *)protobuf_c_message_unpack(
        &upsquad__runtime__v1__session_snapshot__descriptor, NULL, s->snapshot_len, s->snapshot);
    if (!snap) {
        snprintf(msg, msglen, "the session's snapshot does not decode");
        return RPC_INTERNAL;
    }
    orch_worker_init wi = {
        .snapshot = snap, .checkpoint = *ck, .checkpoint_len = *cklen, .loop = loop};
    rc = orch_session_init_worker(o, &wi, worker, msg, msglen);
    protobuf_c_message_free_unpacked(&snap->base, NULL);
    return rc;
}

/* The resumed turn could not start on a worker: it ends failed (the session active, ERROR),
 * so it does not count in flight until its bound. */
static void resume_failed(orch *o, rpc_call *call, const orch_gate_take *t, const orch_session *s,
                          const char *why) {
    char err[256];
    orch_turn_end e = {.agent_status = 4,
                       .loop_base = s->loop_count,
                       .error_code = "RESUME_FAILED",
                       .error_msg = why};
    log_error("gate.resume_failed", "session %s approval %s: %s", t->session_id, t->approval_id,
              why);
    if (orch_store_turn_end(o->pool, s->org_id, t->session_id, t->action_id, &e, err, sizeof err) !=
        DB_OK)
        log_error("store.turn_end", "session %s: %s", t->session_id, err);
    if (call) orch_chat_send_error(call, NULL, "RESUME_FAILED", why, 1);
}

int orch_gate_resume(orch *o, rpc_call *call, const char *org, const char *approval_id,
                     int *parked) {
    orch_gate_take t;
    orch_session s = {0};
    unsigned char *ck = NULL;
    size_t cklen = 0;
    char err[512], msg[512], worker[128] = "", *answer = NULL;
    int64_t timeout = o->cfg->step_timeout_ms;
    *parked = 0;
    if (call && rpc_deadline_ms(call) < timeout)
        timeout = rpc_deadline_ms(call) > 0 ? rpc_deadline_ms(call) : 1;
    int rc = orch_store_gate_take(o->pool, org, approval_id, (int)o->cfg->prior_turns,
                                  (size_t)o->cfg->prior_bytes, timeout + ORCH_TURN_END_SLACK_MS,
                                  o->instance, &t, err, sizeof err);
    if (rc == ORCH_ESTATE) return ORCH_ESTATE;
    if (rc != DB_OK) {
        log_warn("gate.take", "approval %s: %s", approval_id, err);
        return RPC_UNAVAILABLE;
    }
    log_info("gate.resumed", "session %s: %s %s decided; resuming the turn%s", t.session_id, t.kind,
             approval_id, call ? " on the waiting stream" : " (nobody listens)");
    if (call) orch_chat_send_resumed(call, NULL, t.resumed_ms, t.resumed_loop, approval_id);
    rc = orch_store_session_get(o->pool, org, t.session_id, 1, &s, err, sizeof err);
    if (rc != DB_OK) {
        log_error("gate.resume", "session %s: %s", t.session_id, err);
        rc = RPC_UNAVAILABLE;
        goto done;
    }
    answer = answer_of(&t);
    if (!answer && !strcmp(t.tool, ORCH_DELEGATE_TOOL)) {
        /* an approved delegation: the child runs now, and its result resumes the turn */
        orch_chat_turn pt = {.org = org,
                             .sid = t.session_id,
                             .s = &s,
                             .requester = s.user_id,
                             .message = t.message,
                             .parent = t.action_id,
                             .timeout_ms = timeout};
        orch_chat_state dst = {0};
        orch_turn_result dres = {0};
        snprintf(dst.deleg_call, sizeof dst.deleg_call, "%.64s", t.tool_call_id);
        dst.deleg_intent = strndup((const char *)t.frozen, t.frozen_len);
        rc = orch_delegate(o, call, &pt, &dst, &dres, &answer, worker, &ck, &cklen);
        if (rc != RPC_OK)
            resume_failed(o, call, &t, &s,
                          dres.error_message ? dres.error_message : "delegation failed");
        orch_chat_state_clear(&dst);
        orch_turn_result_clear(&dres);
        if (rc != RPC_OK) goto done;
    } else if ((rc = orch_gate_rehydrate(o, &s, worker, &ck, &cklen, msg, sizeof msg)) != RPC_OK) {
        resume_failed(o, call, &t, &s, msg);
        goto done;
    }
    Upsquad__Runtime__V1__AskUserResume aur = UPSQUAD__RUNTIME__V1__ASK_USER_RESUME__INIT;
    if (answer) {
        /* a prompt hands back its frozen turn; a denial (or a delegation's result) the frozen
         * checkpoint it resumes */
        int prompt = !strcmp(t.kind, "user_prompt");
        aur.checkpoint.data = prompt ? t.frozen : ck;
        aur.checkpoint.len = prompt ? t.frozen_len : cklen;
        aur.answer_tool_result.data = (uint8_t *)answer;
        aur.answer_tool_result.len = strlen(answer);
    }
    orch_chat_turn ct = {.org = org,
                         .sid = t.session_id,
                         .s = &s,
                         .requester = s.user_id,
                         .message = t.message,
                         .turns = t.turns,
                         .nturns = t.nturns,
                         .parent = t.action_id,
                         .prefer_worker = worker,
                         .resume = answer ? &aur : NULL,
                         .timeout_ms = timeout};
    /* a cycle's gate re-enters its cycle, the plan going on after it; a chat turn's the turn */
    rc = orch_auto_resume(o, call, &ct, approval_id, parked);
done:
    free(answer);
    free(ck);
    orch_session_clear(&s);
    orch_gate_take_clear(&t);
    return rc;
}

/* ---- the decision consumer ---- */

typedef struct gate_consumer {
    orch *o;
    pthread_t th;
    int started;
    atomic_int stop;
    atomic_int resumes; /* headless resumes running */
    bus_pull *pull;
} gate_consumer;

static gate_consumer G;

/* The decision as stored on the gate: {status, decided_by, comment, response_payload}. */
static char *decision_json(const A(ApprovalDecided) * ev) {
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "status", ev->status ? ev->status : "");
    cJSON_AddStringToObject(d, "decided_by", ev->decided_by ? ev->decided_by : "");
    cJSON_AddStringToObject(d, "comment", ev->comment ? ev->comment : "");
    cJSON *p = ev->response_payload ? pbjson_struct_to_json(ev->response_payload) : NULL;
    cJSON_AddItemToObject(d, "response_payload", p ? p : cJSON_CreateObject());
    char *s = cJSON_PrintUnformatted(d);
    cJSON_Delete(d);
    return s;
}

typedef struct headless {
    char org[37], approval_id[37];
} headless;

static void *headless_main(void *arg) {
    headless *h = arg;
    int parked = 0;
    orch_gate_resume(G.o, NULL, h->org, h->approval_id, &parked);
    free(h);
    atomic_fetch_sub(&G.resumes, 1);
    return NULL;
}

/* A resume nobody's stream waits for, on a thread of its own; 0 when started. */
static int resume_headless(const char *org, const char *approval_id) {
    if (atomic_fetch_add(&G.resumes, 1) >= RESUMES_MAX) {
        atomic_fetch_sub(&G.resumes, 1);
        return -1;
    }
    headless *h = calloc(1, sizeof *h);
    pthread_t th;
    pthread_attr_t at;
    if (!h) goto fail;
    snprintf(h->org, sizeof h->org, "%s", org);
    snprintf(h->approval_id, sizeof h->approval_id, "%s", approval_id);
    pthread_attr_init(&at);
    pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&th, &at, headless_main, h);
    pthread_attr_destroy(&at);
    if (rc == 0) return 0;
    free(h);
fail:
    atomic_fetch_sub(&G.resumes, 1);
    return -1;
}

static void handle(natsMsg *m) {
    orch *o = G.o;
    char err[256], holder[161], sid[37];
    int where = ORCH_GATE_UNKNOWN;
    A(ApprovalDecided) *ev = (A(ApprovalDecided) *)protobuf_c_message_unpack(
        &upsquad__approval__v1__approval_decided__descriptor, NULL,
        (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    char want[128];
    /* a run's gate is the engine's; the subject names the org the message speaks for */
    if (ev && ev->org_id && bus_token_valid(ev->org_id))
        snprintf(want, sizeof want, "%s.%s", SUBJ_APPROVAL_DECIDED, ev->org_id);
    else
        want[0] = 0;
    if (!ev || !ev->session_id || !ev->session_id[0] || !want[0] ||
        strcmp(want, natsMsg_GetSubject(m)) || !ev->approval_id || strlen(ev->approval_id) != 36) {
        bus_ack(m);
        goto done;
    }
    char *dj = decision_json(ev);
    int rc = dj ? orch_store_gate_decided(o->pool, ev->org_id, ev->approval_id, dj, &where, holder,
                                          sid, err, sizeof err)
                : DB_ENOMEM;
    free(dj);
    int n = bus_delivery_count(m);
    if (rc != DB_OK) {
        log_warn("gate.decision", "approval %s: %s; retrying", ev->approval_id, err);
        bus_nak(m, RESUME_BUSY_MS);
    } else if (where == ORCH_GATE_UNKNOWN || where == ORCH_GATE_DONE) {
        bus_ack(m);
    } else if (where == ORCH_GATE_EARLY) {
        if (n < EARLY_TRIES) {
            bus_nak(m, EARLY_DELAY_MS);
        } else {
            log_warn("gate.never_parked",
                     "session %s: approval %s decided, but the turn that "
                     "opened it never parked",
                     sid, ev->approval_id);
            bus_term(m);
        }
    } else if (holder[0] && n <= HOLDER_DELIVERIES) {
        /* a stream waits on the park (here or on another replica): it resumes the turn there */
        log_info("gate.deferred",
                 "session %s: approval %s decided; the stream waiting on %s "
                 "resumes it",
                 sid, ev->approval_id, holder);
        bus_nak(m, HOLDER_GRACE_MS);
    } else if (resume_headless(ev->org_id, ev->approval_id) == 0) {
        bus_ack(m); /* the take is durable from here; a crash mid-turn is a dead turn */
    } else {
        bus_nak(m, RESUME_BUSY_MS);
    }
done:
    if (ev) protobuf_c_message_free_unpacked(&ev->base, NULL);
}

static void pause_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static int setup(orch *o) {
    char err[256];
    const char *subjects[] = {STREAM_APPROVALS_SUBJECTS};
    if (!bus_connected(o->bus)) return -1;
    /* the engine makes the stream too (the same configuration): whichever starts first */
    int rc = bus_js_stream_ensure(o->bus, STREAM_APPROVALS, subjects, 1, BUS_RETENTION_LIMITS,
                                  STREAM_APPROVALS_MAX_AGE_S, NULL, err, sizeof err) ||
             bus_js_pull_subscribe_ex(o->bus, STREAM_APPROVALS, o->cfg->approvals_durable,
                                      STREAM_APPROVALS_SUBJECTS, ACK_WAIT_MS, -1, 1, &G.pull, err,
                                      sizeof err);
    if (rc) log_warn("gate.setup", "approval decisions not consumed yet (%s); retrying", err);
    return rc;
}

static void *consume(void *arg) {
    orch *o = arg;
    char err[256];
    while (!atomic_load(&G.stop) && !G.pull) {
        if (setup(o) == 0) break;
        for (int w = 0; w < 20 && !atomic_load(&G.stop); w++)
            pause_ms(100);
    }
    while (!atomic_load(&G.stop)) {
        natsMsgList list = {0};
        if (bus_js_fetch(G.pull, 16, 1000, &list, err, sizeof err) != BUS_OK) {
            if (!atomic_load(&G.stop)) pause_ms(200);
            continue;
        }
        for (int k = 0; k < list.Count; k++)
            handle(list.Msgs[k]);
        natsMsgList_Destroy(&list);
    }
    return NULL;
}

int orch_gate_start(orch *o, char *err, size_t errlen) {
    /* no NATS: chat gates open, and only a waiting stream resumes them; "none": this replica
     * leaves the decisions to the others of its deployment (its streams still resume theirs) */
    if (!o->bus || !strcmp(o->cfg->approvals_durable, "none")) return 0;
    G.o = o;
    atomic_store(&G.stop, 0);
    if (pthread_create(&G.th, NULL, consume, o))
        return snprintf(err, errlen, "cannot start the approval decision consumer"), -1;
    G.started = 1;
    log_info("gate.started", "consuming %s (durable %s)", STREAM_APPROVALS_SUBJECTS,
             o->cfg->approvals_durable);
    return 0;
}

void orch_gate_stop(orch *o) {
    (void)o;
    if (!G.started) return;
    atomic_store(&G.stop, 1);
    pthread_join(G.th, NULL);
    G.started = 0;
    /* resumes running with nobody listening finish their turn (bounded by the step timeout);
     * the process waits up to 30 s for them (a terminating pod's grace), then their leases
     * let another replica end them */
    for (int i = 0; i < 300 && atomic_load(&G.resumes) > 0; i++)
        pause_ms(100);
    bus_pull_close(G.pull);
    G.pull = NULL;
}
