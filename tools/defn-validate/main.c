/*
 * defn-validate: checks workflow definition files with the workflow engine's validator (the
 * same schema, catalogue and rules CreateWorkflow applies).
 *
 *   defn-validate [--schema PATH] [--catalog PATH] [--json] FILE...
 *
 * FILE "-" reads standard input. Without --json it prints "FILE: valid" or one
 * "FILE: <pointer>: <message>" line per violation; with --json one JSON object per file:
 * {"file", "valid", "violations": [{"instance_location", "message"}]}.
 * Exit status: 0 all valid, 1 some invalid, 2 usage or load error.
 * A tool gated by a switch (catalogue `enabled_by`) is accepted whether its switch is on or
 * off, as CreateWorkflow accepts it: the gate decides only what GetToolCatalog serves and
 * whether the step runs.
 */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../services/workflow-engine/defn.h"

/* Larger inputs are still handed to the validator (which refuses them by size); this only
 * bounds what the tool holds in memory. */
#define MAX_INPUT (64u * 1024u * 1024u)

static int read_input(const char *path, char **out, size_t *len) {
    FILE *f = strcmp(path, "-") == 0 ? stdin : fopen(path, "rb");
    if (!f) return -1;
    size_t cap = 65536, n = 0;
    char *buf = malloc(cap);
    int rc = -1;
    while (buf) {
        if (n == cap) {
            if (cap >= MAX_INPUT) break;
            char *b = realloc(buf, cap * 2);
            if (!b) break;
            buf = b;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n, f);
        n += r;
        if (r == 0) {
            rc = ferror(f) ? -1 : 0;
            break;
        }
    }
    if (f != stdin) fclose(f);
    if (rc != 0) {
        free(buf);
        return -1;
    }
    *out = buf;
    *len = n;
    return 0;
}

static void print_json(const char *file, int rc, const defn_violations *v) {
    cJSON *o = cJSON_CreateObject();
    cJSON *arr = cJSON_CreateArray();
    cJSON_AddStringToObject(o, "file", file);
    cJSON_AddBoolToObject(o, "valid", rc == DEFN_OK);
    for (size_t i = 0; i < v->n; i++) {
        cJSON *e = cJSON_CreateObject();
        cJSON_AddStringToObject(e, "instance_location", v->items[i].instance_location);
        cJSON_AddStringToObject(e, "message", v->items[i].message);
        cJSON_AddItemToArray(arr, e);
    }
    cJSON_AddItemToObject(o, "violations", arr);
    char *txt = cJSON_PrintUnformatted(o);
    if (txt) puts(txt);
    cJSON_free(txt);
    cJSON_Delete(o);
}

static int usage(void) {
    fprintf(stderr, "usage: defn-validate [--schema PATH] [--catalog PATH] [--json] FILE...\n");
    return 2;
}

int main(int argc, char **argv) {
    const char *schema = "services/workflow-engine/schema/workflow-definition.schema.json";
    const char *catalog = "services/workflow-engine/catalog/tools.json";
    bool json = false;
    int i = 1;
    for (; i < argc && strncmp(argv[i], "--", 2) == 0; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (i + 1 < argc && strcmp(argv[i], "--schema") == 0) {
            schema = argv[++i];
        } else if (i + 1 < argc && strcmp(argv[i], "--catalog") == 0) {
            catalog = argv[++i];
        } else {
            return usage();
        }
    }
    if (i >= argc) return usage();
    char err[512];
    defn_ctx *ctx = NULL;
    if (defn_ctx_load(schema, catalog, NULL, &ctx, err, sizeof(err)) != 0) {
        fprintf(stderr, "defn-validate: %s\n", err);
        return 2;
    }
    int status = 0;
    for (; i < argc; i++) {
        char *text = NULL;
        size_t len = 0;
        if (read_input(argv[i], &text, &len) != 0) {
            fprintf(stderr, "defn-validate: cannot read %s\n", argv[i]);
            status = 2;
            continue;
        }
        defn_violations v;
        defn_violations_init(&v);
        int rc = defn_validate(ctx, text, len, &v);
        free(text);
        if (rc < 0) {
            fprintf(stderr, "defn-validate: %s: validator error %d\n", argv[i], rc);
            status = 2;
        } else if (json) {
            print_json(argv[i], rc, &v);
        } else if (rc == DEFN_OK) {
            printf("%s: valid\n", argv[i]);
        } else {
            for (size_t k = 0; k < v.n; k++)
                printf("%s: %s: %s\n", argv[i],
                       v.items[k].instance_location[0] ? v.items[k].instance_location : "(root)",
                       v.items[k].message);
        }
        if (rc == DEFN_INVALID && status == 0) status = 1;
        defn_violations_free(&v);
    }
    defn_ctx_free(ctx);
    return status;
}
