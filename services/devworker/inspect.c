/* See inspect.h. */
#include "inspect.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "auth_claims.h"
#include "google/protobuf/struct.pb-c.h"
#include "google/protobuf/timestamp.pb-c.h"
#include "ids.h"
#include "pbjson.h"
#include "util.h"

static cJSON *bytes_json(const ProtobufCBinaryData *b) {
    char *s = malloc(b->len + 1);
    cJSON *out = NULL;
    if (s == NULL) return NULL;
    memcpy(s, b->data, b->len);
    s[b->len] = 0;
    if (memchr(b->data, 0, b->len) == NULL && util_utf8_valid(s)) {
        out = cJSON_CreateString(s);
    } else {
        char *b64 = malloc(4 * ((b->len + 2) / 3) + 1);
        if (b64) {
            EVP_EncodeBlock((unsigned char *)b64, b->data, (int)b->len);
            out = cJSON_CreateString(b64);
        }
        free(b64);
    }
    free(s);
    return out;
}

static int is_default(const ProtobufCFieldDescriptor *f, const void *p) {
    switch (f->type) {
    case PROTOBUF_C_TYPE_STRING: {
        const char *s = *(char *const *)p;
        return s == NULL || s[0] == 0;
    }
    case PROTOBUF_C_TYPE_BYTES:
        return ((const ProtobufCBinaryData *)p)->len == 0;
    case PROTOBUF_C_TYPE_MESSAGE:
        return *(void *const *)p == NULL;
    case PROTOBUF_C_TYPE_DOUBLE:
        return *(const double *)p == 0.0;
    case PROTOBUF_C_TYPE_FLOAT:
        return *(const float *)p == 0.0f;
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return *(const uint64_t *)p == 0;
    case PROTOBUF_C_TYPE_BOOL:
        return *(const protobuf_c_boolean *)p == 0;
    default:
        return *(const uint32_t *)p == 0; /* 32-bit ints and enums */
    }
}

static cJSON *value_json(const ProtobufCFieldDescriptor *f, const void *p) {
    switch (f->type) {
    case PROTOBUF_C_TYPE_STRING:
        return cJSON_CreateString(*(char *const *)p ? *(char *const *)p : "");
    case PROTOBUF_C_TYPE_BYTES:
        return bytes_json(p);
    case PROTOBUF_C_TYPE_BOOL:
        return cJSON_CreateBool(*(const protobuf_c_boolean *)p);
    case PROTOBUF_C_TYPE_DOUBLE:
        return cJSON_CreateNumber(*(const double *)p);
    case PROTOBUF_C_TYPE_FLOAT:
        return cJSON_CreateNumber(*(const float *)p);
    case PROTOBUF_C_TYPE_INT32:
    case PROTOBUF_C_TYPE_SINT32:
    case PROTOBUF_C_TYPE_SFIXED32:
        return cJSON_CreateNumber(*(const int32_t *)p);
    case PROTOBUF_C_TYPE_UINT32:
    case PROTOBUF_C_TYPE_FIXED32:
        return cJSON_CreateNumber(*(const uint32_t *)p);
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
        return cJSON_CreateNumber((double)*(const int64_t *)p);
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return cJSON_CreateNumber((double)*(const uint64_t *)p);
    case PROTOBUF_C_TYPE_ENUM: {
        const ProtobufCEnumValue *v =
            protobuf_c_enum_descriptor_get_value(f->descriptor, *(const int *)p);
        return v ? cJSON_CreateString(v->name) : cJSON_CreateNumber(*(const int *)p);
    }
    case PROTOBUF_C_TYPE_MESSAGE: {
        const ProtobufCMessage *m = *(ProtobufCMessage *const *)p;
        if (m == NULL) return cJSON_CreateNull();
        if (m->descriptor == &google__protobuf__struct__descriptor)
            return pbjson_struct_to_json((const Google__Protobuf__Struct *)m);
        if (m->descriptor == &google__protobuf__timestamp__descriptor) {
            char buf[PBJSON_TS_MAX];
            if (pbjson_ts_to_rfc3339((const Google__Protobuf__Timestamp *)m, buf, sizeof buf))
                return cJSON_CreateNull();
            return cJSON_CreateString(buf);
        }
        return dw_pb_to_json(m);
    }
    }
    return cJSON_CreateNull();
}

static size_t elem_size(const ProtobufCFieldDescriptor *f) {
    switch (f->type) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
        return 8;
    case PROTOBUF_C_TYPE_DOUBLE:
        return sizeof(double);
    case PROTOBUF_C_TYPE_STRING:
    case PROTOBUF_C_TYPE_MESSAGE:
        return sizeof(void *);
    case PROTOBUF_C_TYPE_BYTES:
        return sizeof(ProtobufCBinaryData);
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    case PROTOBUF_C_TYPE_ENUM:
        return sizeof(int);
    default:
        return 4;
    }
}

/* map<K, V> fields are repeated *Entry messages with fields key and value. */
static int is_map_entry(const ProtobufCFieldDescriptor *f) {
    const ProtobufCMessageDescriptor *d = f->descriptor;
    size_t n;
    if (f->type != PROTOBUF_C_TYPE_MESSAGE || d->n_fields != 2) return 0;
    n = strlen(d->name);
    return n > 5 && strcmp(d->name + n - 5, "Entry") == 0 &&
           strcmp(d->fields[0].name, "key") == 0 && strcmp(d->fields[1].name, "value") == 0;
}

static cJSON *repeated_json(const ProtobufCFieldDescriptor *f, const char *base) {
    size_t n = *(const size_t *)(base + f->quantifier_offset);
    const char *arr = *(char *const *)(base + f->offset);
    size_t es = elem_size(f);
    if (is_map_entry(f)) {
        cJSON *o = cJSON_CreateObject();
        const ProtobufCMessageDescriptor *d = f->descriptor;
        for (size_t i = 0; o && i < n; i++) {
            const char *e = *(char *const *)(arr + i * es);
            const char *key = *(char *const *)(e + d->fields[0].offset);
            cJSON_AddItemToObject(o, key ? key : "",
                                  value_json(&d->fields[1], e + d->fields[1].offset));
        }
        return o;
    }
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++)
        cJSON_AddItemToArray(a, value_json(f, arr + i * es));
    return a;
}

cJSON *dw_pb_to_json(const ProtobufCMessage *m) {
    const ProtobufCMessageDescriptor *d = m->descriptor;
    const char *base = (const char *)m;
    cJSON *o = cJSON_CreateObject();
    for (unsigned i = 0; o && i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            if (*(const size_t *)(base + f->quantifier_offset) == 0) continue;
            cJSON_AddItemToObject(o, f->name, repeated_json(f, base));
            continue;
        }
        if ((f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) &&
            *(const uint32_t *)(base + f->quantifier_offset) != f->id)
            continue;
        if (!(f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) && is_default(f, base + f->offset)) continue;
        cJSON_AddItemToObject(o, f->name, value_json(f, base + f->offset));
    }
    return o;
}

static cJSON *claims_json(const char *tok) {
    cJSON *c = auth_claims_decode(tok);
    return c ? c : cJSON_CreateString("(not a JWS)");
}

static void redact(cJSON *o, const Upsquad__Runtime__V1__ExecuteStepRequest *rq) {
    cJSON *keys = cJSON_GetObjectItemCaseSensitive(o, "provider_keys"), *it;
    cJSON_ArrayForEach(it, keys) {
        char hex[65], *v = cJSON_IsString(it) ? it->valuestring : "";
        ids_sha256_hex(v, strlen(v), hex);
        char buf[80];
        snprintf(buf, sizeof buf, "sha256:%s", hex);
        cJSON_SetValuestring(it, buf);
    }
    if (rq->agent_gateway_token && rq->agent_gateway_token[0])
        cJSON_ReplaceItemInObjectCaseSensitive(o, "agent_gateway_token",
                                               claims_json(rq->agent_gateway_token));
    if (rq->context_engine_token && rq->context_engine_token[0])
        cJSON_ReplaceItemInObjectCaseSensitive(o, "context_engine_token",
                                               claims_json(rq->context_engine_token));
}

char *dw_inspect_json(dw_worker *w, const Upsquad__Runtime__V1__ExecuteStepRequest *rq) {
    cJSON *o = cJSON_CreateObject(), *req = dw_pb_to_json(&rq->base), *wk = cJSON_CreateObject();
    char *txt = NULL;
    if (o && req && wk) {
        redact(req, rq);
        pthread_mutex_lock(&w->mu);
        cJSON_AddStringToObject(wk, "id", w->id);
        cJSON_AddStringToObject(wk, "addr", w->addr);
        pthread_mutex_unlock(&w->mu);
        cJSON_AddItemToObject(o, "worker", wk);
        cJSON_AddItemToObject(o, "request", req);
        wk = req = NULL;
        /* what InitWorkerSession restored here: a recovery's proof of continuity */
        dw_session_inits si;
        cJSON *ss = rq->session_id && dw_session_info(w, rq->session_id, &si)
                        ? cJSON_AddObjectToObject(o, "session")
                        : NULL;
        if (ss) {
            cJSON_AddNumberToObject(ss, "inits", si.inits);
            cJSON_AddNumberToObject(ss, "restored_loop", si.restored_loop);
            cJSON_AddNumberToObject(ss, "next_loop", si.next_iter);
        }
        txt = cJSON_PrintUnformatted(o);
    }
    cJSON_Delete(wk);
    cJSON_Delete(req);
    cJSON_Delete(o);
    return txt;
}
