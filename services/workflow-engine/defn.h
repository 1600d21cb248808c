/*
 * Workflow definition language: validation against the JSON Schema file and the tool catalogue.
 *
 * The schema (schema/workflow-definition.schema.json) is the single source of truth for the
 * structure: it is loaded and interpreted at run time, never restated in C. The semantic rules the
 * schema cannot express (references, scopes, reachability, cycles, the tool catalogue, templates,
 * condition paths, option uniqueness) are checked afterwards, only on a structurally valid
 * definition. The language is documented for authors in docs/workflow-definitions.md.
 *
 * A defn_ctx is immutable once loaded and may be shared by any number of threads.
 */
#ifndef UPSQUAD_WORKFLOW_DEFN_H
#define UPSQUAD_WORKFLOW_DEFN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Limits, checked before and while parsing so that hostile input costs little. */
#define DEFN_MAX_BYTES (256u * 1024u) /* definition size, bytes of JSON text */
#define DEFN_MAX_DEPTH 32             /* JSON nesting of the definition document */
#define DEFN_MAX_SCOPE_DEPTH 8        /* loops / conditions / parallels nested in each other */
/* Worst-case laps of the innermost loop body: the product of the max_iterations of the loops
 * enclosing it (theirs included). Depth alone lets seven loops of 25 multiply to 6.1e9 laps;
 * the interpreter also caps every run's actions (UPSQUAD_WF_RUN_MAX_ACTIONS). */
#define DEFN_MAX_RUN_LAPS 1000
#define DEFN_MAX_STEP_NAME 128 /* code points in a step name */
#define DEFN_MAX_TEMPLATE 8192 /* code points in a templated string inside `with` */
/* At most this many violations are returned; the rest are counted in defn_violations.dropped
 * and announced by one final violation at the root. */
#define DEFN_MAX_VIOLATIONS 200

enum {
    DEFN_OK = 0,
    DEFN_INVALID = 1,    /* the definition has violations (in *out) */
    DEFN_ERR_NOMEM = -1, /* allocation failed; *out may be partial */
    DEFN_ERR_LOAD = -2,  /* schema or catalogue could not be loaded (message in err) */
    DEFN_ERR_ARG = -3,   /* NULL argument */
};

/* One violation: the fields of DefinitionValidationError.FieldViolation. */
typedef struct {
    char *instance_location; /* RFC 6901 pointer into the definition; "" is the root */
    char *message;           /* human-readable */
} defn_violation;

/* Owns its items and their strings (defn_violations_free). */
typedef struct {
    defn_violation *items;
    size_t n;
    size_t cap;
    size_t dropped; /* violations beyond DEFN_MAX_VIOLATIONS, not stored */
} defn_violations;

typedef struct {
    /* Decides whether a tool whose catalogue entry names an `enabled_by` switch is served;
     * asked for `enabled_by_alias` too when the entry names one, and either enables the tool.
     * NULL: read the switch from the environment; "1", "true", "yes" and "on" enable it. */
    bool (*gate_enabled)(const char *switch_name, void *arg);
    void *gate_arg;
} defn_options;

/* The default gate_enabled: the switch read from the environment (arg unused). */
bool defn_env_gate(const char *switch_name, void *arg);

typedef struct defn_ctx defn_ctx;

/* Loads the schema and the tool catalogue from files. opts may be NULL. On failure returns
 * DEFN_ERR_LOAD or DEFN_ERR_NOMEM with a message in err. Caller frees *out with defn_ctx_free. */
int defn_ctx_load(const char *schema_path, const char *catalog_path, const defn_options *opts,
                  defn_ctx **out, char *err, size_t errlen);
/* The same from memory (the texts are copied). */
int defn_ctx_load_mem(const char *schema_json, size_t schema_len, const char *catalog_json,
                      size_t catalog_len, const defn_options *opts, defn_ctx **out, char *err,
                      size_t errlen);
void defn_ctx_free(defn_ctx *ctx);

void defn_violations_init(defn_violations *v);
void defn_violations_free(defn_violations *v);

/* Validates one definition (JSON text, not necessarily NUL-terminated). Every violation found is
 * appended to *out (initialised by the caller): structural ones first, innermost only, in
 * document order; the semantic ones only when the structure is valid. Returns DEFN_OK,
 * DEFN_INVALID, or a negative DEFN_ERR_*. */
int defn_validate(const defn_ctx *ctx, const char *json, size_t len, defn_violations *out);

/* As a DefinitionValidationError message (the status detail): see defn_pb.h. */

/* A one-line status message naming the first violation and the count of the others, truncated
 * to fit buf. Returns the length written (without the NUL). */
size_t defn_violations_summary(const defn_violations *v, char *buf, size_t buflen);

/* ---- the tool catalogue (borrowed views, valid for the lifetime of the ctx) ---- */

typedef struct {
    const char *name;
    const char *type; /* string | number | integer | boolean | object | array */
    bool required;
    const char *description;
    bool pinned_literal; /* the value must be an author-committed literal, never a template */
} defn_tool_arg;

typedef struct {
    const char *action;
    const char *description;
    const defn_tool_arg *args;
    size_t n_args;
} defn_tool_action;

typedef struct {
    const char *tool;
    const char *description;
    const char *enabled_by;       /* NULL, or the environment switch that gates the tool */
    const char *enabled_by_alias; /* NULL, or another name of that switch (either enables) */
    /* false (the switch is off): omitted by GetToolCatalog and failed at dispatch; the
     * validator accepts the tool either way */
    bool enabled;
    const defn_tool_action *actions;
    size_t n_actions;
} defn_tool;

typedef struct {
    const char *tool;
    const char *action;
    const char *rationale; /* why it is read-only, cheap and idempotent */
} defn_poll_observation;

/* Every catalogued tool, enabled or not, in catalogue order. */
const defn_tool *defn_catalog_tools(const defn_ctx *ctx, size_t *n);
/* The admitted poll-mode wait observations, in catalogue order. */
const defn_poll_observation *defn_catalog_observations(const defn_ctx *ctx, size_t *n);
/* The catalogued tool of that name, enabled or not, or NULL. */
const defn_tool *defn_catalog_tool(const defn_ctx *ctx, const char *tool);
/* The action of an enabled tool, or NULL. */
const defn_tool_action *defn_catalog_find(const defn_ctx *ctx, const char *tool,
                                          const char *action);

#endif
