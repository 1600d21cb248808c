/* devtools-invoke: the load generator of bench/devtools-invoke/bench.sh, and its baseline.
 *
 *   devtools-invoke bare                  the limit: a bare nats.c responder on
 *                                         tool.invoke.bench (queue group "bench") answering
 *                                         every request with one pre-packed
 *                                         ToolInvokeResponse; prints "ready"; SIGTERM stops it
 *   devtools-invoke load TOOL ACTION SECONDS CONCURRENCY
 *                                         CONCURRENCY threads send ToolInvokeRequests (a new
 *                                         idempotency key each) to tool.invoke.TOOL and decode
 *                                         the replies; prints one JSON line
 *                                         {"rps":..,"p50_us":..,"p99_us":..,"errors":..}
 * Both sides use plain nats.c on one connection. UPSQUAD_NATS_URL names the server. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cjson/cJSON.h>
#include <nats/nats.h>

#include "pbjson.h"
#include "upsquad/internal/v1/tool.pb-c.h"

#define MAX_SAMPLES (1 << 20)

static natsConnection *nc;
static uint8_t *g_reply;
static int g_reply_len;

static int64_t now_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

/* A reply shaped like devtools' answer to github.get_issue (same fields, similar size). */
static int pack_reply(void) {
    const char *json = "{\"number\":42,\"title\":\"Widget export fails on acme/widgets\","
                       "\"body\":\"Exporting a widget with more than 100 parts returns HTTP 500."
                       "\\n\\nSteps: open a large widget, choose Export.\",\"state\":\"open\","
                       "\"labels\":[\"bug\"],\"author\":\"octocat\",\"html_url\":"
                       "\"https://github.com/acme/widgets/issues/42\"}";
    char err[128];
    cJSON *j = cJSON_Parse(json);
    Upsquad__Internal__V1__ToolInvokeResponse r = UPSQUAD__INTERNAL__V1__TOOL_INVOKE_RESPONSE__INIT;
    if (!j || pbjson_struct_from_json(j, &r.result, err, sizeof err) != 0) return -1;
    cJSON_Delete(j);
    r.ok = 1;
    g_reply_len = (int)upsquad__internal__v1__tool_invoke_response__get_packed_size(&r);
    g_reply = malloc((size_t)g_reply_len);
    upsquad__internal__v1__tool_invoke_response__pack(&r, g_reply);
    pbjson_struct_free(r.result);
    return 0;
}

static void on_bare(natsConnection *c, natsSubscription *s, natsMsg *m, void *ud) {
    (void)s;
    (void)ud;
    natsConnection_Publish(c, natsMsg_GetReply(m), g_reply, g_reply_len);
    natsMsg_Destroy(m);
}

static int run_bare(void) {
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    natsSubscription *sub = NULL;
    if (pack_reply() != 0 ||
        natsConnection_QueueSubscribe(&sub, nc, "tool.invoke.bench", "bench", on_bare, NULL) !=
            NATS_OK ||
        natsSubscription_SetPendingLimits(sub, 65536, 64 << 20) != NATS_OK ||
        natsConnection_Flush(nc) != NATS_OK)
        return 1;
    printf("ready\n");
    fflush(stdout);
    int sig;
    sigwait(&sigs, &sig);
    natsSubscription_Unsubscribe(sub);
    natsSubscription_Destroy(sub);
    free(g_reply);
    return 0;
}

typedef struct loader {
    const char *tool, *action;
    char subject[128];
    int64_t end_us;
    atomic_long seq, errors, done;
    int64_t *samples;
    atomic_long nsamples;
} loader;

static void *load_thread(void *arg) {
    loader *L = arg;
    char key[64], err[128];
    cJSON *args = cJSON_Parse("{\"repo\":\"acme/widgets\",\"number\":42}");
    Upsquad__Internal__V1__ToolInvokeRequest q = UPSQUAD__INTERNAL__V1__TOOL_INVOKE_REQUEST__INIT;
    if (!args || pbjson_struct_from_json(args, &q.arguments, err, sizeof err) != 0) return NULL;
    cJSON_Delete(args);
    q.org_id = "0d5e0000-0000-0000-0000-000000000001";
    q.run_id = "0d5e0000-0000-0000-0000-0000000000b1";
    q.step_name = "bench";
    q.tool = (char *)L->tool;
    q.action = (char *)L->action;
    q.idempotency_key = key;
    uint8_t buf[1024];
    while (now_us() < L->end_us) {
        snprintf(key, sizeof key, "bench-%d-%ld", (int)getpid(), atomic_fetch_add(&L->seq, 1));
        size_t n = upsquad__internal__v1__tool_invoke_request__pack(&q, buf);
        natsMsg *reply = NULL;
        int64_t t0 = now_us();
        if (natsConnection_Request(&reply, nc, L->subject, buf, (int)n, 5000) != NATS_OK) {
            atomic_fetch_add(&L->errors, 1);
            continue;
        }
        Upsquad__Internal__V1__ToolInvokeResponse *r =
            upsquad__internal__v1__tool_invoke_response__unpack(
                NULL, (size_t)natsMsg_GetDataLength(reply),
                (const uint8_t *)natsMsg_GetData(reply));
        int64_t dt = now_us() - t0;
        if (!r || !r->ok)
            atomic_fetch_add(&L->errors, 1);
        else
            atomic_fetch_add(&L->done, 1);
        if (r) upsquad__internal__v1__tool_invoke_response__free_unpacked(r, NULL);
        natsMsg_Destroy(reply);
        long i = atomic_fetch_add(&L->nsamples, 1);
        if (i < MAX_SAMPLES) L->samples[i] = dt;
    }
    pbjson_struct_free(q.arguments);
    return NULL;
}

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int run_load(const char *tool, const char *action, double seconds, int conc) {
    static loader L;
    L.tool = tool;
    L.action = action;
    snprintf(L.subject, sizeof L.subject, "tool.invoke.%s", tool);
    L.samples = malloc(sizeof(int64_t) * MAX_SAMPLES);
    if (!L.samples || conc < 1 || conc > 256) return 1;
    pthread_t th[256];
    int64_t t0 = now_us();
    L.end_us = t0 + (int64_t)(seconds * 1e6);
    for (int i = 0; i < conc; i++)
        pthread_create(&th[i], NULL, load_thread, &L);
    for (int i = 0; i < conc; i++)
        pthread_join(th[i], NULL);
    double elapsed = (double)(now_us() - t0) / 1e6;
    long n = atomic_load(&L.nsamples);
    if (n > MAX_SAMPLES) n = MAX_SAMPLES;
    qsort(L.samples, (size_t)n, sizeof(int64_t), cmp64);
    printf("{\"rps\":%.0f,\"p50_us\":%lld,\"p99_us\":%lld,\"errors\":%ld}\n",
           (double)atomic_load(&L.done) / elapsed, n ? (long long)L.samples[n / 2] : 0,
           n ? (long long)L.samples[n * 99 / 100] : 0, atomic_load(&L.errors));
    free(L.samples);
    return atomic_load(&L.errors) ? 2 : 0;
}

int main(int argc, char **argv) {
    const char *url = getenv("UPSQUAD_NATS_URL");
    if (!url || argc < 2) {
        fprintf(stderr, "usage: UPSQUAD_NATS_URL=... %s bare | load TOOL ACTION SECONDS CONC\n",
                argv[0]);
        return 2;
    }
    if (natsConnection_ConnectTo(&nc, url) != NATS_OK) {
        fprintf(stderr, "cannot connect to %s\n", url);
        return 1;
    }
    int rc = 2;
    if (strcmp(argv[1], "bare") == 0)
        rc = run_bare();
    else if (strcmp(argv[1], "load") == 0 && argc == 6)
        rc = run_load(argv[2], argv[3], atof(argv[4]), atoi(argv[5]));
    natsConnection_Close(nc);
    natsConnection_Destroy(nc);
    nats_Close();
    return rc;
}
