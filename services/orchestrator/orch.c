/* Configuration, start and stop of the orchestrator's parts (orch.h). */
#include "orch.h"

#include <openssl/crypto.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gate.h"
#include "ids.h"
#include "lease.h"
#include "log.h"
#include "turn.h"
#include "util.h"

static orch_config C;

static const cfg_var vars[] = {
    {"UPSQUAD_PG_DSN", CFG_STR, NULL,
     "Postgres connection string of the orchestrator login role (libpq keywords or URI)", &C.pg_dsn,
     0, 0, CFG_REQUIRED | CFG_SECRET},
    {"UPSQUAD_PG_MIGRATE_DSN", CFG_STR, NULL,
     "Postgres connection string of the orchestrator schema's owner role, used only to apply the "
     "migrations (at start or with --migrate); unset: they run as UPSQUAD_PG_DSN, which must "
     "then own the schema (make run and Kubernetes set both: the service logs in as a role that "
     "owns nothing)",
     &C.pg_migrate_dsn, 0, 0, CFG_SECRET},
    {"UPSQUAD_PG_POOL_SIZE", CFG_INT, "8", "Postgres connections at most", &C.pg_pool_size, 1, 256},
    {"UPSQUAD_MIGRATIONS_DIR", CFG_STR, "services/orchestrator/migrations",
     "folder of the schema migrations applied at start; `none`: do not migrate at start (run "
     "`orchestrator --migrate` as a Job instead)",
     &C.migrations_dir},
    {"UPSQUAD_REDIS_URL", CFG_STR, "",
     "Redis for worker liveness (heartbeat keys with a TTL); empty: loads from heartbeats are "
     "not used",
     &C.redis_url},
    {"UPSQUAD_NATS_URL", CFG_STR, "",
     "NATS (JetStream) for workflow agent steps; empty: agent steps are not consumed", &C.nats_url},
    {"UPSQUAD_WORKER_TARGETS", CFG_STR, "",
     "RuntimeService workers: host:port list and/or dns:///name:port (Kubernetes headless "
     "Service); empty: UPSQUAD_DEVWORKER_ADDR when set",
     &C.worker_targets},
    {"UPSQUAD_WORKER_PROBE", CFG_MS, "1s", "how often every worker target is health-checked",
     &C.worker_probe_ms, 100, 60000},
    {"UPSQUAD_WORKER_HEARTBEAT_TTL", CFG_MS, "15s",
     "a worker's heartbeat key expires this long after its last heartbeat", &C.worker_ttl_ms, 1000,
     600000},
    {"UPSQUAD_WORKER_HEARTBEAT_INTERVAL", CFG_MS, "5s",
     "how often workers heartbeat (a devworker: UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL); also how "
     "often each replica sweeps for dead workers",
     &C.worker_hb_interval_ms, 50, 600000},
    {"UPSQUAD_WORKER_HEARTBEAT_MISSES", CFG_INT, "3",
     "a worker whose last heartbeat is older than this many intervals is dead: its sessions are "
     "recovered on another worker",
     &C.worker_hb_misses, 1, 1000},
    {"UPSQUAD_RECOVERY_LEASE", CFG_MS, "30s",
     "how long one replica owns the recovery of a session; a replica that dies while recovering "
     "leaves it to another after this",
     &C.recovery_lease_ms, 2000, 600000},
    {"UPSQUAD_STEP_TIMEOUT", CFG_MS, "10m", "bound on one agent turn (ExecuteStep) on a worker",
     &C.step_timeout_ms, 1000, 3600000},
    {"UPSQUAD_MODEL_REGISTRY_ADDR", CFG_STR, "",
     "model-registry address to check model_override against; empty: not checked",
     &C.model_registry_addr},
    {"UPSQUAD_KEK", CFG_STR, "",
     "key-encryption keys for BYOK provider keys, `kid:64-hex[,kid:64-hex]` (the first "
     "encrypts); empty: provider keys are not sent to workers",
     &C.kek, 0, 0, CFG_SECRET},
    {"UPSQUAD_AGENT_TOKEN_KEY", CFG_STR, "",
     "signing key of agent_gateway_token/context_engine_token (PEM private key for RS256/ES256, "
     "or an HS256 secret); empty: UPSQUAD_JWT_SECRET with HS256",
     &C.token_key, 0, 0, CFG_SECRET},
    {"UPSQUAD_AGENT_TOKEN_ALG", CFG_STR, "HS256", "HS256, RS256 or ES256", &C.token_alg},
    {"UPSQUAD_AGENT_GATEWAY_AUDIENCE", CFG_STR, "upsquad-agent-gateway",
     "`aud` pinned in agent_gateway_token", &C.gateway_audience},
    {"UPSQUAD_CONTEXT_ENGINE_AUDIENCE", CFG_STR, "upsquad-context-engine",
     "`aud` pinned in context_engine_token", &C.context_audience},
    {"UPSQUAD_PRIOR_TURNS", CFG_INT, "20",
     "prior_turns: the newest N final user/assistant turns sent with each turn", &C.prior_turns, 0,
     200},
    {"UPSQUAD_PRIOR_TURNS_BYTES", CFG_INT, "65536",
     "prior_turns: at most this many bytes of text (newest kept)", &C.prior_bytes, 0, 4194304},
    {"UPSQUAD_MESSAGE_MAX", CFG_INT, "65536", "longest user message accepted, in bytes",
     &C.message_max, 1, 1048576},
    {"UPSQUAD_CHECKPOINT_MAX", CFG_INT, "4194304",
     "largest checkpoint blob accepted (bytes, prefix included)", &C.checkpoint_max, 4, 16777216},
    {"UPSQUAD_CHECKPOINTS_KEEP", CFG_INT, "5",
     "checkpoints kept per session (the newest by loop_iteration)", &C.checkpoints_keep, 1, 1000},
    {"UPSQUAD_AGENT_STEPS_CONCURRENCY", CFG_INT, "4",
     "workflow agent steps run at once by this replica", &C.steps_concurrency, 1, 64},
    {"UPSQUAD_AGENT_STEP_TIMEOUT", CFG_MS, "5m",
     "bound on a workflow agent step whose dispatch names none", &C.step_default_timeout_ms, 1000,
     3600000},
    {"UPSQUAD_AGENT_STEP_NO_WORKER_DELIVERIES", CFG_INT, "15",
     "a workflow agent step that finds no live worker is redelivered every 2 s; at this delivery "
     "it is reported failed (NO_WORKER, retryable) and the engine's retry policy decides",
     &C.no_worker_deliveries, 1, 1000},
    {"UPSQUAD_PAUSED_STREAMS", CFG_INT, "16",
     "SendMessage streams a replica keeps open on a paused session until it is resumed or "
     "terminated (each holds a stream worker); beyond, the stream ends after its "
     "SessionPausedEvent",
     &C.paused_streams, 0, 1024},
    {"UPSQUAD_APPROVALS_ADDR", CFG_STR, "",
     "the workflow engine's address (its ApprovalService): a chat turn's gated tool call or "
     "ask_user opens its approval or prompt there; empty: such a turn fails with "
     "APPROVAL_UNAVAILABLE (nothing runs ungoverned)",
     &C.approvals_addr},
    {"UPSQUAD_APPROVAL_TIMEOUT", CFG_INT, "0",
     "seconds until a chat approval or prompt expires (1..604800; 0: the engine's default, a "
     "day); an expired approval resumes the turn with the call denied, an expired prompt with "
     "an empty answer",
     &C.approval_timeout_s, 0, 604800},
    {"UPSQUAD_APPROVALS_DURABLE", CFG_STR, "orchestrator-sessions",
     "the JetStream durable consumer of approval.decided.> that every replica of one deployment "
     "shares (each decision reaches one replica); deployments sharing a NATS use distinct names; "
     "`none`: this replica consumes no decisions (a stream waiting on it still resumes its "
     "session when another replica stores the decision)",
     &C.approvals_durable},
    {"UPSQUAD_AUTONOMOUS_MAX_TODOS", CFG_INT, "20",
     "an autonomous plan keeps at most this many todos of the PLAN step's decomposition (the "
     "first ones in their ordering)",
     &C.auto_max_todos, 1, 64},
    {"UPSQUAD_AUTONOMOUS_STALL_WINDOW", CFG_INT, "3",
     "an autonomous loop stops as stalled after this many cycles in a row with no new artifacts, "
     "no completed todo and the same response_delta_hash as the cycle before",
     &C.auto_stall_window, 1, 50},
    {"UPSQUAD_AUTONOMOUS_RETRIES", CFG_INT, "2",
     "an autonomous cycle whose worker was lost (a retryable failure before anything of it "
     "reached the caller) runs again on another live worker, at most this many times",
     &C.auto_retries, 0, 5},
    {"UPSQUAD_DELEGATION_MAX_DEPTH", CFG_INT, "3",
     "a delegate_to_agent call is refused (an error result, the turn goes on) when the child "
     "would sit deeper than this below its root session",
     &C.deleg_max_depth, 1, 10},
    {"UPSQUAD_DELEGATION_MAX_CHILDREN", CFG_INT, "8",
     "a session's delegations at most (children it spawned, ever); more are refused as above",
     &C.deleg_max_children, 1, 50},
    {"UPSQUAD_TURN_LEASE_TTL", CFG_MS, "15s",
     "a chat turn in flight is leased to the replica relaying it, which renews the lease every "
     "third of this; a lease not renewed for this long is reclaimed by any replica (the turn "
     "ends: no longer in flight, status ERROR, a pending pause commits), so a replica killed "
     "mid-turn leaves nothing running longer than this plus a third",
     &C.turn_lease_ttl_ms, 1000, 600000},
};

const cfg_var *orch_config_vars(size_t *n) {
    *n = sizeof vars / sizeof vars[0];
    return vars;
}

orch_config *orch_config_get(void) {
    return &C;
}

static int set(const char *s) {
    return s && s[0] && strcmp(s, "none") != 0;
}

static void register_metrics(orch *o) {
    o->m_relayed = metrics_counter("orchestrator_relayed_events_total",
                                   "worker events relayed to callers", NULL);
    o->m_dropped = metrics_counter("orchestrator_dropped_answers_total",
                                   "structured answers dropped for exceeding a budget", NULL);
    o->m_turns_ok = metrics_counter("orchestrator_turns_total", "agent turns", "outcome=\"ok\"");
    o->m_turns_failed =
        metrics_counter("orchestrator_turns_total", "agent turns", "outcome=\"failed\"");
    o->m_retries =
        metrics_counter("orchestrator_turn_retries_total", "turns retried on another worker", NULL);
    o->m_recovered = metrics_counter("orchestrator_sessions_recovered_total",
                                     "sessions of a dead worker moved to another worker", NULL);
    o->m_crashed = metrics_counter("orchestrator_sessions_crashed_total",
                                   "sessions whose recovery failed (state crashed)", NULL);
    o->m_no_worker = metrics_counter("orchestrator_no_worker_total",
                                     "turns refused because no worker was live", NULL);
    o->m_cost = metrics_counter("orchestrator_llm_cost_usd_total",
                                "LLM cost reported by workers (MetricsEvent)", NULL);
    o->m_in_tokens = metrics_counter("orchestrator_tokens_total", "LLM tokens", "kind=\"input\"");
    o->m_out_tokens = metrics_counter("orchestrator_tokens_total", "LLM tokens", "kind=\"output\"");
    o->m_heartbeats = metrics_counter("orchestrator_heartbeats_total", "worker heartbeats", NULL);
    o->m_checkpoints =
        metrics_counter("orchestrator_checkpoints_total", "checkpoints accepted", NULL);
    o->m_steps_ok = metrics_counter("orchestrator_agent_steps_total", "workflow agent steps",
                                    "outcome=\"completed\"");
    o->m_steps_failed = metrics_counter("orchestrator_agent_steps_total", "workflow agent steps",
                                        "outcome=\"failed\"");
    o->m_steps_replayed = metrics_counter("orchestrator_agent_steps_total", "workflow agent steps",
                                          "outcome=\"replayed\"");
    o->m_security = metrics_counter("orchestrator_security_events_total",
                                    "security events reported by workers (audited)", NULL);
}

/* One Redis connection per handler thread (kv is not thread-safe), closed when the thread
 * exits (the key's destructor). */
static pthread_key_t kv_key;
static pthread_once_t kv_once = PTHREAD_ONCE_INIT;
static __thread time_t tl_kv_retry;

static void kv_destroy(void *k) {
    kv_close(k);
}

static void kv_key_init(void) {
    pthread_key_create(&kv_key, kv_destroy);
}

kv *orch_kv(const orch *o) {
    char err[256];
    kv *k;
    pthread_once(&kv_once, kv_key_init);
    if ((k = pthread_getspecific(kv_key))) return k;
    if (!set(o->cfg->redis_url) || time(NULL) < tl_kv_retry) return NULL;
    if (kv_connect(o->cfg->redis_url, 1000, &k, err, sizeof err) != KV_OK) {
        log_warn("redis.connect", "%s", err);
        tl_kv_retry = time(NULL) + 2;
        return NULL;
    }
    pthread_setspecific(kv_key, k);
    return k;
}

int orch_mint_agent_tokens(const orch *o, const char *org, const char *agent_id,
                           const char *session_id, char **gateway_token, char **context_token) {
    char extra[320], err[256], jti[37];
    *gateway_token = *context_token = NULL;
    if (!o->signer || ids_uuid_v4(jti)) return -1;
    /* jti: every step's bearer is distinct (refreshed per step, never reused) */
    snprintf(extra, sizeof extra, "{\"agent_id\":\"%s\",\"session_id\":\"%s\",\"jti\":\"%s\"}",
             agent_id, session_id, jti);
    auth_claims c = {.sub = agent_id,
                     .org_id = org,
                     .audience = o->cfg->gateway_audience,
                     .issuer = "upsquad-orchestrator",
                     .clearance = 1,
                     .ttl_s = 600,
                     .extra_json = extra};
    if (auth_mint(o->signer, &c, gateway_token, err, sizeof err)) return -1;
    c.audience = o->cfg->context_audience;
    c.ttl_s = 300;
    if (auth_mint(o->signer, &c, context_token, err, sizeof err)) {
        free(*gateway_token);
        *gateway_token = NULL;
        return -1;
    }
    return 0;
}

char *orch_mint_call_token(const orch *o, const char *org) {
    return orch_mint_scoped_token(o, org, ORCH_CALLER_SCOPE);
}

char *orch_mint_scoped_token(const orch *o, const char *org, const char *scope) {
    char err[256], *tok = NULL, extra[160];
    const char *aud = getenv("UPSQUAD_JWT_AUDIENCE");
    if (!o->signer) return NULL;
    auth_claims c = {.sub = "orchestrator",
                     .org_id = org && org[0] ? org : "00000000-0000-0000-0000-000000000000",
                     .audience = aud && aud[0] ? aud : "upsquad",
                     .issuer = "upsquad-orchestrator",
                     .clearance = 1,
                     .ttl_s = 300,
                     .extra_json = extra};
    snprintf(extra, sizeof extra, "{\"scope\":\"%s\"}", scope);
    if (auth_mint(o->signer, &c, &tok, err, sizeof err)) return NULL;
    return tok;
}

static int open_pool(const orch_config *cfg, db_pool **out, char *err, size_t errlen) {
    db_pool_opts po;
    db_pool_opts_default(&po);
    po.size = (int)cfg->pg_pool_size;
    po.application_name = "orchestrator";
    return db_pool_open_ex(cfg->pg_dsn, &po, out, err, errlen);
}

int orch_migrate(const orch_config *cfg, char *err, size_t errlen) {
    db_pool *p = NULL;
    int applied = 0;
    if (open_pool(cfg, &p, err, errlen)) return -1;
    int rc = db_migrate_as(p, cfg->pg_migrate_dsn, ORCH_SCHEMA, cfg->migrations_dir, &applied, err,
                           errlen);
    if (rc == DB_OK) log_info("db.migrated", "%d migrations applied", applied);
    db_pool_close(p);
    return rc == DB_OK ? 0 : -1;
}

int orch_start(orch *o, const orch_config *cfg, char *err, size_t errlen) {
    char e[512];
    memset(o, 0, sizeof *o);
    o->cfg = cfg;
    char host[64] = "?";
    gethostname(host, sizeof host);
    snprintf(o->instance, sizeof o->instance, "%s:%d", host, (int)getpid());
    register_metrics(o);
    if (open_pool(cfg, &o->pool, e, sizeof e)) goto fail_e;
    if (set(cfg->migrations_dir)) {
        int applied = 0;
        if (db_migrate_as(o->pool, cfg->pg_migrate_dsn, ORCH_SCHEMA, cfg->migrations_dir, &applied,
                          e, sizeof e))
            goto fail_e;
        if (applied) log_info("db.migrated", "%d migrations applied", applied);
    }
    if (set(cfg->kek) && keys_ring_parse(cfg->kek, &o->ring, e, sizeof e)) goto fail_e;
    const char *key = set(cfg->token_key) ? cfg->token_key : getenv("UPSQUAD_JWT_SECRET");
    const char *alg = set(cfg->token_key) ? cfg->token_alg : "HS256";
    if (key && key[0] && auth_signer_new(alg, key, &o->signer, e, sizeof e)) goto fail_e;
    if (!o->signer)
        log_warn("tokens.none", "no signing key: workers get no agent_gateway_token/"
                                "context_engine_token (MCP and context calls disabled)");
    o->tls = (rpc_client_tls){.ca_file = cfg->client_ca,
                              .cert_file = set(cfg->client_cert) ? cfg->client_cert : NULL,
                              .key_file = set(cfg->client_key) ? cfg->client_key : NULL};
    const rpc_client_tls *tlsp = set(cfg->client_ca) ? &o->tls : NULL;
    if (set(cfg->model_registry_addr)) {
        rpc_channel_opts co = {.target = cfg->model_registry_addr, .tls = tlsp};
        if (rpc_channel_new(&co, &o->registry, e, sizeof e)) goto fail_e;
    }
    if (set(cfg->approvals_addr)) {
        rpc_channel_opts co = {.target = cfg->approvals_addr, .tls = tlsp};
        if (rpc_channel_new(&co, &o->approvals, e, sizeof e)) goto fail_e;
    }
    const char *targets =
        set(cfg->worker_targets) ? cfg->worker_targets : getenv("UPSQUAD_DEVWORKER_ADDR");
    if (orch_workers_start(targets ? targets : "", cfg->worker_probe_ms, cfg->redis_url, tlsp,
                           &o->workers, e, sizeof e))
        goto fail_e;
    log_info("workers.configured", "targets \"%s\", %d live", targets ? targets : "",
             orch_workers_live(o->workers));
    if (orch_turn_watcher_start()) {
        snprintf(e, sizeof e, "cannot start the cancellation watcher");
        goto fail_e;
    }
    if (orch_lease_start(o)) {
        snprintf(e, sizeof e, "cannot start the turn lease keeper");
        goto fail_e;
    }
    if (set(cfg->nats_url) && orch_steps_start(o, e, sizeof e)) goto fail_e;
    if (orch_gate_start(o, e, sizeof e)) goto fail_e;
    if (orch_recovery_start(o, e, sizeof e)) goto fail_e;
    return 0;
fail_e:
    util_errf(err, errlen, -1, "%s", e);
    orch_stop(o);
    return -1;
}

void orch_stop(orch *o) {
    orch_recovery_stop(o);
    orch_gate_stop(o);
    orch_steps_stop(o);
    orch_lease_stop();
    orch_turn_watcher_stop();
    orch_workers_stop(o->workers);
    o->workers = NULL;
    if (o->registry) rpc_channel_free(o->registry);
    o->registry = NULL;
    if (o->approvals) rpc_channel_free(o->approvals);
    o->approvals = NULL;
    auth_signer_free(o->signer);
    o->signer = NULL;
    keys_ring_wipe(&o->ring);
    db_pool_close(o->pool);
    o->pool = NULL;
}
