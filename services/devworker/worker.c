/* Configuration, the session table, the in-flight steps and the checkpoint queue (see
 * worker.h). */
#include "worker.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "util.h"

/* ---- configuration: the one table (docs/devworker.md prints it) ---- */

static dw_config C;

static const cfg_var vars[] = {
    {"UPSQUAD_ORCHESTRATOR_ADDR", CFG_STR, "",
     "gRPC target of the orchestrator (RuntimeService.Heartbeat and .Checkpoint); empty: the "
     "worker serves without reporting",
     &C.orchestrator_addr},
    {"UPSQUAD_DEVWORKER_ID", CFG_STR, "",
     "worker_id sent in heartbeats; empty: the advertised address", &C.worker_id},
    {"UPSQUAD_DEVWORKER_ADVERTISE_ADDR", CFG_STR, "",
     "host:port the orchestrator reaches this worker at (heartbeat metadata "
     "x-upsquad-worker-addr); empty: the listen address with its bound port (0.0.0.0 becomes "
     "the host name)",
     &C.advertise_addr},
    {"UPSQUAD_DEVWORKER_REQUIRE_SCOPE", CFG_STR, "runtime.orchestrator",
     "callers' tokens must carry this `scope` (the orchestrator's calls do); `any`: any token "
     "the platform's key verifies (a developer calling the worker with upsquad-token)",
     &C.require_scope},
    {"UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL", CFG_MS, "5s", "time between heartbeats",
     &C.heartbeat_ms, 50, 3600000},
    {"UPSQUAD_DEVWORKER_HEARTBEAT_BACKOFF_MAX", CFG_MS, "30s",
     "longest wait between retries while the orchestrator is unreachable (doubling from 200ms)",
     &C.backoff_max_ms, 50, 3600000},
    {"UPSQUAD_DEVWORKER_ORCHESTRATOR_TIMEOUT", CFG_MS, "3s",
     "deadline of each Heartbeat and Checkpoint call", &C.rpc_timeout_ms, 10, 600000},
    {"UPSQUAD_DEVWORKER_TOKEN_TTL", CFG_MS, "5m",
     "lifetime of the bearer the worker mints for its own calls (re-minted at half-life)",
     &C.token_ttl_ms, 10000, 86400000},
    {"UPSQUAD_DEVWORKER_MAX_SESSIONS", CFG_INT, "4096",
     "sessions remembered (snapshot model, loop counter, latest state); when full the least "
     "recently used is forgotten (steps carry their snapshot, so nothing breaks)",
     &C.max_sessions, 1, 1000000},
    {"UPSQUAD_DEVWORKER_CHECKPOINT_QUEUE", CFG_INT, "1024",
     "checkpoints waiting for the orchestrator; when full the oldest is dropped (counted)",
     &C.checkpoint_queue, 1, 1000000},
    {"UPSQUAD_DEVWORKER_CHECKPOINT_VERSION", CFG_INT, "1",
     "schema version written in (and required of) the 4-byte big-endian checkpoint prefix",
     &C.checkpoint_ver, 1, 2147483647LL},
    {"UPSQUAD_DEVWORKER_CHECKPOINTS", CFG_BOOL, "true",
     "send RuntimeService.Checkpoint at the end of each loop iteration", &C.checkpoints_enabled},
    {"UPSQUAD_DEVWORKER_ALLOW_CRASH", CFG_BOOL, "true",
     "obey the `crash` directive (the process exits); false on a shared dev cluster, where a "
     "chat message must not take the worker down: the step then ends with ErrorEvent "
     "CRASH_DISABLED",
     &C.allow_crash},
    {"UPSQUAD_DEVWORKER_MAX_SCRIPT_ELEMENTS", CFG_INT, "10000",
     "directives per script; a longer script is malformed", &C.max_script, 1, 1000000},
};

const cfg_var *dw_config_vars(size_t *n) {
    *n = sizeof vars / sizeof vars[0];
    return vars;
}

dw_config *dw_config_get(void) {
    return &C;
}

/* The shared variables the worker needs as a client: read again here because svc_main keeps
 * its copy private. Not listed in dw_config_vars (svc_common_vars documents them). */
static const cfg_var signing_vars[] = {
    {"UPSQUAD_JWT_SECRET", CFG_STR, NULL, "", &C.jwt_secret, 0, 0, CFG_SECRET},
    {"UPSQUAD_JWT_AUDIENCE", CFG_STR, "upsquad", "", &C.jwt_audience},
    {"UPSQUAD_JWT_ISSUER", CFG_STR, NULL, "", &C.jwt_issuer},
    {"UPSQUAD_GRPC_ADDR", CFG_STR, "0.0.0.0:50051", "", &C.grpc_addr},
    {"UPSQUAD_TLS_CERT_FILE", CFG_STR, NULL, "", &C.tls_cert},
    {"UPSQUAD_TLS_KEY_FILE", CFG_STR, NULL, "", &C.tls_key},
    {"UPSQUAD_TLS_CLIENT_CA_FILE", CFG_STR, NULL, "", &C.tls_ca},
};
#define N_SIGNING (sizeof signing_vars / sizeof signing_vars[0])

void dw_copy_id(char dst[DW_ID_MAX], const char *s) {
    snprintf(dst, DW_ID_MAX, "%s", s ? s : "");
}

/* ---- sessions ---- */

static dw_session *find_locked(dw_worker *w, const char *id) {
    for (size_t i = 0; i < w->n_sessions; i++)
        if (strcmp(w->sessions[i].id, id) == 0) return &w->sessions[i];
    return NULL;
}

/* A slot for id: the existing one, a free one, or the least recently used (forgotten). */
static dw_session *get_locked(dw_worker *w, const char *id) {
    dw_session *s = find_locked(w, id);
    if (s) return s;
    if (w->n_sessions < (size_t)w->cfg->max_sessions) {
        s = &w->sessions[w->n_sessions++];
    } else {
        s = &w->sessions[0];
        for (size_t i = 1; i < w->n_sessions; i++)
            if (w->sessions[i].last_used < s->last_used) s = &w->sessions[i];
        log_debug("session.evict", "session table full: forgetting %s", s->id);
        free(s->state);
    }
    memset(s, 0, sizeof *s);
    s->restored_loop = -1;
    dw_copy_id(s->id, id);
    return s;
}

int32_t dw_session_touch(dw_worker *w, const char *id, const char *tenant, const char *model) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = get_locked(w, id);
    if (tenant && tenant[0]) dw_copy_id(s->tenant, tenant);
    if (model && model[0]) dw_copy_id(s->model, model);
    s->last_used = ++w->clock;
    int32_t next = s->next_iter;
    pthread_mutex_unlock(&w->mu);
    return next;
}

int32_t dw_session_reserve_iter(dw_worker *w, const char *id) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = get_locked(w, id);
    int32_t it = s->next_iter++;
    s->last_used = ++w->clock;
    pthread_mutex_unlock(&w->mu);
    return it;
}

int32_t dw_session_ck_key(dw_worker *w, const char *id, int32_t iter) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = find_locked(w, id); /* a terminated session's late checkpoint: no shift */
    int32_t key = iter + (s ? s->ck_shift : 0);
    pthread_mutex_unlock(&w->mu);
    return key;
}

void dw_session_ck_taken(dw_worker *w, const char *id, int32_t iter, int32_t key) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = find_locked(w, id); /* never re-creates (nor evicts for) a gone session */
    if (s && s->ck_shift < key - iter + 1) s->ck_shift = key - iter + 1;
    pthread_mutex_unlock(&w->mu);
}

void dw_session_init(dw_worker *w, const char *id, const char *tenant, const char *model,
                     int32_t next, int32_t restored_loop) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = get_locked(w, id);
    s->inits++;
    s->restored_loop = restored_loop;
    dw_copy_id(s->tenant, tenant);
    dw_copy_id(s->model, model);
    s->next_iter = next;
    s->ck_shift = 0; /* a resumed step re-sends its iterations: the replay path */
    s->last_used = ++w->clock;
    pthread_mutex_unlock(&w->mu);
}

int dw_session_info(dw_worker *w, const char *id, dw_session_inits *out) {
    pthread_mutex_lock(&w->mu);
    const dw_session *s = find_locked(w, id);
    if (s) *out = (dw_session_inits){s->inits, s->restored_loop, s->next_iter};
    pthread_mutex_unlock(&w->mu);
    return s != NULL;
}

void dw_session_set_state(dw_worker *w, const char *id, int32_t iter, const uint8_t *blob,
                          size_t len, const char *hash) {
    uint8_t *copy = malloc(len ? len : 1);
    if (copy == NULL) return; /* the poll answers the previous state; the checkpoint still goes */
    memcpy(copy, blob, len);
    pthread_mutex_lock(&w->mu);
    dw_session *s = get_locked(w, id);
    free(s->state);
    s->state = copy;
    s->state_len = len;
    snprintf(s->state_hash, sizeof s->state_hash, "%s", hash);
    if (s->next_iter <= iter) s->next_iter = iter + 1;
    s->last_used = ++w->clock;
    pthread_mutex_unlock(&w->mu);
}

int dw_session_get_state(dw_worker *w, rpc_call *call, const char *id, uint8_t **blob, size_t *len,
                         char **hash) {
    int rc = RPC_NOT_FOUND;
    pthread_mutex_lock(&w->mu);
    dw_session *s = find_locked(w, id);
    if (s && s->state) {
        *blob = rpc_alloc(call, s->state_len ? s->state_len : 1);
        *hash = rpc_strdup(call, s->state_hash);
        if (*blob && *hash) {
            memcpy(*blob, s->state, s->state_len);
            *len = s->state_len;
            rc = RPC_OK;
        } else {
            rc = RPC_RESOURCE_EXHAUSTED;
        }
    }
    pthread_mutex_unlock(&w->mu);
    return rc;
}

void dw_session_set_resume(dw_worker *w, const char *id, int32_t at, const char *sha,
                           const char *call_id, const char *tool) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = get_locked(w, id);
    s->resume_at = at;
    snprintf(s->resume_sha, sizeof s->resume_sha, "%s", sha);
    dw_copy_id(s->resume_call, call_id);
    dw_copy_id(s->resume_tool, tool);
    pthread_mutex_unlock(&w->mu);
}

long long dw_message_run(dw_worker *w, const char *sha) {
    long long n = 0;
    pthread_mutex_lock(&w->mu);
    for (size_t i = 0; i < DW_MSG_RUNS && !n; i++)
        if (strcmp(w->msg_runs[i].sha, sha) == 0) n = ++w->msg_runs[i].runs;
    if (!n) {
        size_t i = w->msg_runs_next;
        w->msg_runs_next = (i + 1) % DW_MSG_RUNS;
        snprintf(w->msg_runs[i].sha, sizeof w->msg_runs[i].sha, "%s", sha);
        n = w->msg_runs[i].runs = 1;
    }
    pthread_mutex_unlock(&w->mu);
    return n;
}

int dw_session_take_resume(dw_worker *w, const char *id, const char *sha, int32_t *at,
                           char call_id[DW_ID_MAX], char tool[DW_ID_MAX]) {
    int hit = 0;
    pthread_mutex_lock(&w->mu);
    dw_session *s = find_locked(w, id);
    if (s && s->resume_at > 0) {
        hit = strcmp(s->resume_sha, sha) == 0;
        *at = s->resume_at;
        dw_copy_id(call_id, s->resume_call);
        dw_copy_id(tool, s->resume_tool);
        s->resume_at = 0; /* one resume per restore */
    }
    pthread_mutex_unlock(&w->mu);
    return hit;
}

void dw_session_model(dw_worker *w, const char *id, char out[DW_ID_MAX]) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = find_locked(w, id);
    dw_copy_id(out, s ? s->model : "");
    pthread_mutex_unlock(&w->mu);
}

void dw_session_terminate(dw_worker *w, const char *id) {
    pthread_mutex_lock(&w->mu);
    dw_session *s = find_locked(w, id);
    if (s) {
        size_t last = --w->n_sessions;
        free(s->state);
        if (s != &w->sessions[last]) *s = w->sessions[last]; /* the last slot fills the hole */
        memset(&w->sessions[last], 0, sizeof *s);
    }
    for (dw_step_ref *r = w->steps; r; r = r->next)
        if (strcmp(r->session_id, id) == 0) atomic_store(&r->terminated, 1);
    pthread_mutex_unlock(&w->mu);
}

/* ---- in-flight steps ---- */

void dw_step_register(dw_worker *w, dw_step_ref *s) {
    pthread_mutex_lock(&w->mu);
    s->next = w->steps;
    w->steps = s;
    w->n_steps++;
    metric_set(w->m_inflight, w->n_steps);
    pthread_mutex_unlock(&w->mu);
}

void dw_step_unregister(dw_worker *w, dw_step_ref *s) {
    pthread_mutex_lock(&w->mu);
    for (dw_step_ref **p = &w->steps; *p; p = &(*p)->next)
        if (*p == s) {
            *p = s->next;
            w->n_steps--;
            break;
        }
    metric_set(w->m_inflight, w->n_steps);
    pthread_mutex_unlock(&w->mu);
}

/* ---- checkpoint queue ---- */

void dw_checkpoint_enqueue(dw_worker *w, const char *session_id, const char *tenant, int32_t iter,
                           const uint8_t *blob, size_t len, const char *sha256) {
    uint8_t *copy = malloc(len ? len : 1);
    if (copy == NULL) {
        metric_inc(w->m_ck_dropped);
        return;
    }
    memcpy(copy, blob, len);
    pthread_mutex_lock(&w->mu);
    if (w->ckq_len == w->ckq_cap) { /* full: the oldest goes (a newer one supersedes it) */
        dw_ckpt *old = &w->ckq[w->ckq_head];
        log_warn("checkpoint.dropped", "queue full (%zu): dropping session %s iteration %d",
                 w->ckq_cap, old->session_id, old->loop_iteration);
        free(old->bytes);
        w->ckq_head = (w->ckq_head + 1) % w->ckq_cap;
        w->ckq_len--;
        metric_inc(w->m_ck_dropped);
    }
    dw_ckpt *c = &w->ckq[(w->ckq_head + w->ckq_len) % w->ckq_cap];
    dw_copy_id(c->session_id, session_id);
    dw_copy_id(c->tenant, tenant);
    c->loop_iteration = iter;
    c->iteration = iter;
    c->renumbered = 0;
    c->bytes = copy;
    c->len = len;
    snprintf(c->sha256, sizeof c->sha256, "%s", sha256);
    w->ckq_len++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

/* ---- start / stop ---- */

static void register_metrics(dw_worker *w) {
    w->m_steps = metrics_counter("devworker_steps_total", "ExecuteStep calls run", NULL);
    w->m_steps_cancelled =
        metrics_counter("devworker_steps_cancelled_total",
                        "steps ended early: cancelled or session terminated", NULL);
    w->m_tokens = metrics_counter("devworker_tokens_total", "TokenEvents streamed", NULL);
    w->m_scripts_invalid =
        metrics_counter("devworker_scripts_invalid_total", "malformed scripts refused", NULL);
    w->m_hb_ok = metrics_counter("devworker_heartbeats_total", "heartbeats sent", "result=\"ok\"");
    w->m_hb_fail =
        metrics_counter("devworker_heartbeats_total", "heartbeats sent", "result=\"failed\"");
    w->m_ck_ok = metrics_counter("devworker_checkpoints_total",
                                 "checkpoints sent to the orchestrator", "result=\"ok\"");
    w->m_ck_fail = metrics_counter("devworker_checkpoints_total",
                                   "checkpoints sent to the orchestrator", "result=\"retried\"");
    w->m_ck_refused = metrics_counter("devworker_checkpoints_total",
                                      "checkpoints sent to the orchestrator", "result=\"refused\"");
    w->m_ck_dropped = metrics_counter("devworker_checkpoints_dropped_total",
                                      "checkpoints dropped because the queue was full", NULL);
    w->m_inflight = metrics_gauge("devworker_steps_in_flight", "ExecuteStep calls running", NULL);
}

int dw_worker_start(dw_worker *w, const dw_config *cfg, rpc_server *srv, char *err, size_t errlen) {
    memset(w, 0, sizeof *w);
    w->cfg = cfg;
    w->srv = srv;
    pthread_mutex_init(&w->mu, NULL);
    util_cond_init_monotonic(&w->cv);
    register_metrics(w);
    if (cfg_load(signing_vars, N_SIGNING, err, errlen) != 0) return -1;
    w->sessions = calloc((size_t)cfg->max_sessions, sizeof *w->sessions);
    w->ckq_cap = (size_t)cfg->checkpoint_queue;
    w->ckq = calloc(w->ckq_cap, sizeof *w->ckq);
    if (!w->sessions || !w->ckq) return util_errf(err, errlen, -1, "out of memory");
    if (cfg->orchestrator_addr && cfg->orchestrator_addr[0]) {
        if (!C.jwt_secret || !C.jwt_secret[0])
            return util_errf(err, errlen, -1,
                             "UPSQUAD_JWT_SECRET is required to sign the worker's heartbeats");
        if (auth_signer_new("HS256", C.jwt_secret, &w->signer, err, errlen) != AUTH_OK) return -1;
        /* mTLS towards the orchestrator when the worker serves mTLS itself: the same
         * certificate (serverAuth + clientAuth) and the same CA */
        rpc_client_tls tls = {C.tls_ca, C.tls_cert, C.tls_key, NULL};
        rpc_channel_opts co = {.target = cfg->orchestrator_addr, .tls = C.tls_cert ? &tls : NULL};
        if (rpc_channel_new(&co, &w->orch, err, errlen) != 0) return -1;
    } else {
        log_info("reporter.off",
                 "UPSQUAD_ORCHESTRATOR_ADDR is empty: no heartbeats or checkpoints");
    }
    if (pthread_create(&w->reporter, NULL, dw_reporter_main, w) != 0)
        return util_errf(err, errlen, -1, "cannot start the reporter thread");
    w->reporter_started = 1;
    return 0;
}

void dw_worker_stop(dw_worker *w) {
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (w->reporter_started) pthread_join(w->reporter, NULL);
    w->reporter_started = 0;
    for (size_t i = 0; i < w->n_sessions; i++)
        free(w->sessions[i].state);
    free(w->sessions);
    w->sessions = NULL;
    while (w->ckq && w->ckq_len) {
        free(w->ckq[w->ckq_head].bytes);
        w->ckq_head = (w->ckq_head + 1) % w->ckq_cap;
        w->ckq_len--;
    }
    free(w->ckq);
    w->ckq = NULL;
    rpc_channel_free(w->orch);
    w->orch = NULL;
    auth_signer_free(w->signer);
    w->signer = NULL;
    cfg_free(signing_vars, N_SIGNING);
}
