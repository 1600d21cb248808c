/* The client of bench/devworker-stream/bench.sh: reads one server stream of N messages with
 * libcommon's client and reports its rate and the gaps between messages, as one JSON line.
 *
 *   devworker-stream --target HOST:PORT --mode step --count N [--token T]
 *       ExecuteStep on a devworker with the burst script  #!script [{"tokens": "tok tok …"}]
 *       (N words: N TokenEvents, nothing else).
 *   devworker-stream --target HOST:PORT --mode bare --count N [--payload B]
 *       PublicStream on rpc-bare-echo: N EchoResponses of about the same size.
 *
 * Both read with the same client code, so the ratio of the two rates is the cost of the
 * devworker's stream (script, event building, libcommon's stream queue) against the bare
 * C-core server streaming the same number of messages. Every message is decoded and checked. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "rpc_client.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"
#include "upsquad/test/v1/echo.pb-c.h"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static void usage(void) {
    fprintf(stderr, "usage: devworker-stream --target HOST:PORT --mode step|bare --count N "
                    "[--token T] [--payload B]\n");
    exit(2);
}

/* The burst script: N words. Caller frees. */
static char *burst_script(long n) {
    const char head[] = "#!script\n[{\"tokens\": \"", tail[] = "\"}]";
    size_t len = sizeof head + (size_t)n * 4 + sizeof tail;
    char *s = malloc(len), *p = s;
    if (s == NULL) return NULL;
    p += sprintf(p, "%s", head);
    for (long i = 0; i < n; i++)
        p += sprintf(p, i ? " tok" : "tok");
    sprintf(p, "%s", tail);
    return s;
}

int main(int argc, char **argv) {
    const char *target = NULL, *mode = NULL, *token = NULL;
    long count = 0, payload = 8;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--target"))
            target = argv[i + 1];
        else if (!strcmp(argv[i], "--mode"))
            mode = argv[i + 1];
        else if (!strcmp(argv[i], "--token"))
            token = argv[i + 1];
        else if (!strcmp(argv[i], "--count"))
            count = strtol(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--payload"))
            payload = strtol(argv[i + 1], NULL, 10);
        else
            usage();
    }
    if (!target || !mode || count <= 0 || count > 10000000 || (argc - 1) % 2) usage();
    int step = !strcmp(mode, "step");
    if (!step && strcmp(mode, "bare")) usage();

    rpc_channel *ch = NULL;
    rpc_reader *rd = NULL;
    char err[256];
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, &ch, err, sizeof err) != 0) {
        fprintf(stderr, "devworker-stream: %s\n", err);
        return 1;
    }
    uint64_t *gaps = malloc((size_t)count * sizeof *gaps);
    char *script = step ? burst_script(count) : NULL;
    if (!gaps || (step && !script)) return 1;

    Upsquad__Runtime__V1__ExecuteStepRequest sr = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_REQUEST__INIT;
    Upsquad__Runtime__V1__SessionSnapshot snap = UPSQUAD__RUNTIME__V1__SESSION_SNAPSHOT__INIT;
    Upsquad__Test__V1__EchoRequest er = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    sr.session_id = "bench-session";
    sr.tenant_id = "bench-org";
    sr.user_message = script;
    snap.model_id = "gpt-5.5";
    sr.snapshot = &snap;
    er.text = "tok";
    er.count = (int32_t)count;
    er.payload_bytes = (int32_t)payload;
    rpc_call_opts o = {.timeout_ms = 120000, .bearer = token};

    uint64_t t0 = now_ns(), t_first = 0, t_prev = 0;
    int rc = step ? rpc_stream_open(ch, "/upsquad.runtime.v1.RuntimeService/ExecuteStep", &sr.base,
                                    &upsquad__runtime__v1__execute_step_event__descriptor, &o, &rd)
                  : rpc_stream_open(ch, "/upsquad.test.v1.EchoService/PublicStream", &er.base,
                                    &upsquad__test__v1__echo_response__descriptor, &o, &rd);
    long n = 0, bad = 0;
    ProtobufCMessage *m;
    while (rc == 0 && rpc_reader_next(rd, &m) == 1) {
        uint64_t t = now_ns();
        if (n == 0)
            t_first = t;
        else if (n - 1 < count)
            gaps[n - 1] = t - t_prev;
        t_prev = t;
        if (step) {
            Upsquad__Runtime__V1__ExecuteStepEvent *ev = (void *)m;
            bad += ev->event_case != UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOKEN ||
                   ev->token->index != n;
        } else {
            bad += ((Upsquad__Test__V1__EchoResponse *)m)->seq != n;
        }
        n++;
        protobuf_c_message_free_unpacked(m, NULL);
    }
    uint64_t t_end = now_ns();
    rpc_status st = {0};
    int code = rd ? rpc_reader_close(rd, &st) : rc;
    if (code != 0 || n != count || bad) {
        fprintf(stderr, "devworker-stream: status %d (%s), %ld of %ld messages, %ld bad\n", code,
                st.message ? st.message : "", n, count, bad);
        return 1;
    }
    size_t ng = (size_t)(n > 1 ? n - 1 : 0);
    qsort(gaps, ng, sizeof *gaps, cmp_u64);
    double secs = (double)(t_end - t0) / 1e9;
    printf("{\"mode\":\"%s\",\"messages\":%ld,\"seconds\":%.6f,\"msgs_per_s\":%.1f,"
           "\"first_ms\":%.3f,\"gap_p50_us\":%.2f,\"gap_p99_us\":%.2f}\n",
           mode, n, secs, (double)n / secs, (double)(t_first - t0) / 1e6,
           ng ? (double)gaps[ng / 2] / 1e3 : 0.0, ng ? (double)gaps[ng * 99 / 100] / 1e3 : 0.0);
    rpc_status_clear(&st);
    free(gaps);
    free(script);
    rpc_channel_free(ch);
    return 0;
}
