/* Human gates (gates.h; docs/workflow-engine.md "Governance"): WorkflowService's ApproveAction,
 * RejectAction, EscalateAction, ListPendingApprovals here, GetRunPrompt and AnswerRunPrompt in
 * gates_prompts.c, upsquad.approval.v1.ApprovalService (RecordDecision, GetApproval) in
 * gates_approval.c, over the governance rows the interpreter opens when a run parks on
 * approval_gate / user_input / question. Every door loads its gate and decides through what
 * is defined here (gates_int.h).
 *
 * Rules decided here:
 *   - A gate is read in the caller's org (RLS) and through its run's visibility: another org's
 *     id, or a private workflow's run of someone else, is NOT_FOUND.
 *   - Who may decide: clearance >= the row's floor (required_clearance) AND the answer scope
 *     (answerable_by "" / "anyone": any member; "requester": only the run's triggerer).
 *     Otherwise PERMISSION_DENIED. The same rule computes can_answer / can_decide and filters
 *     ListPendingApprovals (it lists only what the caller may decide).
 *   - A decision is one transaction: lock the run row (the lock every tick takes first, so a
 *     replica holding the run's lease waits for us or we for it), then move the governance row
 *     out of 'pending' with a conditional UPDATE (first write wins), set the action, walk the
 *     run on (the created actions are next_actions), wake the run's queue row, audit, and put
 *     approval.decided.<org> in the outbox. Any replica can take the decision.
 *   - Escalation raises the floor by one clearance level, up to 5 (the highest clearance);
 *     the action becomes 'escalated' (folds to blocked); audited as gate.escalate. */
#include "gates.h"
#include "gates_int.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ids.h"
#include "interp.h"
#include "log.h"
#include "pbjson.h"
#include "run.h"
#include "store.h"
#include "wf_rpc.h"
#include "subjects.h"
#include "upsquad/approval/v1/approval.pb-c.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

#define P(x) Upsquad__Workflow__V1__##x
#define INIT(x, m) upsquad__workflow__v1__##x##__init(m)

#define PENDING_DEFAULT 50
#define PENDING_MAX 100
#define CLEARANCE_CAP WF_CLEARANCE_MAX
#define ESCALATE_STEP WF_ESCALATE_STEP

/* ---- one gate, loaded for a call ---- */

void gates__free(gate *g) {
    db_tx_rollback(g->tx);
    if (g->have_run) wf_run_free(&g->run);
    PQclear(g->r);
    cJSON_Delete(g->spec);
    memset(g, 0, sizeof *g);
}

/* An action without a governance row: NOT_FOUND unless the caller can see it, else it is not
 * awaiting approval (FAILED_PRECONDITION). */
static int no_gate(rpc_call *call, gate *g, const auth_identity *id, const char *action_id) {
    char err[512];
    PGresult *r = NULL;
    int found = 0, rc = st_action_brief(g->tx, action_id, &r, err, sizeof err);
    if (!rc && PQntuples(r) > 0) {
        rc = wf_run_load(g->tx, st_s(r, 0, 0), 0, &g->run, &found, err, sizeof err);
        g->have_run = found;
    }
    if (rc) {
        PQclear(r);
        return wfr_db_fail(call, rc, err);
    }
    if (!found || (!strcmp(g->run.visibility, "private") && strcmp(g->run.owner, id->sub))) {
        PQclear(r);
        return rpc_error(call, RPC_NOT_FOUND, "action %s not found", action_id);
    }
    rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                   "action %s is %s and waits on no approval; nothing to decide", action_id,
                   st_s(r, 0, 1));
    PQclear(r);
    return rc;
}

/* A session's row re-read under its own row lock (what serializes its deciders); one whose
 * expiry passed is expired first, as the sweeper would have (the expiry is exact). */
static int session_lock(rpc_call *call, gate *g, const char *gid, int by_action,
                        const char *field) {
    char err[512];
    int lapsed = 0;
    for (int pass = 0; pass < 2; pass++) {
        PQclear(g->r);
        g->r = NULL;
        int rc = st_gate_get(g->tx, gid, by_action, 1, &g->r, err, sizeof err);
        if (rc) return wfr_db_fail(call, rc, err);
        if (PQntuples(g->r) == 0)
            return rpc_error(call, RPC_NOT_FOUND, "%s %s not found", by_action ? "action" : field,
                             gid);
        if (pass || (rc = sgate__lapse(g->tx, g->r, &lapsed, err, sizeof err)))
            return rc ? wfr_db_fail(call, rc, err) : RPC_OK;
        if (!lapsed) return RPC_OK;
    }
    return RPC_OK;
}

int gates__open(rpc_call *call, wf_engine *e, const auth_identity *id, const char *field,
                const char *gid, int by_action, int lock, gate *g) {
    char err[512];
    int found = 0;
    memset(g, 0, sizeof *g);
    int rc = st_begin(e->pool, id->org_id, id->sub, &g->tx, err, sizeof err);
    if (!rc) rc = st_gate_get(g->tx, gid, by_action, 0, &g->r, err, sizeof err);
    if (rc) return wfr_db_fail(call, rc, err);
    if (PQntuples(g->r) == 0 && by_action) return no_gate(call, g, id, gid);
    if (PQntuples(g->r) == 0)
        return rpc_error(call, RPC_NOT_FOUND, "%s %s not found", by_action ? "action" : field, gid);
    g->session = st_s(g->r, 0, GT_SESSION)[0] != 0;
    if (g->session) { /* an agent session's row: the org (RLS) is its scope, no run to lock */
        if (lock && (rc = session_lock(call, g, gid, by_action, field))) return rc;
    } else {
        char run_id[37];
        snprintf(run_id, sizeof run_id, "%s", st_s(g->r, 0, GT_RUN));
        if ((rc = wf_run_load(g->tx, run_id, lock, &g->run, &found, err, sizeof err)))
            return wfr_db_fail(call, rc, err);
        g->have_run = found;
        if (!found || (!strcmp(g->run.visibility, "private") && strcmp(g->run.owner, id->sub)))
            return rpc_error(call, RPC_NOT_FOUND, "%s %s not found", by_action ? "action" : field,
                             gid);
        if (lock) { /* serialized behind the run lock: read what the last writer left */
            PQclear(g->r);
            g->r = NULL;
            if ((rc = st_gate_get(g->tx, gid, by_action, 1, &g->r, err, sizeof err)))
                return wfr_db_fail(call, rc, err);
            if (PQntuples(g->r) == 0)
                return rpc_error(call, RPC_NOT_FOUND, "%s %s not found",
                                 by_action ? "action" : field, gid);
        }
    }
    g->spec = cJSON_Parse(st_s(g->r, 0, GT_SPEC));
    if (!g->spec) g->spec = cJSON_CreateObject();
    return RPC_OK;
}

int gates__deny(rpc_call *call, const gate *g, const auth_identity *id) {
    if (id->clearance < g_floor(g))
        return rpc_error(call, RPC_PERMISSION_DENIED,
                         "deciding this %s needs clearance %d; the caller has %d", g_kind(g),
                         g_floor(g), id->clearance);
    return rpc_error(call, RPC_PERMISSION_DENIED,
                     "this %s is answerable_by \"requester\": only the member who started the run "
                     "may answer",
                     g_kind(g));
}

int gates__record(rpc_call *call, wf_engine *e, gate *g, const auth_identity *id,
                  const char *gov_status, const char *act_status, cJSON *output,
                  const char *comment, int *won, char **new_ids) {
    char err[512];
    const char *gid = st_s(g->r, 0, GT_ID), *aid = st_s(g->r, 0, GT_ACTION);
    char *answer = cJSON_PrintUnformatted(output);
    int rc = st_gate_decide(g->tx, gid, gov_status, id->sub, answer, comment, won, err, sizeof err);
    if (rc || !*won) goto done;
    if (g->session) { /* nothing of a run to move: the session hears it on the bus */
        if ((rc = st_approval_timer_delete(g->tx, gid, err, sizeof err))) goto done;
    } else {
        if ((rc =
                 wf_interp_decide(e, &g->run, aid, act_status, answer, new_ids, err, sizeof err)) ||
            (rc = st_action_decided(g->tx, aid, id->sub, err, sizeof err)) ||
            (rc = st_queue_wake(g->tx, g->run.id, err, sizeof err)))
            goto done;
        char line[300];
        snprintf(line, sizeof line, "%s %s: %s by %s", g_kind(g), gid, gov_status, id->sub);
        if ((rc = wf_emit_log(&g->run, aid, "INFO", line, err, sizeof err))) goto done;
    }
    char what[32];
    snprintf(what, sizeof what, "gate.%s", gov_status);
    /* approval.decided.<org>, relayed from the outbox after the commit (message id: the row) */
    if ((rc = st_audit(g->tx, id->org_id, id->sub, gid, what, comment, err, sizeof err)) ||
        (rc = sgate__announce(g->tx, g->r, gov_status, id->sub, output, comment,
                              wf_run_trace(&g->run), err, sizeof err)))
        goto done;
    if (!g->session) rc = wf_run_flush(&g->run, err, sizeof err);
done:
    free(answer);
    return rc ? wfr_db_fail(call, rc, err) : RPC_OK;
}

int gates__reread(rpc_call *call, gate *g) {
    char err[512], gid[37];
    snprintf(gid, sizeof gid, "%s", st_s(g->r, 0, GT_ID));
    PQclear(g->r);
    g->r = NULL;
    int rc = st_gate_get(g->tx, gid, 0, 0, &g->r, err, sizeof err);
    return rc ? wfr_db_fail(call, rc, err) : RPC_OK;
}

int gates__commit(rpc_call *call, wf_engine *e, gate *g) {
    char err[512];
    int rc = db_tx_commit(g->tx, err, sizeof err);
    g->tx = NULL;
    if (rc) return wfr_db_fail(call, rc, err);
    wf_engine_kick(e);
    wf_engine_kick_relay(e);
    return RPC_OK;
}

/* The action row (and the actions in ids) re-read in the gate's transaction. */
static int g_actions(rpc_call *call, gate *g, const char *ids, P(WorkflowAction) * *action,
                     P(WorkflowAction) * **next, size_t *n_next) {
    char err[512], one[48];
    PGresult *r = NULL;
    if (g->session) { /* the row itself, re-read after the decision */
        snprintf(one, sizeof one, "{%s}", st_s(g->r, 0, GT_ID));
        int rc = st_gate_get_many(g->tx, one, &r, err, sizeof err);
        if (rc) return wfr_db_fail(call, rc, err);
        const auth_identity *id = rpc_identity(call);
        if (PQntuples(r) > 0) *action = sgate__action_msg(call, r, 0, id ? id->clearance : 0);
        PQclear(r);
        if (next) *n_next = 0;
        return RPC_OK;
    }
    snprintf(one, sizeof one, "{%s}", st_s(g->r, 0, GT_ACTION));
    int rc = st_actions_by_ids(g->tx, one, &r, err, sizeof err);
    if (rc) return wfr_db_fail(call, rc, err);
    if (PQntuples(r) > 0) *action = wfr_action_msg(call, r, 0);
    PQclear(r);
    if (!next) return RPC_OK;
    *n_next = 0;
    if (!ids || !strcmp(ids, "{}")) return RPC_OK;
    if ((rc = st_actions_by_ids(g->tx, ids, &r, err, sizeof err)))
        return wfr_db_fail(call, rc, err);
    int n = PQntuples(r);
    *next = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof **next);
    for (int i = 0; i < n; i++)
        (*next)[i] = wfr_action_msg(call, r, i);
    *n_next = (size_t)n;
    PQclear(r);
    return RPC_OK;
}

/* ---- approving: no self-approval, N of M ---- */

int gates__approve_rules(rpc_call *call, gate *g, const auth_identity *id, const char *comment,
                         cJSON *o, int *resolved) {
    char err[512];
    *resolved = 1;
    const cJSON *self = cJSON_GetObjectItemCaseSensitive(g->spec, "allow_self_approval");
    if (cJSON_IsFalse(self) && !strcmp(st_s(g->r, 0, GT_TRIGGERED_BY), id->sub))
        return rpc_error(call, RPC_PERMISSION_DENIED,
                         "this gate sets allow_self_approval false: the member who started the "
                         "run may not approve it");
    int need = g_min_approvals(g);
    cJSON *have = cJSON_Parse(st_s(g->r, 0, GT_APPROVERS)), *v;
    int n = 0, dup = 0;
    cJSON_ArrayForEach(v, have) {
        n++;
        if (cJSON_IsString(v) && !strcmp(v->valuestring, id->sub)) dup = 1;
    }
    int rc = RPC_OK;
    if (dup) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                       "member %s already approved this gate; it needs %d distinct approvers "
                       "(%d so far)",
                       id->sub, need, n);
    } else if (n + 1 < need) {
        int added = 0;
        char line[300], gid[37];
        snprintf(gid, sizeof gid, "%s", st_s(g->r, 0, GT_ID));
        snprintf(line, sizeof line, "approval %d of %d by %s", n + 1, need, id->sub);
        if ((rc = st_gate_vote(g->tx, gid, id->sub, &added, err, sizeof err)) ||
            (rc = wf_emit_log(&g->run, st_s(g->r, 0, GT_ACTION), "INFO", line, err, sizeof err)) ||
            (rc = st_audit(g->tx, id->org_id, id->sub, gid, "gate.vote", comment, err,
                           sizeof err)) ||
            (rc = wf_run_flush(&g->run, err, sizeof err)))
            rc = wfr_db_fail(call, rc, err);
        *resolved = 0;
    } else {
        int added = 0; /* the deciding approval is listed too */
        if ((rc = st_gate_vote(g->tx, st_s(g->r, 0, GT_ID), id->sub, &added, err, sizeof err)))
            rc = wfr_db_fail(call, rc, err);
        cJSON *all = have ? cJSON_Duplicate(have, 1) : cJSON_CreateArray();
        cJSON_AddItemToArray(all, cJSON_CreateString(id->sub));
        cJSON_AddItemToObject(o, "approvers", all);
    }
    cJSON_Delete(have);
    return rc;
}

/* ---- ApproveAction / RejectAction / EscalateAction ---- */

enum { OP_APPROVE, OP_REJECT, OP_ESCALATE };

int gates__wrong_door(rpc_call *call, const char *field, const char *kind, const char *here) {
    if (!strcmp(kind, "question_gate") && strcmp(here, "question_gate"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "%s names a question gate: answer it with ApprovalService.RecordDecision "
                         "(decision APPROVED, response_payload {option_key, fields})",
                         field);
    if (!strcmp(kind, "user_prompt") && strcmp(here, "user_prompt"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "%s names a user_input prompt: answer it with "
                         "WorkflowService.AnswerRunPrompt ({choice, text})",
                         field);
    if (!strcmp(kind, "approval_gate") && strcmp(here, "approval_gate"))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "%s names an approval gate: decide it with WorkflowService.ApproveAction "
                         "/ RejectAction or ApprovalService.RecordDecision",
                         field);
    return RPC_OK;
}

static int gate_action(rpc_call *call, wf_engine *e, int op, const char *action_id,
                       const char *comment, P(WorkflowAction) * *action, P(WorkflowAction) * **next,
                       size_t *n_next) {
    static const char *const verbs[] = {"approve", "reject", "escalate"};
    const auth_identity *id;
    gate g = {0};
    char *ids = NULL, err[512];
    int won = 0;
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc || (rc = wfr_need_id(call, "action_id", action_id))) return rc;
    if (wfr_utf8_chars(comment) > COMMENT_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "comment must be at most %d characters",
                         COMMENT_MAX);
    if ((rc = gates__open(call, e, id, "action_id", action_id, 1, 1, &g))) goto done;
    if (op != OP_ESCALATE &&
        (rc = gates__wrong_door(call, "action_id", g_kind(&g), "approval_gate")))
        goto done;
    if (!g_pending(&g)) {
        rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                       "action %s is %s, not awaiting approval; nothing to %s", action_id,
                       st_s(g.r, 0, g.session ? GT_STATUS : GT_ACT_STATUS), verbs[op]);
        goto done;
    }
    if (!g_allowed(&g, id)) {
        rc = gates__deny(call, &g, id);
        goto done;
    }
    if (op == OP_ESCALATE) {
        int floor = g_floor(&g);
        if (floor >= CLEARANCE_CAP) {
            rc = rpc_error(call, RPC_FAILED_PRECONDITION,
                           "action %s already needs the highest clearance (%d)", action_id,
                           CLEARANCE_CAP);
            goto done;
        }
        int to = floor + ESCALATE_STEP > CLEARANCE_CAP ? CLEARANCE_CAP : floor + ESCALATE_STEP;
        char line[200];
        snprintf(line, sizeof line, "escalated from clearance %d to %d%s%s", floor, to,
                 comment[0] ? ": " : "", comment);
        char gid[37];
        snprintf(gid, sizeof gid, "%s", st_s(g.r, 0, GT_ID));
        /* a session's row has no action or run: its floor is all that moves */
        if ((rc = st_gate_escalate(g.tx, gid, to, comment, err, sizeof err)) ||
            (!g.session && ((rc = wf_interp_decide(e, &g.run, st_s(g.r, 0, GT_ACTION), "escalated",
                                                   NULL, &ids, err, sizeof err)) ||
                            (rc = wf_emit_log(&g.run, st_s(g.r, 0, GT_ACTION), "WARN", line, err,
                                              sizeof err)))) ||
            (rc = st_audit(g.tx, id->org_id, id->sub, gid, "gate.escalate", line, err,
                           sizeof err)) ||
            (!g.session && (rc = wf_run_flush(&g.run, err, sizeof err)))) {
            rc = wfr_db_fail(call, rc, err);
            goto done;
        }
        free(ids);
        ids = NULL;
    } else {
        int approve = op == OP_APPROVE, resolved = 1;
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "decision", approve ? "approved" : "rejected");
        cJSON_AddStringToObject(o, "decided_by", id->sub);
        cJSON_AddStringToObject(o, "comment", comment);
        if (approve) rc = gates__approve_rules(call, &g, id, comment, o, &resolved);
        if (!rc && resolved)
            rc = gates__record(call, e, &g, id, approve ? "approved" : "rejected",
                               approve ? "approved" : "rejected", o, comment, &won, &ids);
        cJSON_Delete(o);
        if (rc) goto done;
        if (resolved && !won) { /* cannot happen under the run lock; said plainly if it ever does */
            rc = rpc_error(call, RPC_FAILED_PRECONDITION, "action %s was decided concurrently",
                           action_id);
            goto done;
        }
    }
    if ((rc = g_actions(call, &g, ids, action, next, n_next))) goto done;
    if ((rc = gates__commit(call, e, &g))) goto done;
    log_info("gate.decided", "%s action=%s org=%s by=%s", verbs[op], action_id, id->org_id,
             id->sub);
done:
    free(ids);
    gates__free(&g);
    return rc;
}

static int approve_action(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                          void *ud) {
    const P(ApproveActionRequest) *rq = (const void *)req;
    P(ApproveActionResponse) *out = (void *)resp;
    return gate_action(call, ud, OP_APPROVE, rq->action_id, rq->comment, &out->action,
                       &out->next_actions, &out->n_next_actions);
}

static int reject_action(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud) {
    const P(RejectActionRequest) *rq = (const void *)req;
    P(RejectActionResponse) *out = (void *)resp;
    return gate_action(call, ud, OP_REJECT, rq->action_id, rq->comment, &out->action, NULL, NULL);
}

static int escalate_action(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                           void *ud) {
    const P(EscalateActionRequest) *rq = (const void *)req;
    P(EscalateActionResponse) *out = (void *)resp;
    return gate_action(call, ud, OP_ESCALATE, rq->action_id, rq->comment, &out->action, NULL, NULL);
}

/* ---- ListPendingApprovals ---- */

static int list_pending(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        void *ud) {
    const P(ListPendingApprovalsRequest) *rq = (const void *)req;
    P(ListPendingApprovalsResponse) *out = (void *)resp;
    wf_engine *e = ud;
    const auth_identity *id;
    db_tx *tx = NULL;
    PGresult *page = NULL, *rows = NULL, *srows = NULL;
    char err[512];
    int rc = rpc_tenant(call, RPC_TENANT_SUB, &id);
    if (rc) return rc;
    if (rq->offset < 0) return rpc_error(call, RPC_INVALID_ARGUMENT, "offset must be >= 0");
    /* spec: "limit controls pagination (default: 50, max: 100)", the words ListWorkflows has:
     * the same clamp (0 or less: the default; above 100: 100) */
    int limit = rq->limit <= 0            ? PENDING_DEFAULT
                : rq->limit > PENDING_MAX ? PENDING_MAX
                                          : rq->limit;
    if ((rc = st_begin_ex(e->pool, id->org_id, id->sub, DB_TX_REPEATABLE_READ | DB_TX_READ_ONLY,
                          &tx, err, sizeof err)) ||
        (rc = st_gate_pending(tx, id->sub, id->clearance, rq->agent_id, limit, rq->offset, &page,
                              err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    int n = PQntuples(page);
    size_t len = 3;
    for (int i = 0; i < n; i++)
        len += 38;
    char *ids = rpc_alloc(call, len);
    size_t k = 0;
    ids[k++] = '{';
    for (int i = 0; i < n; i++)
        k += (size_t)sprintf(ids + k, "%s%s", i ? "," : "", st_s(page, i, 0));
    ids[k++] = '}';
    /* the page's run actions and its sessions' rows, two reads (an id of the other kind
     * matches nothing in either) */
    if ((rc = st_actions_by_ids(tx, ids, &rows, err, sizeof err)) ||
        (rc = st_gate_get_many(tx, ids, &srows, err, sizeof err))) {
        rc = wfr_db_fail(call, rc, err);
        goto done;
    }
    out->approvals = rpc_alloc(call, (size_t)(n ? n : 1) * sizeof *out->approvals);
    for (int i = 0; i < n; i++) {
        P(PendingApproval) *p = rpc_alloc(call, sizeof *p);
        upsquad__workflow__v1__pending_approval__init(p);
        p->agent_name = rpc_strdup(call, "");
        for (int j = 0; !st_b(page, i, 3) && j < PQntuples(rows); j++)
            if (!strcmp(st_s(rows, j, AC_ID), st_s(page, i, 0)))
                p->action = wfr_action_msg(call, rows, j);
        for (int j = 0; st_b(page, i, 3) && j < PQntuples(srows); j++)
            if (!strcmp(st_s(srows, j, GT_ID), st_s(page, i, 0))) {
                p->action = sgate__action_msg(call, srows, j, id->clearance);
                cJSON *sp = cJSON_Parse(st_s(srows, j, GT_SPEC));
                const char *an = jstr(sp, "agent_name");
                p->agent_name = rpc_strdup(call, an ? an : "");
                cJSON_Delete(sp);
            }
        p->workflow_name = wfr_s(call, page, i, 1);
        out->approvals[out->n_approvals++] = p;
    }
    Google__Protobuf__Struct ***slots = rpc_alloc(call, (size_t)(n ? n : 1) * 2 * sizeof *slots);
    size_t ns = 0;
    for (size_t i = 0; i < out->n_approvals; i++)
        if (out->approvals[i]->action) {
            slots[ns++] = &out->approvals[i]->action->input;
            slots[ns++] = &out->approvals[i]->action->output;
        }
    wfr_fit(call, &out->base, slots, ns, "GetNodeIO");
    if (n > 0) {
        out->total_count = (int32_t)st_i(page, 0, 2);
    } else if (rq->offset > 0) { /* past the end: count without a page */
        PQclear(page);
        page = NULL;
        if ((rc = st_gate_pending(tx, id->sub, id->clearance, rq->agent_id, 1, 0, &page, err,
                                  sizeof err))) {
            rc = wfr_db_fail(call, rc, err);
            goto done;
        }
        out->total_count = PQntuples(page) ? (int32_t)st_i(page, 0, 2) : 0;
    }
    rc = RPC_OK;
done:
    PQclear(page);
    PQclear(rows);
    PQclear(srows);
    db_tx_rollback(tx);
    return rc;
}

/* ---- registration ---- */

#define WSVC "/upsquad.workflow.v1.WorkflowService/"
#define ASVC "/upsquad.approval.v1.ApprovalService/"
#define WD(x) &upsquad__workflow__v1__##x##__descriptor
#define AD(x) &upsquad__approval__v1__##x##__descriptor
#define WU(name, req, resp, fn)                                                                    \
    {                                                                                              \
        WSVC name, RPC_UNARY, RPC_AUTH_REQUIRED, WD(req), WD(resp), fn, NULL, e,                   \
            .flags = RPC_BLOCKING                                                                  \
    }
#define AU(name, req, resp, fn)                                                                    \
    {                                                                                              \
        ASVC name, RPC_UNARY, RPC_AUTH_REQUIRED, AD(req), AD(resp), fn, NULL, e,                   \
            .flags = RPC_BLOCKING                                                                  \
    }

int wf_gates_register(rpc_server *srv, wf_engine *e) {
    if (e->bus) {
        /* the decisions' stream (the relay publishes approval.decided.<org> into it) and the
         * node I/O stream (a prompt's live frame, wfio.<org>.<run>): the relay keeps the outbox
         * in order, so a publish into a missing stream would hold up every later row */
        char err[256];
        const char *subjects[] = {STREAM_APPROVALS_SUBJECTS}, *io[] = {STREAM_WFIO_SUBJECTS};
        if (bus_js_stream_ensure(e->bus, STREAM_APPROVALS, subjects, 1, BUS_RETENTION_LIMITS,
                                 STREAM_APPROVALS_MAX_AGE_S, NULL, err, sizeof err) != BUS_OK ||
            bus_js_stream_ensure(e->bus, STREAM_WFIO, io, 1, BUS_RETENTION_LIMITS,
                                 STREAM_WFIO_MAX_AGE_S, NULL, err, sizeof err) != BUS_OK) {
            log_error("gates.stream", "cannot ensure the gates' streams: %s", err);
            return RPC_INTERNAL;
        }
    }
    const rpc_method methods[] = {
        WU("ApproveAction", approve_action_request, approve_action_response, approve_action),
        WU("RejectAction", reject_action_request, reject_action_response, reject_action),
        WU("EscalateAction", escalate_action_request, escalate_action_response, escalate_action),
        WU("ListPendingApprovals", list_pending_approvals_request, list_pending_approvals_response,
           list_pending),
        WU("GetRunPrompt", get_run_prompt_request, get_run_prompt_response, gates__get_run_prompt),
        WU("AnswerRunPrompt", answer_run_prompt_request, answer_run_prompt_response,
           gates__answer_run_prompt),
        AU("RecordDecision", record_decision_request, record_decision_response,
           gates__record_decision),
        AU("GetApproval", get_approval_request, get_approval_response, gates__get_approval),
        AU("OpenApproval", open_approval_request, open_approval_response, sgate__open),
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
