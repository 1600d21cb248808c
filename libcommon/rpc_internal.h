/* Internals shared by the rpc_*.c files of libcommon. Not for services. */
#ifndef UPSQUAD_RPC_INTERNAL_H
#define UPSQUAD_RPC_INTERNAL_H

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>
#include <grpc/slice.h>
#include <pthread.h>
#include <stdatomic.h>

#include "metrics.h"
#include "rpc.h"

/* ThreadSanitizer does not see the ordering the C core gives (it is not instrumented): what a
 * thread wrote before handing a tag to the core is visible to the thread that receives the
 * tag's completion. These annotations tell it so: release the tag before a batch or request,
 * acquire it when its completion arrives. No-ops in other builds. */
#ifdef __SANITIZE_THREAD__
void __tsan_acquire(void *addr);
void __tsan_release(void *addr);
#define RPC__TSAN_RELEASE(tag) __tsan_release((void *)(tag))
#define RPC__TSAN_ACQUIRE(tag) __tsan_acquire((void *)(tag))
#else
#define RPC__TSAN_RELEASE(tag) ((void)0)
#define RPC__TSAN_ACQUIRE(tag) ((void)0)
#endif

/* Every completion-queue tag starts with one of these, so one switch dispatches them. */
enum {
    RPC__TAG_REQUEST = 1, /* a requested call arrived (or the request failed at shutdown) */
    RPC__TAG_CLOSE,       /* RECV_CLOSE_ON_SERVER completed: the call is over */
    RPC__TAG_UNARY_SEND,  /* the reply batch of a unary call completed */
    RPC__TAG_STREAM_SEND, /* one stream message was written */
    RPC__TAG_STREAM_END,  /* the stream's status was sent */
    RPC__TAG_SHUTDOWN,    /* the server finished shutting down */
    RPC__TAG_UNKNOWN,     /* a call to a method nobody registered arrived */
    RPC__TAG_UNKNOWN_END, /* ... and was answered UNIMPLEMENTED */
    RPC__TAG_UNARY_RECV,  /* the read past a call's request message: end of stream, or a
                             second message (a protocol error) */
    RPC__TAG_STREAM_RECV, /* a bidi stream's read (rpc_stream_recv) completed */
};

typedef struct rpc__tag {
    int kind;
} rpc__tag;

/* Bump allocator: the first chunk lives inside the call, later ones are malloc'd. */
typedef struct rpc__chunk {
    struct rpc__chunk *next;
    size_t cap, used;
    _Alignas(16) unsigned char mem[];
} rpc__chunk;

typedef struct rpc__arena {
    rpc__chunk *head; /* newest first; the last one is the inline chunk (not freed) */
} rpc__arena;

void rpc__arena_init(rpc__arena *a, void *inline_mem, size_t inline_cap);
void *rpc__arena_alloc(rpc__arena *a, size_t n);
void rpc__arena_release(rpc__arena *a);

typedef struct rpc__method {
    rpc_method m;
    char *service; /* "pkg.Service", from the path */
    void *reg;     /* grpc_server_register_method handle */
    /* rpc_server_handled_total{method,code} series, filled lazily; index = status code */
    _Atomic(metric *) handled[17];
    metric *latency;
} rpc__method;

struct rpc_frame {
    atomic_int refs;
    grpc_slice slice; /* the encoded message; grpc refcounts it again per byte buffer */
};

struct rpc_call {
    rpc__tag t_close, t_send, t_end;
    atomic_int refs;
    struct rpc_server *srv;
    rpc__method *method;
    grpc_call *call;
    grpc_completion_queue *cq;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    ProtobufCMessage *req;
    const auth_identity *ident; /* points into `ident_mem` when authenticated */
    auth_identity ident_mem;
    char trace[40];
    int64_t start_ns;
    atomic_int cancelled; /* set by the CLOSE completion (client gone, deadline, shutdown) */
    int recv_close_cancelled;
    int early_close; /* RECV_CLOSE_ON_SERVER posted at arrival (blocking unary calls) */

    /* outgoing status */
    int code;
    char *message;  /* arena */
    void **details; /* arena array of packed google.protobuf.Any */
    size_t n_details, cap_details;
    grpc_slice status_slice; /* kept until the final batch completes */
    grpc_metadata trailer;   /* grpc-status-details-bin */
    int has_trailer;
    grpc_byte_buffer *reply; /* unary reply in flight */

    /* server streaming (guarded by mu) */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int is_stream;
    int counted_stream; /* counted in the server's active_streams */
    rpc_frame **q;
    size_t q_cap, q_head, q_len;
    int send_inflight;
    int hint_run;      /* frames sent in a row with the write-buffer hint (pump_locked) */
    size_t hint_bytes; /* and their bytes */
    int md_sent;
    int finishing;   /* a status is queued behind the frames */
    int end_started; /* the status batch has been started */
    int closed;      /* no more writes: cancelled or finished */
    int writer_waiting;
    grpc_byte_buffer *inflight;
    int detached;
    char *final_msg; /* heap copy of rpc_stream_finish's message (freed with the stream) */
    rpc_close_fn on_close;
    void *close_ud;
    struct rpc_call *dnext, *dprev; /* the server's list of detached streams */
    struct rpc__defer *defers;      /* rpc_call_defer hooks, newest first (arena) */

    /* the read after the request message (rpc_limits.c) */
    rpc__tag t_recv;
    grpc_byte_buffer *extra; /* a second request message: refused */
    /* a bidi stream's read in flight (rpc_stream_recv): the message, and done/ok guarded by mu */
    grpc_byte_buffer *rbuf;
    int recv_done, recv_ok;

    rpc__arena arena;
    _Alignas(16) unsigned char arena_inline[2048];
};

/* rpc_server.c */
void rpc__call_ref(rpc_call *c);
/* Packs the status and details into the call's trailer; used before sending a status. */
void rpc__prepare_status(rpc_call *c, grpc_op *op);
void rpc__account(rpc_call *c);
void rpc__server_detached_add(struct rpc_server *s, rpc_call *c);
void rpc__server_detached_remove(struct rpc_server *s, rpc_call *c);

/* rpc_call.c */
void rpc__call_run_defers(rpc_call *c);

/* rpc_stream.c */
int rpc__stream_init(rpc_call *c, int queue_cap);
void rpc__stream_on_send(rpc_call *c, int ok);
/* Whether the frame about to be sent (frame_len bytes, c->q_len frames behind it) goes with the
 * write-buffer hint: while frames wait behind it, up to RPC_STREAM_HINT_FRAMES frames or
 * RPC_STREAM_HINT_BYTES bytes in a row; c->mu held. */
#define RPC_STREAM_HINT_FRAMES 16
#define RPC_STREAM_HINT_BYTES 4096
int rpc__stream_hint(rpc_call *c, size_t frame_len);
void rpc__stream_on_end(rpc_call *c);
void rpc__stream_on_close(rpc_call *c);
void rpc__stream_destroy(rpc_call *c);
void rpc__stream_on_recv(rpc_call *c, int ok);

/* rpc_walk.c, rpc_limits.c: requests and responses checked against the rules of docs/rpc.md
 * ("Hardening"). The request walk returns 0, -1 (not a valid message) or a status code, with
 * msg naming the field. */
int rpc__check_request(const uint8_t *p, size_t n, const ProtobufCMessageDescriptor *d,
                       const rpc_field_limit *limits, size_t n_limits, size_t max_decoded,
                       char *msg, size_t msglen);
/* rpc_walk.c: 1 when a string field of msg (recursively) is not valid UTF-8; path names it. */
int rpc__response_bad_string(const ProtobufCMessage *msg, char *path, size_t plen, size_t cap,
                             int depth);
/* Walks, then decodes c->payload into c->req with alloc (the call arena); RPC_OK or the
 * status set. */
int rpc__decode_request(rpc_call *c, ProtobufCAllocator *alloc);
/* The same for one message of a stream: takes ownership of bb (destroyed); *out decoded with
 * alloc (NULL: the heap). */
int rpc__decode_message(rpc_call *c, grpc_byte_buffer *bb, ProtobufCAllocator *alloc,
                        ProtobufCMessage **out);
/* RPC_INTERNAL (status set) when a string field of resp is not valid UTF-8; not NDEBUG only. */
int rpc__check_response(rpc_call *c, const ProtobufCMessage *resp);
/* The same for a stream message: the stream is finished INTERNAL and the message not sent. */
int rpc__stream_check_response(rpc_call *c, const ProtobufCMessage *msg);
int rpc__md_count(const grpc_metadata_array *md, const char *key);
/* Starts the read that must find the end of a call's request stream; false when the core
 * refused the batch (the call is then dispatched at once). */
int rpc__expect_request_end(rpc_call *c);
const rpc_server_opts *rpc__server_opts(const struct rpc_server *s);
/* Defaults of the hardening options, and the channel arguments they become (at most
 * RPC__HARDENING_ARGS of them, written to args; returns how many). */
#define RPC__HARDENING_ARGS 6
void rpc__opts_hardening_defaults(rpc_server_opts *o);
size_t rpc__hardening_args(const rpc_server_opts *o, grpc_arg *args);
/* Every thread the server starts goes through this (pthread_create; tests replace it to make
 * a start fail part-way, deterministically). */
extern int (*rpc__thread_create)(pthread_t *, const pthread_attr_t *, void *(*)(void *), void *);

/* rpc_pool.c: the bounded pool running RPC_BLOCKING unary handlers */
typedef struct rpc__pool rpc__pool;
int rpc__pool_new(int threads, int cap, void (*run)(rpc_call *c), rpc__pool **out);
int rpc__pool_start(rpc__pool *p);
/* 0: queued (the call's reference moves to the pool); -1: full or stopping. */
int rpc__pool_submit(rpc__pool *p, rpc_call *c);
/* Drains the queue (each call is still run) and joins the threads. */
void rpc__pool_stop(rpc__pool *p);
void rpc__pool_free(rpc__pool *p);

/* rpc_client.c: for rpc_astream.c */
#include "rpc_client.h"
typedef struct rpc__call_md rpc__call_md; /* outgoing metadata of one call (heap) */
rpc__call_md *rpc__md_new(const rpc_call_opts *o);
grpc_metadata *rpc__md_items(rpc__call_md *m, size_t *n);
void rpc__md_delete(rpc__call_md *m);
grpc_call *rpc__client_call(rpc_channel *ch, grpc_completion_queue *cq, const char *method,
                            const rpc_call_opts *o);
void rpc__status_fill(rpc_status *st, grpc_status_code code, grpc_slice details,
                      const grpc_metadata_array *trailing);

/* rpc_health.c */
typedef struct rpc__health rpc__health;
int rpc__health_new(rpc__health **out);
void rpc__health_free(rpc__health *h);
int rpc__health_register(struct rpc_server *s);
rpc__health *rpc__server_health(struct rpc_server *s);
void rpc__health_set(rpc__health *h, const char *service, int serving);
void rpc__health_set_all(rpc__health *h, int serving);

/* rpc_reflect.c: grpc.reflection.v1 and v1alpha ServerReflectionInfo from opts->descriptors */
typedef struct rpc__reflect rpc__reflect;
/* Indexes the set (borrowed); RPC_EINVAL when it is not a FileDescriptorSet. */
int rpc__reflect_new(struct rpc_server *s, const void *set, size_t len, rpc__reflect **out);
void rpc__reflect_free(rpc__reflect *r);
int rpc__reflect_register(struct rpc_server *s, rpc__reflect *r);
/* the names of the services registered on s (borrowed; stable once the server started) */
size_t rpc__server_services(const struct rpc_server *s, const char **names, size_t cap);

/* rpc_codec.c: protobuf-c <-> grpc byte buffers */
#define RPC_MAX_NESTING 64 /* deepest message nesting a request may have */
grpc_byte_buffer *rpc__encode(const ProtobufCMessage *msg);
int rpc__decode(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d,
                ProtobufCAllocator *alloc, ProtobufCMessage **out);
/* The same from contiguous bytes: 0, -1 (not a valid message) or -2 (nested deeper than
 * RPC_MAX_NESTING). */
int rpc__decode_bytes(const uint8_t *p, size_t n, const ProtobufCMessageDescriptor *d,
                      ProtobufCAllocator *alloc, ProtobufCMessage **out);
grpc_slice rpc__encode_slice(const ProtobufCMessage *msg);
void rpc__install_log_hook(void);
int64_t rpc__now_ns(void);
/* Reads a whole (PEM) file; *out is NUL-terminated, caller frees. */
int rpc__read_file(const char *path, char **out, char *err, size_t errlen);

#endif
