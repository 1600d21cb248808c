/* Workflow agent steps (docs/orchestrator.md, "Agent steps for workflows").
 *
 * UPSQUAD_AGENT_STEPS_CONCURRENCY threads per replica bind the durable pull consumer
 * DURABLE_AGENT_STEPS of the work-queue stream AGENT_STEPS (replicas share it). For each
 * AgentStepDispatch:
 *   1. claim the idempotency key in step_results: a key whose result is recorded is answered by
 *      publishing that result again (same Nats-Msg-Id), never run twice;
 *   2. run one stateless single turn with the agent of the step's role in the run's org, in a
 *      fresh session (kind 'step'), on the worker pool;
 *   3. tee its live frames to wfio.<org>.<run> (NodeIOEvent: token text coalesced up to 256 bytes
 *      or 50 ms, tool calls and results, status; seq monotonic per (run, step, session); tool
 *      events and the final assistant message also carry their TranscriptEvent);
 *   4. record the AgentStepResult, publish it on agent.step.result.<org>.<run> (Nats-Msg-Id =
 *      the idempotency key), then ack the dispatch.
 * An interrupt_required turn (a gated tool call) carries its InterruptGate: the tool's clearance
 * from the agent's policy and the worker's frozen checkpoint; a dispatch with resume_checkpoint
 * (the decided gate) restores a worker with it and runs the same message there, re-entering
 * only the gated call (docs/orchestrator.md "Workflow agent steps: in-step approvals").
 * A long step keeps its dispatch with in-progress acks every 10 s. An undecodable dispatch is
 * terminated (never redelivered) with an error log. An AgentStepCancel (AGENT_CANCELS, read by
 * every replica) cancels the attempt's worker call, or answers its dispatch "cancelled" when it
 * is picked up later. */
#include <stdatomic.h>
#include <cjson/cJSON.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "agentdef.h"
#include "ids.h"
#include "log.h"
#include "orch.h"
#include "pbjson.h"
#include "session.h"
#include "subjects.h"
#include "upsquad/internal/v1/agent_step.pb-c.h"
#include "upsquad/internal/v1/node_io.pb-c.h"
#include "util.h"

typedef Upsquad__Internal__V1__AgentStepDispatch Dispatch;
typedef Upsquad__Internal__V1__AgentStepResult StepResult;
typedef Upsquad__Internal__V1__NodeIOEvent NodeIOEvent;
typedef Upsquad__Workflow__V1__NodeIOFrame NodeIOFrame;

#define STEPS_MAX_THREADS 64
#define COALESCE_BYTES 256
#define COALESCE_MS 50
#define ACK_WAIT_MS 30000
#define IN_PROGRESS_MS 10000
#define SUMMARY_MAX 512
#define HANDBACK_MS 200 /* how often a running step gives back dispatches sent to its consumer */
#define RECENT_CANCELS 1024 /* keys of cancelled attempts remembered (a ring: oldest forgotten) */

/* The attempt a consumer thread runs, for AgentStepCancel (one slot per consumer thread). */
typedef struct step_slot {
    char key[65]; /* "" when idle */
    atomic_int cancelled;
    bus_pull *pull; /* this consumer's subscription (borrowed) */
} step_slot;

struct orch_steps {
    orch *o;
    bus_pull *pull[STEPS_MAX_THREADS];
    pthread_t th[STEPS_MAX_THREADS];
    int n;
    atomic_int stop; /* set by orch_steps_stop, read by the consumers */
    bus_sub *cancel_sub;
    pthread_mutex_t cmu; /* guards slots and recent */
    step_slot slots[STEPS_MAX_THREADS];
    char recent[RECENT_CANCELS][65];
    size_t recent_next;
};

static void pause_ms(long ms);

/* ---- the tee ---- */

typedef struct tee {
    orch *o;
    const Dispatch *d;
    const char *session_id;
    char subject[256];
    pthread_mutex_t mu;
    int64_t seq;  /* frames published (NodeIOFrame.seq) */
    int32_t tseq; /* transcript events (TranscriptEvent.seq) */
    char buf[COALESCE_BYTES * 4 + 64];
    size_t blen;
    int64_t first_ms;
    natsMsg *msg; /* the dispatch (in-progress acks) */
    int64_t last_progress;
    bus_pull *pull; /* the consumer's subscription (hand_back) */
    int64_t last_handback;
    atomic_int *cancelled; /* the slot's flag: set by an AgentStepCancel of this attempt */
} tee;

static void publish(tee *t, NodeIOFrame *frame, Upsquad__Workflow__V1__TranscriptEvent *tr) {
    NodeIOEvent ev = UPSQUAD__INTERNAL__V1__NODE_IOEVENT__INIT;
    char err[256];
    ev.org_id = t->d->org_id;
    ev.run_id = t->d->run_id;
    ev.action_id = t->d->action_id;
    ev.step_name = t->d->step_name;
    ev.iteration = t->d->iteration;
    if (frame) {
        frame->node_id = t->d->step_name;
        frame->session_id = (char *)t->session_id;
        frame->iteration = t->d->iteration;
        frame->seq = ++t->seq;
        ev.frame = frame;
    }
    ev.transcript = tr;
    size_t len = protobuf_c_message_get_packed_size(&ev.base);
    uint8_t *b = malloc(len ? len : 1);
    if (!b) return;
    protobuf_c_message_pack(&ev.base, b);
    /* a JetStream publish also reaches the hub's live (core) subscribers: one publish */
    if (bus_js_publish(t->o->bus, t->subject, b, (int)len, NULL, NULL, err, sizeof err) != BUS_OK)
        log_warn("steps.wfio",
                 "run %s step %s: frame %lld not published (%s); the seq gap "
                 "tells readers",
                 t->d->run_id, t->d->step_name, (long long)t->seq, err);
    free(b);
}

static void flush_locked(tee *t) {
    if (t->blen == 0) return;
    NodeIOFrame f = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__INIT;
    t->buf[t->blen] = 0;
    f.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOKEN_TEXT;
    f.token_text = t->buf;
    publish(t, &f, NULL);
    t->blen = 0;
}

static Upsquad__Workflow__V1__TranscriptEvent *transcript(tee *t, const char *type, cJSON *content,
                                                          Google__Protobuf__Struct **s) {
    Upsquad__Workflow__V1__TranscriptEvent *e = calloc(1, sizeof *e);
    Google__Protobuf__Timestamp *ts = calloc(1, sizeof *ts);
    char err[128];
    if (!e || !ts || pbjson_struct_from_json(content, s, err, sizeof err)) {
        free(e);
        free(ts);
        return NULL;
    }
    upsquad__workflow__v1__transcript_event__init(e);
    pbjson_ts_now(ts);
    e->session_id = (char *)t->session_id;
    e->seq = ++t->tseq;
    e->event_type = (char *)type;
    e->content = *s;
    e->created_at = ts;
    return e;
}

static void transcript_free(Upsquad__Workflow__V1__TranscriptEvent *e,
                            Google__Protobuf__Struct *s) {
    if (s) pbjson_struct_free(s);
    if (e) free(e->created_at);
    free(e);
}

static char *clamp(const char *s, char *out, size_t cap) {
    size_t n = strlen(s);
    if (n >= cap) {
        n = cap - 4;
        while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
            n--;
        memcpy(out, s, n);
        memcpy(out + n, "...", 4);
    } else {
        memcpy(out, s, n + 1);
    }
    return out;
}

static const char *status_name(int s) {
    static const char *n[] = {"unspecified", "thinking", "acting",
                              "complete",    "error",    "suspended"};
    return s >= 0 && s <= 5 ? n[s] : "unspecified";
}

static int tee_event(void *ud, const ExecuteStepEvent *ev) {
    tee *t = ud;
    NodeIOFrame f = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__INIT;
    Upsquad__Workflow__V1__NodeToolCall tc = UPSQUAD__WORKFLOW__V1__NODE_TOOL_CALL__INIT;
    Upsquad__Workflow__V1__NodeToolResult tr = UPSQUAD__WORKFLOW__V1__NODE_TOOL_RESULT__INIT;
    char summary[SUMMARY_MAX];
    pthread_mutex_lock(&t->mu);
    switch (ev->event_case) {
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOKEN: {
        const char *x = ev->token->text;
        size_t n = strlen(x);
        if (t->blen + n > sizeof t->buf - 1) flush_locked(t);
        if (n > sizeof t->buf - 1) n = sizeof t->buf - 1;
        if (t->blen == 0) t->first_ms = util_mono_ms();
        memcpy(t->buf + t->blen, x, n);
        t->blen += n;
        if (t->blen >= COALESCE_BYTES) flush_locked(t);
        break;
    }
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STATUS:
        flush_locked(t);
        f.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_STATUS;
        f.status = (char *)status_name(ev->status->status);
        publish(t, &f, NULL);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_CALL: {
        flush_locked(t);
        cJSON *args = ev->tool_call->arguments ? pbjson_struct_to_json(ev->tool_call->arguments)
                                               : cJSON_CreateObject();
        char *a = args ? cJSON_PrintUnformatted(args) : NULL;
        tc.tool_name = ev->tool_call->tool_name;
        tc.tool_call_id = ev->tool_call->tool_call_id;
        tc.args_summary = clamp(a ? a : "{}", summary, sizeof summary);
        f.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOOL_CALL;
        f.tool_call = &tc;
        cJSON *c = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "tool_name", tc.tool_name);
        cJSON_AddStringToObject(c, "tool_call_id", tc.tool_call_id);
        cJSON_AddItemToObject(c, "arguments", args ? args : cJSON_CreateObject());
        Google__Protobuf__Struct *s = NULL;
        Upsquad__Workflow__V1__TranscriptEvent *te = transcript(t, "tool_call", c, &s);
        publish(t, &f, te);
        transcript_free(te, s);
        cJSON_Delete(c);
        free(a);
        break;
    }
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT: {
        flush_locked(t);
        const Upsquad__Runtime__V1__ToolResultEvent *r = ev->tool_result;
        tr.tool_call_id = r->tool_call_id;
        tr.tool_name = r->tool_name;
        tr.summary = clamp(r->result, summary, sizeof summary);
        tr.is_error = r->is_error;
        tr.duration_ms = r->duration_ms;
        f.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOOL_RESULT;
        f.tool_result = &tr;
        cJSON *c = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "tool_call_id", r->tool_call_id);
        cJSON_AddStringToObject(c, "tool_name", r->tool_name);
        cJSON_AddStringToObject(c, "result", r->result);
        cJSON_AddBoolToObject(c, "is_error", r->is_error);
        cJSON_AddNumberToObject(c, "duration_ms", r->duration_ms);
        Google__Protobuf__Struct *s = NULL;
        Upsquad__Workflow__V1__TranscriptEvent *te = transcript(t, "tool_result", c, &s);
        publish(t, &f, te);
        transcript_free(te, s);
        cJSON_Delete(c);
        break;
    }
    default:
        break; /* metrics, security, checkpoints, ...: not node I/O */
    }
    pthread_mutex_unlock(&t->mu);
    return 1;
}

/* A fetch that ended early can leave its pull request alive at the server, which then hands the
 * next dispatch to this consumer's subscription while the consumer runs a long step: such a
 * message would wait out the ack wait (30 s). It is given back at once (nak without delay) so
 * an idle consumer, of this replica or another, takes it. */
static void hand_back(bus_pull *p) {
    int n = bus_pull_pending(p);
    natsMsgList l = {0};
    char err[128];
    if (n <= 0) return;
    if (bus_js_fetch(p, n > 16 ? 16 : n, 1, &l, err, sizeof err) == BUS_OK)
        for (int k = 0; k < l.Count; k++) {
            bus_nak(l.Msgs[k], 0);
            log_info("steps.hand_back", "a dispatch delivered to a busy consumer: given back");
        }
    natsMsgList_Destroy(&l);
}

/* Polled by the cancellation watcher every ~20 ms: flushes coalesced tokens after 50 ms and
 * keeps the dispatch from being redelivered while the step runs. */
static int tee_poll(void *ud) {
    tee *t = ud;
    int64_t now = util_mono_ms();
    pthread_mutex_lock(&t->mu);
    if (t->blen && now - t->first_ms >= COALESCE_MS) flush_locked(t);
    if (now - t->last_progress >= IN_PROGRESS_MS) {
        bus_in_progress(t->msg);
        t->last_progress = now;
    }
    int handback = now - t->last_handback >= HANDBACK_MS;
    if (handback) t->last_handback = now;
    pthread_mutex_unlock(&t->mu);
    if (handback) hand_back(t->pull); /* a fetch and naks: not under the lock the tee takes */
    return t->cancelled && atomic_load(t->cancelled); /* non-zero: the worker call is cancelled */
}

/* ---- cancellation (AgentStepCancel) ---- */

/* The slot of this consumer now runs `key`; a key cancelled before it got here starts
 * cancelled. */
static step_slot *slot_begin(orch_steps *s, int i, const char *key) {
    step_slot *sl = &s->slots[i];
    int hit = 0;
    pthread_mutex_lock(&s->cmu);
    snprintf(sl->key, sizeof sl->key, "%s", key);
    for (size_t k = 0; k < RECENT_CANCELS && !hit; k++)
        hit = s->recent[k][0] && !strcmp(s->recent[k], key);
    atomic_store(&sl->cancelled, hit);
    pthread_mutex_unlock(&s->cmu);
    return sl;
}

static void slot_end(orch_steps *s, step_slot *sl) {
    pthread_mutex_lock(&s->cmu);
    sl->key[0] = 0;
    atomic_store(&sl->cancelled, 0);
    pthread_mutex_unlock(&s->cmu);
}

/* AGENT_CANCELS callback (every replica sees every cancel): cancel the attempt if it runs here,
 * and remember the key so a dispatch of it picked up later is not run. */
static void on_cancel(bus *b, natsMsg *m, void *ud) {
    (void)b;
    orch_steps *s = ud;
    Upsquad__Internal__V1__AgentStepCancel *c = upsquad__internal__v1__agent_step_cancel__unpack(
        NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    if (c && strlen(c->idempotency_key) == 64) {
        int running = 0;
        pthread_mutex_lock(&s->cmu);
        snprintf(s->recent[s->recent_next], sizeof s->recent[0], "%s", c->idempotency_key);
        s->recent_next = (s->recent_next + 1) % RECENT_CANCELS;
        for (int i = 0; i < STEPS_MAX_THREADS; i++)
            if (s->slots[i].key[0] && !strcmp(s->slots[i].key, c->idempotency_key)) {
                atomic_store(&s->slots[i].cancelled, 1);
                running = 1;
            }
        pthread_mutex_unlock(&s->cmu);
        if (running)
            log_info("steps.cancel", "run %s step %s: cancelled (%s); stopping the worker call",
                     c->run_id, c->step_name, c->reason);
        else
            log_debug("steps.cancel", "run %s step %s: cancelled (%s); not running here", c->run_id,
                      c->step_name, c->reason);
    }
    if (c) protobuf_c_message_free_unpacked(&c->base, NULL);
}

/* ---- one dispatch ---- */

static int key_cmp(const void *a, const void *b) {
    return strcmp((*(cJSON *const *)a)->string, (*(cJSON *const *)b)->string);
}

/* Orders every object's members by key, recursively: a Struct is a map, so the order it
 * arrives in says nothing (the engine's input comes back from jsonb in its own order), and the
 * same step must render the same message on every attempt. */
static void sort_keys(cJSON *j) {
    cJSON *it;
    if (cJSON_IsObject(j) && j->child) {
        size_t n = 0, k = 0;
        for (it = j->child; it; it = it->next)
            n++;
        cJSON **v = malloc(n * sizeof *v);
        if (v) {
            for (it = j->child; it; it = it->next)
                v[k++] = it;
            qsort(v, n, sizeof *v, key_cmp);
            for (k = 0; k < n; k++) {
                v[k]->prev = k ? v[k - 1] : v[n - 1]; /* cJSON: child->prev is the last item */
                v[k]->next = k + 1 < n ? v[k + 1] : NULL;
            }
            j->child = v[0];
            free(v);
        }
    }
    for (it = j ? j->child : NULL; it; it = it->next)
        sort_keys(it);
}

static char *compose(const Dispatch *d) {
    char *out = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&out, &len);
    if (!f) return NULL;
    fputs(d->goal, f);
    if (d->input && d->input->n_fields) {
        cJSON *j = pbjson_struct_to_json(d->input);
        sort_keys(j);
        char *s = j ? cJSON_PrintUnformatted(j) : NULL;
        if (s) fprintf(f, "\n\nInput: %s", s);
        free(s);
        cJSON_Delete(j);
    }
    if (d->n_expects) {
        fputs("\n\nAnswer with a JSON object with these fields:", f);
        for (size_t i = 0; i < d->n_expects; i++)
            fprintf(f, "\n- %s (%s%s)%s%s", d->expects[i]->name, d->expects[i]->type,
                    d->expects[i]->required ? ", required" : "",
                    d->expects[i]->description[0] ? ": " : "", d->expects[i]->description);
    }
    if (d->feedback[0]) fprintf(f, "\n\nThe previous attempt was rejected: %s", d->feedback);
    fclose(f);
    return out;
}

static Google__Protobuf__Struct *output_of(const char *text) {
    cJSON *j = cJSON_Parse(text);
    Google__Protobuf__Struct *s = NULL;
    char err[128];
    if (!cJSON_IsObject(j)) {
        cJSON_Delete(j);
        j = cJSON_CreateObject();
        cJSON_AddStringToObject(j, "text", text);
    }
    if (pbjson_struct_from_json(j, &s, err, sizeof err)) s = NULL;
    cJSON_Delete(j);
    return s;
}

static int publish_result(orch *o, const Dispatch *d, const uint8_t *b, size_t len) {
    char subj[256], err[256];
    int dup = 0;
    if (bus_subject(subj, sizeof subj, "agent", "step", "result", d->org_id, d->run_id, NULL))
        return -1;
    if (bus_js_publish(o->bus, subj, b, (int)len, d->idempotency_key, &dup, err, sizeof err)) {
        log_warn("steps.result",
                 "run %s step %s: result not published (%s); retried on "
                 "redelivery",
                 d->run_id, d->step_name, err);
        return -1;
    }
    return 0;
}

static void fail(StepResult *r, Upsquad__Internal__V1__StepFailed *f, const char *code,
                 const char *msg, int retryable) {
    f->code = (char *)code;
    f->message = (char *)msg;
    f->retryable = retryable;
    r->outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_FAILED;
    r->failed = f;
}

/* ---- an approval interrupt: its clearance and its frozen checkpoint ---- */

#define CHECKPOINT_POLL "/upsquad.runtime.v1.RuntimeService/Checkpoint"
#define FROZEN_POLL_TIMEOUT_MS 3000
#define FROZEN_WAIT_MS 3000
#define FROZEN_STEP_MS 25
/* the AgentStepResult carrying it must fit one NATS message (max_payload, 1 MiB by default) */
#define FROZEN_MAX_BYTES (768 * 1024)

/* The worker-side Checkpoint poll ("serialise and return state", spec CheckpointRequest) on
 * the worker that ran the turn. 0 with *ck (heap) when it answered a well-formed state. */
static int poll_frozen(orch *o, const char *org, const char *sid, const char *addr, uint8_t **ck,
                       size_t *len) {
    orch_worker *k = addr[0] ? orch_workers_find(o->workers, addr) : NULL;
    if (!k) return -1;
    Upsquad__Runtime__V1__CheckpointRequest rq = UPSQUAD__RUNTIME__V1__CHECKPOINT_REQUEST__INIT;
    rq.session_id = (char *)sid;
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    char *bearer = orch_mint_call_token(o, org), hex[65];
    rpc_call_opts opts = {.timeout_ms = FROZEN_POLL_TIMEOUT_MS, .bearer = bearer};
    int rc = -1;
    if (rpc_unary_call(k->ch, CHECKPOINT_POLL, &rq.base,
                       &upsquad__runtime__v1__checkpoint_response__descriptor, &opts, &resp,
                       &st) == RPC_OK) {
        const Upsquad__Runtime__V1__CheckpointResponse *r = (const void *)resp;
        /* the blob as RuntimeService.Checkpoint takes it: version prefix, bound, digest */
        if (r->state.len >= 4 && (long long)r->state.len <= o->cfg->checkpoint_max) {
            ids_sha256_hex(r->state.data, r->state.len, hex);
            if (!r->hash[0] || !strcasecmp(r->hash, hex)) {
                *ck = malloc(r->state.len);
                if (*ck) {
                    memcpy(*ck, r->state.data, r->state.len);
                    *len = r->state.len;
                    rc = 0;
                }
            }
        }
    }
    if (rc)
        log_warn("steps.frozen_poll", "session %s: the worker's Checkpoint poll gave no state (%s)",
                 sid, st.message ? st.message : "malformed or oversized state");
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_status_clear(&st);
    free(bearer);
    return rc;
}

/* The worker's state frozen at the interrupt: the worker suspends and ends the loop iteration
 * it was in with the suspension in its state before the stream closes, but reports that
 * checkpoint (RuntimeService.Checkpoint) asynchronously, a moment later. So the worker is asked
 * first; one that cannot answer leaves the newest checkpoint stored for the session (a fresh
 * session per attempt: every one is this turn's), waited for up to FROZEN_WAIT_MS. Nothing
 * (*len 0): the gate resumes as a fresh attempt (docs/orchestrator.md). *ck: caller frees. */
static void frozen_checkpoint(orch *o, const char *org, const char *sid, const char *worker,
                              uint8_t **ck, size_t *len) {
    char err[256];
    int loop = 0;
    *ck = NULL;
    *len = 0;
    if (poll_frozen(o, org, sid, worker, ck, len) == 0) goto bound;
    for (int64_t t0 = util_mono_ms(); util_mono_ms() - t0 < FROZEN_WAIT_MS;) {
        unsigned char *b = NULL;
        size_t n = 0;
        int rc = orch_store_checkpoint_latest(o->pool, org, sid, &loop, &b, &n, err, sizeof err);
        if (rc == DB_OK) {
            *ck = b;
            *len = n;
            goto bound;
        }
        if (rc != ORCH_ENOTFOUND) break;
        pause_ms(FROZEN_STEP_MS);
    }
    log_warn("steps.no_frozen",
             "session %s: no frozen checkpoint for the interrupt; its approval "
             "will start a fresh attempt",
             sid);
    return;
bound:
    if (*len <= FROZEN_MAX_BYTES) return;
    log_warn("steps.frozen_too_large",
             "session %s: the frozen checkpoint (%zu bytes) exceeds %d bytes; its approval will "
             "start a fresh attempt",
             sid, *len, FROZEN_MAX_BYTES);
    free(*ck);
    *ck = NULL;
    *len = 0;
}

/* An approved or rejected interrupt's attempt: a worker initialised with the frozen checkpoint
 * (the turn then runs there: worker out). RPC status with msg as orch_session_init_worker's. */
static int reenter(orch *o, const Dispatch *d, const SessionSnapshot *snap, char worker[128],
                   char *msg, size_t msglen) {
    orch_worker_init wi = {.snapshot = snap,
                           .checkpoint = d->resume_checkpoint.data,
                           .checkpoint_len = d->resume_checkpoint.len};
    int rc = orch_session_init_worker(o, &wi, worker, msg, msglen);
    if (rc == RPC_OK)
        log_info("steps.reenter", "run %s step %s: worker %s restored the frozen turn (%s)",
                 d->run_id, d->step_name, worker,
                 d->ask_user_resume ? "the gated call was rejected" : "the gated call approved");
    return rc;
}

/* No live worker: the dispatch waits (nak, redelivered 2 s later) until its
 * UPSQUAD_AGENT_STEP_NO_WORKER_DELIVERIES-th delivery; then the step is reported failed,
 * NO_WORKER, retryable, and the engine's retry policy decides (a fresh attempt after its
 * backoff, or the step fails) instead of the step waiting out its whole timeout. */
static int no_worker_final(orch *o, natsMsg *msg) {
    return bus_delivery_count(msg) >= o->cfg->no_worker_deliveries;
}

/* Returns 0 to ack, -1 to nak (retry later). sl: this consumer's slot, already holding the key. */
static int run_step(orch *o, const Dispatch *d, natsMsg *msg, step_slot *sl) {
    char err[512], sid[37] = "", hash[65], emsg[768];
    unsigned char *prior = NULL;
    size_t plen = 0;
    int rc = orch_store_step_claim(o->pool, d->org_id, d->idempotency_key, d->run_id, &prior, &plen,
                                   err, sizeof err);
    if (rc == ORCH_EREPLAY) {
        /* answered from the record: the turn never runs twice */
        metric_inc(o->m_steps_replayed);
        log_info("steps.replayed", "run %s step %s: redelivered dispatch answered from the record",
                 d->run_id, d->step_name);
        rc = publish_result(o, d, prior, plen);
        free(prior);
        return rc;
    }
    if (rc != DB_OK) {
        log_error("steps.claim", "run %s step %s: %s", d->run_id, d->step_name, err);
        return -1;
    }
    StepResult r = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__INIT;
    Upsquad__Internal__V1__StepFailed failed = UPSQUAD__INTERNAL__V1__STEP_FAILED__INIT;
    Upsquad__Internal__V1__StepCompleted done = UPSQUAD__INTERNAL__V1__STEP_COMPLETED__INIT;
    Upsquad__Runtime__V1__TokenUsage usage = UPSQUAD__RUNTIME__V1__TOKEN_USAGE__INIT;
    Google__Protobuf__Timestamp fin = GOOGLE__PROTOBUF__TIMESTAMP__INIT;
    Upsquad__Internal__V1__InterruptGate gate = UPSQUAD__INTERNAL__V1__INTERRUPT_GATE__INIT;
    orch_agent_row agent = {0};
    orch_session s = {0};
    orch_arena a = {0};
    orch_turn_result res = {0};
    SessionSnapshot *snap = NULL;
    ExecuteStepRequest *req = NULL;
    char *message = NULL;
    r.idempotency_key = d->idempotency_key;
    r.org_id = d->org_id;
    r.run_id = d->run_id;
    r.action_id = d->action_id;
    r.step_name = d->step_name;
    r.iteration = d->iteration;
    r.attempt = d->attempt;
    if (atomic_load(&sl->cancelled)) { /* cancelled before it started: never run */
        fail(&r, &failed, "cancelled", "the step was cancelled before it started", 0);
        goto record;
    }
    rc = orch_store_agent_by_role(o->pool, d->org_id, d->agent_role, &agent, err, sizeof err);
    if (rc == ORCH_ENOTFOUND) {
        snprintf(emsg, sizeof emsg, "no agent with role \"%s\" in org %s", d->agent_role,
                 d->org_id);
        fail(&r, &failed, "agent_not_found", emsg, 0);
        goto record;
    }
    if (rc != DB_OK) goto retry;
    r.agent_id = agent.agent_id;
    orch_new_session n = {.org = d->org_id,
                          .user = d->triggered_by[0] ? d->triggered_by : "workflow",
                          .agent_id = agent.agent_id,
                          .kind = "step",
                          .mode = 1 /* stateless single turn */};
    rc = orch_session_start(o, &n, sid, hash, emsg, sizeof emsg);
    if (rc != RPC_OK) {
        if (rc == RPC_UNAVAILABLE && !no_worker_final(o, msg)) goto retry;
        if (rc == RPC_UNAVAILABLE)
            fail(&r, &failed, "NO_WORKER", emsg, 1);
        else
            fail(&r, &failed, "session_failed", emsg, 0);
        goto record;
    }
    r.session_id = sid;
    message = compose(d);
    if (!message ||
        orch_store_session_get(o->pool, d->org_id, sid, 1, &s, err, sizeof err) != DB_OK ||
        orch_request_build(o, &a, &s, message, 1, NULL, 0, &req, &snap))
        goto retry;
    req->ask_user_resume = d->ask_user_resume;
    char worker[128] = "";
    if (d->resume_checkpoint.len) {
        rc = reenter(o, d, snap, worker, emsg, sizeof emsg);
        if (rc == RPC_UNAVAILABLE && !no_worker_final(o, msg)) goto retry;
        if (rc == RPC_UNAVAILABLE) {
            fail(&r, &failed, "NO_WORKER", emsg, 1);
            goto record;
        }
        /* the worker refused the checkpoint: another attempt cannot do better */
        if (rc != RPC_OK) {
            fail(&r, &failed, "RESUME_REFUSED", emsg, 0);
            goto record;
        }
    }
    tee t = {.o = o,
             .d = d,
             .session_id = sid,
             .msg = msg,
             .last_progress = util_mono_ms(),
             .cancelled = &sl->cancelled,
             .pull = sl->pull};
    pthread_mutex_init(&t.mu, NULL);
    bus_subject(t.subject, sizeof t.subject, SUBJ_WFIO, d->org_id, d->run_id, NULL);
    orch_sink sink = {tee_event, tee_poll, &t};
    int64_t timeout = d->timeout_ms > 0 ? d->timeout_ms : o->cfg->step_default_timeout_ms;
    orch_turn_run_on(o, req, timeout, &sink, worker, &res);
    orch_request_wipe(req);
    pthread_mutex_lock(&t.mu);
    flush_locked(&t);
    if (res.outcome == TURN_COMPLETED) {
        /* the final assistant message: a transcript entry without a live frame */
        cJSON *c = cJSON_CreateObject();
        cJSON_AddStringToObject(c, "text", res.final_text ? res.final_text : "");
        Google__Protobuf__Struct *st = NULL;
        Upsquad__Workflow__V1__TranscriptEvent *te = transcript(&t, "assistant_message", c, &st);
        if (te) publish(&t, NULL, te);
        transcript_free(te, st);
        cJSON_Delete(c);
    }
    pthread_mutex_unlock(&t.mu);
    pthread_mutex_destroy(&t.mu);
    if (res.outcome == TURN_NO_WORKER && !no_worker_final(o, msg)) goto retry;
    usage.input_tokens = (int32_t)res.input_tokens;
    usage.output_tokens = (int32_t)res.output_tokens;
    usage.model = res.model[0] ? res.model : s.model_id;
    usage.cost_usd = res.cost_usd;
    r.usage = &usage;
    switch (res.outcome) {
    case TURN_CANCELLED: /* the engine is past this attempt: the result is for the record */
        fail(&r, &failed, "cancelled", "the step was cancelled while it ran", 0);
        break;
    case TURN_COMPLETED:
        done.text = res.final_text ? res.final_text : (char *)"";
        done.output = output_of(done.text);
        r.outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED;
        r.completed = &done;
        break;
    case TURN_INPUT_REQUIRED:
        r.outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INPUT_REQUIRED;
        r.input_required = res.stop->input_required;
        break;
    case TURN_INTERRUPT:
        r.outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INTERRUPT_REQUIRED;
        r.interrupt_required = res.stop->interrupt_required;
        agentdef_policy pol;
        agentdef_tool_policy(agent.definition, r.interrupt_required->tool_name, &pol);
        gate.required_clearance = pol.clearance; /* never 0 */
        frozen_checkpoint(o, d->org_id, sid, res.worker, &gate.checkpoint.data,
                          &gate.checkpoint.len);
        r.interrupt_gate = &gate;
        break;
    default:
        fail(&r, &failed, res.error_code[0] ? res.error_code : "worker_error",
             res.error_message ? res.error_message : "", res.retryable);
        break;
    }
    orch_turn_end e;
    orch_turn_end_of(&res, 0, &e);
    if (orch_store_turn_end(o->pool, d->org_id, sid, NULL, &e, err, sizeof err) != DB_OK)
        log_error("steps.turn_end", "%s", err);
record:;
    pbjson_ts_now(&fin);
    r.finished_at = &fin;
    size_t len = protobuf_c_message_get_packed_size(&r.base);
    uint8_t *b = malloc(len ? len : 1);
    rc = -1;
    if (b) {
        protobuf_c_message_pack(&r.base, b);
        if (orch_store_step_finish(o->pool, d->org_id, d->idempotency_key, sid, b, len, err,
                                   sizeof err) != DB_OK)
            log_error("steps.record", "run %s step %s: %s", d->run_id, d->step_name, err);
        else
            rc = publish_result(o, d, b, len);
        free(b);
    }
    if (r.outcome_case == UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED)
        metric_inc(o->m_steps_ok);
    else
        metric_inc(o->m_steps_failed);
    log_info("steps.done", "run %s step %s attempt %d: outcome %d session %s", d->run_id,
             d->step_name, d->attempt, (int)r.outcome_case, sid);
    goto done;
retry:
    log_warn("steps.retry", "run %s step %s: not run now (%s); the dispatch is redelivered",
             d->run_id, d->step_name, res.error_message ? res.error_message : "store or worker");
    rc = -1;
done:
    if (done.output) pbjson_struct_free(done.output);
    free(gate.checkpoint.data);
    orch_turn_result_clear(&res);
    if (snap) protobuf_c_message_free_unpacked(&snap->base, NULL);
    orch_arena_free(&a);
    orch_session_clear(&s);
    free(agent.definition);
    free(message);
    return rc;
}

static int dispatch_ok(const Dispatch *d) {
    if (strlen(d->idempotency_key) != 64) return 0;
    for (const char *p = d->idempotency_key; *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f'))) return 0;
    return ids_uuid_valid(d->org_id) && ids_uuid_valid(d->run_id) && d->step_name[0] &&
           d->agent_role[0] && bus_token_valid(d->org_id) && bus_token_valid(d->run_id);
}

static void handle(orch_steps *s, int slot, natsMsg *m) {
    orch *o = s->o;
    Dispatch *d = (Dispatch *)protobuf_c_message_unpack(
        &upsquad__internal__v1__agent_step_dispatch__descriptor, NULL,
        (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    if (!d || !dispatch_ok(d)) {
        log_error("steps.poison", "an agent step dispatch that does not decode or lacks its "
                                  "key/org/run/step/role: terminated");
        bus_term(m);
        if (d) protobuf_c_message_free_unpacked(&d->base, NULL);
        return;
    }
    log_set_trace(d->trace_id[0] ? d->trace_id : NULL);
    step_slot *sl = slot_begin(s, slot, d->idempotency_key);
    sl->pull = s->pull[slot];
    if (run_step(o, d, m, sl) == 0)
        bus_ack(m);
    else
        bus_nak(m, 2000);
    slot_end(s, sl);
    log_set_trace(NULL);
    protobuf_c_message_free_unpacked(&d->base, NULL);
}

typedef struct thread_arg {
    orch_steps *s;
    int i;
} thread_arg;

static thread_arg args[STEPS_MAX_THREADS];
static pthread_mutex_t setup_mu = PTHREAD_MUTEX_INITIALIZER;

static void pause_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Streams and the durable, made idempotently; retried until NATS answers (a replica starting
 * while NATS is down serves its RPCs meanwhile and picks steps up once NATS is back). */
static int setup(orch_steps *s, int i) {
    const char *steps[] = {STREAM_AGENT_STEPS_SUBJECTS};
    const char *results[] = {STREAM_AGENT_RESULTS_SUBJECTS};
    const char *wfio[] = {STREAM_WFIO_SUBJECTS};
    char err[256];
    bus *b = s->o->bus;
    if (!bus_connected(b)) return -1; /* no JetStream call waits on a server that is away */
    pthread_mutex_lock(&setup_mu);
    int rc = bus_js_stream_ensure(b, STREAM_AGENT_STEPS, steps, 1, BUS_RETENTION_WORKQUEUE,
                                  STREAM_AGENT_STEPS_MAX_AGE_S, NULL, err, sizeof err) ||
             bus_js_stream_ensure(b, STREAM_AGENT_RESULTS, results, 1, BUS_RETENTION_WORKQUEUE,
                                  STREAM_AGENT_RESULTS_MAX_AGE_S, NULL, err, sizeof err) ||
             bus_js_stream_ensure(b, STREAM_WFIO, wfio, 1, BUS_RETENTION_LIMITS,
                                  STREAM_WFIO_MAX_AGE_S, NULL, err, sizeof err);
    if (!rc && !s->cancel_sub) {
        /* every replica sees every cancel (a fan-out), including those published while it was
         * disconnected or before it started (the stream keeps an hour of them) */
        const char *cancels[] = {STREAM_AGENT_CANCELS_SUBJECTS};
        rc = bus_js_stream_ensure(b, STREAM_AGENT_CANCELS, cancels, 1, BUS_RETENTION_LIMITS,
                                  STREAM_AGENT_CANCELS_MAX_AGE_S, NULL, err, sizeof err) ||
             bus_js_subscribe_ordered(b, STREAM_AGENT_CANCELS, STREAM_AGENT_CANCELS_SUBJECTS,
                                      on_cancel, s, &s->cancel_sub, err, sizeof err);
        /* no dispatch is taken before the cancels the stream holds are known (bounded wait:
         * past it, a late cancel still stops the turn once it arrives) */
        for (int w = 0; !rc && w < 150 && !bus_sub_caught_up(s->cancel_sub); w++)
            pause_ms(20);
    }
    /* last: consume() takes dispatches once pull[i] is set, so everything above is in place
     * by then, and a failure above leaves it unset and the whole setup is retried */
    if (!rc)
        rc = bus_js_pull_subscribe(b, STREAM_AGENT_STEPS, DURABLE_AGENT_STEPS,
                                   SUBJ_AGENT_STEP_DISPATCH, ACK_WAIT_MS, -1, &s->pull[i], err,
                                   sizeof err);
    pthread_mutex_unlock(&setup_mu);
    if (rc) log_warn("steps.setup", "agent steps not consumed yet (%s); retrying", err);
    return rc;
}

static void *consume(void *arg) {
    thread_arg *ta = arg;
    orch_steps *s = ta->s;
    char err[256];
    while (!s->stop && !s->pull[ta->i]) {
        if (setup(s, ta->i) == 0) break;
        for (int w = 0; w < 20 && !s->stop; w++)
            pause_ms(100);
    }
    while (!s->stop) {
        natsMsgList list = {0};
        if (bus_js_fetch(s->pull[ta->i], 1, 1000, &list, err, sizeof err) != BUS_OK) {
            if (!s->stop) pause_ms(200);
            continue;
        }
        for (int k = 0; k < list.Count; k++)
            handle(s, ta->i, list.Msgs[k]);
        natsMsgList_Destroy(&list);
    }
    return NULL;
}

int orch_steps_start(orch *o, char *err, size_t errlen) {
    orch_steps *s = calloc(1, sizeof *s);
    bus_opts bo;
    if (!s) return snprintf(err, errlen, "out of memory"), -1;
    s->o = o;
    pthread_mutex_init(&s->cmu, NULL);
    o->steps = s;
    bus_opts_default(&bo);
    bo.connect_retry = 1; /* NATS down at start: connect in the background */
    if (bus_connect_ex(o->cfg->nats_url, "orchestrator", &bo, &o->bus, err, errlen)) return -1;
    int n = (int)o->cfg->steps_concurrency;
    if (n > STEPS_MAX_THREADS) n = STEPS_MAX_THREADS;
    for (int i = 0; i < n; i++) {
        args[i] = (thread_arg){s, i};
        if (pthread_create(&s->th[i], NULL, consume, &args[i]))
            return snprintf(err, errlen, "cannot start agent step threads"), -1;
        s->n++;
    }
    log_info("steps.started", "%d consumers of %s (durable %s)", s->n, STREAM_AGENT_STEPS,
             DURABLE_AGENT_STEPS);
    return 0;
}

void orch_steps_stop(orch *o) {
    orch_steps *s = o->steps;
    if (s) {
        s->stop = 1;
        for (int i = 0; i < s->n; i++)
            pthread_join(s->th[i], NULL);
        bus_unsubscribe(s->cancel_sub);
        for (int i = 0; i < STEPS_MAX_THREADS; i++)
            bus_pull_close(s->pull[i]);
        pthread_mutex_destroy(&s->cmu); /* threads joined, cancel callback done */
        free(s);
        o->steps = NULL;
    }
    if (o->bus) bus_close(o->bus);
    o->bus = NULL;
}
