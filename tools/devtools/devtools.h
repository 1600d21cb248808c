/* devtools: a tool provider for local runs and tests (docs/devtools.md).
 *
 * It serves every action of the workflow tool catalogue (the file the validator and
 * GetToolCatalog read) on `tool.invoke.<tool>`, answering from one fixture per action, fails
 * on cue, de-duplicates by idempotency key and counts executions per key. */
#ifndef DEVTOOLS_H
#define DEVTOOLS_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "bus.h"
#include "upsquad/internal/v1/tool.pb-c.h"

/* ---- catalogue and fixtures (catalog.c) ---- */

typedef struct dt_action {
    const char *tool, *action; /* borrowed from the catalogue document */
    const char **args;         /* argument names, catalogue order */
    unsigned char *required;   /* required[i] for args[i] */
    size_t n_args;
    const cJSON *result;  /* the fixture's "result" template (borrowed from its document) */
    const cJSON *pending; /* its optional "pending" object, for laps still pending (or NULL) */
} dt_action;

typedef struct dt_tool {
    const char *tool;
    dt_action *actions;
    size_t n_actions;
} dt_tool;

typedef struct dt_catalog {
    cJSON *doc;       /* the catalogue */
    cJSON **fixtures; /* one document per action, parallel to the flattened actions */
    size_t n_fixtures;
    dt_tool *tools;
    size_t n_tools;
} dt_catalog;

/* Loads the catalogue and the fixture of each of its actions (<dir>/<tool>.<action>.json).
 * A catalogued action without a fixture is an error (a new catalogue action must come with
 * its fixture). dt_catalog_free releases *out, also after a failure. */
int dt_catalog_load(const char *catalog_path, const char *fixtures_dir, dt_catalog *out, char *err,
                    size_t errlen);
void dt_catalog_free(dt_catalog *c);
const dt_tool *dt_catalog_tool(const dt_catalog *c, const char *tool);
const dt_action *dt_catalog_action(const dt_tool *t, const char *action);

/* ---- cues and templates (cues.c) ---- */

/* Failure and delay cues of one invocation (docs/devtools.md, "Cues"). */
typedef struct dt_cues {
    int fail;                 /* permanent failure, recorded for the key */
    char fail_code[64];       /* error_code of that failure ("provider_error") */
    int fail_times;           /* the first N tries of the key fail, retryable, not recorded */
    long long sleep_ms;       /* delay before executing */
    int sleep_times;          /* only the first N tries sleep (0 = every try) */
    long long reply_delay_ms; /* delay after executing and recording, before replying */
    cJSON *result;            /* owned: merged over the fixture's result */
    int pending; /* the first N executions of the step (run, step, iteration) are "pending" */
} dt_cues;

#define DT_CUE_MAX_MS (10 * 60 * 1000) /* bound of every delay cue */

/* Reads the cues of an arguments object: top-level members named `__<cue>` (removed from
 * args, which the caller owns), and `__<cue>[=value]` tokens inside any string value. A
 * top-level `__` member that is not a cue, or a malformed value, is an error (err names it). */
int dt_cues_parse(cJSON *args, dt_cues *out, char *err, size_t errlen);
void dt_cues_free(dt_cues *c);

/* What templates may refer to besides the arguments (`${@name}`). */
typedef struct dt_ctx {
    const char *key, *org_id, *run_id, *step_name, *tool, *action;
    int iteration;
    int lap; /* 1-based count of executions of this step (run, step, iteration, action) */
} dt_ctx;

/* A copy of tmpl with `${arg}`, `${arg|default}` and `${@ctx}` resolved (a string that is
 * exactly one template takes the argument's JSON value and type). Caller frees (cJSON_Delete);
 * NULL on OOM. */
cJSON *dt_render(const cJSON *tmpl, const cJSON *args, const dt_ctx *ctx);

/* ---- the provider (provider.c) ---- */

typedef struct dt_opts {
    const char *provider;      /* ToolAnnounce.provider */
    const char *stats_subject; /* request/reply JSON stats */
    long long dedup_keys;      /* bound of the idempotency record */
    long long dedup_bytes;     /* bound of the recorded responses' bytes */
    long long announce_ms;     /* period of ToolAnnounce */
    long long workers;         /* threads running delayed invocations */
    long long queue;           /* delayed invocations waiting for a worker */
} dt_opts;

typedef struct dt_provider dt_provider;

/* Subscribes every tool's subject and the stats subject, announces, starts the workers.
 * c and b are borrowed and must outlive the provider. *out: dt_provider_stop. */
int dt_provider_start(bus *b, const dt_catalog *c, const dt_opts *o, dt_provider **out, char *err,
                      size_t errlen);
void dt_provider_stop(dt_provider *p);

#endif
