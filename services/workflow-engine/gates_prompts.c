/* Run prompts (gates.h; docs/workflow-engine.md "Governance"): GetRunPrompt reads a user_input
 * prompt or a question gate as the run parked on it; AnswerRunPrompt answers a prompt with
 * {choice, text}, first write wins, through the same decision as every door (gates__record). */
#include "gates_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "pbjson.h"
#include "wf_rpc.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

#define P(x) Upsquad__Workflow__V1__##x

#define TEXT_MAX 4000

/* A prompt allows free text when its step says so; an agent's ask (the row's spec is the agent's
 * result, outcome "input_required", with its question_spec projected) unless it said
 * allow_text false. */
static int g_allow_text(const gate *g) {
    const char *outcome = jstr(g->spec, "outcome");
    const cJSON *at = cJSON_GetObjectItemCaseSensitive(g->spec, "allow_text");
    /* an agent's ask: free text unless its question_spec said allow_text false */
    if (outcome && !strcmp(outcome, "input_required")) return !cJSON_IsFalse(at);
    return cJSON_IsTrue(at);
}

/* ---- GetRunPrompt / AnswerRunPrompt ---- */

/* "pending", "answered" (a person's answer, or on_timeout "default" applied by the run's
 * timer: answered_by "timeout"), or "closed" (expired without an answer, run ended). */
static const char *prompt_status(const gate *g, const cJSON *out) {
    const char *st = st_s(g->r, 0, GT_STATUS);
    if (!strcmp(st, "pending")) return "pending";
    if (!strcmp(st, "answered") || !strcmp(st, "approved")) return "answered";
    const char *c = jstr(out, "choice") ? jstr(out, "choice") : jstr(out, "option_key");
    if (!strcmp(st, "expired") && c && c[0]) return "answered";
    return "closed";
}

static int cmp_name(const void *a, const void *b) {
    return strcmp((*(P(RunPromptAnswerField) *const *)a)->name,
                  (*(P(RunPromptAnswerField) *const *)b)->name);
}

static P(GetRunPromptResponse) *
    prompt_msg(rpc_call *call, const gate *g, const auth_identity *id) {
    P(GetRunPromptResponse) *m = rpc_alloc(call, sizeof *m);
    upsquad__workflow__v1__get_run_prompt_response__init(m);
    int question = !strcmp(g_kind(g), "question_gate");
    const cJSON *sp = g->spec, *o;
    cJSON *out = cJSON_Parse(st_s(g->r, 0, GT_ACT_OUTPUT));
    m->prompt_id = wfr_s(call, g->r, 0, GT_ID);
    m->kind = wfr_s(call, g->r, 0, GT_KIND);
    const char *q = jstr(sp, question ? "prompt" : "question");
    m->question = rpc_strdup(call, q ? q : "");
    const cJSON *opts = cJSON_GetObjectItemCaseSensitive(sp, "options");
    int no = cJSON_GetArraySize(opts);
    m->options = rpc_alloc(call, (size_t)(no ? no : 1) * sizeof *m->options);
    cJSON_ArrayForEach(o, opts) {
        P(RunPromptOption) *op = rpc_alloc(call, sizeof *op);
        upsquad__workflow__v1__run_prompt_option__init(op);
        const char *v = jstr(o, question ? "key" : "value"), *l = jstr(o, "label"),
                   *d = question ? NULL : jstr(o, "description");
        op->value = rpc_strdup(call, v ? v : "");
        op->label = rpc_strdup(call, l ? l : "");
        op->description = rpc_strdup(call, d ? d : "");
        m->options[m->n_options++] = op;
    }
    m->allow_text = !question && g_allow_text(g);
    const char *ph = question ? NULL : jstr(sp, "text_placeholder");
    m->text_placeholder = rpc_strdup(call, ph ? ph : "");
    const char *dc = jstr(sp, question ? "default_option_key" : "default_choice");
    m->default_choice = rpc_strdup(call, dc ? dc : "");
    m->required_clearance = g_floor(g);
    m->governance_expires_at = wfr_ts(call, g->r, 0, GT_EXPIRES);
    /* the run's own window when the step declared one (requested_at + timeout_minutes, what
     * the interpreter's timer honours), else the row's expiry */
    const cJSON *tm = cJSON_GetObjectItemCaseSensitive(sp, "timeout_minutes");
    if (cJSON_IsNumber(tm) && tm->valueint > 0 && !st_null(g->r, 0, GT_CREATED)) {
        m->expires_at = rpc_alloc(call, sizeof *m->expires_at);
        pbjson_ts_from_ms(m->expires_at, st_i(g->r, 0, GT_CREATED) + (int64_t)tm->valueint * 60000);
    } else {
        m->expires_at = m->governance_expires_at;
    }
    const char *status = prompt_status(g, out);
    m->status = rpc_strdup(call, status);
    m->can_answer = !strcmp(status, "pending") && g_pending(g) && g_allowed(g, id);
    if (!strcmp(status, "answered")) {
        cJSON *ans = cJSON_Parse(st_s(g->r, 0, GT_ANSWER));
        const cJSON *src = ans ? ans : out;
        const char *by = st_s(g->r, 0, GT_DECIDED_BY)[0] ? st_s(g->r, 0, GT_DECIDED_BY)
                                                         : jstr(src, "answered_by");
        const char *c = jstr(src, question ? "option_key" : "choice");
        const char *t = jstr(src, "text");
        m->answered_by = rpc_strdup(call, by ? by : "timeout");
        m->answered_choice = rpc_strdup(call, c ? c : "");
        m->answered_text = rpc_strdup(call, t ? t : "");
        const cJSON *f = cJSON_GetObjectItemCaseSensitive(src, "fields");
        char *fj = question && cJSON_IsObject(f) && f->child ? cJSON_PrintUnformatted(f) : NULL;
        m->answered_fields = rpc_strdup(call, fj ? fj : "");
        free(fj);
        cJSON_Delete(ans);
    }
    const char *ab = jstr(sp, "asked_by");
    m->asked_by_step = rpc_strdup(call, ab ? ab : "");
    m->asked_by_role = wfr_s(call, g->r, 0, GT_ASKED_ROLE);
    m->asked_by_agent_id = wfr_s(call, g->r, 0, GT_ASKED_AGENT);
    m->answerable_by = rpc_strdup(call, g_scope(g));
    const cJSON *fields = question ? cJSON_GetObjectItemCaseSensitive(sp, "answer") : NULL;
    int nf = cJSON_GetArraySize(fields);
    m->answer_fields = rpc_alloc(call, (size_t)(nf ? nf : 1) * sizeof *m->answer_fields);
    cJSON_ArrayForEach(o, fields) {
        P(RunPromptAnswerField) *f = rpc_alloc(call, sizeof *f);
        upsquad__workflow__v1__run_prompt_answer_field__init(f);
        const char *ty = jstr(o, "type"), *d = jstr(o, "description");
        f->name = rpc_strdup(call, o->string);
        f->type = rpc_strdup(call, ty ? ty : "");
        f->required = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "required"));
        f->description = rpc_strdup(call, d ? d : "");
        m->answer_fields[m->n_answer_fields++] = f;
    }
    /* a server-defined stable order: by field name */
    qsort(m->answer_fields, m->n_answer_fields, sizeof *m->answer_fields, cmp_name);
    cJSON_Delete(out);
    return m;
}

int gates__get_run_prompt(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud) {
    const P(GetRunPromptRequest) *rq = (const void *)req;
    const auth_identity *id;
    gate g = {0};
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_gate_id(call, "prompt_id", rq->prompt_id))) return rc;
    if ((rc = gates__open(call, ud, id, "prompt_id", rq->prompt_id, 0, 0, &g))) goto done;
    if (!strcmp(g_kind(&g), "approval_gate")) {
        rc = rpc_error(call, RPC_INVALID_ARGUMENT,
                       "prompt_id names an approval gate, not a prompt: read it with "
                       "ApprovalService.GetApproval");
        goto done;
    }
    P(GetRunPromptResponse) *m = prompt_msg(call, &g, id);
    /* the response is the projection itself: copy it into resp (same message type) */
    *(P(GetRunPromptResponse) *)resp = *m;
done:
    gates__free(&g);
    return rc;
}

int gates__check_prompt_answer(rpc_call *call, const gate *g, const char *choice,
                               const char *text) {
    const cJSON *opts = cJSON_GetObjectItemCaseSensitive(g->spec, "options"), *o;
    int allow_text = g_allow_text(g);
    int n = cJSON_GetArraySize(opts);
    if (text[0] && !allow_text)
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "text is not permitted: this prompt does not allow free text");
    if (wfr_utf8_chars(text) > TEXT_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "text must be at most %d characters",
                         TEXT_MAX);
    if (!choice[0]) {
        if (n > 0 || !allow_text)
            return rpc_error(call, RPC_INVALID_ARGUMENT,
                             "choice is required: it must be one of the prompt's option values");
        if (!text[0])
            return rpc_error(call, RPC_INVALID_ARGUMENT,
                             "text is required: this prompt is answered in free text");
        return RPC_OK;
    }
    cJSON_ArrayForEach(o, opts) {
        const char *v = jstr(o, "value");
        if (v && !strcmp(v, choice)) return RPC_OK;
    }
    return rpc_error(call, RPC_INVALID_ARGUMENT, "choice \"%.64s\" is not one of the prompt's %s",
                     choice, n ? "option values" : "options (it has none)");
}

int gates__answer_run_prompt(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                             void *ud) {
    const P(AnswerRunPromptRequest) *rq = (const void *)req;
    P(AnswerRunPromptResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    gate g = {0};
    char *ids = NULL;
    int won = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_gate_id(call, "prompt_id", rq->prompt_id))) return rc;
    if ((rc = gates__open(call, e, id, "prompt_id", rq->prompt_id, 0, 1, &g)) ||
        (rc = gates__wrong_door(call, "prompt_id", g_kind(&g), "user_prompt")))
        goto done;
    if (!g_allowed(&g, id)) {
        rc = gates__deny(call, &g, id);
        goto done;
    }
    /* "A second answer to an already-answered prompt is a NO-OP (first-write-wins)": only an
     * answer that could still be recorded is checked against the prompt */
    if (g_pending(&g) && (rc = gates__check_prompt_answer(call, &g, rq->choice, rq->text)))
        goto done;
    if (g_pending(&g)) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "choice", rq->choice);
        cJSON_AddStringToObject(o, "text", rq->text);
        cJSON_AddStringToObject(o, "answered_by", id->sub);
        rc = gates__record(call, e, &g, id, "answered", "completed", o, "", &won, &ids);
        cJSON_Delete(o);
        if (rc) goto done;
    }
    out->recorded = won;
    out->already_answered = !won;
    if ((rc = gates__reread(call, &g))) goto done; /* the post-answer projection */
    out->prompt = prompt_msg(call, &g, id);
    if ((rc = gates__commit(call, e, &g))) goto done;
    if (won)
        log_info("gate.answered", "prompt=%s org=%s by=%s", rq->prompt_id, id->org_id, id->sub);
done:
    free(ids);
    gates__free(&g);
    return rc;
}
