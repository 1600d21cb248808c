/* Every SQL statement of the orchestrator (schema orchestrator, migrations/).
 *
 * Each function opens its own transaction scoped to one org (db_tx_begin sets app.org_id, and
 * the row-level security policies confine every statement to it), except the two worker paths
 * (heartbeat, checkpoint) which first read the session's org from session_directory. Every
 * state change of a session appends to its hash-chained audit log in the same transaction.
 * Return codes: DB_OK, ORCH_ENOTFOUND, or a DB_E* code with err filled. */
#ifndef UPSQUAD_ORCH_STORE_H
#define UPSQUAD_ORCH_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "db.h"

enum { ORCH_ENOTFOUND = 1, ORCH_ECONFLICT = 2, ORCH_EREPLAY = 3, ORCH_ESTATE = 4, ORCH_EGATED = 5 };

/* ---- agents and keys ---- */
typedef struct orch_agent_row {
    char agent_id[37];
    char role[65];
    char display_name[129];
    char model[97];
    char *definition; /* JSON text, heap: caller frees */
    char updated_at[40];
} orch_agent_row;

int orch_store_agent_upsert(db_pool *p, const char *org, const char *agent_id, const char *role,
                            const char *display_name, const char *model, const char *def_json,
                            int *created, char *err, size_t errlen);
int orch_store_agent_get(db_pool *p, const char *org, const char *agent_id, orch_agent_row *out,
                         char *err, size_t errlen);
int orch_store_agent_by_role(db_pool *p, const char *org, const char *role, orch_agent_row *out,
                             char *err, size_t errlen);
/* Calls fn for each agent of org, ordered by role. */
int orch_store_agent_list(db_pool *p, const char *org,
                          void (*fn)(const orch_agent_row *r, void *ud), void *ud, char *err,
                          size_t errlen);

typedef struct orch_key_row {
    char provider[33];
    char kid[65];
    unsigned char nonce[12];
    unsigned char *ct; /* heap */
    size_t ctlen;
} orch_key_row;

int orch_store_key_set(db_pool *p, const char *org, const char *provider, const char *kid,
                       const unsigned char *nonce, const unsigned char *ct, size_t ctlen, char *err,
                       size_t errlen);
/* *rows (heap array, each ct heap): orch_store_keys_free. */
int orch_store_keys_get(db_pool *p, const char *org, orch_key_row **rows, size_t *n, char *err,
                        size_t errlen);
void orch_store_keys_free(orch_key_row *rows, size_t n);

/* ---- sessions ---- */
typedef struct orch_session {
    char session_id[37], org_id[37], agent_id[37];
    char user_id[129];
    char state[16];
    int agent_status;
    int execution_mode;
    char model_id[97];
    char snapshot_hash[65];
    int loop_count, max_loops, turns;
    int64_t started_ms, last_heartbeat_ms; /* last_heartbeat_ms 0: none */
    char worker[128];                      /* the worker of its last turn */
    unsigned char *snapshot; /* packed SessionSnapshot, heap (NULL when not asked for) */
    size_t snapshot_len;
} orch_session;

void orch_session_clear(orch_session *s);

typedef struct orch_session_new {
    const char *session_id, *org_id, *user_id, *agent_id, *model_id, *snapshot_hash, *kind;
    const char *worker; /* initialised on (NULL: none) */
    int execution_mode, max_loops, agent_status;
    const unsigned char *snapshot;
    size_t snapshot_len;
} orch_session_new;

/* Inserts the session (state 'active'), its directory row and the session_started audit row
 * (detail: agent, model, snapshot hash). action_id out (37 bytes, may be NULL). */
int orch_store_session_create(db_pool *p, const orch_session_new *n, char *action_id, char *err,
                              size_t errlen);
/* with_snapshot: also read the packed snapshot. */
int orch_store_session_get(db_pool *p, const char *org, const char *session_id, int with_snapshot,
                           orch_session *out, char *err, size_t errlen);

typedef struct orch_list_query {
    const char *agent_id; /* NULL/"": any */
    const char *state;    /* NULL: any; a lifecycle state */
    int agent_status;     /* -1: any */
    int page_size;        /* 1..100 */
    int64_t after_ms;     /* keyset cursor (started_at, session_id), 0 = first page */
    const char *after_id;
} orch_list_query;

/* Sessions newest first. *rows heap (orch_session each without snapshot): free(). *more 1 when
 * another page follows. *total: every match. */
int orch_store_session_list(db_pool *p, const char *org, const orch_list_query *q,
                            orch_session **rows, size_t *n, int *more, int64_t *total, char *err,
                            size_t errlen);

/* Terminates (state 'terminated', ended_at, audit session_terminated with reason). Already
 * terminal: *was_terminal 1 and nothing changes. ORCH_ENOTFOUND when absent. */
int orch_store_session_terminate(db_pool *p, const char *org, const char *session_id,
                                 const char *reason, int *was_terminal, char *final_state,
                                 char *err, size_t errlen);

typedef struct orch_turn {
    int role; /* 1 user, 2 assistant */
    char *text;
} orch_turn;

/* Starts a turn: refuses a terminal or suspended session, and one with a pause pending
 * (ORCH_ESTATE, state in final_state: "pausing" for the latter; "suspended" when nothing
 * counts in flight any more: the pending pause is committed then), reads the newest prior turns
 * (at most max_turns and max_bytes of text in total, oldest first), stores the user turn,
 * counts the turn as in flight for at most timeout_ms (what a pause waits for), audits
 * message_received and gives the turn a lease held by owner (this replica) under the id of
 * that row. *turns heap: orch_turns_free. action_id out: the message_received row (the parent
 * of what the turn does, and its lease). */
int orch_store_turn_begin(db_pool *p, const char *org, const char *session_id, const char *message,
                          int max_turns, size_t max_bytes, int64_t timeout_ms, const char *owner,
                          orch_turn **turns, size_t *n, char *action_id, char *final_state,
                          char *err, size_t errlen);
void orch_turns_free(orch_turn *t, size_t n);

/* A committed pause (PauseSession, or a pending pause committed by a turn's end). */
typedef struct orch_pause {
    int committed; /* orch_turn_end.paused: 1 when this turn's end committed a pause */
    int source;    /* PauseSource number */
    char reason[1025];
    char correlation_id[257];
    char checkpoint_key[64]; /* "<session_id>:<loop_iteration>", "" when none */
    int64_t paused_ms;
} orch_pause;

typedef struct orch_turn_end {
    int ok;                 /* 1 completed, 0 failed */
    const char *final_text; /* ok: the assistant turn stored */
    const char *error_code; /* !ok */
    const char *error_msg;
    int agent_status;
    int loop_iterations;
    /* the session's loop_count when the turn began: the turn ends with at least base +
     * loop_iterations (0 for a fresh session) */
    int loop_base;
    int64_t input_tokens, output_tokens;
    double cost_usd;
    const char *worker;
    int worker_answered; /* the worker streamed events: its liveness is news (last_heartbeat) */
    /* out (NULL: not wanted): a pause pending on the session commits at the end of its last
     * turn in flight, in the same transaction; then filled with committed = 1 */
    orch_pause *paused;
    /* > 0: the turn parks the session (a PauseSource, e.g. APPROVAL on an interrupt): a pause
     * with this source, reason and correlation id is pending from this turn's end */
    int park_source;
    const char *park_reason, *park_correlation;
} orch_turn_end;

int orch_store_turn_end(db_pool *p, const char *org, const char *session_id,
                        const char *parent_action_id, const orch_turn_end *e, char *err,
                        size_t errlen);

/* ---- turn leases (docs/orchestrator.md, "Dead turns"): a chat turn in flight is leased to
 * the replica relaying it, which renews it; a lease not renewed for ttl_ms is reclaimed by any
 * replica ---- */
typedef struct orch_turn_lease {
    char action_id[37]; /* the turn's message_received row */
    char session_id[37];
    char org_id[37];
} orch_turn_lease;

/* renewed_at = now for these leases (the ones this replica holds; an ended one is gone). */
int orch_store_turn_leases_renew(db_pool *p, const char (*action_ids)[37], size_t n, char *err,
                                 size_t errlen);
/* At most max leases not renewed for ttl_ms, the stalest first, of every org. */
int orch_store_turn_leases_stale(db_pool *p, int64_t ttl_ms, size_t max, orch_turn_lease *out,
                                 size_t *n, char *err, size_t errlen);
/* Ends the turn of a lease still stale (in one transaction of its org, the session row locked):
 * the lease goes, the turn stops counting in flight, the status leaves THINKING/ACTING for
 * ERROR when no other turn runs, last_error says why, the turn_reclaimed audit row (child of
 * the turn's message_received), and a pending pause commits when no turn is left in flight.
 * by: this replica. *reclaimed 0: the lease was renewed, ended or reclaimed meanwhile (nothing
 * changes). paused (NULL: not wanted): the committed pause. */
int orch_store_turn_reclaim(db_pool *p, const orch_turn_lease *l, int64_t ttl_ms, const char *by,
                            int *reclaimed, orch_pause *paused, char *err, size_t errlen);

/* Appends an audit row. detail_json: a JSON object text (never secrets). action_id out. */
int orch_store_audit(db_pool *p, const char *org, const char *session_id, const char *type,
                     const char *agent_id, const char *parent_action_id, const char *detail_json,
                     char *action_id, char *err, size_t errlen);
/* Sets the session's AgentStatus as relayed (cheap; no audit; not on a terminated session). */
int orch_store_session_status(db_pool *p, const char *org, const char *session_id, int status,
                              char *err, size_t errlen);

/* ---- worker paths: only_org NULL reaches every org's sessions (a worker's token), else only
 * that org's (ORCH_ENOTFOUND for another's) ---- */
/* Records a heartbeat on the session (last_heartbeat = now). ORCH_ENOTFOUND when unknown. */
int orch_store_heartbeat(db_pool *p, const char *only_org, const char *session_id, char *err,
                         size_t errlen);

/* Upserts a checkpoint; keeps the newest `keep` per session. DB_OK (stored), ORCH_EREPLAY (same
 * hash already stored: nothing changes), ORCH_ECONFLICT (another hash at that key),
 * ORCH_ENOTFOUND (no such session). */
int orch_store_checkpoint(db_pool *p, const char *only_org, const char *session_id,
                          int loop_iteration, uint32_t schema_version, const unsigned char *state,
                          size_t len, const char *sha256_hex, int keep, char *err, size_t errlen);
/* The latest checkpoint (tests, resume). *state heap. ORCH_ENOTFOUND when none. */
int orch_store_checkpoint_latest(db_pool *p, const char *org, const char *session_id,
                                 int *loop_iteration, unsigned char **state, size_t *len, char *err,
                                 size_t errlen);

/* ---- delegation (store_tree.c; docs/orchestrator.md, "Delegation") ---- */
/* Links a child session just created to its parent (depth, root, spawn action) and writes its
 * bridge row (pending); ORCH_ESTATE with err when the depth would exceed max_depth or the
 * parent already made max_children delegations (nothing changes). child NULL: the check only. */
int orch_store_delegation_link(db_pool *p, const char *org, const char *parent, const char *child,
                               const char *role, const char *spawn_action, int max_depth,
                               int max_children, char invocation_id[37], int *depth, char *err,
                               size_t errlen);
/* The bridge row's result: status ok, error, timeout or cancelled (first one stands). */
int orch_store_delegation_done(db_pool *p, const char *org, const char *invocation_id,
                               const char *status, const char *error_code, char *err,
                               size_t errlen);

/* ---- the autonomous loop's plan (store_plan.c; docs/orchestrator.md, "The autonomous loop") */
typedef struct orch_plan {
    char *goal;  /* heap */
    char *todos; /* JSON array text [{"id", "title", "done"}], heap */
    int cursor, cycles, stall;
    char last_hash[65];
    int ended;
    char reason[32];
    char gate[37]; /* the approval a cycle parked on (reason "gate"), "" none */
} orch_plan;
void orch_plan_clear(orch_plan *pl);
/* ORCH_ENOTFOUND when the session never ran autonomously. */
int orch_store_plan_get(db_pool *p, const char *org, const char *session_id, orch_plan *out,
                        char *err, size_t errlen);
/* Stores the plan, raises the session's loop_count to loop_count, and appends an audit row
 * (audit_type NULL: none; detail a JSON object text) in one transaction. */
int orch_store_plan_save(db_pool *p, const char *org, const char *session_id, const orch_plan *pl,
                         int loop_count, const char *audit_type, const char *agent,
                         const char *parent, const char *detail, char *err, size_t errlen);

/* *busy 1 when another turn of the session holds a live lease (not mine, the caller's turn):
 * an autonomous loop runs alone on its session. */
int orch_store_plan_busy(db_pool *p, const char *org, const char *session_id, const char *mine,
                         int64_t ttl_ms, int *busy, char *err, size_t errlen);

/* ---- a chat session parked on a human (store_gates.c; docs/orchestrator.md, "Approvals and
 * prompts on the chat path") ---- */
typedef struct orch_gate_row {
    const char *approval_id; /* the engine's approval (or prompt) id */
    const char *kind;        /* "approval_gate" or "user_prompt" */
    const char *tool, *tool_call_id;
    const char *message;         /* the gated turn's user message */
    const unsigned char *frozen; /* a prompt's InputRequired.checkpoint (borrowed), else NULL */
    size_t frozen_len;
    int clearance;
    const char *holder; /* the replica whose stream will wait on the park (NULL: none) */
} orch_gate_row;

/* Records the gate a turn opened (idempotent by approval id), before its park commits. */
int orch_store_gate_record(db_pool *p, const char *org, const char *session_id,
                           const orch_gate_row *g, char *err, size_t errlen);
/* This replica's stream stopped waiting on the session's park (only its own mark is cleared):
 * a decision is then resumed by whichever replica takes it. */
int orch_store_gate_unhold(db_pool *p, const char *org, const char *session_id, const char *holder,
                           char *err, size_t errlen);

enum {
    ORCH_GATE_UNKNOWN = 0, /* no such gate (another service's approval, or another org's) */
    ORCH_GATE_EARLY = 1,   /* the turn that opened it has not parked yet */
    ORCH_GATE_PARKED = 2,  /* the session waits on it: a resume may take it */
    ORCH_GATE_DONE = 3,    /* taken already, or the session ended */
};
/* Stores an ApprovalDecided (as JSON; the first one stays) on its gate. *where: ORCH_GATE_*;
 * holder: the replica whose stream waits ("" when none); session_id: the gate's session. */
int orch_store_gate_decided(db_pool *p, const char *org, const char *approval_id,
                            const char *decision_json, int *where, char holder[161],
                            char session_id[37], char *err, size_t errlen);

/* What a resume takes (heap members: orch_gate_take_clear). */
typedef struct orch_gate_take {
    char approval_id[37], session_id[37], agent_id[37];
    char kind[16], tool[201], tool_call_id[201];
    char action_id[37];    /* the session_resumed row: the resumed turn's parent and lease */
    char *message;         /* the gated turn's user message */
    char *decision;        /* the ApprovalDecided as JSON */
    unsigned char *frozen; /* a prompt's frozen turn ("" when none) */
    size_t frozen_len;
    orch_turn *turns; /* the turns before the gated one */
    size_t nturns;
    int resumed_loop;
    int64_t resumed_ms;
} orch_gate_take;
void orch_gate_take_clear(orch_gate_take *t);
/* Exactly once per gate: when the session is parked on it and its decision arrived, lifts the
 * park (state active, THINKING, in flight for timeout_ms), marks the gate taken, audits
 * session_resumed and leases the resumed turn to owner. ORCH_ESTATE when not so (taken by
 * another resume, not decided, not parked on it). */
int orch_store_gate_take(db_pool *p, const char *org, const char *approval_id, int max_turns,
                         size_t max_bytes, int64_t timeout_ms, const char *owner,
                         orch_gate_take *out, char *err, size_t errlen);

/* What a stream waiting on a park reads each look. */
typedef struct orch_park_look {
    char state[16];
    int64_t resumed_ms;
    int resumed_loop;
    char ready_gate[37]; /* the park's gate is decided and not taken: resume it */
    char resumed_by[37]; /* the last resume was this gate's decision ("" otherwise) */
} orch_park_look;
int orch_store_park_look(db_pool *p, const char *org, const char *session_id, orch_park_look *out,
                         char *err, size_t errlen);
/* key: the newest checkpoint stored at or after since_ms ("" when none yet). */
int orch_store_checkpoint_since(db_pool *p, const char *org, const char *session_id,
                                int64_t since_ms, char key[64], char *err, size_t errlen);

/* ---- pause, resume, provenance (docs/orchestrator.md, "Pause, resume and provenance") ---- */
enum { ORCH_PAUSED = 0, ORCH_PAUSE_ALREADY = 1, ORCH_PAUSE_PENDING = 2 };

/* Pauses a chat session at a message boundary. No turn in flight: the pause commits now
 * (state suspended, AgentStatus SUSPENDED, checkpoint key, audit session_paused), *outcome
 * ORCH_PAUSED. A turn in flight: the pause is recorded (a pause already pending keeps its
 * reason, source and correlation id) and that turn's end commits it, *outcome
 * ORCH_PAUSE_PENDING: call again to learn when it committed. Already suspended:
 * ORCH_PAUSE_ALREADY. *out holds the committed pause (ORCH_PAUSED / ORCH_PAUSE_ALREADY).
 * ORCH_ESTATE (state in state_out: a terminal state, "initializing", or "step" for a
 * workflow step's session), ORCH_ENOTFOUND. */
int orch_store_pause(db_pool *p, const char *org, const char *session_id, const char *reason,
                     int source, const char *correlation_id, int *outcome, orch_pause *out,
                     char *state_out, char *err, size_t errlen);

/* *pending 1 when a pause waits for the session's turns in flight (a cheap read). */
/* What a stream parked on the session's pause looks at: its lifecycle state (16 bytes), and
 * the last resume's resumed_at (ms) and resumed_at_loop. ORCH_ENOTFOUND when absent. */
int orch_store_park_state(db_pool *p, const char *org, const char *session_id, char *state,
                          int64_t *resumed_ms, int *resumed_loop, char *err, size_t errlen);
/* ended (may be NULL): 1 when the session is over (terminated, error, crashed): an autonomous
 * loop stops at its next boundary. */
int orch_store_pause_pending(db_pool *p, const char *org, const char *session_id, int *pending,
                             int *ended, char *err, size_t errlen);

typedef struct orch_resume {
    int agent_status;    /* the status given back (the one the session had when paused) */
    int resumed_at_loop; /* loop_iteration of the newest checkpoint, 0 when none */
    int64_t resumed_ms;
    char gate[65]; /* ORCH_EGATED: the approval the park waits for (its correlation id) */
} orch_resume;

/* ORCH_EGATED (gate: the approval id) when the session is parked on the approval of a gated
 * tool call its turn raised (interrupt_required): that park is lifted only by the approval's
 * decision, never by ResumeSession (spec InterruptRequired: the orchestrator "routes the pending
 * tool intent through approval.Service"); DB_OK otherwise, ORCH_ENOTFOUND when absent. */
int orch_store_resume_gate(db_pool *p, const char *org, const char *session_id, char gate[65],
                           char *err, size_t errlen);

/* Resumes a suspended session (state active, audit session_resumed with the reason). With
 * operator_input (compact JSON text, NULL: none) a system-tagged turn is stored, the newest of
 * the next turn's prior_turns. ORCH_ESTATE (state in state_out) when not suspended,
 * ORCH_ENOTFOUND. */
int orch_store_resume(db_pool *p, const char *org, const char *session_id, const char *reason,
                      const char *operator_input, orch_resume *out, char *state_out, char *err,
                      size_t errlen);

typedef struct orch_audit_link {
    char action_id[37], session_id[37], agent_id[37], parent_action_id[37];
    char action_type[64];
    int64_t created_ms;
    int verified; /* the row's hash recomputes and its prev_hash is its predecessor's hash */
} orch_audit_link;

/* The audit row action_id of session_id and its ancestors through parent_action_id within that
 * session, newest first, at most max rows (out: caller's array). *n 0: no such row. */
int orch_store_audit_chain(db_pool *p, const char *org, const char *session_id,
                           const char *action_id, size_t max, orch_audit_link *out, size_t *n,
                           char *err, size_t errlen);

/* A session's parent and its anchor there: the parent's audit row named by spawn_action_id,
 * else the parent's newest row at or before the child's start. *parent "" for a root session.
 * *anchor_ok 1 when the anchor row exists in the parent, verifies in the parent's hash chain
 * and (when the child recorded one) still carries spawn_anchor_hash. */
int orch_store_audit_anchor(db_pool *p, const char *org, const char *session_id, char parent[37],
                            char anchor_action[37], int *anchor_ok, char *err, size_t errlen);

/* ---- workflow agent steps ---- */
/* Claims a dispatch: DB_OK when new (row 'running' inserted) or a stale 'running' one; ORCH_EREPLAY
 * with *result (heap, packed AgentStepResult) when it already finished. */
int orch_store_step_claim(db_pool *p, const char *org, const char *key, const char *run_id,
                          unsigned char **result, size_t *len, char *err, size_t errlen);
int orch_store_step_finish(db_pool *p, const char *org, const char *key, const char *session_id,
                           const unsigned char *result, size_t len, char *err, size_t errlen);

/* ---- subagent trees (migrations/002_subagents.sql) ---- */
/* One SubagentLink: a sessions row and the bridge row that created it (bridge fields empty
 * when none, as on a root). */
typedef struct orch_link {
    char session_id[37], parent_session_id[37], root_session_id[37], agent_id[37];
    int depth; /* delegation_depth */
    char state[16];
    int64_t started_us, ended_us; /* ended_us 0: live */
    char invocation_id[37], role[65], result_status[16];
    char error_code[129]; /* empty when the result is ok */
} orch_link;

/* The parent of session_id: *is_root 1 (parent untouched) when it has none; else *parent has
 * the parent session's fields and the bridge fields of the edge parent -> session_id.
 * ORCH_ENOTFOUND when session_id is not the org's. */
int orch_store_parent_get(db_pool *p, const char *org, const char *session_id, int *is_root,
                          orch_link *parent, char *err, size_t errlen);
/* Direct children of parent_id in (started_at, session_id) order, after the keyset cursor
 * (after_id NULL/"": first page), at most limit. *rows heap: free(). *more 1 when another page
 * follows; *total every direct child. ORCH_ENOTFOUND when parent_id is not the org's. */
int orch_store_children(db_pool *p, const char *org, const char *parent_id, int64_t after_us,
                        const char *after_id, int limit, orch_link **rows, size_t *n, int *more,
                        int64_t *total, char *err, size_t errlen);
/* The tree under session_id in DFS order (the node first), at most max_depth levels below it,
 * at most fanout children of any node and max_nodes in all. *cut_depth max_depth when a node
 * at the last level has children (else 0); *cut_fanout 1 when a node had more than fanout
 * children or the node bound cut the walk. *rows heap: free(). ORCH_ENOTFOUND when absent. */
int orch_store_tree(db_pool *p, const char *org, const char *session_id, int max_depth, int fanout,
                    int max_nodes, orch_link **rows, size_t *n, int *cut_depth, int *cut_fanout,
                    char *err, size_t errlen);

typedef struct orch_ended {
    char session_id[37];
    char worker[128]; /* the worker of its last turn ("" none) */
    int terminated;   /* 1: ended by this call; 0: already terminal (skipped) */
} orch_ended;

/* In one transaction: terminates every descendant of session_id (and session_id itself with
 * include_root) as orch_store_session_terminate does (audited with reason), and flips the
 * still-pending bridge rows of the sessions it ended to 'cancelled' (*bridge_rows). *out heap
 * (free()): every session of the subtree, parents first. ORCH_ENOTFOUND when session_id is not
 * the org's; ORCH_ESTATE (nothing changed) when the subtree has more than max_sessions. */
int orch_store_tree_terminate(db_pool *p, const char *org, const char *session_id, int include_root,
                              const char *reason, int max_sessions, orch_ended **out, size_t *n,
                              int *bridge_rows, char *err, size_t errlen);

/* ---- worker liveness and crash recovery (store_recovery.c; docs/orchestrator.md, "Crash
 * recovery") ---- */

/* Records a worker's heartbeat (every replica sees it). */
int orch_store_worker_seen(db_pool *p, const char *worker_id, int active_sessions, char *err,
                           size_t errlen);

typedef struct orch_recovery {
    char session_id[37], org_id[37];
    char worker[128]; /* the dead worker */
} orch_recovery;

/* Claims up to max live sessions of workers whose last heartbeat is older than dead_after_ms,
 * leasing each to `owner` for lease_ms (a session under another's unexpired lease is skipped).
 * *out heap (free()), *n claimed. */
int orch_store_recovery_claim(db_pool *p, const char *owner, int64_t dead_after_ms,
                              int64_t lease_ms, size_t max, orch_recovery **out, size_t *n,
                              char *err, size_t errlen);
/* Gives a claimed session back (nothing could be done now: the next sweep tries again). */
int orch_store_recovery_release(db_pool *p, const char *owner, const char *session_id, char *err,
                                size_t errlen);
/* The session now lives on `worker` (recovered from checkpoint loop, -1: none): sessions.worker
 * set, a session_recovered audit row when from is not NULL, the lease released. ORCH_ESTATE
 * when the session is no longer live (nothing changed). */
int orch_store_session_placed(db_pool *p, const char *org, const char *session_id, const char *from,
                              const char *worker, int loop, char *err, size_t errlen);
/* The recovery failed for good: state crashed, AgentStatus ERROR, last_error = why, ended,
 * worker cleared, a session_crashed audit row (worker, loop_iteration, reason), lease
 * released. ORCH_ESTATE when the session is no longer live. */
int orch_store_session_crashed(db_pool *p, const char *org, const char *session_id,
                               const char *worker, int loop, const char *why, char *err,
                               size_t errlen);

#endif
