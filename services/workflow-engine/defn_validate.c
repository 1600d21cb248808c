/*
 * Entry points of the definition validator: loading the context, the limits checked before
 * parsing, the order of the passes, and the wire form of the violations.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_internal.h"

/* Schema and catalogue files are small; anything larger is a deployment mistake. */
#define DEFN__MAX_DATA_FILE (4u * 1024u * 1024u)

static int read_file(const char *path, char **out, size_t *len, char *err, size_t errlen) {
    int rc = DEFN_ERR_LOAD;
    char *buf = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, errlen, "cannot open %s", path);
        return DEFN_ERR_LOAD;
    }
    buf = malloc(DEFN__MAX_DATA_FILE + 1);
    if (!buf) {
        snprintf(err, errlen, "out of memory");
        rc = DEFN_ERR_NOMEM;
        goto done;
    }
    size_t n = fread(buf, 1, DEFN__MAX_DATA_FILE + 1, f);
    if (ferror(f) || n > DEFN__MAX_DATA_FILE) {
        snprintf(err, errlen, "cannot read %s (or larger than %u bytes)", path,
                 DEFN__MAX_DATA_FILE);
        goto done;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    buf = NULL;
    rc = 0;
done:
    free(buf);
    fclose(f);
    return rc;
}

int defn_ctx_load(const char *schema_path, const char *catalog_path, const defn_options *opts,
                  defn_ctx **out, char *err, size_t errlen) {
    char *schema = NULL, *catalog = NULL;
    size_t slen = 0, clen = 0;
    if (!schema_path || !catalog_path || !out) return DEFN_ERR_ARG;
    int rc = read_file(schema_path, &schema, &slen, err, errlen);
    if (rc == 0) rc = read_file(catalog_path, &catalog, &clen, err, errlen);
    if (rc == 0) rc = defn_ctx_load_mem(schema, slen, catalog, clen, opts, out, err, errlen);
    free(schema);
    free(catalog);
    return rc;
}

int defn_ctx_load_mem(const char *schema_json, size_t schema_len, const char *catalog_json,
                      size_t catalog_len, const defn_options *opts, defn_ctx **out, char *err,
                      size_t errlen) {
    if (!schema_json || !catalog_json || !out) return DEFN_ERR_ARG;
    defn_ctx *ctx = calloc(1, sizeof(*ctx));
    if (!ctx) {
        snprintf(err, errlen, "out of memory");
        return DEFN_ERR_NOMEM;
    }
    int rc;
    cJSON *sdoc = cJSON_ParseWithLength(schema_json, schema_len);
    if (!sdoc) {
        snprintf(err, errlen, "schema is not valid JSON");
        rc = DEFN_ERR_LOAD;
        goto fail;
    }
    rc = defn__schema_compile(sdoc, &ctx->schema, err, errlen); /* takes sdoc */
    if (rc != 0) goto fail;
    cJSON *cdoc = cJSON_ParseWithLength(catalog_json, catalog_len);
    if (!cdoc) {
        snprintf(err, errlen, "tool catalogue is not valid JSON");
        rc = DEFN_ERR_LOAD;
        goto fail;
    }
    rc = defn__catalog_load(cdoc, opts, &ctx->catalog, err, errlen); /* takes cdoc */
    if (rc != 0) goto fail;
    *out = ctx;
    return 0;
fail:
    defn_ctx_free(ctx);
    return rc;
}

void defn_ctx_free(defn_ctx *ctx) {
    if (!ctx) return;
    defn__schema_free(ctx->schema);
    defn__catalog_free(&ctx->catalog);
    free(ctx);
}

/* Bounds the nesting before cJSON builds anything, so deep input costs one linear scan and
 * no recursion. Returns the offset of the first bracket past the limit, or len. */
static size_t depth_scan(const char *s, size_t len) {
    int depth = 0;
    bool in_str = false;
    for (size_t i = 0; i < len; i++) {
        char c = s[i];
        if (in_str) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_str = false;
            continue;
        }
        if (c == '"') {
            in_str = true;
        } else if (c == '{' || c == '[') {
            if (++depth > DEFN_MAX_DEPTH) return i;
        } else if (c == '}' || c == ']') {
            depth--;
        }
    }
    return len;
}

static int as_invalid(int rc) {
    return rc != 0 ? rc : DEFN_INVALID;
}

static int pre_checks(const char *json, size_t len, defn_violations *out) {
    if (len > DEFN_MAX_BYTES)
        return as_invalid(defn__add(out, "", "definition is %zu bytes; the limit is %u bytes", len,
                                    DEFN_MAX_BYTES));
    size_t bad = defn__utf8_check((const unsigned char *)json, len);
    if (bad != len)
        return as_invalid(defn__add(out, "", "definition is not valid UTF-8 (byte %zu)", bad));
    size_t deep = depth_scan(json, len);
    if (deep != len)
        return as_invalid(defn__add(out, "", "definition nests deeper than %d levels (byte %zu)",
                                    DEFN_MAX_DEPTH, deep));
    return DEFN_OK;
}

static int parse(const char *json, size_t len, cJSON **doc, defn_violations *out) {
    const char *end = NULL;
    *doc = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!*doc) {
        size_t at = end && end >= json ? (size_t)(end - json) : 0;
        return as_invalid(defn__add(out, "", "definition is not valid JSON (byte %zu)", at));
    }
    /* cJSON stops after the first value; anything but whitespace after it is an error. */
    size_t at = (size_t)(end - json);
    while (at < len && (json[at] == ' ' || json[at] == '\t' || json[at] == '\n' ||
                        json[at] == '\r' || json[at] == '\0'))
        at++;
    if (at < len) {
        cJSON_Delete(*doc);
        *doc = NULL;
        return as_invalid(defn__add(
            out, "", "definition is not valid JSON: text after the document (byte %zu)", at));
    }
    return DEFN_OK;
}

typedef struct {
    const cJSON *m;
    size_t pos;
} member_ref;

static int cmp_members(const void *a, const void *b) {
    const member_ref *x = a, *y = b;
    int c = strcmp(x->m->string, y->m->string);
    if (c != 0) return c;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

static int cmp_pos(const void *a, const void *b) {
    const member_ref *x = a, *y = b;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Reports every repeated member name of one object at its later occurrences, in document
 * order. Sorting keeps this O(n log n) however many members an object has. */
static int report_duplicates(const cJSON *node, defn__ptr *ptr, defn_violations *out) {
    size_t n = (size_t)cJSON_GetArraySize(node), i = 0, ndup = 0;
    member_ref *m = malloc(n * sizeof(*m));
    if (!m) return DEFN_ERR_NOMEM;
    for (const cJSON *c = node->child; c; c = c->next, i++)
        m[i] = (member_ref){c, i};
    qsort(m, n, sizeof(*m), cmp_members);
    for (i = 1; i < n; i++)
        if (strcmp(m[i].m->string, m[i - 1].m->string) == 0) m[ndup++] = m[i];
    qsort(m, ndup, sizeof(*m), cmp_pos);
    int rc = 0;
    for (i = 0; i < ndup && rc == 0; i++) {
        size_t mark = defn__ptr_push_key(ptr, m[i].m->string);
        if (mark == (size_t)-1) {
            rc = DEFN_ERR_NOMEM;
            break;
        }
        rc = defn__add(out, ptr->buf, "duplicate property \"%s\"", m[i].m->string);
        defn__ptr_pop(ptr, mark);
    }
    free(m);
    return rc;
}

/* JSON parsers disagree on repeated member names (first or last wins); the builder and the
 * engine must read one meaning, so a repeated name is refused. */
static int check_duplicates(const cJSON *node, defn__ptr *ptr, defn_violations *out) {
    int rc = 0;
    if (cJSON_IsObject(node) && node->child && node->child->next) {
        /* Small objects (nearly all of a definition) are checked pairwise without allocating;
         * only when a repeat exists, or the object is large, is it sorted. */
        size_t n = 0;
        bool dup = false;
        for (const cJSON *a = node->child; a && !dup && n <= 16; a = a->next, n++)
            for (const cJSON *b = node->child; b != a && !dup; b = b->next)
                dup = strcmp(a->string, b->string) == 0;
        if (dup || n > 16) rc = report_duplicates(node, ptr, out);
    }
    size_t idx = 0;
    for (const cJSON *c = node->child; c && rc == 0; c = c->next, idx++) {
        if (!cJSON_IsObject(c) && !cJSON_IsArray(c)) continue;
        size_t mark = cJSON_IsObject(node) ? defn__ptr_push_key(ptr, c->string)
                                           : defn__ptr_push_index(ptr, idx);
        if (mark == (size_t)-1) return DEFN_ERR_NOMEM;
        rc = check_duplicates(c, ptr, out);
        defn__ptr_pop(ptr, mark);
    }
    return rc;
}

int defn_validate(const defn_ctx *ctx, const char *json, size_t len, defn_violations *out) {
    if (!ctx || !json || !out) return DEFN_ERR_ARG;
    cJSON *doc = NULL;
    size_t before = out->n;
    int rc = pre_checks(json, len, out);
    if (rc == DEFN_OK) rc = parse(json, len, &doc, out);
    if (rc == DEFN_OK) {
        defn__ptr ptr;
        rc = defn__ptr_init(&ptr);
        if (rc == 0) rc = check_duplicates(doc, &ptr, out);
        if (ptr.buf) defn__ptr_free(&ptr);
        if (rc == 0 && out->n > before) rc = DEFN_INVALID;
    }
    if (rc == DEFN_OK) rc = defn__schema_validate(ctx->schema, doc, out);
    if (rc == DEFN_OK) rc = defn__semantic_check(ctx, doc, out);
    cJSON_Delete(doc);
    if (rc >= 0 && defn__add_overflow_note(out) != 0) rc = DEFN_ERR_NOMEM;
    return rc;
}

/* ---- wire form ---- */

size_t defn_violations_summary(const defn_violations *v, char *buf, size_t buflen) {
    if (!buflen) return 0;
    int n;
    if (!v || v->n == 0) {
        n = snprintf(buf, buflen, "workflow definition is valid");
    } else {
        const defn_violation *f = &v->items[0];
        size_t more = v->n - 1 + v->dropped;
        n = snprintf(buf, buflen, "invalid workflow definition: %s: %s",
                     f->instance_location[0] ? f->instance_location : "(root)", f->message);
        if (n >= 0 && (size_t)n < buflen && more)
            n += snprintf(buf + n, buflen - (size_t)n, " (and %zu more %s)", more,
                          more == 1 ? "violation" : "violations");
    }
    if (n < 0) {
        buf[0] = '\0';
        return 0;
    }
    return (size_t)n < buflen ? (size_t)n : buflen - 1;
}
