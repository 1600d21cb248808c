/* Delegation to a sub-agent (delegate.h). */
#include "delegate.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fields.h"
#include "gate.h"
#include "lease.h"
#include "log.h"
#include "pbjson.h"
#include "session.h"
#include "util.h"

#define TASK_MAX 8192

typedef struct child_run {
    char sid[37], agent_id[37], role[65], invocation[37];
    const char *status; /* completed, failed, terminated */
    char error[64];
    char *final_text; /* heap */
} child_run;

/* The answer_tool_result of the parent's resume: {tool_call_id, result: {...}}; is_error marks a
 * result the worker must treat as the call failing. Heap. */
static char *answer_of(const char *call_id, const child_run *ch, const char *refused) {
    cJSON *o = cJSON_CreateObject(), *r = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "tool_call_id", call_id);
    if (refused) {
        cJSON_AddBoolToObject(r, "is_error", 1);
        cJSON_AddStringToObject(r, "status", "refused");
        cJSON_AddStringToObject(r, "error", refused);
    } else {
        cJSON_AddStringToObject(r, "child_session_id", ch->sid);
        cJSON_AddStringToObject(r, "subagent_invocation_id", ch->invocation);
        cJSON_AddStringToObject(r, "agent", ch->role);
        cJSON_AddStringToObject(r, "status", ch->status);
        cJSON_AddStringToObject(r, "final_response", ch->final_text ? ch->final_text : "");
        if (strcmp(ch->status, "completed")) {
            cJSON_AddBoolToObject(r, "is_error", 1);
            cJSON_AddStringToObject(r, "error", ch->error);
        }
    }
    cJSON_AddItemToObject(o, "result", r);
    char *s = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return s;
}

/* spec: the parent waits with SessionPaused(DELEGATION) whose correlation id is the child */
static void tell_paused(rpc_call *call, const orch_envelope *env, const child_run *ch,
                        const char *task) {
    if (!call) return;
    orch_pause pz = {.source = UPSQUAD__RUNTIME__V1__PAUSE_SOURCE__PAUSE_SOURCE_DELEGATION};
    snprintf(pz.reason, sizeof pz.reason, "delegated to %s: %.*s", ch->role,
             (int)util_utf8_cut(task, 200), task);
    snprintf(pz.correlation_id, sizeof pz.correlation_id, "%s", ch->sid);
    orch_chat_send_paused(call, env, &pz);
}

/* The named agent of the org: an agent id, else a role. */
static int resolve(orch *o, const char *org, const char *name, child_run *ch) {
    orch_agent_row a = {0};
    char err[256];
    int rc = strlen(name) == 36 ? orch_store_agent_get(o->pool, org, name, &a, err, sizeof err)
                                : ORCH_ENOTFOUND;
    if (rc == ORCH_ENOTFOUND)
        rc = orch_store_agent_by_role(o->pool, org, name, &a, err, sizeof err);
    if (rc == DB_OK) {
        snprintf(ch->agent_id, sizeof ch->agent_id, "%s", a.agent_id);
        snprintf(ch->role, sizeof ch->role, "%s", a.role);
    }
    free(a.definition);
    return rc;
}

/* The child's turn on the parent's stream (wrapped); its end stored quietly. */
static void run_child(orch *o, rpc_call *call, const orch_chat_turn *t, child_run *ch,
                      const char *task) {
    orch_session s = {0};
    orch_turn *turns = NULL;
    size_t nturns = 0;
    orch_turn_result res = {0};
    orch_chat_state st = {0};
    orch_lease lease = {.held = 0};
    char parent[37] = "", state[16] = "", err[256];
    int parked = 0;
    ch->status = "failed";
    snprintf(ch->error, sizeof ch->error, "CHILD_NOT_STARTED");
    if (orch_store_session_get(o->pool, t->org, ch->sid, 1, &s, err, sizeof err) != DB_OK ||
        orch_store_turn_begin(o->pool, t->org, ch->sid, task, (int)o->cfg->prior_turns,
                              (size_t)o->cfg->prior_bytes, t->timeout_ms + ORCH_TURN_END_SLACK_MS,
                              o->instance, &turns, &nturns, parent, state, err,
                              sizeof err) != DB_OK) {
        log_warn("delegate.child", "child %s: %s", ch->sid, err);
        goto done;
    }
    orch_envelope env = {.child_session_id = ch->sid,
                         .child_agent_id = ch->agent_id,
                         .invocation_id = ch->invocation,
                         .outer = t->env};
    orch_chat_turn ct = {.org = t->org,
                         .sid = ch->sid,
                         .s = &s,
                         .requester = t->requester,
                         .message = task,
                         .turns = turns,
                         .nturns = nturns,
                         .parent = parent,
                         .prefer_worker = s.worker,
                         .timeout_ms = t->timeout_ms,
                         .env = &env};
    orch_lease_hold(&lease, parent);
    orch_chat_steps(o, call, &ct, &res, &st);
    /* the child's end, stored with nobody told: its events went to the parent's stream */
    orch_chat_finish(o, NULL, &ct, &res, &st, &parked);
    orch_lease_drop(&lease);
    orch_session_clear(&s);
    /* a child ended by TerminateSubagentTree (or TerminateSession) reads as terminated */
    if (orch_store_session_get(o->pool, t->org, ch->sid, 0, &s, err, sizeof err) == DB_OK &&
        !strcmp(s.state, "terminated")) {
        ch->status = "terminated";
        snprintf(ch->error, sizeof ch->error, "CHILD_TERMINATED");
    } else if (res.outcome == TURN_COMPLETED) {
        ch->status = "completed";
        ch->error[0] = 0;
        ch->final_text = res.final_text ? strdup(res.final_text) : NULL;
    } else {
        snprintf(ch->error, sizeof ch->error, "%s",
                 res.error_code[0] ? res.error_code : "CHILD_FAILED");
    }
done:
    orch_session_clear(&s);
    orch_turns_free(turns, nturns);
    orch_turn_result_clear(&res);
    orch_chat_state_clear(&st);
}

int orch_delegate(orch *o, rpc_call *call, const orch_chat_turn *t, const orch_chat_state *st,
                  orch_turn_result *res, char **answer, char worker[128], unsigned char **ck,
                  size_t *cklen) {
    child_run ch = {0};
    char err[256], msg[512], hash[65], refused[320] = "";
    int depth = 0;
    cJSON *in = cJSON_Parse(st->deleg_intent ? st->deleg_intent : "");
    const char *agent = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(in, "agent"));
    const char *task = cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(in, "task"));
    int rc = RPC_OK;
    *answer = NULL;
    if (!agent || !agent[0] || !task || !task[0] || strlen(task) > TASK_MAX) {
        snprintf(refused, sizeof refused,
                 "delegate_to_agent needs {\"agent\": a role or agent id, \"task\": 1..%d bytes}",
                 TASK_MAX);
    } else if (resolve(o, t->org, agent, &ch) != DB_OK) {
        snprintf(refused, sizeof refused, "no agent %.64s in this org", agent);
    } else if (orch_store_delegation_link(o->pool, t->org, t->sid, NULL, ch.role, NULL,
                                          (int)o->cfg->deleg_max_depth,
                                          (int)o->cfg->deleg_max_children, ch.invocation, &depth,
                                          err, sizeof err) != DB_OK) {
        snprintf(refused, sizeof refused, "delegation refused: %.200s", err);
    } else {
        orch_new_session n = {.org = t->org,
                              .user = t->s->user_id,
                              .agent_id = ch.agent_id,
                              .kind = "chat",
                              .init_worker = 1};
        if (orch_session_start(o, &n, ch.sid, hash, msg, sizeof msg) != RPC_OK)
            snprintf(refused, sizeof refused, "the child session could not start: %.200s", msg);
        else if (orch_store_delegation_link(o->pool, t->org, t->sid, ch.sid, ch.role, t->parent,
                                            (int)o->cfg->deleg_max_depth,
                                            (int)o->cfg->deleg_max_children, ch.invocation, &depth,
                                            err, sizeof err) != DB_OK)
            snprintf(refused, sizeof refused, "delegation refused: %.200s", err);
    }
    if (refused[0]) {
        log_info("delegate.refused", "session %s: %s", t->sid, refused);
        *answer = answer_of(st->deleg_call, &ch, refused);
    } else {
        log_info("delegate.started", "session %s: child %s (%s, depth %d, invocation %s)", t->sid,
                 ch.sid, ch.role, depth, ch.invocation);
        tell_paused(call, t->env, &ch, task);
        run_child(o, call, t, &ch, task);
        const char *bridge = !strcmp(ch.status, "completed")    ? "ok"
                             : !strcmp(ch.status, "terminated") ? "cancelled"
                                                                : "error";
        if (orch_store_delegation_done(o->pool, t->org, ch.invocation, bridge, ch.error, err,
                                       sizeof err) != DB_OK)
            log_warn("delegate.done", "invocation %s: %s", ch.invocation, err);
        log_info("delegate.ended", "session %s: child %s %s", t->sid, ch.sid, ch.status);
        *answer = answer_of(st->deleg_call, &ch, NULL);
    }
    /* the parent goes on, unless it was ended meanwhile (a tree terminated from its root) */
    orch_session s = {0};
    if (orch_store_session_get(o->pool, t->org, t->sid, 1, &s, err, sizeof err) != DB_OK ||
        strcmp(s.state, "active")) {
        res->outcome = TURN_FAILED;
        snprintf(res->error_code, sizeof res->error_code, "SESSION_TERMINATED");
        free(res->error_message);
        res->error_message = strdup("the session ended while its delegation ran");
        rc = RPC_FAILED_PRECONDITION;
        goto done;
    }
    if (!refused[0] && call) orch_chat_send_resumed(call, t->env, 0, 0, NULL);
    rc = orch_gate_rehydrate(o, &s, worker, ck, cklen, msg, sizeof msg);
    if (rc != RPC_OK) {
        res->outcome = TURN_FAILED;
        snprintf(res->error_code, sizeof res->error_code, "RESUME_FAILED");
        free(res->error_message);
        res->error_message = strdup(msg);
        res->retryable = 1;
    }
done:
    orch_session_clear(&s);
    if (rc != RPC_OK) {
        free(*answer);
        *answer = NULL;
    }
    free(ch.final_text);
    cJSON_Delete(in);
    return rc;
}
