/* workflow-engine: the shared state of one engine process (configuration, pools, bus,
 * validator) and the projection rules of the spec, each in one place. */
#ifndef WF_H
#define WF_H

#include <stdatomic.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "bus.h"
#include "cfg.h"
#include "db.h"
#include "defn.h"
#include "metrics.h"

#define WF_SCHEMA "workflow_engine"
/* escalation ("escalated to a higher clearance", spec) raises a gate's floor this many levels,
 * up to the highest clearance; EscalateAction and a gate's on_timeout "escalate" alike */
#define WF_CLEARANCE_MAX 5
#define WF_ESCALATE_STEP 1

typedef struct wf_config {
    char *pg_dsn;
    long long pg_pool_size;
    char *nats_url;
    char *migrations_dir;
    char *pg_migrate_dsn; /* UPSQUAD_PG_MIGRATE_DSN: the schema owner (migrations only) */
    char *schema_file;
    char *catalog_file;
    char *page_key;         /* HMAC key of page tokens (secret) */
    long long workers;      /* interpreter threads */
    long long group_max;    /* runs one interpreter transaction may tick (group commit) */
    long long max_rendered; /* UPSQUAD_WF_MAX_RENDERED: bytes per template render */
    long long lease_ms;     /* run lease */
    long long idle_poll_ms;
    long long tool_timeout_ms;
    long long tool_attempts;
    long long agent_timeout_ms;
    long long relay_batch;
    long long relay_linger_ms; /* least time between the starts of two relay rounds */
    long long schedule_poll_ms;
    long long agent_retries;          /* retries of a retryable agent failure, per step */
    long long agent_retry_backoff_ms; /* first retry's delay, doubled per retry */
    long long agent_retry_backoff_max_ms;
    long long run_max_actions;  /* actions (step instances, laps included) one run may create */
    long long org_max_active;   /* pending + running runs of one org; more: RESOURCE_EXHAUSTED */
    long long org_trigger_rate; /* runs one org may start per second */
    int code_exec;              /* WF_CODE_EXEC_ENABLED: the catalogue's code_exec switch */
    int code_exec_alias;        /* UPSQUAD_CODE_EXEC_ENABLED: the same switch's other name */
} wf_config;

const cfg_var *wf_config_vars(size_t *n);
wf_config *wf_config_get(void);

typedef struct wf_engine {
    const wf_config *cfg;
    db_pool *pool;
    bus *bus;
    defn_ctx *defn;
    char instance[96];
    unsigned char page_key[32];
    atomic_int stop; /* set at shutdown, read by every engine thread */
    pthread_mutex_t mu;
    pthread_cond_t cv;       /* wakes idle interpreter threads (kick) */
    pthread_cond_t relay_cv; /* wakes the relay (relay_kick), only while it waits for one */
    pthread_cond_t sched_cv; /* ends the scheduler's sleep at shutdown */
    unsigned kick;           /* work was queued locally */
    unsigned relay_kick;     /* outbox rows were committed locally */
    unsigned relay_waiting;  /* the relay sleeps until a kick (else a kick only sets the flag) */
    pthread_t *workers;
    int n_workers;
    pthread_t relay, results, scheduler;
    int relay_started, results_started, scheduler_started;
    bus_pull *result_sub;
    bus_sub *announce_sub;
    /* tools announced by providers (tool.announce), with when they were last heard */
    pthread_mutex_t tools_mu;
    char announced[64][64];
    int64_t announced_at[64];
    int n_announced;
    metric *m_transitions, *m_runs_started, *m_runs_finished, *m_tool_calls, *m_tool_failures,
        *m_tool_batches, *m_published, *m_first_step, *m_outbox_lag, *m_pending_gates,
        *m_oldest_gate, *m_group_runs, *m_group_fallbacks, *m_tick_seconds, *m_tool_round_seconds;
    /* by final status: completed, failed, cancelled (wf_engine_run_ended) */
    metric *m_ended[3], *m_run_seconds[3];
} wf_engine;

int wf_engine_start(wf_engine *e, const wf_config *cfg, char *err, size_t errlen);
void wf_engine_stop(wf_engine *e);
int wf_engine_migrate(const wf_config *cfg, char *err, size_t errlen);
/* Wakes local interpreter threads (a run was queued or woken). */
void wf_engine_kick(wf_engine *e);
/* 1 when GetToolCatalog should list tool: a provider announced it within the last three
 * announce periods, or no provider has announced anything yet (catalogue served whole). */
int wf_tool_mounted(wf_engine *e, const char *tool);
/* Wakes the outbox relay (events were committed). */
void wf_engine_kick_relay(wf_engine *e);
/* Counts a run that reached `status` (completed, failed, cancelled; others are ignored) and
 * observes its duration since started_ms (epoch ms; 0: unknown, not observed). Call after the
 * transaction that ended it committed. */
void wf_engine_run_ended(wf_engine *e, const char *status, int64_t started_ms);

/* ---- projection rules (spec: WorkflowAction.status, NodeStatusUpdate, WorkflowRun) ---- */

/* Raw action status (ten values) -> the five-colour palette. */
const char *wf_fold_status(const char *raw);
/* 1 for the raw statuses counted by nodes_done. */
int wf_raw_terminal(const char *raw);
/* blocked_by projected: the stored token only while the node is parked, else "". */
const char *wf_project_blocked_by(const char *raw, const char *stored);
/* 1 for a terminal run status. */
int wf_run_terminal(const char *status);
/* Wall clock, milliseconds since the epoch. */
int64_t wf_now_ms(void);

#endif
