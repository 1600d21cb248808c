/* One agent turn on the worker pool (turn.h). */
#include "turn.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "log.h"

#define EXECUTE_STEP "/upsquad.runtime.v1.RuntimeService/ExecuteStep"
#define WATCH_MAX 4096

/* ---- the cancellation watcher: a blocked reader cannot poll its caller, so one thread polls
 * every running turn and cancels the worker call of a caller that went away ---- */

typedef struct watch {
    rpc_reader *reader;
    const orch_sink *sink;
    int fired;
} watch;

static pthread_mutex_t wmu = PTHREAD_MUTEX_INITIALIZER;
static watch *wlist[WATCH_MAX];
static size_t wn;
static int wstop, wstarted;
static pthread_t wthread;

static void *watch_main(void *arg) {
    (void)arg;
    for (;;) {
        pthread_mutex_lock(&wmu);
        if (wstop) {
            pthread_mutex_unlock(&wmu);
            return NULL;
        }
        for (size_t i = 0; i < wn; i++) {
            watch *w = wlist[i];
            if (!w->fired && w->sink->cancelled && w->sink->cancelled(w->sink->ud)) {
                w->fired = 1;
                rpc_reader_cancel(w->reader);
            }
        }
        pthread_mutex_unlock(&wmu);
        usleep(20000);
    }
}

int orch_turn_watcher_start(void) {
    wstop = 0;
    if (pthread_create(&wthread, NULL, watch_main, NULL)) return -1;
    wstarted = 1;
    return 0;
}

void orch_turn_watcher_stop(void) {
    pthread_mutex_lock(&wmu);
    wstop = 1;
    pthread_mutex_unlock(&wmu);
    if (wstarted) pthread_join(wthread, NULL);
    wstarted = 0;
}

static int watch_add(watch *w) {
    int ok = 0;
    pthread_mutex_lock(&wmu);
    if (wn < WATCH_MAX) {
        wlist[wn++] = w;
        ok = 1;
    }
    pthread_mutex_unlock(&wmu);
    return ok;
}

static int watch_remove(watch *w) {
    pthread_mutex_lock(&wmu);
    for (size_t i = 0; i < wn; i++)
        if (wlist[i] == w) {
            wlist[i] = wlist[--wn];
            break;
        }
    int fired = w->fired;
    pthread_mutex_unlock(&wmu);
    return fired;
}

/* ---- the turn ---- */

void orch_turn_result_clear(orch_turn_result *r) {
    free(r->final_text);
    free(r->error_message);
    if (r->stop) protobuf_c_message_free_unpacked(&r->stop->base, NULL);
    memset(r, 0, sizeof *r);
}

void orch_turn_end_of(const orch_turn_result *res, int loop_base, orch_turn_end *e) {
    memset(e, 0, sizeof *e);
    e->ok = res->outcome == TURN_COMPLETED;
    e->final_text = res->final_text;
    e->agent_status = e->ok ? 3 /* COMPLETE */ : 4 /* ERROR */;
    e->loop_iterations = res->loop_iterations;
    e->loop_base = loop_base;
    e->input_tokens = res->input_tokens;
    e->output_tokens = res->output_tokens;
    e->cost_usd = res->cost_usd;
    e->worker = res->worker;
    e->worker_answered = res->worker_answered;
    e->error_code = res->error_code;
    e->error_msg = res->error_message;
}

static void set_error(orch_turn_result *r, const char *code, const char *msg, int retryable) {
    snprintf(r->error_code, sizeof r->error_code, "%s", code);
    free(r->error_message);
    r->error_message = strdup(msg ? msg : "");
    r->retryable = retryable;
}

/* Reads one attempt. Returns 1 when the attempt may be retried on another worker (it failed
 * before anything reached the caller), 0 otherwise; r->outcome says how it ended. */
static int attempt(orch *o, orch_worker *k, ExecuteStepRequest *req, int64_t timeout_ms,
                   const orch_sink *sink, orch_turn_result *r) {
    char *gw = NULL, *ce = NULL;
    rpc_reader *rd = NULL;
    rpc_status st = {0};
    int saw_end = 0, got_error = 0, retry = 0, cancelled = 0;
    orch_mint_agent_tokens(o, req->tenant_id, req->agent_id, req->session_id, &gw, &ce);
    req->agent_gateway_token = gw ? gw : (char *)"";
    req->context_engine_token = ce ? ce : (char *)"";
    char *bearer = orch_mint_call_token(o, req->tenant_id);
    rpc_call_opts opts = {.timeout_ms = timeout_ms > 0 ? timeout_ms : 0, .bearer = bearer};
    snprintf(r->worker, sizeof r->worker, "%s", k->addr);
    rpc_stream_open(k->ch, EXECUTE_STEP, &req->base,
                    &upsquad__runtime__v1__execute_step_event__descriptor, &opts, &rd);
    /* the request holds the bearers only until it is sent */
    req->agent_gateway_token = (char *)"";
    req->context_engine_token = (char *)"";
    free(gw);
    free(ce);
    free(bearer);
    watch w = {rd, sink, 0};
    int watched = watch_add(&w);
    for (;;) {
        ProtobufCMessage *m = NULL;
        int n = rpc_reader_next(rd, &m);
        if (n <= 0) break;
        r->worker_answered = 1;
        ExecuteStepEvent *ev = (ExecuteStepEvent *)m;
        int keep = 0;
        /* the step is over at its completion or at a terminal error (an ErrorEvent is "a
         * recoverable or terminal error": a retryable one may be followed by more of the
         * step); whatever the worker sends after that changes nothing (nor reaches the caller:
         * the sink drops it) */
        switch (saw_end ? 0 : ev->event_case) {
        case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION: {
            const Upsquad__Runtime__V1__CompletionEvent *c = ev->completion;
            free(r->final_text);
            r->final_text = strdup(c->final_response);
            r->loop_iterations = c->loop_iterations;
            if (c->token_usage) {
                r->input_tokens = c->token_usage->input_tokens;
                r->output_tokens = c->token_usage->output_tokens;
                if (c->token_usage->cost_usd > 0) r->cost_usd = c->token_usage->cost_usd;
                snprintf(r->model, sizeof r->model, "%s", c->token_usage->model);
            }
            r->outcome = TURN_COMPLETED;
            saw_end = 1;
            break;
        }
        case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_ERROR:
            set_error(r, ev->error->code[0] ? ev->error->code : "WORKER_ERROR", ev->error->message,
                      ev->error->retryable);
            r->outcome = TURN_FAILED; /* unless the step goes on and completes */
            saw_end = !ev->error->retryable;
            got_error = 1;
            break;
        case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_METRICS:
            /* per-LLM-call cost, summed when the completion carries none */
            if (r->outcome != TURN_COMPLETED) r->cost_usd += ev->metrics->cost_usd;
            break;
        case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED:
        case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED:
            r->outcome =
                ev->event_case == UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED
                    ? TURN_INPUT_REQUIRED
                    : TURN_INTERRUPT;
            saw_end = 1;
            keep = 1;
            break;
        default:
            break;
        }
        int s = sink->on_event(sink->ud, ev);
        if (s > 0) r->relayed++;
        if (keep) {
            if (r->stop) protobuf_c_message_free_unpacked(&r->stop->base, NULL);
            r->stop = ev;
        } else {
            protobuf_c_message_free_unpacked(m, NULL);
        }
        if (s < 0) {
            cancelled = 1;
            break;
        }
    }
    int fired = watched ? watch_remove(&w) : 0;
    int code = rpc_reader_close(rd, &st);
    if (cancelled || fired || (sink->cancelled && sink->cancelled(sink->ud))) {
        r->outcome = TURN_CANCELLED;
    } else if (!saw_end && !got_error) {
        /* the worker failed or ended without an outcome */
        char msg[512];
        if (code == 14) /* the worker is gone: crash recovery moves the session */
            snprintf(msg, sizeof msg,
                     "worker %s went away during the turn (%s); crash recovery resumes the "
                     "session on another worker from its latest checkpoint: send the message "
                     "again",
                     k->addr, st.message ? st.message : "unavailable");
        else
            snprintf(msg, sizeof msg, "worker %s ended the turn without an outcome (status %d: %s)",
                     k->addr, code, st.message ? st.message : "");
        set_error(r, code == 14 ? "WORKER_UNAVAILABLE" : "WORKER_FAILED", msg, 1);
        r->outcome = TURN_FAILED;
        if (code == 14 || code == 4 || code == 13 || code == 2) {
            if (code == 14) orch_workers_mark_down(o->workers, k);
            retry = r->relayed == 0;
        }
        log_warn("turn.worker_failed", "session %s: %s", req->session_id, msg);
    }
    rpc_status_clear(&st);
    return retry;
}

int orch_turn_run(orch *o, ExecuteStepRequest *req, int64_t timeout_ms, const orch_sink *sink,
                  orch_turn_result *out) {
    return orch_turn_run_on(o, req, timeout_ms, sink, NULL, out);
}

int orch_turn_run_on(orch *o, ExecuteStepRequest *req, int64_t timeout_ms, const orch_sink *sink,
                     const char *prefer, orch_turn_result *out) {
    memset(out, 0, sizeof *out);
    out->outcome = TURN_NO_WORKER;
    orch_worker *first = NULL;
    if (prefer && prefer[0]) first = orch_workers_pick_live(o->workers, prefer);
    if (!first) first = orch_workers_pick(o->workers, NULL);
    if (!first) {
        metric_inc(o->m_no_worker);
        set_error(out, "NO_WORKER", "no live worker to run the turn", 1);
        return 0;
    }
    int retry = attempt(o, first, req, timeout_ms, sink, out);
    orch_workers_done(o->workers, first);
    if (!retry) return 0;
    orch_worker *second = orch_workers_pick(o->workers, first);
    if (!second) return 0; /* the failure stands */
    metric_inc(o->m_retries);
    log_info("turn.retry", "session %s: retrying on worker %s after %s failed", req->session_id,
             second->addr, first->addr);
    out->outcome = TURN_FAILED;
    attempt(o, second, req, timeout_ms, sink, out);
    orch_workers_done(o->workers, second);
    return 0;
}
