/*
 * The tool catalogue (catalog/tools.json): the governed tools a tool_action may call, their
 * actions and arguments, and the admitted poll-mode wait observations. The same data answers
 * GetToolCatalog, so the validator and the builder's picker cannot disagree.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "defn_internal.h"

static const char *const arg_types[] = {"string",  "number", "integer",
                                        "boolean", "object", "array"};

static int fail(char *err, size_t errlen, const char *where, const char *what) {
    snprintf(err, errlen, "tool catalogue %s: %s", where, what);
    return DEFN_ERR_LOAD;
}

static const char *str_field(const cJSON *obj, const char *name) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    return cJSON_IsString(f) ? f->valuestring : NULL;
}

static int bool_field(const cJSON *obj, const char *name, bool *out) {
    const cJSON *f = cJSON_GetObjectItemCaseSensitive(obj, name);
    if (!cJSON_IsBool(f)) return -1;
    *out = cJSON_IsTrue(f);
    return 0;
}

bool defn_env_gate(const char *name, void *arg) {
    (void)arg;
    const char *v = getenv(name);
    if (!v) return false;
    return strcasecmp(v, "1") == 0 || strcasecmp(v, "true") == 0 || strcasecmp(v, "yes") == 0 ||
           strcasecmp(v, "on") == 0;
}

static int load_arg(const cJSON *j, defn_tool_arg *a, const char *where, char *err, size_t errlen) {
    a->name = str_field(j, "name");
    a->type = str_field(j, "type");
    a->description = str_field(j, "description");
    if (!a->name || !a->type || !a->description)
        return fail(err, errlen, where, "an argument needs name, type and description");
    bool known = false;
    for (size_t i = 0; i < sizeof(arg_types) / sizeof(arg_types[0]); i++)
        known = known || strcmp(a->type, arg_types[i]) == 0;
    if (!known) return fail(err, errlen, a->name, "unknown argument type");
    if (bool_field(j, "required", &a->required) != 0 ||
        bool_field(j, "pinned_literal", &a->pinned_literal) != 0)
        return fail(err, errlen, a->name, "required and pinned_literal must be booleans");
    /* A pinned argument is compared as author-committed text; only strings qualify. */
    if (a->pinned_literal && strcmp(a->type, "string") != 0)
        return fail(err, errlen, a->name, "a pinned_literal argument must be a string");
    return 0;
}

static int load_action(const cJSON *j, defn_tool_action *act, char *err, size_t errlen) {
    act->action = str_field(j, "action");
    act->description = str_field(j, "description");
    const cJSON *args = cJSON_GetObjectItemCaseSensitive(j, "args");
    if (!act->action || !act->description || !cJSON_IsArray(args))
        return fail(err, errlen, "action", "needs action, description and args");
    size_t n = (size_t)cJSON_GetArraySize(args);
    defn_tool_arg *list = calloc(n ? n : 1, sizeof(*list));
    if (!list) return DEFN_ERR_NOMEM;
    act->args = list;
    for (const cJSON *e = args->child; e; e = e->next) {
        int rc = load_arg(e, &list[act->n_args], act->action, err, errlen);
        if (rc != 0) return rc;
        for (size_t k = 0; k < act->n_args; k++)
            if (strcmp(list[k].name, list[act->n_args].name) == 0)
                return fail(err, errlen, act->action, "duplicate argument name");
        act->n_args++;
    }
    return 0;
}

static int load_tool(const cJSON *j, const defn_options *opts, defn_tool *t, char *err,
                     size_t errlen) {
    t->tool = str_field(j, "tool");
    t->description = str_field(j, "description");
    t->enabled_by = str_field(j, "enabled_by");
    t->enabled_by_alias = str_field(j, "enabled_by_alias");
    const cJSON *actions = cJSON_GetObjectItemCaseSensitive(j, "actions");
    if (!t->tool || !t->description || !cJSON_IsArray(actions) || !actions->child)
        return fail(err, errlen, "tool", "needs tool, description and a non-empty actions array");
    if (t->enabled_by_alias && !t->enabled_by)
        return fail(err, errlen, t->tool, "enabled_by_alias needs enabled_by");
    if (t->enabled_by) {
        bool (*gate)(const char *, void *) =
            opts && opts->gate_enabled ? opts->gate_enabled : defn_env_gate;
        void *arg = opts ? opts->gate_arg : NULL;
        /* either name of the switch enables the tool: code_exec's is WF_CODE_EXEC_ENABLED
         * (spec: "code_exec, gated by WF_CODE_EXEC_ENABLED"), with UPSQUAD_CODE_EXEC_ENABLED,
         * this service's earlier name, as its alias */
        t->enabled =
            gate(t->enabled_by, arg) || (t->enabled_by_alias && gate(t->enabled_by_alias, arg));
    } else {
        t->enabled = true;
    }
    size_t n = (size_t)cJSON_GetArraySize(actions);
    defn_tool_action *list = calloc(n, sizeof(*list));
    if (!list) return DEFN_ERR_NOMEM;
    t->actions = list;
    for (const cJSON *e = actions->child; e; e = e->next) {
        defn_tool_action *a = &list[t->n_actions];
        t->n_actions++; /* counted before loading so a failure still frees its args */
        int rc = load_action(e, a, err, errlen);
        if (rc != 0) return rc;
        for (size_t k = 0; k + 1 < t->n_actions; k++)
            if (strcmp(list[k].action, a->action) == 0)
                return fail(err, errlen, t->tool, "duplicate action name");
    }
    return 0;
}

static int load_observations(const cJSON *arr, defn__catalog *c, char *err, size_t errlen) {
    if (!cJSON_IsArray(arr)) return fail(err, errlen, "poll_observations", "must be an array");
    size_t n = (size_t)cJSON_GetArraySize(arr);
    c->observations = calloc(n ? n : 1, sizeof(*c->observations));
    if (!c->observations) return DEFN_ERR_NOMEM;
    for (const cJSON *e = arr->child; e; e = e->next) {
        defn_poll_observation *o = &c->observations[c->n_observations];
        o->tool = str_field(e, "tool");
        o->action = str_field(e, "action");
        o->rationale = str_field(e, "rationale");
        if (!o->tool || !o->action || !o->rationale || !*o->rationale)
            return fail(err, errlen, "poll_observations", "needs tool, action and rationale");
        /* One construction path: an observation's arguments are the catalogued action's. */
        const defn_tool *t = defn__catalog_tool(c, o->tool);
        if (!t || !defn__catalog_action(t, o->action))
            return fail(err, errlen, o->action, "observation is not a catalogued action");
        for (size_t k = 0; k < c->n_observations; k++)
            if (strcmp(c->observations[k].tool, o->tool) == 0 &&
                strcmp(c->observations[k].action, o->action) == 0)
                return fail(err, errlen, o->action, "duplicate observation");
        c->n_observations++;
    }
    return 0;
}

int defn__catalog_load(cJSON *doc, const defn_options *opts, defn__catalog *out, char *err,
                       size_t errlen) {
    memset(out, 0, sizeof(*out));
    out->doc = doc;
    int rc;
    const cJSON *tools = cJSON_GetObjectItemCaseSensitive(doc, "tools");
    if (!cJSON_IsArray(tools) || !tools->child) {
        rc = fail(err, errlen, "tools", "must be a non-empty array");
        goto fail;
    }
    size_t n = (size_t)cJSON_GetArraySize(tools);
    out->tools = calloc(n, sizeof(*out->tools));
    if (!out->tools) {
        rc = DEFN_ERR_NOMEM;
        goto fail;
    }
    for (const cJSON *e = tools->child; e; e = e->next) {
        defn_tool *t = &out->tools[out->n_tools];
        out->n_tools++;
        rc = load_tool(e, opts, t, err, errlen);
        if (rc != 0) goto fail;
        for (size_t k = 0; k + 1 < out->n_tools; k++)
            if (strcmp(out->tools[k].tool, t->tool) == 0) {
                rc = fail(err, errlen, t->tool, "duplicate tool");
                goto fail;
            }
    }
    rc = load_observations(cJSON_GetObjectItemCaseSensitive(doc, "poll_observations"), out, err,
                           errlen);
    if (rc != 0) goto fail;
    return 0;
fail:
    if (rc == DEFN_ERR_NOMEM) snprintf(err, errlen, "out of memory");
    defn__catalog_free(out);
    return rc;
}

void defn__catalog_free(defn__catalog *c) {
    for (size_t i = 0; i < c->n_tools; i++) {
        for (size_t k = 0; k < c->tools[i].n_actions; k++)
            free((void *)c->tools[i].actions[k].args);
        free((void *)c->tools[i].actions);
    }
    free(c->tools);
    free(c->observations);
    cJSON_Delete(c->doc);
    memset(c, 0, sizeof(*c));
}

const defn_tool *defn__catalog_tool(const defn__catalog *c, const char *tool) {
    for (size_t i = 0; i < c->n_tools; i++)
        if (strcmp(c->tools[i].tool, tool) == 0) return &c->tools[i];
    return NULL;
}

const defn_tool_action *defn__catalog_action(const defn_tool *t, const char *action) {
    for (size_t i = 0; i < t->n_actions; i++)
        if (strcmp(t->actions[i].action, action) == 0) return &t->actions[i];
    return NULL;
}

const defn_tool *defn_catalog_tools(const defn_ctx *ctx, size_t *n) {
    *n = ctx->catalog.n_tools;
    return ctx->catalog.tools;
}

const defn_poll_observation *defn_catalog_observations(const defn_ctx *ctx, size_t *n) {
    *n = ctx->catalog.n_observations;
    return ctx->catalog.observations;
}

const defn_tool *defn_catalog_tool(const defn_ctx *ctx, const char *tool) {
    return defn__catalog_tool(&ctx->catalog, tool);
}

const defn_tool_action *defn_catalog_find(const defn_ctx *ctx, const char *tool,
                                          const char *action) {
    const defn_tool *t = defn__catalog_tool(&ctx->catalog, tool);
    if (!t || !t->enabled) return NULL;
    return defn__catalog_action(t, action);
}
