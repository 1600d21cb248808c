/* Server streaming: a bounded queue of encoded frames per stream with exactly one send in
 * flight (the C core allows no more), fed by a blocking writer (the handler) or by a
 * non-blocking producer on any thread (a detached stream). The next send starts on the
 * completion of the previous one, on the stream's completion-queue thread.
 *
 * Locking: c->mu guards the queue and the flags below it in struct rpc_call, and, for a
 * stream, the outgoing status (c->code, c->message: the handler's rpc_error, a producer's
 * rpc_stream_finish and the close completion meet there). Callbacks (on_close) run without
 * it, and so does grpc_call_start_batch: the next batch is chosen under it (pump_locked) and
 * started after it is released (pump_start), so a producer never waits on it for a write. Nothing
 * here allocates from the call's arena, which belongs to the handler's thread: a final message from
 * rpc_stream_finish is a heap copy. */
#include <assert.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "rpc_internal.h"
#include "util.h"

rpc_frame *rpc_frame_encode(const ProtobufCMessage *msg) {
    rpc_frame *f = malloc(sizeof *f);
    if (f == NULL) return NULL;
    atomic_init(&f->refs, 1);
    f->slice = rpc__encode_slice(msg);
    return f;
}

rpc_frame *rpc_frame_ref(rpc_frame *f) {
    atomic_fetch_add_explicit(&f->refs, 1, memory_order_relaxed);
    return f;
}

void rpc_frame_unref(rpc_frame *f) {
    if (f == NULL) return;
    int was = atomic_fetch_sub_explicit(&f->refs, 1, memory_order_acq_rel);
    assert(was > 0 && "rpc_frame_unref without a reference");
    if (was == 1) {
        grpc_slice_unref(f->slice);
        free(f);
    }
}

size_t rpc_frame_len(const rpc_frame *f) {
    return GRPC_SLICE_LENGTH(f->slice);
}

int rpc__stream_init(rpc_call *c, int queue_cap) {
    c->q = calloc((size_t)queue_cap, sizeof *c->q);
    if (c->q == NULL) return -1;
    c->q_cap = (size_t)queue_cap;
    pthread_mutex_init(&c->mu, NULL);
    util_cond_init_monotonic(&c->cv); /* rpc_stream_push_wait's bound */
    c->is_stream = 1;
    return 0;
}

void rpc__stream_destroy(rpc_call *c) {
    while (c->q_len > 0) {
        rpc_frame_unref(c->q[c->q_head]);
        c->q_head = (c->q_head + 1) % c->q_cap;
        c->q_len--;
    }
    if (c->inflight) grpc_byte_buffer_destroy(c->inflight);
    free(c->q);
    free(c->final_msg);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
}

static void drop_queue_locked(rpc_call *c) {
    while (c->q_len > 0) {
        rpc_frame_unref(c->q[c->q_head]);
        c->q_head = (c->q_head + 1) % c->q_cap;
        c->q_len--;
    }
}

/* The next batch of a stream, chosen under c->mu and started after it is released: the C
 * core's start_batch can write to the socket, and a producer pushing to the same stream would
 * otherwise sleep on c->mu for that long (a futex wait and wake per frame on the relay paths).
 * Order needs no lock: send_inflight is set with the choice, so no other batch can start until
 * this one's completion. */
typedef struct send_batch {
    grpc_op ops[3];
    size_t n;
    rpc__tag *tag;
} send_batch;

/* A stream's run of frames sent with the write-buffer hint ends after RPC_STREAM_HINT_FRAMES
 * frames or RPC_STREAM_HINT_BYTES bytes (rpc_internal.h): the next frame goes without it and
 * the transport writes what it holds. Without a bound, a subscriber whose whole burst was
 * queued before its sends began passed every frame of it to the transport hinted: with 1,000
 * such streams the completion-queue thread spent about 300 ms handing 200,000 frames to the
 * transport while the socket stayed idle, and only then did the first byte go out
 * (docs/benchmarks.md, "stream-hub fan-out": the hub's slow rounds). Bounded, the writes start
 * after a stream's first frames and overlap the rest. c->mu held; frame_len: the frame about
 * to be sent, with c->q_len frames behind it. */
int rpc__stream_hint(rpc_call *c, size_t frame_len) {
    if (c->q_len > 0 && c->hint_run < RPC_STREAM_HINT_FRAMES &&
        c->hint_bytes < RPC_STREAM_HINT_BYTES) {
        c->hint_run++;
        c->hint_bytes += frame_len;
        return 1;
    }
    c->hint_run = 0;
    c->hint_bytes = 0;
    return 0;
}

/* Picks the next batch if none is in flight: the next frame (with the status too when it is
 * the last one and the stream is finishing), or the status alone. Returns 1 when *b is to be
 * started with pump_start (the call holds a reference for it). */
static int pump_locked(rpc_call *c, send_batch *b) {
    b->n = 0;
    b->tag = &c->t_send;
    if (c->send_inflight || c->end_started || c->closed) return 0;
    if (c->q_len == 0 && !c->finishing) return 0;
    memset(b->ops, 0, sizeof b->ops);
    if (!c->md_sent) b->ops[b->n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (c->q_len > 0) {
        rpc_frame *f = c->q[c->q_head];
        c->q_head = (c->q_head + 1) % c->q_cap;
        c->q_len--;
        size_t flen = GRPC_SLICE_LENGTH(f->slice);
        c->inflight = grpc_raw_byte_buffer_create(&f->slice, 1);
        rpc_frame_unref(f);
        b->ops[b->n].op = GRPC_OP_SEND_MESSAGE;
        /* more frames wait behind this one: let the transport hold its bytes for the next
         * write (one write syscall for several messages, each still its own message); the
         * last frame of a run, or of a bounded run of hinted frames (rpc__stream_hint), goes
         * without the hint and flushes them all. Never the frame that carries the response
         * headers: chttp2 starts no write for a server's initial metadata whose batch holds a
         * hinted message, and that batch completes only once the headers are written, so the
         * stream's next frame (picked on that completion) would wait for another stream's
         * write on the connection, forever on a connection of its own: a stream whose first
         * frames were queued together received nothing */
        if (c->md_sent && rpc__stream_hint(c, flen)) b->ops[b->n].flags = GRPC_WRITE_BUFFER_HINT;
        b->ops[b->n++].data.send_message.send_message = c->inflight;
    }
    if (c->q_len == 0 && c->finishing) {
        rpc__prepare_status(c, &b->ops[b->n++]);
        c->end_started = 1;
        b->tag = &c->t_end;
    }
    c->md_sent = 1;
    c->send_inflight = 1;
    rpc__call_ref(c);
    return 1;
}

/* Without c->mu. The caller holds a reference of its own across the call. */
static void pump_start(rpc_call *c, send_batch *b) {
    RPC__TSAN_RELEASE(b->tag);
    grpc_call_error e = grpc_call_start_batch(c->call, b->ops, b->n, b->tag, NULL);
    if (e == GRPC_CALL_OK) return;
    log_error("rpc.stream", "stream batch refused: %d", (int)e);
    pthread_mutex_lock(&c->mu);
    /* no STREAM_END will come, and the close completion leaves a call whose status batch
     * was started to it: count the call here, once */
    if (b->tag == &c->t_end) rpc__account(c);
    if (c->inflight) grpc_byte_buffer_destroy(c->inflight);
    c->inflight = NULL;
    c->send_inflight = 0;
    c->closed = 1;
    drop_queue_locked(c);
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    atomic_fetch_sub(&c->refs, 1); /* the batch's; the caller holds another reference */
}

void rpc__stream_on_send(rpc_call *c, int ok) {
    send_batch b;
    int go = 0;
    pthread_mutex_lock(&c->mu);
    grpc_byte_buffer *done = c->inflight;
    c->inflight = NULL;
    c->send_inflight = 0;
    if (!ok) { /* the client is gone; the CLOSE completion will tell the rest */
        c->closed = 1;
        drop_queue_locked(c);
        pthread_cond_broadcast(&c->cv);
    } else {
        go = pump_locked(c, &b);
        /* wake a blocked writer only once the queue has half drained: fewer wake-ups */
        if (c->writer_waiting && c->q_len <= c->q_cap / 2) pthread_cond_signal(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    grpc_byte_buffer_destroy(done);
    if (go) pump_start(c, &b);
    rpc_call_unref(c); /* the finished batch's reference */
}

void rpc__stream_on_end(rpc_call *c) {
    pthread_mutex_lock(&c->mu);
    if (c->inflight) grpc_byte_buffer_destroy(c->inflight);
    c->inflight = NULL;
    c->send_inflight = 0;
    c->closed = 1;
    pthread_cond_broadcast(&c->cv);
    rpc__account(c); /* reads the status: under the lock that guards it */
    pthread_mutex_unlock(&c->mu);
    rpc_call_unref(c);
}

void rpc__stream_on_close(rpc_call *c) {
    rpc_close_fn cb;
    void *ud;
    int detached, account;
    pthread_mutex_lock(&c->mu);
    account = !c->end_started; /* ended without our status: cancelled, deadline, gone */
    if (account) {             /* under the lock: the handler may be setting the status */
        c->end_started = 1;    /* and no status batch will start now */
        if (c->code == RPC_OK) c->code = RPC_CANCELLED;
        rpc__account(c);
    }
    c->closed = 1;
    drop_queue_locked(c);
    pthread_cond_broadcast(&c->cv);
    cb = c->on_close;
    ud = c->close_ud;
    c->on_close = NULL;
    detached = c->detached;
    pthread_mutex_unlock(&c->mu);
    (void)account;
    if (detached) rpc__server_detached_remove(c->srv, c);
    if (cb) cb(c, ud);
}

/* start 0 (rpc_stream_push_deferred): an idle stream stays idle until rpc_stream_kick (or the
 * next push that starts), so that frames queued together start together; a stream with a send
 * in flight takes the frame on that send's completion either way. */
static int push_locked(rpc_call *c, rpc_frame *f, int start, send_batch *b) {
    assert(c->q_len < c->q_cap && "stream queue bound"); /* callers wait or refuse first */
    c->q[(c->q_head + c->q_len) % c->q_cap] = f;
    c->q_len++;
    return start ? pump_locked(c, b) : 0;
}

int rpc_stream_push_wait(rpc_call *c, rpc_frame *f, int64_t wait_ms) {
    struct timespec until;
    send_batch b;
    int rc = RPC_OK, go = 0;
    if (wait_ms >= 0) util_deadline(&until, wait_ms);
    pthread_mutex_lock(&c->mu);
    while (!c->closed && !c->finishing && c->q_len == c->q_cap && rc == RPC_OK) {
        c->writer_waiting = 1;
        if (wait_ms < 0)
            pthread_cond_wait(&c->cv, &c->mu);
        else if (pthread_cond_timedwait(&c->cv, &c->mu, &until) == ETIMEDOUT)
            rc = c->q_len == c->q_cap ? RPC_EFULL : RPC_OK;
    }
    c->writer_waiting = 0;
    if (c->closed || c->finishing)
        rc = RPC_ECLOSED;
    else if (rc == RPC_OK) /* the queue holds its own reference */
        go = push_locked(c, rpc_frame_ref(f), 1, &b);
    pthread_mutex_unlock(&c->mu);
    if (go) pump_start(c, &b); /* the caller's reference covers the call */
    return rc;
}

int rpc_stream_send_wait(rpc_call *c, const ProtobufCMessage *msg, int64_t wait_ms) {
    if (rpc__stream_check_response(c, msg) != RPC_OK) return RPC_ECLOSED;
    rpc_frame *f = rpc_frame_encode(msg);
    if (f == NULL) return RPC_ENOMEM;
    int rc = rpc_stream_push_wait(c, f, wait_ms);
    rpc_frame_unref(f);
    return rc;
}

int rpc_stream_send(rpc_call *c, const ProtobufCMessage *msg) {
    return rpc_stream_send_wait(c, msg, -1);
}

static int push_nowait(rpc_call *c, rpc_frame *f, int start) {
    send_batch b;
    int rc = RPC_OK, go = 0;
    pthread_mutex_lock(&c->mu);
    if (c->closed || c->finishing)
        rc = RPC_ECLOSED;
    else if (c->q_len == c->q_cap)
        rc = RPC_EFULL;
    else
        go = push_locked(c, rpc_frame_ref(f), start, &b);
    pthread_mutex_unlock(&c->mu);
    if (go) pump_start(c, &b);
    return rc;
}

int rpc_stream_push(rpc_call *c, rpc_frame *f) {
    return push_nowait(c, f, 1);
}

int rpc_stream_push_deferred(rpc_call *c, rpc_frame *f) {
    return push_nowait(c, f, 0);
}

void rpc_stream_kick(rpc_call *c) {
    send_batch b;
    pthread_mutex_lock(&c->mu);
    int go = pump_locked(c, &b); /* nothing when a send is in flight: its completion starts
                                  * the next */
    pthread_mutex_unlock(&c->mu);
    if (go) pump_start(c, &b);
}

size_t rpc_stream_queued(rpc_call *c) {
    pthread_mutex_lock(&c->mu);
    size_t n = c->q_len;
    pthread_mutex_unlock(&c->mu);
    return n;
}

size_t rpc_stream_room(rpc_call *c) {
    pthread_mutex_lock(&c->mu);
    size_t n = c->closed || c->finishing ? 0 : c->q_cap - c->q_len;
    pthread_mutex_unlock(&c->mu);
    return n;
}

int rpc_stream_finish(rpc_call *c, int code, const char *message) {
    send_batch b;
    int go = 0;
    pthread_mutex_lock(&c->mu);
    if (!c->finishing && !c->closed) {
        c->finishing = 1;
        /* a status set with rpc_error() is final (rpc.h): OK does not overwrite it */
        if (code != RPC_OK || c->code == RPC_OK) c->code = code;
        if (message && code != RPC_OK) { /* heap, not the arena: any thread may finish */
            free(c->final_msg);
            c->final_msg = strdup(message);
            c->message = c->final_msg;
        }
        go = pump_locked(c, &b);
        pthread_cond_broadcast(&c->cv);
    }
    pthread_mutex_unlock(&c->mu);
    if (go) pump_start(c, &b);
    return RPC_OK;
}

rpc_call *rpc_stream_detach(rpc_call *c, rpc_close_fn on_close, void *ud) {
    pthread_mutex_lock(&c->mu);
    if (c->closed || c->finishing) {
        pthread_mutex_unlock(&c->mu);
        return NULL;
    }
    c->detached = 1;
    c->on_close = on_close;
    c->close_ud = ud;
    rpc__call_ref(c);
    rpc__server_detached_add(c->srv, c);
    pthread_mutex_unlock(&c->mu);
    return c;
}

/* Ends the stream now with `code`: the queued frames are dropped and the status goes out
 * without waiting for the frames (or the send in flight) a stalled client is not reading.
 * grpc_call_cancel_with_status on a server call writes the status trailers, which HTTP/2 flow
 * control does not hold back; on_close runs as for any other end. */
int rpc_stream_abort(rpc_call *c, int code, const char *message) {
    int go = 0;
    pthread_mutex_lock(&c->mu);
    if (!c->closed && !c->end_started) {
        c->closed = 1;
        c->finishing = 1;
        c->code = code;
        drop_queue_locked(c);
        pthread_cond_broadcast(&c->cv);
        go = 1;
    }
    pthread_mutex_unlock(&c->mu);
    if (go) grpc_call_cancel_with_status(c->call, (grpc_status_code)code, message, NULL);
    return RPC_OK;
}

/* ---- bidirectional streams: the handler's reads ---- */

int rpc_stream_recv(rpc_call *c, ProtobufCMessage **out) {
    grpc_op op;
    *out = NULL;
    if (c->method->m.kind != RPC_BIDI_STREAM || !c->is_stream) return RPC_EINVAL;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->rbuf;
    pthread_mutex_lock(&c->mu);
    c->recv_done = 0;
    pthread_mutex_unlock(&c->mu);
    c->t_recv.kind = RPC__TAG_STREAM_RECV;
    rpc__call_ref(c); /* the batch's; released by rpc__stream_on_recv */
    RPC__TSAN_RELEASE(&c->t_recv);
    if (grpc_call_start_batch(c->call, &op, 1, &c->t_recv, NULL) != GRPC_CALL_OK) {
        rpc_call_unref(c);
        return RPC_ECLOSED;
    }
    /* the core completes a pending read when the call ends for any reason: this wait ends */
    pthread_mutex_lock(&c->mu);
    while (!c->recv_done)
        pthread_cond_wait(&c->cv, &c->mu);
    int ok = c->recv_ok;
    grpc_byte_buffer *bb = c->rbuf;
    c->rbuf = NULL;
    pthread_mutex_unlock(&c->mu);
    if (!ok || rpc_cancelled(c)) {
        if (bb) grpc_byte_buffer_destroy(bb);
        return RPC_ECLOSED;
    }
    if (bb == NULL) return RPC_OK; /* half-closed */
    return rpc__decode_message(c, bb, NULL, out);
}

void rpc__stream_on_recv(rpc_call *c, int ok) {
    pthread_mutex_lock(&c->mu);
    c->recv_done = 1;
    c->recv_ok = ok;
    pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    rpc_call_unref(c);
}
