/* The provider side of the tool contract (proto/upsquad/internal/v1/tool.proto):
 *
 *   tool.invoke.<tool>  queue group <tool>   ToolInvokeRequest -> ToolInvokeResponse
 *   tool.batch.<tool>   queue group <tool>   ToolInvokeBatchRequest -> ToolInvokeBatchResponse
 *   tool.announce                            ToolAnnounce at start, every announce_ms, and
 *                                            in reply to any request on the subject
 *   <stats_subject>                          JSON stats, request/reply
 *
 * Idempotency: one record per idempotency key in a bounded LRU. A key runs at most once: a
 * request for a key whose result is recorded gets that result back (replayed = true) and
 * nothing runs; a request for a key still running waits for that try to end (up to 80 % of its
 * own timeout_ms, 5 s without one) and then gets its outcome, or the retryable error
 * "in_progress" when it is still running by then.
 * Retryable failures (__fail_times, timeouts, overload) are not recorded: the next try of the
 * key runs. Invocations without a delay cue run on the subscription's own thread; delayed
 * ones (and duplicates waiting for their key) go to a bounded queue served by worker threads,
 * so a sleeping invocation never holds up the others. A batch hands its delayed calls to the
 * same queue and waits for them before its one reply, so it takes about its slowest call, not
 * the sum; a call the full queue cannot take runs on the batch's thread instead. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "devtools.h"
#include "log.h"
#include "lru.h"
#include "pbjson.h"
#include "subjects.h"
#include "util.h"

#define DT_KEY_MAX 128

typedef Upsquad__Internal__V1__ToolInvokeRequest dt_req;
typedef Upsquad__Internal__V1__ToolInvokeResponse dt_resp;

/* One idempotency key. Pinned in the LRU while it runs. */
typedef struct dt_rec {
    int running;
    int done; /* resp holds the recorded outcome */
    uint8_t *resp;
    size_t resp_len;
    uint32_t tries, executions, replays, in_progress;
    int iteration;
    char run_id[64], step[128], tool[64], action[64];
} dt_rec;

typedef struct dt_job {
    dt_req *req; /* owned (protobuf-c unpacked) */
    cJSON *args; /* owned: the arguments without top-level cues */
    dt_cues cues;
    const dt_action *act;
    char *reply; /* owned: the requester's inbox */
    uint32_t try_no;
    int64_t t0_ms;
    int waiting; /* a duplicate of a running key, waiting for that try to end */
    /* a call of a batch: its response is kept in slot (heap) for the batch's one reply instead
     * of being published to reply; both borrowed from the batch, which outlives the job */
    struct dt_slot *slot;
    struct dt_batch *batch;
} dt_job;

typedef struct dt_slot {
    uint8_t *buf;
    size_t len;
} dt_slot;

/* A batch being answered, on its subscription's thread. slots (one per call, in the calls'
 * order) and the batch itself belong to on_batch and are freed by it only once queued is 0:
 * a worker writes a call's slot, frees the job, and only then counts the call done, so no
 * worker touches either after that. */
typedef struct dt_batch {
    dt_slot *slots;
    size_t queued;          /* calls handed to the workers and not yet done (under p->mu) */
    pthread_cond_t done_cv; /* queued fell to 0 */
} dt_batch;

typedef struct dt_subctx {
    dt_provider *p;
    const dt_tool *t;
    bus_sub *sub, *batch_sub;
} dt_subctx;

typedef struct dt_counters {
    uint64_t invocations, executions, replays, in_progress, transient_failures, permanent_failures,
        timeouts, rejected, overloaded, batches, batch_inline;
    uint32_t max_executions_per_key;
} dt_counters;

struct dt_provider {
    bus *b;
    const dt_catalog *c;
    dt_opts o;
    pthread_mutex_t mu; /* rec, st, queue, stopping */
    pthread_cond_t qcv, stop_cv;
    pthread_cond_t key_cv; /* a try ended (recorded or not): waiting duplicates look again */
    lru *rec;
    lru *laps; /* executions per step (run, step, iteration, tool, action): polls' laps */
    dt_counters st;
    dt_subctx *subs;
    size_t n_subs;
    bus_sub *stats_sub, *announce_sub;
    uint8_t *announce;
    size_t announce_len;
    dt_job **q; /* ring of delayed jobs */
    size_t qhead, qlen;
    size_t busy; /* workers running a job */
    pthread_t *workers;
    size_t n_workers;
    pthread_t announcer;
    int announcer_started;
    int stopping;
};

/* Sleeps up to ms; returns 1 early when the provider stops. */
static int nap(dt_provider *p, long long ms) {
    struct timespec dl;
    util_deadline(&dl, ms);
    pthread_mutex_lock(&p->mu);
    while (!p->stopping)
        if (pthread_cond_timedwait(&p->stop_cv, &p->mu, &dl) == ETIMEDOUT) break;
    int stopped = p->stopping;
    pthread_mutex_unlock(&p->mu);
    return stopped;
}

static void rec_free(void *v) {
    dt_rec *r = v;
    if (!r) return;
    free(r->resp);
    free(r);
}

static int rec_pinned(const void *v) {
    return ((const dt_rec *)v)->running;
}

static void job_free(dt_job *j) {
    if (!j) return;
    if (j->req) upsquad__internal__v1__tool_invoke_request__free_unpacked(j->req, NULL);
    cJSON_Delete(j->args);
    dt_cues_free(&j->cues);
    free(j->reply);
    free(j);
}

/* ---- replies ---- */

/* A response (borrowed bytes) to the job's requester: published to its inbox, or kept in its
 * batch slot. */
static void deliver(dt_provider *p, const dt_job *j, const uint8_t *buf, size_t len) {
    if (j->slot) {
        free(j->slot->buf);
        j->slot->buf = malloc(len ? len : 1);
        j->slot->len = j->slot->buf ? len : 0;
        if (j->slot->buf) memcpy(j->slot->buf, buf, len);
        return;
    }
    if (bus_publish(p->b, j->reply, buf, (int)len) != BUS_OK)
        log_warn("devtools.reply", "reply to %s not sent", j->reply);
}

static void publish_resp(dt_provider *p, const dt_job *j, const dt_resp *r) {
    size_t n = upsquad__internal__v1__tool_invoke_response__get_packed_size(r);
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf) return; /* the requester times out and retries the same key */
    upsquad__internal__v1__tool_invoke_response__pack(r, buf);
    deliver(p, j, buf, n);
    free(buf);
}

static void reply_error(dt_provider *p, const dt_job *j, const char *code, const char *msg,
                        int retryable, int64_t t0) {
    dt_resp r = UPSQUAD__INTERNAL__V1__TOOL_INVOKE_RESPONSE__INIT;
    r.ok = 0;
    r.error_code = (char *)code;
    r.error_message = (char *)msg;
    r.retryable = retryable;
    r.duration_ms = (int32_t)(util_mono_ms() - t0);
    publish_resp(p, j, &r);
}

/* A recorded response sent again with replayed = true: field 7 (varint) appended to the
 * recorded bytes; a protobuf parser keeps the last value of a scalar field. */
static void reply_replay(dt_provider *p, const dt_job *j, const uint8_t *resp, size_t len) {
    uint8_t *buf = malloc(len + 2);
    if (!buf) return;
    memcpy(buf, resp, len);
    buf[len] = (7 << 3) | 0; /* tag: field 7, wire type varint */
    buf[len + 1] = 1;
    deliver(p, j, buf, len + 2);
    free(buf);
}

/* ---- admission: decode, check, de-duplicate ---- */

enum { ADMIT_RUN, ADMIT_DONE, ADMIT_WAIT };

#define DT_WAIT_DEFAULT_MS 5000 /* how long a duplicate without timeout_ms waits */

static int check_args(const dt_action *a, const cJSON *args, char *err, size_t errlen) {
    for (const cJSON *e = args ? args->child : NULL; e; e = e->next) {
        size_t k = 0;
        while (k < a->n_args && strcmp(a->args[k], e->string) != 0)
            k++;
        if (k == a->n_args) {
            snprintf(err, errlen, "arguments.%s: %s.%s has no such argument", e->string, a->tool,
                     a->action);
            return -1;
        }
    }
    for (size_t k = 0; k < a->n_args; k++) {
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(args, a->args[k]);
        if (a->required[k] && (!v || cJSON_IsNull(v))) {
            snprintf(err, errlen, "arguments.%s: required by %s.%s", a->args[k], a->tool,
                     a->action);
            return -1;
        }
    }
    return 0;
}

static int key_valid(const char *k) {
    size_t n = k ? strlen(k) : 0;
    if (n < 1 || n > DT_KEY_MAX) return 0;
    for (; *k; k++)
        if ((unsigned char)*k <= ' ' || *k == 0x7f) return 0;
    return 1;
}

/* Decodes and checks the request (bytes) into j; on a bad request answers it and returns
 * -1. */
static int decode(dt_provider *p, const dt_tool *t, const uint8_t *data, size_t len, dt_job *j) {
    char err[256] = "";
    const char *code = "invalid_arguments";
    j->req = upsquad__internal__v1__tool_invoke_request__unpack(NULL, len, data);
    if (!j->req) {
        snprintf(err, sizeof err, "request: not a ToolInvokeRequest");
    } else if (!key_valid(j->req->idempotency_key)) {
        snprintf(err, sizeof err, "idempotency_key: 1 to %d printable characters", DT_KEY_MAX);
    } else if (strcmp(j->req->tool, t->tool) != 0) {
        snprintf(err, sizeof err, "tool: \"%s\" sent on the subject of \"%s\"", j->req->tool,
                 t->tool);
    } else if (!(j->act = dt_catalog_action(t, j->req->action))) {
        code = "unknown_action";
        snprintf(err, sizeof err, "action: %s has no action \"%s\"", t->tool, j->req->action);
    } else {
        j->args =
            j->req->arguments ? pbjson_struct_to_json(j->req->arguments) : cJSON_CreateObject();
        if (!j->args)
            snprintf(err, sizeof err, "arguments: cannot be read");
        else if (dt_cues_parse(j->args, &j->cues, err, sizeof err) == 0)
            check_args(j->act, j->args, err, sizeof err);
    }
    if (!err[0]) return 0;
    pthread_mutex_lock(&p->mu);
    p->st.rejected++;
    pthread_mutex_unlock(&p->mu);
    reply_error(p, j, code, err, 0, j->t0_ms);
    return -1;
}

static dt_rec *rec_new(const dt_req *q) {
    dt_rec *r = calloc(1, sizeof *r);
    if (!r) return NULL;
    snprintf(r->run_id, sizeof r->run_id, "%s", q->run_id);
    snprintf(r->step, sizeof r->step, "%s", q->step_name);
    snprintf(r->tool, sizeof r->tool, "%s", q->tool);
    snprintf(r->action, sizeof r->action, "%s", q->action);
    r->iteration = q->iteration;
    return r;
}

/* The idempotency decision, under the lock: replay a recorded outcome, wait (may_wait) or
 * refuse while the key runs, or mark it running and let this try run. Returns ADMIT_RUN,
 * ADMIT_WAIT, or ADMIT_DONE (answered). */
static int admit(dt_provider *p, dt_job *j, int may_wait) {
    const char *key = j->req->idempotency_key;
    uint8_t *copy = NULL;
    size_t copy_len = 0;
    int busy = 0, oom = 0;
    pthread_mutex_lock(&p->mu);
    dt_rec *r = lru_get(p->rec, key);
    if (!r) {
        r = rec_new(j->req);
        if (!r || lru_insert(p->rec, key, r, sizeof *r) != 0) r = NULL; /* insert frees r */
    }
    if (!r) {
        oom = 1;
    } else if (r->done) {
        r->replays++;
        p->st.replays++;
        copy = malloc(r->resp_len ? r->resp_len : 1);
        if (copy) memcpy(copy, r->resp, r->resp_len);
        copy_len = r->resp_len;
        oom = !copy;
    } else if (r->running && may_wait) {
        pthread_mutex_unlock(&p->mu);
        return ADMIT_WAIT;
    } else if (r->running) {
        r->in_progress++;
        p->st.in_progress++;
        busy = 1;
    } else {
        r->running = 1;
        j->try_no = ++r->tries;
    }
    pthread_mutex_unlock(&p->mu);
    if (copy) {
        reply_replay(p, j, copy, copy_len);
        free(copy);
    } else if (busy) {
        reply_error(p, j, "in_progress", "this idempotency key is running; retry later", 1,
                    j->t0_ms);
    } else if (oom) {
        reply_error(p, j, "provider_error", "out of memory", 1, j->t0_ms);
    } else {
        return ADMIT_RUN;
    }
    return ADMIT_DONE;
}

/* ---- execution ---- */

/* Ends a try that recorded nothing: the key may run again. */
static void finish_unrecorded(dt_provider *p, const char *key, uint64_t *counter) {
    pthread_mutex_lock(&p->mu);
    dt_rec *r = lru_get(p->rec, key);
    if (r) r->running = 0;
    (*counter)++;
    pthread_cond_broadcast(&p->key_cv);
    pthread_mutex_unlock(&p->mu);
}

/* Records the outcome for the key (the record is pinned, so it is still there). */
static void record(dt_provider *p, const char *key, uint8_t *resp, size_t len, int executed) {
    pthread_mutex_lock(&p->mu);
    dt_rec *r = lru_get(p->rec, key);
    if (r) {
        r->running = 0;
        r->done = 1;
        free(r->resp);
        r->resp = resp;
        r->resp_len = len;
        resp = NULL;
        if (executed) {
            r->executions++;
            if (r->executions > p->st.max_executions_per_key)
                p->st.max_executions_per_key = r->executions;
        }
        lru_recharge(p->rec, key, sizeof *r + len);
    }
    if (executed)
        p->st.executions++;
    else
        p->st.permanent_failures++;
    pthread_cond_broadcast(&p->key_cv);
    pthread_mutex_unlock(&p->mu);
    free(resp);
}

/* This execution's lap of its step: poll waits call the same action once per interval, each
 * lap with its own key. Forgetting a step (LRU) restarts its count. */
static int next_lap(dt_provider *p, const dt_req *q) {
    char id[512];
    snprintf(id, sizeof id, "%s\x1f%s\x1f%d\x1f%s\x1f%s", q->run_id, q->step_name, q->iteration,
             q->tool, q->action);
    pthread_mutex_lock(&p->mu);
    int *n = lru_get(p->laps, id);
    if (!n && (n = calloc(1, sizeof *n)) && lru_insert(p->laps, id, n, sizeof *n) != 0) n = NULL;
    int lap = n ? ++*n : 1;
    pthread_mutex_unlock(&p->mu);
    return lap;
}

/* Members of src (copied) replace or join those of out. -1 on OOM (out is then freed). */
static int merge_into(cJSON **out, const cJSON *src) {
    for (const cJSON *e = src ? src->child : NULL; *out && e; e = e->next) {
        cJSON *v = cJSON_Duplicate(e, 1);
        if (v && cJSON_ReplaceItemInObjectCaseSensitive(*out, e->string, v)) continue;
        if (v && cJSON_AddItemToObject(*out, e->string, v)) continue;
        cJSON_Delete(v);
        cJSON_Delete(*out);
        *out = NULL;
    }
    return *out ? 0 : -1;
}

/* The fixture rendered with the arguments, __result merged over it, and on a pending lap
 * (__pending) the fixture's "pending" object (default {"status": "pending"}). NULL on OOM. */
static Google__Protobuf__Struct *render_result(dt_provider *p, const dt_job *j, char *err,
                                               size_t errlen) {
    const dt_req *q = j->req;
    dt_ctx x = {.key = q->idempotency_key,
                .org_id = q->org_id,
                .run_id = q->run_id,
                .step_name = q->step_name,
                .tool = q->tool,
                .action = q->action,
                .iteration = q->iteration,
                .lap = next_lap(p, q)};
    cJSON *out = dt_render(j->act->result, j->args, &x);
    merge_into(&out, j->cues.result);
    if (out && x.lap <= j->cues.pending) {
        cJSON *pend = j->act->pending ? dt_render(j->act->pending, j->args, &x)
                                      : cJSON_Parse("{\"status\":\"pending\"}");
        if (!pend || merge_into(&out, pend) != 0) {
            cJSON_Delete(out);
            out = NULL;
        }
        cJSON_Delete(pend);
    }
    Google__Protobuf__Struct *s = NULL;
    if (out && pbjson_struct_from_json(out, &s, err, errlen) != 0) s = NULL;
    cJSON_Delete(out);
    return s;
}

/* Runs one admitted try: delay, cue failures, the fixture; records and answers. */
static void execute(dt_provider *p, dt_job *j) {
    const char *key = j->req->idempotency_key;
    const dt_cues *c = &j->cues;
    if (c->sleep_ms > 0 && (c->sleep_times == 0 || j->try_no <= (uint32_t)c->sleep_times)) {
        long long give_up = j->req->timeout_ms > 0 ? j->req->timeout_ms : -1;
        int timed_out = give_up >= 0 && c->sleep_ms >= give_up;
        /* the contract: a provider gives up after timeout_ms, having run nothing */
        if (nap(p, timed_out ? give_up : c->sleep_ms)) {
            finish_unrecorded(p, key, &p->st.transient_failures);
            reply_error(p, j, "provider_error", "provider stopping", 1, j->t0_ms);
            return;
        }
        if (timed_out) {
            finish_unrecorded(p, key, &p->st.timeouts);
            reply_error(p, j, "timeout", "gave up after the request's timeout_ms (cue)", 1,
                        j->t0_ms);
            return;
        }
    }
    if (j->try_no <= (uint32_t)c->fail_times) {
        char msg[96];
        snprintf(msg, sizeof msg, "failing try %u of %d on cue", j->try_no, c->fail_times);
        finish_unrecorded(p, key, &p->st.transient_failures);
        reply_error(p, j, "provider_error", msg, 1, j->t0_ms);
        return;
    }
    char err[256] = "";
    dt_resp r = UPSQUAD__INTERNAL__V1__TOOL_INVOKE_RESPONSE__INIT;
    Google__Protobuf__Struct *result = NULL;
    if (c->fail) {
        r.error_code = (char *)c->fail_code;
        r.error_message = "failed on cue __fail";
    } else if ((result = render_result(p, j, err, sizeof err))) {
        r.ok = 1;
        r.result = result;
    } else {
        finish_unrecorded(p, key, &p->st.transient_failures);
        reply_error(p, j, "provider_error", err[0] ? err : "out of memory", 1, j->t0_ms);
        return;
    }
    r.duration_ms = (int32_t)(util_mono_ms() - j->t0_ms);
    size_t n = upsquad__internal__v1__tool_invoke_response__get_packed_size(&r);
    uint8_t *buf = malloc(n ? n : 1);
    if (buf) upsquad__internal__v1__tool_invoke_response__pack(&r, buf);
    pbjson_struct_free(result);
    if (!buf) {
        finish_unrecorded(p, key, &p->st.transient_failures);
        reply_error(p, j, "provider_error", "out of memory", 1, j->t0_ms);
        return;
    }
    /* Recorded before the reply is sent: a retry that overtakes a late reply gets the same
     * outcome (replayed) and nothing runs twice. */
    uint8_t *copy = malloc(n ? n : 1);
    if (copy) memcpy(copy, buf, n);
    record(p, key, buf, n, !c->fail);
    log_set_trace(j->req->trace_id[0] ? j->req->trace_id : NULL);
    log_debug("devtools.executed", "run=%s step=%s %s.%s key=%s try=%u: %s", j->req->run_id,
              j->req->step_name, j->req->tool, j->req->action, key, j->try_no,
              c->fail ? c->fail_code : "ok");
    log_set_trace(NULL);
    if (c->reply_delay_ms > 0) nap(p, c->reply_delay_ms);
    if (copy) deliver(p, j, copy, n);
    free(copy);
}

/* ---- delayed jobs: a bounded queue and its workers ---- */

/* A duplicate of a running key waits until that try ends, within what its caller still waits
 * for, then is admitted again (replay, run, or "in_progress" when still running). */
static int await_key(dt_provider *p, dt_job *j) {
    int32_t to = j->req->timeout_ms;
    int64_t wait_ms = to > 0 ? (int64_t)to * 8 / 10 : DT_WAIT_DEFAULT_MS;
    int64_t left = j->t0_ms + wait_ms - util_mono_ms();
    struct timespec dl;
    util_deadline(&dl, left);
    pthread_mutex_lock(&p->mu);
    for (;;) {
        const dt_rec *r = lru_get(p->rec, j->req->idempotency_key);
        if (!r || !r->running || p->stopping || left <= 0) break;
        if (pthread_cond_timedwait(&p->key_cv, &p->mu, &dl) == ETIMEDOUT) break;
    }
    pthread_mutex_unlock(&p->mu);
    j->waiting = 0;
    return admit(p, j, 0);
}

/* Hands j to the workers (they own it then) and counts it in its batch; -1 when the queue is
 * full or the provider stops (j stays the caller's). */
static int queue_push(dt_provider *p, dt_job *j) {
    pthread_mutex_lock(&p->mu);
    int full = p->qlen == (size_t)p->o.queue || p->stopping;
    if (!full) {
        p->q[(p->qhead + p->qlen) % (size_t)p->o.queue] = j;
        p->qlen++;
        if (j->batch) j->batch->queued++;
        pthread_cond_signal(&p->qcv);
    }
    pthread_mutex_unlock(&p->mu);
    return full ? -1 : 0;
}

/* Takes ownership of j. Full queue: the try is refused, retryable, and nothing is recorded. */
static void enqueue(dt_provider *p, dt_job *j) {
    if (queue_push(p, j) == 0) return;
    if (j->waiting) { /* the key is another try's: leave its record alone */
        pthread_mutex_lock(&p->mu);
        p->st.overloaded++;
        pthread_mutex_unlock(&p->mu);
    } else {
        finish_unrecorded(p, j->req->idempotency_key, &p->st.overloaded);
    }
    reply_error(p, j, "overloaded", "devtools' delayed-invocation queue is full", 1, j->t0_ms);
    job_free(j);
}

/* Runs a dequeued (or batch-inline) job to its answer: a duplicate first waits for its key. */
static void run_job(dt_provider *p, dt_job *j) {
    if (!j->waiting || await_key(p, j) == ADMIT_RUN) execute(p, j);
}

static void *worker_main(void *arg) {
    dt_provider *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (!p->qlen && !p->stopping)
            pthread_cond_wait(&p->qcv, &p->mu);
        if (!p->qlen) { /* stopping and drained */
            pthread_mutex_unlock(&p->mu);
            return NULL;
        }
        dt_job *j = p->q[p->qhead];
        p->qhead = (p->qhead + 1) % (size_t)p->o.queue;
        p->qlen--;
        p->busy++;
        pthread_mutex_unlock(&p->mu);
        run_job(p, j);
        dt_batch *bt = j->batch;
        job_free(j);
        pthread_mutex_lock(&p->mu);
        p->busy--;
        /* the last touch of the batch: once queued is 0 its thread may free it */
        if (bt && --bt->queued == 0) pthread_cond_signal(&bt->done_cv);
        pthread_mutex_unlock(&p->mu);
    }
}

/* ---- subscriptions ---- */

/* An admitted try that waits before answering (a delay cue this try obeys): a worker's. */
static int job_delayed(const dt_job *j) {
    const dt_cues *c = &j->cues;
    return c->reply_delay_ms > 0 ||
           (c->sleep_ms > 0 && (c->sleep_times == 0 || j->try_no <= (uint32_t)c->sleep_times));
}

static void on_invoke(bus *b, natsMsg *m, void *ud) {
    (void)b;
    dt_subctx *sc = ud;
    dt_provider *p = sc->p;
    const char *reply = natsMsg_GetReply(m);
    pthread_mutex_lock(&p->mu);
    p->st.invocations++;
    pthread_mutex_unlock(&p->mu);
    if (!reply || !*reply) return; /* a publish, not a request: nobody to answer */
    dt_job *j = calloc(1, sizeof *j);
    if (!j || !(j->reply = strdup(reply))) {
        free(j);
        return;
    }
    j->t0_ms = util_mono_ms();
    int a = decode(p, sc->t, (const uint8_t *)natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m),
                   j) != 0
                ? ADMIT_DONE
                : admit(p, j, 1);
    if (a == ADMIT_WAIT) {
        j->waiting = 1; /* waits on a worker, never on this subscription's thread */
        enqueue(p, j);
        return;
    }
    if (a != ADMIT_RUN) {
        job_free(j);
        return;
    }
    if (job_delayed(j)) {
        enqueue(p, j);
        return;
    }
    execute(p, j);
    job_free(j);
}

/* tool.batch.<tool>: every call of the batch through the same admission and execution as a
 * single request (its own key, replay, cues), then one reply with the responses in order.
 * Calls without a delay run on this thread as they come; delayed calls, and duplicates that
 * must wait for their key's running try, go to the workers' queue, so the batch takes about
 * its slowest call. A call the full queue cannot take runs on this thread once the others are
 * handed out (the queue is tried again first): the batch's calls all get their answer, and
 * the blocking stays bounded by the calls' own cues, where a retryable "overloaded" would make
 * the engine send each such call again, alone. A batch over DT_BATCH_MAX calls, or one that
 * does not decode, gets no results: the requester sends its calls one by one. */
#define DT_BATCH_MAX 256

/* Call i of the batch decoded and admitted like a single request. Returns the job to run (its
 * waiting flag set when its key is running elsewhere), or NULL when the call was answered in
 * its slot (bad, replayed, refused) or could not be made (no slot: the requester retries it). */
static dt_job *batch_admit(dt_provider *p, const dt_tool *t, const dt_req *call, const char *reply,
                           dt_batch *bt, size_t i) {
    dt_job *j = calloc(1, sizeof *j);
    size_t len = upsquad__internal__v1__tool_invoke_request__get_packed_size(call);
    uint8_t *buf = malloc(len ? len : 1);
    if (!j || !buf || !(j->reply = strdup(reply))) {
        free(buf);
        job_free(j);
        return NULL;
    }
    upsquad__internal__v1__tool_invoke_request__pack(call, buf);
    j->slot = &bt->slots[i];
    j->batch = bt;
    j->t0_ms = util_mono_ms();
    int a = decode(p, t, buf, len, j) != 0 ? ADMIT_DONE : admit(p, j, 1);
    free(buf);
    if (a == ADMIT_DONE) {
        job_free(j);
        return NULL;
    }
    j->waiting = a == ADMIT_WAIT;
    return j;
}

/* Runs or hands out every call of bq; returns once each has delivered into its slot. */
static void batch_run(dt_provider *p, const dt_tool *t,
                      const Upsquad__Internal__V1__ToolInvokeBatchRequest *bq, size_t n,
                      const char *reply, dt_batch *bt, dt_job **later) {
    size_t n_later = 0, n_inline = 0;
    for (size_t i = 0; i < n; i++) {
        dt_job *j = batch_admit(p, t, bq->calls[i], reply, bt, i);
        if (!j) continue;
        if (!j->waiting && !job_delayed(j)) {
            execute(p, j);
            job_free(j);
        } else if (queue_push(p, j) != 0) {
            later[n_later++] = j; /* admitted (its key marked running) and kept in call order */
        }
    }
    /* a deferred duplicate follows the deferred try of its key (call order), so it never waits
     * here for a call still to be run here */
    for (size_t k = 0; k < n_later; k++) {
        if (queue_push(p, later[k]) == 0) continue;
        n_inline++;
        run_job(p, later[k]);
        job_free(later[k]);
    }
    pthread_mutex_lock(&p->mu);
    p->st.batch_inline += n_inline;
    while (bt->queued)
        pthread_cond_wait(&bt->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

/* The one reply: the responses in the calls' order, up to the first call without one. */
static void batch_reply(dt_provider *p, const char *reply, const dt_slot *slots, size_t n) {
    dt_resp **rs = calloc(n ? n : 1, sizeof *rs);
    Upsquad__Internal__V1__ToolInvokeBatchResponse out =
        UPSQUAD__INTERNAL__V1__TOOL_INVOKE_BATCH_RESPONSE__INIT;
    for (size_t i = 0; rs && i < n && slots[i].buf; i++) {
        rs[i] =
            upsquad__internal__v1__tool_invoke_response__unpack(NULL, slots[i].len, slots[i].buf);
        if (!rs[i]) break;
        out.n_results = i + 1;
    }
    out.results = rs;
    size_t len = upsquad__internal__v1__tool_invoke_batch_response__get_packed_size(&out);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf) {
        upsquad__internal__v1__tool_invoke_batch_response__pack(&out, buf);
        if (bus_publish(p->b, reply, buf, (int)len) != BUS_OK)
            log_warn("devtools.reply", "batch reply to %s not sent", reply);
    }
    free(buf);
    for (size_t i = 0; i < out.n_results; i++)
        upsquad__internal__v1__tool_invoke_response__free_unpacked(rs[i], NULL);
    free(rs);
}

static void on_batch(bus *b, natsMsg *m, void *ud) {
    (void)b;
    dt_subctx *sc = ud;
    dt_provider *p = sc->p;
    const char *reply = natsMsg_GetReply(m);
    if (!reply || !*reply) return;
    Upsquad__Internal__V1__ToolInvokeBatchRequest *bq =
        upsquad__internal__v1__tool_invoke_batch_request__unpack(
            NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    size_t n = bq && bq->n_calls <= DT_BATCH_MAX ? bq->n_calls : 0;
    dt_batch bt = {.slots = calloc(n ? n : 1, sizeof *bt.slots)};
    dt_job **later = calloc(n ? n : 1, sizeof *later);
    if (!bt.slots || !later) n = 0;
    pthread_cond_init(&bt.done_cv, NULL);
    pthread_mutex_lock(&p->mu);
    p->st.batches++;
    p->st.invocations += n;
    pthread_mutex_unlock(&p->mu);
    if (n) batch_run(p, sc->t, bq, n, reply, &bt, later);
    batch_reply(p, reply, bt.slots, n); /* no worker holds bt any more */
    for (size_t i = 0; i < n; i++)
        free(bt.slots[i].buf);
    free(bt.slots);
    free(later);
    pthread_cond_destroy(&bt.done_cv);
    if (bq) upsquad__internal__v1__tool_invoke_batch_request__free_unpacked(bq, NULL);
}

static void on_announce_request(bus *b, natsMsg *m, void *ud) {
    dt_provider *p = ud;
    const char *reply = natsMsg_GetReply(m);
    if (reply && *reply) bus_respond(b, m, p->announce, (int)p->announce_len);
}

static cJSON *rec_json(const char *key, const dt_rec *r) {
    cJSON *o = cJSON_CreateObject();
    if (!o) return NULL;
    cJSON_AddStringToObject(o, "key", key);
    cJSON_AddStringToObject(o, "run_id", r->run_id);
    cJSON_AddStringToObject(o, "step_name", r->step);
    cJSON_AddNumberToObject(o, "iteration", r->iteration);
    cJSON_AddStringToObject(o, "tool", r->tool);
    cJSON_AddStringToObject(o, "action", r->action);
    cJSON_AddNumberToObject(o, "tries", r->tries);
    cJSON_AddNumberToObject(o, "executions", r->executions);
    cJSON_AddNumberToObject(o, "replays", r->replays);
    cJSON_AddNumberToObject(o, "in_progress", r->in_progress);
    cJSON_AddStringToObject(o, "state", r->running ? "running" : r->done ? "done" : "retryable");
    return o;
}

typedef struct run_filter {
    const char *run_id;
    cJSON *arr;
} run_filter;

static void add_if_run(const char *key, void *val, void *ud) {
    run_filter *f = ud;
    const dt_rec *r = val;
    if (strcmp(r->run_id, f->run_id) == 0) cJSON_AddItemToArray(f->arr, rec_json(key, r));
}

/* Request body: empty, or {"key": "..."} for one record, or {"run_id": "..."} for a run's. */
static void on_stats(bus *b, natsMsg *m, void *ud) {
    dt_provider *p = ud;
    cJSON *q = natsMsg_GetDataLength(m) > 0
                   ? cJSON_ParseWithLength(natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m))
                   : NULL;
    const cJSON *key = cJSON_GetObjectItemCaseSensitive(q, "key");
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(q, "run_id");
    cJSON *o = cJSON_CreateObject();
    pthread_mutex_lock(&p->mu);
    const dt_counters *s = &p->st;
    cJSON_AddStringToObject(o, "provider", p->o.provider);
    cJSON_AddNumberToObject(o, "invocations", (double)s->invocations);
    cJSON_AddNumberToObject(o, "batches", (double)s->batches);
    cJSON_AddNumberToObject(o, "batch_inline", (double)s->batch_inline);
    cJSON_AddNumberToObject(o, "executions", (double)s->executions);
    cJSON_AddNumberToObject(o, "replays", (double)s->replays);
    cJSON_AddNumberToObject(o, "in_progress", (double)s->in_progress);
    cJSON_AddNumberToObject(o, "transient_failures", (double)s->transient_failures);
    cJSON_AddNumberToObject(o, "permanent_failures", (double)s->permanent_failures);
    cJSON_AddNumberToObject(o, "timeouts", (double)s->timeouts);
    cJSON_AddNumberToObject(o, "rejected", (double)s->rejected);
    cJSON_AddNumberToObject(o, "overloaded", (double)s->overloaded);
    cJSON_AddNumberToObject(o, "queued", (double)p->qlen);
    cJSON_AddNumberToObject(o, "workers_busy", (double)p->busy);
    cJSON_AddNumberToObject(o, "max_executions_per_key", s->max_executions_per_key);
    cJSON_AddNumberToObject(o, "keys", (double)lru_count(p->rec));
    cJSON_AddNumberToObject(o, "evicted", (double)lru_evicted(p->rec));
    cJSON_AddNumberToObject(o, "dedup_max_keys", (double)p->o.dedup_keys);
    if (cJSON_IsString(key)) {
        const dt_rec *r = lru_get(p->rec, key->valuestring);
        cJSON_AddItemToObject(o, "record", r ? rec_json(key->valuestring, r) : cJSON_CreateNull());
    }
    if (cJSON_IsString(run)) {
        run_filter f = {run->valuestring, cJSON_AddArrayToObject(o, "records")};
        if (f.arr) lru_foreach(p->rec, add_if_run, &f);
    }
    pthread_mutex_unlock(&p->mu);
    char *txt = cJSON_PrintUnformatted(o);
    if (txt) bus_respond(b, m, txt, (int)strlen(txt));
    free(txt);
    cJSON_Delete(o);
    cJSON_Delete(q);
}

/* ---- announce ---- */

static int build_announce(dt_provider *p) {
    Upsquad__Internal__V1__ToolAnnounce a = UPSQUAD__INTERNAL__V1__TOOL_ANNOUNCE__INIT;
    Upsquad__Internal__V1__ToolAnnounceTool *tools = calloc(p->c->n_tools, sizeof *tools);
    Upsquad__Internal__V1__ToolAnnounceTool **ptrs = calloc(p->c->n_tools, sizeof *ptrs);
    int rc = -1;
    if (!tools || !ptrs) goto done;
    for (size_t i = 0; i < p->c->n_tools; i++) {
        const dt_tool *t = &p->c->tools[i];
        upsquad__internal__v1__tool_announce_tool__init(&tools[i]);
        tools[i].tool = (char *)t->tool;
        tools[i].actions = calloc(t->n_actions, sizeof(char *));
        if (!tools[i].actions) goto done;
        for (size_t k = 0; k < t->n_actions; k++)
            tools[i].actions[k] = (char *)t->actions[k].action;
        tools[i].n_actions = t->n_actions;
        ptrs[i] = &tools[i];
    }
    a.provider = (char *)p->o.provider;
    a.tools = ptrs;
    a.n_tools = p->c->n_tools;
    p->announce_len = upsquad__internal__v1__tool_announce__get_packed_size(&a);
    p->announce = malloc(p->announce_len ? p->announce_len : 1);
    if (!p->announce) goto done;
    upsquad__internal__v1__tool_announce__pack(&a, p->announce);
    rc = 0;
done:
    for (size_t i = 0; tools && i < p->c->n_tools; i++)
        free(tools[i].actions);
    free(tools);
    free(ptrs);
    return rc;
}

static void *announcer_main(void *arg) {
    dt_provider *p = arg;
    do {
        if (bus_publish(p->b, SUBJ_TOOL_ANNOUNCE, p->announce, (int)p->announce_len) != BUS_OK)
            log_warn("devtools.announce", "announce not sent (NATS unavailable)");
    } while (!nap(p, p->o.announce_ms));
    return NULL;
}

/* ---- lifecycle ---- */

static int subscribe_all(dt_provider *p, char *err, size_t errlen) {
    char subject[256];
    p->subs = calloc(p->c->n_tools, sizeof *p->subs);
    if (!p->subs) return util_errf(err, errlen, -1, "out of memory");
    for (size_t i = 0; i < p->c->n_tools; i++) {
        dt_subctx *sc = &p->subs[i];
        sc->p = p;
        sc->t = &p->c->tools[i];
        /* the prefix holds a dot, so it is joined here; the tool name is checked as a token */
        if (!bus_token_valid(sc->t->tool) ||
            snprintf(subject, sizeof subject, "%s.%s", SUBJ_TOOL_INVOKE, sc->t->tool) >=
                (int)sizeof subject)
            return util_errf(err, errlen, -1, "tool %s: not a subject token", sc->t->tool);
        /* queue group named after the tool: replicas of a provider share its work */
        if (bus_subscribe(p->b, subject, sc->t->tool, on_invoke, sc, &sc->sub, err, errlen) != 0)
            return -1;
        p->n_subs++; /* unsubscribed at stop, the batch subscription too once made */
        snprintf(subject, sizeof subject, "%s.%s", SUBJ_TOOL_BATCH, sc->t->tool);
        if (bus_subscribe(p->b, subject, sc->t->tool, on_batch, sc, &sc->batch_sub, err, errlen) !=
            0)
            return -1;
    }
    if (bus_subscribe(p->b, p->o.stats_subject, NULL, on_stats, p, &p->stats_sub, err, errlen) !=
            0 ||
        bus_subscribe(p->b, SUBJ_TOOL_ANNOUNCE, NULL, on_announce_request, p, &p->announce_sub, err,
                      errlen) != 0)
        return -1;
    if (bus_flush(p->b, 5000) != BUS_OK)
        return util_errf(err, errlen, -1, "NATS did not confirm the subscriptions");
    return 0;
}

int dt_provider_start(bus *b, const dt_catalog *c, const dt_opts *o, dt_provider **out, char *err,
                      size_t errlen) {
    *out = NULL;
    if (o->dedup_keys < 1 || o->workers < 1 || o->queue < 1 || o->announce_ms < 1)
        return util_errf(err, errlen, -1,
                         "dedup keys, workers, queue and announce period must be positive");
    dt_provider *p = calloc(1, sizeof *p);
    if (!p) return util_errf(err, errlen, -1, "out of memory");
    p->b = b;
    p->c = c;
    p->o = *o;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->qcv, NULL);
    /* timed waits (cue delays, a duplicate waiting for its key) on the monotonic clock: a wall
     * clock step must not cut a delay short */
    util_cond_init_monotonic(&p->stop_cv);
    util_cond_init_monotonic(&p->key_cv);
    lru_opts lo = {.max_entries = (size_t)o->dedup_keys,
                   .max_bytes = (size_t)o->dedup_bytes,
                   .free_val = rec_free,
                   .pinned = rec_pinned};
    p->q = calloc((size_t)o->queue, sizeof *p->q);
    p->workers = calloc((size_t)o->workers, sizeof *p->workers);
    lru_opts laps = {.max_entries = (size_t)o->dedup_keys, .free_val = free};
    if (!p->q || !p->workers || lru_create(&lo, &p->rec) != 0 || lru_create(&laps, &p->laps) != 0 ||
        build_announce(p) != 0) {
        dt_provider_stop(p);
        return util_errf(err, errlen, -1, "out of memory");
    }
    for (; p->n_workers < (size_t)o->workers; p->n_workers++)
        if (pthread_create(&p->workers[p->n_workers], NULL, worker_main, p) != 0) break;
    if (p->n_workers < (size_t)o->workers || subscribe_all(p, err, errlen) != 0) {
        if (!err[0]) snprintf(err, errlen, "cannot start worker threads");
        dt_provider_stop(p);
        return -1;
    }
    p->announcer_started = pthread_create(&p->announcer, NULL, announcer_main, p) == 0;
    *out = p;
    return 0;
}

void dt_provider_stop(dt_provider *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_subs; i++) {
        bus_unsubscribe(p->subs[i].sub);
        bus_unsubscribe(p->subs[i].batch_sub);
    }
    bus_unsubscribe(p->stats_sub);
    bus_unsubscribe(p->announce_sub);
    pthread_mutex_lock(&p->mu);
    p->stopping = 1;
    pthread_cond_broadcast(&p->qcv);
    pthread_cond_broadcast(&p->stop_cv);
    pthread_cond_broadcast(&p->key_cv);
    pthread_mutex_unlock(&p->mu);
    for (size_t i = 0; i < p->n_workers; i++)
        pthread_join(p->workers[i], NULL);
    if (p->announcer_started) pthread_join(p->announcer, NULL);
    lru_destroy(p->rec);
    lru_destroy(p->laps);
    free(p->subs);
    free(p->q);
    free(p->workers);
    free(p->announce);
    pthread_cond_destroy(&p->qcv);
    pthread_cond_destroy(&p->stop_cv);
    pthread_cond_destroy(&p->key_cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}
