/* gRPC server reflection (grpc.reflection.v1 and v1alpha ServerReflectionInfo), answered from a
 * serialized FileDescriptorSet (rpc_server_opts.descriptors; the build embeds the one of
 * proto/, compiled with --include_imports). protobuf-c keeps no FileDescriptorProtos, so the
 * set's wire bytes are the source: each file's bytes are sent as they are, and the few names a
 * lookup needs (file name, package, dependencies, message/enum/service/method names) are read
 * from the wire on demand. The two protocol versions are the same messages under two package
 * names: one handler, the v1 types, serves both paths. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/reflection/v1/reflection.pb-c.h"
#include "log.h"
#include "rpc_internal.h"

typedef Grpc__Reflection__V1__ServerReflectionRequest ReflReq;
typedef Grpc__Reflection__V1__ServerReflectionResponse ReflResp;

#define REFLECT_MAX_SERVICES 64

typedef struct span {
    const uint8_t *p;
    size_t n;
} span;

typedef struct refl_file {
    span bytes; /* the serialized FileDescriptorProto */
    span name, pkg;
} refl_file;

struct rpc__reflect {
    rpc_server *srv;
    refl_file *files;
    size_t n_files;
    atomic_int streams; /* open ServerReflectionInfo streams, bounded by max_reflection_streams */
};

/* ---- the wire, just enough of it ---- */

static int varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}

/* The next field of a message: 1 and its number (and, length-delimited, its bytes), 0 at the
 * end, -1 on bytes that are not a message (groups included: descriptors have none). */
static int field_next(const uint8_t **p, const uint8_t *end, uint32_t *num, span *val) {
    uint64_t key, v;
    if (*p >= end) return 0;
    if (varint(p, end, &key)) return -1;
    *num = (uint32_t)(key >> 3);
    val->p = NULL;
    val->n = 0;
    switch (key & 7) {
    case 0:
        return varint(p, end, &v) ? -1 : 1;
    case 1:
        if (end - *p < 8) return -1;
        *p += 8;
        return 1;
    case 5:
        if (end - *p < 4) return -1;
        *p += 4;
        return 1;
    case 2:
        if (varint(p, end, &v) || v > (uint64_t)(end - *p)) return -1;
        val->p = *p;
        val->n = (size_t)v;
        *p += v;
        return 1;
    default:
        return -1;
    }
}

static int span_is(span s, const char *str, size_t n) {
    return s.n == n && memcmp(s.p, str, n) == 0;
}

/* The string field `num` of a message (the first one), empty when absent. */
static span field_str(span msg, uint32_t num) {
    const uint8_t *p = msg.p, *end = msg.p + msg.n;
    uint32_t f;
    span v, none = {(const uint8_t *)"", 0};
    while (field_next(&p, end, &f, &v) == 1)
        if (f == num && v.p) return v;
    return none;
}

/* Whether the named element (`name`, field 1) of msg is `sym` itself, or, "name.rest", whether
 * its children in field `child` (and `child2`) define rest. */
static int defines(span msg, const char *sym, size_t n, int kind);

enum { K_MESSAGE, K_ENUM, K_SERVICE, K_METHOD };

static int children_define(span msg, const char *sym, size_t n, uint32_t f1, int k1, uint32_t f2,
                           int k2) {
    const uint8_t *p = msg.p, *end = msg.p + msg.n;
    uint32_t f;
    span v;
    while (field_next(&p, end, &f, &v) == 1) {
        if (f == f1 && v.p && defines(v, sym, n, k1)) return 1;
        if (f2 && f == f2 && v.p && defines(v, sym, n, k2)) return 1;
    }
    return 0;
}

static int defines(span msg, const char *sym, size_t n, int kind) {
    span name = field_str(msg, 1);
    if (span_is(name, sym, n)) return 1;
    if (kind == K_ENUM || kind == K_METHOD) return 0;
    if (n <= name.n + 1 || memcmp(sym, name.p, name.n) != 0 || sym[name.n] != '.') return 0;
    sym += name.n + 1;
    n -= name.n + 1;
    if (kind == K_SERVICE) return children_define(msg, sym, n, 2, K_METHOD, 0, 0);
    /* DescriptorProto: nested_type 3, enum_type 4 */
    return children_define(msg, sym, n, 3, K_MESSAGE, 4, K_ENUM);
}

static int file_defines(const refl_file *fl, const char *sym) {
    size_t n = strlen(sym);
    if (fl->pkg.n) {
        if (n <= fl->pkg.n + 1 || memcmp(sym, fl->pkg.p, fl->pkg.n) != 0 || sym[fl->pkg.n] != '.')
            return 0;
        sym += fl->pkg.n + 1;
        n -= fl->pkg.n + 1;
    }
    const uint8_t *p = fl->bytes.p, *end = fl->bytes.p + fl->bytes.n;
    uint32_t f;
    span v;
    /* FileDescriptorProto: message_type 4, enum_type 5, service 6 */
    while (field_next(&p, end, &f, &v) == 1) {
        if (!v.p) continue;
        if ((f == 4 && defines(v, sym, n, K_MESSAGE)) || (f == 5 && defines(v, sym, n, K_ENUM)) ||
            (f == 6 && defines(v, sym, n, K_SERVICE)))
            return 1;
    }
    return 0;
}

static long find_file(const rpc__reflect *r, const char *name, size_t n) {
    for (size_t i = 0; i < r->n_files; i++)
        if (span_is(r->files[i].name, name, n)) return (long)i;
    return -1;
}

/* ---- the index ---- */

static int index_set(rpc__reflect *r, const uint8_t *set, size_t len) {
    const uint8_t *p = set, *end = set + len;
    uint32_t f;
    span v;
    int rc;
    size_t cap = 0;
    while ((rc = field_next(&p, end, &f, &v)) == 1) {
        if (f != 1 || !v.p) continue; /* FileDescriptorSet.file */
        if (r->n_files == cap) {
            cap = cap ? cap * 2 : 32;
            refl_file *nf = realloc(r->files, cap * sizeof *nf);
            if (nf == NULL) return -1;
            r->files = nf;
        }
        refl_file *fl = &r->files[r->n_files++];
        fl->bytes = v;
        fl->name = field_str(v, 1);
        fl->pkg = field_str(v, 2);
    }
    return rc;
}

/* ---- answers ---- */

static void error_answer(ReflResp *out, Grpc__Reflection__V1__ErrorResponse *e, int code,
                         char *msg) {
    e->error_code = code;
    e->error_message = msg;
    out->message_response_case =
        GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ERROR_RESPONSE;
    out->error_response = e;
}

/* The file and the files it imports, transitively, each once, the asked-for one first (what
 * grpcurl and the reference servers send). *out is the caller's to free. */
static int file_closure(const rpc__reflect *r, size_t first, ProtobufCBinaryData **out, size_t *n) {
    size_t *order = malloc(r->n_files * sizeof *order);
    unsigned char *seen = calloc(r->n_files, 1);
    ProtobufCBinaryData *b = malloc(r->n_files * sizeof *b);
    int rc = -1;
    size_t k = 0;
    if (!order || !seen || !b) goto done;
    order[k++] = first;
    seen[first] = 1;
    for (size_t i = 0; i < k; i++) {
        const refl_file *fl = &r->files[order[i]];
        const uint8_t *p = fl->bytes.p, *end = fl->bytes.p + fl->bytes.n;
        uint32_t f;
        span v;
        while (field_next(&p, end, &f, &v) == 1) {
            if (f != 3 || !v.p) continue; /* dependency */
            long d = find_file(r, (const char *)v.p, v.n);
            if (d >= 0 && !seen[d]) {
                seen[d] = 1;
                order[k++] = (size_t)d;
            }
        }
    }
    for (size_t i = 0; i < k; i++) {
        b[i].data = (uint8_t *)r->files[order[i]].bytes.p; /* borrowed: the set outlives us */
        b[i].len = r->files[order[i]].bytes.n;
    }
    *out = b;
    *n = k;
    b = NULL;
    rc = 0;
done:
    free(order);
    free(seen);
    free(b);
    return rc;
}

static int answer(rpc_call *call, rpc__reflect *r, ReflReq *req) {
    ReflResp out = GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__INIT;
    Grpc__Reflection__V1__FileDescriptorResponse fdr =
        GRPC__REFLECTION__V1__FILE_DESCRIPTOR_RESPONSE__INIT;
    Grpc__Reflection__V1__ListServiceResponse lsr =
        GRPC__REFLECTION__V1__LIST_SERVICE_RESPONSE__INIT;
    Grpc__Reflection__V1__ExtensionNumberResponse enr =
        GRPC__REFLECTION__V1__EXTENSION_NUMBER_RESPONSE__INIT;
    Grpc__Reflection__V1__ErrorResponse err = GRPC__REFLECTION__V1__ERROR_RESPONSE__INIT;
    Grpc__Reflection__V1__ServiceResponse svc[REFLECT_MAX_SERVICES];
    Grpc__Reflection__V1__ServiceResponse *svcp[REFLECT_MAX_SERVICES];
    const char *names[REFLECT_MAX_SERVICES];
    char msg[300];
    long file = -1;
    int rc;
    out.valid_host = req->host;
    out.original_request = req;
    switch (req->message_request_case) {
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_LIST_SERVICES: {
        size_t n = rpc__server_services(r->srv, names, REFLECT_MAX_SERVICES);
        for (size_t i = 0; i < n; i++) {
            grpc__reflection__v1__service_response__init(&svc[i]);
            svc[i].name = (char *)names[i];
            svcp[i] = &svc[i];
        }
        lsr.n_service = n;
        lsr.service = svcp;
        out.message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_LIST_SERVICES_RESPONSE;
        out.list_services_response = &lsr;
        break;
    }
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_BY_FILENAME:
        file = find_file(r, req->file_by_filename, strlen(req->file_by_filename));
        if (file < 0) {
            snprintf(msg, sizeof msg, "file not found: %.200s", req->file_by_filename);
            error_answer(&out, &err, RPC_NOT_FOUND, msg);
        }
        break;
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_SYMBOL:
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE: {
        int ext =
            req->message_request_case ==
            GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_ALL_EXTENSION_NUMBERS_OF_TYPE;
        const char *sym = ext ? req->all_extension_numbers_of_type : req->file_containing_symbol;
        for (size_t i = 0; file < 0 && i < r->n_files; i++)
            if (file_defines(&r->files[i], sym)) file = (long)i;
        if (file < 0) {
            snprintf(msg, sizeof msg, "symbol not found: %.200s", sym);
            error_answer(&out, &err, RPC_NOT_FOUND, msg);
        } else if (ext) { /* proto3 files: no type of ours is extended */
            file = -1;
            enr.base_type_name = (char *)sym;
            out.message_response_case =
                GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_ALL_EXTENSION_NUMBERS_RESPONSE;
            out.all_extension_numbers_response = &enr;
        }
        break;
    }
    case GRPC__REFLECTION__V1__SERVER_REFLECTION_REQUEST__MESSAGE_REQUEST_FILE_CONTAINING_EXTENSION:
        snprintf(
            msg, sizeof msg, "extension not found: %.200s(%d)",
            req->file_containing_extension ? req->file_containing_extension->containing_type : "",
            req->file_containing_extension ? req->file_containing_extension->extension_number : 0);
        error_answer(&out, &err, RPC_NOT_FOUND, msg);
        break;
    default:
        error_answer(&out, &err, RPC_INVALID_ARGUMENT,
                     "message_request: none of its fields is set");
    }
    if (file >= 0) {
        if (file_closure(r, (size_t)file, &fdr.file_descriptor_proto,
                         &fdr.n_file_descriptor_proto) != 0)
            return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        out.message_response_case =
            GRPC__REFLECTION__V1__SERVER_REFLECTION_RESPONSE__MESSAGE_RESPONSE_FILE_DESCRIPTOR_RESPONSE;
        out.file_descriptor_response = &fdr;
    }
    rc = rpc_stream_send(call, &out.base);
    free(fdr.file_descriptor_proto);
    return rc;
}

static int reflect_info(rpc_call *call, const ProtobufCMessage *unused, void *ud) {
    rpc__reflect *r = ud;
    int budget = rpc__server_opts(r->srv)->max_reflection_streams, rc;
    (void)unused;
    /* anonymous (grpcurl needs no token): a budget of its own keeps these streams from taking
     * the slots authenticated streams need, like health watches (docs/rpc.md, "Hardening") */
    if (atomic_fetch_add(&r->streams, 1) >= budget) {
        atomic_fetch_sub(&r->streams, 1);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "too many reflection streams (limit %d)",
                         budget);
    }
    for (;;) {
        ProtobufCMessage *m;
        rc = rpc_stream_recv(call, &m);
        if (rc != RPC_OK || m == NULL) break; /* the end of the client's requests: OK */
        rc = answer(call, r, (ReflReq *)m);
        protobuf_c_message_free_unpacked(m, NULL);
        if (rc != RPC_OK) break;
    }
    atomic_fetch_sub(&r->streams, 1);
    return rc == RPC_ECLOSED ? RPC_CANCELLED : rc;
}

int rpc__reflect_new(rpc_server *s, const void *set, size_t len, rpc__reflect **out) {
    rpc__reflect *r = calloc(1, sizeof *r);
    if (r == NULL) return RPC_ENOMEM;
    r->srv = s;
    atomic_init(&r->streams, 0);
    if (index_set(r, set, len) != 0) {
        rpc__reflect_free(r);
        return RPC_EINVAL;
    }
    *out = r;
    return RPC_OK;
}

void rpc__reflect_free(rpc__reflect *r) {
    if (r == NULL) return;
    free(r->files);
    free(r);
}

int rpc__reflect_register(rpc_server *s, rpc__reflect *r) {
    rpc_method m[2] = {
        {"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", RPC_BIDI_STREAM,
         RPC_AUTH_NONE, &grpc__reflection__v1__server_reflection_request__descriptor,
         &grpc__reflection__v1__server_reflection_response__descriptor, NULL, reflect_info, r},
        {"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", RPC_BIDI_STREAM,
         RPC_AUTH_NONE, &grpc__reflection__v1__server_reflection_request__descriptor,
         &grpc__reflection__v1__server_reflection_response__descriptor, NULL, reflect_info, r},
    };
    return rpc_server_add(s, m, 2);
}
