/* The autonomous plan loop (autonomy.h). */
#include "autonomy.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fields.h"
#include "ids.h"
#include "lease.h"
#include "log.h"
#include "pbjson.h"
#include "store.h"
#include "util.h"
#include "workers.h"

typedef Upsquad__Runtime__V1__ExecuteStepEvent StepEvent;

#define RETRY_WAIT_MS 5000 /* a lost worker's cycle waits this long for a live one */

/* ---- the plan ---- */

typedef struct todo_in {
    const char *title; /* borrowed */
    size_t len;
    uint32_t ordering;
    size_t pos;
} todo_in;

static int by_ordering(const void *a, const void *b) {
    const todo_in *x = a, *y = b;
    if (x->ordering != y->ordering) return x->ordering < y->ordering ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos; /* stable: the worker's order breaks ties */
}

static void add_todo(cJSON *arr, int n, const char *title, size_t len) {
    char id[32], *t = strndup(title, len);
    cJSON *o = cJSON_CreateObject();
    snprintf(id, sizeof id, "todo-%d", n);
    cJSON_AddStringToObject(o, "id", id);
    cJSON_AddStringToObject(o, "title", t ? t : "");
    cJSON_AddBoolToObject(o, "done", 0);
    cJSON_AddItemToArray(arr, o);
    free(t);
}

char *orch_auto_plan(const Upsquad__Runtime__V1__DecompositionEvent *d, const char *goal,
                     int max_todos, int *n) {
    size_t cnt = d ? d->n_todos : 0, k = 0;
    todo_in *in = calloc(cnt ? cnt : 1, sizeof *in);
    cJSON *arr = cJSON_CreateArray();
    char *out = NULL;
    *n = 0;
    if (!in || !arr) goto done;
    for (size_t i = 0; i < cnt; i++) {
        const char *t = d->todos[i]->title ? d->todos[i]->title : "";
        size_t len = strlen(t);
        while (len && (*t == ' ' || *t == '\t' || *t == '\n' || *t == '\r'))
            t++, len--;
        while (len && (t[len - 1] == ' ' || t[len - 1] == '\t' || t[len - 1] == '\n' ||
                       t[len - 1] == '\r'))
            len--;
        if (len == 0) continue; /* spec TodoSpec.title: "a todo with an empty title is dropped" */
        in[k++] = (todo_in){t, util_utf8_cut(t, len < 2000 ? len : 2000), d->todos[i]->ordering, i};
    }
    /* spec TodoSpec.ordering: "the orchestrator stable-sorts by it, then re-indexes ids" */
    qsort(in, k, sizeof *in, by_ordering);
    for (size_t i = 0; i < k && (int)i < max_todos; i++)
        add_todo(arr, ++*n, in[i].title, in[i].len);
    /* spec DecompositionEvent: empty -> "keeps its single seed todo and pursues the goal" */
    if (*n == 0) add_todo(arr, ++*n, goal, util_utf8_cut(goal, 2000));
    out = cJSON_PrintUnformatted(arr);
done:
    free(in);
    cJSON_Delete(arr);
    return out;
}

/* ---- one cycle's signals (the observer of its step) ---- */

typedef struct signals {
    const char *goal;
    int max_todos;
    char *plan; /* the PLAN step's todos (heap), NULL until a DecompositionEvent came */
    int n_todos;
    int progress; /* a StepProgress came */
    int artifacts, marked_done, errored;
    char hash[65]; /* hex sha256 of response_delta_hash ("" none) */
    char *final_text;
    /* the turn's steps' token usage summed (spec CompletionEvent.token_usage: "aggregated
     * token counts and cost"): the PLAN step and every cycle, not reset between cycles */
    long long in_tokens, out_tokens;
    double cost_usd;
    char model[128];
} signals;

static void observe(void *ud, const StepEvent *ev) {
    signals *g = ud;
    switch (ev->event_case) {
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_DECOMPOSITION:
        free(g->plan);
        g->plan = orch_auto_plan(ev->decomposition, g->goal, g->max_todos, &g->n_todos);
        break;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STEP_PROGRESS: {
        const Upsquad__Runtime__V1__StepProgress *sp = ev->step_progress;
        g->progress = 1;
        g->artifacts |= sp->produced_new_artifacts;
        g->marked_done |= sp->todo_marked_complete_by_model;
        g->errored += (int)sp->tool_calls_errored;
        if (sp->response_delta_hash.len)
            ids_sha256_hex(sp->response_delta_hash.data, sp->response_delta_hash.len, g->hash);
        break;
    }
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION: {
        const Upsquad__Runtime__V1__TokenUsage *u = ev->completion->token_usage;
        free(g->final_text);
        g->final_text =
            strdup(ev->completion->final_response ? ev->completion->final_response : "");
        if (u) {
            g->in_tokens += u->input_tokens;
            g->out_tokens += u->output_tokens;
            g->cost_usd += u->cost_usd;
            if (u->model && *u->model) snprintf(g->model, sizeof g->model, "%s", u->model);
        }
        break;
    }
    default:
        break;
    }
}

static void signals_reset(signals *g) {
    free(g->final_text);
    g->final_text = NULL;
    g->progress = g->artifacts = g->marked_done = g->errored = 0;
    g->hash[0] = 0;
}

/* ---- telling the caller ---- */

/* The loop's progress on the caller's stream (within a delegated child's turn, wrapped). */
static void tell(rpc_call *call, const orch_envelope *env, const char *detail) {
    if (call) orch_chat_send_status(call, env, detail, 0);
}

/* The loop's one CompletionEvent: the last cycle's answer, the cycles, the turn's steps' usage
 * summed and its wall-clock time since started_ms (spec CompletionEvent). */
static void tell_completion(rpc_call *call, const orch_envelope *env, const char *text, int cycles,
                            const signals *g, int64_t started_ms) {
    if (!call) return;
    Upsquad__Runtime__V1__CompletionEvent c = UPSQUAD__RUNTIME__V1__COMPLETION_EVENT__INIT;
    Upsquad__Runtime__V1__TokenUsage u = UPSQUAD__RUNTIME__V1__TOKEN_USAGE__INIT;
    Upsquad__Runtime__V1__AgentEvent ae;
    upsquad__runtime__v1__agent_event__init(&ae);
    c.final_response = (char *)(text ? text : "");
    c.loop_iterations = cycles;
    u.input_tokens = (int32_t)(g->in_tokens < INT32_MAX ? g->in_tokens : INT32_MAX);
    u.output_tokens = (int32_t)(g->out_tokens < INT32_MAX ? g->out_tokens : INT32_MAX);
    u.cost_usd = g->cost_usd;
    u.model = (char *)g->model;
    c.token_usage = &u;
    int64_t ms = util_mono_ms() - started_ms;
    c.duration_ms = (int32_t)(ms < INT32_MAX ? ms : INT32_MAX);
    ae.event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_COMPLETION;
    ae.completion = &c;
    orch_chat_send(call, env, &ae);
}

/* ---- the loop ---- */

/* Why a loop's turn ends (spec: stall, max_loops, plan complete, cancel and error are the
 * termination reasons); gate, paused, error_retryable and unattended (a gate's decision
 * resumed its cycle with nobody listening) stop the turn, not the plan. */
typedef enum {
    GO_ON = 0,
    END_PLAN_COMPLETE,
    END_MAX_LOOPS,
    END_STALL,
    END_CANCEL,
    END_ERROR,
    STOP_PAUSED,
    STOP_GATE,
    STOP_ERROR_RETRYABLE,
    STOP_UNATTENDED,
} why;

static const char *why_name(why w) {
    static const char *names[] = {
        "",      "plan_complete", "max_loops", "stall",           "cancel",
        "error", "paused",        "gate",      "error_retryable", "unattended"};
    return names[w];
}

typedef struct loop {
    orch *o;
    rpc_call *call;
    const orch_chat_turn *t;
    orch_plan pl;
    cJSON *todos; /* pl.todos parsed */
    int n;
    int base;           /* the session's loop_count when the turn began */
    const signals *g;   /* its steps' signals (the usage summed) */
    int64_t started_ms; /* monotonic: the turn's start */
} loop;

static const char *todo_field(const loop *l, int i, const char *k) {
    const char *v =
        cJSON_GetStringValue(cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(l->todos, i), k));
    return v ? v : "";
}

/* Stores the plan after a cycle (loop_count follows), with an audit row of type (NULL none). */
static void save(loop *l, const char *type, cJSON *detail) {
    char err[256], *d = detail ? cJSON_PrintUnformatted(detail) : NULL;
    char *todos = cJSON_PrintUnformatted(l->todos);
    if (todos) {
        free(l->pl.todos);
        l->pl.todos = todos;
    }
    if (orch_store_plan_save(l->o->pool, l->t->org, l->t->sid, &l->pl, l->base + l->pl.cycles, type,
                             l->t->s->agent_id, l->t->parent, d, err, sizeof err) != DB_OK)
        log_error("auto.save", "session %s: %s", l->t->sid, err);
    free(d);
    cJSON_Delete(detail);
}

/* The orchestrator's confirmation that the active todo is done (the model's flag is only a
 * signal): its step completed, and either the worker reported no progress signals at all (a
 * worker that cannot tell: the completion is its answer), or the model marked it complete
 * with no tool call of the step failing. */
static int confirmed(const signals *g) {
    return !g->progress || (g->marked_done && g->errored == 0);
}

/* spec StepProgress: a stall is "no new artifacts AND no completed todos AND a repeating
 * response_delta_hash" over the window: the cycles counted here in a row. */
static int stalled(loop *l, const signals *g, int done) {
    int repeat = g->hash[0] && !strcmp(g->hash, l->pl.last_hash);
    if (!done && !g->artifacts && repeat)
        l->pl.stall++;
    else
        l->pl.stall = 0;
    snprintf(l->pl.last_hash, sizeof l->pl.last_hash, "%s", g->hash);
    return l->pl.stall >= l->o->cfg->auto_stall_window;
}

/* The PLAN step: its decomposition becomes the plan (a worker that sends none keeps the seed). */
static int plan(loop *l, signals *g, orch_turn_result *res, orch_chat_state *st) {
    orch_chat_step step = {
        .goal = ORCH_PLAN_GOAL, .observe = observe, .ud = g, .hold_completion = 1};
    orch_chat_turn t = *l->t;
    t.step = &step;
    int rc = orch_chat_steps(l->o, l->call, &t, res, st);
    if (res->outcome != TURN_COMPLETED) return rc;
    free(l->pl.goal);
    l->pl.goal = strdup(l->t->message);
    if (!g->plan)
        g->plan = orch_auto_plan(NULL, l->t->message, (int)l->o->cfg->auto_max_todos, &g->n_todos);
    cJSON_Delete(l->todos);
    l->todos = cJSON_Parse(g->plan ? g->plan : "[]");
    l->n = cJSON_GetArraySize(l->todos);
    l->pl.cursor = l->pl.cycles = l->pl.stall = 0;
    l->pl.last_hash[0] = 0;
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "todos", l->n);
    save(l, "plan_created", d);
    char msg[96];
    snprintf(msg, sizeof msg, "plan: %d todo(s)", l->n);
    tell(l->call, l->t->env, msg);
    return rc;
}

/* Ends the loop's turn: the reason stored and audited (loop_terminated, or loop_stopped when
 * the plan goes on later), told to the caller, and the turn's end stored: a completed plan (or
 * a pause between cycles) completes the turn with the last cycle's answer; stall and max_loops
 * are errors the caller is told; a step's own outcome (a gate, an error, a cancel) stands. */
static int finish(loop *l, why w, orch_turn_result *res, orch_chat_state *st, int *parked) {
    char msg[256];
    int done = 0;
    for (int i = 0; i < l->n; i++)
        done +=
            cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(cJSON_GetArrayItem(l->todos, i), "done"));
    l->pl.ended =
        w != STOP_PAUSED && w != STOP_GATE && w != STOP_ERROR_RETRYABLE && w != STOP_UNATTENDED;
    snprintf(l->pl.reason, sizeof l->pl.reason, "%s", why_name(w));
    /* the gate the cycle parked on: its decision re-enters this cycle (orch_auto_resume) */
    snprintf(l->pl.gate, sizeof l->pl.gate, "%s", w == STOP_GATE ? st->approval_id : "");
    cJSON *d = cJSON_CreateObject();
    cJSON_AddStringToObject(d, "reason", why_name(w));
    if (l->pl.gate[0]) cJSON_AddStringToObject(d, "approval_id", l->pl.gate);
    cJSON_AddNumberToObject(d, "cycles", l->pl.cycles);
    cJSON_AddNumberToObject(d, "todos_done", done);
    cJSON_AddNumberToObject(d, "todos", l->n);
    save(l, l->pl.ended ? "loop_terminated" : "loop_stopped", d);
    snprintf(msg, sizeof msg, "autonomous loop %s: %s after %d cycle(s), %d/%d todo(s) done",
             l->pl.ended ? "ended" : "stopped", why_name(w), l->pl.cycles, done, l->n);
    log_info("auto.end", "session %s: %s", l->t->sid, msg);
    if (w != STOP_GATE && w != END_CANCEL) tell(l->call, l->t->env, msg);
    switch (w) {
    case END_PLAN_COMPLETE:
        res->outcome = TURN_COMPLETED;
        tell_completion(l->call, l->t->env, res->final_text, l->pl.cycles, l->g, l->started_ms);
        break;
    case STOP_PAUSED:
        res->outcome = TURN_COMPLETED;
        break;
    case END_STALL:
    case END_MAX_LOOPS:
        res->outcome = TURN_FAILED;
        snprintf(res->error_code, sizeof res->error_code, "%s",
                 w == END_STALL ? "AUTONOMOUS_STALLED" : "AUTONOMOUS_MAX_LOOPS");
        free(res->error_message);
        res->error_message = strdup(msg);
        res->retryable = 0;
        if (l->call) orch_chat_send_error(l->call, l->t->env, res->error_code, msg, 0);
        st->error_relayed = 1;
        break;
    case END_CANCEL:
        res->outcome = TURN_CANCELLED;
        break;
    default: /* the step's own outcome */
        break;
    }
    return orch_chat_finish(l->o, l->call, l->t, res, st, parked);
}

/* spec TerminateSession "ends an active session and releases its resources": 1 when the
 * session is over (told on the stream), so the loop runs no cycle after it and a cycle the
 * terminate cut short ends the loop as cancelled, not as the step's error. *pending: a pause
 * waits (may be NULL). A failed read is neither. */
static int session_over(loop *l, int *pending) {
    char err[256];
    int p = 0, ended = 0;
    if (orch_store_pause_pending(l->o->pool, l->t->org, l->t->sid, &p, &ended, err, sizeof err) !=
        DB_OK)
        p = ended = 0;
    if (pending) *pending = p;
    if (ended) tell(l->call, l->t->env, "the session was terminated: the autonomous loop stops");
    return ended;
}

/* The step of the cycle on the active todo, and what the orchestrator makes of it. resumed: the
 * cycle that parked on a gate, re-entered from its frozen checkpoint after the decision (the
 * resume as t carries it: its worker, and the ask_user_resume of a denial or an answer); it
 * was counted when it began, and a lost worker does not run it again from scratch (its gated
 * call may have run). */
static why step(loop *l, const orch_chat_turn *base, int resumed, signals *g, orch_turn_result *res,
                orch_chat_state *st, int *rc) {
    char msg[2200];
    int ended = 0; /* session_over said so (and told the caller): read and told once */
    const char *title = todo_field(l, l->pl.cursor, "title");
    snprintf(msg, sizeof msg, "%s (%d/%d)%s: %s", todo_field(l, l->pl.cursor, "id"),
             l->pl.cursor + 1, l->n, resumed ? " resumed" : "", title);
    tell(l->call, l->t->env, msg);
    orch_chat_step cs = {.goal = title, .observe = observe, .ud = g, .hold_completion = 1};
    orch_chat_turn t = *base;
    t.step = &cs;
    /* a cycle is an autonomous step, also when a gate's resume (which knows only the session's
     * mode) re-enters it */
    t.mode = UPSQUAD__RUNTIME__V1__EXECUTION_MODE__EXECUTION_MODE_AUTONOMOUS;
    /* the cycle's user_message is the plan's goal, also when a later message (a nudge)
     * continues the plan */
    if (l->pl.goal) t.message = l->pl.goal;
    signals_reset(g);
    for (long long attempt = 0;; attempt++) {
        orch_turn_result_clear(res);
        orch_chat_state_clear(st);
        *rc = orch_chat_steps(l->o, l->call, &t, res, st);
        /* a worker lost mid-cycle (crash, unreachable): the same todo again, on a live worker
         * (the lost one is marked down), from the session's state there; the pool may need a
         * probe round to see the other one live (up to RETRY_WAIT_MS) */
        if ((res->outcome != TURN_FAILED && res->outcome != TURN_NO_WORKER) || !res->retryable ||
            st->error_relayed || resumed || attempt >= l->o->cfg->auto_retries ||
            (ended = session_over(l, NULL)))
            break;
        log_warn("auto.retry", "session %s: %s failed (%s); again on another worker", l->t->sid,
                 todo_field(l, l->pl.cursor, "id"), res->error_code);
        for (int w = 0; w < RETRY_WAIT_MS / 100 && orch_workers_live(l->o->workers) == 0; w++)
            usleep(100 * 1000);
    }
    if (!resumed) l->pl.cycles++;
    if (res->outcome == TURN_INTERRUPT || res->outcome == TURN_INPUT_REQUIRED) return STOP_GATE;
    if (res->outcome == TURN_CANCELLED) return END_CANCEL;
    if (res->outcome != TURN_COMPLETED)
        return ended || session_over(l, NULL) ? END_CANCEL
               : res->retryable               ? STOP_ERROR_RETRYABLE
                                              : END_ERROR;
    free(res->final_text);
    res->final_text = g->final_text ? strdup(g->final_text) : NULL;
    int done = confirmed(g);
    cJSON *d = NULL;
    if (done) {
        cJSON_ReplaceItemInObjectCaseSensitive(cJSON_GetArrayItem(l->todos, l->pl.cursor), "done",
                                               cJSON_CreateTrue());
        d = cJSON_CreateObject();
        cJSON_AddStringToObject(d, "todo", todo_field(l, l->pl.cursor, "id"));
        cJSON_AddNumberToObject(d, "cycle", l->pl.cycles);
        snprintf(msg, sizeof msg, "%s done", todo_field(l, l->pl.cursor, "id"));
        l->pl.cursor++;
    }
    int stall = stalled(l, g, done);
    save(l, done ? "todo_done" : NULL, d);
    if (done) tell(l->call, l->t->env, msg);
    return stall ? END_STALL : GO_ON;
}

/* One cycle on the active todo; GO_ON when the loop goes on, else why it ends. */
static why cycle(loop *l, signals *g, orch_turn_result *res, orch_chat_state *st, int *rc) {
    int pending = 0;
    if (l->pl.cursor >= l->n) return END_PLAN_COMPLETE;
    if (l->pl.cycles >= l->t->s->max_loops) return END_MAX_LOOPS;
    if (l->call && rpc_cancelled(l->call)) return END_CANCEL;
    if (session_over(l, &pending)) return END_CANCEL;
    /* spec: a pause commits at the next boundary: between cycles */
    if (pending) return STOP_PAUSED;
    return step(l, l->t, 0, g, res, st, rc);
}

int orch_auto_busy(orch *o, rpc_call *call, const char *org, const char *sid) {
    char err[256];
    int busy = 0;
    /* one loop per session: a second autonomous message while a turn of the session runs
     * would drive the same plan twice; refused before anything changes */
    if (orch_store_plan_busy(o->pool, org, sid, "00000000-0000-0000-0000-000000000000",
                             o->cfg->turn_lease_ttl_ms, &busy, err, sizeof err) != DB_OK)
        return orch_store_failed(call, "reading the session's turns", err);
    if (busy)
        return rpc_error(call, RPC_FAILED_PRECONDITION,
                         "session %s is running a turn: one autonomous loop runs at a time; send "
                         "again when it ended",
                         sid);
    return RPC_OK;
}

/* A plan left running (a pause, a gate, a lost worker or replica) goes on at its todo: pl
 * (taken over) becomes the loop's; the turn's message is a nudge or a gate's resume, not a new
 * goal. */
static void go_on(loop *l, signals *g, orch_plan *pl) {
    l->pl = *pl;
    memset(pl, 0, sizeof *pl);
    l->pl.gate[0] = 0; /* a running loop waits on no gate (a resumed one was taken) */
    l->todos = cJSON_Parse(l->pl.todos ? l->pl.todos : "[]");
    l->n = cJSON_GetArraySize(l->todos);
    l->base = l->base > l->pl.cycles ? l->base - l->pl.cycles : 0; /* loop_count counts them */
    g->goal = l->pl.goal;
}

/* The loop's turn: t's message plans a new goal or nudges the stored plan on; gated (non-NULL,
 * taken over): the plan whose cycle parked on the gate t resumes, re-entered first. */
static int drive(orch *o, rpc_call *call, const orch_chat_turn *t, orch_plan *gated, int *parked) {
    orch_turn_result res;
    orch_chat_state st;
    orch_lease lease = {.held = 0};
    orch_plan pl = {0};
    char err[256];
    /* the cycles after a resumed one are fresh steps (on the worker it ran on: the session's
     * state is there) */
    orch_chat_turn fresh = *t;
    fresh.resume = NULL;
    signals g = {.goal = t->message, .max_todos = (int)o->cfg->auto_max_todos};
    loop l = {.o = o,
              .call = call,
              .t = &fresh,
              .base = t->s->loop_count,
              .g = &g,
              .started_ms = util_mono_ms()};
    int rc = RPC_OK;
    why w = GO_ON;
    *parked = 0;
    memset(&res, 0, sizeof res);
    memset(&st, 0, sizeof st);
    orch_lease_hold(&lease, t->parent);
    if (gated) {
        go_on(&l, &g, gated);
        w = step(&l, t, 1, &g, &res, &st, &rc);
        /* with nobody listening the resumed cycle ends the turn: the plan is not run on for a
         * caller who is not there; the next autonomous SendMessage goes on at the next todo */
        if (w == GO_ON && !call && l.pl.cursor < l.n) w = STOP_UNATTENDED;
    } else if (orch_store_plan_get(o->pool, t->org, t->sid, &pl, err, sizeof err) == DB_OK &&
               !pl.ended) {
        go_on(&l, &g, &pl);
        tell(call, t->env, "continuing the plan");
    } else {
        orch_plan_clear(&pl);
        rc = plan(&l, &g, &res, &st);
        if (res.outcome != TURN_COMPLETED) {
            w = res.outcome == TURN_CANCELLED ? END_CANCEL : END_ERROR;
            if (!l.pl.goal) l.pl.goal = strdup(t->message);
            if (!l.todos) l.todos = cJSON_CreateArray();
        }
    }
    while (w == GO_ON)
        w = cycle(&l, &g, &res, &st, &rc);
    int rc2 = finish(&l, w, &res, &st, parked);
    rc = rc != RPC_OK ? rc : rc2;
    orch_lease_drop(&lease);
    orch_turn_result_clear(&res);
    orch_chat_state_clear(&st);
    cJSON_Delete(l.todos);
    orch_plan_clear(&l.pl);
    orch_plan_clear(&pl);
    free(g.plan);
    free(g.final_text);
    return rc;
}

int orch_auto_run(orch *o, rpc_call *call, const orch_chat_turn *t, int *parked) {
    return drive(o, call, t, NULL, parked);
}

int orch_auto_resume(orch *o, rpc_call *call, const orch_chat_turn *t, const char *approval_id,
                     int *parked) {
    orch_plan pl;
    char err[256];
    int rc = orch_store_plan_get(o->pool, t->org, t->sid, &pl, err, sizeof err);
    if (rc != DB_OK && rc != ORCH_ENOTFOUND)
        log_warn("auto.resume", "session %s: reading the plan: %s", t->sid, err);
    /* the plan names the gate its cycle parked on; any other gate was a chat turn's */
    if (rc != DB_OK || pl.ended || strcmp(pl.gate, approval_id)) {
        orch_plan_clear(&pl);
        return orch_chat_run(o, call, t, parked);
    }
    log_info("auto.resume", "session %s: the gate %s re-enters its cycle", t->sid, approval_id);
    rc = drive(o, call, t, &pl, parked);
    orch_plan_clear(&pl);
    return rc;
}
