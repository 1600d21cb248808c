/* gRPC server on the C core: typed handlers, no boilerplate in services.
 *
 * Threading model
 *   - `unary_threads` completion queues, one thread each. Unary calls are requested on
 *     these queues and their handlers run inline on the queue's thread: a call never changes
 *     thread, so a call needs no locks. A handler may block (Postgres): it only delays calls
 *     bound to its own queue.
 *   - A pool of `stream_workers` threads runs streaming handlers, so long streams never starve
 *     unary calls. Stream I/O (one send completion per message, never blocking) runs on the
 *     unary queues by default (`stream_threads` 0): every thread polling the core is a poller
 *     and extra pollers cost wake-ups. A service whose unary handlers block for long sets
 *     `stream_threads` > 0 to give stream I/O queues of its own. Streams beyond `max_streams`
 *     are refused with RESOURCE_EXHAUSTED.
 *   - A stream has at most one send in flight and a queue of at most `stream_queue` encoded
 *     frames. rpc_stream_send() blocks the handler while the queue is full (back-pressure);
 *     rpc_stream_push() never blocks and returns RPC_EFULL, so a producer on another thread
 *     (a NATS callback) learns that its subscriber is slow.
 *
 *   - Methods flagged RPC_BLOCKING run their unary handler on the blocking pool instead
 *     (blocking_workers threads, blocking_queue waiting, then RESOURCE_EXHAUSTED).
 *
 * Handlers receive the decoded request and the verified identity, fill the response (all its
 * memory from the call arena: rpc_alloc/rpc_strdup) and return RPC_OK or a status set with
 * rpc_error(). The library encodes, replies and frees.
 *
 * Contract: who owns what in a call
 *   - The arena (rpc_alloc, rpc_strdup, rpc_sprintf, rpc_new_msg, rpc_error, rpc_metadata,
 *     rpc_call_defer, rpc_call_allocator) is single-threaded: only the thread running the
 *     handler uses it, until the handler returns (a detached stream's producers never do).
 *     Nothing in the library allocates from it on another thread.
 *   - The request, identity, method, trace id and deadline are written before the handler
 *     runs and only read afterwards: any thread holding a reference may read them.
 *   - The outgoing status (code, message, details) belongs to the handler's thread for a
 *     unary call. For a stream it is guarded by the stream's lock: rpc_error, rpc_stream_finish
 *     (any thread) and the close completion (a queue thread) all take it.
 *   - The stream queue and its flags are guarded by the same lock; frames are refcounted and
 *     immutable once encoded.
 *   - The call itself is refcounted: the dispatch, the close completion, each batch in flight
 *     and each rpc_stream_detach hold a reference; the last rpc_call_unref frees it, after
 *     running the rpc_call_defer hooks.
 *   - Thread-safe from anywhere: rpc_cancelled, rpc_deadline_ms, rpc_identity, rpc_trace_id,
 *     rpc_method_path, rpc_metadata_copy, rpc_stream_push, rpc_stream_push_deferred,
 *     rpc_stream_kick, rpc_stream_queued, rpc_stream_finish, rpc_call_unref. */
#ifndef UPSQUAD_RPC_H
#define UPSQUAD_RPC_H

#include <protobuf-c/protobuf-c.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"

/* Status codes are the gRPC ones (grpc_status_code values). */
enum {
    RPC_OK = 0,
    RPC_CANCELLED = 1,
    RPC_UNKNOWN = 2,
    RPC_INVALID_ARGUMENT = 3,
    RPC_DEADLINE_EXCEEDED = 4,
    RPC_NOT_FOUND = 5,
    RPC_ALREADY_EXISTS = 6,
    RPC_PERMISSION_DENIED = 7,
    RPC_RESOURCE_EXHAUSTED = 8,
    RPC_FAILED_PRECONDITION = 9,
    RPC_ABORTED = 10,
    RPC_OUT_OF_RANGE = 11,
    RPC_UNIMPLEMENTED = 12,
    RPC_INTERNAL = 13,
    RPC_UNAVAILABLE = 14,
    RPC_DATA_LOSS = 15,
    RPC_UNAUTHENTICATED = 16,
};
/* Library return codes (negative; never sent on the wire). */
enum {
    RPC_EFULL = -1,   /* stream queue full: the subscriber is slow */
    RPC_ECLOSED = -2, /* stream cancelled / finished / client gone */
    RPC_ENOMEM = -3,
    RPC_EINVAL = -4,
    RPC_EDETACHED = -5, /* returned by a stream handler that handed its stream to a producer */
};

typedef struct rpc_server rpc_server;
typedef struct rpc_call rpc_call;
typedef struct rpc_frame rpc_frame;

typedef int (*rpc_unary_fn)(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                            void *ud);
typedef int (*rpc_stream_fn)(rpc_call *call, const ProtobufCMessage *req, void *ud);

/* RPC_BIDI_STREAM: the handler (a stream handler, req NULL) reads the client's messages with
 * rpc_stream_recv and writes with rpc_stream_send, on a stream worker. */
enum { RPC_UNARY = 0, RPC_SERVER_STREAM = 1, RPC_BIDI_STREAM = 2 };
enum { RPC_AUTH_REQUIRED = 0, RPC_AUTH_NONE = 1 };
/* rpc_method.flags. RPC_BLOCKING: the unary handler may block (Postgres, another service): it
 * runs on the blocking pool (blocking_workers threads, blocking_queue more calls waiting; a
 * call beyond that is answered RESOURCE_EXHAUSTED) instead of inline on a completion-queue
 * thread, so Health/Check and the non-blocking methods stay responsive. The handler sees
 * rpc_cancelled() as soon as the client goes, and its thread carries the call's deadline
 * (ctx.h), which `db` turns into the transaction's statement_timeout. */
enum { RPC_BLOCKING = 1 << 0 };

/* A bound on a repeated field of a request, enforced on the wire bytes before the request is
 * decoded (so a 4 MB message of two million empty strings costs a scan, not 100 MB): a request
 * with more elements is refused with INVALID_ARGUMENT naming the field. `field` is the path of
 * the field from the request message, nested fields dotted ("model_ids", "filter.tags"); the
 * bound applies to each message the field appears in. */
typedef struct rpc_field_limit {
    const char *field;
    uint32_t max_count;
} rpc_field_limit;

typedef struct rpc_method {
    const char *path; /* "/upsquad.runtime.v1.ModelRegistryService/ListModels" */
    int kind;         /* RPC_UNARY | RPC_SERVER_STREAM */
    int auth;         /* RPC_AUTH_REQUIRED (default) | RPC_AUTH_NONE */
    const ProtobufCMessageDescriptor *req_desc;
    const ProtobufCMessageDescriptor *resp_desc;
    rpc_unary_fn unary;
    rpc_stream_fn stream;
    void *ud;
    /* Request limits (docs/rpc.md, "Hardening"), checked before decoding: */
    const rpc_field_limit *limits; /* n_limits bounds on repeated fields (borrowed, static) */
    size_t n_limits;
    size_t max_decoded_bytes; /* estimated decoded size; 0: the server's max_decoded_bytes */
    int flags;                /* RPC_BLOCKING (set by designator: .flags = RPC_BLOCKING) */
} rpc_method;

typedef struct rpc_tls {
    const char *cert_file, *key_file; /* server certificate chain + key (PEM files) */
    const char *client_ca_file;       /* set: mTLS, a verified client certificate is required */
} rpc_tls;

typedef struct rpc_server_opts {
    const char *addr;           /* "127.0.0.1:50051"; port 0 picks one (rpc_server_port) */
    int unary_threads;          /* default 1: one poller (docs/benchmarks.md) */
    int stream_threads;         /* default 0: stream I/O shares the unary queues */
    int stream_workers;         /* default 16 */
    int max_streams;            /* default 1024 */
    int stream_queue;           /* frames per stream, default 256 */
    int max_recv_bytes;         /* default 4 MiB */
    int max_send_bytes;         /* default 16 MiB */
    int max_concurrent_streams; /* HTTP/2 streams per connection, default 256 */
    const rpc_tls *tls;         /* NULL: plaintext */
    const auth_verifier *auth;  /* NULL: every RPC_AUTH_REQUIRED method answers UNAUTHENTICATED */
    /* Hardening (docs/rpc.md): */
    size_t max_decoded_bytes;   /* a request's estimated decoded size, default 16 MiB */
    int max_connection_idle_ms; /* close a connection without calls after this, default 5 min */
    int keepalive_time_ms;      /* ping an idle connection after this, default 2 min */
    int keepalive_timeout_ms;   /* and close it when the ping is not answered, default 20 s */
    int handshake_timeout_ms;   /* a connection must finish its HTTP/2 (TLS) set-up, default 10 s */
    int max_health_watches;     /* concurrent grpc.health.v1.Health/Watch streams, default 64 */
    int max_reflection_streams; /* concurrent ServerReflectionInfo streams, default 16 */
    int blocking_workers;       /* threads running RPC_BLOCKING handlers, default 8 (started
                                   only when a method is RPC_BLOCKING) */
    int blocking_queue;         /* blocking calls waiting for a thread, default 64; more are
                                   refused with RESOURCE_EXHAUSTED */
    /* A serialized google.protobuf.FileDescriptorSet (protoc --descriptor_set_out
     * --include_imports; borrowed, must outlive the server): set, the server answers gRPC
     * server reflection (grpc.reflection.v1 and v1alpha) from it. rpc_descriptor_set is the
     * one the build embeds from proto/. */
    const void *descriptors;
    size_t descriptors_len;
} rpc_server_opts;

/* The FileDescriptorSet of every file under proto/, embedded by the build (libproto). */
extern const unsigned char rpc_descriptor_set[];
extern const size_t rpc_descriptor_set_len;

int rpc_server_new(const rpc_server_opts *opts, rpc_server **out, char *err, size_t errlen);
/* Methods are copied; register before rpc_server_start. */
int rpc_server_add(rpc_server *s, const rpc_method *methods, size_t n);
/* Also serves grpc.health.v1.Health (Check, Watch) for "" and each registered service, and
 * server reflection when opts->descriptors is set. */
int rpc_server_start(rpc_server *s, char *err, size_t errlen);
int rpc_server_port(const rpc_server *s);
/* service "" = overall. serving: 1 SERVING, 0 NOT_SERVING. Watchers are notified. */
void rpc_health_set(rpc_server *s, const char *service, int serving);
/* Graceful: health NOT_SERVING, stop accepting, let in-flight calls finish for up to
 * grace_ms, then cancel the rest; returns when every thread has stopped. */
void rpc_server_shutdown(rpc_server *s, int grace_ms);
void rpc_server_free(rpc_server *s);

/* Blocks SIGINT/SIGTERM/SIGHUP in the calling thread (call first in main, before any thread
 * starts, so every thread inherits the mask) ... */
void rpc_block_signals(void);
/* ... and waits for one of them; returns the signal number. */
int rpc_wait_signal(void);

/* ---- inside a handler ---- */
const auth_identity *rpc_identity(const rpc_call *call); /* NULL for RPC_AUTH_NONE methods */
/* The caller's tenant: the verified identity, whose org_id must name a tenant (a UUID), and with
 * RPC_TENANT_SUB its sub a member (a UUID) too. A token that does not is a bad token:
 * UNAUTHENTICATED (set on the call and returned), never a reason to retry. */
enum { RPC_TENANT_SUB = 1 << 0 };
int rpc_tenant(rpc_call *call, int flags, const auth_identity **id);
const char *rpc_method_path(const rpc_call *call);
const char *rpc_trace_id(const rpc_call *call); /* x-request-id or generated */
/* First value of a request metadata key (lowercase), copied into the arena (the handler's
 * thread only); NULL when absent. */
const char *rpc_metadata(const rpc_call *call, const char *key);
/* The same into buf (NUL-terminated, truncated to len - 1), from any thread: the value's
 * full length, or -1 when absent. */
int rpc_metadata_copy(const rpc_call *call, const char *key, char *buf, size_t len);
/* Milliseconds left before the client's deadline; INT64_MAX when none. */
int64_t rpc_deadline_ms(const rpc_call *call);
/* Non-zero once the client cancelled, the deadline passed or the connection broke. */
int rpc_cancelled(const rpc_call *call);

/* Call-scoped arena: freed after the reply is sent. */
void *rpc_alloc(rpc_call *call, size_t n); /* zeroed */
char *rpc_strdup(rpc_call *call, const char *s);
char *rpc_strndup(rpc_call *call, const char *s, size_t n);
char *rpc_sprintf(rpc_call *call, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A zero-initialised message of `desc` in the arena. */
ProtobufCMessage *rpc_new_msg(rpc_call *call, const ProtobufCMessageDescriptor *desc);
/* The arena as a protobuf-c allocator (itself in the arena): for pbjson_*_from_json_a and
 * protobuf_c_message_unpack, so a tree built for the response needs no copy and no free.
 * NULL on ENOMEM. */
ProtobufCAllocator *rpc_call_allocator(rpc_call *call);

/* Runs fn(arg) when the call is freed: after its reply was sent or it ended any other way,
 * once nothing reads the response any more; hooks run in reverse order of registration. For
 * memory the response borrows (a PGresult its strings point into: a
 * two-line function calling PQclear, registered with the result as arg). RPC_OK, or
 * RPC_ENOMEM/RPC_EINVAL and nothing is registered (the caller still owns arg). Called from the
 * thread running the handler. */
typedef void (*rpc_defer_fn)(void *arg);
int rpc_call_defer(rpc_call *call, rpc_defer_fn fn, void *arg);

/* A unary handler's response given already encoded (the wire bytes of the method's response
 * type, e.g. kept from an earlier call): the bytes are copied and sent instead of the response
 * message, which is then neither checked nor encoded (the caller vouches for the bytes: they
 * were encoded from a message that passed the checks). Returns RPC_OK, or RPC_EINVAL (not a
 * unary call, or given twice) / RPC_ENOMEM and nothing changes. A status set with rpc_error()
 * still wins: no response is sent then. Called from the thread running the handler. */
int rpc_reply_encoded(rpc_call *call, const void *data, size_t len);

/* Sets the status to send and returns `code`: `return rpc_error(c, RPC_NOT_FOUND, "...")`.
 * A status set with rpc_error() is final: the call fails with it even when the handler then
 * returns RPC_OK (no response is sent with a non-OK status). A unary handler that returns
 * RPC_OK after the deadline passed answers DEADLINE_EXCEEDED: nobody waits for the reply. */
int rpc_error(rpc_call *call, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Adds a detail (packed into google.protobuf.Any, type URL
 * "type.googleapis.com/<full name>") to the google.rpc.Status sent in grpc-status-details-bin. */
int rpc_error_detail(rpc_call *call, const ProtobufCMessage *detail);

/* ---- server streaming ---- */
/* Encodes msg once and queues it; blocks while the queue is full. RPC_OK or RPC_ECLOSED. */
int rpc_stream_send(rpc_call *call, const ProtobufCMessage *msg);
/* The same, waiting at most wait_ms (< 0: forever) for room: RPC_EFULL when the queue stayed
 * full that long (nothing was queued; a subscriber that stopped reading), RPC_ECLOSED, or
 * RPC_OK. Callers bound what one stalled client can hold: a thread, its memory. */
int rpc_stream_send_wait(rpc_call *call, const ProtobufCMessage *msg, int64_t wait_ms);

/* Bidirectional streams: the next message from the client, decoded (and checked against the
 * method's limits like any request) into *out, which the caller frees with
 * protobuf_c_message_free_unpacked(*out, NULL). Blocks until a message arrives. RPC_OK with
 * *out NULL: the client has half-closed (it sends no more; the handler may still write).
 * RPC_ECLOSED: the call is over (cancelled, deadline, connection gone). A message that is not
 * valid sets INVALID_ARGUMENT on the call and returns it. RPC_EINVAL: not a bidi call. Only the
 * thread running the handler reads, one message at a time. */
int rpc_stream_recv(rpc_call *call, ProtobufCMessage **out);

/* Refcounted, encoded-once frames: one event encoded once, pushed to many streams. */
rpc_frame *rpc_frame_encode(const ProtobufCMessage *msg); /* refcount 1; NULL on ENOMEM */
rpc_frame *rpc_frame_ref(rpc_frame *f);
void rpc_frame_unref(rpc_frame *f);
size_t rpc_frame_len(const rpc_frame *f);

/* Detaching: a stream handler calls rpc_stream_detach(), hands the returned call to a
 * producer and returns RPC_EDETACHED; the worker thread is released and the stream stays
 * open until rpc_stream_finish(). `on_close` runs once (on an I/O thread; must not block)
 * when the stream ends for any reason (client gone, deadline, shutdown, finish), so the
 * producer can unsubscribe. The producer owns one reference: rpc_call_unref() when done. */
typedef void (*rpc_close_fn)(rpc_call *call, void *ud);
rpc_call *rpc_stream_detach(rpc_call *call, rpc_close_fn on_close, void *ud);
/* Never blocks. Takes no ownership of f (it is ref'd). RPC_OK, RPC_EFULL or RPC_ECLOSED. */
int rpc_stream_push(rpc_call *call, rpc_frame *f);
/* Sharing writes: a send started on a stream with nothing queued behind it is written at once,
 * on its own (a write syscall per stream and frame when a fan-out pushes one frame to many idle
 * streams). rpc_stream_push_deferred queues like rpc_stream_push but starts no send on an idle
 * stream; rpc_stream_kick then starts it, every queued frame but the last with the transport's
 * write-buffer hint, so the frames queued meanwhile go out in one write. A producer that defers
 * must kick every stream it deferred to once its batch ends (a stream with a send in flight
 * needs no kick: that send's completion starts the next). Any thread; never blocks. */
int rpc_stream_push_deferred(rpc_call *call, rpc_frame *f);
void rpc_stream_kick(rpc_call *call);
/* Like rpc_stream_send_wait for an encoded frame (f is ref'd, not taken). */
int rpc_stream_push_wait(rpc_call *call, rpc_frame *f, int64_t wait_ms);
/* Queue depth now (frames not yet written), for gap accounting. */
size_t rpc_stream_queued(rpc_call *call);
/* Free queue slots now: pushes that would succeed. Only grows meanwhile (the writer drains), so
 * a stream's one producer can push that many without RPC_EFULL (two frames that must go
 * together: a StreamGap and the frame it names). */
size_t rpc_stream_room(rpc_call *call);
/* Sends the final status after the queued frames. Idempotent. */
int rpc_stream_finish(rpc_call *call, int code, const char *message);
/* Ends the stream at once with `code`, dropping the queued frames (a subscriber that stopped
 * reading: its memory is returned and it learns why). Idempotent; never blocks. */
int rpc_stream_abort(rpc_call *call, int code, const char *message);
void rpc_call_unref(rpc_call *call);

#endif
