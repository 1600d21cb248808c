/* workflow-engine-load: drives runs of N tool_action steps through a workflow-engine and reports
 * step transitions per second and trigger-to-first-step latency (bench/workflow-engine-load/
 * bench.sh).
 *
 *   workflow-engine-load --target HOST:PORT --token JWT [--runs N] [--steps N]
 *   workflow-engine-load --target HOST:PORT --token JWT --fairness VICTIM_JWT [--runs N]
 *   workflow-engine-load --target HOST:PORT --token JWT --sequential [--runs N]
 *                        [--steps N | --laps N]
 *   workflow-engine-load --target HOST:PORT --token JWT --rate RUNS_PER_S [--runs N] [--steps N]
 *
 * Creates one workflow of `steps` chained github.get_issue steps, triggers `runs` runs as fast
 * as it can, polls each until it ends, and prints one JSON line: runs, steps, seconds (first
 * trigger to last completion), transitions (two per step: in_progress, completed),
 * transitions_per_s, first_step_p50_ms / first_step_p99_ms (30 runs one at a time on the idle
 * engine before; server clock: the run's created_at to its first action's created_at; with 30
 * samples p99 is the maximum), failed runs. With --fairness it measures per-org fairness
 * instead (fairness(): another org's one-step latency under this org's flood vs idle). With
 * --sequential it runs `runs` runs one after another (each to its end before the next starts)
 * of `steps` chained steps, or of one loop of `laps` laps of one tool step, and prints the
 * wall time per transition: what one more step costs a run as the run grows (sequential()).
 * With --rate R it triggers `runs` runs open-loop, one every 1/R s whatever the engine does,
 * waits for them all, and prints their trigger-to-first-step p50/p99 (server clock, every run
 * a sample, after a second of the same load not counted): the latency a steady load of R
 * runs/s sees (at_rate()). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "pbjson.h"
#include "rpc_client.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

#define SVC "/upsquad.workflow.v1.WorkflowService/"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* `laps` laps of one tool step: nested loops (a loop has at most 25 laps), the outermost
 * taking the largest factor of what is left that is at most 25; NULL when laps has no such
 * factorisation (a prime above 25). */
static char *loop_definition(int laps) {
    cJSON *d = cJSON_CreateObject(), *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "version", 1);
    cJSON_AddStringToObject(d, "start", "l0");
    cJSON_AddItemToObject(d, "steps", s);
    int level = 0, left = laps;
    while (left > 1) {
        int f = 25;
        while (f > 1 && left % f)
            f--;
        if (f == 1) {
            cJSON_Delete(d);
            return NULL;
        }
        char name[16], body[16];
        snprintf(name, sizeof name, "l%d", level);
        snprintf(body, sizeof body, "l%d", level + 1);
        left /= f;
        cJSON *l = cJSON_AddObjectToObject(s, name);
        cJSON_AddStringToObject(l, "type", "loop");
        cJSON_AddNumberToObject(l, "max_iterations", f);
        cJSON_AddStringToObject(l, "body", left > 1 ? body : "t");
        level++;
    }
    cJSON *t = cJSON_AddObjectToObject(s, "t");
    cJSON_AddStringToObject(t, "type", "tool_action");
    cJSON_AddStringToObject(t, "tool", "github");
    cJSON_AddStringToObject(t, "action", "get_issue");
    cJSON *w = cJSON_AddObjectToObject(t, "with");
    cJSON_AddStringToObject(w, "repo", "acme/widgets");
    cJSON_AddNumberToObject(w, "number", 1);
    if (level == 0) cJSON_SetValuestring(cJSON_GetObjectItem(d, "start"), "t");
    char *out = cJSON_PrintUnformatted(d);
    cJSON_Delete(d);
    return out;
}

static char *definition(int steps) {
    cJSON *d = cJSON_CreateObject(), *s = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "version", 1);
    cJSON_AddStringToObject(d, "start", "s0");
    for (int i = 0; i < steps; i++) {
        char name[16], next[16];
        snprintf(name, sizeof name, "s%d", i);
        snprintf(next, sizeof next, "s%d", i + 1);
        cJSON *st = cJSON_AddObjectToObject(s, name);
        cJSON_AddStringToObject(st, "type", "tool_action");
        cJSON_AddStringToObject(st, "tool", "github");
        cJSON_AddStringToObject(st, "action", "get_issue");
        cJSON *w = cJSON_AddObjectToObject(st, "with");
        cJSON_AddStringToObject(w, "repo", "acme/widgets");
        cJSON_AddNumberToObject(w, "number", i + 1);
        if (i + 1 < steps) cJSON_AddStringToObject(st, "next", next);
    }
    cJSON_AddItemToObject(d, "steps", s);
    char *out = cJSON_PrintUnformatted(d);
    cJSON_Delete(d);
    return out;
}

static rpc_channel *ch;
static rpc_call_opts opts;

static char *trigger_as(const rpc_call_opts *o, const char *wf) {
    rpc_status st = {0};
    Upsquad__Workflow__V1__TriggerWorkflowRequest tr =
        UPSQUAD__WORKFLOW__V1__TRIGGER_WORKFLOW_REQUEST__INIT;
    tr.workflow_id = (char *)wf;
    Upsquad__Workflow__V1__TriggerWorkflowResponse *r = NULL;
    if (rpc_unary_call(ch, SVC "TriggerWorkflow", &tr.base,
                       &upsquad__workflow__v1__trigger_workflow_response__descriptor, o,
                       (ProtobufCMessage **)&r, &st)) {
        fprintf(stderr, "TriggerWorkflow: %d\n", st.code);
        exit(1);
    }
    char *id = strdup(r->run->id);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return id;
}

static char *trigger(const char *wf) {
    return trigger_as(&opts, wf);
}

/* 1 when the run ended (*failed set), 0 when not yet; *first_ms the first step's delay. */
static int finished_as(const rpc_call_opts *o, const char *run, int *failed, double *first_ms) {
    rpc_status st = {0};
    Upsquad__Workflow__V1__GetWorkflowStatusRequest gr =
        UPSQUAD__WORKFLOW__V1__GET_WORKFLOW_STATUS_REQUEST__INIT;
    gr.run_id = (char *)run;
    Upsquad__Workflow__V1__GetWorkflowStatusResponse *g = NULL;
    if (rpc_unary_call(ch, SVC "GetWorkflowStatus", &gr.base,
                       &upsquad__workflow__v1__get_workflow_status_response__descriptor, o,
                       (ProtobufCMessage **)&g, &st))
        return 0;
    const char *s = g->run->status;
    int end = !strcmp(s, "completed") || !strcmp(s, "failed") || !strcmp(s, "cancelled");
    *failed = strcmp(s, "completed") != 0;
    if (g->n_actions > 0 && first_ms)
        *first_ms = (double)(pbjson_ts_to_ms(g->actions[0]->created_at) -
                             pbjson_ts_to_ms(g->run->created_at));
    protobuf_c_message_free_unpacked(&g->base, NULL);
    return end;
}

static int finished(const char *run, int *failed, double *first_ms) {
    return finished_as(&opts, run, failed, first_ms);
}

/* The id of a new workflow of definition dj (JSON), created as o's org; caller frees. */
static char *create_as(const rpc_call_opts *o, const char *dj) {
    char err[256];
    cJSON *dc = cJSON_Parse(dj);
    Google__Protobuf__Struct *def = NULL;
    pbjson_struct_from_json(dc, &def, err, sizeof err);
    cJSON_Delete(dc);
    Upsquad__Workflow__V1__CreateWorkflowRequest cr =
        UPSQUAD__WORKFLOW__V1__CREATE_WORKFLOW_REQUEST__INIT;
    cr.name = "bench";
    cr.definition = def;
    Upsquad__Workflow__V1__CreateWorkflowResponse *cw = NULL;
    rpc_status st = {0};
    if (rpc_unary_call(ch, SVC "CreateWorkflow", &cr.base,
                       &upsquad__workflow__v1__create_workflow_response__descriptor, o,
                       (ProtobufCMessage **)&cw, &st)) {
        fprintf(stderr, "CreateWorkflow: %d %s\n", st.code, st.message ? st.message : "");
        exit(1);
    }
    char *id = strdup(cw->workflow->id);
    protobuf_c_message_free_unpacked(&cw->base, NULL);
    return id;
}

/* Median trigger-to-completion latency (ms, client clock) of n one-step runs of wf, one at a
 * time, as o's org. */
static double victim_ms(const rpc_call_opts *o, const char *wf, int n) {
    double *l = calloc((size_t)n, sizeof *l);
    for (int i = 0; i < n; i++) {
        double t = now_s();
        char *id = trigger_as(o, wf);
        int f = 0;
        while (!finished_as(o, id, &f, NULL) && now_s() - t < 120)
            usleep(2000);
        l[i] = (now_s() - t) * 1000;
        free(id);
    }
    qsort(l, (size_t)n, sizeof *l, cmp_d);
    double m = l[n / 2];
    free(l);
    return m;
}

/* --fairness: one org (--token) floods the engine with `runs` loops of 25 laps of one tool
 * step; another org (--victim-token) runs one-step workflows one at a time, idle and then
 * during the flood. Prints the victim's median latencies and their ratio. */
static int fairness(const char *victim_token, int runs) {
    rpc_call_opts vo = opts;
    vo.bearer = victim_token;
    const char *loop = "{\"version\":1,\"start\":\"l\",\"steps\":{\"l\":{\"type\":\"loop\","
                       "\"max_iterations\":25,\"body\":\"t\"},\"t\":{\"type\":\"tool_action\","
                       "\"tool\":\"github\",\"action\":\"get_issue\",\"with\":{\"repo\":"
                       "\"acme/widgets\",\"number\":1}}}}";
    char *one = definition(1);
    char *wf_flood = create_as(&opts, loop), *wf_victim = create_as(&vo, one);
    double idle = victim_ms(&vo, wf_victim, 11);
    char **ids = calloc((size_t)runs, sizeof *ids);
    for (int i = 0; i < runs; i++)
        ids[i] = trigger(wf_flood);
    double loaded = victim_ms(&vo, wf_victim, 11);
    int pending = 0, f = 0;
    for (int i = 0; i < runs; i++) { /* the rest of the flood is cancelled, not left queued */
        if (!finished(ids[i], &f, NULL)) {
            pending++;
            Upsquad__Workflow__V1__CancelRunRequest cr =
                UPSQUAD__WORKFLOW__V1__CANCEL_RUN_REQUEST__INIT;
            cr.run_id = ids[i];
            Upsquad__Workflow__V1__CancelRunResponse *c = NULL;
            rpc_status st = {0};
            if (!rpc_unary_call(ch, SVC "CancelRun", &cr.base,
                                &upsquad__workflow__v1__cancel_run_response__descriptor, &opts,
                                (ProtobufCMessage **)&c, &st))
                protobuf_c_message_free_unpacked(&c->base, NULL);
        }
        free(ids[i]);
    }
    printf("{\"flood_runs\":%d,\"flood_laps\":%d,\"victim_idle_ms\":%.1f,"
           "\"victim_flood_ms\":%.1f,\"ratio\":%.2f,\"flood_unfinished_after\":%d}\n",
           runs, runs * 25, idle, loaded, idle > 0 ? loaded / idle : 0, pending);
    free(ids);
    free(one);
    free(wf_flood);
    free(wf_victim);
    return 0;
}

/* The run's status through ListRuns (one row, not the run's actions: polling a long run with
 * GetWorkflowStatus would cost the engine more than the run's own steps). 1 when it ended. */
static int ended(const char *wf, const char *run, int *failed) {
    rpc_status st = {0};
    Upsquad__Workflow__V1__ListRunsRequest lr = UPSQUAD__WORKFLOW__V1__LIST_RUNS_REQUEST__INIT;
    lr.workflow_id = (char *)wf;
    lr.page_size = 1;
    Upsquad__Workflow__V1__ListRunsResponse *r = NULL;
    if (rpc_unary_call(ch, SVC "ListRuns", &lr.base,
                       &upsquad__workflow__v1__list_runs_response__descriptor, &opts,
                       (ProtobufCMessage **)&r, &st))
        return 0;
    int end = 0;
    if (r->n_runs == 1 && !strcmp(r->runs[0]->id, run)) {
        const char *s = r->runs[0]->status;
        end = !strcmp(s, "completed") || !strcmp(s, "failed") || !strcmp(s, "cancelled");
        *failed = strcmp(s, "completed") != 0;
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return end;
}

/* --sequential: runs one at a time; wall ms per transition (two per tool step: in_progress,
 * completed; the loops' own transitions are left out). */
static int sequential(int runs, int steps, int laps) {
    char *dj = laps ? loop_definition(laps) : definition(steps);
    if (!dj) {
        fprintf(stderr, "--laps %d: not a product of loops of at most 25 laps\n", laps);
        return 2;
    }
    char *wf = create_as(&opts, dj);
    free(dj);
    long per_run = (long)(laps ? laps : steps) * 2;
    int failed = 0, left = runs;
    double t0 = now_s();
    for (int i = 0; i < runs; i++) {
        char *id = trigger(wf);
        int f = 0;
        double t = now_s();
        while (!ended(wf, id, &f) && now_s() - t < 600)
            usleep(20000);
        if (now_s() - t < 600) left--;
        failed += f;
        free(id);
    }
    double secs = now_s() - t0;
    long transitions = per_run * runs;
    printf("{\"runs\":%d,\"steps\":%d,\"laps\":%d,\"seconds\":%.3f,\"transitions\":%ld,"
           "\"ms_per_transition\":%.3f,\"failed\":%d,\"unfinished\":%d}\n",
           runs, laps ? 0 : steps, laps, secs, transitions,
           transitions ? secs * 1000 / (double)transitions : 0, failed, left);
    free(wf);
    return left || failed ? 1 : 0;
}

/* --rate: `runs` runs of `steps` steps triggered one every 1/rate s (open loop: a late trigger
 * does not delay the next one's schedule beyond it); every run's first-step delay. The load
 * starts one second (at least 10 runs) earlier, those runs not counted: the first runs after an
 * engine's start pay for its cold Postgres backends (25-50 ms for the first, measured), which
 * would otherwise be the p99 of a few hundred samples; their worst is printed apart. */
static int at_rate(double rate, int runs, int steps) {
    char *dj = definition(steps);
    char *wf = create_as(&opts, dj);
    free(dj);
    int warm = rate < 10 ? 10 : (int)rate, all = warm + runs;
    char **ids = calloc((size_t)all, sizeof *ids);
    double *lat = calloc((size_t)all, sizeof *lat);
    double t0 = now_s(), sent = 0, cold = 0;
    for (int i = 0; i < all; i++) {
        double due = t0 + i / rate, now = now_s();
        if (due > now) usleep((useconds_t)((due - now) * 1e6));
        if (i == warm) sent = now_s();
        ids[i] = trigger(wf);
    }
    sent = now_s() - sent;
    int failed = 0, left = all;
    for (int i = 0; i < all && now_s() - t0 < 300;) {
        int f = 0;
        if (finished(ids[i], &f, &lat[i])) {
            failed += f;
            left--;
            i++;
        } else {
            usleep(10000);
        }
    }
    for (int i = 0; i < warm; i++)
        cold = lat[i] > cold ? lat[i] : cold;
    double *m = lat + warm;
    qsort(m, (size_t)runs, sizeof *m, cmp_d);
    printf("{\"runs\":%d,\"rate\":%.1f,\"achieved_rate\":%.1f,\"first_step_p50_ms\":%.1f,"
           "\"first_step_p99_ms\":%.1f,\"first_step_max_ms\":%.1f,\"warmup_runs\":%d,"
           "\"warmup_first_step_max_ms\":%.1f,\"failed\":%d,\"unfinished\":%d}\n",
           runs, rate, sent > 0 ? (runs - 1) / sent : 0, m[runs / 2], m[(runs * 99) / 100],
           m[runs - 1], warm, cold, failed, left);
    for (int i = 0; i < all; i++)
        free(ids[i]);
    free(ids);
    free(lat);
    free(wf);
    return left || failed ? 1 : 0;
}

int main(int argc, char **argv) {
    const char *target = NULL, *token = NULL, *victim = NULL;
    int runs = 100, steps = 10, laps = 0, seq = 0;
    double rate = 0;
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--sequential")) seq = 1;
    for (int i = 1; i + 1 < argc; i += 1 + (strcmp(argv[i], "--sequential") != 0)) {
        if (!strcmp(argv[i], "--target"))
            target = argv[i + 1];
        else if (!strcmp(argv[i], "--token"))
            token = argv[i + 1];
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps"))
            steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--laps"))
            laps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--fairness"))
            victim = argv[i + 1];
        else if (!strcmp(argv[i], "--rate"))
            rate = atof(argv[i + 1]);
    }
    if (!target || !token || runs <= 0 || steps <= 0 || laps < 0 || rate < 0) {
        fprintf(stderr,
                "usage: %s --target HOST:PORT --token JWT [--runs N] [--steps N | --laps N] "
                "[--sequential] [--fairness VICTIM_JWT] [--rate RUNS_PER_S]\n",
                argv[0]);
        return 2;
    }
    char err[256];
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, &ch, err, sizeof err)) {
        fprintf(stderr, "%s\n", err);
        return 1;
    }
    opts.timeout_ms = 10000;
    opts.bearer = token;
    if (victim) return fairness(victim, runs);
    if (seq) return sequential(runs, steps, laps);
    if (rate > 0) return at_rate(rate, runs, steps);
    char *dj = definition(steps);
    char *wf = create_as(&opts, dj);
    free(dj);
    /* latency on an idle engine: one run at a time, trigger to its first step */
    int lat_runs = 30, failed = 0;
    double *lat = calloc((size_t)lat_runs, sizeof *lat);
    for (int i = 0; i < lat_runs; i++) {
        char *id = trigger(wf);
        int f = 0;
        double t = now_s();
        while (!finished(id, &f, &lat[i]) && now_s() - t < 30)
            usleep(5000);
        free(id);
    }
    /* throughput: every run triggered at once, first trigger to last completion */
    char **ids = calloc((size_t)runs, sizeof *ids);
    double t0 = now_s();
    for (int i = 0; i < runs; i++)
        ids[i] = trigger(wf);
    int left = runs;
    double t_end = t0;
    for (int i = 0; i < runs && now_s() - t0 < 300;) {
        int f = 0;
        if (finished(ids[i], &f, NULL)) {
            failed += f;
            left--;
            t_end = now_s();
            i++;
        } else {
            usleep(10000); /* runs finish roughly in order: poll the oldest unfinished one */
        }
    }
    qsort(lat, (size_t)lat_runs, sizeof *lat, cmp_d);
    double secs = t_end - t0;
    long transitions = (long)runs * steps * 2;
    printf("{\"runs\":%d,\"steps\":%d,\"seconds\":%.3f,\"transitions\":%ld,"
           "\"transitions_per_s\":%.1f,\"first_step_p50_ms\":%.1f,\"first_step_p99_ms\":%.1f,"
           "\"failed\":%d,\"unfinished\":%d}\n",
           runs, steps, secs, transitions, secs > 0 ? transitions / secs : 0, lat[lat_runs / 2],
           lat[lat_runs - 1], failed, left);
    return left ? 1 : 0;
}
