/* What a request must satisfy before it is decoded, and what a response must satisfy before it
 * is encoded (docs/rpc.md, "Hardening"):
 *
 *   - exactly one request message (a missing or truncated one is a protocol error: INTERNAL,
 *     as grpc-go and grpc-java answer);
 *   - `string` fields are valid UTF-8 without NUL (proto3 requires UTF-8; C strings end at NUL,
 *     so a NUL would make the service see another value than the client sent);
 *   - repeated fields within the method's declared limits, and the whole request within a
 *     bound of its estimated decoded size — both checked on the wire bytes, before
 *     protobuf-c allocates anything;
 *   - response `string` fields are valid UTF-8 (clients refuse the whole response otherwise);
 *     checked when not NDEBUG (every build of this repository; a release build may drop it).
 *
 * The walk follows the descriptor over the wire bytes once, iteratively per message and
 * recursively per nesting level (bounded by RPC_MAX_NESTING). */
#include <stdio.h>
#include <string.h>

#include "rpc_internal.h"
#include "util.h"

/* What decoding with protobuf-c 1.4 allocates, estimated from above: each message's struct;
 * each field occurrence beyond a message's 16th recorded in a ScannedMember (32 bytes, in
 * slabs that double: up to 2x; the first 16 live on the stack); an array slot per element of a
 * repeated field (a pointer, a ProtobufCBinaryData or the scalar); strings copied with their
 * NUL; unknown fields copied with a 24-byte header; every allocation rounded to 16 (the arena).
 * Its purpose is to refuse a request before the allocations, not after. */
#define W_SCANNED 64
#define W_STACK_SCANNED 16
#define W_UNKNOWN 24
#define W_ROUND(n) (((n) + 15) & ~(size_t)15)
#define W_PATH_MAX 256

typedef struct walk {
    const rpc_field_limit *limits;
    size_t n_limits;
    size_t max, used;
    char lpath[W_PATH_MAX]; /* dotted field names, for limits: "items.tags" */
    char epath[W_PATH_MAX]; /* the same with indexes, for messages: "items[2].tags" */
    size_t llen, elen;
    /* the failure */
    int code; /* RPC_INVALID_ARGUMENT, or -1: not a valid message */
    char msg[W_PATH_MAX + 128];
} walk;

static int wvarint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    *v = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        *v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) return 0;
    }
    return -1;
}

/* Appends ".name" (or "name" at the top) and "[i]" to the paths; returns the old lengths
 * packed so pop() restores them. */
static void push(walk *w, const char *name, long idx, size_t *ol, size_t *oe) {
    *ol = w->llen, *oe = w->elen;
    int n = snprintf(w->lpath + w->llen, W_PATH_MAX - w->llen, "%s%s", w->llen ? "." : "", name);
    if (n > 0) w->llen += (size_t)n < W_PATH_MAX - w->llen ? (size_t)n : W_PATH_MAX - w->llen - 1;
    if (idx >= 0)
        n = snprintf(w->epath + w->elen, W_PATH_MAX - w->elen, "%s%s[%ld]", w->elen ? "." : "",
                     name, idx);
    else
        n = snprintf(w->epath + w->elen, W_PATH_MAX - w->elen, "%s%s", w->elen ? "." : "", name);
    if (n > 0) w->elen += (size_t)n < W_PATH_MAX - w->elen ? (size_t)n : W_PATH_MAX - w->elen - 1;
}

static void pop(walk *w, size_t ol, size_t oe) {
    w->llen = ol, w->elen = oe;
    w->lpath[ol] = 0, w->epath[oe] = 0;
}

static int wfail(walk *w, int code, const char *what) {
    w->code = code;
    snprintf(w->msg, sizeof w->msg, "%s: %s", w->elen ? w->epath : "request", what);
    return -1;
}

static int malformed(walk *w) {
    w->code = -1;
    return -1;
}

/* The declared bound of the field `f` of the message at the current path, or UINT32_MAX. */
static uint32_t limit_of(const walk *w, const ProtobufCFieldDescriptor *f) {
    size_t nl = strlen(f->name);
    for (size_t i = 0; i < w->n_limits; i++) {
        const char *p = w->limits[i].field;
        if (p == NULL) continue;
        if (w->llen) {
            if (strncmp(p, w->lpath, w->llen) != 0 || p[w->llen] != '.') continue;
            p += w->llen + 1;
        }
        if (strncmp(p, f->name, nl) == 0 && p[nl] == 0) return w->limits[i].max_count;
    }
    return UINT32_MAX;
}

static int charge(walk *w, size_t n) {
    w->used += n;
    if (w->used > w->max) {
        char what[96];
        snprintf(what, sizeof what, "the request would decode to more than %zu bytes", w->max);
        return wfail(w, RPC_INVALID_ARGUMENT, what);
    }
    return 0;
}

static size_t scalar_size(ProtobufCType t) {
    switch (t) {
    case PROTOBUF_C_TYPE_INT64:
    case PROTOBUF_C_TYPE_SINT64:
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_UINT64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return 8;
    case PROTOBUF_C_TYPE_BOOL:
        return sizeof(protobuf_c_boolean);
    default:
        return 4;
    }
}

/* Elements of a packed repeated scalar field. */
static size_t packed_count(ProtobufCType t, const uint8_t *p, size_t len) {
    switch (t) {
    case PROTOBUF_C_TYPE_SFIXED32:
    case PROTOBUF_C_TYPE_FIXED32:
    case PROTOBUF_C_TYPE_FLOAT:
        return len / 4;
    case PROTOBUF_C_TYPE_SFIXED64:
    case PROTOBUF_C_TYPE_FIXED64:
    case PROTOBUF_C_TYPE_DOUBLE:
        return len / 8;
    default: {
        size_t n = 0;
        for (size_t i = 0; i < len; i++)
            n += !(p[i] & 0x80);
        return n;
    }
    }
}

static int walk_msg(walk *w, const ProtobufCMessageDescriptor *d, const uint8_t *p,
                    const uint8_t *end, int depth);

/* One occurrence of a known field; `count` is its running count in this message. */
static int walk_field(walk *w, const ProtobufCFieldDescriptor *f, uint32_t *count, int wt,
                      const uint8_t *p, size_t len, size_t scan, int depth) {
    int repeated = f->label == PROTOBUF_C_LABEL_REPEATED;
    size_t elems = 1, ol, oe;
    if (repeated && wt == 2 && f->type != PROTOBUF_C_TYPE_STRING &&
        f->type != PROTOBUF_C_TYPE_BYTES && f->type != PROTOBUF_C_TYPE_MESSAGE)
        elems = packed_count(f->type, p, len);
    if (repeated) {
        uint32_t max = limit_of(w, f);
        if (elems > (size_t)(UINT32_MAX - *count)) elems = UINT32_MAX - *count;
        if (*count + elems > max) {
            char what[64];
            push(w, f->name, -1, &ol, &oe);
            snprintf(what, sizeof what, "at most %u entries per request", max);
            wfail(w, RPC_INVALID_ARGUMENT, what);
            return -1;
        }
    }
    long idx = repeated ? (long)*count : -1;
    *count += (uint32_t)elems;
    if (f->type == PROTOBUF_C_TYPE_STRING) {
        if (wt != 2) return malformed(w);
        if (charge(w, scan + (repeated ? 8 : 0) + W_ROUND(len + 1))) return -1;
        if (memchr(p, 0, len) != NULL || util_utf8_check(p, len) != len) {
            push(w, f->name, idx, &ol, &oe);
            return wfail(w, RPC_INVALID_ARGUMENT,
                         memchr(p, 0, len) ? "contains a NUL character" : "is not valid UTF-8");
        }
        return 0;
    }
    if (f->type == PROTOBUF_C_TYPE_BYTES)
        return charge(w, scan + (repeated ? 16 : 0) + W_ROUND(len));
    if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
        if (wt != 2) return malformed(w);
        const ProtobufCMessageDescriptor *sub = f->descriptor;
        if (charge(w, scan + (repeated ? 8 : 0) + W_ROUND(sub->sizeof_message))) return -1;
        push(w, f->name, idx, &ol, &oe);
        int rc = walk_msg(w, sub, p, p + len, depth + 1);
        pop(w, ol, oe);
        return rc;
    }
    return charge(w, scan + (repeated ? elems * scalar_size(f->type) : 0));
}

static int walk_msg(walk *w, const ProtobufCMessageDescriptor *d, const uint8_t *p,
                    const uint8_t *end, int depth) {
    if (depth > RPC_MAX_NESTING) {
        char what[64];
        snprintf(what, sizeof what, "nests messages deeper than %d levels", RPC_MAX_NESTING);
        return wfail(w, RPC_INVALID_ARGUMENT, what);
    }
    uint32_t counts[d->n_fields ? d->n_fields : 1]; /* occurrences per field, this message */
    memset(counts, 0, sizeof counts);
    size_t occurrences = 0;
    while (p < end) {
        uint64_t key, v, len = 0;
        if (wvarint(&p, end, &key) != 0 || (key >> 3) == 0 || (key >> 3) > 0x1fffffff)
            return malformed(w);
        int wt = (int)(key & 7);
        const uint8_t *val = p;
        switch (wt) {
        case 0:
            if (wvarint(&p, end, &v) != 0) return malformed(w);
            break;
        case 1: /* lengths first: no pointer is moved past the end */
            if (end - p < 8) return malformed(w);
            p += 8;
            break;
        case 5:
            if (end - p < 4) return malformed(w);
            p += 4;
            break;
        case 2:
            if (wvarint(&p, end, &len) != 0 || len > (uint64_t)(end - p)) return malformed(w);
            val = p;
            p += len;
            break;
        default: /* groups (3, 4) are not proto3; 6 and 7 do not exist */
            return malformed(w);
        }
        const ProtobufCFieldDescriptor *f =
            protobuf_c_message_descriptor_get_field(d, (unsigned)(key >> 3));
        size_t scan = ++occurrences > W_STACK_SCANNED ? W_SCANNED : 0;
        int rc = f ? walk_field(w, f, &counts[f - d->fields], wt, val,
                                wt == 2 ? (size_t)len : (size_t)(p - val), scan, depth)
                   : charge(w, scan + W_UNKNOWN + W_ROUND((size_t)(p - val)));
        if (rc != 0) return rc;
    }
    return 0;
}

int rpc__check_request(const uint8_t *p, size_t n, const ProtobufCMessageDescriptor *d,
                       const rpc_field_limit *limits, size_t n_limits, size_t max_decoded,
                       char *msg, size_t msglen) {
    walk w;
    w.limits = limits;
    w.n_limits = n_limits;
    w.max = max_decoded ? max_decoded : SIZE_MAX;
    w.used = 0;
    w.llen = w.elen = 0;
    w.lpath[0] = w.epath[0] = 0;
    w.code = 0;
    w.msg[0] = 0;
    if (charge(&w, W_ROUND(d->sizeof_message)) == 0 && walk_msg(&w, d, p, p + n, 0) == 0) return 0;
    if (w.code < 0) {
        snprintf(msg, msglen, "request is not a valid %s", d->name);
        return -1;
    }
    snprintf(msg, msglen, "%s", w.msg);
    return w.code;
}

/* ---- responses ---- */

/* The first string field of msg (recursively) that is not valid UTF-8: its path in `path`. */
int rpc__response_bad_string(const ProtobufCMessage *msg, char *path, size_t plen, size_t cap,
                             int depth) {
    const ProtobufCMessageDescriptor *d = msg->descriptor;
    if (depth > RPC_MAX_NESTING) return 0;
    for (unsigned i = 0; i < d->n_fields; i++) {
        const ProtobufCFieldDescriptor *f = &d->fields[i];
        const char *base = (const char *)msg + f->offset;
        if (f->type != PROTOBUF_C_TYPE_STRING && f->type != PROTOBUF_C_TYPE_MESSAGE) continue;
        if (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF) {
            uint32_t which =
                *(const uint32_t *)(const void *)((const char *)msg + f->quantifier_offset);
            if (which != f->id) continue;
        }
        size_t n = 1;
        const void *const *items = (const void *const *)(const void *)base;
        if (f->label == PROTOBUF_C_LABEL_REPEATED) {
            n = *(const size_t *)(const void *)((const char *)msg + f->quantifier_offset);
            items = *(const void *const *const *)(const void *)base;
        }
        for (size_t k = 0; k < n; k++) {
            const void *v = items ? items[k] : NULL;
            if (v == NULL) continue;
            int bad = 0;
            if (f->type == PROTOBUF_C_TYPE_STRING) {
                size_t len = strlen(v);
                bad = util_utf8_check(v, len) != len;
            }
            int w =
                f->label == PROTOBUF_C_LABEL_REPEATED
                    ? snprintf(path + plen, cap - plen, "%s%s[%zu]", plen ? "." : "", f->name, k)
                    : snprintf(path + plen, cap - plen, "%s%s", plen ? "." : "", f->name);
            size_t nl = w > 0 && (size_t)w < cap - plen ? plen + (size_t)w : plen;
            if (bad) return 1;
            if (f->type == PROTOBUF_C_TYPE_MESSAGE &&
                rpc__response_bad_string(v, path, nl, cap, depth + 1))
                return 1;
            path[plen] = 0;
        }
    }
    return 0;
}
