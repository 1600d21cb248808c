/* See step.h. Every event is built on the stack or in the script's arena and encoded at once
 * by rpc_stream_send (which blocks while the stream's queue is full: back-pressure). */
#include "step.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ids.h"
#include "inspect.h"
#include "log.h"
#include "pbjson.h"
#include "price.h"
#include "script.h"
#include "util.h"

typedef Upsquad__Runtime__V1__ExecuteStepRequest StepRequest;
typedef Upsquad__Runtime__V1__TokenEvent TokenEvent;
typedef Upsquad__Runtime__V1__ErrorEvent ErrorEvent;
typedef Upsquad__Runtime__V1__CompletionEvent CompletionEvent;
typedef Upsquad__Runtime__V1__TokenUsage TokenUsage;
typedef Upsquad__Runtime__V1__CheckpointEvent CheckpointEvent;

#define WAIT_SLICE_MS 5 /* how often a wait looks at cancellation: the latency of a cancel */

/* RUN_STOP: the step ends here, normally (status OK, no final iteration) */
enum { RUN_OK = 0, RUN_GONE = -1, RUN_TERMINATED = -2, RUN_FAILED = -3, RUN_STOP = -4 };

typedef struct run {
    dw_worker *w;
    rpc_call *call;
    const StepRequest *rq;
    dw_step_ref ref;
    const char *message; /* step_goal, else user_message */
    char model[DW_ID_MAX];
    const char *tenant;
    char message_sha[65];
    int64_t start_ms;
    int32_t token_index; /* TokenEvent.index: 0, 1, … within this response */
    int32_t iter;        /* loop_iteration of the next checkpoint */
    int iterations;      /* iterations finished in this step */
    int dirty;           /* events since the last iteration end */
    long events;         /* events sent */
    const char *last_call_id, *last_call_name;
    int suspend_at;    /* interrupt: the element the step resumes at (0: none) */
    int32_t resume_at; /* a restored suspension of this message: resume there (0: none) */
    char resume_call[DW_ID_MAX], resume_tool[DW_ID_MAX];
    const char *susp_call, *susp_tool;
    int fail_code;         /* the `fail` directive that ended the step: its status and */
    const char *fail_text; /* message, in the call arena (the script is freed before) */
    const char *answer;    /* AskUserResume: the answer's result as text (call arena) */
    long long runs;        /* steps of this message on this worker, this one included */
} run;

static int check(run *r) {
    if (atomic_load(&r->ref.terminated)) return RUN_TERMINATED;
    if (rpc_cancelled(r->call)) return RUN_GONE;
    return RUN_OK;
}

/* Waits ms, looking at cancellation every WAIT_SLICE_MS; ms < 0 waits until cancelled. */
static int wait_ms(run *r, long long ms) {
    int64_t end = ms < 0 ? INT64_MAX : util_mono_ms() + ms;
    for (;;) {
        int rc = check(r);
        if (rc) return rc;
        int64_t left = end - util_mono_ms();
        if (left <= 0) return RUN_OK;
        struct timespec ts = {0, (left < WAIT_SLICE_MS ? left : WAIT_SLICE_MS) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

static int send_event(run *r, Upsquad__Runtime__V1__ExecuteStepEvent *ev) {
    int rc = check(r);
    if (rc) return rc;
    if (rpc_stream_send(r->call, &ev->base) != RPC_OK) return RUN_GONE;
    r->events++;
    r->dirty = 1;
    return RUN_OK;
}

static int send_token(run *r, const char *text, size_t len) {
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    TokenEvent t = UPSQUAD__RUNTIME__V1__TOKEN_EVENT__INIT;
    char buf[256], *txt = len < sizeof buf ? buf : malloc(len + 1);
    if (txt == NULL) return RUN_GONE;
    memcpy(txt, text, len);
    txt[len] = 0;
    t.text = txt;
    t.index = r->token_index++;
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOKEN;
    ev.token = &t;
    int rc = send_event(r, &ev);
    if (txt != buf) free(txt);
    if (rc == RUN_OK) metric_inc(r->w->m_tokens);
    return rc;
}

/* One token per word (dw_next_token), delay_ms before each. */
static int send_tokens(run *r, const char *text, long long delay_ms) {
    size_t n;
    while ((n = dw_next_token(text)) > 0) {
        int rc;
        if (delay_ms > 0 && (rc = wait_ms(r, delay_ms)) != RUN_OK) return rc;
        if ((rc = send_token(r, text, n)) != RUN_OK) return rc;
        text += n;
    }
    return RUN_OK;
}

static int send_error(run *r, const char *code, const char *message, const char *detail) {
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    ErrorEvent e = UPSQUAD__RUNTIME__V1__ERROR_EVENT__INIT;
    e.code = (char *)code;
    e.message = (char *)message;
    e.detail = (char *)(detail ? detail : "");
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_ERROR;
    ev.error = &e;
    return send_event(r, &ev);
}

/* ---------------------------------------------------------------- state ---- */

int dw_state_blob(rpc_call *call, int32_t version, const char *body, uint8_t **out, size_t *len) {
    size_t n = strlen(body);
    uint8_t *b = rpc_alloc(call, n + 4);
    if (b == NULL) return -1;
    /* the 4-byte big-endian schema version prefix (spec: CheckpointRequest.bytes) */
    b[0] = (uint8_t)((uint32_t)version >> 24);
    b[1] = (uint8_t)((uint32_t)version >> 16);
    b[2] = (uint8_t)((uint32_t)version >> 8);
    b[3] = (uint8_t)version;
    memcpy(b + 4, body, n);
    *out = b;
    *len = n + 4;
    return 0;
}

/* The deterministic body: the same session, message and iteration give the same bytes, so a
 * replayed step re-sends an identical checkpoint (the orchestrator's idempotent path). */
static char *default_body(run *r) {
    cJSON *o = cJSON_CreateObject();
    char *txt = NULL;
    if (o && cJSON_AddStringToObject(o, "session_id", r->rq->session_id) &&
        cJSON_AddNumberToObject(o, "loop_iteration", r->iter) &&
        cJSON_AddStringToObject(o, "message_sha256", r->message_sha) &&
        cJSON_AddNumberToObject(o, "tokens", r->token_index) &&
        cJSON_AddNumberToObject(o, "events", (double)r->events) &&
        (r->suspend_at == 0 ||
         (cJSON_AddNumberToObject(o, "suspended_at", r->suspend_at) &&
          cJSON_AddStringToObject(o, "tool_call_id", r->susp_call ? r->susp_call : "") &&
          cJSON_AddStringToObject(o, "tool_name", r->susp_tool ? r->susp_tool : ""))))
        txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    char *copy = txt ? rpc_strdup(r->call, txt) : NULL;
    cJSON_free(txt);
    return copy;
}

/* Ends a loop iteration: records the state and queues the checkpoint. With stream set, the
 * CheckpointEvent is also sent on the stream (the `checkpoint` directive). */
static int end_iteration(run *r, const char *body, int stream) {
    uint8_t *blob;
    size_t len;
    char hash[65];
    int rc = RUN_OK;
    r->iter = dw_session_reserve_iter(r->w, r->rq->session_id);
    if (body == NULL && (body = default_body(r)) == NULL) return RUN_GONE;
    if (dw_state_blob(r->call, (int32_t)r->w->cfg->checkpoint_ver, body, &blob, &len) != 0)
        return RUN_GONE;
    ids_sha256_hex(blob, len, hash);
    if (stream) {
        Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
        CheckpointEvent ce = UPSQUAD__RUNTIME__V1__CHECKPOINT_EVENT__INIT;
        Google__Protobuf__Timestamp ts;
        pbjson_ts_now(&ts);
        ce.state.data = blob;
        ce.state.len = len;
        ce.hash = hash;
        ce.created_at = &ts;
        ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_CHECKPOINT;
        ev.checkpoint = &ce;
        rc = send_event(r, &ev);
    }
    dw_session_set_state(r->w, r->rq->session_id, r->iter, blob, len, hash);
    if (r->w->orch && r->w->cfg->checkpoints_enabled)
        dw_checkpoint_enqueue(r->w, r->rq->session_id, r->tenant, r->iter, blob, len, hash);
    r->iter++;
    r->iterations++;
    r->dirty = 0;
    return rc;
}

/* ---------------------------------------------------------------- usage ---- */

static long input_words(run *r) {
    long n = dw_word_count(r->message);
    for (size_t i = 0; i < r->rq->n_prior_turns; i++)
        if (r->rq->prior_turns[i]->text) n += dw_word_count(r->rq->prior_turns[i]->text);
    return n;
}

static TokenUsage *usage(run *r) {
    TokenUsage *u = rpc_alloc(r->call, sizeof *u);
    if (u == NULL) return NULL;
    upsquad__runtime__v1__token_usage__init(u);
    long in = input_words(r), out = r->token_index;
    u->input_tokens = (int32_t)in;
    u->output_tokens = (int32_t)out;
    u->model = r->model;
    u->cost_usd = dw_price_cost(r->model, in, out);
    return u;
}

/* A resumed ask's answer in the final text: every ANSWER_MARK becomes the answer (a turn that
 * resumed nothing leaves the text as it is). NULL on OOM. */
#define ANSWER_MARK "{{answer}}"
static char *with_answer(run *r, char *text) {
    if (r->answer == NULL || text == NULL || strstr(text, ANSWER_MARK) == NULL) return text;
    size_t ml = strlen(ANSWER_MARK), al = strlen(r->answer), n = strlen(text) + 1;
    for (const char *p = strstr(text, ANSWER_MARK); p; p = strstr(p + ml, ANSWER_MARK))
        n += al; /* an upper bound: each mark's own bytes are counted too */
    char *out = rpc_alloc(r->call, n), *o = out;
    if (out == NULL) return NULL;
    for (const char *p = text; *p;) {
        if (strncmp(p, ANSWER_MARK, ml) == 0) {
            memcpy(o, r->answer, al);
            o += al;
            p += ml;
        } else {
            *o++ = *p++;
        }
    }
    *o = 0;
    return out;
}

static int send_completion(run *r, CompletionEvent *c, unsigned flags) {
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    int rc;
    if (!(c->final_response = with_answer(r, c->final_response))) return RUN_GONE;
    /* the final iteration is checkpointed before the step reports completion */
    if (r->dirty && (rc = end_iteration(r, NULL, 0)) != RUN_OK) return rc;
    if ((flags & DW_F_USAGE) && !(c->token_usage = usage(r))) return RUN_GONE;
    if (flags & DW_F_ITERATIONS) c->loop_iterations = r->iterations > 0 ? r->iterations : 1;
    if (flags & DW_F_DURATION) c->duration_ms = (int32_t)(util_mono_ms() - r->start_ms);
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION;
    ev.completion = c;
    rc = send_event(r, &ev);
    r->dirty = 0; /* the completion itself opens no new iteration */
    return rc;
}

/* ---------------------------------------------------------------- echo ---- */

/* A workflow agent step's goal ends with the fields its output must carry, as the orchestrator
 * words them (services/orchestrator/steps.c, compose): "Answer with a JSON object with these
 * fields:" then one "- NAME (TYPE[, required])[: description]" line each. A model follows that;
 * so does the echo reply, with one deterministic value per type, so that every example workflow
 * runs end to end offline. NULL when the message asks for no fields (or on OOM). */
#define EXPECTS_MARK "\n\nAnswer with a JSON object with these fields:"
static char *structured_echo(run *r) {
    const char *p = strstr(r->message, EXPECTS_MARK);
    if (p == NULL) return NULL;
    cJSON *o = cJSON_CreateObject();
    for (p += strlen(EXPECTS_MARK); o && strncmp(p, "\n- ", 3) == 0;) {
        const char *name = p + 3, *paren = strstr(name, " ("), *eol = strchr(name, '\n');
        if (paren == NULL || (eol && paren > eol)) break;
        char key[128], type[32];
        snprintf(key, sizeof key, "%.*s", (int)(paren - name), name);
        snprintf(type, sizeof type, "%.*s", (int)strcspn(paren + 2, ",)"), paren + 2);
        cJSON *v;
        if (!strcmp(type, "integer") || !strcmp(type, "number"))
            v = cJSON_CreateNumber(1);
        else if (!strcmp(type, "boolean"))
            v = cJSON_CreateTrue();
        else if (!strcmp(type, "object"))
            v = cJSON_CreateObject();
        else if (!strcmp(type, "array") && (v = cJSON_CreateArray()) != NULL)
            cJSON_AddItemToArray(v, cJSON_CreateString(key));
        else
            v = cJSON_CreateString(key);
        cJSON_AddItemToObject(o, key, v);
        p = eol ? eol : name + strlen(name);
    }
    char *text = o ? cJSON_PrintUnformatted(o) : NULL, *out = NULL;
    cJSON_Delete(o);
    if (text) out = rpc_sprintf(r->call, "%s", text);
    free(text);
    return out;
}

static int run_echo(run *r) {
    char *reply = structured_echo(r);
    if (reply == NULL) reply = rpc_sprintf(r->call, "echo: %s", r->message);
    CompletionEvent c = UPSQUAD__RUNTIME__V1__COMPLETION_EVENT__INIT;
    int rc;
    if (reply == NULL) return RUN_GONE;
    if ((rc = send_tokens(r, reply, 0)) != RUN_OK) return rc;
    c.final_response = reply;
    return send_completion(r, &c, DW_F_USAGE | DW_F_ITERATIONS | DW_F_DURATION);
}

/* ---------------------------------------------------------------- plan ---- */

/* The PLAN step of the autonomous loop with a plain goal: one todo per non-empty line of the
 * goal (the whole goal when it is one line), as the DecompositionEvent, then a completion. A
 * todo whose title is itself a script drives its own step (step_goal = the title). */
static int run_plan(run *r) {
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    Upsquad__Runtime__V1__DecompositionEvent d = UPSQUAD__RUNTIME__V1__DECOMPOSITION_EVENT__INIT;
    CompletionEvent c = UPSQUAD__RUNTIME__V1__COMPLETION_EVENT__INIT;
    size_t cap = 1;
    int rc;
    for (const char *p = r->message; *p; p++)
        cap += *p == '\n';
    if (cap > DW_PLAN_MAX_TODOS) cap = DW_PLAN_MAX_TODOS;
    d.todos = rpc_alloc(r->call, cap * sizeof *d.todos);
    if (d.todos == NULL) return RUN_GONE;
    for (const char *p = r->message; *p && d.n_todos < cap;) {
        size_t n = strcspn(p, "\n");
        const char *b = p, *e = p + n;
        while (b < e && (*b == ' ' || *b == '\t' || *b == '\r'))
            b++;
        while (e > b && (e[-1] == ' ' || e[-1] == '\t' || e[-1] == '\r'))
            e--;
        if (e > b) {
            Upsquad__Runtime__V1__TodoSpec *t = rpc_alloc(r->call, sizeof *t);
            if (t == NULL) return RUN_GONE;
            upsquad__runtime__v1__todo_spec__init(t);
            t->id = rpc_sprintf(r->call, "todo-%zu", d.n_todos + 1);
            t->title = rpc_strndup(r->call, b, (size_t)(e - b));
            t->ordering = (uint32_t)d.n_todos;
            if (!t->id || !t->title) return RUN_GONE;
            d.todos[d.n_todos++] = t;
        }
        p += n + (p[n] == '\n');
    }
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_DECOMPOSITION;
    ev.decomposition = &d;
    if ((rc = send_event(r, &ev)) != RUN_OK) return rc;
    c.final_response = rpc_sprintf(r->call, "planned %zu todo(s)", d.n_todos);
    if (c.final_response == NULL) return RUN_GONE;
    return send_completion(r, &c, DW_F_USAGE | DW_F_ITERATIONS | DW_F_DURATION);
}

/* ---------------------------------------------------------------- script ---- */

static char *idem_key(run *r, const char *call_id) {
    char *in = rpc_sprintf(r->call, "%s:%d:%s", r->rq->session_id, r->iter, call_id);
    char *hex = rpc_alloc(r->call, 65);
    if (!in || !hex) return NULL;
    ids_sha256_hex(in, strlen(in), hex);
    return hex;
}

/* The frozen turn an ask_user suspends on: where the script resumes (the element after the
 * ask) and the pending call; AskUserResume.checkpoint brings it back. */
static int ask_checkpoint(run *r, const dw_op *op, const char *call_id, ProtobufCBinaryData *out) {
    cJSON *o = cJSON_CreateObject();
    char *txt = NULL;
    if (o && cJSON_AddStringToObject(o, "session_id", r->rq->session_id) &&
        cJSON_AddNumberToObject(o, "loop_iteration", r->iter) &&
        cJSON_AddStringToObject(o, "tool_call_id", call_id) &&
        cJSON_AddNumberToObject(o, "resume_at", op->index + 1) &&
        cJSON_AddStringToObject(o, "message_sha256", r->message_sha))
        txt = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    if (txt == NULL) return RUN_GONE;
    out->data = (uint8_t *)rpc_strdup(r->call, txt);
    out->len = strlen(txt);
    cJSON_free(txt);
    return out->data ? RUN_OK : RUN_GONE;
}

static int fixup(run *r, const dw_op *op) {
    DwEvent *ev = op->ev;
    unsigned f = op->flags;
    char *id = (f & DW_F_CALL_ID) ? rpc_sprintf(r->call, "call-%d", op->index) : NULL;
    switch (ev->event_case) {
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STATUS:
        if (f & DW_F_TIMESTAMP) {
            Google__Protobuf__Timestamp *ts = rpc_alloc(r->call, sizeof *ts);
            if (ts == NULL) return RUN_GONE;
            pbjson_ts_now(ts);
            ev->status->timestamp = ts;
        }
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_CALL:
        if (id) ev->tool_call->tool_call_id = id;
        r->last_call_id = ev->tool_call->tool_call_id;
        r->last_call_name = ev->tool_call->tool_name;
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT:
        if ((f & DW_F_RESULT_ID) && r->last_call_id)
            ev->tool_result->tool_call_id = (char *)r->last_call_id;
        if ((f & DW_F_RESULT_NAME) && r->last_call_name)
            ev->tool_result->tool_name = (char *)r->last_call_name;
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_METRICS:
        if (f & DW_F_METRICS) ev->metrics->model = r->model;
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED:
        if (id) ev->interrupt_required->tool_call_id = id;
        if ((f & DW_F_IDEM_KEY) && !(ev->interrupt_required->idempotency_key =
                                         idem_key(r, ev->interrupt_required->tool_call_id)))
            return RUN_GONE;
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED:
        if (id) ev->input_required->tool_call_id = id;
        if ((f & DW_F_IDEM_KEY) &&
            !(ev->input_required->idempotency_key = idem_key(r, ev->input_required->tool_call_id)))
            return RUN_GONE;
        if ((f & DW_F_ASK_CKPT) && ask_checkpoint(r, op, ev->input_required->tool_call_id,
                                                  &ev->input_required->checkpoint) != RUN_OK)
            return RUN_GONE;
        break;
    default:
        break;
    }
    return RUN_OK;
}

static int run_op(run *r, const dw_op *op) {
    int rc;
    switch (op->kind) {
    case DW_OP_TOKEN:
        if (op->ms > 0 && (rc = wait_ms(r, op->ms)) != RUN_OK) return rc;
        return send_token(r, op->text, strlen(op->text));
    case DW_OP_TOKENS:
        return send_tokens(r, op->text, op->ms);
    case DW_OP_SLEEP:
        return wait_ms(r, op->ms);
    case DW_OP_HANG:
        log_info("step.hang", "session %s: hanging until the caller goes away", r->rq->session_id);
        return wait_ms(r, -1);
    case DW_OP_CHECKPOINT:
        return end_iteration(r, op->text, 1);
    case DW_OP_FAIL:
        r->fail_code = op->code;
        r->fail_text = rpc_strdup(r->call, op->text);
        return RUN_FAILED;
    case DW_OP_INSPECT: {
        char *txt = dw_inspect_json(r->w, r->rq);
        if (txt == NULL) return RUN_GONE;
        rc = send_token(r, txt, strlen(txt));
        cJSON_free(txt);
        return rc;
    }
    case DW_OP_CRASH:
        if (!r->w->cfg->allow_crash) {
            rc = send_error(r, "CRASH_DISABLED",
                            "the crash directive is disabled on this worker "
                            "(UPSQUAD_DEVWORKER_ALLOW_CRASH=false)",
                            NULL);
            return rc == RUN_OK ? RUN_STOP : rc;
        }
        /* what was sent reaches the client (a crash after N events shows N events), then the
         * process exits as a crashed worker would: no status, the connection drops */
        for (int i = 0; i < 400 && rpc_stream_queued(r->call) > 0; i++)
            usleep(5000);
        usleep(100000);
        log_warn("step.crash", "session %s: crash directive, exiting", r->rq->session_id);
        _exit(3);
    case DW_OP_EVENT:
        if ((rc = fixup(r, op)) != RUN_OK) return rc;
        if (op->ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION)
            return send_completion(r, op->ev->completion, op->flags);
        if ((rc = send_event(r, op->ev)) != RUN_OK) return rc;
        if (op->ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT)
            return end_iteration(r, NULL, 0); /* observe done: the next think starts */
        return RUN_OK;
    }
    return RUN_OK;
}

/* The outcome of a restored suspension's call given by the orchestrator: an ask_user_resume
 * whose answer_tool_result names that call ({tool_call_id, result}) is spliced as the call's
 * result instead of running it (a rejected decision, a delegation's child result). The result
 * text (call arena), or NULL; *is_error: the result says "denied" or "is_error". */
static const char *given_result(run *r, int *is_error) {
    const Upsquad__Runtime__V1__AskUserResume *ar = r->rq->ask_user_resume;
    if (ar == NULL || ar->answer_tool_result.len == 0) return NULL;
    cJSON *a = cJSON_ParseWithLength((const char *)ar->answer_tool_result.data,
                                     ar->answer_tool_result.len);
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(a, "tool_call_id");
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(a, "result");
    const char *out = NULL;
    *is_error = 0;
    if (cJSON_IsString(id) && !strcmp(id->valuestring, r->resume_call) && res) {
        *is_error = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "denied")) ||
                    cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(res, "is_error"));
        char *t = cJSON_IsString(res) ? NULL : cJSON_PrintUnformatted(res);
        out = rpc_strdup(r->call, t ? t : res->valuestring);
        free(t);
    }
    cJSON_Delete(a);
    return out;
}

/* A suspension restored by InitWorkerSession: the approved gated call runs now (its
 * tool_result), or the call gets the result the orchestrator gave (a denial, a delegation's
 * outcome); either way the script goes on after the interrupt. */
static int resume_suspended(run *r, size_t n_ops, int *start) {
    const char *call_id = r->resume_call, *tool = r->resume_tool;
    int32_t at = r->resume_at;
    if (at <= 0 || (size_t)at > n_ops) return RUN_OK;
    int is_error = 0;
    const char *given = given_result(r, &is_error);
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    Upsquad__Runtime__V1__ToolResultEvent tr = UPSQUAD__RUNTIME__V1__TOOL_RESULT_EVENT__INIT;
    tr.tool_call_id = (char *)call_id;
    tr.tool_name = (char *)tool;
    tr.result = given ? (char *)given : "{\"approved\":true}";
    tr.is_error = is_error;
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT;
    ev.tool_result = &tr;
    log_info("step.resumed", "session %s: resuming after the %s call %s", r->rq->session_id,
             given ? "answered" : "approved", call_id);
    if (given) r->answer = given;
    int rc = send_event(r, &ev);
    if (rc == RUN_OK) rc = end_iteration(r, NULL, 0);
    *start = at;
    return rc;
}

/* AskUserResume: the resume point from the frozen turn, and the answer spliced as the
 * ask_user tool's result. Returns the op index to start at (0 when not resuming). */
static int resume_point(run *r, size_t n_ops, int *start) {
    const Upsquad__Runtime__V1__AskUserResume *ar = r->rq->ask_user_resume;
    *start = 0;
    if (ar == NULL || ar->checkpoint.len == 0 || r->resume_at > 0)
        return resume_suspended(r, n_ops, start);
    char *txt = rpc_strndup(r->call, (const char *)ar->checkpoint.data, ar->checkpoint.len);
    cJSON *o = txt ? cJSON_Parse(txt) : NULL;
    const cJSON *at = cJSON_GetObjectItemCaseSensitive(o, "resume_at");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(o, "tool_call_id");
    int rc = RUN_OK;
    if (!cJSON_IsNumber(at) || at->valueint < 0 || (size_t)at->valueint > n_ops ||
        !cJSON_IsString(id)) {
        rc = send_error(r, "RESUME_INVALID",
                        "ask_user_resume.checkpoint is not a devworker frozen turn", NULL);
        cJSON_Delete(o);
        return rc == RUN_OK ? RUN_STOP : rc;
    }
    *start = at->valueint;
    /* the answer as the tool result: answer_tool_result is {tool_call_id, result} */
    char *ans =
        rpc_strndup(r->call, (const char *)ar->answer_tool_result.data, ar->answer_tool_result.len);
    cJSON *a = ans ? cJSON_Parse(ans) : NULL;
    const cJSON *res = cJSON_GetObjectItemCaseSensitive(a, "result");
    char *res_txt =
        res ? (cJSON_IsString(res) ? strdup(res->valuestring) : cJSON_PrintUnformatted(res)) : NULL;
    Upsquad__Runtime__V1__ExecuteStepEvent ev = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__INIT;
    Upsquad__Runtime__V1__ToolResultEvent tr = UPSQUAD__RUNTIME__V1__TOOL_RESULT_EVENT__INIT;
    tr.tool_call_id = rpc_strdup(r->call, id->valuestring);
    tr.tool_name = "ask_user";
    tr.result = res_txt ? res_txt : (ans ? ans : "");
    ev.event_case = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT;
    ev.tool_result = &tr;
    log_info("step.ask_resumed",
             "session %s: resuming the frozen turn at element %d with the answer to %s",
             r->rq->session_id, *start, id->valuestring);
    r->answer = rpc_strdup(r->call, tr.result);
    rc = tr.tool_call_id && r->answer ? send_event(r, &ev) : RUN_GONE;
    if (rc == RUN_OK) rc = end_iteration(r, NULL, 0);
    free(res_txt);
    cJSON_Delete(a);
    cJSON_Delete(o);
    return rc;
}

/* The if_worker / unless_worker modifiers, against the worker's id and address. */
static int runs_here(run *r, const dw_op *op) {
    if (op->first_runs && r->runs > op->first_runs) return 0;
    if (!op->if_worker && !op->unless_worker) return 1;
    pthread_mutex_lock(&r->w->mu);
    const char *want = op->if_worker ? op->if_worker : op->unless_worker;
    int match = strcmp(want, r->w->id) == 0 || strcmp(want, r->w->addr) == 0;
    pthread_mutex_unlock(&r->w->mu);
    return op->if_worker ? match : !match;
}

static int run_script(run *r, const char *body) {
    dw_script *s = NULL;
    char err[512], ptr[256];
    size_t n;
    int rc, start;
    if (dw_script_parse(body, (size_t)r->w->cfg->max_script, &s, err, sizeof err, ptr,
                        sizeof ptr) != 0) {
        metric_inc(r->w->m_scripts_invalid);
        log_info("script.invalid", "session %s: %s", r->rq->session_id, err);
        return send_error(r, "SCRIPT_INVALID", err, ptr);
    }
    const dw_op *ops = dw_script_ops(s, &n);
    if ((rc = resume_point(r, n, &start)) != RUN_OK) goto done;
    for (size_t i = (size_t)start; i < n; i++) {
        if (!runs_here(r, &ops[i])) continue;
        if ((rc = run_op(r, &ops[i])) != RUN_OK) goto done;
        if (ops[i].ends_step) { /* interrupt / ask_user: the worker suspends */
            if (ops[i].ev->event_case ==
                UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED) {
                /* the suspension rides the checkpoint: InitWorkerSession(resume_checkpoint)
                 * with it resumes after the interrupt */
                r->suspend_at = ops[i].index + 1;
                r->susp_call = ops[i].ev->interrupt_required->tool_call_id;
                r->susp_tool = ops[i].ev->interrupt_required->tool_name;
            }
            break;
        }
    }
    if (r->dirty) rc = end_iteration(r, NULL, 0);
done:
    dw_script_free(s);
    return rc;
}

/* ---------------------------------------------------------------- entry ---- */

int dw_step_run(dw_worker *w, rpc_call *call, const StepRequest *rq) {
    run r = {.w = w, .call = call, .rq = rq};
    const char *body;
    int rc;
    /* the cycle's intent: the step goal when the orchestrator drives the autonomous loop, but
     * the PLAN step plans the goal itself (the user message) */
    int plan = rq->step_goal && strcmp(rq->step_goal, DW_PLAN_GOAL) == 0 && rq->user_message &&
               rq->user_message[0];
    r.message = (rq->step_goal && rq->step_goal[0] && !plan) ? rq->step_goal : rq->user_message;
    r.tenant = rq->tenant_id ? rq->tenant_id : "";
    r.start_ms = util_mono_ms();
    ids_sha256_hex(r.message, strlen(r.message), r.message_sha);
    r.runs = dw_message_run(w, r.message_sha);
    if (rq->snapshot && rq->snapshot->model_id && rq->snapshot->model_id[0])
        dw_copy_id(r.model, rq->snapshot->model_id);
    else
        dw_session_model(w, rq->session_id, r.model);
    r.iter = dw_session_touch(w, rq->session_id, r.tenant, r.model);
    dw_copy_id(r.ref.session_id, rq->session_id);
    atomic_init(&r.ref.terminated, 0);
    dw_step_register(w, &r.ref);
    metric_inc(w->m_steps);
    /* the step's lines carry the caller's trace (the run's, through the orchestrator) and the
     * tenant and session as fields (docs/libcommon.md "Traces and log ids") */
    log_set_id(LOG_ID_ORG, r.tenant);
    log_set_id(LOG_ID_SESSION, rq->session_id);
    log_info("step.started", "iteration %d, %s", r.iter, plan ? "plan" : "step");

    /* any step after a restore consumes its suspension; only the suspended script resumes */
    if (!dw_session_take_resume(w, rq->session_id, r.message_sha, &r.resume_at, r.resume_call,
                                r.resume_tool))
        r.resume_at = 0;
    if (dw_script_detect(r.message, &body))
        rc = run_script(&r, body);
    else if (plan)
        rc = run_plan(&r);
    else
        rc = run_echo(&r);

    dw_step_unregister(w, &r.ref);
    log_clear_ids();
    if (rc == RUN_TERMINATED && atomic_load(&r.ref.terminated)) {
        metric_inc(w->m_steps_cancelled);
        rc = send_error(&(run){.w = w, .call = call, .rq = rq}, "SESSION_TERMINATED",
                        "the session was terminated while the step ran", NULL);
    }
    if (rc == RUN_FAILED)
        return rpc_error(call, r.fail_code, "%s", r.fail_text ? r.fail_text : "failed by script");
    if (rc == RUN_GONE) {
        metric_inc(w->m_steps_cancelled);
        /* one line per step the caller abandoned: tests of cancel propagation look for it */
        log_info("step.cancelled", "session %s: cancelled by the caller after %ld events",
                 rq->session_id, r.events);
        return rpc_error(call, RPC_CANCELLED, "cancelled");
    }
    return RPC_OK;
}
