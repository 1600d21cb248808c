/* See rpc_astream.h. Each stream has three batches: the start (send the request, receive the
 * initial metadata), the status, and at most one receive. Each batch in flight holds a
 * reference on the stream; so does the caller until rpc_astream_unref, and the callbacks
 * until on_done. State flags are guarded by the stream's mutex; callbacks run without it. */
#include "rpc_astream.h"

#include <grpc/support/time.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "rpc_internal.h"

#define ASTREAM_MAX_THREADS 64

enum { TAG_START = 1, TAG_MSG, TAG_STATUS };

typedef struct atag {
    int kind;
    struct rpc_astream *s;
} atag;

struct rpc_aclient {
    int n;
    grpc_completion_queue **cq;
    pthread_t *thr;
    int started;
    atomic_uint next; /* round-robin over the queues */
};

struct rpc_astream {
    atomic_int refs;
    rpc_aclient *a;
    grpc_call *call;
    const ProtobufCMessageDescriptor *desc;
    rpc_astream_msg_fn on_msg;
    rpc_astream_done_fn on_done;
    void *ud;
    rpc__call_md *md;
    grpc_byte_buffer *req, *msg;
    grpc_metadata_array init_md, trailing;
    grpc_status_code status;
    grpc_slice details;
    atag t_start, t_msg, t_status;

    pthread_mutex_t mu;
    int msg_inflight; /* a receive is posted */
    int paused;       /* the callback asked for no more until resume */
    int ended;        /* the last receive found the end of the messages */
    int status_done;  /* the status arrived */
    int cancelled;    /* by the consumer */
    int done;         /* on_done ran (or is running) */
};

static void astream_free(rpc_astream *s) {
    if (s->msg) grpc_byte_buffer_destroy(s->msg);
    grpc_byte_buffer_destroy(s->req);
    grpc_slice_unref(s->details);
    grpc_metadata_array_destroy(&s->init_md);
    grpc_metadata_array_destroy(&s->trailing);
    rpc__md_delete(s->md);
    if (s->call) grpc_call_unref(s->call);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

void rpc_astream_unref(rpc_astream *s) {
    if (s && atomic_fetch_sub_explicit(&s->refs, 1, memory_order_acq_rel) == 1) astream_free(s);
}

/* Posts the next receive; the caller holds s->mu. */
static void recv_locked(rpc_astream *s) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &s->msg;
    s->msg = NULL;
    atomic_fetch_add(&s->refs, 1);
    s->msg_inflight = 1;
    RPC__TSAN_RELEASE(&s->t_msg);
    if (grpc_call_start_batch(s->call, &op, 1, &s->t_msg, NULL) != GRPC_CALL_OK) {
        s->msg_inflight = 0;
        s->ended = 1;
        atomic_fetch_sub(&s->refs, 1); /* the caller holds another */
    }
}

/* on_done once the status is in and no message can follow; called without the lock. */
static void maybe_done(rpc_astream *s) {
    pthread_mutex_lock(&s->mu);
    int fire = !s->done && s->status_done && !s->msg_inflight && (s->ended || s->cancelled);
    if (fire) s->done = 1;
    pthread_mutex_unlock(&s->mu);
    if (!fire) return;
    rpc_status st;
    rpc__status_fill(&st, s->status, s->details, &s->trailing);
    if (s->cancelled && st.code == RPC_OK) st.code = RPC_CANCELLED; /* messages were left */
    if (s->on_done) s->on_done(s, &st, s->ud);
    rpc_status_clear(&st);
    rpc_astream_unref(s); /* the callbacks' reference */
}

static void on_msg_done(rpc_astream *s) {
    grpc_byte_buffer *bb = s->msg;
    s->msg = NULL;
    pthread_mutex_lock(&s->mu);
    s->msg_inflight = 0;
    int skip = s->cancelled;
    if (bb == NULL) s->ended = 1;
    pthread_mutex_unlock(&s->mu);
    if (bb && !skip) {
        ProtobufCMessage *m = NULL;
        int verdict = RPC_ASTREAM_CANCEL;
        if (rpc__decode(bb, s->desc, NULL, &m) == 0) {
            verdict = s->on_msg ? s->on_msg(s, m, s->ud) : RPC_ASTREAM_CONTINUE;
            protobuf_c_message_free_unpacked(m, NULL);
        } else {
            log_warn("rpc.astream", "undecodable %s message: cancelling", s->desc->name);
        }
        if (verdict == RPC_ASTREAM_CANCEL) rpc_astream_cancel(s);
        pthread_mutex_lock(&s->mu);
        if (verdict == RPC_ASTREAM_PAUSE && !s->cancelled)
            s->paused = 1;
        else if (!s->msg_inflight)
            recv_locked(s); /* after a cancel it returns the end at once */
        pthread_mutex_unlock(&s->mu);
    } else if (bb) { /* cancelled meanwhile: drain to the end */
        pthread_mutex_lock(&s->mu);
        if (!s->msg_inflight) recv_locked(s);
        pthread_mutex_unlock(&s->mu);
    }
    if (bb) grpc_byte_buffer_destroy(bb);
    maybe_done(s);
}

static void *io_thread(void *arg) {
    grpc_completion_queue *cq = arg;
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) break;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        RPC__TSAN_ACQUIRE(ev.tag);
        atag *t = ev.tag;
        rpc_astream *s = t->s;
        switch (t->kind) {
        case TAG_START:
            break;
        case TAG_MSG:
            on_msg_done(s);
            break;
        case TAG_STATUS:
            pthread_mutex_lock(&s->mu);
            s->status_done = 1;
            pthread_mutex_unlock(&s->mu);
            maybe_done(s);
            break;
        }
        rpc_astream_unref(s); /* the batch's reference */
    }
    return NULL;
}

int rpc_aclient_new(int threads, rpc_aclient **out) {
    if (threads < 1 || threads > ASTREAM_MAX_THREADS) return RPC_EINVAL;
    rpc_aclient *a = calloc(1, sizeof *a);
    if (a == NULL) return RPC_ENOMEM;
    a->n = threads;
    a->cq = calloc((size_t)threads, sizeof *a->cq);
    a->thr = calloc((size_t)threads, sizeof *a->thr);
    if (a->cq == NULL || a->thr == NULL) goto fail;
    grpc_init();
    for (int i = 0; i < threads; i++)
        a->cq[i] = grpc_completion_queue_create_for_next(NULL);
    for (; a->started < threads; a->started++)
        if (pthread_create(&a->thr[a->started], NULL, io_thread, a->cq[a->started]) != 0) {
            rpc_aclient_free(a);
            return RPC_ENOMEM;
        }
    *out = a;
    return RPC_OK;
fail:
    free(a->cq);
    free(a->thr);
    free(a);
    return RPC_ENOMEM;
}

void rpc_aclient_free(rpc_aclient *a) {
    if (a == NULL) return;
    for (int i = 0; i < a->n; i++)
        grpc_completion_queue_shutdown(a->cq[i]);
    for (int i = 0; i < a->started; i++)
        pthread_join(a->thr[i], NULL);
    for (int i = a->started; i < a->n; i++) /* queues no thread polled */
        while (
            grpc_completion_queue_next(a->cq[i], gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
            GRPC_QUEUE_SHUTDOWN) {
        }
    for (int i = 0; i < a->n; i++)
        grpc_completion_queue_destroy(a->cq[i]);
    free(a->cq);
    free(a->thr);
    free(a);
    grpc_shutdown();
}

int rpc_aclient_threads(const rpc_aclient *a) {
    return a->n;
}

int rpc_astream_open(rpc_aclient *a, rpc_channel *ch, const char *method,
                     const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                     const rpc_call_opts *opts, rpc_astream_msg_fn on_msg,
                     rpc_astream_done_fn on_done, void *ud, rpc_astream **out) {
    *out = NULL;
    if (a == NULL || ch == NULL || method == NULL || req == NULL || resp_desc == NULL)
        return RPC_EINVAL;
    rpc_astream *s = calloc(1, sizeof *s);
    if (s == NULL) return RPC_ENOMEM;
    pthread_mutex_init(&s->mu, NULL);
    atomic_init(&s->refs, 2); /* the caller's, and the callbacks' (dropped after on_done) */
    s->a = a;
    s->desc = resp_desc;
    s->on_msg = on_msg;
    s->on_done = on_done;
    s->ud = ud;
    s->details = grpc_empty_slice();
    grpc_metadata_array_init(&s->init_md);
    grpc_metadata_array_init(&s->trailing);
    s->t_start = (atag){TAG_START, s};
    s->t_msg = (atag){TAG_MSG, s};
    s->t_status = (atag){TAG_STATUS, s};
    s->md = rpc__md_new(opts);
    s->req = rpc__encode(req);
    grpc_completion_queue *cq = a->cq[atomic_fetch_add(&a->next, 1) % (unsigned)a->n];
    s->call = s->md && s->req ? rpc__client_call(ch, cq, method, opts) : NULL;
    if (s->call == NULL) {
        astream_free(s);
        return RPC_ENOMEM;
    }
    grpc_op ops[4];
    size_t nmd = 0;
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.metadata = rpc__md_items(s->md, &nmd);
    ops[0].data.send_initial_metadata.count = nmd;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = s->req;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &s->init_md;
    atomic_fetch_add(&s->refs, 1);
    RPC__TSAN_RELEASE(&s->t_start);
    if (grpc_call_start_batch(s->call, ops, 4, &s->t_start, NULL) != GRPC_CALL_OK) {
        astream_free(s);
        return RPC_EINVAL;
    }
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &s->trailing;
    ops[0].data.recv_status_on_client.status = &s->status;
    ops[0].data.recv_status_on_client.status_details = &s->details;
    atomic_fetch_add(&s->refs, 1);
    RPC__TSAN_RELEASE(&s->t_status);
    if (grpc_call_start_batch(s->call, ops, 1, &s->t_status, NULL) != GRPC_CALL_OK) {
        /* cannot happen after a started call; end it and let the start batch drain */
        atomic_fetch_sub(&s->refs, 1);
        grpc_call_cancel(s->call, NULL);
        pthread_mutex_lock(&s->mu);
        s->status = GRPC_STATUS_INTERNAL;
        s->status_done = 1;
        s->ended = 1;
        pthread_mutex_unlock(&s->mu);
    } else {
        pthread_mutex_lock(&s->mu);
        recv_locked(s);
        pthread_mutex_unlock(&s->mu);
    }
    *out = s;
    maybe_done(s);
    return RPC_OK;
}

void rpc_astream_cancel(rpc_astream *s) {
    pthread_mutex_lock(&s->mu);
    int first = !s->cancelled;
    s->cancelled = 1;
    int wake = s->paused && !s->msg_inflight;
    s->paused = 0;
    if (first) grpc_call_cancel(s->call, NULL);
    if (wake) recv_locked(s); /* completes with the end at once: on_done follows on I/O */
    pthread_mutex_unlock(&s->mu);
}

void rpc_astream_resume(rpc_astream *s) {
    pthread_mutex_lock(&s->mu);
    if (s->paused && !s->msg_inflight && !s->ended) {
        s->paused = 0;
        recv_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
}
