/* The orchestrator's moving parts: configuration, stores, the worker pool, token minting and
 * the consumers, shared by the handlers (docs/orchestrator.md). */
#ifndef UPSQUAD_ORCH_H
#define UPSQUAD_ORCH_H

#include <stdatomic.h>
#include <stddef.h>

#include "auth.h"
#include "bus.h"
#include "cfg.h"
#include "db.h"
#include "keys.h"
#include "kv.h"
#include "metrics.h"
#include "rpc.h"
#include "rpc_client.h"
#include "workers.h"

#define ORCH_SCHEMA "orchestrator"
/* The scope claim a worker's token must carry for Heartbeat and Checkpoint. */
#define ORCH_WORKER_SCOPE "runtime.worker"
/* The scope of the bearer this service sends on its calls to workers. */
#define ORCH_CALLER_SCOPE "runtime.orchestrator"
/* A turn's end is stored a little after its step timeout (the worker call returns, then the
 * turn's transaction): the time a turn may count as in flight is its timeout plus this. */
#define ORCH_TURN_END_SLACK_MS 5000

typedef struct orch_config {
    char *pg_dsn;
    long long pg_pool_size;
    char *migrations_dir;
    char *pg_migrate_dsn; /* UPSQUAD_PG_MIGRATE_DSN: the schema owner (migrations only) */
    char *redis_url;
    char *nats_url;
    char *worker_targets;
    long long worker_probe_ms;
    long long worker_ttl_ms;
    long long worker_hb_interval_ms; /* expected heartbeat period of a worker; sweep period */
    long long worker_hb_misses;      /* missed heartbeats that make a worker dead */
    long long recovery_lease_ms;     /* a replica's claim on a session it recovers */
    long long step_timeout_ms;
    char *model_registry_addr;
    char *approvals_addr;         /* UPSQUAD_APPROVALS_ADDR: the engine's ApprovalService */
    long long approval_timeout_s; /* UPSQUAD_APPROVAL_TIMEOUT */
    char *approvals_durable;      /* UPSQUAD_APPROVALS_DURABLE */
    char *kek;
    char *token_key;
    char *token_alg;
    char *gateway_audience;
    char *context_audience;
    long long prior_turns;
    long long prior_bytes;
    long long message_max;
    long long checkpoint_max;
    long long checkpoints_keep;
    long long steps_concurrency;
    long long step_default_timeout_ms;
    long long no_worker_deliveries; /* a dispatch without a live worker: deliveries, then failed */
    long long paused_streams;       /* SendMessage streams held open on a paused session */
    long long turn_lease_ttl_ms;    /* a chat turn's lease not renewed this long is reclaimed */
    long long auto_max_todos;       /* UPSQUAD_AUTONOMOUS_MAX_TODOS: a plan's todos at most */
    long long auto_stall_window;    /* UPSQUAD_AUTONOMOUS_STALL_WINDOW: cycles without progress */
    long long auto_retries;         /* UPSQUAD_AUTONOMOUS_RETRIES: a lost worker's cycle again */
    long long deleg_max_depth;      /* UPSQUAD_DELEGATION_MAX_DEPTH */
    long long deleg_max_children;   /* UPSQUAD_DELEGATION_MAX_CHILDREN */
    char *client_ca, *client_cert, *client_key; /* TLS/mTLS towards workers and model-registry */
} orch_config;

const cfg_var *orch_config_vars(size_t *n);
orch_config *orch_config_get(void);

typedef struct orch_steps orch_steps;
typedef struct orch_sweeper orch_sweeper;

typedef struct orch {
    const orch_config *cfg; /* borrowed */
    db_pool *pool;
    bus *bus;
    auth_signer *signer;
    keys_ring ring; /* n == 0: no KEK configured (provider keys are not sent) */
    rpc_channel *registry;
    rpc_channel *approvals; /* the workflow engine (ApprovalService); NULL: not configured */
    rpc_client_tls tls;     /* towards workers and model-registry (used when tls.ca_file is set) */
    orch_workers *workers;
    orch_steps *steps;
    orch_sweeper *sweeper; /* crash recovery (recovery.c) */
    char instance[128];
    atomic_int parked; /* SendMessage streams waiting on a paused session (lifecycle.c) */

    metric *m_relayed, *m_dropped, *m_turns_ok, *m_turns_failed, *m_retries, *m_no_worker;
    metric *m_cost, *m_in_tokens, *m_out_tokens, *m_heartbeats, *m_checkpoints;
    metric *m_steps_ok, *m_steps_failed, *m_steps_replayed, *m_security, *m_relay_seconds;
    metric *m_recovered, *m_crashed;
} orch;

int orch_start(orch *o, const orch_config *cfg, char *err, size_t errlen);
int orch_migrate(const orch_config *cfg, char *err, size_t errlen);
void orch_stop(orch *o);

/* The Redis connection of the calling thread (opened lazily); NULL when Redis is not
 * configured or unreachable now. */
kv *orch_kv(const orch *o);

/* Mints the per-step agent-scoped bearers (never persisted, never logged). Caller frees. */
int orch_mint_agent_tokens(const orch *o, const char *org, const char *agent_id,
                           const char *session_id, char **gateway_token, char **context_token);

/* A short-lived bearer for calls to workers (sub "orchestrator", scope runtime.orchestrator,
 * aud UPSQUAD_JWT_AUDIENCE); NULL without a signing key. Caller frees. */
char *orch_mint_call_token(const orch *o, const char *org);
/* The same with another scope (e.g. approvals.open towards the engine). Caller frees. */
char *orch_mint_scoped_token(const orch *o, const char *org, const char *scope);

/* LifecycleService and RuntimeService handlers (lifecycle.c, runtime.c). */
int orch_lifecycle_register(rpc_server *srv, orch *o);
int orch_runtime_register(rpc_server *srv, orch *o);
/* LifecycleService's subagent-tree methods (tree.c). */
int orch_tree_register(rpc_server *srv, orch *o);

/* The crash-recovery sweeper (recovery.c; docs/orchestrator.md, "Crash recovery"). */
int orch_recovery_start(orch *o, char *err, size_t errlen);
void orch_recovery_stop(orch *o);

/* Workflow agent steps (steps.c). */
int orch_steps_start(orch *o, char *err, size_t errlen);
void orch_steps_stop(orch *o);

#endif
