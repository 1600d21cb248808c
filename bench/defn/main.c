/*
 * defn: time per validation of a large workflow definition against the time cJSON alone takes
 * to parse it (the floor any validator pays).
 *
 *   defn [--steps N] [--iterations N] [--schema PATH] [--catalog PATH] [--dump]
 *
 * The generated definition mixes every step kind the way real workflows do: a chain of agent
 * and tool steps whose templates read the trigger and earlier outputs, with gates, prompts,
 * questions, waits, and every tenth position a container (loop, condition or parallel) with
 * two inner steps. --dump prints it instead of timing.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../services/workflow-engine/defn.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void name_of(char *buf, size_t len, int i) {
    snprintf(buf, len, "step_%03d", i);
}

static cJSON *agent(const char *prev) {
    char prompt[256];
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "agent_action");
    cJSON_AddStringToObject(s, "agent_role", "eng");
    if (prev)
        snprintf(prompt, sizeof(prompt),
                 "Continue issue ${/trigger/issue_number} from: ${/steps/%s/output/summary}", prev);
    else
        snprintf(prompt, sizeof(prompt), "Triage issue ${/trigger/issue_number}.");
    cJSON_AddStringToObject(s, "prompt", prompt);
    cJSON *exp = cJSON_AddObjectToObject(s, "expects");
    cJSON *f = cJSON_AddObjectToObject(exp, "summary");
    cJSON_AddStringToObject(f, "type", "string");
    cJSON_AddBoolToObject(f, "required", 1);
    cJSON *acc = cJSON_AddObjectToObject(s, "acceptance");
    cJSON_AddNumberToObject(acc, "max_redos", 2);
    return s;
}

static cJSON *tool(const char *prev) {
    char body[256];
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "tool_action");
    cJSON_AddStringToObject(s, "tool", "github");
    cJSON_AddStringToObject(s, "action", "create_comment");
    cJSON *w = cJSON_AddObjectToObject(s, "with");
    cJSON_AddStringToObject(w, "repo", "acme/widgets");
    cJSON_AddStringToObject(w, "number", "${/trigger/issue_number}");
    snprintf(body, sizeof(body), "Progress: ${/steps/%s/status}", prev ? prev : "step_000");
    cJSON_AddStringToObject(w, "body", prev ? body : "Started.");
    return s;
}

static cJSON *gate(void) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "approval_gate");
    cJSON_AddNumberToObject(s, "required_clearance", 3);
    cJSON_AddStringToObject(s, "summary", "Approve the change for ${/trigger/issue_number}?");
    return s;
}

static cJSON *prompt(void) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "user_input");
    cJSON_AddStringToObject(s, "question", "Which environment?");
    cJSON *opts = cJSON_AddArrayToObject(s, "options");
    const char *vals[] = {"staging", "production"};
    for (int i = 0; i < 2; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "value", vals[i]);
        cJSON_AddStringToObject(o, "label", vals[i]);
        cJSON_AddItemToArray(opts, o);
    }
    cJSON_AddStringToObject(s, "default_choice", "staging");
    cJSON_AddNumberToObject(s, "timeout_minutes", 60);
    cJSON_AddStringToObject(s, "on_timeout", "default");
    return s;
}

static cJSON *question(void) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "question");
    cJSON_AddStringToObject(s, "prompt", "Release risk?");
    cJSON_AddNumberToObject(s, "required_clearance", 2);
    cJSON *opts = cJSON_AddArrayToObject(s, "options");
    const char *keys[] = {"low", "high"};
    for (int i = 0; i < 2; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "key", keys[i]);
        cJSON_AddStringToObject(o, "label", keys[i]);
        cJSON_AddItemToArray(opts, o);
    }
    cJSON *ans = cJSON_AddObjectToObject(s, "answer");
    cJSON *f = cJSON_AddObjectToObject(ans, "risk_score");
    cJSON_AddStringToObject(f, "type", "integer");
    return s;
}

static cJSON *wait_signal(void) {
    cJSON *s = cJSON_CreateObject();
    cJSON_AddStringToObject(s, "type", "wait");
    cJSON_AddStringToObject(s, "mode", "signal");
    cJSON_AddStringToObject(s, "event_key", "ci.finished");
    cJSON_AddNumberToObject(s, "timeout_minutes", 120);
    cJSON_AddStringToObject(s, "on_timeout", "fail");
    return s;
}

static void set_next(cJSON *s, const char *next) {
    const char *field = strcmp(cJSON_GetObjectItem(s, "type")->valuestring, "approval_gate") == 0
                            ? "on_approve"
                            : "next";
    cJSON_AddStringToObject(s, field, next);
}

/* A container at position i with two inner steps (i+1, i+2) in its scope. */
static void container(cJSON *steps, int i, const char *prev) {
    char self[32], a[32], b[32], path[64];
    name_of(self, sizeof(self), i);
    name_of(a, sizeof(a), i + 1);
    name_of(b, sizeof(b), i + 2);
    cJSON *c = cJSON_CreateObject();
    int which = (i / 10) % 3;
    if (which == 0) {
        cJSON_AddStringToObject(c, "type", "loop");
        cJSON_AddStringToObject(c, "body", a);
        cJSON_AddNumberToObject(c, "max_iterations", 3);
        cJSON *u = cJSON_AddObjectToObject(c, "until");
        snprintf(path, sizeof(path), "/steps/%s/status", b);
        cJSON_AddStringToObject(u, "op", "eq");
        cJSON_AddStringToObject(u, "path", path);
        cJSON_AddStringToObject(u, "value", "completed");
        cJSON *sa = agent(prev);
        set_next(sa, b);
        cJSON_AddItemToObject(steps, a, sa);
        cJSON_AddItemToObject(steps, b, tool(a));
    } else if (which == 1) {
        cJSON_AddStringToObject(c, "type", "condition");
        cJSON *u = cJSON_AddObjectToObject(c, "if");
        snprintf(path, sizeof(path), "/steps/%s/output/summary", prev);
        cJSON_AddStringToObject(u, "op", "exists");
        cJSON_AddStringToObject(u, "path", path);
        cJSON_AddStringToObject(c, "then", a);
        cJSON_AddStringToObject(c, "else", b);
        cJSON_AddItemToObject(steps, a, agent(prev));
        cJSON_AddItemToObject(steps, b, tool(prev));
    } else {
        cJSON_AddStringToObject(c, "type", "parallel");
        cJSON *br = cJSON_AddArrayToObject(c, "branches");
        cJSON_AddItemToArray(br, cJSON_CreateString(a));
        cJSON_AddItemToArray(br, cJSON_CreateString(b));
        cJSON_AddItemToObject(steps, a, agent(prev));
        cJSON_AddItemToObject(steps, b, agent(prev));
    }
    cJSON_AddItemToObject(steps, self, c);
}

static char *make_definition(int n) {
    cJSON *d = cJSON_CreateObject();
    cJSON_AddNumberToObject(d, "version", 1);
    cJSON_AddStringToObject(d, "start", "step_000");
    cJSON *fields = cJSON_AddObjectToObject(cJSON_AddObjectToObject(d, "trigger"), "fields");
    cJSON *f = cJSON_AddObjectToObject(fields, "issue_number");
    cJSON_AddStringToObject(f, "type", "integer");
    cJSON_AddBoolToObject(f, "required", 1);
    cJSON *steps = cJSON_AddObjectToObject(d, "steps");
    char prev[32] = "", self[32], next[32];
    int i = 0;
    while (i < n) {
        name_of(self, sizeof(self), i);
        bool is_container = i % 10 == 9 && i + 2 < n;
        int after = is_container ? i + 3 : i + 1;
        name_of(next, sizeof(next), after);
        if (is_container) {
            container(steps, i, prev[0] ? prev : NULL);
        } else {
            cJSON *s;
            switch (i % 9) {
            case 2:
                s = gate();
                break;
            case 4:
                s = prompt();
                break;
            case 6:
                s = question();
                break;
            case 7:
                s = wait_signal();
                break;
            case 1:
            case 5:
                s = tool(prev[0] ? prev : NULL);
                break;
            default:
                s = agent(prev[0] ? prev : NULL);
                break;
            }
            cJSON_AddItemToObject(steps, self, s);
        }
        if (after < n) set_next(cJSON_GetObjectItem(steps, self), next);
        snprintf(prev, sizeof(prev), "%s", self);
        i = after;
    }
    char *txt = cJSON_PrintUnformatted(d);
    cJSON_Delete(d);
    return txt;
}

int main(int argc, char **argv) {
    const char *schema = "services/workflow-engine/schema/workflow-definition.schema.json";
    const char *catalog = "services/workflow-engine/catalog/tools.json";
    int steps = 200, iters = 2000, dump = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steps") == 0 && i + 1 < argc)
            steps = atoi(argv[++i]);
        else if (strcmp(argv[i], "--iterations") == 0 && i + 1 < argc)
            iters = atoi(argv[++i]);
        else if (strcmp(argv[i], "--schema") == 0 && i + 1 < argc)
            schema = argv[++i];
        else if (strcmp(argv[i], "--catalog") == 0 && i + 1 < argc)
            catalog = argv[++i];
        else if (strcmp(argv[i], "--dump") == 0)
            dump = 1;
        else {
            fprintf(
                stderr,
                "usage: defn [--steps N] [--iterations N] [--schema P] [--catalog P] [--dump]\n");
            return 2;
        }
    }
    if (steps < 1 || iters < 1) return 2;
    char *def = make_definition(steps);
    if (!def) return 1;
    size_t len = strlen(def);
    if (dump) {
        puts(def);
        cJSON_free(def);
        return 0;
    }
    char err[512];
    defn_ctx *ctx = NULL;
    if (defn_ctx_load(schema, catalog, NULL, &ctx, err, sizeof(err)) != 0) {
        fprintf(stderr, "defn: %s\n", err);
        cJSON_free(def);
        return 1;
    }
    int status = 0;
    defn_violations v;
    defn_violations_init(&v);
    if (defn_validate(ctx, def, len, &v) != DEFN_OK) {
        fprintf(stderr, "defn: generated definition is invalid: %s: %s\n",
                v.n ? v.items[0].instance_location : "", v.n ? v.items[0].message : "");
        status = 1;
    }
    defn_violations_free(&v);
    /* Parse and validate alternate in rounds and the best round of each counts, so that a
     * machine shared with other work skews both sides alike. */
    int rounds = 20, per = iters / rounds > 0 ? iters / rounds : 1;
    double parse = 1e9, val = 1e9;
    for (int r = 0; r < rounds && status == 0; r++) {
        double t0 = now_s();
        for (int i = 0; i < per && status == 0; i++) {
            cJSON *d = cJSON_ParseWithLength(def, len);
            if (!d) status = 1;
            cJSON_Delete(d);
        }
        double t = (now_s() - t0) / per;
        if (t < parse) parse = t;
        t0 = now_s();
        for (int i = 0; i < per && status == 0; i++) {
            defn_violations_init(&v);
            if (defn_validate(ctx, def, len, &v) != DEFN_OK) status = 1;
            defn_violations_free(&v);
        }
        t = (now_s() - t0) / per;
        if (t < val) val = t;
    }
    if (status == 0) {
        printf("defn: %d steps, %zu bytes, best of %d rounds of %d\n", steps, len, rounds, per);
        printf("defn: cJSON parse only    %9.1f us\n", parse * 1e6);
        printf("defn: validate (total)    %9.1f us  (%.1f MB/s)\n", val * 1e6,
               (double)len / val / 1e6);
        printf("defn: ratio validate/parse %8.2f\n", val / parse);
    }
    defn_ctx_free(ctx);
    cJSON_free(def);
    return status;
}
