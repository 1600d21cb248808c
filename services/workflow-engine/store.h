/* Every SQL statement of the workflow engine (schema workflow_engine, migrations/).
 *
 * Tenant work runs in transactions scoped with SET LOCAL app.org_id and app.member_id
 * (st_begin); the row-level security policies of every table confine each statement to the
 * org. Service work (claiming runs, relaying the outbox, firing schedules) runs in
 * transactions that set app.service = 'on', which only the id-and-timer tables admit
 * (st_begin_service).
 *
 * Reads return a PGresult (caller PQclears) whose columns are listed next to each function
 * (the *_COL enums). Timestamps come back as integer milliseconds since the epoch (NULL: "").
 * Functions return DB_OK or a DB_E* code with err. */
#ifndef WF_STORE_H
#define WF_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "db.h"

int st_begin(db_pool *p, const char *org_id, const char *member_id, db_tx **out, char *err,
             size_t errlen);
/* The same with DB_TX_* flags: reads that return several result sets (a run and its actions,
 * a count and a page) use DB_TX_REPEATABLE_READ | DB_TX_READ_ONLY, one consistent snapshot. */
int st_begin_ex(db_pool *p, const char *org_id, const char *member_id, int flags, db_tx **out,
                char *err, size_t errlen);
#define ST_SNAPSHOT (DB_TX_REPEATABLE_READ | DB_TX_READ_ONLY)
int st_begin_service(db_pool *p, db_tx **out, char *err, size_t errlen);
/* The same with DB_TX_* flags (DB_TX_PIPELINE: the engine's own loops, see db.h). */
int st_begin_service_ex(db_pool *p, int flags, db_tx **out, char *err, size_t errlen);
/* Switches an open service transaction to one org (for work found by a service scan). */
int st_scope_org(db_tx *tx, const char *org_id, char *err, size_t errlen);

/* Column helpers: "" for NULL. */
const char *st_s(const PGresult *r, int row, int col);
int64_t st_i(const PGresult *r, int row, int col);
double st_d(const PGresult *r, int row, int col);
int st_b(const PGresult *r, int row, int col);
int st_null(const PGresult *r, int row, int col);

/* ---- workflows: rows in WF_* columns ---- */
enum {
    WF_ID,
    WF_ORG,
    WF_TEAM,
    WF_NAME,
    WF_DESC,
    WF_DEF,
    WF_CREATED_BY,
    WF_STATUS,
    WF_CREATED_AT,
    WF_DELETED_AT,
    WF_TRIGGER_TYPE,
    WF_ENABLED,
    WF_UPDATED_AT,
    WF_VISIBILITY,
    WF_TRIGGER_CONFIG,
    WF_CLASSIFICATION,
    WF_NCOLS
};
int st_wf_insert(db_tx *tx, const char *id, const char *org, const char *team, const char *name,
                 const char *desc, const char *def_json, const char *created_by,
                 const char *visibility, PGresult **out, char *err, size_t errlen);
/* A live (not deleted) workflow the member may see (team workflows: the org; private: owner).
 * Zero rows when absent. */
int st_wf_get(db_tx *tx, const char *id, const char *member, int lock, PGresult **out, char *err,
              size_t errlen);
/* The same visibility, only what starting a run needs (WD_* columns): no run statistics, so
 * its cost does not grow with the workflow's runs. */
enum { WD_STATUS, WD_DEF };
int st_wf_def(db_tx *tx, const char *id, const char *member, PGresult **out, char *err,
              size_t errlen);
int st_wf_list(db_tx *tx, const char *member, const char *team, const char *status, int limit,
               int offset, PGresult **out, int *total, char *err, size_t errlen);
int st_wf_update_def(db_tx *tx, const char *id, const char *def_json, PGresult **out, char *err,
                     size_t errlen);
int st_wf_update_status(db_tx *tx, const char *id, const char *status, PGresult **out, char *err,
                        size_t errlen);
int st_wf_set_trigger(db_tx *tx, const char *id, int enabled, const char *trigger_type,
                      const char *trigger_config, PGresult **out, char *err, size_t errlen);
/* Any workflow of the org by id, deleted or private included (the scheduler's view). */
int st_wf_row(db_tx *tx, const char *id, PGresult **out, char *err, size_t errlen);
/* *deleted 0: it was already deleted. */
int st_wf_delete(db_tx *tx, const char *id, int *deleted, char *err, size_t errlen);
/* Every run of the workflow (column 0: id), ordered by id, locked (FOR UPDATE). */
int st_wf_run_ids(db_tx *tx, const char *wf, PGresult **out, char *err, size_t errlen);

/* ---- schedules ---- */
int st_schedule_put(db_tx *tx, const char *wf, const char *org, const char *spec_json,
                    int64_t next_fire_ms, char *err, size_t errlen);
int st_schedule_drop(db_tx *tx, const char *wf, char *err, size_t errlen);
/* Service: one due schedule, locked (SKIP LOCKED). Columns: workflow_id, org_id, spec,
 * next_fire_at ms. */
int st_schedule_due(db_tx *tx, PGresult **out, char *err, size_t errlen);
int st_schedule_advance(db_tx *tx, const char *wf, int64_t next_fire_ms, char *err, size_t errlen);
/* 1 when the firing (wf, slot) was new, 0 when another replica already fired it. */
int st_firing_insert(db_tx *tx, const char *org, const char *wf, int64_t slot_ms,
                     const char *run_id, int *inserted, char *err, size_t errlen);
/* Next minute strictly after after_ms whose wall-clock fields in time zone tz are in the
 * given sets (Postgres arrays as text, "{0,15,30}"); -1 when none within 400 days. Returns
 * DB_ERR for an unknown time zone. */
int st_cron_next(db_pool *p, const char *mins, const char *hours, const char *doms,
                 const char *months, const char *dows, int dom_star, int dow_star, const char *tz,
                 int64_t after_ms, int64_t *next_ms, char *err, size_t errlen);

/* ---- audit and logs ---- */
int st_audit(db_tx *tx, const char *org, const char *member, const char *subject,
             const char *action, const char *reason, char *err, size_t errlen);
int st_log(db_tx *tx, const char *org, const char *run, const char *action_id, const char *level,
           const char *message, char *err, size_t errlen);

/* ---- runs ---- */
/* trace: the creating call's trace id (NULL: none), kept for the run's later work. */
int st_run_insert(db_tx *tx, const char *id, const char *org, const char *wf,
                  const char *triggered_by, const char *context_json, const char *def_json,
                  const char *trace, char *err, size_t errlen);
/* Per-org admission of a new run: serialises the org's triggers on a transaction-scoped
 * advisory lock (so concurrent triggers cannot all pass one count), then counts its pending and
 * running runs (*active) and the runs it started in the last second (*recent). */
int st_org_admission(db_tx *tx, const char *org, long long *active, long long *recent, char *err,
                     size_t errlen);
/* Claims an idempotency key for run_id (a new key, or one older than the 24-hour window).
 * *claimed 1: run_id is the key's run now; 0: the key names a live earlier run, returned in
 * prior (37 bytes) with *same 1 when that run is of workflow wf with this trigger context.
 * A concurrent claim of the same key waits for the first transaction (primary key). */
int st_trigger_key_claim(db_tx *tx, const char *org, const char *key, const char *run_id,
                         const char *wf, const char *context_json, int *claimed, char *prior,
                         int *same, char *err, size_t errlen);
/* The run with its workflow's scope, for the interpreter and run control. lock: FOR UPDATE.
 * Zero rows when absent (or another org's: RLS). */
enum {
    RL_ID,
    RL_ORG,
    RL_WF,
    RL_TRIGGERED_BY,
    RL_STATUS,
    RL_CONTEXT,
    RL_DEF,
    RL_DISPLAY,
    RL_SEQ,
    RL_COST,
    RL_STARTED_AT,
    RL_COMPLETED_AT,
    RL_WF_NAME,
    RL_TEAM,
    RL_VISIBILITY,
    RL_OWNER,
    RL_CLASSIFICATION,
    RL_WF_DELETED,
    RL_TRACE,
    RL_ACTIONS, /* actions the run has (the run budget) */
    RL_NCOLS
};
int st_run_load(db_tx *tx, const char *run_id, int lock, PGresult **out, char *err, size_t errlen);
/* A tick's three reads queued on a pipelined transaction (DB_EINVAL when tx is not) without a
 * sync, in the lock order of every tick: the run locked (st_run_load, RL_*), the lease fenced
 * (st_queue_fence: *fence has a row when the lease is held), the run's actions as a tick needs
 * them (st_actions_load, IA_*). A group tick sends every run's reads, each behind its own org
 * scope, and flushes once (db_pipe_flush); the slots fill at the flush (caller PQclears). */
int st_tick_head_send(db_tx *tx, const char *run, const char *owner, int64_t lease_ms,
                      PGresult **run_row, PGresult **fence, PGresult **acts, char *err,
                      size_t errlen);
/* WorkflowRun rows (RUN_* columns), node counts populated. */
enum {
    RUN_ID,
    RUN_WF,
    RUN_ORG,
    RUN_TRIGGERED_BY,
    RUN_STATUS,
    RUN_CONTEXT,
    RUN_STARTED_AT,
    RUN_COMPLETED_AT,
    RUN_CREATED_AT,
    RUN_COST,
    RUN_PAUSED_AT,
    RUN_CANCELLED_AT,
    RUN_TOTAL,
    RUN_DONE,
    RUN_DISPLAY,
    RUN_WF_NAME,
    RUN_PROMPT_KIND,
    RUN_OPEN_PROMPTS,
    RUN_WAITING,
    RUN_STARTED_US,
    RUN_CLASS, /* the workflow's data_classification (redaction floor) */
    RUN_NCOLS
};
int st_run_row(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen);
/* What a run status event needs: one row of RC_* columns. */
enum { RC_TOTAL, RC_DONE, RC_COST, RC_STARTED_AT, RC_COMPLETED_AT };
int st_run_counts(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen);
/* Keyset page (started_at DESC, id DESC) after cursor (after_us, after_id; after_id NULL: from
 * the newest). wf NULL: across workflows, limited to the member's visible ones (teams: Postgres
 * array text). statuses: array text or NULL for all. Returns limit + 1 rows at most. */
int st_run_page(db_tx *tx, const char *wf, const char *member, const char *teams,
                const char *statuses, const char *after_us, const char *after_id, int limit,
                PGresult **out, char *err, size_t errlen);
/* Sets the run's status and its timestamps (completed_at on a terminal status, paused_at on
 * paused, cleared on running, cancelled_at on cancelled), reason, and event_seq. */
int st_run_set_status(db_tx *tx, const char *run_id, const char *status, const char *reason,
                      char *err, size_t errlen);
int st_run_set_seq(db_tx *tx, const char *run_id, int64_t seq, char *err, size_t errlen);
int st_run_add_cost(db_tx *tx, const char *run_id, double cost, char *err, size_t errlen);

/* ---- actions (store_actions.c) ---- */
/* WorkflowAction rows, ordered (created_at, iteration, id). */
enum {
    AC_ID,
    AC_RUN,
    AC_ORG,
    AC_STEP,
    AC_AGENT,
    AC_STATUS,
    AC_INPUT,
    AC_OUTPUT,
    AC_DECIDED_BY,
    AC_DECIDED_AT,
    AC_CREATED_AT,
    AC_APPROVAL,
    AC_COST,
    AC_ELAPSED,
    AC_BLOCKED_BY,
    AC_ITERATION,
    AC_TYPE,
    AC_CLASS, /* the run's workflow data_classification (redaction floor) */
    AC_NCOLS
};
int st_actions_of(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen);
int st_action_get(db_tx *tx, const char *run_id, const char *action_id, PGresult **out, char *err,
                  size_t errlen);
/* The interpreter's view of every action of a run (IA_* columns), in creation order. */
enum {
    IA_ID,
    IA_STEP,
    IA_TYPE,
    IA_LAP,
    IA_ITERATION,
    IA_STATUS,
    IA_ATTEMPT,
    IA_KEY,
    IA_INPUT,
    IA_OUTPUT,
    IA_RESULT,
    IA_FEEDBACK,
    IA_POLLS,
    IA_DEADLINE,
    IA_NEXT_POLL,
    IA_COST,
    IA_BLOCKED,
    IA_STARTED,
    IA_APPROVAL,
    IA_NCOLS
};
/* A tick's view of a run's actions (IA_*): the latest lap of each step of its definition, in
 * creation order; not every action of a long run. */
int st_actions_load(db_tx *tx, const char *run_id, PGresult **out, char *err, size_t errlen);
typedef struct st_action_w {
    const char *id, *org, *run, *step, *type, *lap;
    int iteration;
    const char *status;
    int attempt;
    const char *key, *input, *output, *feedback, *blocked_by, *approval_id, *agent_id;
    int polls;
    int64_t deadline_ms, next_poll_ms; /* 0: NULL */
    int clear_result;
    int started;  /* stamp started_at now (when NULL) */
    int finished; /* stamp finished_at now */
    double add_cost;
    int64_t add_in_tokens, add_out_tokens;
} st_action_w;
int st_action_insert(db_tx *tx, const st_action_w *a, char *err, size_t errlen);
int st_action_update(db_tx *tx, const st_action_w *a, char *err, size_t errlen);
/* Records an outcome for the current attempt (idempotency key) of an in-progress action once;
 * *applied = 0 when it was not in progress, a different attempt, or already recorded. */
int st_action_put_result(db_tx *tx, const char *action_id, const char *key, const char *result_json,
                         int *applied, char *err, size_t errlen);
int st_governance_insert(db_tx *tx, const char *id, const char *org, const char *run,
                         const char *action, const char *kind, int clearance, const char *spec_json,
                         char *err, size_t errlen);

/* Marks one governance row expired (its gate's timeout fired). */
int st_governance_expire(db_tx *tx, const char *id, char *err, size_t errlen);
/* Closes the run's open governance rows (the run was cancelled or failed). */
int st_governance_close(db_tx *tx, const char *run, char *err, size_t errlen);

/* ---- external events (store_actions.c) ---- */
int st_delivery_insert(db_tx *tx, const char *org, const char *run, const char *key,
                       const char *delivery, const char *payload_json, int *inserted, char *err,
                       size_t errlen);
/* Consumes the oldest buffered delivery on key for action; *payload (malloc'd JSON text) NULL
 * when there is none. */
int st_delivery_take(db_tx *tx, const char *run, const char *key, const char *action_id,
                     char **payload, char *err, size_t errlen);

/* ---- run queue (leases; store_queue.c) ---- */
int st_queue_insert(db_tx *tx, const char *run, const char *org, char *err, size_t errlen);
int st_queue_wake(db_tx *tx, const char *run, char *err, size_t errlen);
int st_queue_delete(db_tx *tx, const char *run, char *err, size_t errlen);
/* Service: leases up to limit due runs whose lease is free or expired. Columns: run_id,
 * org_id, wake_gen. */
int st_queue_claim(db_tx *tx, const char *owner, int64_t lease_ms, int limit, PGresult **out,
                   char *err, size_t errlen);
/* 1 when owner still holds the lease (and extends it), 0 when it was lost. */
int st_queue_fence(db_tx *tx, const char *run, const char *owner, int64_t lease_ms, int *held,
                   char *err, size_t errlen);
/* Frees the lease: the run sleeps until wake_ms (0: until woken), unless it was woken since
 * gen was read. */
int st_queue_release(db_tx *tx, const char *run, const char *owner, int64_t gen, int64_t wake_ms,
                     char *err, size_t errlen);

/* Service: the pending human gates of every org (pending_gates, migration 011): how many, and
 * the age of the oldest in seconds (0 when none; store_gates.c). */
int st_pending_gates(db_tx *tx, int64_t *n, double *oldest_s, char *err, size_t errlen);

/* ---- outbox (store_queue.c) ---- */
/* The run's new event_seq and its outbox rows at once; subjects, msg_ids: Postgres text[]
 * literals; payloads: text[] of hex. */
int st_events_put(db_tx *tx, const char *org, const char *run, int64_t seq, const char *subjects,
                  const char *msg_ids, const char *payloads_hex, const char *trace, char *err,
                  size_t errlen);
/* One outbox row; trace: the trace id it is published under ("" none). */
int st_outbox_put(db_tx *tx, const char *org, const char *subject, const char *msg_id,
                  const void *payload, size_t len, const char *trace, char *err, size_t errlen);
/* Service: the oldest rows (id, subject, msg_id, payload, trace_id, age_ms; binary), under the
 * relay's advisory lock (*locked 0: another replica relays now, no rows). */
int st_outbox_fetch(db_tx *tx, int limit, int *locked, PGresult **out, char *err, size_t errlen);
/* Deletes the published rows; ids as a Postgres array text "{1,2,3}". */
int st_outbox_delete(db_tx *tx, const char *ids, char *err, size_t errlen);

/* ---- agent step bookkeeping (store_actions.c; migrations/004_agent_steps.sql) ---- */

typedef struct st_agent_state {
    int retries, resumes;
    char tool_call_id[128];
    uint8_t *checkpoint; /* heap (caller frees with st_agent_state_clear); NULL: no open ask */
    size_t checkpoint_len;
    char *answer; /* heap; NULL: not resumed */
    int gated; /* the checkpoint is an approval interrupt's (012_agent_gates.sql), not an ask's */
} st_agent_state;
void st_agent_state_clear(st_agent_state *s);
/* The action's row; all zero when it has none. */
int st_agent_state_get(db_tx *tx, const char *action_id, st_agent_state *out, char *err,
                       size_t errlen);
/* Takes one retry when fewer than max were taken: *taken = the retry's number (1..max), 0 when
 * the retries are exhausted. */
int st_agent_retry_take(db_tx *tx, const char *org, const char *run, const char *action_id, int max,
                        int *taken, char *err, size_t errlen);
/* Records the frozen turn of an ask, or (gated) the frozen checkpoint of an approval
 * interrupt, replacing an earlier one; the answer is cleared. */
int st_agent_ask_put(db_tx *tx, const char *org, const char *run, const char *action_id,
                     const char *tool_call_id, const uint8_t *checkpoint, size_t len, int gated,
                     char *err, size_t errlen);
/* Counts a resumed attempt; answer_json (NULL ok) is the AskUserResume.answer_tool_result. */
int st_agent_resume_put(db_tx *tx, const char *org, const char *run, const char *action_id,
                        const char *answer_json, char *err, size_t errlen);
/* The step ended: the frozen turn and its answer are dropped. */
int st_agent_ask_clear(db_tx *tx, const char *action_id, char *err, size_t errlen);

/* ---- human gates (gates.c; store_gates.c) ---- */
/* One governance row with its run and action context (GT_* columns). by_action: id is the
 * action's id (its newest row); lock: FOR UPDATE of the row. No row: not in the tx's org. */
enum {
    GT_ID,
    GT_ORG,
    GT_RUN,
    GT_ACTION,
    GT_KIND,
    GT_STATUS,
    GT_CLEARANCE,
    GT_SPEC,
    GT_CREATED,
    GT_EXPIRES,
    GT_DECIDED_BY,
    GT_DECIDED_AT,
    GT_ANSWER,
    GT_COMMENT,
    GT_ESCALATIONS,
    GT_TRIGGERED_BY,
    GT_DEADLINE,
    GT_ACT_STATUS,
    GT_ACT_OUTPUT,
    GT_ASKED_ROLE,
    GT_ASKED_AGENT,
    GT_WF_NAME,
    GT_APPROVERS, /* JSON array of the member ids who approved (N of M) */
    /* an agent session's row (run_id, action_id ""; GT_TRIGGERED_BY is its requested_by and
     * GT_ASKED_AGENT its agent); "" on a run's */
    GT_SESSION,
    GT_AGENT,
    GT_TOOL,
    GT_TOOL_CALL,
    GT_KEY,
    GT_LAPSED, /* "t" when expires_at has passed */
    GT_NCOLS
};
int st_gate_get(db_tx *tx, const char *id, int by_action, int lock, PGresult **out, char *err,
                size_t errlen);
/* First write wins: moves a pending row to status; *won 0 when it was no longer pending. */
int st_gate_decide(db_tx *tx, const char *id, const char *status, const char *member,
                   const char *answer_json, const char *comment, int *won, char *err,
                   size_t errlen);
int st_gate_escalate(db_tx *tx, const char *id, int floor, const char *comment, char *err,
                     size_t errlen);
/* A gate's on_timeout "escalate": raises a pending row's floor by step, at most to cap, and
 * counts the escalation; *floor is the floor after (0 when the row was no longer pending). */
int st_gate_escalate_by(db_tx *tx, const char *id, int step, int cap, const char *comment,
                        int *floor, char *err, size_t errlen);
int st_action_decided(db_tx *tx, const char *action_id, const char *member, char *err,
                      size_t errlen);
/* AC_* rows of the actions in ids (a Postgres uuid[] literal). */
int st_actions_by_ids(db_tx *tx, const char *ids, PGresult **out, char *err, size_t errlen);
/* Pending gates this member may decide: (action id, workflow name, total, session) rows; a
 * session's row (session "t") gives its own id as the action id and "" as the name. */
int st_gate_pending(db_tx *tx, const char *member, int clearance, const char *agent, int limit,
                    int offset, PGresult **out, char *err, size_t errlen);
/* N of M: adds member to the pending row's approvers; *added 0 when already counted. */
int st_gate_vote(db_tx *tx, const char *id, const char *member, int *added, char *err,
                 size_t errlen);
/* GT_* rows of the governance rows in ids (a Postgres uuid[] literal). */
int st_gate_get_many(db_tx *tx, const char *ids, PGresult **out, char *err, size_t errlen);

/* ---- agent sessions' approvals (store_approvals.c; migrations/010_session_approvals.sql) ---- */
typedef struct st_session_gate {
    const char *id, *org, *session, *agent, *kind, *tool, *tool_call_id, *requested_by, *key;
    const uint8_t *intent;
    size_t intent_len;
    int clearance;
    const char *spec_json;
    int64_t timeout_s;
} st_session_gate;
/* Opens the row and its expiry timer unless (org, session, key) has one: *created 0 and
 * id_out (37 bytes) the existing row's id. A concurrent open of the same key waits for the
 * first transaction (unique index) and then finds its row. */
int st_session_gate_open(db_tx *tx, const st_session_gate *g, int *created, char *id_out, char *err,
                         size_t errlen);
/* The row's pending_tool_intent (*out malloc'd, caller frees; NULL and 0 when none). */
int st_session_gate_intent(db_tx *tx, const char *id, uint8_t **out, size_t *len, char *err,
                           size_t errlen);
int st_approval_timer_delete(db_tx *tx, const char *id, char *err, size_t errlen);
/* Service: up to limit due timers (approval_id, org_id), oldest first, not locked: each is
 * fired in a transaction that locks its governance row first, the order of every decision. */
int st_approval_timer_due(db_tx *tx, int limit, PGresult **out, char *err, size_t errlen);

/* (run_id, status) of one action of the tx's org; no row: not in it. */
int st_action_brief(db_tx *tx, const char *action_id, PGresult **out, char *err, size_t errlen);

#endif
