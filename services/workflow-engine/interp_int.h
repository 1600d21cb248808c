/* Internals shared by the interpreter's files: interp.c (loading, side effects, one tick,
 * cancel, decisions), interp_steps.c (starting steps, waits, outcomes), interp_walk.c (the
 * walk), interp_results.c (the agent results consumer) and schedule.c (schedules). Unless it
 * says otherwise, each function here runs inside the tick's transaction. */
#ifndef WF_INTERP_INT_H
#define WF_INTERP_INT_H

#include "interp.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ids.h"
#include "log.h"
#include "pbjson.h"
#include "store.h"
#include "subjects.h"
#include "upsquad/internal/v1/agent_step.pb-c.h"
#include "upsquad/internal/v1/node_io.pb-c.h"
#include "upsquad/internal/v1/tool.pb-c.h"
#include "wf_expr.h"
#include "util.h"

enum { SCOPE_DONE, SCOPE_BUSY, SCOPE_FAILED };

#define MAX_JOBS 64
#define TICKS_PER_CLAIM 32

typedef struct act {
    char id[37];
    char *step, *type, *lap;
    int iteration;
    char status[20];
    int attempt;
    char key[65];
    cJSON *input, *output, *result;
    char *feedback;
    int polls;
    int64_t deadline_ms, next_poll_ms, started_ms;
    double cost;
    char blocked[64], approval[37], agent_id[64];
    st_agent_state *resume; /* the next dispatch resumes a frozen ask (AskUserResume); owned */
    const char *park_kind;  /* an agent that parked itself this tick: its row's kind (static) */
    /* pending writes */
    int is_new, dirty, clear_result, started, finished;
    double add_cost;
    int64_t add_in, add_out;
} act;

typedef struct job {
    char action_id[37], key[65], step[160], tool[64], action[64], lap[64];
    int iteration;
    char *args; /* JSON */
} job;

typedef struct tick {
    wf_engine *e;
    wf_run *run;
    db_tx *tx;
    act **acts; /* the run's latest lap of each step (st_actions_load), then the tick's new ones */
    size_t n, cap;
    size_t n_new; /* actions this tick created (with run->actions: the run budget) */
    act **idx;    /* acts by (step, lap) (interp__find); idx_cap a power of two */
    size_t idx_cap;
    const cJSON **def_idx; /* the definition's steps by name (interp__step_def), built lazily */
    size_t def_cap;
    cJSON *state, *steps;
    int64_t now, wake_ms;
    job jobs[MAX_JOBS];
    int n_jobs;
    int paused;
    char reason[512];
    char budget[160]; /* set when the run exceeded UPSQUAD_WF_RUN_MAX_ACTIONS: its failure */
    char err[512];
    int rc;
} tick;

static inline const cJSON *item(const cJSON *o, const char *k) {
    return cJSON_GetObjectItemCaseSensitive(o, k);
}
static inline const char *str(const cJSON *o, const char *k) {
    const cJSON *v = item(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}
static inline int num(const cJSON *o, const char *k, int def) {
    const cJSON *v = item(o, k);
    return cJSON_IsNumber(v) ? v->valueint : def;
}

enum { TICK_LOST = -1, TICK_IDLE = 0, TICK_JOBS = 1, TICK_FINISHED = 2 };

/* One leased run's place in a group tick (interp_loop.c): what the loop hands the tick and
 * what the tick hands back. The loop owns it; between its reads being sent and interp__tick_end
 * the tick's own members are in use. */
typedef struct tick_run {
    char run_id[37], org[37];
    int64_t gen; /* the claim's wake_gen (st_queue_release: a wake-up since is not lost) */
    /* the previous tick's tool calls and their outcomes (JSON, heap), applied by this one */
    job done[MAX_JOBS];
    char *results[MAX_JOBS];
    int n_done;
    job jobs[MAX_JOBS]; /* out: the calls this tick committed (caller frees args) */
    int n_jobs;
    int out;   /* TICK_*, set by interp__tick_end */
    int ticks; /* ticks since the claim (at most TICKS_PER_CLAIM, then released) */
    int used;  /* the slot holds a claimed run */
    /* the tick's own */
    PGresult *row, *fence, *acts;
    wf_run run;
    tick t;
    int finished;
} tick_run;

/* A group tick, in one pipelined transaction begun with no org: for every run, its org scope
 * and its three reads queued (st_tick_head_send); one db_pipe_flush; for every run, its org
 * scope again and interp__tick_step (the walk; its writes queued); COMMIT; then
 * interp__tick_end for every run (committed 0: nothing of the tick happened, r->out
 * TICK_LOST). A step that fails (err names the run) fails the whole transaction. The scope
 * statements are the caller's (interp_loop.c), so runs of one org in a row share one. */
int interp__tick_step(wf_engine *e, db_tx *tx, tick_run *r, char *err, size_t errlen);
void interp__tick_end(wf_engine *e, tick_run *r, int committed);

/* Cross-file internals: only the interpreter's files call them. */
const cJSON *interp__step_def(tick *t, const char *name);
void interp__wake_at(tick *t, int64_t ms);
void interp__idem_key(const char *run, const char *step, const char *lap, const char *what, int n,
                      char out[65]);
void interp__act_free(act *a);
act *interp__find(tick *t, const char *step, const char *lap);
void interp__state_put(tick *t, act *a);
const char *interp__gov_kind(const act *a);
const char *interp__asked_by_step(const act *a);
const char *interp__last_agent_step(const tick *t);
int interp__save(tick *t, act *a);
act *interp__new_act(tick *t, const char *step, const char *type, const char *lap, int iteration,
                     const char *status);
void interp__set_status(act *a, const char *status);
void interp__set_output(act *a, cJSON *out);
void interp__fail_act(tick *t, act *a, const char *code, const char *msg);
void interp__complete_act(tick *t, act *a, cJSON *output);
int interp__load_acts(tick *t);
int interp__load_acts_from(tick *t, PGresult *r);
void interp__add_tool_job(tick *t, act *a, const char *tool, const char *action, const char *key);
int interp__prompt_frame(tick *t, const act *a, const cJSON *spec);
int interp__dispatch_agent(tick *t, act *a, const cJSON *sd);
int interp__cancel_agent(tick *t, act *a, const char *reason);
int interp__start_agent(tick *t, act *a, const cJSON *sd);
int interp__fail_if_gated_off(tick *t, act *a, const char *tool);
int interp__start_tool(tick *t, act *a, const cJSON *sd);
int interp__start_gate(tick *t, act *a, const cJSON *sd);
int interp__gate_timed_out(tick *t, act *a, const cJSON *sd);
int interp__advance_wait(tick *t, act *a, const cJSON *sd);
int interp__start_wait(tick *t, act *a, const cJSON *sd);
int interp__apply_tool_result(tick *t, act *a);
int interp__redispatch_agent(tick *t, act *a, const cJSON *sd);
int interp__apply_agent_result(tick *t, act *a, const cJSON *sd);
int interp__walk_scope(tick *t, const char *entry, const char *lap, int iteration);
void interp__tick_init(tick *t, wf_engine *e, wf_run *run);
void interp__tick_free(tick *t);
int interp__agent_gate_timed_out(tick *t, act *a);
int interp__answer_denies(const char *answer);
int interp__keep_ask(db_tx *tx, const Upsquad__Internal__V1__AgentStepResult *m, char *err,
                     size_t errlen);

#endif
