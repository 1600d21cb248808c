/* workflow-engine-load: drives runs of N tool_action steps through a workflow-engine and reports
 * step transitions per second and trigger-to-first-step latency (bench/workflow-engine-load/
 * bench.sh).
 *
 *   workflow-engine-load --target HOST:PORT --token JWT [--runs N] [--steps N]
 *
 * Creates one workflow of `steps` chained github.get_issue steps, triggers `runs` runs as fast
 * as it can, polls each until it ends, and prints one JSON line: runs, steps, seconds (first
 * trigger to last completion), transitions (two per step: in_progress, completed),
 * transitions_per_s, first_step_p50_ms / first_step_p99_ms (30 runs one at a time on the idle
 * engine before; server clock: the run's created_at to its first action's created_at; with 30
 * samples p99 is the maximum), failed runs. */
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

static char *trigger(const char *wf) {
    rpc_status st = {0};
    Upsquad__Workflow__V1__TriggerWorkflowRequest tr =
        UPSQUAD__WORKFLOW__V1__TRIGGER_WORKFLOW_REQUEST__INIT;
    tr.workflow_id = (char *)wf;
    Upsquad__Workflow__V1__TriggerWorkflowResponse *r = NULL;
    if (rpc_unary_call(ch, SVC "TriggerWorkflow", &tr.base,
                       &upsquad__workflow__v1__trigger_workflow_response__descriptor, &opts,
                       (ProtobufCMessage **)&r, &st)) {
        fprintf(stderr, "TriggerWorkflow: %d\n", st.code);
        exit(1);
    }
    char *id = strdup(r->run->id);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    return id;
}

/* 1 when the run ended (*failed set), 0 when not yet; *first_ms the first step's delay. */
static int finished(const char *run, int *failed, double *first_ms) {
    rpc_status st = {0};
    Upsquad__Workflow__V1__GetWorkflowStatusRequest gr =
        UPSQUAD__WORKFLOW__V1__GET_WORKFLOW_STATUS_REQUEST__INIT;
    gr.run_id = (char *)run;
    Upsquad__Workflow__V1__GetWorkflowStatusResponse *g = NULL;
    if (rpc_unary_call(ch, SVC "GetWorkflowStatus", &gr.base,
                       &upsquad__workflow__v1__get_workflow_status_response__descriptor, &opts,
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

int main(int argc, char **argv) {
    const char *target = NULL, *token = NULL;
    int runs = 100, steps = 10;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--target"))
            target = argv[i + 1];
        else if (!strcmp(argv[i], "--token"))
            token = argv[i + 1];
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps"))
            steps = atoi(argv[i + 1]);
    }
    if (!target || !token || runs <= 0 || steps <= 0) {
        fprintf(stderr, "usage: %s --target HOST:PORT --token JWT [--runs N] [--steps N]\n",
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
    char *dj = definition(steps);
    cJSON *dc = cJSON_Parse(dj);
    Google__Protobuf__Struct *def = NULL;
    pbjson_struct_from_json(dc, &def, err, sizeof err);
    Upsquad__Workflow__V1__CreateWorkflowRequest cr =
        UPSQUAD__WORKFLOW__V1__CREATE_WORKFLOW_REQUEST__INIT;
    cr.name = "bench";
    cr.definition = def;
    Upsquad__Workflow__V1__CreateWorkflowResponse *cw = NULL;
    rpc_status st = {0};
    if (rpc_unary_call(ch, SVC "CreateWorkflow", &cr.base,
                       &upsquad__workflow__v1__create_workflow_response__descriptor, &opts,
                       (ProtobufCMessage **)&cw, &st)) {
        fprintf(stderr, "CreateWorkflow: %d %s\n", st.code, st.message ? st.message : "");
        return 1;
    }
    /* latency on an idle engine: one run at a time, trigger to its first step */
    int lat_runs = 30, failed = 0;
    double *lat = calloc((size_t)lat_runs, sizeof *lat);
    for (int i = 0; i < lat_runs; i++) {
        char *id = trigger(cw->workflow->id);
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
        ids[i] = trigger(cw->workflow->id);
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
