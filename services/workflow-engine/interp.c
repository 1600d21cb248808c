/* The durable interpreter (interp.h; docs/workflow-engine.md "Run model").
 *
 * A run is advanced in ticks by whichever replica holds its lease (run_queue). One tick is one
 * transaction scoped to the run's org: fence the lease, load the run and its actions, walk the
 * definition from `start` recomputing where the run stands from the actions table (the single
 * durable truth), apply outcomes that arrived (agent results, tool results, events), create the
 * actions that become due, and write every transition with its outbox event. Side effects
 * happen only after that commit: agent steps are outbox rows (published with the idempotency
 * key as JetStream message id), tool calls are NATS requests made after the commit and
 * recorded in a second transaction, retried with the same key. A crash at any point leaves
 * either the transition uncommitted (nothing happened) or committed with its side effect keyed
 * (a replay returns the recorded result). */
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
    act **acts;
    size_t n, cap;
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

/* ---- small helpers ---- */

static const cJSON *item(const cJSON *o, const char *k) {
    return cJSON_GetObjectItemCaseSensitive(o, k);
}
static const char *str(const cJSON *o, const char *k) {
    const cJSON *v = item(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}
static int num(const cJSON *o, const char *k, int def) {
    const cJSON *v = item(o, k);
    return cJSON_IsNumber(v) ? v->valueint : def;
}
static const cJSON *step_def(tick *t, const char *name) {
    return item(item(t->run->def, "steps"), name);
}

static void wake_at(tick *t, int64_t ms) {
    if (ms > 0 && (t->wake_ms == 0 || ms < t->wake_ms)) t->wake_ms = ms;
}

static void idem_key(const char *run, const char *step, const char *lap, const char *what, int n,
                     char out[65]) {
    char buf[1024];
    /* sha256(run_id:step_name:iteration:attempt) (DESIGN.md); the lap path stands for the
     * iteration so nested loops never collide */
    int len = snprintf(buf, sizeof buf, "%s:%s:%s:%s%d", run, step, lap[0] ? lap : "0", what, n);
    ids_sha256_hex(buf, (size_t)(len < (int)sizeof buf ? len : (int)sizeof buf - 1), out);
}

static void act_free(act *a) {
    free(a->step);
    free(a->type);
    free(a->lap);
    free(a->feedback);
    cJSON_Delete(a->input);
    cJSON_Delete(a->output);
    cJSON_Delete(a->result);
    if (a->resume) st_agent_state_clear(a->resume);
    free(a->resume);
}

static act *find(tick *t, const char *step, const char *lap) {
    for (size_t i = t->n; i-- > 0;)
        if (!strcmp(t->acts[i]->step, step) && !strcmp(t->acts[i]->lap, lap)) return t->acts[i];
    return NULL;
}

/* The run state's view of one step: its latest lap. */
static void state_put(tick *t, act *a) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "status", a->status);
    if (a->output) cJSON_AddItemToObject(s, "output", cJSON_Duplicate(a->output, 1));
    cJSON_DeleteItemFromObjectCaseSensitive(t->steps, a->step);
    cJSON_AddItemToObject(t->steps, a->step, s);
}

static const char *gov_kind(const act *a) {
    /* an agent's ask_user is a user_prompt (needs_input), its interrupt an approval */
    if (a->park_kind) return a->park_kind;
    if (!strcmp(a->type, "question")) return "question_gate";
    if (!strcmp(a->type, "user_input")) return "user_prompt";
    return "approval_gate";
}

/* The agent step a parked action is attributed to (spec: asked_by_step): an agent that parked
 * itself (ask_user, interrupt) asks for itself; a gate names it with the DSL's asked_by, which
 * start_gate fills in when the definition leaves it out. */
static const char *asked_by_step(const act *a) {
    if (!strcmp(a->type, "agent_action")) return a->step;
    return str(a->input, "asked_by");
}

/* The spec's fallback for a gate without a declared asked_by: the last agent step the run
 * completed (in the order the actions were created), or NULL before any agent turn. */
static const char *last_agent_step(const tick *t) {
    for (size_t i = t->n; i-- > 0;)
        if (!strcmp(t->acts[i]->type, "agent_action") && !strcmp(t->acts[i]->status, "completed"))
            return t->acts[i]->step;
    return NULL;
}

/* The asking step's agent_role (spec: asked_by_role), the one attribution the node status
 * event, the live prompt frame and GetRunPrompt (from the row's spec.asked_by) all report;
 * NULL when the action is not attributed. */
static const char *asked_role(tick *t, const char *asked) {
    return asked ? str(step_def(t, asked), "agent_role") : NULL;
}

/* Writes the action (insert or update) and its transition event. */
static int save(tick *t, act *a) {
    if (t->rc) return t->rc;
    char *in = a->input ? cJSON_PrintUnformatted(a->input) : NULL;
    char *out = a->output ? cJSON_PrintUnformatted(a->output) : NULL;
    st_action_w w = {.id = a->id,
                     .org = t->run->org,
                     .run = t->run->id,
                     .step = a->step,
                     .type = a->type,
                     .lap = a->lap,
                     .iteration = a->iteration,
                     .status = a->status,
                     .attempt = a->attempt,
                     .key = a->key,
                     .input = in,
                     .output = out,
                     .feedback = a->feedback,
                     .blocked_by = a->blocked,
                     .approval_id = a->approval,
                     .agent_id = a->agent_id,
                     .polls = a->polls,
                     .deadline_ms = a->deadline_ms,
                     .next_poll_ms = a->next_poll_ms,
                     .clear_result = a->clear_result,
                     .started = a->started,
                     .finished = a->finished,
                     .add_cost = a->add_cost,
                     .add_in_tokens = a->add_in,
                     .add_out_tokens = a->add_out};
    int rc = a->is_new ? st_action_insert(t->tx, &w, t->err, sizeof t->err)
                       : st_action_update(t->tx, &w, t->err, sizeof t->err);
    if (rc == DB_OK && a->is_new && (a->add_cost > 0 || a->agent_id[0]))
        rc = st_action_update(t->tx, &w, t->err, sizeof t->err);
    if (rc == DB_OK && a->add_cost > 0)
        rc = st_run_add_cost(t->tx, t->run->id, a->add_cost, t->err, sizeof t->err);
    a->cost += a->add_cost;
    const char *kind = !strcmp(a->status, "awaiting_approval") || !strcmp(a->status, "escalated")
                           ? gov_kind(a)
                           : NULL;
    const char *asked = kind ? asked_by_step(a) : NULL;
    if (rc == DB_OK && a->started_ms == 0 && strcmp(a->status, "pending") &&
        strcmp(a->status, "skipped"))
        a->started_ms = t->now;
    wf_node_ev ev = {a->id,
                     a->step,
                     a->type,
                     a->status,
                     a->blocked,
                     a->iteration,
                     a->started_ms ? t->now - a->started_ms : 0,
                     a->cost,
                     kind,
                     asked_role(t, asked),
                     kind ? a->approval : NULL};
    if (rc == DB_OK) rc = wf_emit_node(t->run, &ev, t->err, sizeof t->err);
    metric_inc(t->e->m_transitions);
    free(in);
    free(out);
    a->is_new = a->clear_result = a->started = a->finished = 0;
    a->add_cost = 0;
    a->add_in = a->add_out = 0;
    state_put(t, a);
    t->rc = rc;
    return rc;
}

static act *new_act(tick *t, const char *step, const char *type, const char *lap, int iteration,
                    const char *status) {
    /* actions are allocated one by one: callers keep pointers across walks that add more */
    if (t->n == t->cap) {
        size_t cap = t->cap ? t->cap * 2 : 32;
        act **na = realloc(t->acts, cap * sizeof *na);
        if (!na) return NULL;
        t->acts = na;
        t->cap = cap;
    }
    act *a = calloc(1, sizeof *a);
    if (!a) return NULL;
    t->acts[t->n++] = a;
    memset(a, 0, sizeof *a);
    ids_uuid_v7(a->id);
    a->step = strdup(step);
    a->type = strdup(type);
    a->lap = strdup(lap);
    a->iteration = iteration;
    snprintf(a->status, sizeof a->status, "%s", status);
    a->is_new = 1;
    a->feedback = strdup("");
    return a;
}

static void set_status(act *a, const char *status) {
    snprintf(a->status, sizeof a->status, "%s", status);
    if (wf_raw_terminal(status)) a->finished = 1;
}

static void set_output(act *a, cJSON *out) {
    cJSON_Delete(a->output);
    if (out && !cJSON_IsObject(out)) { /* an output envelope is an object */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "value", out);
        out = o;
    }
    a->output = out;
}

static void fail_act(tick *t, act *a, const char *code, const char *msg) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "error", code);
    cJSON_AddStringToObject(o, "message", msg);
    set_output(a, o);
    set_status(a, "failed");
    snprintf(t->reason, sizeof t->reason, "step %s failed: %s", a->step, msg);
    save(t, a);
    char line[700];
    snprintf(line, sizeof line, "step %s failed: %s", a->step, msg);
    if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "ERROR", line, t->err, sizeof t->err);
}

static void complete_act(tick *t, act *a, cJSON *output) {
    set_output(a, output);
    set_status(a, "completed");
    save(t, a);
}

/* ---- loading ---- */

static int load_acts_from(tick *t, PGresult *r);

static int load_acts(tick *t) {
    PGresult *r = NULL;
    int rc = st_actions_load(t->tx, t->run->id, &r, t->err, sizeof t->err);
    if (rc) return rc;
    return load_acts_from(t, r);
}

/* The run's actions from st_actions_load's rows (IA_*); takes ownership of r (cleared). */
static int load_acts_from(tick *t, PGresult *r) {
    for (int i = 0; i < PQntuples(r); i++) {
        act *a = new_act(t, st_s(r, i, IA_STEP), st_s(r, i, IA_TYPE), st_s(r, i, IA_LAP),
                         (int)st_i(r, i, IA_ITERATION), st_s(r, i, IA_STATUS));
        if (!a) {
            PQclear(r);
            return DB_ENOMEM;
        }
        a->is_new = 0;
        snprintf(a->id, sizeof a->id, "%s", st_s(r, i, IA_ID));
        a->attempt = (int)st_i(r, i, IA_ATTEMPT);
        snprintf(a->key, sizeof a->key, "%s", st_s(r, i, IA_KEY));
        a->input = cJSON_Parse(st_s(r, i, IA_INPUT));
        a->output = cJSON_Parse(st_s(r, i, IA_OUTPUT));
        a->result = cJSON_Parse(st_s(r, i, IA_RESULT));
        free(a->feedback);
        a->feedback = strdup(st_s(r, i, IA_FEEDBACK));
        a->polls = (int)st_i(r, i, IA_POLLS);
        a->deadline_ms = st_i(r, i, IA_DEADLINE);
        a->next_poll_ms = st_i(r, i, IA_NEXT_POLL);
        a->cost = st_d(r, i, IA_COST);
        snprintf(a->blocked, sizeof a->blocked, "%s", st_s(r, i, IA_BLOCKED));
        a->started_ms = st_i(r, i, IA_STARTED);
        snprintf(a->approval, sizeof a->approval, "%s", st_s(r, i, IA_APPROVAL));
        state_put(t, a);
    }
    PQclear(r);
    return DB_OK;
}

/* ---- side effects queued during a tick ---- */

static void add_tool_job(tick *t, act *a, const char *tool, const char *action, const char *key) {
    if (t->n_jobs >= MAX_JOBS) { /* bounded: the rest wait for the next tick */
        wake_at(t, t->now);
        return;
    }
    for (int i = 0; i < t->n_jobs; i++)
        if (!strcmp(t->jobs[i].action_id, a->id)) return;
    job *j = &t->jobs[t->n_jobs++];
    memset(j, 0, sizeof *j);
    snprintf(j->action_id, sizeof j->action_id, "%s", a->id);
    snprintf(j->key, sizeof j->key, "%s", key);
    snprintf(j->step, sizeof j->step, "%s", a->step);
    snprintf(j->tool, sizeof j->tool, "%s", tool);
    snprintf(j->action, sizeof j->action, "%s", action);
    snprintf(j->lap, sizeof j->lap, "%s", a->lap);
    j->iteration = a->iteration;
    j->args = a->input ? cJSON_PrintUnformatted(a->input) : strdup("{}");
}

/* Writes m (encoded) to the outbox in the tick's transaction: published after the commit, with
 * msg_id as the JetStream de-duplication id. */
static int outbox_msg(tick *t, const char *subject, const char *msg_id, const ProtobufCMessage *m) {
    size_t len = protobuf_c_message_get_packed_size(m);
    uint8_t *buf = malloc(len ? len : 1);
    if (!buf) return DB_ENOMEM;
    protobuf_c_message_pack(m, buf);
    int rc = st_outbox_put(t->tx, t->run->org, subject, msg_id, buf, len, t->err, sizeof t->err);
    free(buf);
    return rc;
}

/* The live "answer needed" frame of a user_prompt this tick opened (spec: NodeIOFrame
 * .user_prompt, structural, delivered at every clearance): a NodeIOEvent on wfio.<org>.<run>,
 * written to the outbox in the transaction that inserts the governance row, so it is
 * published exactly when the prompt exists. spec is the row's spec (borrowed): the question
 * and asked_by GetRunPrompt serves from the same row. The frame's session_id is the prompt id
 * and its seq 1: a (session_id, seq) key of its own, so the hub's de-dup and gap detection
 * never mix it with the orchestrator's frames of the step's attempts
 * (proto/upsquad/internal/v1/node_io.proto). */
static int prompt_frame(tick *t, const act *a, const cJSON *spec) {
    Upsquad__Internal__V1__NodeIOEvent ev = UPSQUAD__INTERNAL__V1__NODE_IOEVENT__INIT;
    Upsquad__Workflow__V1__NodeIOFrame fr = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__INIT;
    Upsquad__Workflow__V1__UserPromptFrame up = UPSQUAD__WORKFLOW__V1__USER_PROMPT_FRAME__INIT;
    char subject[160], msg_id[80];
    const char *q = str(spec, "question"), *asked = str(spec, "asked_by");
    const char *role = asked_role(t, asked);
    up.prompt_id = (char *)a->approval;
    up.question = (char *)(q ? q : "");
    up.asked_by_step = (char *)(asked ? asked : "");
    up.asked_by_role = (char *)(role ? role : "");
    fr.node_id = a->step;
    fr.session_id = (char *)a->approval;
    fr.seq = 1;
    fr.iteration = a->iteration;
    fr.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_USER_PROMPT;
    fr.user_prompt = &up;
    ev.org_id = t->run->org;
    ev.run_id = t->run->id;
    ev.action_id = (char *)a->id;
    ev.frame = &fr;
    ev.step_name = a->step;
    ev.iteration = a->iteration;
    snprintf(subject, sizeof subject, "%s.%s.%s", SUBJ_WFIO, t->run->org, t->run->id);
    snprintf(msg_id, sizeof msg_id, "prompt:%s", a->approval);
    return outbox_msg(t, subject, msg_id, &ev.base);
}

static int dispatch_agent(tick *t, act *a, const cJSON *sd) {
    Upsquad__Internal__V1__AgentStepDispatch d;
    Google__Protobuf__Struct *input = NULL;
    Google__Protobuf__Timestamp now;
    char e2[256];
    upsquad__internal__v1__agent_step_dispatch__init(&d);
    pbjson_ts_now(&now);
    const cJSON *exp = item(sd, "expects"), *f;
    size_t ne = (size_t)cJSON_GetArraySize(exp), k = 0;
    Upsquad__Internal__V1__ExpectedField *ef = calloc(ne ? ne : 1, sizeof *ef);
    Upsquad__Internal__V1__ExpectedField **efp = calloc(ne ? ne : 1, sizeof *efp);
    cJSON_ArrayForEach(f, exp) {
        upsquad__internal__v1__expected_field__init(&ef[k]);
        ef[k].name = f->string;
        ef[k].type = (char *)(str(f, "type") ? str(f, "type") : "");
        ef[k].required = cJSON_IsTrue(item(f, "required"));
        ef[k].description = (char *)(str(f, "description") ? str(f, "description") : "");
        efp[k] = &ef[k];
        k++;
    }
    pbjson_struct_from_json(a->input, &input, e2, sizeof e2);
    const cJSON *goal = item(a->input, "prompt");
    d.idempotency_key = a->key;
    d.org_id = t->run->org;
    d.run_id = t->run->id;
    d.workflow_id = t->run->wf;
    d.action_id = a->id;
    d.step_name = a->step;
    d.iteration = a->iteration;
    d.attempt = a->attempt;
    d.agent_role = (char *)(str(sd, "agent_role") ? str(sd, "agent_role") : "");
    d.goal = cJSON_IsString(goal) ? goal->valuestring : "";
    d.input = input;
    d.expects = efp;
    d.n_expects = k;
    d.feedback = a->feedback;
    d.triggered_by = t->run->triggered_by;
    d.timeout_ms = (int32_t)t->e->cfg->agent_timeout_ms;
    /* the run's trace (the call that triggered it) follows the step to the orchestrator and
     * the worker; a run no call made goes on the step's key */
    d.trace_id = t->run->trace[0] ? t->run->trace : a->key;
    d.dispatched_at = &now;
    d.team_id = t->run->team;
    Upsquad__Runtime__V1__AskUserResume aur = UPSQUAD__RUNTIME__V1__ASK_USER_RESUME__INIT;
    if (a->resume && a->resume->checkpoint && a->resume->answer) {
        /* the same frozen turn goes on: its checkpoint verbatim, the answer keyed to the
         * pending ask_user call (agent-runtime-api: AskUserResume) */
        aur.checkpoint.data = a->resume->checkpoint;
        aur.checkpoint.len = a->resume->checkpoint_len;
        aur.answer_tool_result.data = (uint8_t *)a->resume->answer;
        aur.answer_tool_result.len = strlen(a->resume->answer);
        d.ask_user_resume = &aur;
    }
    int rc = outbox_msg(t, SUBJ_AGENT_STEP_DISPATCH, a->key, &d.base);
    free(ef);
    free(efp);
    if (input) pbjson_struct_free(input);
    return rc;
}

/* An agent attempt in flight is stopped (CancelRun, its run failing, its timeout): the cancel
 * is an outbox row of the same transaction as the step's end, so it reaches the orchestrator
 * even after a crash; every replica there cancels that attempt's ExecuteStep. An attempt
 * waiting out a retry delay has nothing in flight. */
static int cancel_agent(tick *t, act *a, const char *reason) {
    if (strcmp(a->type, "agent_action") || strcmp(a->status, "in_progress") || !a->key[0] ||
        a->next_poll_ms > 0)
        return DB_OK;
    Upsquad__Internal__V1__AgentStepCancel c = UPSQUAD__INTERNAL__V1__AGENT_STEP_CANCEL__INIT;
    Google__Protobuf__Timestamp now;
    char subject[160], msg_id[80];
    pbjson_ts_now(&now);
    c.idempotency_key = a->key;
    c.org_id = t->run->org;
    c.run_id = t->run->id;
    c.action_id = a->id;
    c.step_name = a->step;
    c.reason = (char *)reason;
    c.cancelled_at = &now;
    snprintf(subject, sizeof subject, "%s.%s.%s", SUBJ_AGENT_STEP_CANCEL, t->run->org, t->run->id);
    snprintf(msg_id, sizeof msg_id, "cancel:%s", a->key);
    return outbox_msg(t, subject, msg_id, &c.base);
}

/* ---- starting steps ---- */

/* Arms the attempt's timeout (the step's timeout_minutes, else UPSQUAD_WF_AGENT_TIMEOUT),
 * commits its transition and dispatches it. */
static int send_agent(tick *t, act *a, const cJSON *sd) {
    int tm = num(sd, "timeout_minutes", 0);
    a->deadline_ms = t->now + (tm > 0 ? (int64_t)tm * 60000 : t->e->cfg->agent_timeout_ms);
    wake_at(t, a->deadline_ms);
    if (save(t, a)) return SCOPE_BUSY;
    t->rc = dispatch_agent(t, a, sd);
    return SCOPE_BUSY;
}

static int start_agent(tick *t, act *a, const cJSON *sd) {
    char e2[300];
    const char *prompt = str(sd, "prompt");
    cJSON *goal = wf_expr_render(t->state, prompt ? prompt : "", e2, sizeof e2);
    if (!goal) {
        fail_act(t, a, "template", e2);
        return SCOPE_FAILED;
    }
    /* a redo's feedback travels in AgentStepDispatch.feedback; the orchestrator adds it to the
     * turn, so the goal stays the step's prompt */
    cJSON *in = cJSON_CreateObject();
    cJSON_AddStringToObject(in, "agent_role", str(sd, "agent_role") ? str(sd, "agent_role") : "");
    cJSON_AddItemToObject(in, "prompt", cJSON_IsString(goal) ? goal : cJSON_CreateString(""));
    if (!cJSON_IsString(goal)) cJSON_Delete(goal);
    if (a->feedback[0]) cJSON_AddStringToObject(in, "feedback", a->feedback);
    cJSON_Delete(a->input);
    a->input = in;
    a->attempt++;
    idem_key(t->run->id, a->step, a->lap, "", a->attempt, a->key);
    set_status(a, "in_progress");
    a->started = 1;
    a->clear_result = 1;
    return send_agent(t, a, sd);
}

/* A tool_action whose tool is behind a process-level gate that is off here validated at create
 * (the whitelist is the catalogue, gate or not) and must "fail closed at dispatch" (spec
 * GetToolCatalogResponse.tools): the step fails before any request is sent, naming the tool
 * and its switch. Returns 1 when it failed the step. */
static int fail_if_gated_off(tick *t, act *a, const char *tool) {
    const defn_tool *d = tool ? defn_catalog_tool(t->e->defn, tool) : NULL;
    if (!d || d->enabled) return 0;
    char msg[256];
    snprintf(msg, sizeof msg, "tool %s is not enabled in this deployment (%s)", d->tool,
             d->enabled_by);
    fail_act(t, a, "tool_disabled", msg);
    return 1;
}

static int start_tool(tick *t, act *a, const cJSON *sd) {
    char e2[300];
    if (fail_if_gated_off(t, a, str(sd, "tool"))) return SCOPE_FAILED;
    cJSON *with = item(sd, "with") ? wf_expr_render_tree(t->state, item(sd, "with"), e2, sizeof e2)
                                   : cJSON_CreateObject();
    if (!with) {
        fail_act(t, a, "template", e2);
        return SCOPE_FAILED;
    }
    cJSON_Delete(a->input);
    a->input = with;
    a->attempt++;
    idem_key(t->run->id, a->step, a->lap, "", a->attempt, a->key);
    set_status(a, "in_progress");
    a->started = 1;
    a->clear_result = 1;
    if (save(t, a)) return SCOPE_BUSY;
    add_tool_job(t, a, str(sd, "tool"), str(sd, "action"), a->key);
    return SCOPE_BUSY;
}

static int start_gate(tick *t, act *a, const cJSON *sd) {
    char e2[300];
    cJSON *spec = cJSON_Duplicate(sd, 1);
    /* render the human-facing text now: the card shows what the run saw */
    const char *field = !strcmp(a->type, "approval_gate") ? "summary"
                        : !strcmp(a->type, "user_input")  ? "question"
                                                          : "prompt";
    const char *text = str(sd, field);
    if (text) {
        cJSON *r = wf_expr_render(t->state, text, e2, sizeof e2);
        if (!r) {
            cJSON_Delete(spec);
            fail_act(t, a, "template", e2);
            return SCOPE_FAILED;
        }
        cJSON_ReplaceItemInObjectCaseSensitive(spec, field, r);
    }
    if (!str(spec, "asked_by") && last_agent_step(t))
        cJSON_AddStringToObject(spec, "asked_by", last_agent_step(t));
    cJSON_Delete(a->input);
    a->input = spec;
    ids_uuid_v4(a->approval);
    const char *kind = gov_kind(a);
    snprintf(a->blocked, sizeof a->blocked, "%s",
             !strcmp(kind, "question_gate") ? "awaiting-question" : a->approval);
    set_status(a, "awaiting_approval");
    a->started = 1;
    int tm = num(sd, "timeout_minutes", 0);
    if (tm > 0) { /* the run's own timer: on_timeout applies at requested_at + N minutes */
        a->deadline_ms = t->now + (int64_t)tm * 60000;
        wake_at(t, a->deadline_ms);
    }
    if (save(t, a)) return SCOPE_BUSY;
    char *sj = cJSON_PrintUnformatted(spec);
    t->rc = st_governance_insert(t->tx, a->approval, t->run->org, t->run->id, a->id, kind,
                                 num(sd, "required_clearance", 0), sj, t->err, sizeof t->err);
    free(sj);
    /* a question_gate (clearance-gated, answered through RecordDecision) and an approval gate
     * have no live prompt frame: the spec's frame is the user_prompt's */
    if (!t->rc && !strcmp(kind, "user_prompt")) t->rc = prompt_frame(t, a, spec);
    char line[300];
    snprintf(line, sizeof line, "step %s is waiting for a person (%s)", a->step, kind);
    if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "INFO", line, t->err, sizeof t->err);
    return SCOPE_BUSY;
}

/* A parked gate whose window closed: its on_timeout decides (docs/workflow-definitions.md).
 * The window is the step's (GetRunPrompt.expires_at, "the deadline the run's own timer will
 * honour", spec) and an escalation does not move it: an escalated gate is still "parked" and
 * "WILL transition again" (spec), so the timer fires on it as on an awaiting one. */
static int gate_timed_out(tick *t, act *a, const cJSON *sd) {
    if (a->deadline_ms <= 0 ||
        (strcmp(a->status, "awaiting_approval") && strcmp(a->status, "escalated")))
        return SCOPE_BUSY;
    if (t->now < a->deadline_ms) {
        wake_at(t, a->deadline_ms);
        return SCOPE_BUSY;
    }
    const char *ot = str(sd, "on_timeout") ? str(sd, "on_timeout") : "";
    char line[300];
    snprintf(line, sizeof line, "step %s timed out waiting for a person (on_timeout %s)", a->step,
             ot[0] ? ot : "none");
    if (!strcmp(a->type, "approval_gate") && !strcmp(ot, "escalate")) {
        /* "escalated = parked, escalated to a higher clearance" (spec): the row stays pending
         * and decidable ("can remain in the queue", spec) with its floor one level up, as
         * EscalateAction leaves it. The window is spent: the gate waits for a decision, with
         * no timer left to escalate again. */
        int floor = 0;
        char why[340];
        if (a->approval[0])
            t->rc = st_gate_escalate_by(t->tx, a->approval, WF_ESCALATE_STEP, WF_CLEARANCE_MAX,
                                        "timed out", &floor, t->err, sizeof t->err);
        snprintf(why, sizeof why, "%s: escalated to clearance %d", line, floor);
        if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "WARN", why, t->err, sizeof t->err);
        if (!t->rc && a->approval[0])
            t->rc = st_audit(t->tx, t->run->org, "", a->approval, "gate.escalate", why, t->err,
                             sizeof t->err);
        if (t->rc) return SCOPE_BUSY;
        a->deadline_ms = 0;
        set_status(a, "escalated");
        save(t, a);
        return SCOPE_BUSY;
    }
    /* every other policy resolves the gate: the row closes as expired */
    if (a->approval[0]) t->rc = st_governance_expire(t->tx, a->approval, t->err, sizeof t->err);
    if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "WARN", line, t->err, sizeof t->err);
    if (t->rc) return SCOPE_BUSY;
    a->deadline_ms = 0;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "answered_by", "timeout");
    if (!strcmp(a->type, "approval_gate")) {
        cJSON_AddStringToObject(o, "decision", "rejected");
        cJSON_AddStringToObject(o, "decided_by", "timeout");
        set_output(a, o);
        set_status(a, "rejected");
        save(t, a);
        if (str(sd, "on_reject")) return SCOPE_DONE;
        snprintf(t->reason, sizeof t->reason, "step %s was rejected (timed out)", a->step);
        return SCOPE_FAILED;
    }
    int question = !strcmp(a->type, "question");
    if (!strcmp(ot, "default")) {
        const char *def = str(sd, question ? "default_option_key" : "default_choice");
        cJSON_AddStringToObject(o, question ? "option_key" : "choice", def ? def : "");
        if (question)
            cJSON_AddObjectToObject(o, "fields");
        else
            cJSON_AddStringToObject(o, "text", "");
        complete_act(t, a, o);
        return SCOPE_DONE;
    }
    if (!strcmp(ot, "continue")) {
        complete_act(t, a, o);
        return SCOPE_DONE;
    }
    cJSON_Delete(o);
    fail_act(t, a, "timeout", "nobody answered in time");
    return SCOPE_FAILED;
}

/* ---- waits ---- */

static int wait_timed_out(tick *t, act *a, const cJSON *sd) {
    if (a->deadline_ms <= 0 || t->now < a->deadline_ms) {
        wake_at(t, a->deadline_ms);
        return SCOPE_BUSY;
    }
    const char *ot = str(sd, "on_timeout");
    if (ot && !strcmp(ot, "continue")) {
        cJSON *o = a->output ? cJSON_Duplicate(a->output, 1) : cJSON_CreateObject();
        cJSON_DeleteItemFromObjectCaseSensitive(o, "timed_out");
        cJSON_AddBoolToObject(o, "timed_out", 1);
        complete_act(t, a, o);
        return SCOPE_DONE;
    }
    fail_act(t, a, "timeout", "the wait timed out");
    return SCOPE_FAILED;
}

static int advance_wait(tick *t, act *a, const cJSON *sd) {
    const char *mode = str(sd, "mode");
    if (mode && !strcmp(mode, "poll")) {
        const cJSON *poll = item(sd, "poll");
        if (a->result) { /* an observation arrived: evaluate `until` on it as our output */
            const cJSON *ok = item(a->result, "ok");
            a->polls++;
            a->clear_result = 1;
            if (cJSON_IsTrue(ok)) {
                set_output(a, cJSON_Duplicate(item(a->result, "result"), 1));
                state_put(t, a);
                if (wf_expr_holds(t->state, item(poll, "until"))) {
                    cJSON_Delete(a->result);
                    a->result = NULL;
                    complete_act(t, a, cJSON_Duplicate(a->output, 1));
                    return SCOPE_DONE;
                }
            }
            cJSON_Delete(a->result);
            a->result = NULL;
            a->next_poll_ms = t->now + (int64_t)num(poll, "interval_seconds", 60) * 1000;
            save(t, a);
        }
        int r = wait_timed_out(t, a, sd);
        if (r != SCOPE_BUSY) return r;
        if (a->next_poll_ms <= t->now) {
            char key[65];
            idem_key(t->run->id, a->step, a->lap, "poll", a->polls + 1, key);
            if (strcmp(a->key, key)) {
                snprintf(a->key, sizeof a->key, "%s", key);
                save(t, a);
            }
            char e2[300];
            cJSON *with = item(poll, "with")
                              ? wf_expr_render_tree(t->state, item(poll, "with"), e2, sizeof e2)
                              : cJSON_CreateObject();
            if (!with) {
                fail_act(t, a, "template", e2);
                return SCOPE_FAILED;
            }
            cJSON *keep = a->input;
            a->input = with;
            add_tool_job(t, a, str(poll, "tool"), str(poll, "action"), key);
            a->input = keep;
            cJSON_Delete(with);
        } else {
            wake_at(t, a->next_poll_ms);
        }
        return SCOPE_BUSY;
    }
    /* signal: the oldest buffered delivery on the key resolves the wait */
    char *payload = NULL;
    t->rc = st_delivery_take(t->tx, t->run->id, str(sd, "event_key"), a->id, &payload, t->err,
                             sizeof t->err);
    if (t->rc) return SCOPE_BUSY;
    if (payload) {
        cJSON *p = cJSON_Parse(payload);
        free(payload);
        if (!p || cJSON_IsNull(p)) {
            cJSON_Delete(p);
            p = cJSON_CreateObject();
        }
        complete_act(t, a, p);
        return SCOPE_DONE;
    }
    return wait_timed_out(t, a, sd);
}

static int start_wait(tick *t, act *a, const cJSON *sd) {
    const char *mode = str(sd, "mode");
    int poll = mode && !strcmp(mode, "poll");
    snprintf(a->blocked, sizeof a->blocked, "%s", poll ? "waiting-on-poll" : "waiting-on-signal");
    set_status(a, "waiting");
    a->started = 1;
    int tm = num(sd, "timeout_minutes", 0);
    if (tm > 0) a->deadline_ms = t->now + (int64_t)tm * 60000;
    a->next_poll_ms = poll ? t->now : 0;
    a->input = cJSON_CreateObject();
    if (!poll) cJSON_AddStringToObject(a->input, "event_key", str(sd, "event_key"));
    if (save(t, a)) return SCOPE_BUSY;
    return advance_wait(t, a, sd);
}

/* ---- outcomes ---- */

static int apply_tool_result(tick *t, act *a) {
    cJSON *r = a->result;
    a->result = NULL;
    a->clear_result = 1;
    if (cJSON_IsTrue(item(r, "ok"))) {
        const cJSON *res = item(r, "result");
        complete_act(t, a, res ? cJSON_Duplicate(res, 1) : cJSON_CreateObject());
        cJSON_Delete(r);
        return SCOPE_DONE;
    }
    char msg[400];
    snprintf(msg, sizeof msg, "%s: %s", str(r, "error_code") ? str(r, "error_code") : "error",
             str(r, "error_message") ? str(r, "error_message") : "");
    fail_act(t, a, str(r, "error_code") ? str(r, "error_code") : "error", msg);
    cJSON_Delete(r);
    return SCOPE_FAILED;
}

/* expects + acceptance: 0 accepted, else feedback in fb. */
static int accept_output(tick *t, act *a, const cJSON *sd, const cJSON *output, char *fb,
                         size_t fblen) {
    const cJSON *exp = item(sd, "expects");
    if (exp && wf_expr_check_fields(exp, output, "output", fb, fblen) != 0) return -1;
    const cJSON *acc = item(sd, "acceptance");
    const cJSON *check = item(acc, "check");
    if (!check) return 0;
    /* the check may read the step's own output */
    cJSON *keep = a->output;
    a->output = (cJSON *)output;
    state_put(t, a);
    int ok = wf_expr_holds(t->state, check);
    a->output = keep;
    state_put(t, a);
    if (ok) return 0;
    const char *tmpl = str(acc, "feedback");
    cJSON *r = NULL;
    if (tmpl) {
        cJSON *tmp = cJSON_Duplicate(t->state, 1);
        cJSON *s = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(tmp, "steps"),
                                                    a->step);
        if (s) {
            cJSON_DeleteItemFromObjectCaseSensitive(s, "output");
            cJSON_AddItemToObject(s, "output", cJSON_Duplicate(output, 1));
        }
        char e2[200];
        r = wf_expr_render(tmp, tmpl, e2, sizeof e2);
        cJSON_Delete(tmp);
    }
    snprintf(fb, fblen, "%s",
             r && cJSON_IsString(r) ? r->valuestring : "the output failed the acceptance check");
    cJSON_Delete(r);
    return -1;
}

/* Sends the attempt already keyed on `a` (a retry whose delay passed): the step's input and
 * feedback as they were, a fresh timeout, and the frozen ask again when the failed attempt
 * was resuming one. */
static int redispatch_agent(tick *t, act *a, const cJSON *sd) {
    st_agent_state *rs = calloc(1, sizeof *rs);
    if (!rs) return t->rc = DB_ENOMEM, SCOPE_BUSY;
    if ((t->rc = st_agent_state_get(t->tx, a->id, rs, t->err, sizeof t->err))) {
        free(rs);
        return SCOPE_BUSY;
    }
    a->resume = rs;
    a->next_poll_ms = 0;
    return send_agent(t, a, sd);
}

/* A retryable failure (the worker's ErrorEvent.retryable, a worker that could not be reached)
 * is tried again as a new attempt — attempt + 1, so a fresh idempotency key — after
 * UPSQUAD_WF_AGENT_RETRY_BACKOFF doubled per retry (at most ..._BACKOFF_MAX), up to
 * UPSQUAD_WF_AGENT_RETRIES per step. Returns 1 when a retry was scheduled, 0 when exhausted. */
static int retry_agent(tick *t, act *a, const cJSON *r) {
    const wf_config *c = t->e->cfg;
    int n = 0;
    if (c->agent_retries <= 0) return 0;
    if ((t->rc = st_agent_retry_take(t->tx, t->run->org, t->run->id, a->id, (int)c->agent_retries,
                                     &n, t->err, sizeof t->err)))
        return 1;
    if (n == 0) return 0;
    int64_t delay = c->agent_retry_backoff_ms;
    for (int i = 1; i < n && delay < c->agent_retry_backoff_max_ms; i++)
        delay *= 2;
    if (delay > c->agent_retry_backoff_max_ms) delay = c->agent_retry_backoff_max_ms;
    char line[700];
    snprintf(line, sizeof line, "step %s attempt %d failed (%s: %s); retry %d of %lld in %lld ms",
             a->step, a->attempt, str(r, "code") ? str(r, "code") : "failed",
             str(r, "message") ? str(r, "message") : "", n, c->agent_retries, (long long)delay);
    a->attempt++;
    idem_key(t->run->id, a->step, a->lap, "", a->attempt, a->key);
    a->next_poll_ms = t->now + delay; /* the walk dispatches it then (redispatch_agent) */
    a->deadline_ms = 0;
    wake_at(t, a->next_poll_ms);
    if (!save(t, a)) t->rc = wf_emit_log(t->run, a->id, "WARN", line, t->err, sizeof t->err);
    return 1;
}

static int apply_agent_result(tick *t, act *a, const cJSON *sd) {
    cJSON *r = a->result;
    a->result = NULL;
    a->clear_result = 1;
    a->add_cost += cJSON_IsNumber(item(r, "cost_usd")) ? item(r, "cost_usd")->valuedouble : 0;
    a->add_in += num(r, "input_tokens", 0);
    a->add_out += num(r, "output_tokens", 0);
    if (str(r, "agent_id")) snprintf(a->agent_id, sizeof a->agent_id, "%s", str(r, "agent_id"));
    const char *outcome = str(r, "outcome");
    int ret = SCOPE_BUSY;
    if (outcome && !strcmp(outcome, "completed")) {
        const cJSON *output = item(r, "output");
        char fb[600];
        if (accept_output(t, a, sd, output, fb, sizeof fb) == 0) {
            complete_act(t, a, cJSON_Duplicate(output, 1));
            ret = SCOPE_DONE;
        } else {
            const cJSON *acc = item(sd, "acceptance");
            int max_redos = num(acc, "max_redos", 0);
            st_agent_state as = {0};
            /* retries and resumed asks are attempts too, but not redos */
            if ((t->rc = st_agent_state_get(t->tx, a->id, &as, t->err, sizeof t->err))) {
                cJSON_Delete(r);
                return SCOPE_BUSY;
            }
            int redos = a->attempt - 1 - as.retries - as.resumes;
            st_agent_state_clear(&as);
            if (redos < max_redos) { /* redo with the feedback */
                char line[800];
                snprintf(line, sizeof line, "step %s redone (attempt %d): %s", a->step,
                         a->attempt + 1, fb);
                free(a->feedback);
                a->feedback = strdup(fb);
                set_output(a, cJSON_Duplicate(output, 1));
                t->rc = wf_emit_log(t->run, a->id, "WARN", line, t->err, sizeof t->err);
                /* a redo is a fresh turn: a frozen ask it came from is not resumed again */
                if (!t->rc) t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
                ret = start_agent(t, a, sd);
            } else if (str(acc, "on_exhausted") && !strcmp(str(acc, "on_exhausted"), "continue")) {
                complete_act(t, a, cJSON_Duplicate(output, 1));
                ret = SCOPE_DONE;
            } else {
                set_output(a, cJSON_Duplicate(output, 1));
                fail_act(t, a, "acceptance", fb);
                ret = SCOPE_FAILED;
            }
        }
    } else if (outcome &&
               (!strcmp(outcome, "input_required") || !strcmp(outcome, "interrupt_required"))) {
        /* parked: the governance row is what the next issue answers */
        cJSON *spec = cJSON_Duplicate(r, 1);
        /* the agent asks for itself (spec: asked_by_step): recorded on the row so GetRunPrompt
         * and the live frame attribute it as the node status event does */
        cJSON_DeleteItemFromObjectCaseSensitive(spec, "asked_by");
        cJSON_AddStringToObject(spec, "asked_by", asked_by_step(a));
        ids_uuid_v4(a->approval);
        snprintf(a->blocked, sizeof a->blocked, "%s", a->approval);
        set_status(a, "awaiting_approval");
        const char *kind = !strcmp(outcome, "input_required") ? "user_prompt" : "approval_gate";
        a->park_kind = kind;
        if (!save(t, a)) {
            char *sj = cJSON_PrintUnformatted(spec);
            t->rc = st_governance_insert(t->tx, a->approval, t->run->org, t->run->id, a->id, kind,
                                         0, sj, t->err, sizeof t->err);
            free(sj);
            if (!t->rc && !strcmp(kind, "user_prompt")) t->rc = prompt_frame(t, a, spec);
        }
        cJSON_Delete(spec);
    } else if (cJSON_IsTrue(item(r, "retryable")) && retry_agent(t, a, r)) {
        ret = SCOPE_BUSY;
    } else if (!t->rc) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s",
                 str(r, "message") ? str(r, "message") : "agent step failed");
        fail_act(t, a, str(r, "code") ? str(r, "code") : "failed", msg);
        ret = SCOPE_FAILED;
    }
    /* the step is over: its frozen ask (if any) is no longer needed */
    if (!t->rc && (ret == SCOPE_DONE || ret == SCOPE_FAILED))
        t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
    cJSON_Delete(r);
    return ret;
}

/* ---- the walk ---- */

static int walk_scope(tick *t, const char *entry, const char *lap, int iteration);

/* Every step reachable from entry (inner scopes included) is marked skipped in this lap. */
static void skip_from(tick *t, const char *entry, const char *lap, int iteration, int depth) {
    if (!entry || depth > 64 || t->rc) return;
    const cJSON *sd = step_def(t, entry);
    if (!sd || find(t, entry, lap)) return;
    act *a = new_act(t, entry, str(sd, "type") ? str(sd, "type") : "", lap, iteration, "skipped");
    if (!a || save(t, a)) return;
    static const char *const refs[] = {"next", "on_approve", "on_reject", "body", "then", "else"};
    for (size_t i = 0; i < sizeof refs / sizeof refs[0]; i++)
        skip_from(t, str(sd, refs[i]), lap, iteration, depth + 1);
    const cJSON *c;
    cJSON_ArrayForEach(c, item(sd, "branches")) {
        if (cJSON_IsString(c)) skip_from(t, c->valuestring, lap, iteration, depth + 1);
    }
    cJSON_ArrayForEach(c, item(sd, "options"))
        skip_from(t, str(c, "next"), lap, iteration, depth + 1);
}

/* Where a resolved step goes next. */
static const char *next_of(const cJSON *sd, const act *a) {
    const char *type = str(sd, "type");
    if (!strcmp(type, "approval_gate"))
        return !strcmp(a->status, "approved") ? str(sd, "on_approve") : str(sd, "on_reject");
    if (!strcmp(type, "user_input") || !strcmp(type, "question")) {
        const char *choice = str(a->output, !strcmp(type, "question") ? "option_key" : "choice");
        const cJSON *o;
        cJSON_ArrayForEach(o, item(sd, "options")) {
            const char *v = str(o, !strcmp(type, "question") ? "key" : "value");
            if (choice && v && !strcmp(choice, v) && str(o, "next")) return str(o, "next");
        }
    }
    return str(sd, "next");
}

static void lap_path(char *out, size_t n, const char *lap, int l) {
    if (lap[0])
        snprintf(out, n, "%s/%d", lap, l);
    else
        snprintf(out, n, "%d", l);
}

static int walk_loop(tick *t, act *a, const cJSON *sd) {
    int max = num(sd, "max_iterations", 1);
    for (;;) {
        int l = num(a->output, "iterations", 1);
        char sub[128];
        lap_path(sub, sizeof sub, a->lap, l);
        cJSON *prev = cJSON_DetachItemFromObjectCaseSensitive(t->state, "loop");
        cJSON *loop = cJSON_CreateObject();
        cJSON_AddNumberToObject(loop, "iteration", l);
        cJSON_AddNumberToObject(loop, "max_iterations", max);
        cJSON_AddItemToObject(t->state, "loop", loop);
        int r = walk_scope(t, str(sd, "body"), sub, l);
        int done = r == SCOPE_DONE &&
                   (l >= max || (item(sd, "until") && wf_expr_holds(t->state, item(sd, "until"))));
        cJSON_DeleteItemFromObjectCaseSensitive(t->state, "loop");
        if (prev) cJSON_AddItemToObject(t->state, "loop", prev);
        if (r == SCOPE_FAILED) {
            fail_act(t, a, "loop", "an iteration failed");
            return SCOPE_FAILED;
        }
        if (r == SCOPE_BUSY || t->rc) return SCOPE_BUSY;
        if (done) {
            complete_act(t, a, cJSON_Duplicate(a->output, 1));
            return SCOPE_DONE;
        }
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "iterations", l + 1);
        set_output(a, o);
        if (save(t, a)) return SCOPE_BUSY;
    }
}

static int walk_parallel(tick *t, act *a, const cJSON *sd) {
    int busy = 0, failed = 0;
    const cJSON *b;
    cJSON_ArrayForEach(b, item(sd, "branches")) {
        if (!cJSON_IsString(b)) continue;
        int r = walk_scope(t, b->valuestring, a->lap, a->iteration);
        if (r == SCOPE_FAILED) failed = 1;
        if (r == SCOPE_BUSY) busy = 1;
    }
    if (failed) { /* a failed branch fails the run */
        fail_act(t, a, "branch", "a branch failed");
        return SCOPE_FAILED;
    }
    if (busy || t->rc) return SCOPE_BUSY;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "branches", cJSON_GetArraySize(item(sd, "branches")));
    complete_act(t, a, o);
    return SCOPE_DONE;
}

static int walk_step(tick *t, const char *name, const char *lap, int iteration) {
    const cJSON *sd = step_def(t, name);
    const char *type = str(sd, "type");
    if (!sd || !type) return SCOPE_FAILED;
    act *a = find(t, name, lap);
    if (!a) {
        if (t->paused) return SCOPE_BUSY;                 /* pause: no new step starts */
        if (t->n >= (size_t)t->e->cfg->run_max_actions) { /* the run budget: fails the run */
            snprintf(t->budget, sizeof t->budget,
                     "run budget exceeded: step %s would be action %zu of at most %lld "
                     "(UPSQUAD_WF_RUN_MAX_ACTIONS)",
                     name, t->n + 1, t->e->cfg->run_max_actions);
            return SCOPE_FAILED;
        }
        const char *init = !strcmp(type, "condition") ? "completed" : "in_progress";
        if (!(a = new_act(t, name, type, lap, iteration, init))) return SCOPE_BUSY;
        if (!strcmp(type, "agent_action")) return start_agent(t, a, sd);
        if (!strcmp(type, "tool_action")) return start_tool(t, a, sd);
        if (!strcmp(type, "wait")) return start_wait(t, a, sd);
        if (!strcmp(type, "approval_gate") || !strcmp(type, "user_input") ||
            !strcmp(type, "question"))
            return start_gate(t, a, sd);
        if (!strcmp(type, "condition")) {
            int holds = wf_expr_holds(t->state, item(sd, "if"));
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "branch", holds ? "then" : "else");
            a->output = o;
            a->started = a->finished = 1;
            if (save(t, a)) return SCOPE_BUSY;
            /* the untaken arm's steps become skipped */
            skip_from(t, str(sd, holds ? "else" : "then"), lap, iteration, 0);
        } else { /* loop, parallel: containers in progress */
            cJSON *o = cJSON_CreateObject();
            if (!strcmp(type, "loop")) cJSON_AddNumberToObject(o, "iterations", 1);
            a->output = o;
            a->started = 1;
            if (save(t, a)) return SCOPE_BUSY;
        }
    }
    if (!strcmp(a->status, "failed") || !strcmp(a->status, "rejected")) {
        if (!strcmp(a->status, "rejected") && !str(sd, "on_reject"))
            snprintf(t->reason, sizeof t->reason, "step %s was rejected", name);
        else if (!strcmp(a->status, "rejected"))
            return SCOPE_DONE; /* routed by on_reject */
        return SCOPE_FAILED;
    }
    if (!strcmp(type, "condition")) {
        const char *arm = str(a->output, "branch");
        const char *entry = arm ? str(sd, arm) : NULL;
        return entry ? walk_scope(t, entry, lap, iteration) : SCOPE_DONE;
    }
    if (wf_raw_terminal(a->status)) return SCOPE_DONE;
    if (!strcmp(type, "loop")) return walk_loop(t, a, sd);
    if (!strcmp(type, "parallel")) return walk_parallel(t, a, sd);
    if (!strcmp(type, "wait")) return advance_wait(t, a, sd);
    if (!strcmp(a->status, "in_progress")) {
        if (!strcmp(type, "agent_action")) {
            if (a->result) return apply_agent_result(t, a, sd);
            if (a->next_poll_ms > 0) { /* a retry waiting out its delay */
                if (t->now >= a->next_poll_ms) return redispatch_agent(t, a, sd);
                wake_at(t, a->next_poll_ms);
                return SCOPE_BUSY;
            }
            if (a->deadline_ms > 0 && t->now >= a->deadline_ms) {
                t->rc = cancel_agent(t, a, "timeout");
                if (!t->rc) t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
                fail_act(t, a, "timeout", "the agent step timed out");
                return SCOPE_FAILED;
            }
            wake_at(t, a->deadline_ms);
            return SCOPE_BUSY;
        }
        if (!strcmp(type, "tool_action")) {
            if (a->result) return apply_tool_result(t, a);
            /* dispatched by a process whose gate was on: this one never sends it */
            if (fail_if_gated_off(t, a, str(sd, "tool"))) return SCOPE_FAILED;
            /* in progress without a result: (re)invoke with the same key; a provider returns
             * the recorded result for a key it has executed */
            add_tool_job(t, a, str(sd, "tool"), str(sd, "action"), a->key);
            return SCOPE_BUSY;
        }
    }
    if (!strcmp(type, "approval_gate") || !strcmp(type, "user_input") || !strcmp(type, "question"))
        return gate_timed_out(t, a, sd);
    return SCOPE_BUSY; /* parked on a person */
}

static int walk_scope(tick *t, const char *entry, const char *lap, int iteration) {
    const char *name = entry;
    int guard = 0;
    while (name && !t->rc) {
        if (++guard > 1024) return SCOPE_FAILED;
        int r = walk_step(t, name, lap, iteration);
        if (r != SCOPE_DONE) return r;
        const cJSON *sd = step_def(t, name);
        act *a = find(t, name, lap);
        if (!strcmp(str(sd, "type"), "condition") || !a) {
            name = str(sd, "next");
        } else {
            name = next_of(sd, a);
        }
    }
    return SCOPE_DONE;
}

/* ---- cancel ---- */

static int stop_open_actions(tick *t, const char *why) {
    t->rc = st_governance_close(t->tx, t->run->id, t->err, sizeof t->err);
    for (size_t i = 0; i < t->n && !t->rc; i++) {
        act *a = t->acts[i];
        if (wf_raw_terminal(a->status)) continue;
        if ((t->rc = cancel_agent(t, a, why))) break;
        /* an agent's frozen ask ends with its step */
        if (!strcmp(a->type, "agent_action") &&
            (t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err)))
            break;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "error", why);
        set_output(a, o);
        set_status(a, "failed");
        save(t, a);
    }
    return t->rc;
}

static void tick_init(tick *t, wf_engine *e, wf_run *run) {
    memset(t, 0, sizeof *t);
    t->e = e;
    t->run = run;
    t->tx = run->tx;
    t->now = wf_now_ms();
    t->state = cJSON_CreateObject();
    cJSON_AddItemToObject(t->state, "trigger", cJSON_Duplicate(run->context, 1));
    cJSON *r = cJSON_AddObjectToObject(t->state, "run");
    cJSON_AddStringToObject(r, "id", run->id);
    cJSON_AddStringToObject(r, "workflow_id", run->wf);
    cJSON_AddStringToObject(r, "triggered_by", run->triggered_by);
    Google__Protobuf__Timestamp ts;
    char buf[PBJSON_TS_MAX];
    pbjson_ts_from_ms(&ts, run->started_ms);
    pbjson_ts_to_rfc3339(&ts, buf, sizeof buf);
    cJSON_AddStringToObject(r, "started_at", buf);
    t->steps = cJSON_AddObjectToObject(t->state, "steps");
}

static void tick_free(tick *t) {
    for (size_t i = 0; i < t->n; i++)
        act_free(t->acts[i]), free(t->acts[i]);
    free(t->acts);
    for (int i = 0; i < t->n_jobs; i++)
        free(t->jobs[i].args);
    cJSON_Delete(t->state);
}

int wf_interp_cancel(wf_run *r, char *err, size_t errlen) {
    tick t;
    tick_init(&t, NULL, r);
    static wf_engine dummy;
    t.e = &dummy; /* metrics are NULL-safe */
    int rc = load_acts(&t);
    if (!rc) rc = stop_open_actions(&t, "cancelled");
    if (rc) snprintf(err, errlen, "%s", t.err);
    tick_free(&t);
    return rc;
}

/* ---- one tick ---- */

enum { TICK_LOST = -1, TICK_IDLE = 0, TICK_JOBS = 1, TICK_FINISHED = 2 };

/* Outcomes of the previous tick's tool requests, applied by the next tick of the same lease
 * (never written on their own: a crash before that tick commits re-requests with the key). */
static void apply_outcomes(tick *t, const job *done, char *const *results, int n_done) {
    for (int k = 0; k < n_done; k++) {
        for (size_t i = 0; i < t->n; i++) {
            act *a = t->acts[i];
            if (strcmp(a->id, done[k].action_id) || strcmp(a->key, done[k].key) || a->result)
                continue;
            if (!strcmp(a->status, "in_progress") || !strcmp(a->status, "waiting"))
                a->result = cJSON_Parse(results[k]);
        }
    }
}

/* Runs one tick; on TICK_JOBS the jobs are moved to *jobs (caller frees args). An idle tick
 * also frees the lease in its own transaction (the run sleeps until *wake_ms or a wake-up). */
static int run_tick(wf_engine *e, const char *run_id, const char *org, int64_t gen, const job *done,
                    char *const *results, int n_done, job *jobs, int *n_jobs, int64_t *wake_ms) {
    char err[512];
    db_tx *tx = NULL;
    wf_run run = {0};
    tick t;
    PGresult *run_row = NULL, *acts = NULL;
    int found = 0, held = 0, out = TICK_LOST;
    memset(&t, 0, sizeof t);
    *n_jobs = 0;
    *wake_ms = 0;
    /* lock order, everywhere: the run row, then its queue row, then its actions. Pipelined
     * (db.h): the tick's writes and its COMMIT go out together; every one of them is checked
     * by the commit, and nothing is acted on before the commit returned DB_OK. */
    if (st_begin_ex(e->pool, org, NULL, DB_TX_PIPELINE, &tx, err, sizeof err) ||
        st_tick_head(tx, run_id, e->instance, e->cfg->lease_ms, &run_row, &held, &acts, err,
                     sizeof err))
        goto done;
    wf_run_take(tx, run_row, &run, &found);
    run_row = NULL;
    if (!held) goto done;
    if (!found || wf_run_terminal(run.status)) {
        if (!st_queue_delete(tx, run_id, err, sizeof err) && !db_tx_commit(tx, err, sizeof err))
            out = TICK_FINISHED;
        tx = NULL;
        goto done;
    }
    tick_init(&t, e, &run);
    t.paused = !strcmp(run.status, "paused");
    t.rc = load_acts_from(&t, acts);
    acts = NULL;
    if (t.rc) goto done;
    apply_outcomes(&t, done, results, n_done);
    if (!strcmp(run.status, "pending") &&
        (t.rc = wf_run_transition(&run, "running", "", t.err, sizeof t.err)))
        goto done;
    int r = walk_scope(&t, str(run.def, "start"), "", 0);
    if (t.rc) goto done;
    int finished = 0;
    if (r == SCOPE_DONE && !t.paused) {
        t.rc = wf_run_transition(&run, "completed", "", t.err, sizeof t.err);
        finished = 1;
    } else if (r == SCOPE_FAILED) {
        if (!(t.rc = stop_open_actions(&t, "run failed")))
            t.rc = wf_run_transition(&run, "failed",
                                     t.budget[0]   ? t.budget
                                     : t.reason[0] ? t.reason
                                                   : "a step failed",
                                     t.err, sizeof t.err);
        finished = 1;
    }
    if (finished && !t.rc) {
        t.rc = st_queue_delete(tx, run_id, t.err, sizeof t.err);
        metric_inc(e->m_runs_finished);
    }
    if (!finished && !t.rc && t.n_jobs == 0)
        t.rc = st_queue_release(tx, run_id, e->instance, gen, t.wake_ms, t.err, sizeof t.err);
    if (t.rc || (t.rc = wf_run_flush(&run, t.err, sizeof t.err)) ||
        (t.rc = db_tx_commit(tx, t.err, sizeof t.err))) {
        tx = NULL;
        goto done;
    }
    tx = NULL;
    wf_engine_kick_relay(e);
    if (finished) {
        wf_engine_run_ended(e, run.status, run.started_ms);
        out = TICK_FINISHED;
        goto done;
    }
    for (int i = 0; i < t.n_jobs; i++) {
        jobs[i] = t.jobs[i];
        t.jobs[i].args = NULL;
    }
    *n_jobs = t.n_jobs;
    t.n_jobs = 0;
    *wake_ms = t.wake_ms;
    out = *n_jobs ? TICK_JOBS : TICK_IDLE;
done:
    if (t.rc) log_error("run.tick", "run=%s: %s (%s)", run_id, t.err, db_sqlstate());
    PQclear(acts);
    db_tx_rollback(tx);
    if (t.state) tick_free(&t);
    wf_run_free(&run);
    return out;
}

/* One tool call over NATS request/reply, retried with the same key; the outcome as JSON. */
static char *invoke_tool(wf_engine *e, const char *run_id, const char *org, const job *j) {
    Upsquad__Internal__V1__ToolInvokeRequest rq;
    Google__Protobuf__Struct *args = NULL;
    char subject[160], e2[256];
    upsquad__internal__v1__tool_invoke_request__init(&rq);
    cJSON *aj = cJSON_Parse(j->args);
    pbjson_struct_from_json(aj, &args, e2, sizeof e2);
    cJSON_Delete(aj);
    rq.idempotency_key = (char *)j->key;
    rq.org_id = (char *)org;
    rq.run_id = (char *)run_id;
    rq.step_name = (char *)j->step;
    rq.iteration = j->iteration;
    rq.tool = (char *)j->tool;
    rq.action = (char *)j->action;
    rq.arguments = args;
    rq.timeout_ms = (int32_t)e->cfg->tool_timeout_ms;
    rq.trace_id = (char *)j->key;
    size_t len = protobuf_c_message_get_packed_size(&rq.base);
    uint8_t *buf = malloc(len ? len : 1);
    protobuf_c_message_pack(&rq.base, buf);
    if (args) pbjson_struct_free(args);
    cJSON *out = cJSON_CreateObject();
    const char *code = "no_provider";
    int ok = 0;
    if (!bus_token_valid(j->tool)) code = "invalid_tool";
    snprintf(subject, sizeof subject, "%s.%s", SUBJ_TOOL_INVOKE, j->tool);
    for (long long at = 0;
         !ok && at < e->cfg->tool_attempts && !e->stop && strcmp(code, "invalid_tool"); at++) {
        natsMsg *reply = NULL;
        metric_inc(e->m_tool_calls);
        int rc = e->bus ? bus_request(e->bus, subject, buf, (int)len, (int)e->cfg->tool_timeout_ms,
                                      &reply)
                        : BUS_ECLOSED;
        if (rc == BUS_OK) {
            Upsquad__Internal__V1__ToolInvokeResponse *rs =
                upsquad__internal__v1__tool_invoke_response__unpack(
                    NULL, (size_t)natsMsg_GetDataLength(reply),
                    (const uint8_t *)natsMsg_GetData(reply));
            natsMsg_Destroy(reply);
            if (!rs) {
                code = "bad_reply";
                continue;
            }
            if (!rs->ok && rs->retryable && at + 1 < e->cfg->tool_attempts) {
                protobuf_c_message_free_unpacked(&rs->base, NULL);
                code = "retryable";
                continue;
            }
            cJSON_AddBoolToObject(out, "ok", rs->ok);
            cJSON_AddItemToObject(out, "result",
                                  rs->result ? pbjson_struct_to_json(rs->result)
                                             : cJSON_CreateObject());
            cJSON_AddStringToObject(out, "error_code", rs->error_code);
            cJSON_AddStringToObject(out, "error_message", rs->error_message);
            cJSON_AddBoolToObject(out, "replayed", rs->replayed);
            protobuf_c_message_free_unpacked(&rs->base, NULL);
            ok = 1;
        } else {
            code = rc == BUS_ETIMEOUT ? "timeout" : "no_provider";
            if (rc == BUS_ENORESP) usleep(200000);
        }
    }
    free(buf);
    if (!ok) {
        metric_inc(e->m_tool_failures);
        cJSON_AddBoolToObject(out, "ok", 0);
        cJSON_AddStringToObject(out, "error_code", code);
        cJSON_AddStringToObject(out, "error_message",
                                "the tool provider did not answer within its attempts");
    }
    char *s = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);
    return s;
}

static void release(wf_engine *e, const char *run_id, const char *org, int64_t gen,
                    int64_t wake_ms) {
    char err[512];
    db_tx *tx = NULL;
    if (st_begin_ex(e->pool, org, NULL, DB_TX_PIPELINE, &tx, err, sizeof err) ||
        st_queue_release(tx, run_id, e->instance, gen, wake_ms, err, sizeof err) ||
        db_tx_commit(tx, err, sizeof err))
        log_warn("run.release", "run=%s: %s", run_id, err);
}

typedef struct invoke_arg {
    wf_engine *e;
    const char *run_id, *org;
    const job *j;
    char *result;
} invoke_arg;

static void *invoke_thread(void *arg) {
    invoke_arg *a = arg;
    a->result = invoke_tool(a->e, a->run_id, a->org, a->j);
    return NULL;
}

/* Requests a tick's tool calls at once (one thread each, at most MAX_JOBS), so the tool steps
 * of parallel branches overlap; one call runs inline. */
static void invoke_all(wf_engine *e, const char *run_id, const char *org, const job *jobs,
                       char **results, int n) {
    invoke_arg args[MAX_JOBS];
    pthread_t th[MAX_JOBS];
    int started[MAX_JOBS] = {0};
    for (int k = 0; k < n; k++) {
        args[k] = (invoke_arg){e, run_id, org, &jobs[k], NULL};
        if (n > 1 && k > 0) started[k] = pthread_create(&th[k], NULL, invoke_thread, &args[k]) == 0;
        if (!started[k] && k > 0) invoke_thread(&args[k]);
    }
    invoke_thread(&args[0]);
    for (int k = 0; k < n; k++) {
        if (started[k]) pthread_join(th[k], NULL);
        results[k] = args[k].result;
    }
}

static void process_run(wf_engine *e, const char *run_id, const char *org, int64_t gen) {
    job jobs[MAX_JOBS], done[MAX_JOBS];
    char *results[MAX_JOBS];
    int n = 0, n_done = 0;
    int64_t wake = 0;
    for (int i = 0; i < TICKS_PER_CLAIM && !e->stop; i++) {
        int r = run_tick(e, run_id, org, gen, done, results, n_done, jobs, &n, &wake);
        for (int k = 0; k < n_done; k++) {
            free(results[k]);
            free(done[k].args);
        }
        n_done = 0;
        if (r != TICK_JOBS) return; /* idle (released), finished, or the lease was lost */
        invoke_all(e, run_id, org, jobs, results, n); /* parallel branches run concurrently */
        for (int k = 0; k < n; k++)
            done[k] = jobs[k];
        n_done = n;
    }
    for (int k = 0; k < n_done; k++) {
        free(results[k]);
        free(done[k].args);
    }
    release(e, run_id, org, gen, wf_now_ms());
}

static void idle_wait(wf_engine *e, long long ms) {
    struct timespec ts;
    util_deadline(&ts, ms);
    pthread_mutex_lock(&e->mu);
    /* only a run kick or the poll interval send an idle thread to claim (the relay and the
     * scheduler sleep on condition variables of their own) */
    while (!e->kick && !e->stop && pthread_cond_timedwait(&e->cv, &e->mu, &ts) != ETIMEDOUT) {
    }
    e->kick = 0;
    pthread_mutex_unlock(&e->mu);
}

void *wf_interp_thread(void *arg) {
    wf_engine *e = arg;
    char err[512];
    while (!e->stop) {
        db_tx *tx = NULL;
        PGresult *r = NULL;
        int claimed = 0;
        if (st_begin_service_ex(e->pool, DB_TX_PIPELINE, &tx, err, sizeof err) == DB_OK &&
            st_queue_claim(tx, e->instance, e->cfg->lease_ms, 1, &r, err, sizeof err) == DB_OK &&
            db_tx_commit(tx, err, sizeof err) == DB_OK) {
            tx = NULL;
            if (PQntuples(r) > 0) { /* more may be due: one more idle thread looks (a chain
                                     * that ends with the first claim finding nothing) */
                pthread_mutex_lock(&e->mu);
                e->kick = 1;
                pthread_cond_signal(&e->cv);
                pthread_mutex_unlock(&e->mu);
            }
            for (int i = 0; i < PQntuples(r); i++) {
                claimed++;
                char run_id[37], org[37];
                snprintf(run_id, sizeof run_id, "%s", st_s(r, i, 0));
                snprintf(org, sizeof org, "%s", st_s(r, i, 1));
                process_run(e, run_id, org, st_i(r, i, 2));
            }
        } else if (tx) {
            log_warn("run.claim", "%s", err);
        }
        db_tx_rollback(tx);
        PQclear(r);
        if (!claimed) idle_wait(e, e->cfg->idle_poll_ms);
    }
    return NULL;
}

/* ---- agent results ---- */

/* The agent's question (InputRequired.question_spec: {question, options[], allow_text}) as the
 * prompt the governance row poses: `question`, `options` as [{value, label}] (a bare string is
 * both), `allow_text` (true unless the agent said false). The checkpoint never goes here. */
static void ask_spec(cJSON *o, const Upsquad__Runtime__V1__InputRequired *ir) {
    cJSON_AddStringToObject(o, "tool_call_id", ir->tool_call_id);
    /* an agent that posed no spec sends empty bytes (data NULL): the prompt is text-only */
    char *txt = ir->question_spec.len
                    ? strndup((const char *)ir->question_spec.data, ir->question_spec.len)
                    : NULL;
    cJSON *q = txt ? cJSON_Parse(txt) : NULL, *opts = cJSON_CreateArray();
    const cJSON *it;
    free(txt);
    if (str(q, "question")) cJSON_AddStringToObject(o, "question", str(q, "question"));
    cJSON_ArrayForEach(it, item(q, "options")) {
        const char *v = cJSON_IsString(it) ? it->valuestring : str(it, "value");
        const char *l = cJSON_IsString(it) ? it->valuestring : str(it, "label");
        if (!v || !v[0]) continue;
        cJSON *x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "value", v);
        cJSON_AddStringToObject(x, "label", l ? l : v);
        cJSON_AddItemToArray(opts, x);
    }
    cJSON_AddItemToObject(o, "options", opts);
    cJSON_AddBoolToObject(o, "allow_text", !cJSON_IsFalse(item(q, "allow_text")));
    if (str(q, "answerable_by"))
        cJSON_AddStringToObject(o, "answerable_by", str(q, "answerable_by"));
    cJSON_Delete(q);
}

static char *result_json(const Upsquad__Internal__V1__AgentStepResult *m) {
    cJSON *o = cJSON_CreateObject();
    const char *outcome = "failed";
    switch (m->outcome_case) {
    case UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_COMPLETED:
        outcome = "completed";
        cJSON_AddItemToObject(o, "output",
                              m->completed->output ? pbjson_struct_to_json(m->completed->output)
                                                   : cJSON_CreateObject());
        if (!m->completed->output) {
            cJSON_DeleteItemFromObjectCaseSensitive(o, "output");
            cJSON *x = cJSON_AddObjectToObject(o, "output");
            cJSON_AddStringToObject(x, "text", m->completed->text);
        }
        cJSON_AddStringToObject(o, "text", m->completed->text);
        break;
    case UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_FAILED:
        cJSON_AddStringToObject(o, "code", m->failed->code);
        cJSON_AddStringToObject(o, "message", m->failed->message);
        cJSON_AddBoolToObject(o, "retryable", m->failed->retryable);
        break;
    case UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INPUT_REQUIRED:
        outcome = "input_required";
        ask_spec(o, m->input_required);
        break;
    case UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INTERRUPT_REQUIRED:
        outcome = "interrupt_required";
        break;
    default:
        break;
    }
    cJSON_AddStringToObject(o, "outcome", outcome);
    cJSON_AddStringToObject(o, "session_id", m->session_id);
    cJSON_AddStringToObject(o, "agent_id", m->agent_id);
    cJSON_AddNumberToObject(o, "attempt", m->attempt);
    if (m->usage) {
        cJSON_AddNumberToObject(o, "cost_usd", m->usage->cost_usd);
        cJSON_AddNumberToObject(o, "input_tokens", m->usage->input_tokens);
        cJSON_AddNumberToObject(o, "output_tokens", m->usage->output_tokens);
        cJSON_AddStringToObject(o, "model", m->usage->model);
    }
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* An ask_user park (InputRequired with a checkpoint): the frozen turn is kept with the action,
 * in the transaction that records the result, for the AskUserResume of the answer. It never
 * enters the result JSON, the governance row's spec or any event. */
static int keep_ask(db_tx *tx, const Upsquad__Internal__V1__AgentStepResult *m, char *err,
                    size_t errlen) {
    if (m->outcome_case != UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INPUT_REQUIRED)
        return DB_OK;
    if (m->input_required->checkpoint.len == 0) /* nothing to resume: an earlier ask is over */
        return st_agent_ask_clear(tx, m->action_id, err, errlen);
    return st_agent_ask_put(tx, m->org_id, m->run_id, m->action_id, m->input_required->tool_call_id,
                            m->input_required->checkpoint.data, m->input_required->checkpoint.len,
                            err, errlen);
}

/* 0: handled (ack), -1: retry later (nak). */
static int take_result(wf_engine *e, natsMsg *msg) {
    char err[512];
    Upsquad__Internal__V1__AgentStepResult *m = upsquad__internal__v1__agent_step_result__unpack(
        NULL, (size_t)natsMsg_GetDataLength(msg), (const uint8_t *)natsMsg_GetData(msg));
    if (!m) return 0; /* poison: dropped */
    int rc = 0, applied = 0;
    if (ids_uuid_valid(m->org_id) && ids_uuid_valid(m->run_id) && ids_uuid_valid(m->action_id)) {
        char *json = result_json(m);
        db_tx *tx = NULL;
        /* queue row before action row: the order a tick takes them in */
        if (st_begin(e->pool, m->org_id, NULL, &tx, err, sizeof err) ||
            st_queue_wake(tx, m->run_id, err, sizeof err) ||
            st_action_put_result(tx, m->action_id, m->idempotency_key, json, &applied, err,
                                 sizeof err) ||
            (applied && keep_ask(tx, m, err, sizeof err)) || db_tx_commit(tx, err, sizeof err)) {
            log_warn("agent.result", "run=%s action=%s: %s", m->run_id, m->action_id, err);
            rc = -1;
        }
        free(json);
    }
    protobuf_c_message_free_unpacked(&m->base, NULL);
    if (applied) wf_engine_kick(e);
    return rc;
}

void *wf_results_thread(void *arg) {
    wf_engine *e = arg;
    char err[256];
    while (!e->stop) {
        natsMsgList list = {0};
        if (bus_js_fetch(e->result_sub, 16, 500, &list, err, sizeof err) != BUS_OK) {
            usleep(200000);
            continue;
        }
        for (int i = 0; i < list.Count; i++) {
            if (take_result(e, list.Msgs[i]) == 0)
                bus_ack(list.Msgs[i]);
            else
                bus_nak(list.Msgs[i], 500);
        }
        natsMsgList_Destroy(&list);
    }
    return NULL;
}

/* ---- schedules ---- */

/* One cron field into a Postgres int array text; *star when it was "*". */
static int cron_field(const char *f, int lo, int hi, char *out, size_t outlen, int *star) {
    unsigned char set[64] = {0};
    char buf[128];
    snprintf(buf, sizeof buf, "%s", f);
    *star = !strcmp(f, "*");
    for (char *save = NULL, *part = strtok_r(buf, ",", &save); part;
         part = strtok_r(NULL, ",", &save)) {
        int a = lo, b = hi, step = 1;
        char *slash = strchr(part, '/');
        if (slash) {
            *slash = 0;
            char *end;
            step = (int)strtol(slash + 1, &end, 10);
            if (*end || step <= 0) return -1;
        }
        if (strcmp(part, "*")) {
            char *end;
            a = (int)strtol(part, &end, 10);
            if (end == part) return -1;
            b = a;
            if (*end == '-') {
                char *e2;
                b = (int)strtol(end + 1, &e2, 10);
                if (e2 == end + 1 || *e2) return -1;
            } else if (*end) {
                return -1;
            } else if (slash) {
                b = hi;
            }
        }
        if (a < lo || b > hi || a > b) return -1;
        for (int v = a; v <= b; v += step)
            set[v] = 1;
    }
    size_t o = 0;
    out[o++] = '{';
    for (int v = lo; v <= hi; v++)
        if (set[v])
            o += (size_t)snprintf(out + o, outlen - o, "%s%d", o > 1 ? "," : "",
                                  v % (hi == 7 ? 7 : 1000));
    if (o == 1) return -1;
    out[o++] = '}';
    out[o] = 0;
    return 0;
}

/* The usual cron macros, as their five fields. NULL: not a macro. */
static const char *cron_macro(const char *m) {
    static const char *const names[][2] = {{"@yearly", "0 0 1 1 *"},  {"@annually", "0 0 1 1 *"},
                                           {"@monthly", "0 0 1 * *"}, {"@weekly", "0 0 * * 0"},
                                           {"@daily", "0 0 * * *"},   {"@midnight", "0 0 * * *"},
                                           {"@hourly", "0 * * * *"}};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
        if (!strcmp(m, names[i][0])) return names[i][1];
    return NULL;
}

/* "interval": a duration string ("90s", "15m", "1h", "1d"; a bare number is seconds) as
 * seconds; -1 when it is not one. */
static double interval_of(const char *s) {
    char *end = NULL;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return -1;
    double unit = !*end || !strcmp(end, "s") ? 1
                  : !strcmp(end, "m")        ? 60
                  : !strcmp(end, "h")        ? 3600
                  : !strcmp(end, "d")        ? 86400
                                             : -1;
    return unit < 0 ? -1 : v * unit;
}

int wf_schedule_next(db_pool *p, const char *spec_json, int64_t after_ms, int64_t *next_ms,
                     char *err, size_t errlen) {
    cJSON *spec = cJSON_Parse(spec_json);
    int rc = -1;
    const cJSON *iv = item(spec, "interval_seconds");
    const char *cron = str(spec, "cron"), *macro = cron ? cron_macro(cron) : NULL;
    const char *tz = str(spec, "timezone") ? str(spec, "timezone") : "UTC";
    /* interval_seconds, or "interval" as a duration; -1: neither */
    double secs = !iv ? -1 : cJSON_IsNumber(iv) ? iv->valuedouble : 0;
    if (macro) cron = macro;
    if (!iv && str(spec, "interval") && (secs = interval_of(str(spec, "interval"))) <= 0) {
        snprintf(err, errlen,
                 "interval must be a duration such as \"90s\", \"15m\", \"1h\" or "
                 "\"1d\"");
        goto done;
    }
    if (!cJSON_IsObject(spec)) {
        snprintf(err, errlen, "must be an object");
    } else if (secs >= 0) {
        if (secs < 1 || secs > 86400 * 366 || secs != (double)(int64_t)secs) {
            snprintf(err, errlen,
                     "interval_seconds (or interval) must be a whole number of "
                     "seconds from 1 to 31622400");
        } else {
            int64_t step = (int64_t)secs * 1000;
            *next_ms = (after_ms / step + 1) * step; /* epoch-aligned slots */
            rc = 0;
        }
    } else if (!cron) {
        snprintf(err, errlen, "cron (\"m h dom mon dow\") or interval_seconds is required");
    } else {
        char f[5][64], arr[5][256];
        int stars[5];
        static const int lo[] = {0, 0, 1, 1, 0}, hi[] = {59, 23, 31, 12, 7};
        if (sscanf(cron, "%63s %63s %63s %63s %63s", f[0], f[1], f[2], f[3], f[4]) != 5) {
            snprintf(err, errlen, "cron must have five fields: minute hour day month weekday");
            goto done;
        }
        for (int i = 0; i < 5; i++)
            if (cron_field(f[i], lo[i], hi[i], arr[i], sizeof arr[i], &stars[i]) != 0) {
                snprintf(err, errlen, "cron field %d (\"%s\") is not valid", i + 1, f[i]);
                goto done;
            }
        char e2[256];
        if (st_cron_next(p, arr[0], arr[1], arr[2], arr[3], arr[4], stars[2], stars[4], tz,
                         after_ms, next_ms, e2, sizeof e2) != DB_OK) {
            snprintf(err, errlen, "timezone \"%s\" is not known", tz);
            goto done;
        }
        if (*next_ms < 0) {
            snprintf(err, errlen, "cron never fires within 400 days");
            goto done;
        }
        rc = 0;
    }
done:
    cJSON_Delete(spec);
    return rc;
}

/* Fires one due schedule; 1 when one was handled. A (workflow, slot) firing row makes each
 * firing start exactly one run however many replicas see it. */
static int fire_one(wf_engine *e) {
    char err[512], run_id[37], wf[37], org[37];
    db_tx *tx = NULL;
    PGresult *r = NULL, *w = NULL;
    wf_run run = {0};
    int handled = 0, inserted = 0, found = 0;
    if (st_begin_service(e->pool, &tx, err, sizeof err) ||
        st_schedule_due(tx, &r, err, sizeof err) || PQntuples(r) == 0)
        goto done;
    handled = 1;
    snprintf(wf, sizeof wf, "%s", st_s(r, 0, 0));
    snprintf(org, sizeof org, "%s", st_s(r, 0, 1));
    int64_t slot = st_i(r, 0, 3), next = 0;
    if (st_scope_org(tx, org, err, sizeof err) || st_wf_row(tx, wf, &w, err, sizeof err)) goto fail;
    if (PQntuples(w) == 0 || !st_null(w, 0, WF_DELETED_AT) || !st_b(w, 0, WF_ENABLED) ||
        strcmp(st_s(w, 0, WF_STATUS), "archived") == 0) {
        if (st_schedule_drop(tx, wf, err, sizeof err)) goto fail;
    } else {
        ids_uuid_v7(run_id);
        if (st_firing_insert(tx, org, wf, slot, run_id, &inserted, err, sizeof err)) goto fail;
        if (inserted && (st_run_insert(tx, run_id, org, wf, NULL, "{}", st_s(w, 0, WF_DEF), NULL,
                                       err, sizeof err) ||
                         wf_run_load(tx, run_id, 1, &run, &found, err, sizeof err) ||
                         wf_run_transition(&run, "pending", "schedule", err, sizeof err) ||
                         wf_run_flush(&run, err, sizeof err)))
            goto fail;
        int64_t now = wf_now_ms();
        if (wf_schedule_next(e->pool, st_s(r, 0, 2), now > slot ? now : slot, &next, err,
                             sizeof err) ||
            st_schedule_advance(tx, wf, next, err, sizeof err))
            goto fail;
    }
    if (db_tx_commit(tx, err, sizeof err)) {
        tx = NULL;
        goto fail;
    }
    tx = NULL;
    if (inserted) {
        log_info("schedule.fired", "workflow=%s run=%s", wf, run_id);
        metric_inc(e->m_runs_started);
        wf_engine_kick(e);
    }
    goto done;
fail:
    log_warn("schedule.fire", "workflow=%s: %s", wf, err);
    handled = 0; /* back off for a poll period rather than spin on a failing schedule */
done:
    db_tx_rollback(tx);
    wf_run_free(&run);
    PQclear(r);
    PQclear(w);
    return handled;
}

void *wf_scheduler_thread(void *arg) {
    wf_engine *e = arg;
    while (!e->stop) {
        if (!fire_one(e)) {
            struct timespec ts;
            util_deadline(&ts, e->cfg->schedule_poll_ms);
            pthread_mutex_lock(&e->mu); /* only stop or the interval end this */
            while (!e->stop && pthread_cond_timedwait(&e->sched_cv, &e->mu, &ts) != ETIMEDOUT) {
            }
            pthread_mutex_unlock(&e->mu);
        }
    }
    return NULL;
}

/* ---- a person's decision on a parked gate (gates.c) ---- */

/* How a parked agent's answer reaches its turn. An ask_user with its frozen turn kept
 * (keep_ask): AskUserResume = that checkpoint + answer_tool_result {tool_call_id, result: the
 * recorded answer {choice, text, answered_by}}, built from the durable answer so a replay sends
 * the same bytes; the prompt is unchanged (the worker resumes the same turn). Anything else (an
 * approved interrupt, an ask without a checkpoint): a fresh turn whose feedback carries the
 * answer. Either way a resumed attempt is not an acceptance redo. */
static int resume_agent_turn(tick *t, act *a, const char *output_json) {
    st_agent_state *rs = calloc(1, sizeof *rs);
    char *answer = NULL;
    int rc = rs ? st_agent_state_get(t->tx, a->id, rs, t->err, sizeof t->err) : DB_ENOMEM;
    if (rc) goto done;
    if (rs->checkpoint && rs->tool_call_id[0]) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "tool_call_id", rs->tool_call_id);
        cJSON *res = cJSON_Parse(output_json ? output_json : "{}");
        cJSON_AddItemToObject(o, "result", res ? res : cJSON_CreateObject());
        answer = cJSON_PrintUnformatted(o);
        cJSON_Delete(o);
        if (!answer) {
            rc = DB_ENOMEM;
            goto done;
        }
        free(rs->answer);
        rs->answer = strdup(answer);
        a->resume = rs;
        rs = NULL;
    } else {
        char fb[1200];
        snprintf(fb, sizeof fb, "A person answered your request: %s",
                 output_json ? output_json : "{}");
        free(a->feedback);
        a->feedback = strdup(fb);
    }
    rc = st_agent_resume_put(t->tx, t->run->org, t->run->id, a->id, answer, t->err, sizeof t->err);
done:
    if (rs) st_agent_state_clear(rs);
    free(rs);
    cJSON_free(answer);
    return t->rc = rc;
}

int wf_interp_decide(wf_engine *e, wf_run *r, const char *action_id, const char *status,
                     const char *output_json, char **new_ids, char *err, size_t errlen) {
    tick t;
    tick_init(&t, e, r);
    t.paused = !strcmp(r->status, "paused");
    *new_ids = NULL;
    int rc = load_acts(&t);
    act *a = NULL;
    for (size_t i = 0; !rc && i < t.n; i++)
        if (!strcmp(t.acts[i]->id, action_id)) a = t.acts[i];
    if (!rc && !a) {
        snprintf(t.err, sizeof t.err, "action %s is not in run %s", action_id, r->id);
        rc = DB_EINVAL;
    }
    int resume_agent = !rc && !strcmp(a->type, "agent_action") &&
                       (!strcmp(status, "completed") || !strcmp(status, "approved"));
    if (resume_agent) {
        /* an agent that asked a person (input_required / interrupt_required): its turn goes
         * on as a new attempt; the step's output stays the agent's to give */
        rc = resume_agent_turn(&t, a, output_json);
        a->blocked[0] = 0;
        const char *keep = a->step;
        if (!rc) start_agent(&t, a, step_def(&t, keep));
        rc = t.rc;
    } else if (!rc) {
        if (output_json) set_output(a, cJSON_Parse(output_json));
        set_status(a, status);
        a->deadline_ms = strcmp(status, "escalated") ? 0 : a->deadline_ms;
        rc = save(&t, a);
    }
    size_t n0 = t.n;
    /* walk now, like a tick would: the steps the decision starts are created in this same
     * transaction (the caller's next_actions); side effects are left to the run's next tick,
     * which the caller wakes (a tool call is re-requested with its key) */
    if (!rc && strcmp(status, "escalated")) {
        walk_scope(&t, str(r->def, "start"), "", 0);
        rc = t.rc;
    }
    if (!rc) {
        size_t len = 3, k = 0;
        for (size_t i = n0; i < t.n; i++)
            len += 38;
        char *ids = malloc(len);
        if (!ids) {
            rc = DB_ENOMEM;
        } else {
            ids[k++] = '{';
            for (size_t i = n0; i < t.n; i++)
                k += (size_t)sprintf(ids + k, "%s%s", i > n0 ? "," : "", t.acts[i]->id);
            ids[k++] = '}';
            ids[k] = 0;
            *new_ids = ids;
        }
    }
    if (rc) snprintf(err, errlen, "%s", t.err[0] ? t.err : "cannot apply the decision");
    tick_free(&t);
    return rc;
}
