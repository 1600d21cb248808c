/* Message encoding between protobuf-c and the C core's byte buffers, the call arena, and
 * the route of the core's own log lines into ours. */
#include <errno.h>
#include <grpc/byte_buffer_reader.h>
#include <stdio.h>
#include <grpc/support/log.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "rpc_internal.h"
#include "util.h"

int64_t rpc__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

grpc_slice rpc__encode_slice(const ProtobufCMessage *msg) {
    size_t n = protobuf_c_message_get_packed_size(msg);
    grpc_slice s = grpc_slice_malloc(n);
    protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    return s;
}

grpc_byte_buffer *rpc__encode(const ProtobufCMessage *msg) {
    grpc_slice s = rpc__encode_slice(msg);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static int varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}

/* protobuf-c's unpacker recurses once per nested message and has no depth limit, so a request
 * of google.protobuf.Value nested a million times deep would overflow the stack. This walk
 * follows only the fields the descriptor says are messages, and stops at RPC_MAX_NESTING
 * (its own recursion is bounded by that). Malformed input is left for the unpacker to reject. */
static int depth_ok(const ProtobufCMessageDescriptor *d, const uint8_t *p, const uint8_t *end,
                    int depth) {
    if (depth > RPC_MAX_NESTING) return 0;
    while (p < end) {
        uint64_t key, len;
        if (varint(&p, end, &key) != 0) return 1;
        switch (key & 7) {
        case 0:
            if (varint(&p, end, &len) != 0) return 1;
            break;
        case 1: /* the length is checked before the pointer moves: never past `end` */
            if (end - p < 8) return 1;
            p += 8;
            break;
        case 5:
            if (end - p < 4) return 1;
            p += 4;
            break;
        case 2: {
            if (varint(&p, end, &len) != 0 || len > (uint64_t)(end - p)) return 1;
            const ProtobufCFieldDescriptor *f =
                protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
            if (f && f->type == PROTOBUF_C_TYPE_MESSAGE &&
                !depth_ok(f->descriptor, p, p + len, depth + 1))
                return 0;
            p += len;
            break;
        }
        default:
            return 1;
        }
    }
    return 1;
}

/* Decodes with `alloc` (the call arena on the server, so nothing is freed one by one).
 * A message that arrives in several slices is flattened once. Messages nested deeper than
 * RPC_MAX_NESTING are refused (only a message long enough to be that deep is walked). */
int rpc__decode_bytes(const uint8_t *p, size_t n, const ProtobufCMessageDescriptor *d,
                      ProtobufCAllocator *alloc, ProtobufCMessage **out) {
    *out = NULL;
    if (n > 2 * RPC_MAX_NESTING && !depth_ok(d, p, p + n, 0)) return -2;
    *out = protobuf_c_message_unpack(d, alloc, n, p);
    return *out ? 0 : -1;
}

int rpc__decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d,
                ProtobufCAllocator *alloc, ProtobufCMessage **out) {
    grpc_byte_buffer_reader r;
    if (bb == NULL) return rpc__decode_bytes((const uint8_t *)"", 0, d, alloc, out);
    if (!grpc_byte_buffer_reader_init(&r, bb)) return -1;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    int rc = rpc__decode_bytes(GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), d, alloc, out);
    grpc_slice_unref(s);
    return rc;
}

void rpc__arena_init(rpc__arena *a, void *inline_mem, size_t inline_cap) {
    rpc__chunk *c = inline_mem;
    c->next = NULL;
    c->cap = inline_cap - sizeof(rpc__chunk);
    c->used = 0;
    a->head = c;
}

void *rpc__arena_alloc(rpc__arena *a, size_t n) {
    rpc__chunk *c = a->head;
    size_t need = (n + 15) & ~(size_t)15;
    if (need < n) return NULL;
    if (c->cap - c->used < need) {
        size_t cap = need > 8192 ? need : 8192;
        rpc__chunk *nc = malloc(sizeof(*nc) + cap);
        if (nc == NULL) return NULL;
        nc->next = c;
        nc->cap = cap;
        nc->used = 0;
        a->head = c = nc;
    }
    void *p = c->mem + c->used;
    c->used += need;
    memset(p, 0, n);
    return p;
}

void rpc__arena_release(rpc__arena *a) {
    rpc__chunk *c = a->head;
    while (c && c->next) { /* the last chunk is the inline one */
        rpc__chunk *next = c->next;
        free(c);
        c = next;
    }
    if (c) c->used = 0;
    a->head = c;
}

/* The core logs TLS handshake failures and the like on stderr in its own format; keep every
 * line of the process JSON. */
static void rpc__gpr_log(gpr_log_func_args *args) {
    int lvl = args->severity == GPR_LOG_SEVERITY_ERROR  ? LOG_WARN
              : args->severity == GPR_LOG_SEVERITY_INFO ? LOG_DEBUG
                                                        : LOG_DEBUG;
    if (log__level <= lvl)
        log_write(lvl, "grpc.core", "%s:%d %s", args->file, args->line, args->message);
}

void rpc__install_log_hook(void) {
    gpr_set_log_function(rpc__gpr_log);
}

/* PEM files: certificates, keys, CA bundles. */
#define RPC__PEM_MAX (1 << 20)

int rpc__read_file(const char *path, char **out, char *err, size_t errlen) {
    return util_read_file(path, RPC__PEM_MAX, out, NULL, err, errlen);
}
