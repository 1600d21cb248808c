/* The walk (interp_int.h): from `start`, recompute where the run stands from its actions and
 * create the actions that become due; loops, parallel branches, skips. */
#include "interp_int.h"

/* ---- the walk ---- */

/* Every step reachable from entry (inner scopes included) is marked skipped in this lap. */
static void skip_from(tick *t, const char *entry, const char *lap, int iteration, int depth) {
    if (!entry || depth > 64 || t->rc) return;
    const cJSON *sd = interp__step_def(t, entry);
    if (!sd || interp__find(t, entry, lap)) return;
    act *a = interp__new_act(t, entry, str(sd, "type") ? str(sd, "type") : "", lap, iteration,
                             "skipped");
    if (!a || interp__save(t, a)) return;
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
        int r = interp__walk_scope(t, str(sd, "body"), sub, l);
        int done = r == SCOPE_DONE &&
                   (l >= max || (item(sd, "until") && wf_expr_holds(t->state, item(sd, "until"))));
        cJSON_DeleteItemFromObjectCaseSensitive(t->state, "loop");
        if (prev) cJSON_AddItemToObject(t->state, "loop", prev);
        if (r == SCOPE_FAILED) {
            interp__fail_act(t, a, "loop", "an iteration failed");
            return SCOPE_FAILED;
        }
        if (r == SCOPE_BUSY || t->rc) return SCOPE_BUSY;
        if (done) {
            interp__complete_act(t, a, cJSON_Duplicate(a->output, 1));
            return SCOPE_DONE;
        }
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "iterations", l + 1);
        interp__set_output(a, o);
        if (interp__save(t, a)) return SCOPE_BUSY;
    }
}

static int walk_parallel(tick *t, act *a, const cJSON *sd) {
    int busy = 0, failed = 0;
    const cJSON *b;
    cJSON_ArrayForEach(b, item(sd, "branches")) {
        if (!cJSON_IsString(b)) continue;
        int r = interp__walk_scope(t, b->valuestring, a->lap, a->iteration);
        if (r == SCOPE_FAILED) failed = 1;
        if (r == SCOPE_BUSY) busy = 1;
    }
    if (failed) { /* a failed branch fails the run */
        interp__fail_act(t, a, "branch", "a branch failed");
        return SCOPE_FAILED;
    }
    if (busy || t->rc) return SCOPE_BUSY;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "branches", cJSON_GetArraySize(item(sd, "branches")));
    interp__complete_act(t, a, o);
    return SCOPE_DONE;
}

static int walk_step(tick *t, const char *name, const char *lap, int iteration) {
    const cJSON *sd = interp__step_def(t, name);
    const char *type = str(sd, "type");
    if (!sd || !type) return SCOPE_FAILED;
    act *a = interp__find(t, name, lap);
    if (!a) {
        if (t->paused) return SCOPE_BUSY; /* pause: no new step starts */
        long long total = (long long)t->run->actions + (long long)t->n_new;
        if (total >= t->e->cfg->run_max_actions) { /* the run budget: fails the run */
            snprintf(t->budget, sizeof t->budget,
                     "run budget exceeded: step %s would be action %lld of at most %lld "
                     "(UPSQUAD_WF_RUN_MAX_ACTIONS)",
                     name, total + 1, t->e->cfg->run_max_actions);
            return SCOPE_FAILED;
        }
        const char *init = !strcmp(type, "condition") ? "completed" : "in_progress";
        if (!(a = interp__new_act(t, name, type, lap, iteration, init))) return SCOPE_BUSY;
        if (!strcmp(type, "agent_action")) return interp__start_agent(t, a, sd);
        if (!strcmp(type, "tool_action")) return interp__start_tool(t, a, sd);
        if (!strcmp(type, "wait")) return interp__start_wait(t, a, sd);
        if (!strcmp(type, "approval_gate") || !strcmp(type, "user_input") ||
            !strcmp(type, "question"))
            return interp__start_gate(t, a, sd);
        if (!strcmp(type, "condition")) {
            int holds = wf_expr_holds(t->state, item(sd, "if"));
            cJSON *o = cJSON_CreateObject();
            cJSON_AddStringToObject(o, "branch", holds ? "then" : "else");
            a->output = o;
            a->started = a->finished = 1;
            if (interp__save(t, a)) return SCOPE_BUSY;
            /* the untaken arm's steps become skipped */
            skip_from(t, str(sd, holds ? "else" : "then"), lap, iteration, 0);
        } else { /* loop, parallel: containers in progress */
            cJSON *o = cJSON_CreateObject();
            if (!strcmp(type, "loop")) cJSON_AddNumberToObject(o, "iterations", 1);
            a->output = o;
            a->started = 1;
            if (interp__save(t, a)) return SCOPE_BUSY;
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
        return entry ? interp__walk_scope(t, entry, lap, iteration) : SCOPE_DONE;
    }
    if (wf_raw_terminal(a->status)) return SCOPE_DONE;
    if (!strcmp(type, "loop")) return walk_loop(t, a, sd);
    if (!strcmp(type, "parallel")) return walk_parallel(t, a, sd);
    if (!strcmp(type, "wait")) return interp__advance_wait(t, a, sd);
    if (!strcmp(a->status, "in_progress")) {
        if (!strcmp(type, "agent_action")) {
            if (a->result) return interp__apply_agent_result(t, a, sd);
            if (a->next_poll_ms > 0) { /* a retry waiting out its delay */
                if (t->now >= a->next_poll_ms) return interp__redispatch_agent(t, a, sd);
                interp__wake_at(t, a->next_poll_ms);
                return SCOPE_BUSY;
            }
            if (a->deadline_ms > 0 && t->now >= a->deadline_ms) {
                t->rc = interp__cancel_agent(t, a, "timeout");
                if (!t->rc) t->rc = st_agent_ask_clear(t->tx, a->id, t->err, sizeof t->err);
                interp__fail_act(t, a, "timeout", "the agent step timed out");
                return SCOPE_FAILED;
            }
            interp__wake_at(t, a->deadline_ms);
            return SCOPE_BUSY;
        }
        if (!strcmp(type, "tool_action")) {
            if (a->result) return interp__apply_tool_result(t, a);
            /* dispatched by a process whose gate was on: this one never sends it */
            if (interp__fail_if_gated_off(t, a, str(sd, "tool"))) return SCOPE_FAILED;
            /* in progress without a result: (re)invoke with the same key; a provider returns
             * the recorded result for a key it has executed */
            interp__add_tool_job(t, a, str(sd, "tool"), str(sd, "action"), a->key);
            return SCOPE_BUSY;
        }
    }
    if (!strcmp(type, "approval_gate") || !strcmp(type, "user_input") || !strcmp(type, "question"))
        return interp__gate_timed_out(t, a, sd);
    if (!strcmp(type, "agent_action") &&
        (!strcmp(a->status, "awaiting_approval") || !strcmp(a->status, "escalated")))
        return interp__agent_gate_timed_out(t, a);
    return SCOPE_BUSY; /* parked on a person */
}

int interp__walk_scope(tick *t, const char *entry, const char *lap, int iteration) {
    const char *name = entry;
    int guard = 0;
    while (name && !t->rc) {
        if (++guard > 1024) return SCOPE_FAILED;
        int r = walk_step(t, name, lap, iteration);
        if (r != SCOPE_DONE) return r;
        const cJSON *sd = interp__step_def(t, name);
        act *a = interp__find(t, name, lap);
        if (!strcmp(str(sd, "type"), "condition") || !a) {
            name = str(sd, "next");
        } else {
            name = next_of(sd, a);
        }
    }
    return SCOPE_DONE;
}
