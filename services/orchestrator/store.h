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

enum { ORCH_ENOTFOUND = 1, ORCH_ECONFLICT = 2, ORCH_EREPLAY = 3, ORCH_ESTATE = 4 };

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

/* Starts a turn: refuses a terminal session (ORCH_ESTATE, state in final_state), reads the
 * newest prior turns (at most max_turns and max_bytes of text in total, oldest first), stores
 * the user turn and audits message_received. *turns heap: orch_turns_free. action_id out: the
 * message_received row (the parent of what the turn does). */
int orch_store_turn_begin(db_pool *p, const char *org, const char *session_id, const char *message,
                          int max_turns, size_t max_bytes, orch_turn **turns, size_t *n,
                          char *action_id, char *final_state, char *err, size_t errlen);
void orch_turns_free(orch_turn *t, size_t n);

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
} orch_turn_end;

int orch_store_turn_end(db_pool *p, const char *org, const char *session_id,
                        const char *parent_action_id, const orch_turn_end *e, char *err,
                        size_t errlen);

/* Appends an audit row. detail_json: a JSON object text (never secrets). action_id out. */
int orch_store_audit(db_pool *p, const char *org, const char *session_id, const char *type,
                     const char *agent_id, const char *parent_action_id, const char *detail_json,
                     char *action_id, char *err, size_t errlen);
/* Sets the session's AgentStatus as relayed (cheap; no audit). */
int orch_store_session_status(db_pool *p, const char *org, const char *session_id, int status,
                              char *err, size_t errlen);

/* ---- worker paths ---- */
/* Records a heartbeat on the session (last_heartbeat = now). ORCH_ENOTFOUND when unknown. */
int orch_store_heartbeat(db_pool *p, const char *session_id, char *err, size_t errlen);

/* Upserts a checkpoint; keeps the newest `keep` per session. DB_OK (stored), ORCH_EREPLAY (same
 * hash already stored: nothing changes), ORCH_ECONFLICT (another hash at that key),
 * ORCH_ENOTFOUND (no such session). */
int orch_store_checkpoint(db_pool *p, const char *session_id, int loop_iteration,
                          uint32_t schema_version, const unsigned char *state, size_t len,
                          const char *sha256_hex, int keep, char *err, size_t errlen);
/* The latest checkpoint (tests, resume). *state heap. ORCH_ENOTFOUND when none. */
int orch_store_checkpoint_latest(db_pool *p, const char *org, const char *session_id,
                                 int *loop_iteration, unsigned char **state, size_t *len, char *err,
                                 size_t errlen);

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

#endif
