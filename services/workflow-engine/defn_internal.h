/* Internals shared by the defn_*.c files of the definition validator. */
#ifndef UPSQUAD_WORKFLOW_DEFN_INTERNAL_H
#define UPSQUAD_WORKFLOW_DEFN_INTERNAL_H

#include <cjson/cJSON.h>

#include "defn.h"

/* ---- JSON pointer under construction (grows; bounded by the document size) ---- */
typedef struct {
    char *buf; /* NUL-terminated */
    size_t len;
    size_t cap;
} defn__ptr;

int defn__ptr_init(defn__ptr *p);
void defn__ptr_free(defn__ptr *p);
/* Replaces the content by an already escaped pointer. */
int defn__ptr_set(defn__ptr *p, const char *text);
/* Append "/<escaped key>" or "/<index>"; return the previous length for defn__ptr_pop, or
 * (size_t)-1 when out of memory. */
size_t defn__ptr_push_key(defn__ptr *p, const char *key);
size_t defn__ptr_push_index(defn__ptr *p, size_t index);
void defn__ptr_pop(defn__ptr *p, size_t len);

/* ---- violations ---- */
/* Appends one violation (message formatted printf-style, clipped at 1 KiB). Past
 * DEFN_MAX_VIOLATIONS only counts it. Returns 0 or DEFN_ERR_NOMEM. */
int defn__add(defn_violations *v, const char *loc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* When violations were dropped, replaces the last stored one by a root note saying how many
 * were not reported (the stored count stays DEFN_MAX_VIOLATIONS). */
int defn__add_overflow_note(defn_violations *v);
/* Removes violation i..n-1 (used to drop duplicates). */
void defn__truncate(defn_violations *v, size_t n);

/* ---- text ---- */
size_t defn__utf8_len(const char *s); /* code points of a valid UTF-8 string */
/* First invalid byte offset, or len when s[0..len) is valid UTF-8. */
size_t defn__utf8_check(const unsigned char *s, size_t len);
/* Shortest decimal text of a JSON number. */
void defn__fmt_num(double d, char *buf, size_t len);
/* Deep JSON equality (numbers by value, objects regardless of member order). */
bool defn__json_equal(const cJSON *a, const cJSON *b);
/* Resolves an RFC 6901 pointer within doc; NULL when absent or malformed. */
const cJSON *defn__resolve(const cJSON *doc, const char *ptr);

/* ---- the JSON Schema interpreter ---- */
typedef struct defn__schema defn__schema;
/* Compiles a draft 2020-12 schema document; takes ownership of doc. Unknown keywords and
 * non-local $refs are load errors, so the schema cannot silently mean more than is enforced. */
int defn__schema_compile(cJSON *doc, defn__schema **out, char *err, size_t errlen);
void defn__schema_free(defn__schema *s);
/* Appends the innermost violations of instance, in document order. Returns DEFN_OK,
 * DEFN_INVALID or DEFN_ERR_NOMEM. */
int defn__schema_validate(const defn__schema *s, const cJSON *instance, defn_violations *out);

/* ---- the tool catalogue ---- */
typedef struct {
    cJSON *doc; /* owns every string the views below point to */
    defn_tool *tools;
    size_t n_tools;
    defn_poll_observation *observations;
    size_t n_observations;
} defn__catalog;

/* Takes ownership of doc. */
int defn__catalog_load(cJSON *doc, const defn_options *opts, defn__catalog *out, char *err,
                       size_t errlen);
void defn__catalog_free(defn__catalog *c);
const defn_tool *defn__catalog_tool(const defn__catalog *c, const char *tool);
const defn_tool_action *defn__catalog_action(const defn_tool *t, const char *action);

struct defn_ctx {
    defn__schema *schema;
    defn__catalog catalog;
};

/* ---- the semantic rules ---- */
int defn__semantic_check(const defn_ctx *ctx, const cJSON *doc, defn_violations *out);

#endif
