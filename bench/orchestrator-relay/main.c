/* orchestrator-relay: the client of bench/orchestrator-relay/bench.sh.
 *
 *   orchestrator-relay --mode relay  --target ORCH --token T --agent A --count N
 *       one SendMessage whose message is a devworker burst script of N tokens, read through
 *       the orchestrator, in a session created first (CreateSession, not timed: session
 *       set-up is the `first` mode's figure);
 *   orchestrator-relay --mode direct --target WORKER --token T --count N
 *       the same script as one ExecuteStep read from the devworker directly;
 *   orchestrator-relay --mode first  --target ORCH --token T --agent A --count K
 *       K SendMessage calls without a session (session create + InitWorkerSession + turn),
 *       each timed to its first token;
 *   orchestrator-relay --mode bare   --target WORKER
 *       the relay's limit: a bare relay server on the libcommon rpc layer the orchestrator
 *       uses (rpc.h server streaming in, rpc_client.h rpc_stream_open/rpc_reader_next out),
 *       with the server defaults the orchestrator runs with, serving ExecuteStep by opening
 *       the same call on WORKER and re-sending each event as it is read: no service logic
 *       (no session, no transaction, no projection). Prints "port=N" and serves until
 *       SIGTERM; `--mode direct --target` its port reads through it.
 * Prints one JSON line (relay, direct): tokens_per_s = tokens / (request sent -> last token),
 * the rate the caller sees; burst_tokens_per_s = from the first token to the last (inflated
 * when the stream was already buffered when the first token was read: the transport holds
 * whole runs of messages, so it measures the client's decoding, not the stream); first-token
 * ms; per-token gap p50/p99. Or first-token p50/p99 (first). Exit 1 when a stream fails or a
 * token is missing. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "rpc.h"
#include "rpc_client.h"
#include "upsquad/runtime/v1/lifecycle.pb-c.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* This process's CPU time so far (user + system), in microseconds. */
static double cpu_now_us(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) * 1e6 +
           (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec);
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

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

/* A new session of the agent (CreateSession); sid: 37 bytes. 0 or -1. */
static int create_session(rpc_channel *ch, const char *agent, const char *token, char *sid) {
    rpc_call_opts o = {.timeout_ms = 30000, .bearer = token};
    Upsquad__Runtime__V1__CreateSessionRequest r =
        UPSQUAD__RUNTIME__V1__CREATE_SESSION_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    r.agent_id = (char *)agent;
    int code =
        rpc_unary_call(ch, "/upsquad.runtime.v1.LifecycleService/CreateSession", &r.base,
                       &upsquad__runtime__v1__create_session_response__descriptor, &o, &resp, NULL);
    if (code == 0 && resp)
        snprintf(sid, 37, "%s", ((Upsquad__Runtime__V1__CreateSessionResponse *)resp)->session_id);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    return code == 0 ? 0 : -1;
}

/* Opens the stream of one turn (relay: in session sid, or a new one when sid is empty). */
static int open_turn(rpc_channel *ch, int relay, const char *agent, const char *sid,
                     const char *msg, const char *token, rpc_reader **rd) {
    rpc_call_opts o = {.timeout_ms = 120000, .bearer = token};
    if (relay) {
        Upsquad__Runtime__V1__SendMessageRequest r =
            UPSQUAD__RUNTIME__V1__SEND_MESSAGE_REQUEST__INIT;
        r.agent_id = sid[0] ? "" : (char *)agent;
        r.session_id = (char *)sid;
        r.message = (char *)msg;
        return rpc_stream_open(ch, "/upsquad.runtime.v1.LifecycleService/SendMessage", &r.base,
                               &upsquad__runtime__v1__agent_event__descriptor, &o, rd);
    }
    Upsquad__Runtime__V1__ExecuteStepRequest sr = UPSQUAD__RUNTIME__V1__EXECUTE_STEP_REQUEST__INIT;
    Upsquad__Runtime__V1__SessionSnapshot snap = UPSQUAD__RUNTIME__V1__SESSION_SNAPSHOT__INIT;
    sr.session_id = "00000000-0000-4000-8000-00000000be0c";
    sr.tenant_id = "00000000-0000-4000-8000-0000000000be";
    sr.user_message = (char *)msg;
    snap.model_id = "claude-sonnet-4-6";
    sr.snapshot = &snap;
    return rpc_stream_open(ch, "/upsquad.runtime.v1.RuntimeService/ExecuteStep", &sr.base,
                           &upsquad__runtime__v1__execute_step_event__descriptor, &o, rd);
}

/* 1 when m is a token event (either message type). */
static int is_token(int relay, ProtobufCMessage *m) {
    if (relay)
        return ((Upsquad__Runtime__V1__AgentEvent *)m)->event_case ==
               UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_TOKEN;
    return ((Upsquad__Runtime__V1__ExecuteStepEvent *)m)->event_case ==
           UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOKEN;
}

/* The bare relay's ExecuteStep: the same request upstream, every event re-sent as read. */
static int bare_execute_step(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    rpc_channel *up = ud;
    /* the caller's bearer, passed on (the devworker verifies it) */
    const char *auth = rpc_metadata(call, "authorization");
    rpc_call_opts o = {.timeout_ms = 120000,
                       .bearer = auth && !strncmp(auth, "Bearer ", 7) ? auth + 7 : NULL};
    rpc_reader *rd = NULL;
    ProtobufCMessage *m;
    int rc = RPC_OK;
    if (rpc_stream_open(up, "/upsquad.runtime.v1.RuntimeService/ExecuteStep", req,
                        &upsquad__runtime__v1__execute_step_event__descriptor, &o, &rd) != 0)
        return rpc_error(call, RPC_UNAVAILABLE, "bare relay: upstream open failed");
    while (rc == RPC_OK && rpc_reader_next(rd, &m) == 1) {
        rc = rpc_stream_send(call, m);
        protobuf_c_message_free_unpacked(m, NULL);
    }
    rpc_status st = {0};
    int code = rpc_reader_close(rd, &st);
    if (rc == RPC_OK && code != 0)
        rc = rpc_error(call, code, "bare relay: upstream: %s", st.message ? st.message : "");
    rpc_status_clear(&st);
    return rc == RPC_OK ? RPC_OK : rc;
}

static int bare_serve(const char *target) {
    rpc_block_signals();
    rpc_channel *up = NULL;
    rpc_server *s = NULL;
    char err[256];
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, &up, err, sizeof err)) goto fail;
    /* the defaults of the service config table (libcommon/service.c), which the bench's
     * orchestrator runs with; its message size (UPSQUAD_MESSAGE_MAX=1048576 in bench.sh) is
     * under both of the server's limits here */
    rpc_server_opts so = {.addr = "127.0.0.1:0",
                          .unary_threads = 1,
                          .stream_threads = 0,
                          .stream_workers = 16,
                          .max_streams = 1024,
                          .stream_queue = 256};
    rpc_method m = {.path = "/upsquad.runtime.v1.RuntimeService/ExecuteStep",
                    .kind = RPC_SERVER_STREAM,
                    .auth = RPC_AUTH_NONE,
                    .req_desc = &upsquad__runtime__v1__execute_step_request__descriptor,
                    .resp_desc = &upsquad__runtime__v1__execute_step_event__descriptor,
                    .stream = bare_execute_step,
                    .ud = up};
    if (rpc_server_new(&so, &s, err, sizeof err) || rpc_server_add(s, &m, 1) ||
        rpc_server_start(s, err, sizeof err))
        goto fail;
    printf("port=%d\n", rpc_server_port(s));
    fflush(stdout);
    rpc_wait_signal();
    rpc_server_shutdown(s, 1000);
    rpc_server_free(s);
    rpc_channel_free(up);
    return 0;
fail:
    fprintf(stderr, "orchestrator-relay: bare relay: %s\n", err);
    if (s) rpc_server_free(s);
    if (up) rpc_channel_free(up);
    return 1;
}

int main(int argc, char **argv) {
    const char *target = NULL, *mode = NULL, *token = NULL, *agent = "";
    long count = 0;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--target"))
            target = argv[i + 1];
        else if (!strcmp(argv[i], "--mode"))
            mode = argv[i + 1];
        else if (!strcmp(argv[i], "--token"))
            token = argv[i + 1];
        else if (!strcmp(argv[i], "--agent"))
            agent = argv[i + 1];
        else if (!strcmp(argv[i], "--count"))
            count = strtol(argv[i + 1], NULL, 10);
    }
    if (target && mode && !strcmp(mode, "bare")) return bare_serve(target);
    if (!target || !mode || count <= 0 || count > 10000000) {
        fprintf(stderr, "usage: orchestrator-relay --mode relay|direct|first --target HOST:PORT "
                        "--count N [--token T] [--agent A]\n"
                        "       orchestrator-relay --mode bare --target WORKER\n");
        return 2;
    }
    int first = !strcmp(mode, "first"), relay = first || !strcmp(mode, "relay");
    rpc_channel *ch = NULL;
    char err[256];
    rpc_channel_opts co = {.target = target};
    if (rpc_channel_new(&co, &ch, err, sizeof err)) {
        fprintf(stderr, "orchestrator-relay: %s\n", err);
        return 1;
    }
    uint64_t *v = malloc((size_t)count * sizeof *v);
    if (!v) return 1;
    if (first) {
        for (long k = 0; k < count; k++) {
            rpc_reader *rd = NULL;
            ProtobufCMessage *m;
            uint64_t t0 = now_ns();
            int got = 0;
            open_turn(ch, 1, agent, "", "hello bench", token, &rd);
            while (rpc_reader_next(rd, &m) == 1) {
                if (!got && is_token(1, m)) {
                    v[k] = now_ns() - t0;
                    got = 1;
                }
                protobuf_c_message_free_unpacked(m, NULL);
            }
            rpc_status st = {0};
            int code = rpc_reader_close(rd, &st);
            if (code || !got) {
                fprintf(stderr, "orchestrator-relay: turn %ld: status %d (%s)\n", k, code,
                        st.message ? st.message : "no token");
                return 1;
            }
            rpc_status_clear(&st);
        }
        qsort(v, (size_t)count, sizeof *v, cmp_u64);
        printf("{\"mode\":\"first\",\"turns\":%ld,\"first_p50_ms\":%.3f,\"first_p99_ms\":%.3f}\n",
               count, (double)v[count / 2] / 1e6, (double)v[count * 99 / 100] / 1e6);
        return 0;
    }
    char *script = burst_script(count);
    rpc_reader *rd = NULL;
    char sid[37] = "";
    if (relay && create_session(ch, agent, token, sid) != 0) {
        fprintf(stderr, "orchestrator-relay: CreateSession failed\n");
        return 1;
    }
    /* the connection is up before the clock starts, on both sides (the relay's CreateSession
     * opened it already) */
    Grpc__Health__V1__HealthCheckRequest hreq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *hresp = NULL;
    rpc_call_opts ho = {.timeout_ms = 10000};
    rpc_unary_call(ch, "/grpc.health.v1.Health/Check", &hreq.base,
                   &grpc__health__v1__health_check_response__descriptor, &ho, &hresp, NULL);
    if (hresp) protobuf_c_message_free_unpacked(hresp, NULL);
    double cpu0 = cpu_now_us(); /* the timed run's CPU only, not the set-up before it */
    uint64_t t0 = now_ns(), t_first = 0, t_prev = 0;
    long n = 0;
    ProtobufCMessage *m;
    open_turn(ch, relay, agent, sid, script, token, &rd);
    while (rpc_reader_next(rd, &m) == 1) {
        if (is_token(relay, m)) {
            uint64_t t = now_ns();
            if (n == 0)
                t_first = t;
            else
                v[n - 1] = t - t_prev;
            t_prev = t;
            n++;
        }
        protobuf_c_message_free_unpacked(m, NULL);
    }
    uint64_t t_end = t_prev;
    rpc_status st = {0};
    int code = rpc_reader_close(rd, &st);
    if (code || n != count) {
        fprintf(stderr, "orchestrator-relay: status %d (%s), %ld of %ld tokens\n", code,
                st.message ? st.message : "", n, count);
        return 1;
    }
    size_t ng = (size_t)(n - 1);
    qsort(v, ng, sizeof *v, cmp_u64);
    /* the rate the caller sees: request to last token (the turn's own set-up included: for
     * the relay a transaction and the worker call, for the devworker parsing the script) */
    double secs = (double)(t_end - t0) / 1e9, burst = (double)(t_end - t_first) / 1e9;
    double cpu = cpu_now_us() - cpu0;
    printf("{\"mode\":\"%s\",\"tokens\":%ld,\"seconds\":%.6f,\"tokens_per_s\":%.1f,"
           "\"burst_tokens_per_s\":%.1f,\"first_ms\":%.3f,\"gap_p50_us\":%.2f,"
           "\"gap_p99_us\":%.2f,\"cpu_us\":%.0f}\n",
           mode, n, secs, secs > 0 ? (double)n / secs : 0.0,
           burst > 0 ? (double)(n - 1) / burst : 0.0, (double)(t_first - t0) / 1e6,
           ng ? (double)v[ng / 2] / 1e3 : 0.0, ng ? (double)v[ng * 99 / 100] / 1e3 : 0.0, cpu);
    rpc_status_clear(&st);
    free(v);
    free(script);
    rpc_channel_free(ch);
    return 0;
}
