/* The interpreter's steps (interp_int.h): starting each kind of step, waits, and applying the
 * outcomes that arrived (tool results, agent results). */
#include "interp_int.h"

/* ---- starting steps ---- */

/* Arms the attempt's timeout (the step's timeout_minutes, else UPSQUAD_WF_AGENT_TIMEOUT),
 * commits its transition and dispatches it. */
static int send_agent(tick *t, act *a, const cJSON *sd) {
    int tm = num(sd, "timeout_minutes", 0);
    a->deadline_ms = t->now + (tm > 0 ? (int64_t)tm * 60000 : t->e->cfg->agent_timeout_ms);
    interp__wake_at(t, a->deadline_ms);
    if (interp__save(t, a)) return SCOPE_BUSY;
    t->rc = interp__dispatch_agent(t, a, sd);
    return SCOPE_BUSY;
}

int interp__start_agent(tick *t, act *a, const cJSON *sd) {
    char e2[300];
    const char *prompt = str(sd, "prompt");
    cJSON *goal = wf_expr_render(t->state, prompt ? prompt : "", e2, sizeof e2);
    if (!goal) {
        interp__fail_act(t, a, "template", e2);
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
    interp__idem_key(t->run->id, a->step, a->lap, "", a->attempt, a->key);
    interp__set_status(a, "in_progress");
    a->started = 1;
    a->clear_result = 1;
    return send_agent(t, a, sd);
}

/* A tool_action whose tool is behind a process-level gate that is off here validated at create
 * (the whitelist is the catalogue, gate or not) and must "fail closed at dispatch" (spec
 * GetToolCatalogResponse.tools): the step fails before any request is sent, naming the tool
 * and its switch. Returns 1 when it failed the step. */
int interp__fail_if_gated_off(tick *t, act *a, const char *tool) {
    const defn_tool *d = tool ? defn_catalog_tool(t->e->defn, tool) : NULL;
    if (!d || d->enabled) return 0;
    char msg[256];
    snprintf(msg, sizeof msg, "tool %s is not enabled in this deployment (%s)", d->tool,
             d->enabled_by);
    interp__fail_act(t, a, "tool_disabled", msg);
    return 1;
}

int interp__start_tool(tick *t, act *a, const cJSON *sd) {
    char e2[300];
    if (interp__fail_if_gated_off(t, a, str(sd, "tool"))) return SCOPE_FAILED;
    cJSON *with = item(sd, "with") ? wf_expr_render_tree(t->state, item(sd, "with"), e2, sizeof e2)
                                   : cJSON_CreateObject();
    if (!with) {
        interp__fail_act(t, a, "template", e2);
        return SCOPE_FAILED;
    }
    cJSON_Delete(a->input);
    a->input = with;
    a->attempt++;
    interp__idem_key(t->run->id, a->step, a->lap, "", a->attempt, a->key);
    interp__set_status(a, "in_progress");
    a->started = 1;
    a->clear_result = 1;
    if (interp__save(t, a)) return SCOPE_BUSY;
    interp__add_tool_job(t, a, str(sd, "tool"), str(sd, "action"), a->key);
    return SCOPE_BUSY;
}

int interp__start_gate(tick *t, act *a, const cJSON *sd) {
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
            interp__fail_act(t, a, "template", e2);
            return SCOPE_FAILED;
        }
        cJSON_ReplaceItemInObjectCaseSensitive(spec, field, r);
    }
    if (!str(spec, "asked_by") && interp__last_agent_step(t))
        cJSON_AddStringToObject(spec, "asked_by", interp__last_agent_step(t));
    cJSON_Delete(a->input);
    a->input = spec;
    ids_uuid_v4(a->approval);
    const char *kind = interp__gov_kind(a);
    snprintf(a->blocked, sizeof a->blocked, "%s",
             !strcmp(kind, "question_gate") ? "awaiting-question" : a->approval);
    interp__set_status(a, "awaiting_approval");
    a->started = 1;
    int tm = num(sd, "timeout_minutes", 0);
    if (tm > 0) { /* the run's own timer: on_timeout applies at requested_at + N minutes */
        a->deadline_ms = t->now + (int64_t)tm * 60000;
        interp__wake_at(t, a->deadline_ms);
    }
    if (interp__save(t, a)) return SCOPE_BUSY;
    char *sj = cJSON_PrintUnformatted(spec);
    t->rc = st_governance_insert(t->tx, a->approval, t->run->org, t->run->id, a->id, kind,
                                 num(sd, "required_clearance", 0), sj, t->err, sizeof t->err);
    free(sj);
    /* a question_gate (clearance-gated, answered through RecordDecision) and an approval gate
     * have no live prompt frame: the spec's frame is the user_prompt's */
    if (!t->rc && !strcmp(kind, "user_prompt")) t->rc = interp__prompt_frame(t, a, spec);
    char line[300];
    snprintf(line, sizeof line, "step %s is waiting for a person (%s)", a->step, kind);
    if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "INFO", line, t->err, sizeof t->err);
    return SCOPE_BUSY;
}

/* A parked gate whose window closed: its on_timeout decides (docs/workflow-definitions.md).
 * The window is the step's (GetRunPrompt.expires_at, "the deadline the run's own timer will
 * honour", spec) and an escalation does not move it: an escalated gate is still "parked" and
 * "WILL transition again" (spec), so the timer fires on it as on an awaiting one. */
int interp__gate_timed_out(tick *t, act *a, const cJSON *sd) {
    if (a->deadline_ms <= 0 ||
        (strcmp(a->status, "awaiting_approval") && strcmp(a->status, "escalated")))
        return SCOPE_BUSY;
    if (t->now < a->deadline_ms) {
        interp__wake_at(t, a->deadline_ms);
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
        interp__set_status(a, "escalated");
        interp__save(t, a);
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
        interp__set_output(a, o);
        interp__set_status(a, "rejected");
        interp__save(t, a);
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
        interp__complete_act(t, a, o);
        return SCOPE_DONE;
    }
    if (!strcmp(ot, "continue")) {
        interp__complete_act(t, a, o);
        return SCOPE_DONE;
    }
    cJSON_Delete(o);
    interp__fail_act(t, a, "timeout", "nobody answered in time");
    return SCOPE_FAILED;
}

/* An agent's approval interrupt whose window (the step's timeout_minutes) closed: the step's
 * timeout policy applies, as it does to the attempt itself: the row closes as expired, the
 * gated call never runs and the step fails "timeout" (an agent step has no on_timeout). */
int interp__agent_gate_timed_out(tick *t, act *a) {
    if (a->deadline_ms <= 0) return SCOPE_BUSY; /* no window: it waits for its decision */
    if (t->now < a->deadline_ms) {
        interp__wake_at(t, a->deadline_ms);
        return SCOPE_BUSY;
    }
    char line[300];
    snprintf(line, sizeof line,
             "step %s timed out waiting for the approval of its gated call (timeout_minutes)",
             a->step);
    if (a->approval[0]) t->rc = st_governance_expire(t->tx, a->approval, t->err, sizeof t->err);
    if (!t->rc) t->rc = wf_emit_log(t->run, a->id, "WARN", line, t->err, sizeof t->err);
    if (!t->rc) t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
    if (t->rc) return SCOPE_BUSY;
    a->deadline_ms = 0;
    interp__fail_act(t, a, "timeout", "nobody decided the gated tool call in time");
    return SCOPE_FAILED;
}

/* ---- waits ---- */

static int wait_timed_out(tick *t, act *a, const cJSON *sd) {
    if (a->deadline_ms <= 0 || t->now < a->deadline_ms) {
        interp__wake_at(t, a->deadline_ms);
        return SCOPE_BUSY;
    }
    const char *ot = str(sd, "on_timeout");
    if (ot && !strcmp(ot, "continue")) {
        cJSON *o = a->output ? cJSON_Duplicate(a->output, 1) : cJSON_CreateObject();
        cJSON_DeleteItemFromObjectCaseSensitive(o, "timed_out");
        cJSON_AddBoolToObject(o, "timed_out", 1);
        interp__complete_act(t, a, o);
        return SCOPE_DONE;
    }
    interp__fail_act(t, a, "timeout", "the wait timed out");
    return SCOPE_FAILED;
}

int interp__advance_wait(tick *t, act *a, const cJSON *sd) {
    const char *mode = str(sd, "mode");
    if (mode && !strcmp(mode, "poll")) {
        const cJSON *poll = item(sd, "poll");
        if (a->result) { /* an observation arrived: evaluate `until` on it as our output */
            const cJSON *ok = item(a->result, "ok");
            a->polls++;
            a->clear_result = 1;
            if (cJSON_IsTrue(ok)) {
                interp__set_output(a, cJSON_Duplicate(item(a->result, "result"), 1));
                interp__state_put(t, a);
                if (wf_expr_holds(t->state, item(poll, "until"))) {
                    cJSON_Delete(a->result);
                    a->result = NULL;
                    interp__complete_act(t, a, cJSON_Duplicate(a->output, 1));
                    return SCOPE_DONE;
                }
            }
            cJSON_Delete(a->result);
            a->result = NULL;
            a->next_poll_ms = t->now + (int64_t)num(poll, "interval_seconds", 60) * 1000;
            interp__save(t, a);
        }
        int r = wait_timed_out(t, a, sd);
        if (r != SCOPE_BUSY) return r;
        if (a->next_poll_ms <= t->now) {
            char key[65];
            interp__idem_key(t->run->id, a->step, a->lap, "poll", a->polls + 1, key);
            if (strcmp(a->key, key)) {
                snprintf(a->key, sizeof a->key, "%s", key);
                interp__save(t, a);
            }
            char e2[300];
            cJSON *with = item(poll, "with")
                              ? wf_expr_render_tree(t->state, item(poll, "with"), e2, sizeof e2)
                              : cJSON_CreateObject();
            if (!with) {
                interp__fail_act(t, a, "template", e2);
                return SCOPE_FAILED;
            }
            cJSON *keep = a->input;
            a->input = with;
            interp__add_tool_job(t, a, str(poll, "tool"), str(poll, "action"), key);
            a->input = keep;
            cJSON_Delete(with);
        } else {
            interp__wake_at(t, a->next_poll_ms);
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
        interp__complete_act(t, a, p);
        return SCOPE_DONE;
    }
    return wait_timed_out(t, a, sd);
}

int interp__start_wait(tick *t, act *a, const cJSON *sd) {
    const char *mode = str(sd, "mode");
    int poll = mode && !strcmp(mode, "poll");
    snprintf(a->blocked, sizeof a->blocked, "%s", poll ? "waiting-on-poll" : "waiting-on-signal");
    interp__set_status(a, "waiting");
    a->started = 1;
    int tm = num(sd, "timeout_minutes", 0);
    if (tm > 0) a->deadline_ms = t->now + (int64_t)tm * 60000;
    a->next_poll_ms = poll ? t->now : 0;
    a->input = cJSON_CreateObject();
    if (!poll) cJSON_AddStringToObject(a->input, "event_key", str(sd, "event_key"));
    if (interp__save(t, a)) return SCOPE_BUSY;
    return interp__advance_wait(t, a, sd);
}

/* ---- outcomes ---- */

int interp__apply_tool_result(tick *t, act *a) {
    cJSON *r = a->result;
    a->result = NULL;
    a->clear_result = 1;
    if (cJSON_IsTrue(item(r, "ok"))) {
        const cJSON *res = item(r, "result");
        interp__complete_act(t, a, res ? cJSON_Duplicate(res, 1) : cJSON_CreateObject());
        cJSON_Delete(r);
        return SCOPE_DONE;
    }
    char msg[400];
    snprintf(msg, sizeof msg, "%s: %s", str(r, "error_code") ? str(r, "error_code") : "error",
             str(r, "error_message") ? str(r, "error_message") : "");
    interp__fail_act(t, a, str(r, "error_code") ? str(r, "error_code") : "error", msg);
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
    interp__state_put(t, a);
    int ok = wf_expr_holds(t->state, check);
    a->output = keep;
    interp__state_put(t, a);
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
int interp__redispatch_agent(tick *t, act *a, const cJSON *sd) {
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
    interp__idem_key(t->run->id, a->step, a->lap, "", a->attempt, a->key);
    a->next_poll_ms = t->now + delay; /* the walk dispatches it then (redispatch_agent) */
    a->deadline_ms = 0;
    interp__wake_at(t, a->next_poll_ms);
    if (!interp__save(t, a))
        t->rc = wf_emit_log(t->run, a->id, "WARN", line, t->err, sizeof t->err);
    return 1;
}

int interp__apply_agent_result(tick *t, act *a, const cJSON *sd) {
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
            interp__complete_act(t, a, cJSON_Duplicate(output, 1));
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
                interp__set_output(a, cJSON_Duplicate(output, 1));
                t->rc = wf_emit_log(t->run, a->id, "WARN", line, t->err, sizeof t->err);
                /* a redo is a fresh turn: a frozen ask it came from is not resumed again */
                if (!t->rc) t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
                ret = interp__start_agent(t, a, sd);
            } else if (str(acc, "on_exhausted") && !strcmp(str(acc, "on_exhausted"), "continue")) {
                interp__complete_act(t, a, cJSON_Duplicate(output, 1));
                ret = SCOPE_DONE;
            } else {
                interp__set_output(a, cJSON_Duplicate(output, 1));
                interp__fail_act(t, a, "acceptance", fb);
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
        cJSON_AddStringToObject(spec, "asked_by", interp__asked_by_step(a));
        ids_uuid_v4(a->approval);
        snprintf(a->blocked, sizeof a->blocked, "%s", a->approval);
        interp__set_status(a, "awaiting_approval");
        const char *kind = !strcmp(outcome, "input_required") ? "user_prompt" : "approval_gate";
        int gated = !strcmp(kind, "approval_gate"), floor = 0;
        a->park_kind = kind;
        a->deadline_ms = 0; /* the attempt is over: a parked ask waits for its answer */
        if (gated) {
            /* the gated tool's floor as the orchestrator read it from the agent's policy
             * (result_json never leaves it 0); the step's timeout_minutes is the gate's window,
             * as an approval gate's own (docs/workflow-engine.md "Agent steps: in-step
             * approvals") */
            int tm = num(sd, "timeout_minutes", 0);
            floor = num(r, "required_clearance", WF_CLEARANCE_MAX);
            if (floor < 1 || floor > WF_CLEARANCE_MAX) floor = WF_CLEARANCE_MAX;
            if (tm > 0) {
                a->deadline_ms = t->now + (int64_t)tm * 60000;
                interp__wake_at(t, a->deadline_ms);
                cJSON_AddNumberToObject(spec, "timeout_minutes", tm); /* its expires_at */
            }
        }
        if (!interp__save(t, a)) {
            char *sj = cJSON_PrintUnformatted(spec);
            t->rc = st_governance_insert(t->tx, a->approval, t->run->org, t->run->id, a->id, kind,
                                         floor, sj, t->err, sizeof t->err);
            free(sj);
            if (!t->rc && !strcmp(kind, "user_prompt")) t->rc = interp__prompt_frame(t, a, spec);
        }
        cJSON_Delete(spec);
    } else if (cJSON_IsTrue(item(r, "retryable")) && retry_agent(t, a, r)) {
        ret = SCOPE_BUSY;
    } else if (!t->rc) {
        char msg[400];
        snprintf(msg, sizeof msg, "%s",
                 str(r, "message") ? str(r, "message") : "agent step failed");
        interp__fail_act(t, a, str(r, "code") ? str(r, "code") : "failed", msg);
        ret = SCOPE_FAILED;
    }
    /* the step is over: its frozen ask (if any) is no longer needed */
    if (!t->rc && (ret == SCOPE_DONE || ret == SCOPE_FAILED))
        t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
    cJSON_Delete(r);
    return ret;
}
