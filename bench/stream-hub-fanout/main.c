/* stream-hub-fanout: the two programs of bench/stream-hub-fanout/bench.sh.
 *
 *   stream-hub-fanout bare
 *       The baseline: a libcommon gRPC server whose StreamNodeIO sends snapshot_done, detaches
 *       the stream and, once BENCH_SUBS streams are attached (plus 300 ms), pushes BENCH_FRAMES
 *       live frames (token_text = "<publish ns>|" padded to BENCH_SIZE bytes), each encoded once
 *       and pushed to every stream, at BENCH_RATE frames/s (0 = as fast as the queues take
 *       them; a full queue is waited for, so nothing is lost). No hub logic. BENCH_THREADS:
 *       the server's completion-queue threads (libcommon's one knob). BENCH_BATCH (default
 *       1): frames pushed in batches of that many, each batch's sends started together at its
 *       last frame (rpc_stream_push_deferred, as the hub does with a burst). Prints port=N.
 *
 *   stream-hub-fanout client ADDR
 *       Opens BENCH_SUBS StreamNodeIO streams of run BENCH_RUN (token BENCH_TOKEN) over one
 *       connection per 200 streams, on one completion-queue thread. BENCH_STALLED=1: stream 0
 *       has a connection of its own without BDP probing and stops reading after
 *       snapshot_done. Prints "ready" when every stream has its snapshot_done, then counts live
 *       frames until every reading stream has BENCH_FRAMES or BENCH_IDLE_MS pass without one,
 *       and prints one JSON line: deliveries, rate, publish-to-client latency p50/p99, loss,
 *       the client's own CPU from the first live frame to the last, and the longest pause
 *       between two live frames (a sender that stalls shows there). */
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "rpc.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

#define METHOD "/upsquad.workflow.v1.WorkflowService/StreamNodeIO"

typedef Upsquad__Workflow__V1__StreamNodeIOResponse IOResp;

static long env_l(const char *k, long def) {
    const char *v = getenv(k);
    return v && *v ? strtol(v, NULL, 10) : def;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ---------------------------------------------------------------- bare server ---- */

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static rpc_call **calls;
static long n_calls, want_subs;

static void on_close(rpc_call *c, void *ud) {
    (void)c;
    (void)ud;
}

/* user + system CPU of this process, in microseconds */
static int64_t cpu_us(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (int64_t)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1000000 + ru.ru_utime.tv_usec +
           ru.ru_stime.tv_usec;
}

static int bare_stream(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    (void)req;
    (void)ud;
    IOResp done = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
    done.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_DONE;
    done.snapshot_done = 1;
    if (rpc_stream_send(call, &done.base) != RPC_OK) return RPC_CANCELLED;
    rpc_call *c = rpc_stream_detach(call, on_close, NULL);
    if (!c) return RPC_CANCELLED;
    pthread_mutex_lock(&mu);
    if (n_calls < want_subs) calls[n_calls++] = c;
    pthread_cond_broadcast(&cv);
    pthread_mutex_unlock(&mu);
    return RPC_EDETACHED;
}

static void *producer(void *arg) {
    (void)arg;
    long frames = env_l("BENCH_FRAMES", 200), size = env_l("BENCH_SIZE", 256);
    double rate = (double)env_l("BENCH_RATE", 0);
    long batch = env_l("BENCH_BATCH", 1);
    char *tok = malloc((size_t)size + 32);
    pthread_mutex_lock(&mu);
    while (n_calls < want_subs)
        pthread_cond_wait(&cv, &mu);
    pthread_mutex_unlock(&mu);
    usleep(300000);
    int64_t t0 = now_ns();
    for (long i = 0; i < frames; i++) {
        if (rate > 0) {
            int64_t wait = t0 + (int64_t)((double)i * 1e9 / rate) - now_ns();
            if (wait > 0) usleep((useconds_t)(wait / 1000));
        }
        Upsquad__Workflow__V1__NodeIOFrame fr = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__INIT;
        IOResp r = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__INIT;
        int k = snprintf(tok, (size_t)size + 32, "%lld|", (long long)now_ns());
        while (k < size)
            tok[k++] = 'x';
        tok[k] = 0;
        fr.node_id = "coder";
        fr.session_id = "s1";
        fr.seq = i + 1;
        fr.event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOKEN_TEXT;
        fr.token_text = tok;
        r.frame_case = UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_LIVE;
        r.live = &fr;
        rpc_frame *f = rpc_frame_encode(&r.base);
        /* in a batch but its last frame: queued, the send starts with the batch's last frame */
        int defer = batch > 1 && (i + 1) % batch != 0 && i + 1 < frames;
        for (long c = 0; c < n_calls; c++) {
            while ((defer ? rpc_stream_push_deferred(calls[c], f) : rpc_stream_push(calls[c], f)) ==
                   RPC_EFULL) {
                rpc_stream_kick(calls[c]); /* a queue full of deferred frames: start it */
                sched_yield();
            }
        }
        rpc_frame_unref(f);
    }
    free(tok);
    return NULL;
}

static int run_bare(void) {
    char err[256];
    rpc_server *srv = NULL;
    want_subs = env_l("BENCH_SUBS", 1000);
    calls = calloc((size_t)want_subs, sizeof *calls);
    rpc_server_opts o = {.addr = "127.0.0.1:0",
                         .max_streams = (int)want_subs + 64,
                         .unary_threads = (int)env_l("BENCH_THREADS", 1)};
    rpc_method m = {METHOD,
                    RPC_SERVER_STREAM,
                    RPC_AUTH_NONE,
                    &upsquad__workflow__v1__stream_node_iorequest__descriptor,
                    &upsquad__workflow__v1__stream_node_ioresponse__descriptor,
                    NULL,
                    bare_stream,
                    NULL};
    rpc_block_signals();
    if (rpc_server_new(&o, &srv, err, sizeof err) || rpc_server_add(srv, &m, 1) ||
        rpc_server_start(srv, err, sizeof err)) {
        fprintf(stderr, "bare: %s\n", err);
        return 1;
    }
    pthread_t t;
    pthread_create(&t, NULL, producer, NULL);
    printf("port=%d\n", rpc_server_port(srv));
    fflush(stdout);
    rpc_wait_signal();
    _exit(0); /* a benchmark server: the process ends, no orderly teardown needed */
}

/* ---------------------------------------------------------------- client ---- */

enum { T_START = 0, T_STATUS = 1, T_RECV = 2 };

typedef struct stream {
    grpc_call *call;
    grpc_metadata_array md_in, trailers;
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *recv;
    int ready, ended, stalled;
    long live, gaps;
    int tags[3][2]; /* [kind] = {kind, index} as the tag */
} stream;

static stream *S;
static long NS;

static void *tag_of(long i, int kind) {
    return (void *)(intptr_t)((i << 2) | kind);
}

static void post_recv(long i) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &S[i].recv;
    grpc_call_start_batch(S[i].call, &op, 1, tag_of(i, T_RECV), NULL);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static int run_client(const char *addr) {
    NS = env_l("BENCH_SUBS", 1000);
    long frames = env_l("BENCH_FRAMES", 200), idle_ms = env_l("BENCH_IDLE_MS", 3000);
    int stalled = (int)env_l("BENCH_STALLED", 0);
    const char *run = getenv("BENCH_RUN") ? getenv("BENCH_RUN") : "";
    const char *token = getenv("BENCH_TOKEN") ? getenv("BENCH_TOKEN") : "";
    char auth[4096];
    snprintf(auth, sizeof auth, "Bearer %s", token);
    grpc_init();
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    long nch = (NS + 199) / 200 + 1;
    grpc_channel **ch = calloc((size_t)nch, sizeof *ch);
    for (long c = 0; c < nch; c++) {
        grpc_arg a[3];
        a[0].type = GRPC_ARG_INTEGER;
        a[0].key = GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL;
        a[0].value.integer = 1;
        a[1].type = GRPC_ARG_INTEGER;
        a[1].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
        a[1].value.integer = 16 << 20;
        a[2].type = GRPC_ARG_INTEGER;
        a[2].key = GRPC_ARG_HTTP2_BDP_PROBE;
        a[2].value.integer = 0;
        grpc_channel_args args = {c == 0 ? 3 : 2, a};
        grpc_channel_credentials *cr = grpc_insecure_credentials_create();
        ch[c] = grpc_channel_create(addr, cr, &args);
        grpc_channel_credentials_release(cr);
    }
    S = calloc((size_t)NS, sizeof *S);
    Upsquad__Workflow__V1__StreamNodeIORequest rq =
        UPSQUAD__WORKFLOW__V1__STREAM_NODE_IOREQUEST__INIT;
    rq.run_id = (char *)run;
    size_t rl = protobuf_c_message_get_packed_size(&rq.base);
    uint8_t *rb = malloc(rl + 1);
    protobuf_c_message_pack(&rq.base, rb);
    grpc_slice method = grpc_slice_from_static_string(METHOD);
    for (long i = 0; i < NS; i++) {
        stream *s = &S[i];
        s->stalled = stalled && i == 0;
        /* channel 0 (no BDP probing: a small window) only for the stalled stream */
        grpc_channel *c = s->stalled ? ch[0] : ch[1 + (i % (nch - 1))];
        s->call = grpc_channel_create_call(c, NULL, GRPC_PROPAGATE_DEFAULTS, cq, method, NULL,
                                           gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        grpc_metadata md;
        md.key = grpc_slice_from_static_string("authorization");
        md.value = grpc_slice_from_copied_string(auth);
        grpc_slice rs = grpc_slice_from_copied_buffer((const char *)rb, rl);
        grpc_byte_buffer *req = grpc_raw_byte_buffer_create(&rs, 1);
        grpc_slice_unref(rs);
        grpc_op ops[4];
        memset(ops, 0, sizeof ops);
        ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &md;
        ops[1].op = GRPC_OP_SEND_MESSAGE;
        ops[1].data.send_message.send_message = req;
        ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
        ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[3].data.recv_initial_metadata.recv_initial_metadata = &s->md_in;
        grpc_call_start_batch(s->call, ops, 4, tag_of(i, T_START), NULL);
        grpc_byte_buffer_destroy(req);
        grpc_slice_unref(md.value);
        grpc_op st;
        memset(&st, 0, sizeof st);
        st.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        st.data.recv_status_on_client.trailing_metadata = &s->trailers;
        st.data.recv_status_on_client.status = &s->status;
        st.data.recv_status_on_client.status_details = &s->details;
        grpc_call_start_batch(s->call, &st, 1, tag_of(i, T_STATUS), NULL);
        post_recv(i);
    }
    long ready = 0, ended = 0, done_streams = 0, readers = NS - (stalled ? 1 : 0);
    long n_lat = 0, cap_lat = frames * readers + 16, total = 0, gaps = 0;
    int64_t *lat = malloc((size_t)cap_lat * sizeof *lat), t_first = 0, t_last = 0;
    int said_ready = 0;
    int64_t max_gap = 0;   /* the longest pause between two live frames (a stalled sender) */
    long gap_at = 0;       /* live frames received before it */
    int64_t cpu_first = 0; /* the client's own CPU (us) at the first live frame */
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(
            cq, gpr_time_add(gpr_now(GPR_CLOCK_REALTIME), gpr_time_from_millis(100, GPR_TIMESPAN)),
            NULL);
        int64_t now = now_ns();
        if (ev.type == GRPC_QUEUE_TIMEOUT) {
            if (t_last && now - t_last > idle_ms * 1000000LL) break;
            if (ended >= NS) break;
            continue;
        }
        long i = (long)((intptr_t)ev.tag >> 2);
        int kind = (int)((intptr_t)ev.tag & 3);
        stream *s = &S[i];
        if (kind == T_STATUS) {
            s->ended = 1;
            ended++;
            if (!s->ready) {
                char *d = grpc_slice_to_c_string(s->details);
                fprintf(stderr, "stream %ld ended before snapshot_done: %d %s\n", i, (int)s->status,
                        d);
                gpr_free(d);
            }
            if (ended >= NS) break;
            continue;
        }
        if (kind != T_RECV) continue;
        if (!ev.success || !s->recv) continue; /* end of stream: the status follows */
        grpc_byte_buffer_reader rd;
        grpc_byte_buffer_reader_init(&rd, s->recv);
        grpc_slice all = grpc_byte_buffer_reader_readall(&rd);
        grpc_byte_buffer_reader_destroy(&rd);
        grpc_byte_buffer_destroy(s->recv);
        s->recv = NULL;
        IOResp *r = upsquad__workflow__v1__stream_node_ioresponse__unpack(
            NULL, GRPC_SLICE_LENGTH(all), GRPC_SLICE_START_PTR(all));
        grpc_slice_unref(all);
        if (r) {
            if (r->frame_case ==
                    UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_SNAPSHOT_DONE &&
                !s->ready) {
                s->ready = 1;
                ready++;
            } else if (r->frame_case == UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_LIVE) {
                s->live++;
                if (!s->stalled) {
                    total++;
                    if (t_last && now - t_last > max_gap) {
                        max_gap = now - t_last;
                        gap_at = total;
                    }
                    if (!t_first) {
                        t_first = now;
                        cpu_first = cpu_us();
                    }
                    t_last = now;
                    const char *tok = r->live->token_text;
                    if (tok && n_lat < cap_lat) lat[n_lat++] = now - strtoll(tok, NULL, 10);
                    if (s->live == frames) done_streams++;
                }
            } else if (r->frame_case == UPSQUAD__WORKFLOW__V1__STREAM_NODE_IORESPONSE__FRAME_GAP) {
                s->gaps++;
                gaps++;
            }
            upsquad__workflow__v1__stream_node_ioresponse__free_unpacked(r, NULL);
        }
        if (!said_ready && ready >= NS) {
            printf("ready\n");
            fflush(stdout);
            said_ready = 1;
        }
        if (!(s->stalled && s->ready)) post_recv(i);
        if (done_streams >= readers) break;
    }
    qsort(lat, (size_t)n_lat, sizeof *lat, cmp_i64);
    double secs = t_last > t_first ? (double)(t_last - t_first) / 1e9 : 0;
    long min_live = frames;
    for (long i = 0; i < NS; i++)
        if (!S[i].stalled && S[i].live < min_live) min_live = S[i].live;
    printf("{\"subs\":%ld,\"ready\":%ld,\"frames\":%ld,\"delivered\":%ld,\"expected\":%ld,"
           "\"secs\":%.4f,\"rate\":%.0f,\"p50_ms\":%.3f,\"p99_ms\":%.3f,\"min_per_stream\":%ld,"
           "\"gaps\":%ld,\"stalled_live\":%ld,\"client_cpu_us\":%lld,\"max_gap_us\":%lld,"
           "\"gap_at\":%ld}\n",
           NS, ready, frames, total, frames * readers, secs, secs > 0 ? (double)total / secs : 0,
           n_lat ? (double)lat[n_lat / 2] / 1e6 : 0,
           n_lat ? (double)lat[(size_t)((double)n_lat * 0.99)] / 1e6 : 0, min_live, gaps,
           stalled ? S[0].live : 0, (long long)(t_first ? cpu_us() - cpu_first : 0),
           (long long)(max_gap / 1000), gap_at);
    fflush(stdout);
    _exit(0); /* streams are cancelled by the exit */
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 2 && strcmp(argv[1], "bare") == 0) return run_bare();
    if (argc >= 3 && strcmp(argv[1], "client") == 0) return run_client(argv[2]);
    fprintf(stderr, "usage: stream-hub-fanout bare | client ADDR   (settings: BENCH_* env)\n");
    return 2;
}
