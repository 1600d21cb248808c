/* The consumer loop of wf-responder (see responder.h).
 *
 * At-least-once on both legs, as the bus contract says: a dispatch is acked only after its
 * result was published (JetStream ack); a redelivered or re-published dispatch whose key has
 * a recorded result gets that same result again (same Nats-Msg-Id) and does not execute
 * again. Counting: `dispatches` per key counts every delivery, `executions` the first only. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ids.h"
#include "log.h"
#include "lru.h"
#include "pbjson.h"
#include "responder.h"
#include "subjects.h"
#include "upsquad/internal/v1/agent_step.pb-c.h"
#include "util.h"

typedef Upsquad__Internal__V1__AgentStepDispatch wr_dispatch;
typedef Upsquad__Internal__V1__AgentStepResult wr_result;

#define WR_FETCH_WAIT_MS 500
#define WR_HEARTBEAT_MS 2000 /* "in progress" while a step sleeps on cue */

static const char *const outcome_names[] = {"completed", "failed", "input_required",
                                            "interrupt_required"};

typedef struct wr_rec {
    int running, done;
    uint8_t *result; /* packed AgentStepResult, re-sent on a duplicate */
    size_t result_len;
    char subject[256];
    uint32_t dispatches, executions;
    int outcome, iteration, attempt;
    char run_id[64], step[128];
} wr_rec;

typedef struct wr_worker {
    wr *r;
    pthread_t th;
    bus_pull *pull;
} wr_worker;

typedef struct wr_counters {
    uint64_t dispatches, executions, duplicates, rejected, publish_errors;
    uint64_t outcomes[4];
    uint32_t max_dispatches_per_key, max_executions_per_key;
} wr_counters;

struct wr {
    bus *b;
    wr_opts o;
    pthread_mutex_t mu; /* rec, st, stopping */
    lru *rec;
    wr_counters st;
    wr_worker *workers;
    size_t n_workers;
    bus_sub *stats_sub;
    atomic_int stopping;
};

static void rec_free(void *v) {
    wr_rec *r = v;
    if (r) free(r->result);
    free(r);
}

static int rec_pinned(const void *v) {
    return ((const wr_rec *)v)->running;
}

/* ---- the outcome ---- */

/* A UUID-shaped id derived from text (deterministic session and agent ids). */
static void derived_uuid(const char *a, const char *b, char out[37]) {
    char hex[65];
    ids_sha256 h;
    if (ids_sha256_init(&h) != 0) {
        snprintf(out, 37, "00000000-0000-4000-8000-000000000000");
        return;
    }
    ids_sha256_update_str(&h, a);
    ids_sha256_update_str(&h, ":");
    ids_sha256_update_str(&h, b);
    ids_sha256_final_hex(&h, hex);
    snprintf(out, 37, "%.8s-%.4s-4%.3s-8%.3s-%.12s", hex, hex + 8, hex + 12, hex + 15, hex + 18);
}

/* Default output: every `expects` field with a value of its type, plus the goal echoed. */
static cJSON *default_output(const wr_dispatch *d) {
    cJSON *o = cJSON_CreateObject();
    char text[256];
    for (size_t i = 0; o && i < d->n_expects; i++) {
        const Upsquad__Internal__V1__ExpectedField *f = d->expects[i];
        const char *t = f->type;
        cJSON *v;
        if (strcmp(t, "number") == 0 || strcmp(t, "integer") == 0) {
            v = cJSON_CreateNumber(1);
        } else if (strcmp(t, "boolean") == 0) {
            v = cJSON_CreateTrue();
        } else if (strcmp(t, "array") == 0) {
            snprintf(text, sizeof text, "%s 1", f->name);
            v = cJSON_CreateArray();
            cJSON_AddItemToArray(v, cJSON_CreateString(text));
        } else if (strcmp(t, "object") == 0) {
            v = cJSON_CreateObject();
        } else {
            snprintf(text, sizeof text, "%s of %s", f->name, d->step_name);
            v = cJSON_CreateString(text);
        }
        cJSON_AddItemToObject(o, f->name, v);
    }
    if (o && !cJSON_GetObjectItemCaseSensitive(o, "goal"))
        cJSON_AddStringToObject(o, "goal", d->goal);
    return o;
}

typedef struct wr_build {
    wr_result res;
    Upsquad__Runtime__V1__TokenUsage usage;
    Google__Protobuf__Timestamp finished;
    Upsquad__Internal__V1__StepCompleted completed;
    Upsquad__Internal__V1__StepFailed failed;
    Upsquad__Runtime__V1__InputRequired input;
    Upsquad__Runtime__V1__InterruptRequired interrupt;
    char session[37], agent[37], call_id[48], ask_key[65], text_msg[128];
    char *text;     /* owned */
    char *spec;     /* owned */
    cJSON *out_doc; /* owned */
} wr_build;

static void usage_of(const wr_dispatch *d, const wr_cues *c, const char *text, wr_build *w) {
    upsquad__runtime__v1__token_usage__init(&w->usage);
    w->usage.input_tokens =
        (int32_t)(c->input_tokens >= 0 ? c->input_tokens : 12 + (long long)strlen(d->goal) / 4);
    w->usage.output_tokens =
        (int32_t)(c->output_tokens >= 0 ? c->output_tokens : 8 + (long long)strlen(text) / 4);
    w->usage.model = "wf-responder";
    /* deterministic price: $3 / $15 per million input / output tokens */
    w->usage.cost_usd = c->cost_usd >= 0
                            ? c->cost_usd
                            : w->usage.input_tokens * 3e-6 + w->usage.output_tokens * 15e-6;
    w->res.usage = &w->usage;
}

static void build_parked(const wr_dispatch *d, int outcome, wr_build *w) {
    snprintf(w->call_id, sizeof w->call_id, "call-%.16s", d->idempotency_key);
    char buf[256];
    snprintf(buf, sizeof buf, "%s:0:%s", w->session, w->call_id);
    ids_sha256_hex(buf, strlen(buf), w->ask_key);
    cJSON *spec = cJSON_CreateObject();
    if (outcome == WR_INPUT_REQUIRED) {
        cJSON_AddStringToObject(spec, "question", d->goal);
        cJSON_AddItemToObject(spec, "options", cJSON_CreateArray());
        cJSON_AddBoolToObject(spec, "allow_text", 1);
    } else {
        cJSON_AddStringToObject(spec, "tool", "github.merge_pull_request");
        cJSON_AddStringToObject(spec, "reason", "requires_approval policy (cue)");
    }
    w->spec = cJSON_PrintUnformatted(spec);
    cJSON_Delete(spec);
    ProtobufCBinaryData bytes = {w->spec ? strlen(w->spec) : 0, (uint8_t *)w->spec};
    if (outcome == WR_INPUT_REQUIRED) {
        upsquad__runtime__v1__input_required__init(&w->input);
        w->input.tool_call_id = w->call_id;
        w->input.tool_name = "ask_user";
        w->input.idempotency_key = w->ask_key;
        w->input.question_spec = bytes;
        w->input.checkpoint = (ProtobufCBinaryData){2, (uint8_t *)"{}"};
        w->res.outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INPUT_REQUIRED;
        w->res.input_required = &w->input;
    } else {
        upsquad__runtime__v1__interrupt_required__init(&w->interrupt);
        w->interrupt.tool_call_id = w->call_id;
        w->interrupt.tool_name = "github.merge_pull_request";
        w->interrupt.idempotency_key = w->ask_key;
        w->interrupt.pending_tool_intent = bytes;
        w->res.outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INTERRUPT_REQUIRED;
        w->res.interrupt_required = &w->interrupt;
    }
}

/* Fills w (which then borrows from d and owns its buffers); *outcome the WR_* chosen. */
static int build_result(const wr_dispatch *d, const wr_cues *c, wr_build *w, int *outcome) {
    memset(w, 0, sizeof *w);
    upsquad__internal__v1__agent_step_result__init(&w->res);
    wr_result *r = &w->res;
    r->idempotency_key = d->idempotency_key;
    r->org_id = d->org_id;
    r->run_id = d->run_id;
    r->action_id = d->action_id;
    r->step_name = d->step_name;
    r->iteration = d->iteration;
    r->attempt = d->attempt;
    derived_uuid(d->run_id, d->idempotency_key, w->session);
    derived_uuid(d->org_id, d->agent_role, w->agent);
    r->session_id = w->session;
    r->agent_id = w->agent;
    pbjson_ts_now(&w->finished);
    r->finished_at = &w->finished;
    /* a resumed ask (the answer is in the dispatch) completes the frozen turn */
    *outcome = d->ask_user_resume && c->outcome != WR_FAILED ? WR_COMPLETED : c->outcome;
    if (*outcome == WR_COMPLETED) {
        w->out_doc = c->output ? cJSON_Duplicate(c->output, 1) : default_output(d);
        if (w->out_doc && d->ask_user_resume)
            cJSON_AddStringToObject(w->out_doc, "resumed", "true");
        w->text = w->out_doc ? cJSON_PrintUnformatted(w->out_doc) : NULL;
        char err[128];
        upsquad__internal__v1__step_completed__init(&w->completed);
        if (!w->text ||
            pbjson_struct_from_json(w->out_doc, &w->completed.output, err, sizeof err) != 0)
            return -1;
        w->completed.text = w->text;
        r->outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED;
        r->completed = &w->completed;
    } else if (*outcome == WR_FAILED) {
        upsquad__internal__v1__step_failed__init(&w->failed);
        snprintf(w->text_msg, sizeof w->text_msg, "failed on cue (attempt %d)", d->attempt);
        w->failed.code = (char *)c->fail_code;
        w->failed.message = w->text_msg;
        w->failed.retryable = c->fail_retryable;
        r->outcome_case = UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_FAILED;
        r->failed = &w->failed;
    } else {
        build_parked(d, *outcome, w);
    }
    usage_of(d, c, w->text ? w->text : "", w);
    return 0;
}

static void build_free(wr_build *w) {
    pbjson_struct_free(w->completed.output);
    free(w->text);
    free(w->spec);
    cJSON_Delete(w->out_doc);
}

/* ---- one delivery ---- */

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Sleeps on cue, keeping the delivery alive (in progress) and stopping early on shutdown. */
static void sleep_step(wr *r, natsMsg *m, long long ms) {
    int64_t end = now_ms() + ms, beat = now_ms() + WR_HEARTBEAT_MS;
    while (!r->stopping && now_ms() < end) {
        usleep(20 * 1000);
        if (now_ms() >= beat) {
            bus_in_progress(m);
            beat = now_ms() + WR_HEARTBEAT_MS;
        }
    }
}

static void count_outcome(wr *r, const char *key, int outcome) {
    pthread_mutex_lock(&r->mu);
    r->st.outcomes[outcome]++;
    wr_rec *rec = lru_get(r->rec, key);
    if (rec) rec->outcome = outcome;
    pthread_mutex_unlock(&r->mu);
}

/* Publishes the recorded result of key (again), acks on success, naks otherwise. */
static void publish_recorded(wr *r, natsMsg *m, const char *key) {
    char err[256];
    uint8_t *buf = NULL;
    size_t len = 0;
    char subject[256] = "";
    pthread_mutex_lock(&r->mu);
    wr_rec *rec = lru_get(r->rec, key);
    if (rec && rec->done && (buf = malloc(rec->result_len ? rec->result_len : 1))) {
        memcpy(buf, rec->result, rec->result_len);
        len = rec->result_len;
        snprintf(subject, sizeof subject, "%s", rec->subject);
    }
    pthread_mutex_unlock(&r->mu);
    if (!buf) {
        bus_nak(m, 1000);
        return;
    }
    if (bus_js_publish(r->b, subject, buf, (int)len, key, NULL, err, sizeof err) == BUS_OK) {
        bus_ack(m);
    } else {
        log_warn("wf_responder.publish", "%s", err);
        pthread_mutex_lock(&r->mu);
        r->st.publish_errors++;
        pthread_mutex_unlock(&r->mu);
        bus_nak(m, 1000);
    }
    free(buf);
}

static wr_rec *rec_new(const wr_dispatch *d, const char *subject) {
    wr_rec *rec = calloc(1, sizeof *rec);
    if (!rec) return NULL;
    snprintf(rec->run_id, sizeof rec->run_id, "%s", d->run_id);
    snprintf(rec->step, sizeof rec->step, "%s", d->step_name);
    snprintf(rec->subject, sizeof rec->subject, "%s", subject);
    rec->iteration = d->iteration;
    rec->attempt = d->attempt;
    rec->outcome = -1;
    return rec;
}

enum { RUN_EXECUTE, RUN_REPLAY, RUN_LATER };

/* Counts the delivery and decides: execute (first time), replay (recorded), later (the key
 * is running on another worker, or no memory). */
static int admit(wr *r, const wr_dispatch *d, const char *subject) {
    int what = RUN_LATER;
    pthread_mutex_lock(&r->mu);
    r->st.dispatches++;
    wr_rec *rec = lru_get(r->rec, d->idempotency_key);
    if (!rec) {
        rec = rec_new(d, subject);
        if (rec && lru_insert(r->rec, d->idempotency_key, rec, sizeof *rec) != 0) rec = NULL;
    }
    if (rec) {
        rec->dispatches++;
        if (rec->dispatches > r->st.max_dispatches_per_key)
            r->st.max_dispatches_per_key = rec->dispatches;
        if (rec->done) {
            r->st.duplicates++;
            what = RUN_REPLAY;
        } else if (!rec->running) {
            rec->running = 1;
            rec->executions++;
            r->st.executions++;
            if (rec->executions > r->st.max_executions_per_key)
                r->st.max_executions_per_key = rec->executions;
            what = RUN_EXECUTE;
        } else {
            r->st.duplicates++;
        }
    }
    pthread_mutex_unlock(&r->mu);
    return what;
}

static void record(wr *r, const char *key, uint8_t *buf, size_t len) {
    pthread_mutex_lock(&r->mu);
    wr_rec *rec = lru_get(r->rec, key);
    if (rec) {
        rec->running = 0;
        rec->done = buf != NULL;
        free(rec->result);
        rec->result = buf;
        rec->result_len = len;
        buf = NULL;
        lru_recharge(r->rec, key, sizeof *rec + len);
    }
    pthread_mutex_unlock(&r->mu);
    free(buf);
}

static void execute(wr *r, natsMsg *m, const wr_dispatch *d) {
    wr_cues c;
    wr_build w;
    int outcome = WR_COMPLETED;
    wr_cues_parse(d->goal, d->attempt, &c);
    if (c.sleep_ms > 0) sleep_step(r, m, c.sleep_ms);
    uint8_t *buf = NULL;
    size_t len = 0;
    if (!r->stopping) {
        if (build_result(d, &c, &w, &outcome) == 0) {
            len = upsquad__internal__v1__agent_step_result__get_packed_size(&w.res);
            buf = malloc(len ? len : 1);
            if (buf) upsquad__internal__v1__agent_step_result__pack(&w.res, buf);
        }
        build_free(&w);
    }
    wr_cues_free(&c);
    record(r, d->idempotency_key, buf, len); /* NULL: not recorded, runs on redelivery */
    if (!buf) {
        bus_nak(m, 1000);
        return;
    }
    count_outcome(r, d->idempotency_key, outcome);
    publish_recorded(r, m, d->idempotency_key);
}

static void handle(wr *r, natsMsg *m) {
    wr_dispatch *d = upsquad__internal__v1__agent_step_dispatch__unpack(
        NULL, (size_t)natsMsg_GetDataLength(m), (const uint8_t *)natsMsg_GetData(m));
    char subject[256];
    if (!d || !d->idempotency_key[0] ||
        bus_subject(subject, sizeof subject, "agent", "step", "result", d->org_id, d->run_id,
                    NULL) != BUS_OK) {
        /* poison: never redelivered, counted */
        log_warn("wf_responder.reject", "undecodable dispatch or bad org/run token");
        pthread_mutex_lock(&r->mu);
        r->st.rejected++;
        pthread_mutex_unlock(&r->mu);
        bus_term(m);
        if (d) upsquad__internal__v1__agent_step_dispatch__free_unpacked(d, NULL);
        return;
    }
    switch (admit(r, d, subject)) {
    case RUN_EXECUTE:
        execute(r, m, d);
        break;
    case RUN_REPLAY:
        publish_recorded(r, m, d->idempotency_key);
        break;
    default:
        bus_nak(m, 500);
    }
    upsquad__internal__v1__agent_step_dispatch__free_unpacked(d, NULL);
}

static void *worker_main(void *arg) {
    wr_worker *w = arg;
    char err[256];
    while (!w->r->stopping) {
        natsMsgList list;
        if (bus_js_fetch(w->pull, 1, WR_FETCH_WAIT_MS, &list, err, sizeof err) != BUS_OK) {
            usleep(200 * 1000); /* NATS away: the library reconnects */
            continue;
        }
        for (int i = 0; i < list.Count; i++)
            handle(w->r, list.Msgs[i]);
        natsMsgList_Destroy(&list);
    }
    return NULL;
}

/* ---- stats ---- */

static cJSON *rec_json(const char *key, const wr_rec *rec) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "key", key);
    cJSON_AddStringToObject(o, "run_id", rec->run_id);
    cJSON_AddStringToObject(o, "step_name", rec->step);
    cJSON_AddNumberToObject(o, "iteration", rec->iteration);
    cJSON_AddNumberToObject(o, "attempt", rec->attempt);
    cJSON_AddNumberToObject(o, "dispatches", rec->dispatches);
    cJSON_AddNumberToObject(o, "executions", rec->executions);
    cJSON_AddStringToObject(o, "outcome", rec->outcome >= 0 ? outcome_names[rec->outcome] : "");
    return o;
}

typedef struct run_filter {
    const char *run_id;
    cJSON *arr;
} run_filter;

static void add_if_run(const char *key, void *val, void *ud) {
    run_filter *f = ud;
    const wr_rec *rec = val;
    if (strcmp(rec->run_id, f->run_id) == 0) cJSON_AddItemToArray(f->arr, rec_json(key, rec));
}

static void on_stats(bus *b, natsMsg *m, void *ud) {
    wr *r = ud;
    cJSON *q = natsMsg_GetDataLength(m) > 0
                   ? cJSON_ParseWithLength(natsMsg_GetData(m), (size_t)natsMsg_GetDataLength(m))
                   : NULL;
    const cJSON *key = cJSON_GetObjectItemCaseSensitive(q, "key");
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(q, "run_id");
    cJSON *o = cJSON_CreateObject();
    pthread_mutex_lock(&r->mu);
    const wr_counters *s = &r->st;
    cJSON_AddStringToObject(o, "consumer", "wf-responder");
    cJSON_AddNumberToObject(o, "dispatches", (double)s->dispatches);
    cJSON_AddNumberToObject(o, "executions", (double)s->executions);
    cJSON_AddNumberToObject(o, "duplicates", (double)s->duplicates);
    cJSON_AddNumberToObject(o, "rejected", (double)s->rejected);
    cJSON_AddNumberToObject(o, "publish_errors", (double)s->publish_errors);
    for (int i = 0; i < 4; i++)
        cJSON_AddNumberToObject(o, outcome_names[i], (double)s->outcomes[i]);
    cJSON_AddNumberToObject(o, "max_dispatches_per_key", s->max_dispatches_per_key);
    cJSON_AddNumberToObject(o, "max_executions_per_key", s->max_executions_per_key);
    cJSON_AddNumberToObject(o, "keys", (double)lru_count(r->rec));
    cJSON_AddNumberToObject(o, "evicted", (double)lru_evicted(r->rec));
    if (cJSON_IsString(key)) {
        const wr_rec *rec = lru_get(r->rec, key->valuestring);
        cJSON_AddItemToObject(o, "record",
                              rec ? rec_json(key->valuestring, rec) : cJSON_CreateNull());
    }
    if (cJSON_IsString(run)) {
        run_filter f = {run->valuestring, cJSON_AddArrayToObject(o, "records")};
        if (f.arr) lru_foreach(r->rec, add_if_run, &f);
    }
    pthread_mutex_unlock(&r->mu);
    char *txt = cJSON_PrintUnformatted(o);
    if (txt) bus_respond(b, m, txt, (int)strlen(txt));
    free(txt);
    cJSON_Delete(o);
    cJSON_Delete(q);
}

/* ---- lifecycle ---- */

/* Creates the stream with the contract's settings when it is missing; one that exists (the
 * engine made it) is left as it is. */
static int stream_ensure(bus *b, const char *name, const char *subject, int64_t max_age_s,
                         char *err, size_t errlen) {
    uint64_t msgs = 0;
    if (bus_js_stream_msgs(b, name, &msgs, err, errlen) == BUS_OK) return 0;
    const char *subjects[] = {subject};
    return bus_js_stream_ensure(b, name, subjects, 1, BUS_RETENTION_WORKQUEUE, max_age_s, NULL, err,
                                errlen);
}

int wr_start(bus *b, const wr_opts *o, wr **out, char *err, size_t errlen) {
    *out = NULL;
    if (o->workers < 1 || o->keys < 1 || o->ack_wait_ms < 1)
        return util_errf(err, errlen, -1, "workers, keys and ack wait must be positive");
    if (stream_ensure(b, STREAM_AGENT_STEPS, STREAM_AGENT_STEPS_SUBJECTS,
                      STREAM_AGENT_STEPS_MAX_AGE_S, err, errlen) != 0 ||
        stream_ensure(b, STREAM_AGENT_RESULTS, STREAM_AGENT_RESULTS_SUBJECTS,
                      STREAM_AGENT_RESULTS_MAX_AGE_S, err, errlen) != 0)
        return -1;
    wr *r = calloc(1, sizeof *r);
    if (!r) return util_errf(err, errlen, -1, "out of memory");
    r->b = b;
    r->o = *o;
    pthread_mutex_init(&r->mu, NULL);
    lru_opts lo = {.max_entries = (size_t)o->keys, .free_val = rec_free, .pinned = rec_pinned};
    r->workers = calloc((size_t)o->workers, sizeof *r->workers);
    if (!r->workers || lru_create(&lo, &r->rec) != 0) {
        wr_stop(r);
        return util_errf(err, errlen, -1, "out of memory");
    }
    for (; r->n_workers < (size_t)o->workers; r->n_workers++) {
        wr_worker *w = &r->workers[r->n_workers];
        w->r = r;
        if (bus_js_pull_subscribe(b, STREAM_AGENT_STEPS, o->durable, STREAM_AGENT_STEPS_SUBJECTS,
                                  (int)o->ack_wait_ms, -1, &w->pull, err, errlen) != BUS_OK)
            break;
        if (pthread_create(&w->th, NULL, worker_main, w) != 0) {
            bus_pull_close(w->pull);
            w->pull = NULL;
            snprintf(err, errlen, "cannot start a worker thread");
            break;
        }
    }
    if (r->n_workers < (size_t)o->workers ||
        bus_subscribe(b, o->stats_subject, NULL, on_stats, r, &r->stats_sub, err, errlen) != 0 ||
        bus_flush(b, 5000) != BUS_OK) {
        if (!err[0]) snprintf(err, errlen, "NATS did not confirm the subscriptions");
        wr_stop(r);
        return -1;
    }
    *out = r;
    return 0;
}

void wr_stop(wr *r) {
    if (!r) return;
    bus_unsubscribe(r->stats_sub);
    r->stopping = 1;
    for (size_t i = 0; i < r->n_workers; i++) {
        pthread_join(r->workers[i].th, NULL);
        bus_pull_close(r->workers[i].pull);
    }
    lru_destroy(r->rec);
    free(r->workers);
    pthread_mutex_destroy(&r->mu);
    free(r);
}
