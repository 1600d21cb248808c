/* The reporter thread: heartbeats and queued checkpoints to the orchestrator
 * (RuntimeService.Heartbeat / .Checkpoint), with a bearer the worker mints itself.
 *
 *   - Every heartbeat interval: one worker-level heartbeat (session_id empty, active_sessions =
 *     the steps in flight), then one per session with a step in flight (at most
 *     HB_MAX_SESSIONS), so the orchestrator can refresh each session's last_heartbeat. The
 *     worker's address rides as metadata x-upsquad-worker-addr; worker_id defaults to it.
 *   - Checkpoints go out in queue order while the orchestrator answers. A transport failure
 *     (UNAVAILABLE, DEADLINE_EXCEEDED) keeps the checkpoint at the head of the queue.
 *     ALREADY_EXISTS (another hash holds that iteration) means another worker ran an earlier
 *     turn of the session: turns land on any worker (no session affinity) and each counts a
 *     session's iterations from what it saw, so the second worker's numbers collide with the
 *     first's. The session's keys shift up by one and the checkpoint goes again (at most
 *     CK_RENUMBER_MAX times): a key is the iteration plus the session's shift, so a session's
 *     checkpoints keep their relative order however many were queued behind the colliding
 *     one, its next iterations continue above them, and concurrent steps of one session that
 *     reserved distinct iterations keep distinct keys whatever order they are sent in. A re-keyed
 *     JSON state's "loop_iteration" follows (and the hash with it). Any other status
 *     (INVALID_ARGUMENT, NOT_FOUND) is final: logged, counted, dropped.
 *   - Unreachable orchestrator: the worker keeps serving; retries back off from 200 ms,
 *     doubling up to UPSQUAD_DEVWORKER_HEARTBEAT_BACKOFF_MAX; "orchestrator.unreachable" and
 *     "orchestrator.reachable" are logged once per change of state.
 *
 * Tokens: HS256 with UPSQUAD_JWT_SECRET, aud UPSQUAD_JWT_AUDIENCE, sub = worker id, scope
 * "runtime.worker", clearance 1; org_id = the session's tenant on a checkpoint, the nil UUID
 * on a heartbeat (a worker belongs to no tenant). */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ids.h"
#include "log.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"
#include "worker.h"
#include "util.h"

#define SVC "/upsquad.runtime.v1.RuntimeService/"
#define HB_MAX_SESSIONS 64
#define BACKOFF_MIN_MS 200
#define CK_RENUMBER_MAX 64
#define NIL_ORG "00000000-0000-0000-0000-000000000000"

typedef struct reporter {
    dw_worker *w;
    int state;              /* -1 unknown, 0 unreachable, 1 reachable */
    long long backoff;      /* next retry wait while unreachable */
    int64_t next_hb;        /* monotonic ms */
    char *hb_token;         /* cached heartbeat bearer */
    int64_t hb_token_renew; /* monotonic ms at which it is re-minted */
    int refused;            /* last non-transient Heartbeat status (0 = acknowledged) */
} reporter;

/* The advertised address and worker id, once the server has its port. */
static int resolve_identity(dw_worker *w) {
    const dw_config *c = w->cfg;
    int port = rpc_server_port(w->srv);
    if (port <= 0) return -1;
    pthread_mutex_lock(&w->mu); /* steps read them (inspect) */
    if (c->advertise_addr && c->advertise_addr[0]) {
        snprintf(w->addr, sizeof w->addr, "%s", c->advertise_addr);
    } else {
        char host[200] = "";
        const char *a = c->grpc_addr ? c->grpc_addr : "";
        const char *colon = strrchr(a, ':');
        size_t hl = colon ? (size_t)(colon - a) : 0;
        if (hl >= sizeof host) hl = sizeof host - 1;
        memcpy(host, a, hl);
        host[hl] = 0;
        if (!host[0] || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "[::]") == 0) {
            if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "localhost");
            host[sizeof host - 1] = 0;
        }
        snprintf(w->addr, sizeof w->addr, "%s:%d", host, port);
    }
    dw_copy_id(w->id, (c->worker_id && c->worker_id[0]) ? c->worker_id : w->addr);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

/* A fresh bearer for org (caller frees), or NULL (logged). */
static char *mint(reporter *r, const char *org) {
    dw_worker *w = r->w;
    char extra[400], err[256], *tok = NULL;
    snprintf(extra, sizeof extra, "{\"scope\":\"runtime.worker\"}");
    auth_claims cl = {.sub = w->id,
                      .org_id = (org && org[0]) ? org : NIL_ORG,
                      .audience = w->cfg->jwt_audience,
                      .issuer = w->cfg->jwt_issuer,
                      .clearance = 1,
                      .ttl_s = w->cfg->token_ttl_ms / 1000,
                      .extra_json = extra};
    if (auth_mint(w->signer, &cl, &tok, err, sizeof err) != AUTH_OK) {
        log_error("reporter.token", "cannot mint the worker's bearer: %s", err);
        return NULL;
    }
    return tok;
}

static const char *hb_token(reporter *r) {
    int64_t now = util_mono_ms();
    if (r->hb_token == NULL || now >= r->hb_token_renew) {
        char *t = mint(r, NULL);
        if (t == NULL) return NULL;
        free(r->hb_token);
        r->hb_token = t;
        r->hb_token_renew = now + r->w->cfg->token_ttl_ms / 2;
    }
    return r->hb_token;
}

static int transient(int code) {
    return code == RPC_UNAVAILABLE || code == RPC_DEADLINE_EXCEEDED || code == RPC_CANCELLED ||
           code == RPC_UNKNOWN || code == RPC_RESOURCE_EXHAUSTED;
}

static void set_state(reporter *r, int up, const char *why) {
    if (r->state == up) return;
    r->state = up;
    if (up)
        log_info("orchestrator.reachable", "heartbeats to %s acknowledged (worker %s at %s)",
                 r->w->cfg->orchestrator_addr, r->w->id, r->w->addr);
    else
        log_warn("orchestrator.unreachable",
                 "%s: %s; serving on, retrying with back-off up to %lld ms",
                 r->w->cfg->orchestrator_addr, why, r->w->cfg->backoff_max_ms);
}

/* One Heartbeat call; the status code. */
static int heartbeat(reporter *r, const char *session_id, int active, char *why, size_t whylen) {
    dw_worker *w = r->w;
    Upsquad__Runtime__V1__HeartbeatRequest rq = UPSQUAD__RUNTIME__V1__HEARTBEAT_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    const char *tok = hb_token(r);
    if (tok == NULL) {
        snprintf(why, whylen, "no bearer");
        return RPC_INTERNAL;
    }
    rq.session_id = (char *)session_id;
    rq.worker_id = w->id;
    rq.active_sessions = active;
    rpc_md md[] = {{"x-upsquad-worker-addr", w->addr}};
    rpc_call_opts o = {.timeout_ms = w->cfg->rpc_timeout_ms, .bearer = tok, .md = md, .n_md = 1};
    int code =
        rpc_unary_call(w->orch, SVC "Heartbeat", &rq.base,
                       &upsquad__runtime__v1__heartbeat_response__descriptor, &o, &resp, &st);
    if (code != RPC_OK)
        snprintf(why, whylen, "Heartbeat: status %d %s", code, st.message ? st.message : "");
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_status_clear(&st);
    if (code == RPC_OK)
        metric_inc(w->m_hb_ok);
    else
        metric_inc(w->m_hb_fail);
    return code;
}

/* The worker-level heartbeat, then one per session in flight. 0 when the orchestrator
 * answered (any non-transient status counts as reachable: it is there, it said no). */
static int heartbeat_round(reporter *r, char *why, size_t whylen) {
    dw_worker *w = r->w;
    char(*ids)[DW_ID_MAX] = malloc(HB_MAX_SESSIONS * sizeof *ids);
    int n = 0, active, code;
    if (ids == NULL) return -1;
    pthread_mutex_lock(&w->mu);
    active = w->n_steps;
    for (dw_step_ref *s = w->steps; s && n < HB_MAX_SESSIONS; s = s->next) {
        int dup = 0;
        for (int i = 0; i < n && !dup; i++)
            dup = strcmp(ids[i], s->session_id) == 0;
        if (!dup) dw_copy_id(ids[n++], s->session_id);
    }
    pthread_mutex_unlock(&w->mu);
    code = heartbeat(r, "", active, why, whylen);
    /* the orchestrator is there but says no (a key or audience mismatch, no Heartbeat yet):
     * say it once per change of answer, not every interval */
    int refused = transient(code) ? r->refused : code;
    if (refused != r->refused) {
        if (refused != RPC_OK)
            log_warn("heartbeat.refused", "%s", why);
        else
            log_info("heartbeat.accepted", "heartbeats acknowledged again");
        r->refused = refused;
    }
    for (int i = 0; i < n && !transient(code); i++)
        code = heartbeat(r, ids[i], active, why, whylen);
    free(ids);
    return transient(code) ? -1 : 0;
}

/* Takes the head of the queue (caller owns c->bytes), 0 when empty. */
static int take_head(dw_worker *w, dw_ckpt *c) {
    int got = 0;
    pthread_mutex_lock(&w->mu);
    if (w->ckq_len > 0) {
        *c = w->ckq[w->ckq_head];
        w->ckq_head = (w->ckq_head + 1) % w->ckq_cap;
        w->ckq_len--;
        got = 1;
    }
    pthread_mutex_unlock(&w->mu);
    return got;
}

/* Puts a checkpoint back at the head (after a transport failure); dropped when the queue
 * filled meanwhile (newer checkpoints win). */
static void put_back(dw_worker *w, dw_ckpt *c) {
    pthread_mutex_lock(&w->mu);
    if (w->ckq_len < w->ckq_cap) {
        w->ckq_head = (w->ckq_head + w->ckq_cap - 1) % w->ckq_cap;
        w->ckq[w->ckq_head] = *c;
        w->ckq_len++;
        c->bytes = NULL;
    }
    pthread_mutex_unlock(&w->mu);
    if (c->bytes) {
        metric_inc(w->m_ck_dropped);
        free(c->bytes);
    }
}

/* Re-keys c to `iter`: a JSON object state with a "loop_iteration" number gets the new one (the
 * state names its own iteration, as the devworker's default state does), and the hash is
 * recomputed over the new bytes. Other states keep their bytes. 0, or -1 out of memory. */
static int rekey(dw_ckpt *c, int32_t iter) {
    int rc = 0;
    cJSON *o = c->len > 4 ? cJSON_ParseWithLength((const char *)c->bytes + 4, c->len - 4) : NULL;
    cJSON *it = o ? cJSON_GetObjectItemCaseSensitive(o, "loop_iteration") : NULL;
    c->loop_iteration = iter;
    if (cJSON_IsNumber(it)) {
        cJSON_SetNumberValue(it, iter);
        char *body = cJSON_PrintUnformatted(o);
        size_t n = body ? strlen(body) : 0;
        uint8_t *b = body ? malloc(n + 4) : NULL;
        if (b) {
            memcpy(b, c->bytes, 4); /* the schema version prefix */
            memcpy(b + 4, body, n);
            free(c->bytes);
            c->bytes = b;
            c->len = n + 4;
            ids_sha256_hex(c->bytes, c->len, c->sha256);
        } else {
            rc = -1;
        }
        cJSON_free(body);
    }
    cJSON_Delete(o);
    return rc;
}

/* Sends one checkpoint; -1 on a transport failure (kept for a retry). */
static int send_checkpoint(reporter *r, dw_ckpt *c, char *why, size_t whylen) {
    dw_worker *w = r->w;
    Upsquad__Runtime__V1__CheckpointRequest rq = UPSQUAD__RUNTIME__V1__CHECKPOINT_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    char *tok = mint(r, c->tenant);
    int code;
    int32_t key = dw_session_ck_key(w, c->session_id, c->iteration);
    if (key != c->loop_iteration) {
        int32_t was = c->loop_iteration;
        if (rekey(c, key) != 0) {
            free(tok);
            metric_inc(w->m_ck_dropped);
            free(c->bytes);
            return 0;
        }
        log_info("checkpoint.renumbered", "session %s: iteration %d goes as %d (another worker's)",
                 c->session_id, was, key);
    }
    rq.session_id = c->session_id;
    rq.bytes.data = c->bytes;
    rq.bytes.len = c->len;
    rq.bytes_sha256 = c->sha256;
    rq.loop_iteration = c->loop_iteration;
    rpc_md md[] = {{"x-upsquad-worker-addr", w->addr}};
    rpc_call_opts o = {.timeout_ms = w->cfg->rpc_timeout_ms, .bearer = tok, .md = md, .n_md = 1};
    code =
        tok ? rpc_unary_call(w->orch, SVC "Checkpoint", &rq.base,
                             &upsquad__runtime__v1__checkpoint_response__descriptor, &o, &resp, &st)
            : RPC_INTERNAL;
    free(tok);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    if (code != RPC_OK)
        snprintf(why, whylen, "Checkpoint: status %d %s", code, st.message ? st.message : "");
    rpc_status_clear(&st);
    if (code == RPC_OK) {
        metric_inc(w->m_ck_ok);
        free(c->bytes);
        return 0;
    }
    if (transient(code)) {
        metric_inc(w->m_ck_fail);
        put_back(w, c);
        return -1;
    }
    if (code == RPC_ALREADY_EXISTS && c->renumbered < CK_RENUMBER_MAX) {
        dw_session_ck_taken(w, c->session_id, c->iteration, c->loop_iteration);
        c->renumbered++;
        put_back(w, c); /* next in line, with the next key */
        return 0;
    }
    metric_inc(w->m_ck_refused);
    log_warn("checkpoint.refused", "session %s iteration %d: %s", c->session_id, c->loop_iteration,
             why);
    free(c->bytes);
    return 0;
}

static void wait_until(dw_worker *w, int64_t deadline, int want_queue) {
    pthread_mutex_lock(&w->mu);
    while (!w->stop && !(want_queue && w->ckq_len > 0)) {
        int64_t left = deadline - util_mono_ms();
        if (left <= 0) break;
        struct timespec ts;
        util_deadline(&ts, left);
        pthread_cond_timedwait(&w->cv, &w->mu, &ts);
    }
    pthread_mutex_unlock(&w->mu);
}

static int stopping(dw_worker *w) {
    pthread_mutex_lock(&w->mu);
    int s = w->stop;
    pthread_mutex_unlock(&w->mu);
    return s;
}

void *dw_reporter_main(void *arg) {
    dw_worker *w = arg;
    reporter r = {.w = w, .state = -1, .backoff = BACKOFF_MIN_MS};
    char why[512];
    log_set_trace("devworker-reporter");
    while (resolve_identity(w) != 0 && !stopping(w))
        wait_until(w, util_mono_ms() + 20, 0);
    if (w->orch == NULL) { /* nothing to report to: idle until stopped */
        wait_until(w, INT64_MAX, 0);
        return NULL;
    }
    log_info("reporter.start", "worker %s at %s heartbeats to %s every %lld ms", w->id, w->addr,
             w->cfg->orchestrator_addr, w->cfg->heartbeat_ms);
    r.next_hb = util_mono_ms();
    while (!stopping(w)) {
        if (util_mono_ms() >= r.next_hb) {
            if (heartbeat_round(&r, why, sizeof why) == 0) {
                set_state(&r, 1, NULL);
                r.backoff = BACKOFF_MIN_MS;
                r.next_hb = util_mono_ms() + w->cfg->heartbeat_ms;
            } else {
                set_state(&r, 0, why);
                r.next_hb = util_mono_ms() + r.backoff;
                r.backoff =
                    r.backoff * 2 > w->cfg->backoff_max_ms ? w->cfg->backoff_max_ms : r.backoff * 2;
            }
        }
        dw_ckpt c;
        while (r.state == 1 && !stopping(w) && take_head(w, &c)) {
            if (send_checkpoint(&r, &c, why, sizeof why) != 0) {
                set_state(&r, 0, why);
                r.next_hb = util_mono_ms() + r.backoff;
                break;
            }
        }
        wait_until(w, r.next_hb, r.state == 1);
    }
    free(r.hb_token);
    return NULL;
}
