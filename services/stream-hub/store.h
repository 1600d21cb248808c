/* stream_hub's store: every SQL statement of the service (migrations/001_projection.sql,
 * 002_prompt_frames.sql).
 *
 * Every function runs in a transaction bound to one org (db_tx_begin), so row-level security
 * confines it to that tenant even if a query forgot a predicate. Writes are idempotent by
 * sequence (redelivered or replayed events change nothing). Blobs are the protobuf bytes as
 * published; callers decode them. */
#ifndef UPSQUAD_HUB_STORE_H
#define UPSQUAD_HUB_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "db.h"

/* One stored event: a run event (seq = the run's sequence) or a transcript event. */
typedef struct hs_blob {
    int64_t seq;
    char kind; /* 'n' node, 'r' run, 'l' log; 't' transcript; 'p' prompt frame; 'u' the
                  snapshot's upto mark */
    uint8_t *body;
    size_t len;
} hs_blob;

typedef struct hs_blobs {
    hs_blob *v;
    size_t n;
} hs_blobs;
void hs_blobs_free(hs_blobs *b);

/* The projected run row. */
typedef struct hs_run {
    char run_id[64], workflow_id[128], workflow_name[256], team_id[64], visibility[16];
    char owner_id[64], display_name[256], status[32], prompt_id[64], asked_by_role[64];
    int needs_input, needs_approval, prompt_kind, is_waiting;
    int nodes_total, nodes_done;
    /* open human-answerable gates (run_nodes); has_open_prompt_count 0 when not determined
     * (a run projected before run_nodes existed) */
    int has_open_prompt_count, open_prompt_count;
    int64_t last_seq;
} hs_run;

/* ---- writes (projection) ---- */
/* What the projector extracted from one RunEvent (strings borrowed). */
typedef struct hs_run_event {
    const char *org_id, *run_id;
    int64_t seq;
    char kind; /* 'n', 'r', 'l' */
    const char *node_id;
    int iteration;
    double at_s; /* epoch seconds; 0 = now */
    /* scope (every event) */
    const char *workflow_id, *workflow_name, *team_id, *visibility, *owner_id, *display_name;
    /* status group: run status after the event ("" = unchanged) and the governance roll-up */
    const char *status;
    int needs_input, needs_approval, prompt_kind, is_waiting;
    const char *prompt_id, *asked_by_role;
    /* 'n' only: the node's five-colour status after the transition (NodeStatusUpdate.status) */
    const char *node_status;
    /* counters ('r' only) */
    int has_counters, nodes_total, nodes_done;
    /* the run's workflow is deleted (RunScope.workflow_deleted: no visible-runs set has it) */
    int workflow_deleted;
    const uint8_t *body;
    size_t len;
} hs_run_event;

int hs_put_run_event(db_pool *p, const hs_run_event *e, char *err, size_t errlen);

typedef struct hs_transcript_event {
    const char *org_id, *run_id, *step_name, *action_id, *session_id;
    int iteration, seq;
    const uint8_t *body;
    size_t len;
} hs_transcript_event;

int hs_put_transcript(db_pool *p, const hs_transcript_event *e, char *err, size_t errlen);

/* A captured user_prompt frame (migrations/002_prompt_frames.sql); strings borrowed. */
typedef struct hs_prompt_frame {
    const char *org_id, *run_id, *prompt_id, *step_name, *action_id;
    int iteration;
    const uint8_t *body; /* the NodeIOFrame as published */
    size_t len;
} hs_prompt_frame;

int hs_put_prompt_frame(db_pool *p, const hs_prompt_frame *e, char *err, size_t errlen);

/* ---- reads ---- */
/* *found 0 when the run is unknown to this org (or belongs to another). */
int hs_get_run(db_pool *p, const char *org, const char *run_id, hs_run *out, int *found, char *err,
               size_t errlen);
/* The newest node event per (node_id, iteration) among the seqs without a hole below them,
 * in seq order, followed by one row of kind 'u' whose seq is the last seq the snapshot covers;
 * and the run row read in the same snapshot (*found 0: unknown run). */
int hs_node_fold(db_pool *p, const char *org, const char *run_id, hs_blobs *out, hs_run *run,
                 int *found, char *err, size_t errlen);
/* Events of any kind with seq > after, in seq order, at most limit. */
int hs_events_after(db_pool *p, const char *org, const char *run_id, int64_t after, int limit,
                    hs_blobs *out, char *err, size_t errlen);
/* How long ago (ms, the database's clock) event `seq` of the run was projected; 0 when it is
 * not stored. */
int hs_event_age_ms(db_pool *p, const char *org, const char *run_id, int64_t seq, int64_t *age_ms,
                    char *err, size_t errlen);
/* The last `tail` log events without a hole below them, in seq order, then the 'u' row as
 * above, and the run row of the same snapshot. */
int hs_log_tail(db_pool *p, const char *org, const char *run_id, int tail, hs_blobs *out,
                hs_run *run, int *found, char *err, size_t errlen);
/* Transcript events of a run, of one node (step name or action id; NULL/"" = every node),
 * ordered by (session_id, seq, created_at), at most limit. seq carries the event's seq. */
int hs_transcript(db_pool *p, const char *org, const char *run_id, const char *node, int limit,
                  hs_blobs *out, char *err, size_t errlen);
/* The captured user_prompt frames of a run (kind 'p', body a NodeIOFrame) whose prompt is still
 * open (a node's newest projected state is parked on it, run_nodes), of one node (step name or
 * action id; NULL/"" = every node), the newest `limit` of them, oldest first. */
int hs_prompt_frames(db_pool *p, const char *org, const char *run_id, const char *node, int limit,
                     hs_blobs *out, char *err, size_t errlen);
/* How many of the given runs the projection holds at a lower seq than given (or not at all):
 * nonzero means the store has not caught up with what was seen live. */
int hs_runs_behind(db_pool *p, const char *org, const char *const *run_ids, const int64_t *seqs,
                   size_t n, int *behind, char *err, size_t errlen);
/* Visible runs of a member: team arm (team_id in teams) or private arm (owner_id = member),
 * whose status is in `statuses` (NULL = any), newest first, at most limit. *out: caller frees. */
int hs_visible_runs(db_pool *p, const char *org, const char *member, const char *const *teams,
                    size_t n_teams, const char *const *statuses, size_t n_statuses, int limit,
                    hs_run **out, size_t *n, char *err, size_t errlen);

#endif
