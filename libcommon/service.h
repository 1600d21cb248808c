/* The life of a service executable, so main.c only wires: configuration from the environment
 * (the shared variables below plus the service's own table), logging, token verification,
 * the gRPC server with health, metrics over HTTP, SIGHUP reloads, and a graceful stop on
 * SIGTERM/SIGINT that exits 0.
 *
 * Shared variables (every service):
 *   UPSQUAD_GRPC_ADDR, UPSQUAD_METRICS_ADDR, UPSQUAD_LOG_LEVEL, UPSQUAD_JWT_SECRET,
 *   UPSQUAD_JWT_PUBLIC_KEY_FILE, UPSQUAD_JWT_AUDIENCE, UPSQUAD_JWT_ISSUER, UPSQUAD_TLS_CERT_FILE,
 *   UPSQUAD_TLS_KEY_FILE, UPSQUAD_TLS_CLIENT_CA_FILE, UPSQUAD_RPC_UNARY_THREADS,
 *   UPSQUAD_RPC_STREAM_THREADS, UPSQUAD_RPC_STREAM_WORKERS, UPSQUAD_RPC_MAX_STREAMS,
 *   UPSQUAD_RPC_STREAM_QUEUE, UPSQUAD_SHUTDOWN_GRACE, and the hardening budgets (docs/rpc.md):
 *   UPSQUAD_RPC_MAX_DECODED_BYTES, UPSQUAD_RPC_MAX_CONNECTION_IDLE, UPSQUAD_RPC_KEEPALIVE_TIME,
 *   UPSQUAD_RPC_KEEPALIVE_TIMEOUT, UPSQUAD_RPC_HANDSHAKE_TIMEOUT, UPSQUAD_RPC_MAX_HEALTH_WATCHES,
 *   UPSQUAD_METRICS_MAX_CONNECTIONS, UPSQUAD_METRICS_MAX_PER_IP, UPSQUAD_METRICS_IDLE_TIMEOUT
 *   (documented in svc_common_vars()).
 *
 * Command line: `--help-config` prints every variable as a markdown table; `--migrate` runs the
 * service's migrations and exits (a Kubernetes Job), when the service has any. */
#ifndef UPSQUAD_SERVICE_H
#define UPSQUAD_SERVICE_H

#include "cfg.h"
#include "rpc.h"

typedef struct svc_def {
    const char *name;    /* "model-registry": log `svc` field and metrics */
    const cfg_var *vars; /* the service's own variables (may be NULL) */
    size_t n_vars;
    void *state; /* passed to the hooks */
    /* After configuration and logging, before serving: open stores, load state, register the
     * methods with rpc_server_add. Returns 0, or non-zero with err filled (exit 1). */
    int (*init)(void *state, rpc_server *srv, char *err, size_t errlen);
    int (*migrate)(void *state, char *err, size_t errlen); /* optional: --migrate */
    void (*reload)(void *state);                           /* optional: SIGHUP */
    void (*fini)(void *state);                             /* optional: after the server stopped */
} svc_def;

/* Runs the service until SIGTERM/SIGINT; returns the process exit code. Prints "port=N" and
 * then "metrics_port=M" (0 when disabled) on stdout once listening (tests bind port 0). */
int svc_main(const svc_def *def, int argc, char **argv);

/* The shared variables' table, for documentation tools. */
const cfg_var *svc_common_vars(size_t *n);

#endif
