/* The yardstick for libcommon's RPC layer: an echo server written directly on the gRPC C core.
 *
 *   rpc-bare-echo ADDR [THREADS]      e.g. rpc-bare-echo 127.0.0.1:0 1
 *
 * THREADS (default 1) completion queues, one thread each. One thread is the fastest setting for
 * one client connection on a 2-core machine: every thread in grpc_completion_queue_next is a
 * poller, and more pollers for one connection only add cross-thread wake-ups.
 *
 * Serves /upsquad.test.v1.EchoService/PublicEcho and /PublicStream with the semantics of
 * tests/proto/upsquad/test/v1/echo.proto (text echoed, `payload_bytes` of payload, a stream
 * of `count` messages with seq 0..count-1, then OK; `meta` echoed). delay_ms and fail_code are
 * outside the yardstick and answered with UNIMPLEMENTED. Prints "port=N" once listening; stops on
 * SIGTERM/SIGINT.
 *
 * What makes it fast, and what a competent C-core user does anyway:
 *   - one completion queue per thread; a call is requested on, bound to and driven by one
 *     queue, so no call state is ever shared between threads and nothing is locked;
 *   - methods registered with GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER: the request arrives
 *     with the new-call event, and a unary call is answered with a single batch (initial
 *     metadata, message, status, close) — one completion per call;
 *   - several calls requested ahead per queue and method, so arrivals never wait for a slot;
 *   - unary requests are decoded into a per-thread bump arena (no malloc per field); responses
 *     are packed straight into the slice that is sent;
 *   - a stream keeps exactly one send in flight and carries its status on the last message. */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "upsquad/test/v1/echo.pb-c.h"

#define ECHO_PATH_UNARY "/upsquad.test.v1.EchoService/PublicEcho"
#define ECHO_PATH_STREAM "/upsquad.test.v1.EchoService/PublicStream"

/* Calls requested ahead per queue and method: enough that a burst of new calls (the load
 * generator's concurrency is spread over the queues) never waits for a request slot. */
#define AHEAD_UNARY 32
#define AHEAD_STREAM 8
#define MAX_THREADS 64
/* Largest payload_bytes honoured; the response must stay under the client's default 4 MiB
 * receive limit. */
#define MAX_PAYLOAD (1024 * 1024)
/* Per-thread arena for decoding unary requests; bigger requests fall back to malloc. */
#define ARENA_BYTES (64 * 1024)
#define SHUTDOWN_GRACE_MS 2000

/* M_OTHER: any unregistered path, answered UNIMPLEMENTED (the core would otherwise hold such
 * calls until their deadline). */
enum { M_UNARY = 0, M_STREAM = 1, M_OTHER = 2 };
enum { EV_NEW, EV_SEND, EV_CLOSE };

typedef struct echo_call echo_call;
typedef struct worker worker;

/* A completion-queue tag: which event of which call. */
typedef struct ev {
    int kind;
    echo_call *call;
} ev;

struct echo_call {
    worker *w;
    int method;
    grpc_call *call;
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_call_details details; /* M_OTHER only */
    grpc_byte_buffer *req_bb;
    ev ev_new, ev_send, ev_close;
    int close_cancelled;
    /* streaming state */
    Upsquad__Test__V1__EchoRequest *req; /* owned (system allocator) while streaming */
    int32_t next_seq;
    int send_pending;   /* a send batch is in flight */
    int close_received; /* RECV_CLOSE_ON_SERVER completed */
    int finished;       /* status sent, or the call failed: nothing more to send */
    grpc_byte_buffer *send_bb;
    echo_call *next_free;
};

struct worker {
    grpc_completion_queue *cq;
    pthread_t thread;
    echo_call *free_list;
    /* bump arena for unary request decoding; reset after each call */
    _Alignas(16) unsigned char arena[ARENA_BYTES];
    size_t arena_used;
};

static grpc_server *g_server;
static void *g_method[2];
static const int g_ahead[3] = {AHEAD_UNARY, AHEAD_STREAM, 1};
/* Zeroed bytes the payloads point into (.bss: costs no memory until read): encoded by copy,
 * never written. */
static uint8_t g_payload[MAX_PAYLOAD];

/* ---- per-thread arena allocator for protobuf-c ---- */

static void *arena_alloc(void *ud, size_t n) {
    worker *w = ud;
    size_t need = (n + 15) & ~(size_t)15;
    if (need <= ARENA_BYTES - w->arena_used) {
        void *p = w->arena + w->arena_used;
        w->arena_used += need;
        return p;
    }
    return malloc(n);
}

static void arena_free(void *ud, void *p) {
    worker *w = ud;
    unsigned char *c = p;
    if (c >= w->arena && c < w->arena + ARENA_BYTES) return;
    free(p);
}

/* ---- calls ---- */

static echo_call *call_get(worker *w, int method) {
    echo_call *c = w->free_list;
    if (c)
        w->free_list = c->next_free;
    else if (!(c = malloc(sizeof *c)))
        return NULL;
    memset(c, 0, sizeof *c);
    c->w = w;
    c->method = method;
    c->ev_new = (ev){EV_NEW, c};
    c->ev_send = (ev){EV_SEND, c};
    c->ev_close = (ev){EV_CLOSE, c};
    grpc_metadata_array_init(&c->md);
    grpc_call_details_init(&c->details);
    return c;
}

/* Returns the slot to the worker's free list; the list is bounded by the peak number of live
 * calls on this queue and freed at exit. */
static void call_put(echo_call *c) {
    worker *w = c->w;
    grpc_metadata_array_destroy(&c->md);
    grpc_call_details_destroy(&c->details);
    if (c->req_bb) grpc_byte_buffer_destroy(c->req_bb);
    if (c->send_bb) grpc_byte_buffer_destroy(c->send_bb);
    if (c->req) upsquad__test__v1__echo_request__free_unpacked(c->req, NULL);
    if (c->call) grpc_call_unref(c->call);
    c->next_free = w->free_list;
    w->free_list = c;
}

/* Asks the core for the next call of `method` on this worker's queue. 0 or -1 (shutdown). */
static int call_request(worker *w, int method) {
    echo_call *c = call_get(w, method);
    if (!c) return -1;
    grpc_call_error e = method == M_OTHER
                            ? grpc_server_request_call(g_server, &c->call, &c->details, &c->md,
                                                       w->cq, w->cq, &c->ev_new)
                            : grpc_server_request_registered_call(
                                  g_server, g_method[method], &c->call, &c->deadline, &c->md,
                                  &c->req_bb, w->cq, w->cq, &c->ev_new);
    if (e != GRPC_CALL_OK) {
        call_put(c);
        return -1;
    }
    return 0;
}

/* Decodes the request; a single-slice buffer (the usual case) is decoded in place. */
static Upsquad__Test__V1__EchoRequest *decode_request(grpc_byte_buffer *bb,
                                                      ProtobufCAllocator *alloc) {
    grpc_byte_buffer_reader r;
    grpc_slice *first;
    Upsquad__Test__V1__EchoRequest *req = NULL;
    if (!bb || !grpc_byte_buffer_reader_init(&r, bb)) return NULL;
    size_t len = grpc_byte_buffer_length(bb);
    if (len == 0) {
        req = upsquad__test__v1__echo_request__unpack(alloc, 0, (const uint8_t *)"");
    } else if (grpc_byte_buffer_reader_peek(&r, &first) && GRPC_SLICE_LENGTH(*first) == len) {
        req = upsquad__test__v1__echo_request__unpack(alloc, len, GRPC_SLICE_START_PTR(*first));
    } else {
        /* peek consumed the first slice: read everything from a fresh reader */
        grpc_byte_buffer_reader_destroy(&r);
        if (!grpc_byte_buffer_reader_init(&r, bb)) return NULL;
        grpc_slice all = grpc_byte_buffer_reader_readall(&r);
        req = upsquad__test__v1__echo_request__unpack(alloc, GRPC_SLICE_LENGTH(all),
                                                      GRPC_SLICE_START_PTR(all));
        grpc_slice_unref(all);
    }
    grpc_byte_buffer_reader_destroy(&r);
    return req;
}

/* Checks the fields the yardstick honours. GRPC_STATUS_OK or a status with its message. */
static grpc_status_code check_request(const Upsquad__Test__V1__EchoRequest *req, int method,
                                      const char **msg) {
    if (!req) return *msg = "request: not a valid EchoRequest", GRPC_STATUS_INVALID_ARGUMENT;
    if (req->payload_bytes < 0 || req->payload_bytes > MAX_PAYLOAD)
        return *msg = "payload_bytes: must be in [0, 1048576]", GRPC_STATUS_INVALID_ARGUMENT;
    if (method == M_STREAM && req->count < 0)
        return *msg = "count: must be >= 0", GRPC_STATUS_INVALID_ARGUMENT;
    if (req->delay_ms != 0)
        return *msg = "delay_ms: not served by the bare echo server", GRPC_STATUS_UNIMPLEMENTED;
    if (req->fail_code != 0)
        return *msg = "fail_code: not served by the bare echo server", GRPC_STATUS_UNIMPLEMENTED;
    return GRPC_STATUS_OK;
}

/* Packs the response straight into the slice that will be sent. Caller destroys the buffer. */
static grpc_byte_buffer *encode_response(const Upsquad__Test__V1__EchoRequest *req, int32_t seq) {
    Upsquad__Test__V1__EchoResponse resp = UPSQUAD__TEST__V1__ECHO_RESPONSE__INIT;
    resp.text = req->text;
    resp.seq = seq;
    resp.payload.data = (uint8_t *)g_payload;
    resp.payload.len = (size_t)req->payload_bytes;
    resp.meta = req->meta; /* borrowed: packed before the request is freed */
    size_t n = upsquad__test__v1__echo_response__get_packed_size(&resp);
    grpc_slice s = grpc_slice_malloc(n);
    upsquad__test__v1__echo_response__pack(&resp, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

/* Unary calls and unregistered paths: one batch answers and closes the call. */
static void unary_start(echo_call *c) {
    worker *w = c->w;
    ProtobufCAllocator alloc = {arena_alloc, arena_free, w};
    Upsquad__Test__V1__EchoRequest *req = NULL;
    const char *msg = "method: not served by this server";
    grpc_status_code code = GRPC_STATUS_UNIMPLEMENTED;
    if (c->method == M_UNARY) {
        req = decode_request(c->req_bb, &alloc);
        msg = NULL;
        code = check_request(req, M_UNARY, &msg);
    }
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (code == GRPC_STATUS_OK) {
        c->send_bb = encode_response(req, 0);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->send_bb;
    }
    grpc_slice details = grpc_slice_from_static_string(msg ? msg : "");
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = code;
    ops[n++].data.send_status_from_server.status_details = msg ? &details : NULL;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->close_cancelled;
    if (req) upsquad__test__v1__echo_request__free_unpacked(req, &alloc);
    w->arena_used = 0;
    if (grpc_call_start_batch(c->call, ops, n, &c->ev_send, NULL) != GRPC_CALL_OK) call_put(c);
}

/* Starts the next send of a stream: the next message (the status rides on the last one), or
 * the status alone for an empty stream or a rejected request. */
static void stream_send_next(echo_call *c, grpc_status_code code, const char *msg) {
    grpc_op ops[3];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (c->next_seq == 0) ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (code == GRPC_STATUS_OK && c->next_seq < c->req->count) {
        c->send_bb = encode_response(c->req, c->next_seq);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->send_bb;
        c->next_seq++;
    }
    grpc_slice details = grpc_slice_from_static_string(msg ? msg : "");
    if (code != GRPC_STATUS_OK || c->next_seq == c->req->count) {
        ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
        ops[n].data.send_status_from_server.status = code;
        ops[n++].data.send_status_from_server.status_details = msg ? &details : NULL;
        c->finished = 1;
    }
    c->send_pending = 1;
    if (grpc_call_start_batch(c->call, ops, n, &c->ev_send, NULL) != GRPC_CALL_OK) {
        c->send_pending = 0;
        c->finished = 1;
    }
}

/* A stream is released once nothing is in flight and the close has been seen. */
static void stream_maybe_release(echo_call *c) {
    if (!c->send_pending && c->close_received && c->finished) call_put(c);
}

static void stream_start(echo_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &c->close_cancelled;
    if (grpc_call_start_batch(c->call, &op, 1, &c->ev_close, NULL) != GRPC_CALL_OK) {
        call_put(c);
        return;
    }
    c->req = decode_request(c->req_bb, NULL);
    const char *msg = NULL;
    grpc_status_code code = check_request(c->req, M_STREAM, &msg);
    stream_send_next(c, code, msg);
    stream_maybe_release(c);
}

static void on_event(worker *w, ev *e, int ok) {
    echo_call *c = e->call;
    switch (e->kind) {
    case EV_NEW:
        if (!ok) { /* server shutting down: the request was withdrawn */
            call_put(c);
            return;
        }
        call_request(w, c->method); /* keep the number of requested calls constant */
        if (c->method != M_STREAM)
            unary_start(c);
        else
            stream_start(c);
        return;
    case EV_SEND:
        if (c->method != M_STREAM) { /* the one batch, close included: the call is over */
            call_put(c);
            return;
        }
        c->send_pending = 0;
        grpc_byte_buffer_destroy(c->send_bb);
        c->send_bb = NULL;
        if (!ok || c->close_received) c->finished = 1;
        if (!c->finished) stream_send_next(c, GRPC_STATUS_OK, NULL);
        stream_maybe_release(c);
        return;
    case EV_CLOSE: /* the client went away, the deadline passed, or the status went out */
        c->close_received = 1;
        if (!c->send_pending) c->finished = 1;
        stream_maybe_release(c);
        return;
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    for (;;) {
        grpc_event e = grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (e.type == GRPC_QUEUE_SHUTDOWN) break;
        if (e.type == GRPC_OP_COMPLETE) on_event(w, e.tag, e.success);
    }
    return NULL;
}

static grpc_completion_queue *nonpolling_cq(void) {
    grpc_completion_queue_attributes attr = {GRPC_CQ_CURRENT_VERSION, GRPC_CQ_NEXT,
                                             GRPC_CQ_NON_POLLING, NULL};
    return grpc_completion_queue_create(grpc_completion_queue_factory_lookup(&attr), &attr, NULL);
}

static int wait_signal(void) {
    sigset_t set;
    int sig = 0;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    while (sigwait(&set, &sig) != 0) {
    }
    return sig;
}

int main(int argc, char **argv) {
    static worker workers[MAX_THREADS];
    int rc = 1, nthreads = argc > 2 ? atoi(argv[2]) : 1;
    if (argc < 2 || argc > 3 || nthreads < 1 || nthreads > MAX_THREADS) {
        fprintf(stderr, "usage: %s ADDR [THREADS 1..%d]\n", argv[0], MAX_THREADS);
        return 2;
    }
    /* Every thread (ours and the core's) inherits the mask: signals reach only sigwait. */
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGTERM);
    sigaddset(&set, SIGINT);
    pthread_sigmask(SIG_BLOCK, &set, NULL);

    grpc_init();
    g_server = grpc_server_create(NULL, NULL);
    g_method[M_UNARY] = grpc_server_register_method(g_server, ECHO_PATH_UNARY, NULL,
                                                    GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    g_method[M_STREAM] = grpc_server_register_method(g_server, ECHO_PATH_STREAM, NULL,
                                                     GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    grpc_completion_queue *shutdown_cq = nonpolling_cq();
    grpc_server_register_completion_queue(g_server, shutdown_cq, NULL);
    for (int i = 0; i < nthreads; i++) {
        workers[i].cq = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(g_server, workers[i].cq, NULL);
    }
    grpc_server_credentials *creds = grpc_insecure_server_credentials_create();
    int port = grpc_server_add_http2_port(g_server, argv[1], creds);
    grpc_server_credentials_release(creds);
    if (port <= 0) {
        fprintf(stderr, "rpc-bare-echo: cannot listen on %s\n", argv[1]);
        grpc_server_destroy(g_server);
        goto done;
    }
    grpc_server_start(g_server);
    for (int i = 0; i < nthreads; i++)
        for (int m = 0; m < 3; m++)
            for (int k = 0; k < g_ahead[m]; k++)
                call_request(&workers[i], m);
    for (int i = 0; i < nthreads; i++)
        pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]);
    printf("port=%d\n", port);
    fflush(stdout);

    wait_signal();
    /* In-flight calls get a grace period, then are cancelled. */
    static int shutdown_tag;
    grpc_server_shutdown_and_notify(g_server, shutdown_cq, &shutdown_tag);
    grpc_event e = grpc_completion_queue_next(
        shutdown_cq,
        gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                     gpr_time_from_millis(SHUTDOWN_GRACE_MS, GPR_TIMESPAN)),
        NULL);
    if (e.type == GRPC_QUEUE_TIMEOUT) {
        grpc_server_cancel_all_calls(g_server);
        grpc_completion_queue_next(shutdown_cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    }
    grpc_server_destroy(g_server);
    for (int i = 0; i < nthreads; i++)
        grpc_completion_queue_shutdown(workers[i].cq);
    for (int i = 0; i < nthreads; i++) {
        pthread_join(workers[i].thread, NULL);
        grpc_completion_queue_destroy(workers[i].cq);
        for (echo_call *c = workers[i].free_list, *next; c; c = next) {
            next = c->next_free;
            free(c);
        }
    }
    rc = 0;
done:
    grpc_completion_queue_shutdown(shutdown_cq);
    while (
        grpc_completion_queue_next(shutdown_cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
        GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(shutdown_cq);
    grpc_shutdown_blocking();
    return rc;
}
