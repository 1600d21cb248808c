/* See service.h. */
#include "service.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "auth.h"
#include "bus.h"
#include "log.h"
#include "metrics.h"
#include "rpc_internal.h"

static struct {
    char *grpc_addr, *metrics_addr, *log_level;
    char *jwt_secret, *jwt_pubkey_file, *jwt_audience, *jwt_issuer;
    char *tls_cert, *tls_key, *tls_ca;
    long long unary_threads, stream_threads, stream_workers, max_streams, stream_queue, grace_ms;
    long long jwt_leeway_ms;
    /* hardening (docs/rpc.md) */
    long long max_decoded, conn_idle_ms, keepalive_ms, keepalive_timeout_ms, handshake_ms;
    long long max_health_watches, max_reflection_streams, metrics_conns, metrics_per_ip,
        metrics_idle_ms;
    long long blocking_workers, blocking_queue, bus_delivery_threads;
} C;

static const cfg_var common_vars[] = {
    {"UPSQUAD_GRPC_ADDR", CFG_STR, "0.0.0.0:50051", "gRPC listen address (port 0 picks one)",
     &C.grpc_addr},
    {"UPSQUAD_METRICS_ADDR", CFG_STR, "", "Prometheus /metrics HTTP address; empty disables",
     &C.metrics_addr},
    {"UPSQUAD_LOG_LEVEL", CFG_STR, "info", "debug, info, warn or error", &C.log_level},
    {"UPSQUAD_JWT_SECRET", CFG_STR, NULL, "HS256 secret verifying tokens (local runs)",
     &C.jwt_secret, 0, 0, CFG_SECRET},
    {"UPSQUAD_JWT_PUBLIC_KEY_FILE", CFG_STR, NULL,
     "PEM public key (RS256 or ES256) verifying the gateway's tokens (production)",
     &C.jwt_pubkey_file},
    {"UPSQUAD_JWT_AUDIENCE", CFG_STR, "upsquad", "required `aud` of tokens", &C.jwt_audience},
    {"UPSQUAD_JWT_ISSUER", CFG_STR, NULL, "required `iss` of tokens, when set", &C.jwt_issuer},
    {"UPSQUAD_JWT_LEEWAY", CFG_MS, "30s", "clock skew allowed on a token's `exp` and `nbf`",
     &C.jwt_leeway_ms, 0, 300000},
    {"UPSQUAD_TLS_CERT_FILE", CFG_STR, NULL, "server certificate chain (PEM); unset: plaintext",
     &C.tls_cert},
    {"UPSQUAD_TLS_KEY_FILE", CFG_STR, NULL, "server private key (PEM)", &C.tls_key},
    {"UPSQUAD_TLS_CLIENT_CA_FILE", CFG_STR, NULL,
     "CA bundle (PEM); set: mTLS, clients must present a certificate it verifies", &C.tls_ca},
    {"UPSQUAD_RPC_UNARY_THREADS", CFG_INT, "1",
     "threads running unary calls inline, one completion queue each; every thread polls the "
     "connections, so each one more costs wake-ups: raise it only when handlers block on I/O",
     &C.unary_threads, 1, 256},
    {"UPSQUAD_RPC_STREAM_THREADS", CFG_INT, "0",
     "threads driving streaming I/O; 0 shares the unary threads (best unless unary handlers "
     "block for long)",
     &C.stream_threads, 0, 64},
    {"UPSQUAD_RPC_STREAM_WORKERS", CFG_INT, "16", "threads running streaming handlers",
     &C.stream_workers, 1, 1024},
    {"UPSQUAD_RPC_MAX_STREAMS", CFG_INT, "1024",
     "concurrent server streams; more are refused with RESOURCE_EXHAUSTED", &C.max_streams, 1,
     1000000},
    {"UPSQUAD_RPC_STREAM_QUEUE", CFG_INT, "256",
     "frames queued per stream; a producer pushing into a full queue is told the subscriber "
     "is slow",
     &C.stream_queue, 1, 65536},
    {"UPSQUAD_RPC_BLOCKING_WORKERS", CFG_INT, "8",
     "threads running the handlers of methods that block (Postgres, other services), so they "
     "never delay health checks or non-blocking calls; started only when a method blocks",
     &C.blocking_workers, 1, 1024},
    {"UPSQUAD_RPC_BLOCKING_QUEUE", CFG_INT, "64",
     "blocking calls waiting for a free handler thread; more are refused with "
     "RESOURCE_EXHAUSTED (metric rpc_server_blocking_refused_total)",
     &C.blocking_queue, 1, 1000000},
    {"UPSQUAD_BUS_DELIVERY_THREADS", CFG_INT, "2",
     "threads delivering NATS messages to every subscription of the process (each "
     "subscription keeps its order on one of them); 0: a thread per subscription",
     &C.bus_delivery_threads, 0, 1024},
    {"UPSQUAD_SHUTDOWN_GRACE", CFG_MS, "10s",
     "on SIGTERM, how long in-flight calls may finish before they are cancelled", &C.grace_ms, 0,
     3600000},
    /* hardening (docs/rpc.md, "Hardening") */
    {"UPSQUAD_RPC_MAX_DECODED_BYTES", CFG_INT, "16777216",
     "a request's estimated decoded size, checked on the wire bytes before decoding; larger "
     "requests are refused with INVALID_ARGUMENT",
     &C.max_decoded, 65536, 1LL << 32},
    {"UPSQUAD_RPC_MAX_CONNECTION_IDLE", CFG_MS, "5m",
     "a connection without calls for this long is closed (GOAWAY; clients reconnect on demand)",
     &C.conn_idle_ms, 1000, 86400000},
    {"UPSQUAD_RPC_KEEPALIVE_TIME", CFG_MS, "2m",
     "a silent connection is pinged after this long ...", &C.keepalive_ms, 1000, 86400000},
    {"UPSQUAD_RPC_KEEPALIVE_TIMEOUT", CFG_MS, "20s",
     "... and closed when the ping is not answered within this", &C.keepalive_timeout_ms, 1000,
     600000},
    {"UPSQUAD_RPC_HANDSHAKE_TIMEOUT", CFG_MS, "10s",
     "a new connection must complete its HTTP/2 (and TLS) set-up within this", &C.handshake_ms, 100,
     600000},
    {"UPSQUAD_RPC_MAX_HEALTH_WATCHES", CFG_INT, "64",
     "concurrent grpc.health.v1.Health/Watch streams (no token needed); more are refused with "
     "RESOURCE_EXHAUSTED, so they cannot take the slots of authenticated streams",
     &C.max_health_watches, 1, 100000},
    {"UPSQUAD_RPC_MAX_REFLECTION_STREAMS", CFG_INT, "16",
     "concurrent gRPC server reflection streams (grpcurl; no token needed); more are refused "
     "with RESOURCE_EXHAUSTED",
     &C.max_reflection_streams, 1, 100000},
    {"UPSQUAD_METRICS_MAX_CONNECTIONS", CFG_INT, "256",
     "open connections to the metrics port; more are closed at once", &C.metrics_conns, 2, 4096},
    {"UPSQUAD_METRICS_MAX_PER_IP", CFG_INT, "8",
     "open connections to the metrics port from one address", &C.metrics_per_ip, 1, 4096},
    {"UPSQUAD_METRICS_IDLE_TIMEOUT", CFG_MS, "3s",
     "a metrics connection silent for this long is closed (whole seconds, at least 1 s)",
     &C.metrics_idle_ms, 1000, 600000},
};

const cfg_var *svc_common_vars(size_t *n) {
    *n = sizeof common_vars / sizeof common_vars[0];
    return common_vars;
}

static int make_verifier(auth_verifier **out, char *err, size_t errlen) {
    char *pem = NULL;
    int rc;
    if (C.jwt_pubkey_file && rpc__read_file(C.jwt_pubkey_file, &pem, err, errlen) != 0) return -1;
    if (pem == NULL && (C.jwt_secret == NULL || C.jwt_secret[0] == 0)) {
        snprintf(err, errlen, "UPSQUAD_JWT_SECRET or UPSQUAD_JWT_PUBLIC_KEY_FILE is required");
        return -1;
    }
    auth_config ac = {pem ? NULL : C.jwt_secret, pem, C.jwt_audience, C.jwt_issuer,
                      (int)(C.jwt_leeway_ms / 1000)};
    rc = auth_verifier_new(&ac, out, err, errlen);
    free(pem);
    return rc == AUTH_OK ? 0 : -1;
}

static int load_config(const svc_def *def, char *err, size_t errlen) {
    if (cfg_load(common_vars, sizeof common_vars / sizeof common_vars[0], err, errlen) != 0)
        return -1;
    if (def->n_vars && cfg_load(def->vars, def->n_vars, err, errlen) != 0) return -1;
    return 0;
}

static void print_config(const svc_def *def) {
    printf("## %s\n\n", def->name);
    cfg_print_markdown(common_vars, sizeof common_vars / sizeof common_vars[0], stdout);
    if (def->n_vars) cfg_print_markdown(def->vars, def->n_vars, stdout);
}

int svc_main(const svc_def *def, int argc, char **argv) {
    char err[1024] = "";
    int code = 1, migrate_only = 0;
    auth_verifier *verifier = NULL;
    rpc_server *srv = NULL;

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help-config") == 0) {
            print_config(def);
            return 0;
        } else if (strcmp(argv[i], "--migrate") == 0) {
            migrate_only = 1;
        } else {
            fprintf(stderr, "usage: %s [--help-config] [--migrate]\n", argv[0]);
            return 2;
        }
    }
    /* before any thread exists, so every thread inherits the mask and sigwait sees them */
    rpc_block_signals();
    signal(SIGPIPE, SIG_IGN);
    log_init(def->name, LOG_INFO);
    if (load_config(def, err, sizeof err) != 0) goto fail;
    int lvl = log_level_parse(C.log_level);
    if (lvl < 0) {
        snprintf(err, sizeof err, "UPSQUAD_LOG_LEVEL: unknown level \"%s\"", C.log_level);
        goto fail;
    }
    log_init(def->name, lvl);
    cfg_log(common_vars, sizeof common_vars / sizeof common_vars[0]);
    bus_set_delivery_threads((int)C.bus_delivery_threads);
    if (def->n_vars) cfg_log(def->vars, def->n_vars);
    if (migrate_only) {
        if (def->migrate == NULL) {
            log_info("svc.migrate", "no migrations");
            code = 0;
        } else if (def->migrate(def->state, err, sizeof err) == 0) {
            code = 0;
        } else {
            goto fail;
        }
        goto done;
    }
    if (make_verifier(&verifier, err, sizeof err) != 0) goto fail;
    rpc_tls tls = {C.tls_cert, C.tls_key, C.tls_ca};
    rpc_server_opts o = {
        .addr = C.grpc_addr,
        .unary_threads = (int)C.unary_threads,
        .stream_threads = (int)C.stream_threads,
        .stream_workers = (int)C.stream_workers,
        .max_streams = (int)C.max_streams,
        .stream_queue = (int)C.stream_queue,
        .blocking_workers = (int)C.blocking_workers,
        .blocking_queue = (int)C.blocking_queue,
        /* any of the three set: rpc_server_start refuses an incomplete set */
        .tls = (C.tls_cert || C.tls_key || C.tls_ca) ? &tls : NULL,
        .auth = verifier,
        .max_decoded_bytes = (size_t)C.max_decoded,
        .max_connection_idle_ms = (int)C.conn_idle_ms,
        .keepalive_time_ms = (int)C.keepalive_ms,
        .keepalive_timeout_ms = (int)C.keepalive_timeout_ms,
        .handshake_timeout_ms = (int)C.handshake_ms,
        .max_health_watches = (int)C.max_health_watches,
        .max_reflection_streams = (int)C.max_reflection_streams,
        .descriptors = rpc_descriptor_set,
        .descriptors_len = rpc_descriptor_set_len,
    };
    if (rpc_server_new(&o, &srv, err, sizeof err) != 0) goto fail;
    if (def->init && def->init(def->state, srv, err, sizeof err) != 0) goto fail;
    if (rpc_server_start(srv, err, sizeof err) != 0) goto fail;
    metrics_serve_opts mo = {(int)C.metrics_conns, (int)C.metrics_per_ip,
                             (int)((C.metrics_idle_ms + 999) / 1000)};
    if (C.metrics_addr && C.metrics_addr[0] &&
        metrics_serve_with(C.metrics_addr, &mo, err, sizeof err) != 0)
        goto fail;
    printf("port=%d\nmetrics_port=%d\n", rpc_server_port(srv), metrics_port());
    fflush(stdout);
    log_info("svc.ready", "%s listening on port %d, metrics on %d", def->name, rpc_server_port(srv),
             metrics_port());
    for (;;) {
        int sig = rpc_wait_signal();
        if (sig != SIGHUP) {
            log_info("svc.signal", "signal %d: shutting down", sig);
            break;
        }
        log_info("svc.signal", "SIGHUP: reloading");
        if (def->reload) def->reload(def->state);
    }
    rpc_server_shutdown(srv, (int)C.grace_ms);
    code = 0;
    goto done;
fail:
    log_error("svc.fatal", "%s", err);
    code = 1;
done:
    if (srv) rpc_server_shutdown(srv, 0);
    if (def->fini) def->fini(def->state);
    rpc_server_free(srv);
    metrics_stop();
    auth_verifier_free(verifier);
    cfg_free(common_vars, sizeof common_vars / sizeof common_vars[0]);
    if (def->n_vars) cfg_free(def->vars, def->n_vars);
    return code;
}
