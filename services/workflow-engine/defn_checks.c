/* The checks of each step of a definition (defn_semantic_int.h): state pointers and templates,
 * conditions, tool calls and their arguments, and the rules of each step kind. The scopes and
 * the "can run before" relation they consult are built by defn_semantic.c. */
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_semantic_int.h"

/* ------------------------------------------------------------------ state pointers */

typedef struct {
    int step;         /* the step whose field is checked */
    position pos;     /* when it is evaluated */
    const char *what; /* "template ${...}: " prefix, or "" for condition paths */
} reader;

static bool in_loop(const sem *s, const reader *rd) {
    const step *st = &s->steps[rd->step];
    if (rd->pos == AT_AFTER && st->k == K_LOOP) return true;
    return st->region >= 0 && s->regions[st->region].loop >= 0;
}

/* Splits the next reference token of p (after a '/') into tok; returns the rest or NULL on a
 * malformed escape. */
static const char *next_token(const char *p, const char *end, char *tok, size_t cap) {
    size_t w = 0;
    for (; p < end && *p != '/'; p++) {
        char c = *p;
        if (c == '~') {
            if (p + 1 >= end || (p[1] != '0' && p[1] != '1')) return NULL;
            c = p[1] == '0' ? '~' : '/';
            p++;
        }
        if (w + 1 < cap) tok[w++] = c;
    }
    tok[w] = '\0';
    return p;
}

static bool one_of(const char *v, const char *const *set) {
    for (; *set; set++)
        if (strcmp(v, *set) == 0) return true;
    return false;
}

/* Checks one pointer into the run state (len bytes at p), reporting at where. */
static void check_state_ptr(sem *s, const reader *rd, const char *p, size_t len,
                            const char *where) {
    static const char *const run_keys[] = {"id", "workflow_id", "triggered_by", "started_at", NULL};
    static const char *const loop_keys[] = {"iteration", "max_iterations", NULL};
    static const char *const env_keys[] = {"output", "status", NULL};
    const char *end = p + len, *q;
    char root[256], t1[512], t2[256];
    if (len == 0 || *p != '/') {
        defn__sem_add(s, where, "%smust be a JSON pointer starting with / such as /trigger/...",
                      rd->what);
        return;
    }
    q = next_token(p + 1, end, root, sizeof(root));
    const char *q2 = q && q < end ? next_token(q + 1, end, t1, sizeof(t1)) : q;
    if (q2 == q) t1[0] = '\0';
    const char *q3 = q2 && q2 < end ? next_token(q2 + 1, end, t2, sizeof(t2)) : q2;
    if (q3 == q2) t2[0] = '\0';
    if (!q || !q2 || !q3) {
        defn__sem_add(s, where, "%smalformed JSON pointer escape (use ~0 for ~ and ~1 for /)",
                      rd->what);
        return;
    }
    bool has1 = q < end, has2 = q2 < end;
    if (strcmp(root, "trigger") == 0) {
        if (has1 && s->trigger_fields && !defn__sem_get(s->trigger_fields, t1))
            defn__sem_add(s, where, "%strigger field \"%s\" is not declared in /trigger/fields",
                          rd->what, t1);
    } else if (strcmp(root, "run") == 0) {
        if (!has1 || !one_of(t1, run_keys))
            defn__sem_add(s, where, "%s/run has id, workflow_id, triggered_by and started_at",
                          rd->what);
    } else if (strcmp(root, "loop") == 0) {
        if (!in_loop(s, rd))
            defn__sem_add(s, where, "%s/loop is only defined inside a loop body", rd->what);
        else if (!has1 || !one_of(t1, loop_keys))
            defn__sem_add(s, where, "%s/loop has iteration and max_iterations", rd->what);
    } else if (strcmp(root, "steps") == 0) {
        int x = has1 ? defn__sem_find(s, t1) : -1;
        if (!has1) {
            defn__sem_add(s, where, "%s/steps needs a step name, as in /steps/<name>/output",
                          rd->what);
        } else if (x < 0) {
            defn__sem_add(s, where, "%sreads unknown step \"%s\"", rd->what, t1);
        } else if (has2 && !one_of(t2, env_keys)) {
            defn__sem_add(s, where, "%sa step's envelope has only \"output\" and \"status\"",
                          rd->what);
        } else if (x == rd->step && rd->pos != AT_SELF) {
            defn__sem_add(s, where, "%sreads the output of its own step, which does not exist yet",
                          rd->what);
        } else if (x != rd->step && s->steps[rd->step].region >= 0) {
            int target = rd->pos == AT_AFTER ? 2 * rd->step + 1 : 2 * rd->step;
            if (!defn__sem_runs_before(s, x, target))
                defn__sem_add(s, where,
                              "%sreads step \"%s\", which cannot have run before this point",
                              rd->what, t1);
        }
    } else {
        defn__sem_add(s, where,
                      "%sunknown state root \"%s\"; the roots are /trigger, /steps, /loop and /run",
                      rd->what, root);
    }
}

/* Finds the templates of str (from `from`): returns the offset of "${" or -1. "$${" is an
 * escaped, literal "${". */
static long next_template(const char *str, size_t from) {
    for (size_t i = from; str[i]; i++) {
        if (str[i] == '$' && str[i + 1] == '$' && str[i + 2] == '{') {
            i += 2;
            continue;
        }
        if (str[i] == '$' && str[i + 1] == '{') return (long)i;
    }
    return -1;
}

static bool has_template(const char *str) {
    return next_template(str, 0) >= 0;
}

/* The whole string is one template: its value keeps its JSON type when substituted. */
static bool whole_template(const char *str) {
    if (str[0] != '$' || str[1] != '{') return false;
    const char *close = strchr(str, '}');
    return close && close[1] == '\0';
}

static void check_templates(sem *s, int i, const char *str, const char *where, position pos) {
    long at = 0;
    while ((at = next_template(str, (size_t)at)) >= 0) {
        const char *open = str + at + 2;
        const char *close = strchr(open, '}');
        if (!close) {
            defn__sem_add(s, where, "template at character %ld is not closed with }",
                          (long)defn__utf8_len(str) - (long)defn__utf8_len(str + at));
            return;
        }
        char what[300];
        snprintf(what, sizeof(what),
                 "template ${%.*s}: ", (int)((close - open) > 200 ? 200 : close - open), open);
        reader rd = {i, pos, what};
        check_state_ptr(s, &rd, open, (size_t)(close - open), where);
        at = close - str + 1;
    }
}

/* The template-bearing string field f of step i (absent is fine). */
static void check_template_field(sem *s, int i, const cJSON *obj, const char *f, const char *sub,
                                 position pos) {
    const char *str = defn__sem_str(obj, sub ? sub : f);
    if (!str) return;
    char where[1024];
    snprintf(where, sizeof(where), "%s", defn__sem_loc(s, i, f, -1, sub));
    check_templates(s, i, str, where, pos);
}

/* ------------------------------------------------------------------ conditions */

static void check_condition(sem *s, int i, const cJSON *c, defn__ptr *at, position pos) {
    const char *op = defn__sem_str(c, "op");
    if (!op) return;
    const cJSON *of = defn__sem_get(c, "of");
    if (cJSON_IsArray(of)) {
        size_t idx = 0;
        for (const cJSON *e = of->child; e && s->rc == 0; e = e->next, idx++) {
            size_t m1 = defn__ptr_push_key(at, "of");
            size_t m2 = m1 == (size_t)-1 ? m1 : defn__ptr_push_index(at, idx);
            if (m2 == (size_t)-1) {
                s->rc = DEFN_ERR_NOMEM;
                return;
            }
            check_condition(s, i, e, at, pos);
            defn__ptr_pop(at, m1);
        }
        return;
    }
    const char *path = defn__sem_str(c, "path");
    if (!path) return;
    size_t m = defn__ptr_push_key(at, "path");
    if (m == (size_t)-1) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    reader rd = {i, pos, ""};
    check_state_ptr(s, &rd, path, strlen(path), at->buf);
    defn__ptr_pop(at, m);
}

static void check_condition_field(sem *s, int i, const cJSON *c, const char *f, const char *sub,
                                  position pos) {
    if (!c) return;
    defn__ptr at;
    if (defn__ptr_init(&at) != 0) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    if (defn__ptr_set(&at, defn__sem_loc(s, i, f, -1, sub)) != 0) {
        s->rc = DEFN_ERR_NOMEM;
        defn__ptr_free(&at);
        return;
    }
    check_condition(s, i, c, &at, pos);
    defn__ptr_free(&at);
}

/* ------------------------------------------------------------------ tools */

static bool arg_type_ok(const char *type, const cJSON *v) {
    if (strcmp(type, "string") == 0) return cJSON_IsString(v);
    if (strcmp(type, "boolean") == 0) return cJSON_IsBool(v);
    if (strcmp(type, "object") == 0) return cJSON_IsObject(v);
    if (strcmp(type, "array") == 0) return cJSON_IsArray(v);
    if (strcmp(type, "number") == 0) return cJSON_IsNumber(v);
    if (strcmp(type, "integer") == 0)
        return cJSON_IsNumber(v) && v->valuedouble == (double)(long long)v->valuedouble;
    return false;
}

static const char *json_type(const cJSON *v) {
    if (cJSON_IsString(v)) return "string";
    if (cJSON_IsNumber(v)) return "number";
    if (cJSON_IsBool(v)) return "boolean";
    if (cJSON_IsObject(v)) return "object";
    if (cJSON_IsArray(v)) return "array";
    return "null";
}

/* Every string inside an argument value may carry templates. */
static void check_value_templates(sem *s, int i, const cJSON *v, defn__ptr *at) {
    if (cJSON_IsString(v)) {
        size_t len = defn__utf8_len(v->valuestring);
        if (len > DEFN_MAX_TEMPLATE)
            defn__sem_add(s, at->buf, "length must be <= %d, but got %zu", DEFN_MAX_TEMPLATE, len);
        else
            check_templates(s, i, v->valuestring, at->buf, AT_ENTRY);
        return;
    }
    size_t idx = 0;
    for (const cJSON *c = v->child; c && s->rc == 0; c = c->next, idx++) {
        size_t m =
            cJSON_IsObject(v) ? defn__ptr_push_key(at, c->string) : defn__ptr_push_index(at, idx);
        if (m == (size_t)-1) {
            s->rc = DEFN_ERR_NOMEM;
            return;
        }
        check_value_templates(s, i, c, at);
        defn__ptr_pop(at, m);
    }
}

static void check_args(sem *s, int i, const char *prefix, const cJSON *with, const defn_tool *tool,
                       const defn_tool_action *act) {
    defn__ptr at;
    if (defn__ptr_init(&at) != 0) {
        s->rc = DEFN_ERR_NOMEM;
        return;
    }
    char base[1024];
    snprintf(base, sizeof(base), "%s",
             prefix ? defn__sem_loc(s, i, prefix, -1, "with")
                    : defn__sem_loc(s, i, "with", -1, NULL));
    for (const cJSON *a = cJSON_IsObject(with) ? with->child : NULL; a && s->rc == 0; a = a->next) {
        if (defn__ptr_set(&at, base) != 0) {
            s->rc = DEFN_ERR_NOMEM;
            break;
        }
        if (defn__ptr_push_key(&at, a->string) == (size_t)-1) {
            s->rc = DEFN_ERR_NOMEM;
            break;
        }
        const defn_tool_arg *arg = NULL;
        for (size_t k = 0; k < act->n_args && !arg; k++)
            if (strcmp(act->args[k].name, a->string) == 0) arg = &act->args[k];
        if (!arg) {
            defn__sem_add(s, at.buf, "\"%s.%s\" has no argument \"%s\"", tool->tool, act->action,
                          a->string);
            continue;
        }
        bool tmpl = cJSON_IsString(a) && has_template(a->valuestring);
        if (arg->pinned_literal && tmpl) {
            defn__sem_add(s, at.buf,
                          "argument \"%s\" is pinned: it must be a literal, not a template",
                          arg->name);
            continue;
        }
        if (!(tmpl && whole_template(a->valuestring)) && !arg_type_ok(arg->type, a)) {
            if (tmpl)
                defn__sem_add(s, at.buf,
                              "argument \"%s\" must be %s; a template must then be the whole value",
                              arg->name, arg->type);
            else
                defn__sem_add(s, at.buf, "argument \"%s\" must be %s, but got %s", arg->name,
                              arg->type, json_type(a));
            continue;
        }
        check_value_templates(s, i, a, &at);
    }
    for (size_t k = 0; k < act->n_args && s->rc == 0; k++)
        if (act->args[k].required && !defn__sem_get(with, act->args[k].name))
            defn__sem_add(s, cJSON_IsObject(with) ? base : defn__sem_loc(s, i, prefix, -1, NULL),
                          "missing required argument \"%s\" of \"%s.%s\"", act->args[k].name,
                          tool->tool, act->action);
    defn__ptr_free(&at);
}

static void list_tools(const sem *s, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < s->ctx->catalog.n_tools && used < len; k++) {
        const defn_tool *t = &s->ctx->catalog.tools[k];
        int w = snprintf(buf + used, len - used, "%s\"%s\"", used ? ", " : "", t->tool);
        if (w > 0) used += (size_t)w;
    }
}

static void list_observations(const sem *s, char *buf, size_t len) {
    size_t used = 0;
    buf[0] = '\0';
    for (size_t k = 0; k < s->ctx->catalog.n_observations && used < len; k++) {
        const defn_poll_observation *o = &s->ctx->catalog.observations[k];
        int w =
            snprintf(buf + used, len - used, "%s\"%s.%s\"", used ? ", " : "", o->tool, o->action);
        if (w > 0) used += (size_t)w;
    }
}

/* Resolves (tool, action) of step i, under prefix (NULL for the step itself, "poll" for a
 * poll-mode wait), reports what is not catalogued, then checks the arguments. */
static void check_tool_call(sem *s, int i, const cJSON *obj, const char *prefix, bool observation) {
    const char *tname = defn__sem_str(obj, "tool"), *aname = defn__sem_str(obj, "action");
    if (!tname || !aname) return;
    char list[600];
    const defn__catalog *cat = &s->ctx->catalog;
    if (observation) {
        bool tool_ok = false, pair_ok = false;
        for (size_t k = 0; k < cat->n_observations; k++) {
            tool_ok = tool_ok || strcmp(cat->observations[k].tool, tname) == 0;
            pair_ok = pair_ok || (strcmp(cat->observations[k].tool, tname) == 0 &&
                                  strcmp(cat->observations[k].action, aname) == 0);
        }
        if (!pair_ok) {
            list_observations(s, list, sizeof(list));
            if (!tool_ok)
                defn__sem_add(s, defn__sem_loc(s, i, prefix, -1, "tool"),
                              "\"%s\" has no admitted poll observation; admitted: %s", tname, list);
            else
                defn__sem_add(s, defn__sem_loc(s, i, prefix, -1, "action"),
                              "\"%s.%s\" is not an admitted poll observation; admitted: %s", tname,
                              aname, list);
            return;
        }
    }
    const char *tool_field = prefix ? prefix : "tool";
    const char *tool_sub = prefix ? "tool" : NULL;
    const defn_tool *t = defn__catalog_tool(cat, tname);
    if (!t) {
        list_tools(s, list, sizeof(list));
        defn__sem_add(s, defn__sem_loc(s, i, tool_field, -1, tool_sub),
                      "unknown tool \"%s\"; catalogued tools: %s", tname, list);
        return;
    }
    /* A tool whose gate is off is checked like any other: the create-time whitelist is the
     * catalogue, gate or not (spec GetToolCatalogResponse.tools: a node built from a gated-off
     * tool "would validate at create, render on the canvas, and then fail closed at dispatch").
     * The gate only hides it from GetToolCatalog and fails the step when the run reaches it. */
    const defn_tool_action *act = defn__catalog_action(t, aname);
    if (!act) {
        defn__sem_add(s,
                      defn__sem_loc(s, i, prefix ? prefix : "action", -1, prefix ? "action" : NULL),
                      "tool \"%s\" has no action \"%s\"", tname, aname);
        return;
    }
    check_args(s, i, prefix, defn__sem_get(obj, "with"), t, act);
}

/* ------------------------------------------------------------------ per kind */

static void check_timeout_pair(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    if (defn__sem_get(node, "on_timeout") && !defn__sem_get(node, "timeout_minutes"))
        defn__sem_add(s, defn__sem_loc(s, i, "on_timeout", -1, NULL),
                      "on_timeout needs timeout_minutes");
}

static void check_asked_by(sem *s, int i) {
    const char *name = defn__sem_str(s->steps[i].node, "asked_by");
    int x = name ? defn__sem_find(s, name) : -1;
    if (x < 0) return; /* unknown: reported with the references */
    if (s->steps[x].k != K_AGENT)
        defn__sem_add(s, defn__sem_loc(s, i, "asked_by", -1, NULL),
                      "must name an agent_action step; \"%s\" is a %s", name,
                      defn__sem_kind_name(s->steps[x].node));
    else if (s->steps[i].region >= 0 && !defn__sem_runs_before(s, x, 2 * i))
        defn__sem_add(s, defn__sem_loc(s, i, "asked_by", -1, NULL),
                      "step \"%s\" cannot have run before this step asks", name);
}

/* Duplicate option tokens and a default that is not one of them. */
static void check_options(sem *s, int i, const char *field, const char *dflt_field,
                          const char *what) {
    const cJSON *node = s->steps[i].node;
    const cJSON *opts = defn__sem_get(node, "options");
    int idx = 0;
    for (const cJSON *o = cJSON_IsArray(opts) ? opts->child : NULL; o; o = o->next, idx++) {
        const char *v = defn__sem_str(o, field);
        if (!v) continue;
        int j = 0;
        for (const cJSON *p = opts->child; p != o; p = p->next, j++) {
            const char *w = defn__sem_str(p, field);
            if (w && strcmp(v, w) == 0) {
                defn__sem_add(s, defn__sem_loc(s, i, "options", idx, field),
                              "duplicate option %s \"%s\" (option %d has it)", what, v, j);
                break;
            }
        }
    }
    const char *dflt = defn__sem_str(node, dflt_field);
    if (dflt) {
        bool found = false;
        for (const cJSON *o = cJSON_IsArray(opts) ? opts->child : NULL; o && !found; o = o->next) {
            const char *v = defn__sem_str(o, field);
            found = v && strcmp(v, dflt) == 0;
        }
        if (!found)
            defn__sem_add(s, defn__sem_loc(s, i, dflt_field, -1, NULL),
                          "\"%s\" is not one of the option %ss", dflt, what);
    }
    const char *on_timeout = defn__sem_str(node, "on_timeout");
    if (on_timeout && strcmp(on_timeout, "default") == 0 && !dflt)
        defn__sem_add(s, defn__sem_loc(s, i, "on_timeout", -1, NULL),
                      "on_timeout \"default\" needs %s", dflt_field);
}

static bool non_empty(const cJSON *v) {
    return v && v->child;
}

static void check_user_input(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_options(s, i, "value", "default_choice", "value");
    bool text = cJSON_IsTrue(defn__sem_get(node, "allow_text"));
    if (!non_empty(defn__sem_get(node, "options")) && !text)
        defn__sem_add(s, defn__sem_loc(s, i, NULL, -1, NULL),
                      "a prompt needs options or allow_text: true");
    if (defn__sem_get(node, "text_placeholder") && !text)
        defn__sem_add(s, defn__sem_loc(s, i, "text_placeholder", -1, NULL),
                      "text_placeholder needs allow_text: true");
    check_timeout_pair(s, i);
    check_asked_by(s, i);
    check_template_field(s, i, node, "question", NULL, AT_ENTRY);
}

static void check_question(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_options(s, i, "key", "default_option_key", "key");
    if (!non_empty(defn__sem_get(node, "options")) && !non_empty(defn__sem_get(node, "answer")))
        defn__sem_add(s, defn__sem_loc(s, i, NULL, -1, NULL),
                      "a question needs options or answer fields");
    check_timeout_pair(s, i);
    check_asked_by(s, i);
    check_template_field(s, i, node, "prompt", NULL, AT_ENTRY);
}

static void check_agent(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_template_field(s, i, node, "prompt", NULL, AT_ENTRY);
    const cJSON *acc = defn__sem_get(node, "acceptance");
    if (!acc) return;
    if (!non_empty(defn__sem_get(node, "expects")) && !defn__sem_get(acc, "check"))
        defn__sem_add(s, defn__sem_loc(s, i, "acceptance", -1, NULL),
                      "acceptance needs expects or a check to judge the output by");
    check_condition_field(s, i, defn__sem_get(acc, "check"), "acceptance", "check", AT_SELF);
    check_template_field(s, i, acc, "acceptance", "feedback", AT_SELF);
}

static void check_wait(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    check_timeout_pair(s, i);
    const cJSON *poll = defn__sem_get(node, "poll");
    if (!poll) return;
    check_tool_call(s, i, poll, "poll", true);
    check_condition_field(s, i, defn__sem_get(poll, "until"), "poll", "until", AT_SELF);
}

void defn__sem_check_step(sem *s, int i) {
    const cJSON *node = s->steps[i].node;
    switch (s->steps[i].k) {
    case K_AGENT:
        check_agent(s, i);
        break;
    case K_TOOL:
        check_tool_call(s, i, node, NULL, false);
        break;
    case K_APPROVAL:
        check_timeout_pair(s, i);
        check_template_field(s, i, node, "summary", NULL, AT_ENTRY);
        break;
    case K_USER_INPUT:
        check_user_input(s, i);
        break;
    case K_QUESTION:
        check_question(s, i);
        break;
    case K_WAIT:
        check_wait(s, i);
        break;
    case K_LOOP:
        check_condition_field(s, i, defn__sem_get(node, "until"), "until", NULL, AT_AFTER);
        break;
    case K_CONDITION:
        check_condition_field(s, i, defn__sem_get(node, "if"), "if", NULL, AT_ENTRY);
        break;
    default:
        break;
    }
}
