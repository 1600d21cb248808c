/* Unary load client for the model-registry benchmark, on the gRPC C core client API. The same
 * client drives the service (GetModelRecommendation) and the bare C-core echo server
 * (bench/rpc-bare-echo, PublicEcho), so the ratio of the two runs measures the servers only.
 *
 *   model-registry-load --target HOST:PORT --kind recommend|echo [--concurrency N]
 *                       [--duration S] [--warmup S] [--threads K] [--channels C]
 *                       [--token T] [--role R] [--goal G]
 *
 * N call loops, spread over K threads (one completion queue each) and C channels, each keep
 * one call outstanding; a call is one batch (one completion). Every response is decoded and
 * checked. Only completions inside [warmup, warmup + duration] count. Latencies go into a
 * histogram of 1 us buckets up to 1 s (bounded memory; slower calls land in the last bucket).
 * Prints one JSON line; exits 0 when there were completions and no errors. */
#include <getopt.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>

#include "upsquad/runtime/v1/model.pb-c.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define MAX_THREADS 16
#define MAX_CHANNELS 64
#define MAX_CONCURRENCY 1024
#define CALL_DEADLINE_MS 10000
#define HIST_BUCKETS 1000000 /* 1 us each: up to 1 s */

#define PATH_RECOMMEND "/upsquad.runtime.v1.ModelRegistryService/GetModelRecommendation"
#define PATH_ECHO "/upsquad.test.v1.EchoService/PublicEcho"
#define PATH_ECHO_AUTH "/upsquad.test.v1.EchoService/Echo"

typedef struct config {
    const char *target, *kind, *token, *role, *goal;
    int concurrency, threads, channels, recommend;
    double duration_s, warmup_s;
} config;

typedef struct worker worker;

typedef struct loop {
    worker *w;
    grpc_channel *ch;
    void *method;
    grpc_call *call;
    grpc_metadata_array init_md, trail_md;
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *send_bb, *recv_bb;
    uint64_t start_ns;
    int done;
} loop;

struct worker {
    grpc_completion_queue *cq;
    pthread_t thread;
    loop *loops;
    int nloops, active;
    uint32_t *hist; /* HIST_BUCKETS counters */
    uint64_t calls, errors;
};

static config cfg = {.kind = "recommend",
                     .concurrency = 8,
                     .threads = 2,
                     .channels = 2,
                     .duration_s = 5,
                     .warmup_s = 1,
                     .role = "backend-sme",
                     .goal = "balanced"};
static grpc_slice req_slice;
static grpc_metadata auth_md;
static uint64_t warm_end_ns, end_ns;
static const char *echo_text = "model-registry-bench";

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int check_response(grpc_byte_buffer *bb) {
    grpc_byte_buffer_reader r;
    int ok = 0;
    if (!bb || !grpc_byte_buffer_reader_init(&r, bb)) return 0;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    const uint8_t *p = GRPC_SLICE_START_PTR(s);
    size_t n = GRPC_SLICE_LENGTH(s);
    if (cfg.recommend) {
        Upsquad__Runtime__V1__GetModelRecommendationResponse *m =
            upsquad__runtime__v1__get_model_recommendation_response__unpack(NULL, n, p);
        ok = m && m->recommended && m->recommended->model_id[0] && m->reasoning[0];
        if (m) upsquad__runtime__v1__get_model_recommendation_response__free_unpacked(m, NULL);
    } else {
        Upsquad__Test__V1__EchoResponse *m = upsquad__test__v1__echo_response__unpack(NULL, n, p);
        ok = m && strcmp(m->text, echo_text) == 0;
        if (m) upsquad__test__v1__echo_response__free_unpacked(m, NULL);
    }
    grpc_slice_unref(s);
    return ok;
}

static void call_start(loop *l) {
    gpr_timespec deadline = gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                         gpr_time_from_millis(CALL_DEADLINE_MS, GPR_TIMESPAN));
    l->call = grpc_channel_create_registered_call(l->ch, NULL, GRPC_PROPAGATE_DEFAULTS, l->w->cq,
                                                  l->method, deadline, NULL);
    grpc_metadata_array_init(&l->init_md);
    grpc_metadata_array_init(&l->trail_md);
    l->details = grpc_empty_slice();
    l->send_bb = grpc_raw_byte_buffer_create(&req_slice, 1);
    l->recv_bb = NULL;
    l->start_ns = now_ns();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (cfg.token) {
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &auth_md;
    }
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = l->send_bb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &l->init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &l->recv_bb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &l->trail_md;
    ops[5].data.recv_status_on_client.status = &l->status;
    ops[5].data.recv_status_on_client.status_details = &l->details;
    if (grpc_call_start_batch(l->call, ops, 6, l, NULL) != GRPC_CALL_OK) {
        fprintf(stderr, "model-registry-load: cannot start a call\n");
        exit(1);
    }
}

static void call_done(loop *l, int ok) {
    worker *w = l->w;
    uint64_t t = now_ns();
    int good = ok && l->status == GRPC_STATUS_OK && check_response(l->recv_bb);
    if (t >= warm_end_ns && t <= end_ns) {
        if (good) {
            uint64_t us = (t - l->start_ns) / 1000;
            w->hist[us < HIST_BUCKETS ? us : HIST_BUCKETS - 1]++;
            w->calls++;
        } else {
            w->errors++;
        }
    }
    if (!good && w->errors == 1 && t >= warm_end_ns) {
        fprintf(stderr, "model-registry-load: call failed (status %d: %.*s)\n", (int)l->status,
                (int)GRPC_SLICE_LENGTH(l->details), (const char *)GRPC_SLICE_START_PTR(l->details));
    }
    grpc_call_unref(l->call);
    grpc_metadata_array_destroy(&l->init_md);
    grpc_metadata_array_destroy(&l->trail_md);
    grpc_slice_unref(l->details);
    grpc_byte_buffer_destroy(l->send_bb);
    if (l->recv_bb) grpc_byte_buffer_destroy(l->recv_bb);
    if (t < end_ns) {
        call_start(l);
    } else {
        l->done = 1;
        w->active--;
    }
}

static void *worker_main(void *arg) {
    worker *w = arg;
    for (int i = 0; i < w->nloops; i++)
        call_start(&w->loops[i]);
    while (w->active > 0) {
        grpc_event ev =
            grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type != GRPC_OP_COMPLETE) break;
        call_done(ev.tag, ev.success);
    }
    return NULL;
}

static int encode_request(void) {
    size_t n;
    uint8_t *buf;
    if (cfg.recommend) {
        Upsquad__Runtime__V1__GetModelRecommendationRequest r =
            UPSQUAD__RUNTIME__V1__GET_MODEL_RECOMMENDATION_REQUEST__INIT;
        r.agent_role = (char *)cfg.role;
        r.optimization_goal = (char *)cfg.goal;
        n = upsquad__runtime__v1__get_model_recommendation_request__get_packed_size(&r);
        if (!(buf = malloc(n ? n : 1))) return -1;
        upsquad__runtime__v1__get_model_recommendation_request__pack(&r, buf);
    } else {
        Upsquad__Test__V1__EchoRequest r = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
        r.text = (char *)echo_text;
        n = upsquad__test__v1__echo_request__get_packed_size(&r);
        if (!(buf = malloc(n ? n : 1))) return -1;
        upsquad__test__v1__echo_request__pack(&r, buf);
    }
    req_slice = grpc_slice_from_copied_buffer((const char *)buf, n);
    free(buf);
    return 0;
}

static double quantile_ms(const uint64_t *h, uint64_t total, double q) {
    uint64_t rank = (uint64_t)(q * (double)total), seen = 0;
    if (rank >= total) rank = total ? total - 1 : 0;
    for (size_t i = 0; i < HIST_BUCKETS; i++) {
        seen += h[i];
        if (seen > rank) return ((double)i + 0.5) / 1000.0;
    }
    return 0;
}

static void usage(void) {
    fprintf(stderr, "usage: model-registry-load --target HOST:PORT [--kind recommend|echo] "
                    "[--concurrency N] [--duration S] [--warmup S] [--threads K] [--channels C] "
                    "[--token T] [--role R] [--goal G]\n");
    exit(2);
}

static void parse_args(int argc, char **argv) {
    static const struct option opts[] = {
        {"target", 1, 0, 't'},   {"kind", 1, 0, 'k'},   {"concurrency", 1, 0, 'n'},
        {"duration", 1, 0, 'd'}, {"warmup", 1, 0, 'w'}, {"threads", 1, 0, 'T'},
        {"channels", 1, 0, 'c'}, {"token", 1, 0, 'a'},  {"role", 1, 0, 'r'},
        {"goal", 1, 0, 'g'},     {0, 0, 0, 0}};
    int o;
    while ((o = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (o) {
        case 't':
            cfg.target = optarg;
            break;
        case 'k':
            cfg.kind = optarg;
            break;
        case 'n':
            cfg.concurrency = atoi(optarg);
            break;
        case 'd':
            cfg.duration_s = atof(optarg);
            break;
        case 'w':
            cfg.warmup_s = atof(optarg);
            break;
        case 'T':
            cfg.threads = atoi(optarg);
            break;
        case 'c':
            cfg.channels = atoi(optarg);
            break;
        case 'a':
            cfg.token = optarg;
            break;
        case 'r':
            cfg.role = optarg;
            break;
        case 'g':
            cfg.goal = optarg;
            break;
        default:
            usage();
        }
    }
    cfg.recommend = strcmp(cfg.kind, "recommend") == 0;
    if (!cfg.target || (!cfg.recommend && strcmp(cfg.kind, "echo") != 0) || cfg.concurrency < 1 ||
        cfg.concurrency > MAX_CONCURRENCY || cfg.threads < 1 || cfg.threads > MAX_THREADS ||
        cfg.channels < 1 || cfg.channels > MAX_CHANNELS || cfg.duration_s <= 0 ||
        cfg.duration_s > 600 || cfg.warmup_s < 0 || cfg.warmup_s > 60)
        usage();
    if (cfg.threads > cfg.concurrency) cfg.threads = cfg.concurrency;
}

int main(int argc, char **argv) {
    grpc_channel *chans[MAX_CHANNELS];
    worker workers[MAX_THREADS];
    uint64_t *hist = calloc(HIST_BUCKETS, sizeof *hist);
    parse_args(argc, argv);
    if (!hist || encode_request()) return 1;
    grpc_init();
    if (cfg.token) {
        static char bearer[4096];
        snprintf(bearer, sizeof bearer, "Bearer %s", cfg.token);
        auth_md.key = grpc_slice_from_static_string("authorization");
        auth_md.value = grpc_slice_from_static_string(bearer);
    }
    const char *path = cfg.recommend ? PATH_RECOMMEND : cfg.token ? PATH_ECHO_AUTH : PATH_ECHO;
    void *methods[MAX_CHANNELS];
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    for (int c = 0; c < cfg.channels; c++) {
        /* distinct channel args so each channel gets its own connection */
        grpc_arg arg = {GRPC_ARG_INTEGER, "model_registry_load.channel", {.integer = c}};
        grpc_channel_args args = {1, &arg};
        chans[c] = grpc_channel_create(cfg.target, creds, &args);
        methods[c] = grpc_channel_register_call(chans[c], path, NULL, NULL);
    }
    grpc_channel_credentials_release(creds);
    uint64_t t0 = now_ns();
    warm_end_ns = t0 + (uint64_t)(cfg.warmup_s * 1e9);
    end_ns = warm_end_ns + (uint64_t)(cfg.duration_s * 1e9);
    memset(workers, 0, sizeof workers);
    for (int t = 0; t < cfg.threads; t++) {
        worker *w = &workers[t];
        w->cq = grpc_completion_queue_create_for_next(NULL);
        w->nloops = cfg.concurrency / cfg.threads + (t < cfg.concurrency % cfg.threads);
        w->active = w->nloops;
        w->loops = calloc((size_t)w->nloops, sizeof *w->loops);
        w->hist = calloc(HIST_BUCKETS, sizeof *w->hist);
        if (!w->loops || !w->hist) return 1;
        for (int i = 0; i < w->nloops; i++) {
            int c = (t + i * cfg.threads) % cfg.channels;
            w->loops[i] = (loop){.w = w, .ch = chans[c], .method = methods[c]};
        }
    }
    for (int t = 0; t < cfg.threads; t++)
        pthread_create(&workers[t].thread, NULL, worker_main, &workers[t]);
    uint64_t calls = 0, errors = 0;
    for (int t = 0; t < cfg.threads; t++) {
        worker *w = &workers[t];
        pthread_join(w->thread, NULL);
        calls += w->calls;
        errors += w->errors;
        for (size_t i = 0; i < HIST_BUCKETS; i++)
            hist[i] += w->hist[i];
        grpc_completion_queue_shutdown(w->cq);
        while (grpc_completion_queue_next(w->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
               GRPC_QUEUE_SHUTDOWN) {
        }
        grpc_completion_queue_destroy(w->cq);
        free(w->loops);
        free(w->hist);
    }
    printf("{\"kind\":\"%s\",\"target\":\"%s\",\"concurrency\":%d,\"seconds\":%.1f,"
           "\"calls\":%llu,\"errors\":%llu,\"calls_per_s\":%.0f,\"p50_ms\":%.3f,"
           "\"p99_ms\":%.3f}\n",
           cfg.kind, cfg.target, cfg.concurrency, cfg.duration_s, (unsigned long long)calls,
           (unsigned long long)errors, (double)calls / cfg.duration_s,
           quantile_ms(hist, calls, 0.50), quantile_ms(hist, calls, 0.99));
    for (int c = 0; c < cfg.channels; c++)
        grpc_channel_destroy(chans[c]);
    grpc_slice_unref(req_slice);
    free(hist);
    grpc_shutdown();
    return calls > 0 && errors == 0 ? 0 : 1;
}
