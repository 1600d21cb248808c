/* Run-state expressions of the definition language (docs/workflow-definitions.md): templates
 * `${<pointer>}` and conditions (`eq`, `ne`, `gt`, ..., `all`/`any`/`none`). Pure functions over
 * cJSON trees; no I/O. */
#ifndef WF_EXPR_H
#define WF_EXPR_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdbool.h>

/* The value at RFC 6901 pointer `ptr` of doc (borrowed), or NULL when it does not resolve. */
const cJSON *wf_expr_resolve(const cJSON *state, const char *ptr);

/* Bytes one render (a template, or a whole `with` tree) may produce; more fails the render
 * with an error naming UPSQUAD_WF_MAX_RENDERED (set once at start-up, before any thread). */
#define WF_EXPR_MAX_RENDERED_DEFAULT (1024 * 1024)
extern size_t wf_expr_max_rendered;

/* Renders a template string against state. A string that is exactly one template keeps the
 * value's JSON type. Returns a new cJSON (caller frees), or NULL with err naming the pointer
 * that did not resolve. */
cJSON *wf_expr_render(const cJSON *state, const char *tmpl, char *err, size_t errlen);

/* Deep-copies v rendering every string inside it (a `with` block). NULL + err on failure. */
cJSON *wf_expr_render_tree(const cJSON *state, const cJSON *v, char *err, size_t errlen);

/* Evaluates a condition object; a comparison on an absent value is false. */
bool wf_expr_holds(const cJSON *state, const cJSON *cond);

/* Checks obj against a field-spec map ({name: {type, required}}): 0, or -1 with err naming
 * the first field that is missing or of the wrong type. */
int wf_expr_check_fields(const cJSON *spec, const cJSON *obj, const char *what, char *err,
                         size_t errlen);
#endif
