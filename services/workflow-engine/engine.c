/* Configuration, start-up (validator, pool, migrations, bus, streams) and the engine's threads
 * (wf.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ids.h"
#include "interp.h"
#include "log.h"
#include "subjects.h"
#include "upsquad/internal/v1/tool.pb-c.h"
#include "util.h"
#include "wf.h"
#include "wf_expr.h"

static wf_config C;

static const cfg_var vars[] = {
    {"UPSQUAD_PG_DSN", CFG_STR, NULL,
     "Postgres connection string of the workflow_engine login role (not a superuser, not "
     "BYPASSRLS)",
     &C.pg_dsn, 0, 0, CFG_REQUIRED | CFG_SECRET},
    {"UPSQUAD_PG_MIGRATE_DSN", CFG_STR, NULL,
     "Postgres connection string of the workflow_engine schema's owner role, used only to apply "
     "the "
     "migrations (at start or with --migrate); unset: they run as UPSQUAD_PG_DSN, which must "
     "then own the schema (make run and Kubernetes set both: the service logs in as a role that "
     "owns nothing)",
     &C.pg_migrate_dsn, 0, 0, CFG_SECRET},
    {"UPSQUAD_PG_POOL_SIZE", CFG_INT, "8",
     "Postgres connections at most (RPC threads, interpreter threads, relay, scheduler share "
     "them)",
     &C.pg_pool_size, 2, 200},
    {"UPSQUAD_NATS_URL", CFG_STR, "nats://127.0.0.1:4222",
     "NATS server(s) with JetStream: events, agent steps and results, tool calls", &C.nats_url},
    {"UPSQUAD_MIGRATIONS_DIR", CFG_STR, "services/workflow-engine/migrations",
     "folder of the schema migrations applied at start; `none`: do not migrate at start (run "
     "`workflow-engine --migrate` as a Job instead)",
     &C.migrations_dir},
    {"UPSQUAD_WF_SCHEMA_FILE", CFG_STR,
     "services/workflow-engine/schema/workflow-definition.schema.json",
     "the definition language's JSON Schema", &C.schema_file},
    {"UPSQUAD_WF_CATALOG_FILE", CFG_STR, "services/workflow-engine/catalog/tools.json",
     "the tool catalogue (validator and GetToolCatalog)", &C.catalog_file},
    {"UPSQUAD_WF_PAGE_KEY", CFG_STR, NULL,
     "HMAC key of ListRuns/ListVisibleRuns page tokens; the same on every replica. Unset: "
     "derived from UPSQUAD_JWT_SECRET, else random per process (tokens then only work on the "
     "replica that issued them)",
     &C.page_key, 0, 0, CFG_SECRET},
    {"UPSQUAD_WF_WORKERS", CFG_INT, "2",
     "interpreter threads (each advances one group of runs at a time)", &C.workers, 1, 64},
    {"UPSQUAD_WF_GROUP_MAX", CFG_INT, "16",
     "group commit: due runs one interpreter thread claims at once and ticks in one "
     "transaction (each under its own org scope and lease); an idle engine claims what is due, "
     "one run; 1 ticks every run in its own transaction",
     &C.group_max, 1, 256},
    {"UPSQUAD_WF_MAX_RENDERED", CFG_INT, "1048576",
     "bytes one template render may produce (a step's prompt, summary or whole `with` block); "
     "a step whose templates expand past it fails with an error naming this variable",
     &C.max_rendered, 1024, 8388608},
    {"UPSQUAD_WF_LEASE", CFG_MS, "15s",
     "run lease: a replica that dies holding a run loses it after this long and any replica "
     "continues it",
     &C.lease_ms, 500, 600000},
    {"UPSQUAD_WF_IDLE_POLL", CFG_MS, "200ms",
     "how often an idle interpreter thread looks for due runs (local triggers wake it at once)",
     &C.idle_poll_ms, 5, 60000},
    {"UPSQUAD_WF_TOOL_TIMEOUT", CFG_MS, "5s", "one tool request's reply timeout",
     &C.tool_timeout_ms, 50, 600000},
    {"UPSQUAD_WF_TOOL_ATTEMPTS", CFG_INT, "3",
     "tool request attempts (same idempotency key) before the step fails", &C.tool_attempts, 1, 20},
    {"UPSQUAD_WF_AGENT_TIMEOUT", CFG_MS, "30m",
     "an agent step without timeout_minutes fails after this long without a result",
     &C.agent_timeout_ms, 1000, 86400000},
    {"UPSQUAD_WF_RELAY_BATCH", CFG_INT, "256", "outbox rows published per relay round",
     &C.relay_batch, 1, 10000},
    {"UPSQUAD_WF_RELAY_LINGER", CFG_MS, "10ms",
     "least time between the starts of two relay rounds: under load the events of several "
     "ticks share one round (an idle relay still publishes a commit's events at once)",
     &C.relay_linger_ms, 0, 1000},
    {"UPSQUAD_WF_SCHEDULE_POLL", CFG_MS, "1s",
     "how often a replica looks for due schedules and expired session approvals",
     &C.schedule_poll_ms, 50, 60000},
    {"UPSQUAD_WF_AGENT_RETRIES", CFG_INT, "3",
     "retries of an agent step whose attempt failed retryably (ErrorEvent.retryable, worker "
     "unreachable), each with a fresh idempotency key; then the step fails",
     &C.agent_retries, 0, 20},
    {"UPSQUAD_WF_AGENT_RETRY_BACKOFF", CFG_MS, "2s",
     "delay before the first retry of an agent step, doubled for each further retry",
     &C.agent_retry_backoff_ms, 10, 600000},
    {"UPSQUAD_WF_AGENT_RETRY_BACKOFF_MAX", CFG_MS, "60s",
     "longest delay between agent step retries", &C.agent_retry_backoff_max_ms, 10, 3600000},
    {"UPSQUAD_WF_RUN_MAX_ACTIONS", CFG_INT, "10000",
     "actions one run may create (every step instance, each loop lap's included); the run fails "
     "when its next step would exceed it",
     &C.run_max_actions, 1, 1000000},
    {"UPSQUAD_WF_ORG_MAX_ACTIVE_RUNS", CFG_INT, "200",
     "pending and running runs one org may have; a trigger beyond is RESOURCE_EXHAUSTED with a "
     "RetryInfo of 5 s",
     &C.org_max_active, 1, 1000000},
    {"UPSQUAD_WF_ORG_TRIGGERS_PER_SEC", CFG_INT, "20",
     "runs one org may start within one second; a trigger beyond is RESOURCE_EXHAUSTED with a "
     "RetryInfo of 1 s",
     &C.org_trigger_rate, 1, 100000},
    /* the catalogue's switches (tools.json enabled_by, enabled_by_alias): catalog_gate */
    {"WF_CODE_EXEC_ENABLED", CFG_BOOL, "false",
     "serve the code_exec tool: GetToolCatalog lists it and definitions may use it (spec: "
     "\"code_exec, gated by WF_CODE_EXEC_ENABLED\"); also on when UPSQUAD_CODE_EXEC_ENABLED is",
     &C.code_exec, 0, 0},
    {"UPSQUAD_CODE_EXEC_ENABLED", CFG_BOOL, "false",
     "the same switch under this service's earlier name (an alias: either one enables code_exec)",
     &C.code_exec_alias, 0, 0},
};

const cfg_var *wf_config_vars(size_t *n) {
    *n = sizeof vars / sizeof vars[0];
    return vars;
}

wf_config *wf_config_get(void) {
    return &C;
}

/* The validator asks for the catalogue's switches by name. The ones declared in vars answer
 * from the loaded configuration (--help-config lists them, a malformed value stops the start);
 * a switch only another catalogue file names is read from the environment, as without opts. */
static bool catalog_gate(const char *name, void *arg) {
    const wf_config *cfg = arg;
    if (!strcmp(name, "WF_CODE_EXEC_ENABLED")) return cfg->code_exec;
    if (!strcmp(name, "UPSQUAD_CODE_EXEC_ENABLED")) return cfg->code_exec_alias;
    return defn_env_gate(name, NULL);
}

static int set(const char *s) {
    return s && s[0] && strcmp(s, "none") != 0;
}

/* Each kick wakes at most one thread: the relay only when it sleeps waiting for one (during
 * its linger the flag is enough), one idle interpreter thread for queued work (a thread that
 * claims a run wakes the next, wf_interp_thread). */
void wf_engine_kick_relay(wf_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->relay_kick = 1;
    if (e->relay_waiting) pthread_cond_signal(&e->relay_cv);
    pthread_mutex_unlock(&e->mu);
}

void wf_engine_kick(wf_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->kick = 1;
    e->relay_kick = 1;
    pthread_cond_signal(&e->cv);
    if (e->relay_waiting) pthread_cond_signal(&e->relay_cv);
    pthread_mutex_unlock(&e->mu);
}

int wf_engine_migrate(const wf_config *cfg, char *err, size_t errlen) {
    db_pool *pool = NULL;
    int applied = 0;
    if (!set(cfg->migrations_dir))
        return util_errf(err, errlen, -1, "UPSQUAD_MIGRATIONS_DIR is none");
    if (db_pool_open(cfg->pg_dsn, 1, &pool, err, errlen) != DB_OK) return -1;
    int rc = db_migrate_as(pool, cfg->pg_migrate_dsn, WF_SCHEMA, cfg->migrations_dir, &applied, err,
                           errlen);
    db_pool_close(pool);
    if (rc != DB_OK) return -1;
    log_info("engine.migrated", "%d migration(s) applied", applied);
    return 0;
}

static void page_key(wf_engine *e) {
    const char *k = set(C.page_key) ? C.page_key : getenv("UPSQUAD_JWT_SECRET");
    unsigned char raw[32];
    if (k && k[0]) {
        char hex[65];
        char buf[512];
        snprintf(buf, sizeof buf, "workflow-engine page tokens:%s", k);
        ids_sha256_hex(buf, strlen(buf), hex);
        for (int i = 0; i < 32; i++) {
            unsigned v;
            sscanf(hex + 2 * i, "%2x", &v);
            raw[i] = (unsigned char)v;
        }
    } else {
        char u[37];
        ids_uuid_v4(u);
        ids_sha256_hex(u, strlen(u), (char[65]){0});
        for (int i = 0; i < 32; i++)
            raw[i] = (unsigned char)u[i];
        log_warn("engine.page_key", "no UPSQUAD_WF_PAGE_KEY: page tokens are per process");
    }
    memcpy(e->page_key, raw, 32);
}

static int streams(wf_engine *e, char *err, size_t errlen) {
    const char *wf[] = {STREAM_WF_EVENTS_SUBJECT_STATUS, STREAM_WF_EVENTS_SUBJECT_LOG};
    const char *steps[] = {STREAM_AGENT_STEPS_SUBJECTS};
    const char *results[] = {STREAM_AGENT_RESULTS_SUBJECTS};
    const char *cancels[] = {STREAM_AGENT_CANCELS_SUBJECTS};
    if (bus_js_stream_ensure(e->bus, STREAM_WF_EVENTS, wf, 2, BUS_RETENTION_LIMITS,
                             STREAM_WF_EVENTS_MAX_AGE_S, NULL, err, errlen) != BUS_OK ||
        bus_js_stream_ensure(e->bus, STREAM_AGENT_STEPS, steps, 1, BUS_RETENTION_WORKQUEUE,
                             STREAM_AGENT_STEPS_MAX_AGE_S, NULL, err, errlen) != BUS_OK ||
        bus_js_stream_ensure(e->bus, STREAM_AGENT_RESULTS, results, 1, BUS_RETENTION_WORKQUEUE,
                             STREAM_AGENT_RESULTS_MAX_AGE_S, NULL, err, errlen) != BUS_OK ||
        bus_js_stream_ensure(e->bus, STREAM_AGENT_CANCELS, cancels, 1, BUS_RETENTION_LIMITS,
                             STREAM_AGENT_CANCELS_MAX_AGE_S, NULL, err, errlen) != BUS_OK)
        return -1;
    return bus_js_pull_subscribe(e->bus, STREAM_AGENT_RESULTS, DURABLE_AGENT_RESULTS,
                                 STREAM_AGENT_RESULTS_SUBJECTS, 30000, -1, &e->result_sub, err,
                                 errlen) == BUS_OK
               ? 0
               : -1;
}

/* Providers announce every 30 s (proto/upsquad/internal/v1/tool.proto): a tool not heard of
 * for three periods is considered unmounted. */
#define ANNOUNCE_TTL_MS (90 * 1000)

static void take_announce(wf_engine *e, const void *data, int len) {
    Upsquad__Internal__V1__ToolAnnounce *a =
        upsquad__internal__v1__tool_announce__unpack(NULL, (size_t)len, data);
    if (!a) return;
    int64_t now = wf_now_ms();
    pthread_mutex_lock(&e->tools_mu);
    for (size_t i = 0; i < a->n_tools; i++) {
        const char *t = a->tools[i]->tool;
        int k = 0;
        while (k < e->n_announced && strcmp(e->announced[k], t))
            k++;
        if (k == e->n_announced) {
            if (k == 64 || strlen(t) >= sizeof e->announced[0]) continue; /* bounded */
            snprintf(e->announced[k], sizeof e->announced[k], "%s", t);
            e->n_announced++;
        }
        e->announced_at[k] = now;
    }
    pthread_mutex_unlock(&e->tools_mu);
    protobuf_c_message_free_unpacked(&a->base, NULL);
}

static void on_announce(bus *b, natsMsg *m, void *ud) {
    (void)b;
    if (natsMsg_GetDataLength(m) > 0)
        take_announce(ud, natsMsg_GetData(m), natsMsg_GetDataLength(m));
}

int wf_tool_mounted(wf_engine *e, const char *tool) {
    int64_t now = wf_now_ms();
    int mounted = 0;
    pthread_mutex_lock(&e->tools_mu);
    for (int k = 0; k < e->n_announced; k++)
        if (!strcmp(e->announced[k], tool)) mounted = now - e->announced_at[k] < ANNOUNCE_TTL_MS;
    if (e->n_announced == 0) mounted = 1;
    pthread_mutex_unlock(&e->tools_mu);
    return mounted;
}

static const char *const wf_end_status[3] = {"completed", "failed", "cancelled"};

static void metrics(wf_engine *e) {
    e->m_transitions =
        metrics_counter("workflow_engine_transitions_total", "action transitions committed", NULL);
    e->m_runs_started = metrics_counter("workflow_engine_runs_started_total", "runs created", NULL);
    e->m_runs_finished =
        metrics_counter("workflow_engine_runs_finished_total", "runs that reached an end", NULL);
    e->m_tool_calls = metrics_counter("workflow_engine_tool_requests_total",
                                      "tool requests sent (retries included)", NULL);
    e->m_tool_batches = metrics_counter("workflow_engine_tool_batches_total",
                                        "batch requests of a tick's calls to one tool "
                                        "(tool.batch.<tool>)",
                                        NULL);
    e->m_tool_failures = metrics_counter("workflow_engine_tool_failures_total",
                                         "tool steps whose every attempt failed", NULL);
    e->m_published =
        metrics_counter("workflow_engine_outbox_published_total", "outbox rows published", NULL);
    e->m_outbox_lag = metrics_gauge(
        "workflow_engine_outbox_lag_seconds",
        "age of the oldest unpublished outbox row, as the replica holding the relay saw it at its "
        "last round (0 on the other replicas: alert on the max)",
        NULL);
    e->m_pending_gates = metrics_gauge(
        "workflow_engine_pending_approvals",
        "human gates (approvals, prompts, questions; runs' and agent sessions') waiting for a "
        "decision, all orgs, read every UPSQUAD_WF_SCHEDULE_POLL",
        NULL);
    e->m_oldest_gate = metrics_gauge("workflow_engine_oldest_pending_approval_seconds",
                                     "age of the oldest of those gates (0 when none)", NULL);
    static const double group_buckets[] = {1, 2, 4, 8, 16, 32, 64, 128, 256};
    e->m_group_runs =
        metrics_histogram("workflow_engine_tick_group_runs",
                          "runs ticked by one committed interpreter transaction (group commit)",
                          NULL, group_buckets, sizeof group_buckets / sizeof group_buckets[0]);
    static const double round_buckets[] = {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                           0.1,   0.25,   0.5,   1,    5};
    const size_t n_round = sizeof round_buckets / sizeof round_buckets[0];
    e->m_tick_seconds =
        metrics_histogram("workflow_engine_tick_seconds",
                          "one interpreter transaction (a group's ticks), begin to commit", NULL,
                          round_buckets, n_round);
    e->m_tool_round_seconds =
        metrics_histogram("workflow_engine_tool_round_seconds",
                          "a group's tool requests between two of its ticks, first sent to last "
                          "answered (what a run triggered meanwhile waits for, with the tick)",
                          NULL, round_buckets, n_round);
    e->m_group_fallbacks = metrics_counter(
        "workflow_engine_tick_group_fallbacks_total",
        "group transactions that failed and were ticked again one run at a time", NULL);
    /* seconds to a day: a run is a tool call or two, or waits on people for hours */
    static const double run_buckets[] = {0.1, 0.5, 1, 5, 15, 60, 300, 900, 3600, 14400, 86400};
    for (int i = 0; i < 3; i++) {
        char l[32];
        snprintf(l, sizeof l, "status=\"%s\"", wf_end_status[i]);
        e->m_ended[i] = metrics_counter("workflow_engine_runs_ended_total",
                                        "runs that ended, by final status", l);
        e->m_run_seconds[i] =
            metrics_histogram("workflow_engine_run_duration_seconds",
                              "time from a run's start to its end, by final status", l, run_buckets,
                              sizeof run_buckets / sizeof run_buckets[0]);
    }
}

void wf_engine_run_ended(wf_engine *e, const char *status, int64_t started_ms) {
    for (int i = 0; i < 3; i++) {
        if (strcmp(status, wf_end_status[i]) != 0) continue;
        metric_inc(e->m_ended[i]);
        if (started_ms > 0) {
            int64_t ms = wf_now_ms() - started_ms;
            metric_observe(e->m_run_seconds[i], ms > 0 ? (double)ms / 1000.0 : 0.0);
        }
    }
}

int wf_engine_start(wf_engine *e, const wf_config *cfg, char *err, size_t errlen) {
    char host[64] = "localhost";
    db_pool_opts po;
    bus_opts bo;
    memset(e, 0, sizeof *e);
    e->cfg = cfg;
    wf_expr_max_rendered = (size_t)cfg->max_rendered; /* before any interpreter thread */
    pthread_mutex_init(&e->mu, NULL);
    util_cond_init_monotonic(&e->cv);
    util_cond_init_monotonic(&e->relay_cv);
    util_cond_init_monotonic(&e->sched_cv);
    pthread_mutex_init(&e->tools_mu, NULL);
    gethostname(host, sizeof host - 1);
    char u[37];
    ids_uuid_v4(u);
    snprintf(e->instance, sizeof e->instance, "%s:%d:%.8s", host, (int)getpid(), u);
    metrics(e);
    page_key(e);
    defn_options dopts = {.gate_enabled = catalog_gate, .gate_arg = (void *)cfg};
    if (defn_ctx_load(cfg->schema_file, cfg->catalog_file, &dopts, &e->defn, err, errlen) !=
        DEFN_OK)
        goto fail;
    db_pool_opts_default(&po);
    po.size = (int)cfg->pg_pool_size;
    po.application_name = "workflow-engine";
    if (db_pool_open_ex(cfg->pg_dsn, &po, &e->pool, err, errlen) != DB_OK) goto fail;
    if (set(cfg->migrations_dir)) {
        int applied = 0;
        if (db_migrate_as(e->pool, cfg->pg_migrate_dsn, WF_SCHEMA, cfg->migrations_dir, &applied,
                          err, errlen) != DB_OK)
            goto fail;
        if (applied) log_info("engine.migrated", "%d migration(s) applied", applied);
    }
    bus_opts_default(&bo);
    if (bus_connect_ex(cfg->nats_url, e->instance, &bo, &e->bus, err, errlen) != BUS_OK) goto fail;
    if (streams(e, err, errlen)) goto fail;
    if (bus_subscribe(e->bus, SUBJ_TOOL_ANNOUNCE, NULL, on_announce, e, &e->announce_sub, err,
                      errlen) != BUS_OK)
        goto fail;
    natsMsg *reply = NULL; /* ask the providers already running (one answers now, all in 30 s) */
    if (bus_request(e->bus, SUBJ_TOOL_ANNOUNCE, "", 0, 500, &reply) == BUS_OK) {
        take_announce(e, natsMsg_GetData(reply), natsMsg_GetDataLength(reply));
        natsMsg_Destroy(reply);
    }
    e->n_workers = (int)cfg->workers;
    e->workers = calloc((size_t)e->n_workers, sizeof *e->workers);
    for (int i = 0; i < e->n_workers; i++)
        if (pthread_create(&e->workers[i], NULL, wf_interp_thread, e) != 0) {
            e->n_workers = i;
            util_errf(err, errlen, -1, "cannot start interpreter threads");
            goto fail;
        }
    if (pthread_create(&e->relay, NULL, wf_relay_thread, e) == 0) e->relay_started = 1;
    if (pthread_create(&e->results, NULL, wf_results_thread, e) == 0) e->results_started = 1;
    if (pthread_create(&e->scheduler, NULL, wf_scheduler_thread, e) == 0) e->scheduler_started = 1;
    /* named for top -H / perf (at most 15 characters) */
    for (int i = 0; i < e->n_workers; i++)
        pthread_setname_np(e->workers[i], "wf-interp");
    if (e->relay_started) pthread_setname_np(e->relay, "wf-relay");
    if (e->results_started) pthread_setname_np(e->results, "wf-results");
    if (e->scheduler_started) pthread_setname_np(e->scheduler, "wf-scheduler");
    if (!e->relay_started || !e->results_started || !e->scheduler_started) {
        util_errf(err, errlen, -1, "cannot start engine threads");
        goto fail;
    }
    log_info("engine.started", "instance=%s workers=%d", e->instance, e->n_workers);
    return 0;
fail:
    wf_engine_stop(e);
    return -1;
}

void wf_engine_stop(wf_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->stop = 1;
    pthread_cond_broadcast(&e->cv);
    pthread_cond_broadcast(&e->relay_cv);
    pthread_cond_broadcast(&e->sched_cv);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < e->n_workers; i++)
        pthread_join(e->workers[i], NULL);
    free(e->workers);
    e->workers = NULL;
    e->n_workers = 0;
    if (e->relay_started) pthread_join(e->relay, NULL);
    if (e->results_started) pthread_join(e->results, NULL);
    if (e->scheduler_started) pthread_join(e->scheduler, NULL);
    e->relay_started = e->results_started = e->scheduler_started = 0;
    bus_unsubscribe(e->announce_sub);
    e->announce_sub = NULL;
    bus_pull_close(e->result_sub);
    e->result_sub = NULL;
    bus_close(e->bus);
    e->bus = NULL;
    db_pool_close(e->pool);
    e->pool = NULL;
    defn_ctx_free(e->defn);
    e->defn = NULL;
}
