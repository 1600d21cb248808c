/* Builders of small in-memory catalogues for the model-registry unit tests. */
#ifndef UPSQUAD_MR_FIXTURE_H
#define UPSQUAD_MR_FIXTURE_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../../services/model-registry/catalog.h"

typedef struct fx_model {
    const char *id, *provider;
    double reasoning, code, structured, long_context, tool_use;
    int tools; /* supports_tool_use */
    int status;
    double in, out; /* price effective from day 0 */
} fx_model;

static inline char *fx_dup(const char *s) {
    char *d = strdup(s);
    if (!d) abort();
    return d;
}

static inline void fx_fill(mr_model *m, const fx_model *f) {
    m->model_id = fx_dup(f->id);
    m->provider = fx_dup(f->provider);
    m->display_name = fx_dup(f->id);
    m->released_on = MR_DATE_NONE;
    m->max_context_tokens = 200000;
    m->supports_streaming = true;
    m->supports_tool_use = f->tools != 0;
    m->tool_use_quality = f->tools ? f->tool_use : 0.0;
    m->reasoning = f->reasoning;
    m->code_generation = f->code;
    m->structured_ops = f->structured;
    m->long_context = f->long_context;
    m->evidence = fx_dup("benchmarks");
    m->score_basis = fx_dup("fixture");
    m->status = f->status;
    m->deprecated_on = MR_DATE_NONE;
    m->shutdown_on = f->status == MR_STATUS_RETIRED ? 1 : MR_DATE_NONE;
    m->successor = NULL;
    if (mr_model_alloc_prices(m, 1)) abort();
    m->prices[0].effective_from = 0;
    m->prices[0].input_per_million = f->in;
    m->prices[0].output_per_million = f->out;
    m->prices[0].source_url = fx_dup("https://example.test/pricing");
    m->prices[0].verified_on = 0;
    m->prices[0].note = fx_dup("");
}

/* A validated catalogue of the given models (abort on failure: fixtures are code). */
static inline void fx_catalog(mr_catalog *c, const fx_model *models, size_t n) {
    char err[256];
    memset(c, 0, sizeof *c);
    c->catalog_version = fx_dup("fixture");
    if (mr_catalog_alloc(c, n)) abort();
    for (size_t i = 0; i < n; i++)
        fx_fill(&c->models[i], &models[i]);
    if (mr_catalog_validate(c, true, err, sizeof err)) {
        fprintf(stderr, "fixture invalid: %s\n", err);
        abort();
    }
}

/* Path of the repository's data file: $MR_CATALOG_FILE, else relative to the checkout root (the
 * usual working directory of tests), else relative to the test binary (build/tests/unit/). */
static inline const char *fx_catalog_path(void) {
    static char path[4096];
    const char *rel = "services/model-registry/catalog/models.json";
    const char *p = getenv("MR_CATALOG_FILE");
    if (p && *p) return p;
    if (access(rel, R_OK) == 0) return rel;
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
    if (n <= 0) return rel;
    path[n] = '\0';
    char *slash = strrchr(path, '/');
    if (!slash) return rel;
    snprintf(slash + 1, sizeof path - (size_t)(slash + 1 - path), "../../../%s", rel);
    return path;
}

#endif
