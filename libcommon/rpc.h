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
 * Handlers receive the decoded request and the verified identity, fill the response (all its
 * memory from the call arena: rpc_alloc/rpc_strdup) and return RPC_OK or a status set with
 * rpc_error(). The library encodes, replies and frees. */
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

enum { RPC_UNARY = 0, RPC_SERVER_STREAM = 1 };
enum { RPC_AUTH_REQUIRED = 0, RPC_AUTH_NONE = 1 };

typedef struct rpc_method {
    const char *path; /* "/upsquad.runtime.v1.ModelRegistryService/ListModels" */
    int kind;         /* RPC_UNARY | RPC_SERVER_STREAM */
    int auth;         /* RPC_AUTH_REQUIRED (default) | RPC_AUTH_NONE */
    const ProtobufCMessageDescriptor *req_desc;
    const ProtobufCMessageDescriptor *resp_desc;
    rpc_unary_fn unary;
    rpc_stream_fn stream;
    void *ud;
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
} rpc_server_opts;

int rpc_server_new(const rpc_server_opts *opts, rpc_server **out, char *err, size_t errlen);
/* Methods are copied; register before rpc_server_start. */
int rpc_server_add(rpc_server *s, const rpc_method *methods, size_t n);
/* Also serves grpc.health.v1.Health (Check, Watch) for "" and each registered service. */
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
const char *rpc_method_path(const rpc_call *call);
const char *rpc_trace_id(const rpc_call *call); /* x-request-id or generated */
/* First value of a request metadata key (lowercase), copied; NULL when absent. */
const char *rpc_metadata(const rpc_call *call, const char *key);
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

/* Sets the status to send and returns `code`: `return rpc_error(c, RPC_NOT_FOUND, "...")`. */
int rpc_error(rpc_call *call, int code, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Adds a detail (packed into google.protobuf.Any, type URL
 * "type.googleapis.com/<full name>") to the google.rpc.Status sent in grpc-status-details-bin. */
int rpc_error_detail(rpc_call *call, const ProtobufCMessage *detail);

/* ---- server streaming ---- */
/* Encodes msg once and queues it; blocks while the queue is full. RPC_OK or RPC_ECLOSED. */
int rpc_stream_send(rpc_call *call, const ProtobufCMessage *msg);

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
/* Queue depth now (frames not yet written), for gap accounting. */
size_t rpc_stream_queued(rpc_call *call);
/* Sends the final status after the queued frames. Idempotent. */
int rpc_stream_finish(rpc_call *call, int code, const char *message);
/* Ends the stream at once with `code`, dropping the queued frames (a subscriber that stopped
 * reading: its memory is returned and it learns why). Idempotent; never blocks. */
int rpc_stream_abort(rpc_call *call, int code, const char *message);
void rpc_call_unref(rpc_call *call);

#endif
