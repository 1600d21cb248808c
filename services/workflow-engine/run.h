/* A run inside one tenant transaction: its row, its workflow's scope, and the events every
 * change writes to the outbox (RunEvent on wf.status / wf.log, per-run seq). */
#ifndef WF_RUN_H
#define WF_RUN_H

#include <cjson/cJSON.h>
#include <stdint.h>

#include "db.h"

typedef struct wf_run {
    db_tx *tx; /* borrowed */
    char id[37], org[37], wf[37], triggered_by[37], team[37], owner[37];
    char status[16], visibility[16], classification[16];
    char trace[65]; /* the creating call's trace id ("" none) */
    char *wf_name, *display_name;
    int wf_deleted; /* its workflow is soft-deleted (RunScope.workflow_deleted) */
    int64_t seq;    /* last event seq written */
    int64_t seq_loaded;
    int64_t started_ms;
    int64_t actions; /* actions the run had when loaded (runs.actions_count) */
    cJSON *def, *context;
    /* events emitted in this transaction, written by wf_run_flush in one statement */
    char *ev_subjects, *ev_ids, *ev_payloads; /* Postgres array texts being built */
    size_t ev_len[3], ev_cap[3];
    int n_ev;
} wf_run;

/* Loads (lock: FOR UPDATE) the run; *found 0 when it is not visible to the tx's org. */
int wf_run_load(db_tx *tx, const char *run_id, int lock, wf_run *out, int *found, char *err,
                size_t errlen);
/* The same from a row of st_run_load's columns already read (st_tick_head_send); takes ownership
 * of res (cleared). Returns DB_OK. */
int wf_run_take(db_tx *tx, PGresult *res, wf_run *r, int *found);
void wf_run_free(wf_run *r);
/* The trace an outbox row r writes now is published under: the calling RPC's (this thread's
 * log trace) when a call is writing it, else the run's own (the call that created it). */
const char *wf_run_trace(const wf_run *r);
/* Writes the events emitted since the last flush (outbox rows) and the run's event_seq, in one
 * statement; call before committing. */
int wf_run_flush(wf_run *r, char *err, size_t errlen);

/* One action's projected transition. */
typedef struct wf_node_ev {
    const char *action_id, *step, *type, *raw_status, *blocked_by;
    int iteration;
    int64_t elapsed_ms;
    double cost;
    const char *prompt_kind;   /* governance kind when parked on one, else NULL */
    const char *asked_by_role; /* the asking agent step's agent_role when parked, else NULL */
    const char *approval;      /* the governance row id when parked on one, else NULL */
} wf_node_ev;

int wf_emit_node(wf_run *r, const wf_node_ev *n, char *err, size_t errlen);
/* Sets the run status (timestamps per st_run_set_status) and emits the RunTransition and a
 * log line. */
int wf_run_transition(wf_run *r, const char *status, const char *reason, char *err, size_t errlen);
/* Emits the run's RunTransition, status unchanged, after its workflow was soft-deleted (loaded
 * after the delete, its scope carries workflow_deleted: the run leaves every visible-runs
 * set). Flush with wf_run_flush. */
int wf_run_workflow_deleted(wf_run *r, char *err, size_t errlen);
int wf_emit_log(wf_run *r, const char *action_id, const char *level, const char *msg, char *err,
                size_t errlen);

#endif
