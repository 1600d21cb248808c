/* The durable interpreter (interp.h; docs/workflow-engine.md "Run model").
 *
 * A run is advanced in ticks by whichever replica holds its lease (run_queue). A tick runs
 * inside a transaction, with its statements scoped to the run's org: fence the lease, load the
 * run and its actions, walk the
 * definition from `start` recomputing where the run stands from the actions table (the single
 * durable truth), apply outcomes that arrived (agent results, tool results, events), create the
 * actions that become due, and write every transition with its outbox event. Side effects
 * happen only after that commit: agent steps are outbox rows (published with the idempotency
 * key as JetStream message id), tool calls are NATS requests made after the commit and
 * recorded in a second transaction, retried with the same key. A crash at any point leaves
 * either the transition uncommitted (nothing happened) or committed with its side effect keyed
 * (a replay returns the recorded result). One transaction may carry the ticks of several
 * leased runs, of any orgs (group commit, interp_loop.c). */
#include "interp_int.h"

/* ---- small helpers ---- */

static size_t def_slot(const cJSON *const *idx, size_t cap, const char *name) {
    size_t i = (size_t)util_fnv1a(UTIL_FNV1A_INIT, name, strlen(name)) & (cap - 1);
    while (idx[i] && strcmp(idx[i]->string, name))
        i = (i + 1) & (cap - 1);
    return i;
}

/* A step's definition by name. cJSON objects are lists: the walk visits every step of a long
 * chain each tick, so the tick indexes the definition's steps once (a hash table at most half
 * full) instead of scanning the list for each lookup. */
const cJSON *interp__step_def(tick *t, const char *name) {
    const cJSON *steps = item(t->run->def, "steps");
    if (!name || !cJSON_IsObject(steps)) return NULL;
    if (!t->def_idx) {
        size_t cap = 16;
        while (cap < (size_t)cJSON_GetArraySize(steps) * 2)
            cap *= 2;
        if (!(t->def_idx = calloc(cap, sizeof *t->def_idx))) return item(steps, name);
        t->def_cap = cap;
        const cJSON *c;
        cJSON_ArrayForEach(c, steps) { /* a duplicate name: the first wins, as item() would */
            size_t i = def_slot(t->def_idx, cap, c->string);
            if (!t->def_idx[i]) t->def_idx[i] = c;
        }
    }
    return t->def_idx[def_slot(t->def_idx, t->def_cap, name)];
}

void interp__wake_at(tick *t, int64_t ms) {
    if (ms > 0 && (t->wake_ms == 0 || ms < t->wake_ms)) t->wake_ms = ms;
}

void interp__idem_key(const char *run, const char *step, const char *lap, const char *what, int n,
                      char out[65]) {
    char buf[1024];
    /* sha256(run_id:step_name:iteration:attempt) (the design's key); the lap path stands for the
     * iteration so nested loops never collide */
    int len = snprintf(buf, sizeof buf, "%s:%s:%s:%s%d", run, step, lap[0] ? lap : "0", what, n);
    ids_sha256_hex(buf, (size_t)(len < (int)sizeof buf ? len : (int)sizeof buf - 1), out);
}

void interp__act_free(act *a) {
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

/* The tick's index of its actions by (step, lap): open addressing, at most half full, so the
 * walk's lookups cost the same however many actions the tick holds. */
static size_t act_slot(act *const *idx, size_t cap, const char *step, const char *lap) {
    uint64_t h = util_fnv1a(UTIL_FNV1A_INIT, step, strlen(step));
    h = util_fnv1a(h, "/", 1);
    h = util_fnv1a(h, lap, strlen(lap));
    size_t i = (size_t)h & (cap - 1);
    while (idx[i] && (strcmp(idx[i]->step, step) || strcmp(idx[i]->lap, lap)))
        i = (i + 1) & (cap - 1);
    return i;
}

/* Room for one more action in the index; -1 out of memory (nothing changed). */
static int index_reserve(tick *t) {
    if ((t->n + 1) * 2 <= t->idx_cap) return 0;
    size_t cap = t->idx_cap ? t->idx_cap * 2 : 64;
    act **idx = calloc(cap, sizeof *idx);
    if (!idx) return -1;
    for (size_t i = 0; i < t->n; i++) /* in creation order: a later (step, lap) wins */
        idx[act_slot(idx, cap, t->acts[i]->step, t->acts[i]->lap)] = t->acts[i];
    free(t->idx);
    t->idx = idx;
    t->idx_cap = cap;
    return 0;
}

act *interp__find(tick *t, const char *step, const char *lap) {
    return t->idx_cap ? t->idx[act_slot(t->idx, t->idx_cap, step, lap)] : NULL;
}

static cJSON *state_of(const act *a) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "status", a->status);
    if (a->output) cJSON_AddItemToObject(s, "output", cJSON_Duplicate(a->output, 1));
    return s;
}

/* The run state's view of one step: its latest lap. */
void interp__state_put(tick *t, act *a) {
    cJSON_DeleteItemFromObjectCaseSensitive(t->steps, a->step);
    cJSON_AddItemToObject(t->steps, a->step, state_of(a));
}

const char *interp__gov_kind(const act *a) {
    /* an agent's ask_user is a user_prompt (needs_input), its interrupt an approval */
    if (a->park_kind) return a->park_kind;
    if (!strcmp(a->type, "question")) return "question_gate";
    if (!strcmp(a->type, "user_input")) return "user_prompt";
    return "approval_gate";
}

/* The agent step a parked action is attributed to (spec: asked_by_step): an agent that parked
 * itself (ask_user, interrupt) asks for itself; a gate names it with the DSL's asked_by, which
 * start_gate fills in when the definition leaves it out. */
const char *interp__asked_by_step(const act *a) {
    if (!strcmp(a->type, "agent_action")) return a->step;
    return str(a->input, "asked_by");
}

/* The spec's fallback for a gate without a declared asked_by: the last agent step the run
 * completed (in the order the actions were created), or NULL before any agent turn. */
const char *interp__last_agent_step(const tick *t) {
    for (size_t i = t->n; i-- > 0;)
        if (!strcmp(t->acts[i]->type, "agent_action") && !strcmp(t->acts[i]->status, "completed"))
            return t->acts[i]->step;
    return NULL;
}

/* The asking step's agent_role (spec: asked_by_role), the one attribution the node status
 * event, the live prompt frame and GetRunPrompt (from the row's spec.asked_by) all report;
 * NULL when the action is not attributed. */
static const char *asked_role(tick *t, const char *asked) {
    return asked ? str(interp__step_def(t, asked), "agent_role") : NULL;
}

/* Writes the action (insert or update) and its transition event. */
int interp__save(tick *t, act *a) {
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
                           ? interp__gov_kind(a)
                           : NULL;
    const char *asked = kind ? interp__asked_by_step(a) : NULL;
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
    interp__state_put(t, a);
    t->rc = rc;
    return rc;
}

act *interp__new_act(tick *t, const char *step, const char *type, const char *lap, int iteration,
                     const char *status) {
    /* actions are allocated one by one: callers keep pointers across walks that add more */
    if (index_reserve(t)) return NULL;
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
    if (!a->step || !a->type || !a->lap) {
        interp__act_free(a);
        free(a);
        t->n--;
        return NULL;
    }
    t->idx[act_slot(t->idx, t->idx_cap, a->step, a->lap)] = a;
    a->iteration = iteration;
    snprintf(a->status, sizeof a->status, "%s", status);
    a->is_new = 1;
    t->n_new++;
    a->feedback = strdup("");
    return a;
}

void interp__set_status(act *a, const char *status) {
    snprintf(a->status, sizeof a->status, "%s", status);
    if (wf_raw_terminal(status)) a->finished = 1;
}

void interp__set_output(act *a, cJSON *out) {
    cJSON_Delete(a->output);
    if (out && !cJSON_IsObject(out)) { /* an output envelope is an object */
        cJSON *o = cJSON_CreateObject();
        cJSON_AddItemToObject(o, "value", out);
        out = o;
    }
    a->output = out;
}

void interp__fail_act(tick *t, act *a, const char *code, const char *msg) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "error", code);
    cJSON_AddStringToObject(o, "message", msg);
    interp__set_output(a, o);
    interp__set_status(a, "failed");
    snprintf(t->reason, sizeof t->reason, "step %s failed: %s", a->step, msg);
    interp__save(t, a);
    char line[700];
    snprintf(line, sizeof line, "step %s failed: %s", a->step, msg);
    if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "ERROR", line, t->err, sizeof t->err);
}

void interp__complete_act(tick *t, act *a, cJSON *output) {
    interp__set_output(a, output);
    interp__set_status(a, "completed");
    interp__save(t, a);
}

/* ---- loading ---- */

int interp__load_acts(tick *t) {
    PGresult *r = NULL;
    int rc = st_actions_load(t->tx, t->run->id, &r, t->err, sizeof t->err);
    if (rc) return rc;
    return interp__load_acts_from(t, r);
}

/* The run's actions from st_actions_load's rows (IA_*); takes ownership of r (cleared). */
int interp__load_acts_from(tick *t, PGresult *r) {
    for (int i = 0; i < PQntuples(r); i++) {
        act *a = interp__new_act(t, st_s(r, i, IA_STEP), st_s(r, i, IA_TYPE), st_s(r, i, IA_LAP),
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
        /* one row per step (st_actions_load): added without looking for an earlier one */
        cJSON_AddItemToObject(t->steps, a->step, state_of(a));
    }
    t->n_new = 0; /* loaded, not created */
    PQclear(r);
    return DB_OK;
}

/* ---- side effects queued during a tick ---- */

void interp__add_tool_job(tick *t, act *a, const char *tool, const char *action, const char *key) {
    if (t->n_jobs >= MAX_JOBS) { /* bounded: the rest wait for the next tick */
        interp__wake_at(t, t->now);
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
    int rc = st_outbox_put(t->tx, t->run->org, subject, msg_id, buf, len, wf_run_trace(t->run),
                           t->err, sizeof t->err);
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
int interp__prompt_frame(tick *t, const act *a, const cJSON *spec) {
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

int interp__dispatch_agent(tick *t, act *a, const cJSON *sd) {
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
         * pending call (agent-runtime-api: AskUserResume); a gated call's checkpoint restores
         * the worker first (InitWorkerSession.resume_checkpoint), and only a denial is spliced
         * as the call's result (an approved call runs) */
        aur.checkpoint.data = a->resume->checkpoint;
        aur.checkpoint.len = a->resume->checkpoint_len;
        aur.answer_tool_result.data = (uint8_t *)a->resume->answer;
        aur.answer_tool_result.len = strlen(a->resume->answer);
        if (a->resume->gated) {
            d.resume_checkpoint.data = a->resume->checkpoint;
            d.resume_checkpoint.len = a->resume->checkpoint_len;
        }
        if (!a->resume->gated || interp__answer_denies(a->resume->answer)) d.ask_user_resume = &aur;
    }
    int rc = outbox_msg(t, SUBJ_AGENT_STEP_DISPATCH, a->key, &d.base);
    free(ef);
    free(efp);
    if (input) pbjson_struct_free(input);
    return rc;
}

/* A gated call's recorded decision {tool_call_id, result} is a denial. */
int interp__answer_denies(const char *answer) {
    cJSON *o = cJSON_Parse(answer);
    int denied = cJSON_IsTrue(
        cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "result"), "denied"));
    cJSON_Delete(o);
    return denied;
}

/* An agent attempt in flight is stopped (CancelRun, its run failing, its timeout): the cancel
 * is an outbox row of the same transaction as the step's end, so it reaches the orchestrator
 * even after a crash; every replica there cancels that attempt's ExecuteStep. An attempt
 * waiting out a retry delay has nothing in flight. */
int interp__cancel_agent(tick *t, act *a, const char *reason) {
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

/* ---- cancel ---- */

static int stop_open_actions(tick *t, const char *why) {
    t->rc = st_governance_close(t->tx, t->run->id, t->err, sizeof t->err);
    for (size_t i = 0; i < t->n && !t->rc; i++) {
        act *a = t->acts[i];
        if (wf_raw_terminal(a->status)) continue;
        if ((t->rc = interp__cancel_agent(t, a, why))) break;
        /* an agent's frozen ask ends with its step */
        if (!strcmp(a->type, "agent_action") &&
            (t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err)))
            break;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "error", why);
        interp__set_output(a, o);
        interp__set_status(a, "failed");
        interp__save(t, a);
    }
    return t->rc;
}

void interp__tick_init(tick *t, wf_engine *e, wf_run *run) {
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

void interp__tick_free(tick *t) {
    for (size_t i = 0; i < t->n; i++)
        interp__act_free(t->acts[i]), free(t->acts[i]);
    free(t->acts);
    free(t->idx);
    free(t->def_idx);
    for (int i = 0; i < t->n_jobs; i++)
        free(t->jobs[i].args);
    cJSON_Delete(t->state);
}

int wf_interp_cancel(wf_run *r, char *err, size_t errlen) {
    tick t;
    interp__tick_init(&t, NULL, r);
    static wf_engine dummy;
    t.e = &dummy; /* metrics are NULL-safe */
    int rc = interp__load_acts(&t);
    if (!rc) rc = stop_open_actions(&t, "cancelled");
    if (rc) snprintf(err, errlen, "%s", t.err);
    interp__tick_free(&t);
    return rc;
}

/* ---- one tick ---- */

/* Outcomes of the previous tick's tool requests, applied by the next tick of the same lease
 * (never written on their own: a crash before that tick commits re-requests with the key). */
static void apply_outcomes(tick *t, const tick_run *r) {
    for (int k = 0; k < r->n_done; k++) {
        for (size_t i = 0; i < t->n; i++) {
            act *a = t->acts[i];
            if (strcmp(a->id, r->done[k].action_id) || strcmp(a->key, r->done[k].key) || a->result)
                continue;
            if (!strcmp(a->status, "in_progress") || !strcmp(a->status, "waiting"))
                a->result = cJSON_Parse(r->results[k]);
        }
    }
}

/* The walk of one run whose reads arrived, up to its writes (queued on the pipeline). */
static int tick_walk(tick_run *r) {
    tick *t = &r->t;
    wf_run *run = &r->run;
    t->paused = !strcmp(run->status, "paused");
    t->rc = interp__load_acts_from(t, r->acts); /* takes the result */
    r->acts = NULL;
    if (t->rc) return t->rc;
    apply_outcomes(t, r);
    if (!strcmp(run->status, "pending") &&
        (t->rc = wf_run_transition(run, "running", "", t->err, sizeof t->err)))
        return t->rc;
    int w = interp__walk_scope(t, str(run->def, "start"), "", 0);
    if (t->rc) return t->rc;
    if (w == SCOPE_DONE && !t->paused) {
        t->rc = wf_run_transition(run, "completed", "", t->err, sizeof t->err);
        r->finished = 1;
    } else if (w == SCOPE_FAILED) {
        if (!(t->rc = stop_open_actions(t, "run failed")))
            t->rc = wf_run_transition(run, "failed",
                                      t->budget[0]   ? t->budget
                                      : t->reason[0] ? t->reason
                                                     : "a step failed",
                                      t->err, sizeof t->err);
        r->finished = 1;
    }
    if (r->finished && !t->rc) t->rc = st_queue_delete(t->tx, r->run_id, t->err, sizeof t->err);
    /* an idle tick frees the lease in its own transaction (the run sleeps until wake_ms or a
     * wake-up); one with jobs keeps it for the next tick, which applies their outcomes */
    if (!r->finished && !t->rc && t->n_jobs == 0)
        t->rc = st_queue_release(t->tx, r->run_id, t->e->instance, r->gen, t->wake_ms, t->err,
                                 sizeof t->err);
    if (!t->rc) t->rc = wf_run_flush(run, t->err, sizeof t->err);
    return t->rc;
}

int interp__tick_step(wf_engine *e, db_tx *tx, tick_run *r, char *err, size_t errlen) {
    int held = r->fence && PQntuples(r->fence) > 0, found = 0, rc = DB_OK;
    PQclear(r->fence);
    r->fence = NULL;
    r->out = TICK_LOST;
    wf_run_take(tx, r->row, &r->run, &found);
    r->row = NULL;
    if (!held) return DB_OK; /* another owner took the lease: nothing to write */
    if (!found || wf_run_terminal(r->run.status)) { /* nothing left to advance */
        rc = st_queue_delete(tx, r->run_id, err, errlen);
        r->out = TICK_FINISHED;
        return rc;
    }
    interp__tick_init(&r->t, e, &r->run);
    if ((rc = tick_walk(r))) {
        snprintf(err, errlen, "run=%s: %s", r->run_id, r->t.err);
        return rc;
    }
    r->out = r->finished ? TICK_FINISHED : r->t.n_jobs ? TICK_JOBS : TICK_IDLE;
    return DB_OK;
}

void interp__tick_end(wf_engine *e, tick_run *r, int committed) {
    if (!committed) r->out = TICK_LOST;
    if (r->out == TICK_JOBS) { /* the calls go out only now that their actions are durable */
        for (int i = 0; i < r->t.n_jobs; i++) {
            r->jobs[i] = r->t.jobs[i];
            r->t.jobs[i].args = NULL;
        }
        r->n_jobs = r->t.n_jobs;
        r->t.n_jobs = 0;
    }
    if (committed && r->finished) {
        metric_inc(e->m_runs_finished);
        wf_engine_run_ended(e, r->run.status, r->run.started_ms);
    }
    PQclear(r->row);
    PQclear(r->fence);
    PQclear(r->acts);
    r->row = r->fence = r->acts = NULL;
    if (r->t.state) interp__tick_free(&r->t);
    memset(&r->t, 0, sizeof r->t);
    wf_run_free(&r->run);
    memset(&r->run, 0, sizeof r->run);
    r->finished = 0;
}

/* ---- a person's decision on a parked gate (gates.c) ---- */

/* How a person's answer or decision reaches the parked agent's turn (docs/workflow-engine.md
 * "Agent steps: retries and ask_user resume", "Agent steps: in-step approvals"). With the
 * frozen turn kept (keep_ask) the same turn goes on, from an answer built from the durable
 * decision so a replay sends the same bytes, the prompt unchanged:
 *   - an ask_user: AskUserResume = the checkpoint + {tool_call_id, result: the recorded answer
 *     {choice, text, answered_by}};
 *   - an approval interrupt (gated): the next dispatch carries the checkpoint as
 *     resume_checkpoint (the worker re-enters only the gated call); approved, the answer
 *     {tool_call_id, result: {approved: true, ...}} is only recorded; rejected, the result is
 *     the denial {denied: true, approval_id, status, decided_by, comment}, sent as
 *     AskUserResume.
 * Without a frozen turn: an approval or an answer starts a fresh turn whose feedback carries
 * it; a rejection is not resumed (*resumed 0: the step is rejected as before). Either way a
 * resumed attempt is not an acceptance redo. */
static int resume_agent_turn(tick *t, act *a, const char *status, const char *output_json,
                             int *resumed) {
    st_agent_state *rs = calloc(1, sizeof *rs);
    char *answer = NULL;
    int rejected = !strcmp(status, "rejected");
    int rc = rs ? st_agent_state_get(t->tx, a->id, rs, t->err, sizeof t->err) : DB_ENOMEM;
    *resumed = 0;
    if (rc) goto done;
    if (rs->checkpoint && rs->tool_call_id[0]) {
        cJSON *o = cJSON_CreateObject();
        cJSON *res = cJSON_Parse(output_json ? output_json : "{}");
        if (rs->gated) { /* the decision as the gated call's outcome (its result if denied) */
            cJSON *dec = cJSON_CreateObject(), *x;
            cJSON_AddBoolToObject(dec, rejected ? "denied" : "approved", 1);
            cJSON_AddStringToObject(dec, "approval_id", a->approval);
            cJSON_AddStringToObject(dec, "status", status); /* as the chat path's decision */
            x = cJSON_GetObjectItemCaseSensitive(res, "decided_by");
            cJSON_AddStringToObject(dec, "decided_by", cJSON_IsString(x) ? x->valuestring : "");
            x = cJSON_GetObjectItemCaseSensitive(res, "comment");
            cJSON_AddStringToObject(dec, "comment", cJSON_IsString(x) ? x->valuestring : "");
            cJSON_Delete(res);
            res = dec;
        }
        cJSON_AddStringToObject(o, "tool_call_id", rs->tool_call_id);
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
    } else if (rejected) {
        goto done; /* nothing to re-enter: the rejection stands */
    } else {
        char fb[1200];
        snprintf(fb, sizeof fb, "A person answered your request: %s",
                 output_json ? output_json : "{}");
        free(a->feedback);
        a->feedback = strdup(fb);
    }
    *resumed = 1;
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
    interp__tick_init(&t, e, r);
    t.paused = !strcmp(r->status, "paused");
    *new_ids = NULL;
    int rc = interp__load_acts(&t);
    act *a = NULL;
    for (size_t i = 0; !rc && i < t.n; i++)
        if (!strcmp(t.acts[i]->id, action_id)) a = t.acts[i];
    if (!rc && !a) {
        snprintf(t.err, sizeof t.err, "action %s is not in run %s", action_id, r->id);
        rc = DB_EINVAL;
    }
    int resumed = 0;
    if (!rc && !strcmp(a->type, "agent_action") &&
        (!strcmp(status, "completed") || !strcmp(status, "approved") ||
         !strcmp(status, "rejected")))
        /* an agent that asked a person (input_required / interrupt_required): its turn goes
         * on as a new attempt; the step's output stays the agent's to give */
        rc = resume_agent_turn(&t, a, status, output_json, &resumed);
    if (resumed) {
        a->blocked[0] = 0;
        a->deadline_ms = 0; /* the gate's window is over; the attempt arms its own */
        const char *keep = a->step;
        interp__start_agent(&t, a, interp__step_def(&t, keep));
        rc = t.rc;
    } else if (!rc) {
        if (output_json) interp__set_output(a, cJSON_Parse(output_json));
        interp__set_status(a, status);
        a->deadline_ms = strcmp(status, "escalated") ? 0 : a->deadline_ms;
        rc = interp__save(&t, a);
    }
    size_t n0 = t.n;
    /* walk now, like a tick would: the steps the decision starts are created in this same
     * transaction (the caller's next_actions); side effects are left to the run's next tick,
     * which the caller wakes (a tool call is re-requested with its key) */
    if (!rc && strcmp(status, "escalated")) {
        interp__walk_scope(&t, str(r->def, "start"), "", 0);
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
    interp__tick_free(&t);
    return rc;
}
