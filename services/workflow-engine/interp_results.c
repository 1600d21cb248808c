/* The agent results consumer (interp.h): AgentStepResult messages from the orchestrator,
 * recorded against their action and the run woken. */
#include "interp_int.h"

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
    case UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INTERRUPT_REQUIRED: {
        /* the gate's card: which call waits, and the floor its policy sets (an orchestrator
         * that names none leaves the gate at the highest clearance: never 0) */
        int c = m->interrupt_gate ? m->interrupt_gate->required_clearance : 0;
        outcome = "interrupt_required";
        cJSON_AddStringToObject(o, "tool_name", m->interrupt_required->tool_name);
        cJSON_AddStringToObject(o, "tool_call_id", m->interrupt_required->tool_call_id);
        cJSON_AddNumberToObject(o, "required_clearance",
                                c >= 1 && c <= WF_CLEARANCE_MAX ? c : WF_CLEARANCE_MAX);
        break;
    }
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

/* A park with a frozen turn — an ask_user (InputRequired.checkpoint) or an approval interrupt
 * (InterruptGate.checkpoint, gated) — is kept with the action, in the transaction that records
 * the result, for the resume the answer or decision starts. It never enters the result JSON,
 * the governance row's spec or any event. */
int interp__keep_ask(db_tx *tx, const Upsquad__Internal__V1__AgentStepResult *m, char *err,
                     size_t errlen) {
    const char *call = NULL;
    const ProtobufCBinaryData *ck = NULL;
    int gated = 0;
    if (m->outcome_case == UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INPUT_REQUIRED) {
        call = m->input_required->tool_call_id;
        ck = &m->input_required->checkpoint;
    } else if (m->outcome_case ==
               UPSQUAD__INTERNAL__V1__AGENT_STEP_RESULT__OUTCOME_INTERRUPT_REQUIRED) {
        call = m->interrupt_required->tool_call_id;
        ck = m->interrupt_gate ? &m->interrupt_gate->checkpoint : NULL;
        gated = 1;
    } else {
        return DB_OK;
    }
    if (!ck || ck->len == 0) /* nothing to resume: an earlier park is over */
        return st_agent_ask_clear(tx, m->action_id, err, errlen);
    return st_agent_ask_put(tx, m->org_id, m->run_id, m->action_id, call, ck->data, ck->len, gated,
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
            (applied && interp__keep_ask(tx, m, err, sizeof err)) ||
            db_tx_commit(tx, err, sizeof err)) {
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
