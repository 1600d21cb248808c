/* The interpreter's threads (interp.h; docs/workflow-engine.md "Run model", "Group commit"):
 * claim due runs, tick them, make their tool calls, tick again with the outcomes, release.
 *
 * Group commit: a thread claims up to UPSQUAD_WF_GROUP_MAX due runs at once and ticks them all
 * in one transaction, each run's statements under its own org scope and fenced by its own
 * lease; the claim takes what is due, so an idle engine ticks one run per transaction (no
 * latency added) and a loaded one shares each commit, and each round trip, among many runs.
 * The tool calls the group's ticks committed go out together (a tool's calls, across runs, as
 * one batch request), and the group's next tick applies their outcomes. A group whose
 * transaction fails is ticked again one run at a time, so one run's failure holds back only
 * itself. */
#include "interp_int.h"

#include <pthread.h>

/* ---- tool calls ---- */

/* One tool call of a group: its job, its run (borrowed) and its outcome (JSON, heap). */
typedef struct call {
    wf_engine *e;
    const job *j;
    const char *run_id, *org;
    char *result;
} call;

/* The request of one call (args: heap, pbjson_struct_free; the strings are borrowed). */
static void tool_request(const wf_engine *e, const call *c,
                         Upsquad__Internal__V1__ToolInvokeRequest *rq,
                         Google__Protobuf__Struct **args) {
    char e2[256];
    const job *j = c->j;
    upsquad__internal__v1__tool_invoke_request__init(rq);
    *args = NULL;
    cJSON *aj = cJSON_Parse(j->args);
    pbjson_struct_from_json(aj, args, e2, sizeof e2);
    cJSON_Delete(aj);
    rq->idempotency_key = (char *)j->key;
    rq->org_id = (char *)c->org;
    rq->run_id = (char *)c->run_id;
    rq->step_name = (char *)j->step;
    rq->iteration = j->iteration;
    rq->tool = (char *)j->tool;
    rq->action = (char *)j->action;
    rq->arguments = *args;
    rq->timeout_ms = (int32_t)e->cfg->tool_timeout_ms;
    rq->trace_id = (char *)j->key;
}

/* A provider's answer as the outcome JSON the next tick records (heap). */
static char *tool_outcome(const Upsquad__Internal__V1__ToolInvokeResponse *rs) {
    cJSON *out = cJSON_CreateObject();
    cJSON_AddBoolToObject(out, "ok", rs->ok);
    cJSON_AddItemToObject(out, "result",
                          rs->result ? pbjson_struct_to_json(rs->result) : cJSON_CreateObject());
    cJSON_AddStringToObject(out, "error_code", rs->error_code);
    cJSON_AddStringToObject(out, "error_message", rs->error_message);
    cJSON_AddBoolToObject(out, "replayed", rs->replayed);
    char *s = cJSON_PrintUnformatted(out);
    cJSON_Delete(out);
    return s;
}

/* One tool call over NATS request/reply, retried with the same key; the outcome as JSON. */
static char *invoke_tool(const call *c) {
    wf_engine *e = c->e;
    Upsquad__Internal__V1__ToolInvokeRequest rq;
    Google__Protobuf__Struct *args = NULL;
    char subject[160];
    const char *tool = c->j->tool;
    tool_request(e, c, &rq, &args);
    size_t len = protobuf_c_message_get_packed_size(&rq.base);
    uint8_t *buf = malloc(len ? len : 1);
    protobuf_c_message_pack(&rq.base, buf);
    if (args) pbjson_struct_free(args);
    char *text = NULL;
    const char *code = "no_provider";
    if (!bus_token_valid(tool)) code = "invalid_tool";
    snprintf(subject, sizeof subject, "%s.%s", SUBJ_TOOL_INVOKE, tool);
    for (long long at = 0;
         !text && at < e->cfg->tool_attempts && !e->stop && strcmp(code, "invalid_tool"); at++) {
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
            text = tool_outcome(rs);
            protobuf_c_message_free_unpacked(&rs->base, NULL);
        } else {
            code = rc == BUS_ETIMEOUT ? "timeout" : "no_provider";
            if (rc == BUS_ENORESP) usleep(200000);
        }
    }
    free(buf);
    if (!text) {
        metric_inc(e->m_tool_failures);
        cJSON *out = cJSON_CreateObject();
        cJSON_AddBoolToObject(out, "ok", 0);
        cJSON_AddStringToObject(out, "error_code", code);
        cJSON_AddStringToObject(out, "error_message",
                                "the tool provider did not answer within its attempts");
        text = cJSON_PrintUnformatted(out);
        cJSON_Delete(out);
    }
    return text;
}

/* At most this many calls per tool.batch request (the devtools provider's bound too); a
 * group's calls to one tool beyond it go in further batches. */
#define TOOL_BATCH_MAX 256

/* The calls cs[idx[0..n)) of one tool as one request on tool.batch.<tool> (decision: calls to
 * one provider travel together, whichever runs they belong to; each carries its own run, org
 * and idempotency key). Each settled answer (ok, or a failure not worth a retry) becomes its
 * call's outcome; the others stay NULL and go one by one (invoke_tool: the same keys, so
 * nothing runs twice), as do all of them when the provider serves no batches (no responders)
 * or the request fails. */
static void invoke_batch(wf_engine *e, call *cs, const int *idx, int n) {
    Upsquad__Internal__V1__ToolInvokeRequest *rq = calloc((size_t)n, sizeof *rq);
    Upsquad__Internal__V1__ToolInvokeRequest **calls = calloc((size_t)n, sizeof *calls);
    Google__Protobuf__Struct **args = calloc((size_t)n, sizeof *args);
    Upsquad__Internal__V1__ToolInvokeBatchRequest b =
        UPSQUAD__INTERNAL__V1__TOOL_INVOKE_BATCH_REQUEST__INIT;
    Upsquad__Internal__V1__ToolInvokeBatchResponse *rs = NULL;
    const char *tool = cs[idx[0]].j->tool;
    char subject[160];
    natsMsg *reply = NULL;
    uint8_t *buf = NULL;
    if (!rq || !calls || !args || !e->bus || !bus_token_valid(tool)) goto done;
    for (int k = 0; k < n; k++) {
        tool_request(e, &cs[idx[k]], &rq[k], &args[k]);
        calls[k] = &rq[k];
    }
    b.calls = calls;
    b.n_calls = (size_t)n;
    size_t len = protobuf_c_message_get_packed_size(&b.base);
    if (!(buf = malloc(len ? len : 1))) goto done;
    protobuf_c_message_pack(&b.base, buf);
    snprintf(subject, sizeof subject, "%s.%s", SUBJ_TOOL_BATCH, tool);
    metric_inc(e->m_tool_batches);
    if (bus_request(e->bus, subject, buf, (int)len, (int)e->cfg->tool_timeout_ms, &reply) != BUS_OK)
        goto done;
    rs = upsquad__internal__v1__tool_invoke_batch_response__unpack(
        NULL, (size_t)natsMsg_GetDataLength(reply), (const uint8_t *)natsMsg_GetData(reply));
    natsMsg_Destroy(reply);
    for (int k = 0; rs && k < n && (size_t)k < rs->n_results; k++) {
        const Upsquad__Internal__V1__ToolInvokeResponse *r = rs->results[k];
        if (r->ok || !r->retryable) {
            metric_inc(e->m_tool_calls);
            cs[idx[k]].result = tool_outcome(r);
        }
    }
done:
    if (rs) protobuf_c_message_free_unpacked(&rs->base, NULL);
    for (int k = 0; args && k < n; k++)
        if (args[k]) pbjson_struct_free(args[k]);
    free(buf);
    free(args);
    free(calls);
    free(rq);
}

/* A piece of a group's calls made on one thread: a batch (n >= 2 calls of one tool) or one
 * call alone (n == 1, batch 0). idx: borrowed, into cs. */
typedef struct unit {
    call *cs;
    const int *idx;
    int n, batch;
} unit;

static void *unit_thread(void *arg) {
    unit *u = arg;
    if (u->batch)
        invoke_batch(u->cs[u->idx[0]].e, u->cs, u->idx, u->n);
    else
        u->cs[u->idx[0]].result = invoke_tool(&u->cs[u->idx[0]]);
    return NULL;
}

/* Runs us[0..n) at once, in waves of at most MAX_JOBS threads (a wave's first unit on this
 * thread; a thread that cannot start runs its unit here): the group's round lasts about its
 * slowest request, not the sum of its tools' requests. */
static void run_units(unit *us, int n) {
    for (int w = 0; w < n; w += MAX_JOBS) {
        int m = n - w < MAX_JOBS ? n - w : MAX_JOBS, started[MAX_JOBS] = {0};
        pthread_t th[MAX_JOBS];
        for (int i = 1; i < m; i++) {
            started[i] = pthread_create(&th[i], NULL, unit_thread, &us[w + i]) == 0;
            if (!started[i]) unit_thread(&us[w + i]);
        }
        unit_thread(&us[w]);
        for (int i = 1; i < m; i++)
            if (started[i]) pthread_join(th[i], NULL);
    }
}

/* Makes calls cs[0..n): a tool's calls (two or more) as batches of at most TOOL_BATCH_MAX and
 * every other call alone, all at once (run_units); then, again at once, each call left without
 * an outcome (its batch unanswered or refused) alone, with its same key. */
static void invoke_all(call *cs, int n) {
    int *idx = calloc((size_t)n, sizeof *idx);
    unit *us = calloc((size_t)n, sizeof *us);
    char *planned = calloc((size_t)n, 1);
    int nu = 0, m = 0;
    if (!idx || !us || !planned) { /* no memory for the plan: one call at a time */
        for (int k = 0; k < n; k++)
            cs[k].result = invoke_tool(&cs[k]);
        goto done;
    }
    for (int k = 0; k < n; k++) { /* idx: each tool's calls together, in order of first call */
        if (planned[k]) continue;
        int first = m;
        for (int i = k; i < n; i++)
            if (!planned[i] && !strcmp(cs[i].j->tool, cs[k].j->tool)) {
                planned[i] = 1;
                idx[m++] = i;
            }
        for (int i = first; i < m; i += TOOL_BATCH_MAX) {
            int c = m - i < TOOL_BATCH_MAX ? m - i : TOOL_BATCH_MAX;
            us[nu++] = (unit){cs, idx + i, c, m - first >= 2};
        }
    }
    run_units(us, nu);
    nu = m = 0;
    for (int k = 0; k < n; k++)
        if (!cs[k].result) {
            idx[m] = k;
            us[nu++] = (unit){cs, idx + m++, 1, 0};
        }
    run_units(us, nu);
done:
    free(planned);
    free(us);
    free(idx);
}

/* The calls the group's last tick committed, made; each outcome lands in its run's results,
 * for its next tick. */
static void invoke_group(wf_engine *e, tick_run **rs, int n) {
    int total = 0, k = 0;
    for (int i = 0; i < n; i++)
        total += rs[i]->n_jobs;
    call *cs = calloc((size_t)(total ? total : 1), sizeof *cs);
    for (int i = 0; cs && i < n; i++)
        for (int j = 0; j < rs[i]->n_jobs; j++)
            cs[k++] = (call){e, &rs[i]->jobs[j], rs[i]->run_id, rs[i]->org, NULL};
    int64_t t0 = util_mono_us();
    if (cs) invoke_all(cs, total);
    if (total) metric_observe(e->m_tool_round_seconds, (double)(util_mono_us() - t0) / 1e6);
    k = 0;
    for (int i = 0; i < n; i++) { /* the jobs become the next tick's done */
        tick_run *r = rs[i];
        for (int j = 0; j < r->n_jobs; j++) {
            r->done[j] = r->jobs[j];
            r->results[j] = cs ? cs[k++].result : NULL; /* NULL: not called, re-requested */
        }
        r->n_done = r->n_jobs;
        r->n_jobs = 0;
    }
    free(cs);
}

static void drop_outcomes(tick_run *r) {
    for (int k = 0; k < r->n_done; k++) {
        free(r->results[k]);
        free(r->done[k].args);
    }
    r->n_done = 0;
}

/* ---- ticks of a group ---- */

/* Scopes tx's next statements to org unless they already are (*scoped: the org of the last
 * scope statement, "" none yet): every statement of a run runs under its own org (RLS), and
 * consecutive runs of one org share a scope statement. */
static int scope(db_tx *tx, const char *org, const char **scoped, char *err, size_t errlen) {
    if (!strcmp(*scoped, org)) return DB_OK;
    *scoped = org;
    return st_scope_org(tx, org, err, errlen);
}

/* Ticks rs[0..n) in one transaction (interp_int.h, "A group tick"). 0 when it committed. */
static int group_tick(wf_engine *e, tick_run **rs, int n) {
    char err[512] = "";
    const char *scoped = "";
    db_tx *tx = NULL;
    int64_t t0 = util_mono_us();
    int rc = st_begin_ex(e->pool, NULL, NULL, DB_TX_PIPELINE, &tx, err, sizeof err);
    for (int i = 0; rc == DB_OK && i < n; i++) {
        tick_run *r = rs[i];
        rc = scope(tx, r->org, &scoped, err, sizeof err);
        if (rc == DB_OK)
            rc = st_tick_head_send(tx, r->run_id, e->instance, e->cfg->lease_ms, &r->row, &r->fence,
                                   &r->acts, err, sizeof err);
    }
    if (rc == DB_OK) rc = db_pipe_flush(db_tx_conn(tx), err, sizeof err);
    for (int i = 0; rc == DB_OK && i < n; i++) { /* after the reads, under the last run's scope */
        rc = scope(tx, rs[i]->org, &scoped, err, sizeof err);
        if (rc == DB_OK) rc = interp__tick_step(e, tx, rs[i], err, sizeof err);
    }
    if (rc == DB_OK) {
        rc = db_tx_commit(tx, err, sizeof err); /* releases tx either way */
        tx = NULL;
    }
    db_tx_rollback(tx);
    for (int i = 0; i < n; i++)
        interp__tick_end(e, rs[i], rc == DB_OK);
    if (rc == DB_OK) {
        metric_observe(e->m_tick_seconds, (double)(util_mono_us() - t0) / 1e6);
        metric_observe(e->m_group_runs, n);
        wf_engine_kick_relay(e);
    } else {
        log_error("run.tick", "%d run(s): %s (%s)", n, err, db_sqlstate());
    }
    return rc;
}

/* Frees the leases of rs[0..n) with a wake-up now: they have more to do (a round limit or a
 * shutdown ended their turn; outcomes not yet applied are re-requested with their keys). */
static void release_group(wf_engine *e, tick_run **rs, int n) {
    char err[512] = "";
    const char *scoped = "";
    db_tx *tx = NULL;
    int rc = st_begin_ex(e->pool, NULL, NULL, DB_TX_PIPELINE, &tx, err, sizeof err);
    for (int i = 0; rc == DB_OK && i < n; i++) {
        rc = scope(tx, rs[i]->org, &scoped, err, sizeof err);
        if (rc == DB_OK)
            rc = st_queue_release(tx, rs[i]->run_id, e->instance, rs[i]->gen, wf_now_ms(), err,
                                  sizeof err);
    }
    if (rc == DB_OK) {
        rc = db_tx_commit(tx, err, sizeof err);
        tx = NULL;
    }
    db_tx_rollback(tx);
    if (rc != DB_OK) log_warn("run.release", "%d run(s): %s", n, err); /* leases expire */
}

/* ---- the thread ---- */

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

static int by_run_id(const void *a, const void *b) {
    return strcmp((*(tick_run *const *)a)->run_id, (*(tick_run *const *)b)->run_id);
}

/* Claims up to max - n due runs (fair across orgs: st_queue_claim) into free slots, appended
 * to rs[0..n) and the whole kept sorted by run id (every group locks its runs' rows in the
 * same order); the new n. */
static int claim(wf_engine *e, tick_run *slots, int max, tick_run **rs, int n) {
    char err[512];
    db_tx *tx = NULL;
    PGresult *r = NULL;
    int rc = st_begin_service_ex(e->pool, DB_TX_PIPELINE, &tx, err, sizeof err);
    if (rc == DB_OK)
        rc = st_queue_claim(tx, e->instance, e->cfg->lease_ms, max - n, &r, err, sizeof err);
    if (rc == DB_OK) {
        rc = db_tx_commit(tx, err, sizeof err); /* releases tx either way */
        tx = NULL;
    }
    if (rc != DB_OK) log_warn("run.claim", "%s", err);
    for (int i = 0, k = 0; rc == DB_OK && i < PQntuples(r) && n < max; i++) {
        while (slots[k].used)
            k++;
        tick_run *s = &slots[k];
        snprintf(s->run_id, sizeof s->run_id, "%s", st_s(r, i, 0));
        snprintf(s->org, sizeof s->org, "%s", st_s(r, i, 1));
        s->gen = st_i(r, i, 2);
        s->n_done = s->n_jobs = s->ticks = 0;
        s->used = 1;
        rs[n++] = s;
    }
    db_tx_rollback(tx);
    PQclear(r);
    qsort(rs, (size_t)n, sizeof *rs, by_run_id);
    return n;
}

/* Takes a pending kick (a local trigger or wake-up): 1 when there was one. */
static int take_kick(wf_engine *e) {
    pthread_mutex_lock(&e->mu);
    int k = e->kick != 0;
    e->kick = 0;
    pthread_mutex_unlock(&e->mu);
    return k;
}

/* More may be due: one more idle thread looks (a chain that ends with the first claim
 * finding nothing or room to spare). */
static void kick_one(wf_engine *e) {
    pthread_mutex_lock(&e->mu);
    e->kick = 1;
    pthread_cond_signal(&e->cv);
    pthread_mutex_unlock(&e->mu);
}

/* Advances the claimed runs rs[0..n) until none is left: a tick with tool calls keeps its run
 * in the group for the next tick, which applies their outcomes; an idle or finished run (or
 * one whose lease was lost) leaves it, and so does one after TICKS_PER_CLAIM ticks (released,
 * woken at once, so other threads and replicas get their turn). Between two ticks the group
 * takes in runs that became due (a kick, or one idle-poll interval since it last looked), so a
 * run triggered while every thread is busy waits for one round, not for a whole group. */
static void process_group(wf_engine *e, tick_run *slots, int max, tick_run **rs, int n) {
    int64_t looked = wf_now_ms();
    while (n > 0 && !e->stop) {
        if (group_tick(e, rs, n) != DB_OK && n > 1) {
            metric_inc(e->m_group_fallbacks);
            for (int i = 0; i < n; i++)
                group_tick(e, &rs[i], 1);
        }
        int live = 0, spent = 0;
        tick_run *done[n]; /* n > 0 here */
        for (int i = 0; i < n; i++) {
            tick_run *r = rs[i];
            drop_outcomes(r);
            if (r->out == TICK_JOBS && ++r->ticks < TICKS_PER_CLAIM)
                rs[live++] = r;
            else if (r->out == TICK_JOBS)
                done[spent++] = r; /* its calls are re-requested, same keys, by the next holder */
            else
                r->used = 0;
        }
        if (spent > 0) release_group(e, done, spent);
        for (int i = 0; i < spent; i++) {
            for (int j = 0; j < done[i]->n_jobs; j++)
                free(done[i]->jobs[j].args);
            done[i]->n_jobs = 0;
            done[i]->used = 0;
        }
        n = live;
        if (n > 0) invoke_group(e, rs, n);
        if (n > 0 && n < max && !e->stop &&
            (take_kick(e) || wf_now_ms() - looked >= e->cfg->idle_poll_ms)) {
            int room = max - n;
            looked = wf_now_ms();
            n = claim(e, slots, max, rs, n);
            if (n - live == room) kick_one(e);
        }
    }
    for (int i = 0; i < n; i++) { /* stopping: the outcomes in hand are re-requested later */
        drop_outcomes(rs[i]);
        rs[i]->used = 0;
    }
    if (n > 0) release_group(e, rs, n);
}

void *wf_interp_thread(void *arg) {
    wf_engine *e = arg;
    int max = (int)e->cfg->group_max;
    tick_run *slots = calloc((size_t)max, sizeof *slots);
    tick_run **rs = calloc((size_t)max, sizeof *rs);
    if (!slots || !rs) {
        log_error("run.claim", "no memory for %d run slots: this interpreter thread stops", max);
        goto done;
    }
    while (!e->stop) {
        int n = claim(e, slots, max, rs, 0);
        if (n > 0) {
            kick_one(e);
            process_group(e, slots, max, rs, n);
        } else {
            idle_wait(e, e->cfg->idle_poll_ms);
        }
    }
done:
    free(rs);
    free(slots);
    return NULL;
}
