/* See script.h. JSON objects become protobuf-c messages through the generated descriptors, so
 * a directive's fields are exactly the proto field names of its arm (a typo is "unknown
 * field", a wrong type names the expected one). All memory of a parsed script lives in one
 * arena (plus the google.protobuf.Struct trees pbjson builds on the heap, listed for release),
 * freed by dw_script_free. */
#include "script.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "google/protobuf/struct.pb-c.h"
#include "google/protobuf/timestamp.pb-c.h"
#include "pbjson.h"
#include "util.h"

#define ARENA_CHUNK 16384
#define MAX_NEST 16 /* nesting of messages inside one directive */

typedef struct chunk {
    struct chunk *next;
    size_t used, cap;
    _Alignas(max_align_t) unsigned char data[];
} chunk;

struct dw_script {
    chunk *arena;
    Google__Protobuf__Struct **structs; /* heap trees from pbjson, released at free */
    size_t n_structs, cap_structs;
    dw_op *ops;
    size_t n_ops;
};

/* Parsing context: where we are, for error messages. */
typedef struct pctx {
    dw_script *s;
    int index;       /* element index */
    char path[256];  /* "tool_call.arguments" */
    char *err, *ptr; /* outputs */
    size_t errlen, ptrlen;
    int failed;    /* 1 = the message says out of memory */
    int hide_next; /* the next member name is implied (a shorthand array) */
} pctx;

/* ---------------------------------------------------------------- arena ---- */

static void *arena_alloc(dw_script *s, size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (s->arena == NULL || s->arena->cap - s->arena->used < n) {
        size_t cap = n > ARENA_CHUNK ? n : ARENA_CHUNK;
        chunk *c = malloc(sizeof *c + cap);
        if (c == NULL) return NULL;
        c->next = s->arena;
        c->used = 0;
        c->cap = cap;
        s->arena = c;
    }
    void *p = s->arena->data + s->arena->used;
    s->arena->used += n;
    memset(p, 0, n);
    return p;
}

static char *arena_strndup(dw_script *s, const char *p, size_t n) {
    char *d = arena_alloc(s, n + 1);
    if (d) {
        memcpy(d, p, n);
        d[n] = 0;
    }
    return d;
}

static char *arena_strdup(dw_script *s, const char *p) {
    return arena_strndup(s, p, strlen(p));
}

static int keep_struct(dw_script *s, Google__Protobuf__Struct *st) {
    if (s->n_structs == s->cap_structs) {
        size_t cap = s->cap_structs ? 2 * s->cap_structs : 8;
        void *p = realloc(s->structs, cap * sizeof *s->structs);
        if (p == NULL) return -1;
        s->structs = p;
        s->cap_structs = cap;
    }
    s->structs[s->n_structs++] = st;
    return 0;
}

void dw_script_free(dw_script *s) {
    if (s == NULL) return;
    for (size_t i = 0; i < s->n_structs; i++)
        pbjson_struct_free(s->structs[i]);
    free(s->structs);
    while (s->arena) {
        chunk *n = s->arena->next;
        free(s->arena);
        s->arena = n;
    }
    free(s);
}

const dw_op *dw_script_ops(const dw_script *s, size_t *n) {
    *n = s->n_ops;
    return s->ops;
}

/* ---------------------------------------------------------------- errors ---- */

/* Formats "script element N: <path>: <msg>" and the JSON pointer "/N/<path with / for .>". */
__attribute__((format(printf, 2, 3))) static int fail(pctx *c, const char *fmt, ...) {
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (c->index < 0)
        snprintf(c->err, c->errlen, "script: %s", msg);
    else if (c->path[0])
        snprintf(c->err, c->errlen, "script element %d: %s: %s", c->index, c->path, msg);
    else
        snprintf(c->err, c->errlen, "script element %d: %s", c->index, msg);
    if (c->ptrlen) {
        if (c->index < 0) {
            snprintf(c->ptr, c->ptrlen, "%s", "");
        } else {
            int n =
                snprintf(c->ptr, c->ptrlen, "/%d%s%s", c->index, c->path[0] ? "/" : "", c->path);
            for (int i = 0; i < n && (size_t)i < c->ptrlen; i++)
                if (c->ptr[i] == '.') c->ptr[i] = '/';
        }
    }
    return -1;
}

static int oom(pctx *c) {
    return fail(c, "out of memory");
}

/* Appends ".name" or "[i]" to the path; returns the previous length to restore. */
static size_t path_push(pctx *c, const char *name, int idx) {
    size_t len = strlen(c->path);
    if (name)
        snprintf(c->path + len, sizeof c->path - len, "%s%s", len ? "." : "", name);
    else
        snprintf(c->path + len, sizeof c->path - len, ".%d", idx);
    return len;
}

static void path_pop(pctx *c, size_t len) {
    c->path[len] = 0;
}

/* ---------------------------------------------------------------- JSON -> protobuf ---- */

static int from_json(pctx *c, const cJSON *j, const ProtobufCMessageDescriptor *d, int depth,
                     ProtobufCMessage **out);

static const char *type_name(const cJSON *j) {
    if (cJSON_IsObject(j)) return "an object";
    if (cJSON_IsArray(j)) return "an array";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNull(j)) return "null";
    return "a number";
}

static int integral(pctx *c, const cJSON *j, double lo, double hi, double *v) {
    if (!cJSON_IsNumber(j)) return fail(c, "expected an integer, got %s", type_name(j));
    double d = j->valuedouble;
    if (!isfinite(d) || d != floor(d)) return fail(c, "expected an integer");
    if (d < lo || d > hi) return fail(c, "%.0f is out of range %.0f..%.0f", d, lo, hi);
    *v = d;
    return 0;
}

/* An enum value by its proto name ("AGENT_STATUS_THINKING"), by the name without the enum's
 * prefix ("THINKING", any case) or by number. */
static int enum_value(pctx *c, const cJSON *j, const ProtobufCEnumDescriptor *e, int *out) {
    if (cJSON_IsNumber(j)) {
        double v;
        if (integral(c, j, INT32_MIN, INT32_MAX, &v)) return -1;
        if (!protobuf_c_enum_descriptor_get_value(e, (int)v))
            return fail(c, "%.0f is not a %s value", v, e->name);
        *out = (int)v;
        return 0;
    }
    if (!cJSON_IsString(j)) return fail(c, "expected a %s name, got %s", e->name, type_name(j));
    const char *s = j->valuestring;
    size_t sl = strlen(s);
    for (unsigned i = 0; i < e->n_values; i++) {
        const char *n = e->values[i].name;
        size_t nl = strlen(n);
        if (strcasecmp(n, s) == 0 ||
            (nl > sl && n[nl - sl - 1] == '_' && strcasecmp(n + nl - sl, s) == 0)) {
            *out = e->values[i].value;
            return 0;
        }
    }
    return fail(c, "unknown %s \"%.64s\"", e->name, s);
}

static int set_scalar(pctx *c, const cJSON *j, const ProtobufCFieldDescriptor *f, int depth,
                      void *dst) {
    double v;
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
        if (integral(c, j, INT32_MIN, INT32_MAX, &v)) return -1;
        *(int32_t *)dst = (int32_t)v;
        return 0;
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        if (integral(c, j, 0, UINT32_MAX, &v)) return -1;
        *(uint32_t *)dst = (uint32_t)v;
        return 0;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
        if (integral(c, j, -9007199254740992.0, 9007199254740992.0, &v)) return -1;
        *(int64_t *)dst = (int64_t)v;
        return 0;
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        if (integral(c, j, 0, 9007199254740992.0, &v)) return -1;
        *(uint64_t *)dst = (uint64_t)v;
        return 0;
    case PROTOBUF_C_TYPE_BOOL:
        if (!cJSON_IsBool(j)) return fail(c, "expected a boolean, got %s", type_name(j));
        *(protobuf_c_boolean *)dst = cJSON_IsTrue(j);
        return 0;
    case PROTOBUF_C_TYPE_DOUBLE:
    case PROTOBUF_C_TYPE_FLOAT:
        if (!cJSON_IsNumber(j) || !isfinite(j->valuedouble))
            return fail(c, "expected a number, got %s", type_name(j));
        if (f->type == PROTOBUF_C_TYPE_DOUBLE)
            *(double *)dst = j->valuedouble;
        else
            *(float *)dst = (float)j->valuedouble;
        return 0;
    case PROTOBUF_C_TYPE_ENUM: {
        int e = 0;
        if (enum_value(c, j, f->descriptor, &e)) return -1;
        *(int *)dst = e;
        return 0;
    }
    case PROTOBUF_C_TYPE_STRING:
        if (!cJSON_IsString(j)) return fail(c, "expected a string, got %s", type_name(j));
        if (!util_utf8_valid(j->valuestring)) return fail(c, "not valid UTF-8");
        if (!(*(char **)dst = arena_strdup(c->s, j->valuestring))) return oom(c);
        return 0;
    case PROTOBUF_C_TYPE_BYTES: {
        /* bytes: a string is taken as its UTF-8 bytes; an object or array as its compact JSON
         * text (question_spec, pending_tool_intent are JSON documents on the wire) */
        ProtobufCBinaryData *b = dst;
        if (cJSON_IsString(j)) {
            b->len = strlen(j->valuestring);
            if (!(b->data = (uint8_t *)arena_strdup(c->s, j->valuestring))) return oom(c);
            return 0;
        }
        if (!cJSON_IsObject(j) && !cJSON_IsArray(j))
            return fail(c, "expected a string, an object or an array, got %s", type_name(j));
        char *txt = cJSON_PrintUnformatted(j);
        if (txt == NULL) return oom(c);
        b->len = strlen(txt);
        b->data = (uint8_t *)arena_strdup(c->s, txt);
        cJSON_free(txt);
        return b->data ? 0 : oom(c);
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessageDescriptor *md = f->descriptor;
        if (md == &google__protobuf__timestamp__descriptor) {
            Google__Protobuf__Timestamp *ts = arena_alloc(c->s, sizeof *ts);
            if (ts == NULL) return oom(c);
            if (!cJSON_IsString(j) || pbjson_ts_parse_rfc3339(j->valuestring, ts) != 0)
                return fail(c, "expected an RFC 3339 timestamp string");
            *(ProtobufCMessage **)dst = &ts->base;
            return 0;
        }
        if (md == &google__protobuf__struct__descriptor) {
            Google__Protobuf__Struct *st = NULL;
            char e[200];
            if (!cJSON_IsObject(j)) return fail(c, "expected an object, got %s", type_name(j));
            if (pbjson_struct_from_json(j, &st, e, sizeof e) != 0) return fail(c, "%s", e);
            if (keep_struct(c->s, st) != 0) {
                pbjson_struct_free(st);
                return oom(c);
            }
            *(ProtobufCMessage **)dst = &st->base;
            return 0;
        }
        return from_json(c, j, md, depth + 1, (ProtobufCMessage **)dst);
    }
    default:
        return fail(c, "unsupported field type");
    }
}

static size_t elem_size(const ProtobufCFieldDescriptor *f) {
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        return 4;
    case PROTOBUF_C_TYPE_FLOAT:
        return sizeof(float);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return 8;
    case PROTOBUF_C_TYPE_DOUBLE:
        return sizeof(double);
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_ENUM:
        return sizeof(int);
    case PROTOBUF_C_TYPE_STRING:
        return sizeof(char *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(void *);
    }
    return sizeof(void *);
}

/* A message whose only field is repeated (StructuredAnswerRow.cells) may be written as that
 * array: rows: [["a", "b"], …]. */
static const cJSON *unwrap_single(const cJSON *j, const ProtobufCMessageDescriptor *d,
                                  cJSON **tmp) {
    *tmp = NULL;
    if (!cJSON_IsArray(j) || d->n_fields != 1 || d->fields[0].label != PROTOBUF_C_LABEL_REPEATED)
        return j;
    cJSON *o = cJSON_CreateObject();
    cJSON *dup = cJSON_Duplicate(j, 1);
    if (!o || !dup || !cJSON_AddItemToObject(o, d->fields[0].name, dup)) {
        cJSON_Delete(o);
        cJSON_Delete(dup);
        return j;
    }
    *tmp = o;
    return o;
}

static int set_field(pctx *c, const cJSON *j, const ProtobufCFieldDescriptor *f, int depth,
                     ProtobufCMessage *m) {
    char *base = (char *)m;
    if (f->label == PROTOBUF_C_LABEL_REPEATED) {
        if (!cJSON_IsArray(j)) return fail(c, "expected an array, got %s", type_name(j));
        int n = cJSON_GetArraySize(j), i = 0;
        size_t es = elem_size(f);
        char *arr = arena_alloc(c->s, (n ? (size_t)n : 1) * es);
        if (arr == NULL) return oom(c);
        const cJSON *it;
        cJSON_ArrayForEach(it, j) {
            size_t mark = path_push(c, NULL, i);
            cJSON *tmp = NULL;
            const cJSON *v = it;
            if (f->type == PROTOBUF_C_TYPE_MESSAGE) v = unwrap_single(it, f->descriptor, &tmp);
            c->hide_next = tmp != NULL; /* errors point into what the author wrote */
            int rc = set_scalar(c, v, f, depth, arr + (size_t)i * es);
            cJSON_Delete(tmp);
            if (rc) return -1;
            path_pop(c, mark);
            i++;
        }
        *(size_t *)(base + f->quantifier_offset) = (size_t)n;
        *(void **)(base + f->offset) = arr;
        return 0;
    }
    if (cJSON_IsNull(j)) return 0; /* null = the default */
    if (set_scalar(c, j, f, depth, base + f->offset)) return -1;
    if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF)
        *(uint32_t *)(base + f->quantifier_offset) = f->id;
    else if (f->label == PROTOBUF_C_LABEL_OPTIONAL && f->type != PROTOBUF_C_TYPE_MESSAGE &&
             f->type != PROTOBUF_C_TYPE_STRING)
        *(protobuf_c_boolean *)(base + f->quantifier_offset) = 1;
    return 0;
}

static int from_json(pctx *c, const cJSON *j, const ProtobufCMessageDescriptor *d, int depth,
                     ProtobufCMessage **out) {
    if (depth > MAX_NEST) return fail(c, "nested deeper than %d levels", MAX_NEST);
    if (!cJSON_IsObject(j)) return fail(c, "expected an object, got %s", type_name(j));
    ProtobufCMessage *m = arena_alloc(c->s, d->sizeof_message);
    if (m == NULL) return oom(c);
    d->message_init(m);
    const cJSON *it;
    cJSON_ArrayForEach(it, j) {
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field_by_name(d, it->string);
        size_t mark = strlen(c->path);
        if (c->hide_next)
            c->hide_next = 0;
        else
            path_push(c, it->string, 0);
        if (f == NULL) return fail(c, "unknown field (%s has no field of that name)", d->name);
        if (set_field(c, it, f, depth, m)) return -1;
        path_pop(c, mark);
    }
    *out = m;
    return 0;
}

/* ---------------------------------------------------------------- directives ---- */

typedef struct directive {
    const char *name; /* key in the script */
    const char *arm;  /* ExecuteStepEvent field, NULL for control directives */
    dw_op_kind kind;
} directive;

static const directive directives[] = {
    {"token", "token", DW_OP_TOKEN},
    {"tokens", "token", DW_OP_TOKENS},
    {"status", "status", DW_OP_EVENT},
    {"tool_call", "tool_call", DW_OP_EVENT},
    {"tool_result", "tool_result", DW_OP_EVENT},
    {"structured_answer", "structured_answer", DW_OP_EVENT},
    {"write_confirm", "write_confirm", DW_OP_EVENT},
    {"metrics", "metrics", DW_OP_EVENT},
    {"security", "security", DW_OP_EVENT},
    {"step_progress", "step_progress", DW_OP_EVENT},
    {"decomposition", "decomposition", DW_OP_EVENT},
    {"interrupt", "interrupt_required", DW_OP_EVENT},
    {"ask_user", "input_required", DW_OP_EVENT},
    {"error", "error", DW_OP_EVENT},
    {"complete", "completion", DW_OP_EVENT},
    {"checkpoint", "checkpoint", DW_OP_CHECKPOINT},
    {"sleep_ms", NULL, DW_OP_SLEEP},
    {"hang", NULL, DW_OP_HANG},
    {"crash", NULL, DW_OP_CRASH},
    {"inspect", NULL, DW_OP_INSPECT},
    {"fail", NULL, DW_OP_FAIL},
};
#define N_DIRECTIVES (sizeof directives / sizeof directives[0])

static const directive *find_directive(const char *name) {
    for (size_t i = 0; i < N_DIRECTIVES; i++)
        if (strcmp(directives[i].name, name) == 0) return &directives[i];
    return NULL;
}

/* The payload normalised into the arm's JSON object (shorthands expanded); *owned is set when
 * a new tree was built (the caller deletes it). */
static const cJSON *normalise(pctx *c, const directive *d, const cJSON *v, cJSON **owned) {
    *owned = NULL;
    if (strcmp(d->name, "status") == 0 && (cJSON_IsString(v) || cJSON_IsNumber(v))) {
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddItemToObject(o, "status", cJSON_Duplicate(v, 1))) goto nomem;
        return *owned = o;
    }
    if (strcmp(d->name, "complete") == 0 && cJSON_IsString(v)) {
        cJSON *o = cJSON_CreateObject();
        if (!o || !cJSON_AddStringToObject(o, "final_response", v->valuestring)) goto nomem;
        return *owned = o;
    }
    if (strcmp(d->name, "decomposition") == 0) {
        /* an array of todos; a todo may be its title alone; ordering defaults to its index */
        if (!cJSON_IsArray(v)) {
            fail(c, "expected an array of todos, got %s", type_name(v));
            return NULL;
        }
        cJSON *o = cJSON_CreateObject(), *arr = cJSON_CreateArray();
        if (!o || !arr || !cJSON_AddItemToObject(o, "todos", arr)) {
            cJSON_Delete(arr);
            goto nomem;
        }
        *owned = o;
        int i = 0;
        const cJSON *t;
        cJSON_ArrayForEach(t, v) {
            cJSON *todo = cJSON_IsString(t) ? cJSON_CreateObject() : cJSON_Duplicate(t, 1);
            if (!todo) goto nomem;
            cJSON_AddItemToArray(arr, todo);
            if (cJSON_IsString(t) && !cJSON_AddStringToObject(todo, "title", t->valuestring))
                goto nomem;
            if (cJSON_IsObject(todo) && !cJSON_GetObjectItemCaseSensitive(todo, "ordering"))
                cJSON_AddNumberToObject(todo, "ordering", i);
            i++;
        }
        return o;
    }
    if (strcmp(d->name, "tool_result") == 0 && cJSON_IsObject(v)) {
        /* a non-string result is the tool's JSON output: carried as its compact text */
        const cJSON *r = cJSON_GetObjectItemCaseSensitive(v, "result");
        if (r && !cJSON_IsString(r) && !cJSON_IsNull(r)) {
            cJSON *o = cJSON_Duplicate(v, 1);
            char *txt = cJSON_PrintUnformatted(r);
            if (!o || !txt) {
                cJSON_Delete(o);
                cJSON_free(txt);
                goto nomem;
            }
            cJSON_ReplaceItemInObjectCaseSensitive(o, "result", cJSON_CreateString(txt));
            cJSON_free(txt);
            return *owned = o;
        }
    }
    return v;
nomem:
    cJSON_Delete(*owned);
    *owned = NULL;
    oom(c);
    return NULL;
}

static int has(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return v && !cJSON_IsNull(v) && !(cJSON_IsString(v) && v->valuestring[0] == 0);
}

static unsigned default_flags(const directive *d, const cJSON *o) {
    unsigned f = 0;
    const char *n = d->name;
    if (strcmp(n, "status") == 0 && !has(o, "timestamp")) f |= DW_F_TIMESTAMP;
    if (strcmp(n, "complete") == 0) {
        if (!has(o, "token_usage")) f |= DW_F_USAGE;
        if (!has(o, "loop_iterations")) f |= DW_F_ITERATIONS;
        if (!has(o, "duration_ms")) f |= DW_F_DURATION;
    }
    if (strcmp(n, "tool_call") == 0 || strcmp(n, "interrupt") == 0 || strcmp(n, "ask_user") == 0) {
        if (!has(o, "tool_call_id")) f |= DW_F_CALL_ID;
    }
    if (strcmp(n, "interrupt") == 0 || strcmp(n, "ask_user") == 0) {
        if (!has(o, "idempotency_key")) f |= DW_F_IDEM_KEY;
    }
    if (strcmp(n, "ask_user") == 0 && !has(o, "checkpoint")) f |= DW_F_ASK_CKPT;
    if (strcmp(n, "tool_result") == 0) {
        if (!has(o, "tool_call_id")) f |= DW_F_RESULT_ID;
        if (!has(o, "tool_name")) f |= DW_F_RESULT_NAME;
    }
    if (strcmp(n, "metrics") == 0 && !has(o, "model")) f |= DW_F_METRICS;
    return f;
}

static int parse_event(pctx *c, const directive *d, const cJSON *v, dw_op *op) {
    const ProtobufCMessageDescriptor *ed = &upsquad__runtime__v1__execute_step_event__descriptor;
    const ProtobufCFieldDescriptor *arm =
        protobuf_c_message_descriptor_get_field_by_name(ed, d->arm);
    cJSON *owned = NULL;
    ProtobufCMessage *payload = NULL;
    int rc = -1;
    const cJSON *o = normalise(c, d, v, &owned);
    if (o == NULL) return -1;
    if (!cJSON_IsObject(o)) {
        fail(c, "expected an object, got %s", type_name(o));
        goto done;
    }
    if (strcmp(d->name, "ask_user") == 0 && !has(o, "tool_name")) {
        /* the built-in elicitation tool: always "ask_user" */
        if (owned == NULL && !(owned = cJSON_Duplicate(o, 1))) {
            oom(c);
            goto done;
        }
        cJSON_DeleteItemFromObjectCaseSensitive(owned, "tool_name");
        cJSON_AddStringToObject(owned, "tool_name", "ask_user");
        o = owned;
    }
    if (from_json(c, o, arm->descriptor, 0, &payload)) goto done;
    DwEvent *ev = arena_alloc(c->s, sizeof *ev);
    if (ev == NULL) {
        oom(c);
        goto done;
    }
    upsquad__runtime__v1__execute_step_event__init(ev);
    *(ProtobufCMessage **)((char *)ev + arm->offset) = payload;
    *(uint32_t *)((char *)ev + arm->quantifier_offset) = arm->id;
    op->ev = ev;
    op->flags = default_flags(d, o);
    op->ends_step = strcmp(d->name, "interrupt") == 0 || strcmp(d->name, "ask_user") == 0;
    rc = 0;
done:
    cJSON_Delete(owned);
    return rc;
}

static int parse_true(pctx *c, const cJSON *v) {
    if (!cJSON_IsTrue(v)) return fail(c, "expected true");
    return 0;
}

static const char *const grpc_codes[] = {
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
};

/* {"code": "UNAVAILABLE" | 14, "message": "…"}: any status but OK. */
static int parse_fail(pctx *c, const cJSON *v, dw_op *op) {
    const cJSON *it;
    if (!cJSON_IsObject(v)) return fail(c, "expected an object {\"code\", \"message\"}");
    op->code = -1;
    op->text = "failed by script";
    cJSON_ArrayForEach(it, v) {
        size_t mark = path_push(c, it->string, 0);
        if (strcmp(it->string, "code") == 0) {
            double d;
            if (cJSON_IsString(it)) {
                for (int i = 1; i <= 16; i++)
                    if (strcasecmp(grpc_codes[i], it->valuestring) == 0) op->code = i;
                if (op->code < 0) return fail(c, "unknown gRPC status \"%.40s\"", it->valuestring);
            } else {
                if (integral(c, it, 1, 16, &d)) return -1;
                op->code = (int)d;
            }
        } else if (strcmp(it->string, "message") == 0) {
            if (!cJSON_IsString(it)) return fail(c, "expected a string, got %s", type_name(it));
            if (!(op->text = arena_strdup(c->s, it->valuestring))) return oom(c);
        } else {
            return fail(c, "unknown field (a fail takes \"code\" and \"message\")");
        }
        path_pop(c, mark);
    }
    if (op->code < 0) {
        path_push(c, "code", 0);
        return fail(c, "required (a gRPC status other than OK)");
    }
    return 0;
}

static int parse_element(pctx *c, const cJSON *el, dw_op *op) {
    const cJSON *it, *dkey = NULL, *delay = NULL;
    const directive *d = NULL;
    if (!cJSON_IsObject(el))
        return fail(c, "expected an object with one directive, got %s", type_name(el));
    cJSON_ArrayForEach(it, el) {
        if (strcmp(it->string, "delay_ms") == 0) {
            delay = it;
            continue;
        }
        if (strcmp(it->string, "if_worker") == 0 || strcmp(it->string, "unless_worker") == 0) {
            const char **dst = it->string[0] == 'i' ? &op->if_worker : &op->unless_worker;
            path_push(c, it->string, 0);
            if (!cJSON_IsString(it) || !it->valuestring[0])
                return fail(c, "expected a worker id or address");
            if (!(*dst = arena_strdup(c->s, it->valuestring))) return oom(c);
            path_pop(c, 0);
            continue;
        }
        if (strcmp(it->string, "first_runs") == 0) {
            double v;
            path_push(c, it->string, 0);
            if (integral(c, it, 1, 1000000, &v)) return -1;
            path_pop(c, 0);
            op->first_runs = (long long)v;
            continue;
        }
        const directive *x = find_directive(it->string);
        if (x == NULL) return fail(c, "unknown directive \"%.64s\"", it->string);
        if (d != NULL)
            return fail(c, "more than one directive (\"%s\" and \"%s\"); write one per element",
                        d->name, x->name);
        d = x;
        dkey = it;
    }
    if (d == NULL)
        return fail(c, "no directive (an element is an object such as {\"token\": \"hi\"})");
    if (delay && d->kind != DW_OP_TOKENS && d->kind != DW_OP_TOKEN) {
        path_push(c, "delay_ms", 0);
        return fail(c, "only allowed with \"tokens\" or \"token\"");
    }
    op->kind = d->kind;
    op->index = c->index;
    op->name = d->name;
    if (delay) {
        double v;
        path_push(c, "delay_ms", 0);
        if (integral(c, delay, 0, 60000, &v)) return -1;
        path_pop(c, 0);
        op->ms = (long long)v;
    }
    path_push(c, d->name, 0);
    switch (d->kind) {
    case DW_OP_TOKEN:
    case DW_OP_TOKENS:
        if (!cJSON_IsString(dkey)) return fail(c, "expected a string, got %s", type_name(dkey));
        if (!util_utf8_valid(dkey->valuestring)) return fail(c, "not valid UTF-8");
        if (!(op->text = arena_strdup(c->s, dkey->valuestring))) return oom(c);
        break;
    case DW_OP_SLEEP: {
        double v;
        if (integral(c, dkey, 0, 600000, &v)) return -1;
        op->ms = (long long)v;
        break;
    }
    case DW_OP_HANG:
    case DW_OP_CRASH:
    case DW_OP_INSPECT:
        if (parse_true(c, dkey)) return -1;
        break;
    case DW_OP_CHECKPOINT:
        op->flags = DW_F_CREATED;
        if (cJSON_IsObject(dkey)) {
            cJSON_ArrayForEach(it, dkey) {
                path_push(c, it->string, 0);
                if (strcmp(it->string, "state") != 0)
                    return fail(c, "unknown field (a checkpoint takes only \"state\")");
                if (!cJSON_IsString(it)) return fail(c, "expected a string, got %s", type_name(it));
                if (!(op->text = arena_strdup(c->s, it->valuestring))) return oom(c);
                path_pop(c, strlen(d->name));
            }
        } else if (parse_true(c, dkey)) {
            return fail(c, "expected true or {\"state\": \"…\"}");
        }
        break;
    case DW_OP_EVENT:
        if (parse_event(c, d, dkey, op)) return -1;
        break;
    case DW_OP_FAIL:
        if (parse_fail(c, dkey, op)) return -1;
        break;
    }
    path_pop(c, 0);
    return 0;
}

/* What may follow the script's array: nothing but white space, or context after a blank line
 * (a workflow agent step's goal reaches the worker followed by "\n\nInput: ..." and the
 * step's expected fields and feedback, which a script ignores). */
static int trailer_ok(const char *end) {
    int newlines = 0;
    for (const char *p = end; *p; p++) {
        if (*p == '\n') {
            if (++newlines == 2) return 1;
        } else if (*p != ' ' && *p != '\t' && *p != '\r') {
            return 0;
        }
    }
    return 1;
}

int dw_script_parse(const char *body, size_t max_elements, dw_script **out, char *err,
                    size_t errlen, char *pointer, size_t pointerlen) {
    pctx c = {.index = -1, .err = err, .errlen = errlen, .ptr = pointer, .ptrlen = pointerlen};
    cJSON *root = NULL;
    int rc = -1;
    if (pointerlen) pointer[0] = 0;
    if (!(c.s = calloc(1, sizeof *c.s))) {
        oom(&c);
        goto done;
    }
    const char *end = NULL;
    root = cJSON_ParseWithOpts(body, &end, 0);
    if (root == NULL) {
        const char *at = cJSON_GetErrorPtr();
        long off = (at && at >= body) ? (long)(at - body) : 0;
        fail(&c, "not valid JSON (near byte %ld of the script)", off);
        goto done;
    }
    if (!trailer_ok(end)) {
        fail(&c,
             "not valid JSON (text after the array at byte %ld of the script; context "
             "after a script must follow a blank line)",
             (long)(end - body));
        goto done;
    }
    if (!cJSON_IsArray(root)) {
        fail(&c, "expected a JSON array of directives, got %s", type_name(root));
        goto done;
    }
    size_t n = (size_t)cJSON_GetArraySize(root);
    if (n > max_elements) {
        fail(&c, "%zu elements; at most %zu", n, max_elements);
        goto done;
    }
    if (!(c.s->ops = arena_alloc(c.s, (n ? n : 1) * sizeof *c.s->ops))) {
        oom(&c);
        goto done;
    }
    const cJSON *el;
    cJSON_ArrayForEach(el, root) {
        c.index = (int)c.s->n_ops;
        c.path[0] = 0;
        if (parse_element(&c, el, &c.s->ops[c.s->n_ops])) goto done;
        c.s->n_ops++;
    }
    *out = c.s;
    c.s = NULL;
    rc = 0;
done:
    cJSON_Delete(root);
    dw_script_free(c.s);
    return rc;
}

/* ---------------------------------------------------------------- text ---- */

int dw_script_detect(const char *msg, const char **body) {
    static const char magic[] = "#!script";
    if (strncmp(msg, magic, sizeof magic - 1) != 0) return 0;
    const char *p = msg + sizeof magic - 1;
    while (*p == ' ' || *p == '\t' || *p == '\r')
        p++;
    if (*p != '\n' && *p != 0) return 0;
    *body = *p ? p + 1 : p;
    return 1;
}

size_t dw_next_token(const char *t) {
    const char *p = t;
    while (*p && isspace((unsigned char)*p))
        p++;
    while (*p && !isspace((unsigned char)*p))
        p++;
    /* trailing whitespace at the end of the text joins the last token */
    const char *q = p;
    while (*q && isspace((unsigned char)*q))
        q++;
    if (*q == 0) p = q;
    return (size_t)(p - t);
}

long dw_word_count(const char *t) {
    long n = 0;
    const char *p = t;
    while (*p) {
        while (*p && isspace((unsigned char)*p))
            p++;
        if (!*p) break;
        n++;
        while (*p && !isspace((unsigned char)*p))
            p++;
    }
    return n;
}
