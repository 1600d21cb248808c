/*
 * libFuzzer harness over the workflow definition validator: any byte string is a candidate
 * definition. Beyond the sanitizers' checks it asserts the validator's contract: a verdict
 * (valid, or invalid with at least one violation), pointers that are "" or start with '/',
 * non-empty messages, at most DEFN_MAX_VIOLATIONS of them, and a wire form that encodes.
 * Built and run by tests/workflow/test_fuzz.sh.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn.h"

static defn_ctx *ctx;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char err[512];
    const char *schema = getenv("DEFN_SCHEMA");
    const char *catalog = getenv("DEFN_CATALOG");
    /* no gate options: a gated tool's arguments are checked whether its gate is on or off */
    if (defn_ctx_load(schema ? schema
                             : "services/workflow-engine/schema/workflow-definition.schema.json",
                      catalog ? catalog : "services/workflow-engine/catalog/tools.json", NULL, &ctx,
                      err, sizeof(err)) != 0) {
        fprintf(stderr, "defn_fuzz: %s\n", err);
        abort();
    }
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    defn_violations v;
    defn_violations_init(&v);
    int rc = defn_validate(ctx, (const char *)data, size, &v);
    if (rc != DEFN_OK && rc != DEFN_INVALID) abort();
    if ((rc == DEFN_OK) != (v.n == 0)) abort();
    if (v.n > DEFN_MAX_VIOLATIONS) abort();
    for (size_t i = 0; i < v.n; i++) {
        const char *loc = v.items[i].instance_location;
        if (loc[0] != '\0' && loc[0] != '/') abort();
        if (v.items[i].message[0] == '\0') abort();
    }
    char summary[256];
    defn_violations_summary(&v, summary, sizeof(summary));
    defn_violations_free(&v);
    return 0;
}
