/* The gRPC server: completion-queue threads, call dispatch, unary replies, status details,
 * authentication, graceful shutdown. Streams live in rpc_stream.c, health in rpc_health.c. */
#include <assert.h>
#include <errno.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ctx.h"
#include "google/protobuf/any.pb-c.h"
#include "google/rpc/status.pb-c.h"
#include "ids.h"
#include "log.h"
#include "rpc_internal.h"
#include "util.h"

#define container_of(p, T, f) ((T *)(void *)((char *)(p)-offsetof(T, f)))

/* Outstanding call requests per (method, queue): a call that arrives while every request of its
 * method is matched waits in the core's pending list until one is re-armed, so a burst of calls
 * on one connection is matched at once up to this many per queue. 2 cost the model-registry's
 * GetModelRecommendation p99 at 8 calls outstanding on 2 queues (docs/benchmarks.md). */
#define LISTENERS_PER_QUEUE 8

typedef struct rpc__listener {
    rpc__tag t;
    rpc_server *s;
    rpc__method *m; /* NULL: the catch-all for unregistered methods */
    grpc_completion_queue *cq;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_call_details details; /* catch-all only */
} rpc__listener;

/* A call to an unknown method: answered UNIMPLEMENTED without a handler. */
typedef struct rpc__unknown {
    rpc__tag t;
    grpc_call *call;
    grpc_slice msg;
    int cancelled;
} rpc__unknown;

struct rpc_server {
    grpc_server *srv;
    rpc_server_opts o;
    rpc_tls tls;
    char *addr;
    rpc__method *methods;
    size_t n_methods, cap_methods;
    grpc_completion_queue **ucq, **scq, *shutdown_cq;
    pthread_t *uthr, *sthr, *wthr;
    int n_ucq, n_scq, n_workers;
    int n_uthr, n_sthr, n_wthr; /* threads actually started (a start can fail part-way) */
    int queues_down;            /* every queue shut down and drained */
    int shared_cq;              /* stream I/O runs on the unary queues (stream_threads 0) */
    rpc__listener *listeners;
    size_t n_listeners;
    rpc__tag t_shutdown;

    /* stream worker pool: a bounded ring of calls waiting for a worker */
    pthread_mutex_t wmu;
    pthread_cond_t wcv;
    rpc_call **wq;
    size_t wq_cap, wq_head, wq_len;
    int wstop;
    atomic_int active_streams;

    /* arming a listener (read side: the queue threads arm concurrently, never waiting on
     * each other) vs destroying the server (write side; srv NULL after) */
    pthread_rwlock_t amu;
    pthread_mutex_t dmu; /* detached streams, finished at shutdown */
    rpc_call *detached;

    rpc__health *health;
    rpc__reflect *reflect; /* NULL without descriptors */
    atomic_int port;       /* read by other threads (rpc_server_port) while start sets it */
    int started;
    int core_abandoned; /* a bound server whose start failed: core objects left to exit */
    atomic_int stopping;
    metric *m_inflight, *m_refused;
    rpc__pool *bpool; /* RPC_BLOCKING handlers; NULL when no method blocks */
    metric *m_blocking_refused;
};

static const char *const code_names[17] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

/* ---------------------------------------------------------------- call lifetime ---- */

void rpc__call_ref(rpc_call *c) {
    atomic_fetch_add_explicit(&c->refs, 1, memory_order_relaxed);
}

static void call_free(rpc_call *c) {
    if (c->is_stream) {
        rpc__stream_destroy(c);
        if (c->srv) atomic_fetch_sub(&c->srv->active_streams, c->counted_stream);
    }
    metric_add(c->srv->m_inflight, -1);
    grpc_metadata_array_destroy(&c->md);
    if (c->payload) grpc_byte_buffer_destroy(c->payload);
    if (c->reply) grpc_byte_buffer_destroy(c->reply);
    if (c->extra) grpc_byte_buffer_destroy(c->extra);
    grpc_slice_unref(c->status_slice);
    if (c->has_trailer) grpc_slice_unref(c->trailer.value);
    grpc_call_unref(c->call);
    rpc__call_run_defers(c); /* after the last use of the response, before its arena goes */
    rpc__arena_release(&c->arena);
    free(c);
}

void rpc_call_unref(rpc_call *c) {
    if (c == NULL) return;
    int was = atomic_fetch_sub_explicit(&c->refs, 1, memory_order_acq_rel);
    assert(was > 0 && "rpc_call_unref without a reference");
    if (was == 1) call_free(c);
}

static void *arena_pb_alloc(void *ud, size_t n) {
    return rpc__arena_alloc(&((rpc_call *)ud)->arena, n);
}
static void arena_pb_free(void *ud, void *p) {
    (void)ud;
    (void)p;
}

void *rpc_alloc(rpc_call *c, size_t n) {
    return rpc__arena_alloc(&c->arena, n);
}

char *rpc_strndup(rpc_call *c, const char *s, size_t n) {
    char *p = rpc__arena_alloc(&c->arena, n + 1);
    if (p) memcpy(p, s, n);
    return p;
}

char *rpc_strdup(rpc_call *c, const char *s) {
    return s ? rpc_strndup(c, s, strlen(s)) : NULL;
}

static char *arena_vsprintf(rpc_call *c, const char *fmt, va_list ap) {
    char small[256];
    va_list cp;
    va_copy(cp, ap);
    int n = vsnprintf(small, sizeof small, fmt, cp);
    va_end(cp);
    if (n < 0) return NULL;
    char *p = rpc__arena_alloc(&c->arena, (size_t)n + 1);
    if (p == NULL) return NULL;
    if ((size_t)n < sizeof small)
        memcpy(p, small, (size_t)n + 1);
    else
        vsnprintf(p, (size_t)n + 1, fmt, ap);
    return p;
}

char *rpc_sprintf(rpc_call *c, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *p = arena_vsprintf(c, fmt, ap);
    va_end(ap);
    return p;
}

int rpc_reply_encoded(rpc_call *c, const void *data, size_t len) {
    if (c->method->m.kind != RPC_UNARY || c->reply) return RPC_EINVAL;
    grpc_slice s = grpc_slice_from_copied_buffer(data, len);
    c->reply = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return c->reply ? RPC_OK : RPC_ENOMEM;
}

ProtobufCMessage *rpc_new_msg(rpc_call *c, const ProtobufCMessageDescriptor *d) {
    ProtobufCMessage *m = rpc__arena_alloc(&c->arena, d->sizeof_message);
    if (m) d->message_init(m);
    return m;
}

int rpc_error(rpc_call *c, int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *msg = arena_vsprintf(c, fmt, ap); /* the arena: this is the handler's thread */
    va_end(ap);
    /* a stream's status is also read by its close completion on a queue thread */
    if (c->is_stream) pthread_mutex_lock(&c->mu);
    c->message = msg;
    c->code = code;
    if (c->is_stream) pthread_mutex_unlock(&c->mu);
    return code;
}

int rpc_error_detail(rpc_call *c, const ProtobufCMessage *detail) {
    Google__Protobuf__Any *any = rpc_alloc(c, sizeof *any);
    if (any == NULL) return RPC_ENOMEM;
    google__protobuf__any__init(any);
    any->type_url = rpc_sprintf(c, "type.googleapis.com/%s", detail->descriptor->name);
    any->value.len = protobuf_c_message_get_packed_size(detail);
    any->value.data = rpc_alloc(c, any->value.len + 1);
    if (any->type_url == NULL || any->value.data == NULL) return RPC_ENOMEM;
    protobuf_c_message_pack(detail, any->value.data);
    if (c->n_details == c->cap_details) {
        size_t cap = c->cap_details ? c->cap_details * 2 : 4;
        void **d = rpc_alloc(c, cap * sizeof *d);
        if (d == NULL) return RPC_ENOMEM;
        if (c->n_details) memcpy(d, c->details, c->n_details * sizeof *d);
        c->details = d;
        c->cap_details = cap;
    }
    c->details[c->n_details++] = any;
    return RPC_OK;
}

/* google.rpc.Status goes in the grpc-status-details-bin trailer (the core base64-encodes
 * -bin values); its code and message repeat the call's status, as the gRPC spec requires. */
void rpc__prepare_status(rpc_call *c, grpc_op *op) {
    /* A call that ends CANCELLED after its deadline passed was ended by the deadline (handlers
     * see both as rpc_cancelled()). The client must read DEADLINE_EXCEEDED whichever arrives
     * first, its own timer or this status: on a loaded machine (a sanitizer build) ours can. */
    if (c->code == RPC_CANCELLED && rpc_deadline_ms(c) <= 0) {
        c->code = RPC_DEADLINE_EXCEEDED;
        c->message = "deadline exceeded";
    }
    memset(op, 0, sizeof *op);
    op->op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    op->data.send_status_from_server.status = (grpc_status_code)c->code;
    c->status_slice = grpc_slice_from_copied_string(c->message ? c->message : "");
    op->data.send_status_from_server.status_details = &c->status_slice;
    if (c->n_details == 0 || c->code == RPC_OK) return;
    Google__Rpc__Status st = GOOGLE__RPC__STATUS__INIT;
    st.code = c->code;
    st.message = c->message ? c->message : "";
    st.n_details = c->n_details;
    st.details = (Google__Protobuf__Any **)c->details;
    c->trailer.key = grpc_slice_from_static_string("grpc-status-details-bin");
    c->trailer.value = rpc__encode_slice(&st.base);
    c->has_trailer = 1;
    op->data.send_status_from_server.trailing_metadata_count = 1;
    op->data.send_status_from_server.trailing_metadata = &c->trailer;
}

/* ---------------------------------------------------------------- accessors ---- */

const auth_identity *rpc_identity(const rpc_call *c) {
    return c->ident;
}
int rpc_tenant(rpc_call *c, int flags, const auth_identity **id) {
    *id = c->ident;
    if (!*id || !ids_uuid_valid((*id)->org_id))
        return rpc_error(c, RPC_UNAUTHENTICATED, "the token's org_id is not a tenant UUID");
    if ((flags & RPC_TENANT_SUB) && !ids_uuid_valid((*id)->sub))
        return rpc_error(c, RPC_UNAUTHENTICATED, "the token's sub is not a member UUID");
    return RPC_OK;
}
const char *rpc_method_path(const rpc_call *c) {
    return c->method->m.path;
}
const char *rpc_trace_id(const rpc_call *c) {
    return c->trace;
}

static const grpc_metadata *md_find(const grpc_metadata_array *md, const char *key) {
    for (size_t i = 0; i < md->count; i++)
        if (grpc_slice_str_cmp(md->metadata[i].key, key) == 0) return &md->metadata[i];
    return NULL;
}

const char *rpc_metadata(const rpc_call *c, const char *key) {
    const grpc_metadata *m = md_find(&c->md, key);
    if (m == NULL) return NULL;
    return rpc_strndup((rpc_call *)c, (const char *)GRPC_SLICE_START_PTR(m->value),
                       GRPC_SLICE_LENGTH(m->value));
}

int rpc_metadata_copy(const rpc_call *c, const char *key, char *buf, size_t len) {
    const grpc_metadata *m = md_find(&c->md, key);
    if (m == NULL) return -1;
    size_t n = GRPC_SLICE_LENGTH(m->value);
    if (len > 0) {
        size_t k = n < len - 1 ? n : len - 1;
        memcpy(buf, GRPC_SLICE_START_PTR(m->value), k);
        buf[k] = 0;
    }
    return n > INT32_MAX ? INT32_MAX : (int)n;
}

int64_t rpc_deadline_ms(const rpc_call *c) {
    if (gpr_time_cmp(c->deadline, gpr_inf_future(c->deadline.clock_type)) == 0) return INT64_MAX;
    gpr_timespec left = gpr_time_sub(c->deadline, gpr_now(c->deadline.clock_type));
    return (int64_t)left.tv_sec * 1000 + left.tv_nsec / 1000000;
}

int rpc_cancelled(const rpc_call *c) {
    return atomic_load_explicit(&((rpc_call *)c)->cancelled, memory_order_relaxed) ||
           rpc_deadline_ms(c) <= 0;
}

/* ---------------------------------------------------------------- dispatch ---- */

/* A trace id the caller chose (x-request-id, or the trace-id of a W3C traceparent), else a
 * fresh one. Only a safe character set is taken, so a log line can't be forged through it. */
static void call_trace(rpc_call *c) {
    static _Thread_local uint64_t rng;
    const grpc_metadata *m = md_find(&c->md, "x-request-id");
    size_t off = 0, max = 36;
    if (m == NULL && (m = md_find(&c->md, "traceparent")) != NULL) off = 3, max = 32;
    if (m) {
        const char *v = (const char *)GRPC_SLICE_START_PTR(m->value);
        size_t n = GRPC_SLICE_LENGTH(m->value), j = 0;
        for (size_t i = off; i < n && j < max; i++) {
            char ch = v[i];
            int ok = (ch >= '0' && ch <= '9') || (ch >= 'a' && ch <= 'z') ||
                     (ch >= 'A' && ch <= 'Z') || ch == '-' || ch == '_' || ch == '.';
            if (!ok) break;
            c->trace[j++] = ch;
        }
        c->trace[j] = 0;
        if (j > 0) return;
    }
    if (rng == 0) rng = (uint64_t)rpc__now_ns() ^ (uint64_t)(uintptr_t)&rng ^ 0x9e3779b97f4a7c15ull;
    static const char hex[] = "0123456789abcdef";
    for (int k = 0; k < 2; k++) {
        rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
        for (int i = 0; i < 16; i++)
            c->trace[16 * k + i] = hex[(rng >> (4 * i)) & 15];
    }
    c->trace[32] = 0;
}

/* Verified tokens, per thread (no locks): a client sends the same token on every call of a
 * session, and a signature check costs 5-70 us. An entry is the exact header bytes, so a hit
 * proves the same token verified before; it is used only until the token's own `exp`, and
 * only for the verifier that checked it. Direct-mapped by a hash of the header. Each thread's
 * table (about 45 KB) lives as long as the thread: a thread-specific key frees it when the
 * thread exits (a server's threads end at shutdown; a process may run several servers). */
#define TOKEN_CACHE_SLOTS 8
#define TOKEN_CACHE_MAX 1024 /* longer headers are verified every time */

typedef struct token_slot {
    const auth_verifier *v;
    size_t len;
    char hdr[TOKEN_CACHE_MAX];
    auth_identity id;
} token_slot;

static _Thread_local token_slot *token_cache;
static pthread_key_t token_cache_key;
static pthread_once_t token_cache_once = PTHREAD_ONCE_INIT;
static int token_cache_key_ok;

static void token_cache_key_init(void) {
    token_cache_key_ok = pthread_key_create(&token_cache_key, free) == 0;
}

/* NULL when the table cannot be allocated or registered for freeing (no caching then). */
static token_slot *token_cache_get(void) {
    if (token_cache) return token_cache;
    pthread_once(&token_cache_once, token_cache_key_init);
    if (!token_cache_key_ok) return NULL;
    token_slot *t = calloc(TOKEN_CACHE_SLOTS, sizeof *t);
    if (t && pthread_setspecific(token_cache_key, t) != 0) {
        free(t);
        t = NULL;
    }
    return token_cache = t;
}

static int authenticate(rpc_call *c, const char *hdr, size_t len, char *err, size_t errlen) {
    const auth_verifier *v = c->srv->o.auth;
    int64_t now = (int64_t)time(NULL);
    token_slot *slot = NULL;
    if (len <= TOKEN_CACHE_MAX) {
        token_slot *cache = token_cache_get();
        if (cache) slot = &cache[util_fnv1a(UTIL_FNV1A_INIT, hdr, len) % TOKEN_CACHE_SLOTS];
    }
    if (slot && slot->v == v && slot->len == len && slot->id.exp > now &&
        memcmp(slot->hdr, hdr, len) == 0) {
        c->ident_mem = slot->id;
        return AUTH_OK;
    }
    int rc = auth_verify_bearer(v, hdr, len, now, &c->ident_mem, err, errlen);
    if (rc == AUTH_OK && slot) {
        slot->v = v;
        slot->len = len;
        memcpy(slot->hdr, hdr, len);
        slot->id = c->ident_mem;
    }
    return rc;
}

/* Authentication, deadline and decoding: what every call needs before its handler. */
static int call_prepare(rpc_call *c) {
    rpc__method *m = c->method;
    if (m->m.auth == RPC_AUTH_REQUIRED) {
        const grpc_metadata *a = md_find(&c->md, "authorization");
        char err[160];
        if (a == NULL) return rpc_error(c, RPC_UNAUTHENTICATED, "missing bearer token");
        if (rpc__md_count(&c->md, "authorization") > 1)
            return rpc_error(c, RPC_UNAUTHENTICATED, "more than one authorization header");
        if (c->srv->o.auth == NULL)
            return rpc_error(c, RPC_UNAUTHENTICATED, "no token verifier configured");
        if (authenticate(c, (const char *)GRPC_SLICE_START_PTR(a->value),
                         GRPC_SLICE_LENGTH(a->value), err, sizeof err) != AUTH_OK)
            return rpc_error(c, RPC_UNAUTHENTICATED, "invalid token: %s", err);
        c->ident = &c->ident_mem;
    }
    if (rpc_deadline_ms(c) <= 0) return rpc_error(c, RPC_DEADLINE_EXCEEDED, "deadline exceeded");
    if (m->m.kind == RPC_BIDI_STREAM) return RPC_OK; /* the handler reads (rpc_stream_recv) */
    ProtobufCAllocator alloc = {arena_pb_alloc, arena_pb_free, c};
    return rpc__decode_request(c, &alloc);
}

void rpc__account(rpc_call *c) {
    int code = c->code;
    if (code == RPC_OK && atomic_load(&c->cancelled))
        code = rpc_deadline_ms(c) <= 0 ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED;
    if (code < 0 || code > 16) code = RPC_UNKNOWN;
    rpc__method *m = c->method;
    metric *h = atomic_load_explicit(&m->handled[code], memory_order_acquire);
    if (h == NULL) {
        char labels[512];
        snprintf(labels, sizeof labels, "method=\"%s\",code=\"%s\"", m->m.path, code_names[code]);
        h = metrics_counter("rpc_server_handled_total", "RPCs completed, by method and status code",
                            labels);
        atomic_store_explicit(&m->handled[code], h, memory_order_release);
    }
    metric_inc(h);
    double secs = (double)(rpc__now_ns() - c->start_ns) / 1e9;
    metric_observe(m->latency, secs);
    if (log__level <= LOG_DEBUG || (code == RPC_INTERNAL || code == RPC_UNKNOWN)) {
        int lvl = (code == RPC_INTERNAL || code == RPC_UNKNOWN) ? LOG_WARN : LOG_DEBUG;
        char prev[64];
        snprintf(prev, sizeof prev, "%s", log_get_trace() ? log_get_trace() : "");
        log_set_trace(c->trace);
        log_write(lvl, "rpc.done", "method=%s code=%s ms=%.3f%s%s", m->m.path, code_names[code],
                  secs * 1e3, c->message ? " msg=" : "", c->message ? c->message : "");
        log_set_trace(prev[0] ? prev : NULL);
    }
}

/* One batch per unary call: the reply, the status, and RECV_CLOSE_ON_SERVER. A unary handler
 * runs on the thread that would report the close, so posting it earlier could not make a
 * cancellation visible sooner; it would only cost a second completion per call. */
static void unary_reply(rpc_call *c, ProtobufCMessage *resp) {
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!c->early_close) {
        ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        ops[n++].data.recv_close_on_server.cancelled = &c->recv_close_cancelled;
    }
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (resp) {
        if (c->reply == NULL) c->reply = rpc__encode(resp); /* else rpc_reply_encoded */
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->reply;
    }
    rpc__prepare_status(c, &ops[n++]);
    /* the dispatch reference moves to the batch */
    grpc_call *gc = c->call; /* the last read of c before the completion may free it */
    RPC__TSAN_RELEASE(&c->t_send);
    grpc_call_error e = grpc_call_start_batch(gc, ops, n, &c->t_send, NULL);
    if (e != GRPC_CALL_OK) {
        log_error("rpc.batch", "unary reply batch refused: %d", (int)e);
        rpc__account(c);
        rpc_call_unref(c);
    }
}

/* Runs the handler of a prepared call and replies. The thread carries the call's deadline
 * meanwhile (ctx.h), so what the handler does (db) is bounded by it. */
static void unary_handle(rpc_call *c) {
    ProtobufCMessage *resp = rpc_new_msg(c, c->method->m.resp_desc);
    int code;
    ctx_set_deadline_ms(rpc_deadline_ms(c));
    code = resp ? c->method->m.unary(c, c->req, resp, c->method->m.ud)
                : rpc_error(c, RPC_RESOURCE_EXHAUSTED, "out of memory");
    ctx_clear();
    if (code < 0 || code > 16)
        code = rpc_error(c, RPC_INTERNAL, "handler returned %d", code);
    else if (code != RPC_OK && c->code == RPC_OK)
        c->code = code;
    else if (code == RPC_OK && c->code != RPC_OK)
        code = c->code; /* the rule: a status set with rpc_error() is final (rpc.h) */
    else if (code == RPC_OK && rpc_deadline_ms(c) <= 0)
        code = rpc_error(c, RPC_DEADLINE_EXCEEDED, "deadline exceeded"); /* nobody waits */
    if (code == RPC_OK && c->reply == NULL) code = rpc__check_response(c, resp);
    unary_reply(c, code == RPC_OK ? resp : NULL);
}

static void unary_run(rpc_call *c) {
    int code = call_prepare(c);
    if (code == RPC_OK)
        unary_handle(c);
    else
        unary_reply(c, NULL);
}

/* On a pool thread: the client may have gone while the call waited in the queue. */
static void blocking_run(rpc_call *c) {
    log_set_trace(c->trace);
    if (rpc_cancelled(c)) {
        rpc_error(c, rpc_deadline_ms(c) <= 0 ? RPC_DEADLINE_EXCEEDED : RPC_CANCELLED,
                  "call ended while it waited for a handler thread");
        unary_reply(c, NULL);
    } else {
        unary_handle(c);
    }
    log_set_trace(NULL);
}

/* RPC_BLOCKING: authentication and decoding stay here (cheap, and a bad call is answered
 * without taking a pool slot); the handler goes to the pool, or the call is refused. */
static void blocking_dispatch(rpc_call *c) {
    rpc_server *s = c->srv;
    if (call_prepare(c) != RPC_OK) {
        unary_reply(c, NULL);
        return;
    }
    /* RECV_CLOSE_ON_SERVER now, not with the reply: the handler runs on another thread and
     * may wait long, and this completion is how rpc_cancelled() learns the client left. */
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->recv_close_cancelled;
    rpc__call_ref(c);
    c->early_close = 1;
    grpc_call *gc = c->call;
    RPC__TSAN_RELEASE(&c->t_close);
    if (grpc_call_start_batch(gc, &op, 1, &c->t_close, NULL) != GRPC_CALL_OK) {
        atomic_fetch_sub(&c->refs, 1);
        c->early_close = 0;
    }
    if (rpc__pool_submit(s->bpool, c) == 0) return;
    metric_inc(s->m_blocking_refused);
    if (atomic_load(&s->stopping))
        rpc_error(c, RPC_UNAVAILABLE, "server is shutting down");
    else
        rpc_error(c, RPC_RESOURCE_EXHAUSTED,
                  "server overloaded: %d blocking calls running and %d waiting",
                  s->o.blocking_workers, s->o.blocking_queue);
    unary_reply(c, NULL);
}

/* A unary call is ready to run once its request stream ended: inline, or on the blocking
 * pool for an RPC_BLOCKING method. */
static void unary_start(rpc_call *c) {
    if ((c->method->m.flags & RPC_BLOCKING) && c->srv->bpool)
        blocking_dispatch(c);
    else
        unary_run(c);
}

static void stream_dispatch(rpc_call *c);

/* The request stream of a call ended, or carried a second message (call_prepare refuses it).
 * A unary call cancelled first never runs its handler. */
static void request_read(rpc_call *c, int ok) {
    log_set_trace(c->trace);
    if (c->method->m.kind != RPC_UNARY) {
        stream_dispatch(c);
    } else if (!ok) {
        rpc_error(c, RPC_CANCELLED, "cancelled before the request was read");
        unary_reply(c, NULL);
    } else {
        unary_start(c);
    }
    log_set_trace(NULL);
}
/* Bounded hand-off to the stream workers; a full ring refuses the call. */
static int stream_enqueue(rpc_server *s, rpc_call *c) {
    int ok = 0;
    pthread_mutex_lock(&s->wmu);
    if (s->wq_len < s->wq_cap && !s->wstop) {
        s->wq[(s->wq_head + s->wq_len) % s->wq_cap] = c;
        s->wq_len++;
        ok = 1;
        pthread_cond_signal(&s->wcv);
    }
    pthread_mutex_unlock(&s->wmu);
    return ok;
}

static void stream_dispatch(rpc_call *c) {
    rpc_server *s = c->srv;
    if (!c->is_stream && rpc__stream_init(c, s->o.stream_queue) != 0) {
        /* without a queue the call can only be dropped; the core answers the client */
        log_error("rpc.stream", "out of memory creating a stream");
        grpc_call_cancel_with_status(c->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        rpc_call_unref(c);
        return;
    }
    int code = call_prepare(c);
    if (code == RPC_OK) {
        c->counted_stream = 1;
        if (atomic_fetch_add(&s->active_streams, 1) >= s->o.max_streams)
            code = rpc_error(c, RPC_RESOURCE_EXHAUSTED, "too many concurrent streams (limit %d)",
                             s->o.max_streams);
        else if (!stream_enqueue(s, c))
            code = rpc_error(c, RPC_RESOURCE_EXHAUSTED, "server is shutting down or overloaded");
    }
    if (code != RPC_OK) {
        metric_inc(s->m_refused);
        rpc_stream_finish(c, code, NULL);
        rpc_call_unref(c);
    }
}

static void *stream_worker(void *arg) {
    rpc_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->wmu);
        while (s->wq_len == 0 && !s->wstop)
            pthread_cond_wait(&s->wcv, &s->wmu);
        if (s->wq_len == 0) {
            pthread_mutex_unlock(&s->wmu);
            break;
        }
        rpc_call *c = s->wq[s->wq_head];
        s->wq_head = (s->wq_head + 1) % s->wq_cap;
        s->wq_len--;
        pthread_mutex_unlock(&s->wmu);

        log_set_trace(c->trace);
        int rc = c->method->m.stream(c, c->req, c->method->m.ud);
        if (rc != RPC_EDETACHED) {
            if (rc < 0 || rc > 16) rc = rpc_error(c, RPC_INTERNAL, "handler returned %d", rc);
            /* under the stream's lock; a status set with rpc_error() stays final (rpc.h) */
            rpc_stream_finish(c, rc, NULL);
        }
        log_set_trace(NULL);
        rpc_call_unref(c);
    }
    return NULL;
}

/* ---------------------------------------------------------------- listeners ---- */

static void listener_arm(rpc__listener *l) {
    grpc_call_error e;
    l->call = NULL;
    l->payload = NULL;
    grpc_metadata_array_init(&l->md);
    RPC__TSAN_RELEASE(&l->t);
    /* a call that arrived as the server shut down may be re-armed by its queue thread while
     * rpc_server_shutdown destroys the server: the lock orders the two, srv NULL means gone */
    pthread_rwlock_rdlock(&l->s->amu);
    grpc_server *srv = l->s->srv;
    if (srv == NULL) {
        e = GRPC_CALL_ERROR_ALREADY_FINISHED;
    } else if (l->m) {
        /* a bidi method is registered without its first message read (its handler reads) */
        e = grpc_server_request_registered_call(
            srv, l->m->reg, &l->call, &l->deadline, &l->md,
            l->m->m.kind == RPC_BIDI_STREAM ? NULL : &l->payload, l->cq, l->cq, &l->t);
    } else {
        grpc_call_details_init(&l->details);
        e = grpc_server_request_call(srv, &l->call, &l->details, &l->md, l->cq, l->cq, &l->t);
    }
    pthread_rwlock_unlock(&l->s->amu);
    if (e != GRPC_CALL_OK) {
        if (srv) log_warn("rpc.listen", "request for new calls refused: %d", (int)e);
        if (srv && !l->m) grpc_call_details_destroy(&l->details);
        grpc_metadata_array_destroy(&l->md);
    }
}

static void unknown_answer(rpc__listener *l) {
    rpc__unknown *u = calloc(1, sizeof *u);
    grpc_call *call = l->call;
    char buf[300];
    snprintf(buf, sizeof buf, "unknown method %.*s", (int)GRPC_SLICE_LENGTH(l->details.method),
             (const char *)GRPC_SLICE_START_PTR(l->details.method));
    grpc_call_details_destroy(&l->details);
    grpc_metadata_array_destroy(&l->md);
    if (u == NULL) {
        grpc_call_cancel_with_status(call, GRPC_STATUS_UNIMPLEMENTED, "unknown method", NULL);
        grpc_call_unref(call);
        return;
    }
    u->t.kind = RPC__TAG_UNKNOWN_END;
    u->call = call;
    u->msg = grpc_slice_from_copied_string(buf);
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[1].data.send_status_from_server.status = GRPC_STATUS_UNIMPLEMENTED;
    ops[1].data.send_status_from_server.status_details = &u->msg;
    ops[2].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[2].data.recv_close_on_server.cancelled = &u->cancelled;
    RPC__TSAN_RELEASE(&u->t);
    if (grpc_call_start_batch(call, ops, 3, &u->t, NULL) != GRPC_CALL_OK) {
        grpc_slice_unref(u->msg);
        grpc_call_unref(call);
        free(u);
    }
}

static void on_request(rpc__listener *l, int ok) {
    rpc_server *s = l->s;
    if (!ok) { /* shutdown: the request was withdrawn */
        grpc_metadata_array_destroy(&l->md);
        if (l->m == NULL) grpc_call_details_destroy(&l->details);
        return;
    }
    if (l->m == NULL) {
        unknown_answer(l);
        if (!atomic_load(&s->stopping)) listener_arm(l);
        return;
    }
    /* the inline arena (most of the struct) needs no zeroing: rpc__arena_alloc zeroes */
    rpc_call *c = malloc(sizeof *c);
    if (c) memset(c, 0, offsetof(rpc_call, arena_inline));
    if (c == NULL) {
        grpc_call_cancel_with_status(l->call, GRPC_STATUS_RESOURCE_EXHAUSTED, "out of memory",
                                     NULL);
        grpc_call_unref(l->call);
        grpc_metadata_array_destroy(&l->md);
        if (l->payload) grpc_byte_buffer_destroy(l->payload);
        listener_arm(l);
        return;
    }
    c->t_close.kind = RPC__TAG_CLOSE;
    c->t_send.kind = l->m->m.kind == RPC_UNARY ? RPC__TAG_UNARY_SEND : RPC__TAG_STREAM_SEND;
    c->t_end.kind = RPC__TAG_STREAM_END;
    /* streams: the CLOSE completion + dispatch; unary calls: dispatch, then the reply batch */
    atomic_init(&c->refs, l->m->m.kind == RPC_UNARY ? 1 : 2);
    c->srv = s;
    c->method = l->m;
    c->call = l->call;
    c->cq = l->cq;
    c->deadline = l->deadline;
    c->md = l->md;
    c->payload = l->payload;
    c->start_ns = rpc__now_ns();
    rpc__arena_init(&c->arena, c->arena_inline, sizeof c->arena_inline);
    metric_add(s->m_inflight, 1);
    listener_arm(l);

    if (l->m->m.kind != RPC_UNARY) {
        /* The stream state exists before the close batch can complete: a client that cancels at
         * once may be seen by a completion-queue thread before stream_dispatch runs, and a close
         * that found no stream state was lost (never closed, on_close never ran: a detached
         * stream's owner and the call leaked). stream_dispatch retries a failed init. */
        (void)rpc__stream_init(c, s->o.stream_queue);
        /* RECV_CLOSE_ON_SERVER first: its completion is the only reliable news that the client
         * went away, the deadline passed or the connection broke while the handler, on another
         * thread, is still writing. */
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
        op.data.recv_close_on_server.cancelled = &c->recv_close_cancelled;
        RPC__TSAN_RELEASE(&c->t_close);
        if (grpc_call_start_batch(c->call, &op, 1, &c->t_close, NULL) != GRPC_CALL_OK)
            atomic_fetch_sub(&c->refs, 1);
    }
    call_trace(c);
    log_set_trace(c->trace);
    if (l->m->m.kind == RPC_BIDI_STREAM)
        stream_dispatch(c); /* its messages are the handler's to read */
    else if (rpc__expect_request_end(c)) {
        /* request_read() dispatches it once the request stream has ended */
    } else if (l->m->m.kind == RPC_UNARY)
        unary_start(c);
    else
        stream_dispatch(c);
    log_set_trace(NULL);
}

static void on_close(rpc_call *c) {
    if (c->recv_close_cancelled) atomic_store(&c->cancelled, 1);
    if (c->is_stream) rpc__stream_on_close(c);
    rpc_call_unref(c);
}

static void *cq_thread(void *arg) {
    grpc_completion_queue *cq = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        RPC__TSAN_ACQUIRE(ev.tag);
        rpc__tag *t = ev.tag;
        switch (t->kind) {
        case RPC__TAG_REQUEST:
            on_request((rpc__listener *)t, ev.success);
            break;
        case RPC__TAG_CLOSE:
            on_close(container_of(t, rpc_call, t_close));
            break;
        case RPC__TAG_UNARY_SEND: {
            rpc_call *c = container_of(t, rpc_call, t_send);
            /* an early close reports on its own completion (on_close) */
            if (!c->early_close && c->recv_close_cancelled) atomic_store(&c->cancelled, 1);
            rpc__account(c);
            rpc_call_unref(c);
            break;
        }
        case RPC__TAG_STREAM_SEND:
            rpc__stream_on_send(container_of(t, rpc_call, t_send), ev.success);
            break;
        case RPC__TAG_STREAM_END:
            rpc__stream_on_end(container_of(t, rpc_call, t_end));
            break;
        case RPC__TAG_UNARY_RECV:
            request_read(container_of(t, rpc_call, t_recv), ev.success);
            break;
        case RPC__TAG_STREAM_RECV:
            rpc__stream_on_recv(container_of(t, rpc_call, t_recv), ev.success);
            break;
        case RPC__TAG_UNKNOWN_END: {
            rpc__unknown *u = (rpc__unknown *)t;
            grpc_slice_unref(u->msg);
            grpc_call_unref(u->call);
            free(u);
            break;
        }
        default:
            log_error("rpc.cq", "unexpected completion tag kind %d", t->kind);
        }
    }
    return NULL;
}

/* ---------------------------------------------------------------- server ---- */

static void opts_defaults(rpc_server_opts *o) {
    if (o->unary_threads <= 0) o->unary_threads = 1;
    if (o->stream_threads < 0) o->stream_threads = 0;
    if (o->stream_workers <= 0) o->stream_workers = 16;
    if (o->max_streams <= 0) o->max_streams = 1024;
    if (o->stream_queue <= 0) o->stream_queue = 256;
    if (o->max_recv_bytes <= 0) o->max_recv_bytes = 4 << 20;
    if (o->max_send_bytes <= 0) o->max_send_bytes = 16 << 20;
    if (o->max_concurrent_streams <= 0) o->max_concurrent_streams = 256;
    rpc__opts_hardening_defaults(o);
    if (o->blocking_workers <= 0) o->blocking_workers = 8;
    if (o->blocking_queue <= 0) o->blocking_queue = 64;
}

int rpc_server_new(const rpc_server_opts *opts, rpc_server **out, char *err, size_t errlen) {
    rpc_server *s = calloc(1, sizeof *s);
    if (s == NULL) goto oom;
    s->o = *opts;
    opts_defaults(&s->o);
    s->addr = strdup(opts->addr ? opts->addr : "127.0.0.1:0");
    if (s->addr == NULL) goto oom;
    if (opts->tls) {
        s->tls = *opts->tls;
        s->o.tls = &s->tls;
    }
    pthread_mutex_init(&s->wmu, NULL);
    pthread_cond_init(&s->wcv, NULL);
    pthread_mutex_init(&s->dmu, NULL);
    pthread_rwlock_init(&s->amu, NULL);
    s->wq_cap = (size_t)s->o.max_streams;
    s->wq = calloc(s->wq_cap, sizeof *s->wq);
    if (s->wq == NULL || rpc__health_new(&s->health) != 0) goto oom;
    rpc__install_log_hook();
    grpc_init();
    s->m_inflight = metrics_gauge("rpc_server_inflight_calls", "RPCs being handled", NULL);
    s->m_refused = metrics_counter("rpc_server_refused_streams_total",
                                   "streams refused because of limits", NULL);
    s->m_blocking_refused =
        metrics_counter("rpc_server_blocking_refused_total",
                        "blocking calls refused because the pool and its queue were full", NULL);
    *out = s;
    return 0;
oom:
    snprintf(err, errlen, "out of memory");
    if (s) {
        free(s->wq);
        free(s->addr);
        free(s);
    }
    return RPC_ENOMEM;
}

int rpc_server_add(rpc_server *s, const rpc_method *methods, size_t n) {
    if (s->started) return RPC_EINVAL;
    for (size_t i = 0; i < n; i++) {
        const rpc_method *m = &methods[i];
        if (m->path == NULL || m->path[0] != '/' || m->req_desc == NULL || m->resp_desc == NULL ||
            (m->kind == RPC_UNARY ? m->unary == NULL : m->stream == NULL))
            return RPC_EINVAL;
        if (s->n_methods == s->cap_methods) {
            size_t cap = s->cap_methods ? s->cap_methods * 2 : 16;
            rpc__method *nm = realloc(s->methods, cap * sizeof *nm);
            if (nm == NULL) return RPC_ENOMEM;
            s->methods = nm;
            s->cap_methods = cap;
        }
        rpc__method *d = &s->methods[s->n_methods];
        memset(d, 0, sizeof *d);
        d->m = *m;
        const char *slash = strchr(m->path + 1, '/');
        d->service = slash ? strndup(m->path + 1, (size_t)(slash - m->path - 1)) : strdup("");
        if (d->service == NULL) return RPC_ENOMEM;
        char labels[400];
        snprintf(labels, sizeof labels, "method=\"%s\"", m->path);
        d->latency =
            metrics_histogram("rpc_server_handling_seconds",
                              "RPC handling time, from arrival to status", labels, NULL, 0);
        s->n_methods++;
    }
    return RPC_OK;
}

static grpc_server_credentials *server_creds(const rpc_tls *tls, char *err, size_t errlen) {
    char *cert = NULL, *key = NULL, *ca = NULL;
    grpc_server_credentials *creds = NULL;
    if (rpc__read_file(tls->cert_file, &cert, err, errlen) != 0 ||
        rpc__read_file(tls->key_file, &key, err, errlen) != 0 ||
        (tls->client_ca_file && rpc__read_file(tls->client_ca_file, &ca, err, errlen) != 0))
        goto done;
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    creds = grpc_ssl_server_credentials_create_ex(
        ca, &pair, 1,
        ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
           : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
    if (creds == NULL) snprintf(err, errlen, "invalid TLS certificate or key");
done:
    free(cert);
    free(key);
    free(ca);
    return creds;
}

int (*rpc__thread_create)(pthread_t *, const pthread_attr_t *, void *(*)(void *),
                          void *) = pthread_create;

/* *started counts the threads running, so that a failure part-way joins exactly those. */
static int start_threads(pthread_t **thr, int n, void *(*fn)(void *), void **args, void *arg,
                         int *started) {
    *thr = calloc((size_t)n, sizeof **thr);
    if (*thr == NULL) return -1;
    for (int i = 0; i < n; i++) {
        if (rpc__thread_create(&(*thr)[i], NULL, fn, args ? args[i] : arg) != 0) return -1;
        *started = i + 1;
    }
    return 0;
}

static int make_queues(rpc_server *s, grpc_completion_queue ***qs, int n, int *count) {
    *qs = calloc((size_t)n, sizeof **qs);
    if (*qs == NULL) return -1;
    for (int i = 0; i < n; i++) {
        (*qs)[i] = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(s->srv, (*qs)[i], NULL);
    }
    *count = n;
    return 0;
}

/* Refuses a TLS configuration that would not do what it says: a client CA without a server
 * certificate (it would serve plaintext, without client authentication), a certificate
 * without its key or a key without its certificate. */
static int tls_check(const rpc_tls *tls, char *err, size_t errlen) {
    if (tls == NULL) return 0;
    if (tls->cert_file == NULL && tls->key_file == NULL && tls->client_ca_file)
        snprintf(err, errlen,
                 "TLS: a client CA is set but no server certificate and key: mTLS "
                 "needs both (UPSQUAD_TLS_CERT_FILE, UPSQUAD_TLS_KEY_FILE)");
    else if (tls->cert_file == NULL || tls->cert_file[0] == 0)
        snprintf(err, errlen,
                 "TLS: a server key is set without its certificate "
                 "(UPSQUAD_TLS_CERT_FILE)");
    else if (tls->key_file == NULL || tls->key_file[0] == 0)
        snprintf(err, errlen,
                 "TLS: a server certificate is set without its key "
                 "(UPSQUAD_TLS_KEY_FILE)");
    else
        return 0;
    return -1;
}

static void arm_all(rpc_server *s) {
    size_t k = 0;
    for (size_t i = 0; i < s->n_methods; i++) {
        rpc__method *m = &s->methods[i];
        int unary = m->m.kind == RPC_UNARY;
        int nq = unary ? s->n_ucq : s->n_scq;
        for (int q = 0; q < nq; q++)
            for (int j = 0; j < LISTENERS_PER_QUEUE; j++) {
                rpc__listener *l = &s->listeners[k++];
                l->t.kind = RPC__TAG_REQUEST;
                l->s = s;
                l->m = m;
                l->cq = unary ? s->ucq[q] : s->scq[q];
                listener_arm(l);
            }
    }
    rpc__listener *l = &s->listeners[k++]; /* catch-all for unregistered methods */
    l->t.kind = RPC__TAG_REQUEST;
    l->s = s;
    l->cq = s->ucq[0];
    listener_arm(l);
    s->n_listeners = k;
}

int rpc_server_start(rpc_server *s, char *err, size_t errlen) {
    grpc_arg args[4 + RPC__HARDENING_ARGS];
    args[0] = (grpc_arg){
        GRPC_ARG_INTEGER, GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH, {.integer = s->o.max_recv_bytes}};
    args[1] = (grpc_arg){
        GRPC_ARG_INTEGER, GRPC_ARG_MAX_SEND_MESSAGE_LENGTH, {.integer = s->o.max_send_bytes}};
    args[2] = (grpc_arg){GRPC_ARG_INTEGER,
                         GRPC_ARG_MAX_CONCURRENT_STREAMS,
                         {.integer = s->o.max_concurrent_streams}};
    args[3] = (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_ALLOW_REUSEPORT, {.integer = 0}};
    grpc_channel_args ca = {4 + rpc__hardening_args(&s->o, args + 4), args};
    grpc_server_credentials *creds = NULL;

    if (s->srv) {
        snprintf(err, errlen, "server already started");
        return RPC_EINVAL;
    }
    if (tls_check(s->o.tls, err, errlen) != 0) return RPC_EINVAL;
    if (rpc__health_register(s) != 0) goto oom;
    if (s->o.descriptors) {
        if (rpc__reflect_new(s, s->o.descriptors, s->o.descriptors_len, &s->reflect) != RPC_OK) {
            snprintf(err, errlen, "descriptors: not a serialized FileDescriptorSet");
            return RPC_EINVAL;
        }
        if (rpc__reflect_register(s, s->reflect) != 0) goto oom;
    }
    s->srv = grpc_server_create(&ca, NULL);
    s->n_workers = s->o.stream_workers;
    if (make_queues(s, &s->ucq, s->o.unary_threads, &s->n_ucq) != 0) goto oom;
    if (s->o.stream_threads == 0) { /* stream I/O shares the unary queues: no extra pollers */
        s->scq = s->ucq;
        s->n_scq = s->n_ucq;
        s->shared_cq = 1;
    } else if (make_queues(s, &s->scq, s->o.stream_threads, &s->n_scq) != 0) {
        goto oom;
    }
    s->shutdown_cq = grpc_completion_queue_create_for_pluck(NULL);
    for (size_t i = 0; i < s->n_methods; i++) {
        s->methods[i].reg = grpc_server_register_method(
            s->srv, s->methods[i].m.path, NULL,
            s->methods[i].m.kind == RPC_BIDI_STREAM ? GRPC_SRM_PAYLOAD_NONE
                                                    : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER,
            0);
        if (s->methods[i].reg == NULL) {
            snprintf(err, errlen, "cannot register method %s (registered twice?)",
                     s->methods[i].m.path);
            return RPC_EINVAL;
        }
    }
    for (size_t i = 0; i < s->n_methods && s->bpool == NULL; i++)
        if (s->methods[i].m.kind == RPC_UNARY && (s->methods[i].m.flags & RPC_BLOCKING) &&
            rpc__pool_new(s->o.blocking_workers, s->o.blocking_queue, blocking_run, &s->bpool) != 0)
            goto oom;
    creds =
        s->o.tls ? server_creds(s->o.tls, err, errlen) : grpc_insecure_server_credentials_create();
    if (creds == NULL) return RPC_EINVAL;
    s->port = grpc_server_add_http2_port(s->srv, s->addr, creds);
    grpc_server_credentials_release(creds);
    if (s->port <= 0) {
        snprintf(err, errlen, "cannot listen on %s", s->addr);
        return RPC_EINVAL;
    }
    size_t nl = 1;
    for (size_t i = 0; i < s->n_methods; i++)
        nl +=
            (size_t)(s->methods[i].m.kind == RPC_UNARY ? s->n_ucq : s->n_scq) * LISTENERS_PER_QUEUE;
    s->listeners = calloc(nl, sizeof *s->listeners);
    if (s->listeners == NULL) goto oom;
    /* Every thread before the server starts: from here on nothing can fail, and a failure
     * above leaves a server that rpc_server_free takes apart (the threads that did start are
     * stopped and joined, the queues no thread polled are drained here). */
    if (start_threads(&s->uthr, s->n_ucq, cq_thread, (void **)s->ucq, NULL, &s->n_uthr) != 0 ||
        (!s->shared_cq &&
         start_threads(&s->sthr, s->n_scq, cq_thread, (void **)s->scq, NULL, &s->n_sthr) != 0) ||
        start_threads(&s->wthr, s->n_workers, stream_worker, NULL, s, &s->n_wthr) != 0 ||
        (s->bpool && rpc__pool_start(s->bpool) != 0)) {
        snprintf(err, errlen, "cannot start threads (%d queue, %d stream, %d blocking)",
                 s->n_ucq + (s->shared_cq ? 0 : s->n_scq), s->n_workers,
                 s->bpool ? s->o.blocking_workers : 0);
        return RPC_ENOMEM;
    }
    grpc_server_start(s->srv);
    s->started = 1;
    arm_all(s);
    for (size_t i = 0; i < s->n_methods; i++)
        rpc__health_set(s->health, s->methods[i].service, 1);
    rpc__health_set(s->health, "", 1);
    log_info("rpc.listen", "serving %zu methods on %s (port %d, %s)", s->n_methods, s->addr,
             s->port, s->o.tls ? (s->o.tls->client_ca_file ? "mTLS" : "TLS") : "plaintext");
    return RPC_OK;
oom:
    snprintf(err, errlen, "out of memory");
    return RPC_ENOMEM;
}

const rpc_server_opts *rpc__server_opts(const rpc_server *s) {
    return &s->o;
}

rpc__health *rpc__server_health(rpc_server *s) {
    return s->health;
}

size_t rpc__server_services(const rpc_server *s, const char **names, size_t cap) {
    size_t n = 0;
    for (size_t i = 0; i < s->n_methods; i++) {
        size_t j = 0;
        while (j < n && strcmp(names[j], s->methods[i].service) != 0)
            j++;
        if (j == n && n < cap) names[n++] = s->methods[i].service;
    }
    return n;
}

int rpc_server_port(const rpc_server *s) {
    return s->port;
}

void rpc_health_set(rpc_server *s, const char *service, int serving) {
    rpc__health_set(s->health, service, serving);
}

void rpc__server_detached_add(rpc_server *s, rpc_call *c) {
    pthread_mutex_lock(&s->dmu);
    c->dprev = NULL;
    c->dnext = s->detached;
    if (s->detached) s->detached->dprev = c;
    s->detached = c;
    pthread_mutex_unlock(&s->dmu);
}

void rpc__server_detached_remove(rpc_server *s, rpc_call *c) {
    pthread_mutex_lock(&s->dmu);
    if (c->dprev)
        c->dprev->dnext = c->dnext;
    else if (s->detached == c)
        s->detached = c->dnext;
    if (c->dnext) c->dnext->dprev = c->dprev;
    c->dnext = c->dprev = NULL;
    pthread_mutex_unlock(&s->dmu);
}

/* Detached streams are open-ended subscriptions: end them at once with UNAVAILABLE so their
 * clients reconnect to another replica, instead of holding the grace period. */
static void finish_detached(rpc_server *s) {
    for (;;) {
        pthread_mutex_lock(&s->dmu);
        rpc_call *c = s->detached;
        if (c) {
            if (c->dnext) c->dnext->dprev = NULL;
            s->detached = c->dnext;
            c->dnext = c->dprev = NULL;
            rpc__call_ref(c);
        }
        pthread_mutex_unlock(&s->dmu);
        if (c == NULL) break;
        rpc_stream_finish(c, RPC_UNAVAILABLE, "server shutting down");
        rpc_call_unref(c);
    }
}

/* The stream workers and the blocking pool: those that started finish what they hold. */
static void workers_stop(rpc_server *s) {
    pthread_mutex_lock(&s->wmu);
    s->wstop = 1;
    pthread_cond_broadcast(&s->wcv);
    pthread_mutex_unlock(&s->wmu);
    for (int i = 0; i < s->n_wthr; i++)
        pthread_join(s->wthr[i], NULL);
    s->n_wthr = 0;
    rpc__pool_stop(s->bpool);
}

static void queue_drain(grpc_completion_queue *q) {
    while (grpc_completion_queue_next(q, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
}

/* A queue must be shut down and drained before it is destroyed: its thread drains it, or,
 * when the start failed before that thread ran, this does. */
static void queues_stop(rpc_server *s) {
    if (s->queues_down) return;
    for (int i = 0; i < s->n_ucq; i++)
        grpc_completion_queue_shutdown(s->ucq[i]);
    for (int i = 0; !s->shared_cq && i < s->n_scq; i++)
        grpc_completion_queue_shutdown(s->scq[i]);
    for (int i = 0; i < s->n_uthr; i++)
        pthread_join(s->uthr[i], NULL);
    for (int i = 0; i < s->n_sthr; i++)
        pthread_join(s->sthr[i], NULL);
    for (int i = s->n_uthr; i < s->n_ucq; i++)
        queue_drain(s->ucq[i]);
    for (int i = s->n_sthr; !s->shared_cq && i < s->n_scq; i++)
        queue_drain(s->scq[i]);
    s->n_uthr = s->n_sthr = 0;
    s->queues_down = 1;
}

void rpc_server_shutdown(rpc_server *s, int grace_ms) {
    if (!s->started || atomic_exchange(&s->stopping, 1)) return;
    log_info("rpc.shutdown", "draining (grace %d ms)", grace_ms);
    rpc__health_set_all(s->health, 0);
    grpc_server_shutdown_and_notify(s->srv, s->shutdown_cq, &s->t_shutdown);
    finish_detached(s);
    gpr_timespec until =
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC), gpr_time_from_millis(grace_ms, GPR_TIMESPAN));
    grpc_event ev = grpc_completion_queue_pluck(s->shutdown_cq, &s->t_shutdown, until, NULL);
    if (ev.type == GRPC_QUEUE_TIMEOUT) {
        log_warn("rpc.shutdown", "grace period over: cancelling the calls still running");
        grpc_server_cancel_all_calls(s->srv);
        grpc_completion_queue_pluck(s->shutdown_cq, &s->t_shutdown,
                                    gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    }
    workers_stop(s); /* before the server goes: queued calls still reply */
    pthread_rwlock_wrlock(&s->amu);
    grpc_server *srv = s->srv;
    s->srv = NULL;
    pthread_rwlock_unlock(&s->amu);
    grpc_server_destroy(srv);
    queues_stop(s);
    log_info("rpc.shutdown", "stopped");
}

/* The queues, after the server: every queue stopped and destroyed. */
static void core_free(rpc_server *s) {
    queues_stop(s);
    for (int i = 0; i < s->n_ucq; i++)
        grpc_completion_queue_destroy(s->ucq[i]);
    for (int i = 0; !s->shared_cq && i < s->n_scq; i++)
        grpc_completion_queue_destroy(s->scq[i]);
    if (s->shutdown_cq) {
        grpc_completion_queue_shutdown(s->shutdown_cq);
        grpc_completion_queue_destroy(s->shutdown_cq);
    }
}

void rpc_server_free(rpc_server *s) {
    if (s == NULL) return;
    if (s->started) rpc_server_shutdown(s, 0);
    workers_stop(s); /* a start that failed part-way may have started some */
    if (s->srv && s->port > 0 && !s->started) {
        /* A bound server whose start failed: the process is about to exit (svc_main), and the
         * C core (1.51) can block forever in grpc_server_destroy of a bound server that never
         * started (its event engine waits for a thread count that does not drop). Stop our
         * threads and leave the core's objects to the exit. */
        queues_stop(s);
        s->core_abandoned = 1;
    } else if (s->srv) {   /* never started: the server goes before its queues */
        if (s->port > 0) { /* the core refuses to destroy a bound server not shut down */
            grpc_server_shutdown_and_notify(s->srv, s->shutdown_cq, &s->t_shutdown);
            grpc_completion_queue_pluck(s->shutdown_cq, &s->t_shutdown,
                                        gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        }
        grpc_server_destroy(s->srv);
        s->srv = NULL;
    }
    if (!s->core_abandoned) core_free(s);
    for (size_t i = 0; i < s->n_methods; i++)

        free(s->methods[i].service);
    rpc__health_free(s->health);
    rpc__reflect_free(s->reflect);
    rpc__pool_free(s->bpool);
    free(s->methods);
    free(s->listeners);
    free(s->ucq);
    if (!s->shared_cq) free(s->scq);
    free(s->uthr);
    free(s->sthr);
    free(s->wthr);
    free(s->wq);
    free(s->addr);
    pthread_mutex_destroy(&s->wmu);
    pthread_cond_destroy(&s->wcv);
    pthread_mutex_destroy(&s->dmu);
    int abandoned = s->core_abandoned;
    pthread_rwlock_destroy(&s->amu);
    free(s);
    if (!abandoned) grpc_shutdown();
}

void rpc_block_signals(void) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &set, NULL);
}

int rpc_wait_signal(void) {
    sigset_t set;
    int sig = 0;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGHUP);
    while (sigwait(&set, &sig) != 0) {
    }
    return sig;
}
