/* The tool catalogue (services/workflow-engine/catalog/tools.json, the same file the
 * validator and GetToolCatalog read) and one fixture per catalogued action. Only the names
 * and required-ness of arguments matter here: the validator has checked the definitions. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "devtools.h"
#include "util.h"

#define DT_FILE_MAX (1 << 20) /* catalogue and fixtures are small; larger is a mistake */

static int read_json(const char *path, cJSON **out, char *err, size_t errlen) {
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return util_errf(err, errlen, -1, "%s: cannot open", path);
    char *buf = malloc(DT_FILE_MAX + 1);
    size_t n = buf ? fread(buf, 1, DT_FILE_MAX + 1, f) : 0;
    fclose(f);
    int rc = 0;
    if (!buf) {
        rc = util_errf(err, errlen, -1, "out of memory");
    } else if (n > DT_FILE_MAX) {
        rc = util_errf(err, errlen, -1, "%s: larger than %d bytes", path, DT_FILE_MAX);
    } else {
        *out = cJSON_ParseWithLength(buf, n);
        if (!*out) rc = util_errf(err, errlen, -1, "%s: not valid JSON", path);
    }
    free(buf);
    return rc;
}

static const char *str_of(const cJSON *o, const char *name) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(o, name);
    return cJSON_IsString(f) ? f->valuestring : NULL;
}

static int load_args(const cJSON *jact, dt_action *a, char *err, size_t errlen) {
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(jact, "args");
    if (!cJSON_IsArray(args))
        return util_errf(err, errlen, -1, "catalogue %s.%s: args must be an array", a->tool,
                         a->action);
    size_t n = (size_t)cJSON_GetArraySize(args);
    a->args = calloc(n ? n : 1, sizeof *a->args);
    a->required = calloc(n ? n : 1, 1);
    if (!a->args || !a->required) return util_errf(err, errlen, -1, "out of memory");
    for (const cJSON *e = args->child; e; e = e->next) {
        const char *name = str_of(e, "name");
        if (!name)
            return util_errf(err, errlen, -1, "catalogue %s.%s: an argument has no name", a->tool,
                             a->action);
        a->args[a->n_args] = name;
        a->required[a->n_args] = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(e, "required"));
        a->n_args++;
    }
    return 0;
}

/* <dir>/<tool>.<action>.json: {"result": {...}} */
static int load_fixture(const char *dir, dt_action *a, cJSON **doc, char *err, size_t errlen) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.%s.json", dir, a->tool, a->action);
    int rc = read_json(path, doc, err, errlen);
    if (rc != 0) return rc;
    const cJSON *result = cJSON_GetObjectItemCaseSensitive(*doc, "result");
    if (!cJSON_IsObject(result))
        return util_errf(err, errlen, -1, "%s: needs a \"result\" object", path);
    a->result = result;
    const cJSON *pending = cJSON_GetObjectItemCaseSensitive(*doc, "pending");
    if (pending && !cJSON_IsObject(pending))
        return util_errf(err, errlen, -1, "%s: \"pending\" must be an object", path);
    a->pending = pending;
    return 0;
}

static int load_tool(const cJSON *jt, dt_tool *t, dt_catalog *c, const char *dir, char *err,
                     size_t errlen) {
    t->tool = str_of(jt, "tool");
    const cJSON *actions = cJSON_GetObjectItemCaseSensitive(jt, "actions");
    if (!t->tool || !bus_token_valid(t->tool) || !cJSON_IsArray(actions))
        return util_errf(err, errlen, -1,
                         "catalogue: a tool needs a subject-safe name and actions");
    t->actions = calloc((size_t)cJSON_GetArraySize(actions) + 1, sizeof *t->actions);
    if (!t->actions) return util_errf(err, errlen, -1, "out of memory");
    for (const cJSON *e = actions->child; e; e = e->next) {
        dt_action *a = &t->actions[t->n_actions++];
        a->tool = t->tool;
        a->action = str_of(e, "action");
        if (!a->action)
            return util_errf(err, errlen, -1, "catalogue %s: action without name", t->tool);
        int rc = load_args(e, a, err, errlen);
        if (rc == 0) rc = load_fixture(dir, a, &c->fixtures[c->n_fixtures++], err, errlen);
        if (rc != 0) return rc;
    }
    return 0;
}

int dt_catalog_load(const char *catalog_path, const char *fixtures_dir, dt_catalog *out, char *err,
                    size_t errlen) {
    memset(out, 0, sizeof *out);
    int rc = read_json(catalog_path, &out->doc, err, errlen);
    if (rc != 0) return rc;
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(out->doc, "tools");
    if (!cJSON_IsArray(tools) || !tools->child)
        return util_errf(err, errlen, -1, "%s: \"tools\" must be a non-empty array", catalog_path);
    size_t n_actions = 0;
    for (const cJSON *t = tools->child; t; t = t->next)
        n_actions += (size_t)cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(t, "actions"));
    out->tools = calloc((size_t)cJSON_GetArraySize(tools), sizeof *out->tools);
    out->fixtures = calloc(n_actions + 1, sizeof *out->fixtures);
    if (!out->tools || !out->fixtures) return util_errf(err, errlen, -1, "out of memory");
    for (const cJSON *t = tools->child; t; t = t->next) {
        rc = load_tool(t, &out->tools[out->n_tools++], out, fixtures_dir, err, errlen);
        if (rc != 0) return rc;
    }
    return 0;
}

void dt_catalog_free(dt_catalog *c) {
    for (size_t i = 0; c->tools && i < c->n_tools; i++) {
        for (size_t k = 0; k < c->tools[i].n_actions; k++) {
            free(c->tools[i].actions[k].args);
            free(c->tools[i].actions[k].required);
        }
        free(c->tools[i].actions);
    }
    free(c->tools);
    for (size_t i = 0; i < c->n_fixtures; i++)
        cJSON_Delete(c->fixtures[i]);
    free(c->fixtures);
    cJSON_Delete(c->doc);
    memset(c, 0, sizeof *c);
}

const dt_tool *dt_catalog_tool(const dt_catalog *c, const char *tool) {
    for (size_t i = 0; tool && i < c->n_tools; i++)
        if (strcmp(c->tools[i].tool, tool) == 0) return &c->tools[i];
    return NULL;
}

const dt_action *dt_catalog_action(const dt_tool *t, const char *action) {
    for (size_t i = 0; t && action && i < t->n_actions; i++)
        if (strcmp(t->actions[i].action, action) == 0) return &t->actions[i];
    return NULL;
}
