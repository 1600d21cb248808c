/* The worker pool: RuntimeService targets, their liveness and load, and the choice of one.
 *
 * Targets (UPSQUAD_WORKER_TARGETS): a comma-separated list of host:port, and/or dns:///name:port
 * entries (a Kubernetes headless Service: every address the name resolves to is one worker;
 * resolved again on every probe round, so pods that come and go are followed).
 * Liveness: a probe thread calls grpc.health.v1.Health/Check on every target each
 * UPSQUAD_WORKER_PROBE; a target that answers is live. A call that fails to reach a worker marks
 * it down at once (until the next successful probe).
 * Load: the worker's own heartbeat (RuntimeService.Heartbeat, kept in Redis under
 * orch:worker:<worker_id> with a TTL) when its worker_id is the address the target names;
 * otherwise the relays this replica has in flight on it. The least loaded live worker wins;
 * ties go round-robin. */
#ifndef UPSQUAD_ORCH_WORKERS_H
#define UPSQUAD_ORCH_WORKERS_H

#include <stddef.h>

#include "rpc_client.h"

#define ORCH_WORKERS_MAX 64
#define ORCH_WORKER_KEY "orch:worker:" /* + worker_id: active_sessions, PX heartbeat TTL */

typedef struct orch_worker {
    char addr[128];
    rpc_channel *ch;
    int up;       /* under the pool's mutex */
    int inflight; /* relays of this replica on it */
    int hb_load;  /* active_sessions from its heartbeat; -1: unknown */
    int present;  /* still named by the targets */
} orch_worker;

typedef struct orch_workers orch_workers;

/* Parses targets and starts the probe thread (redis_url may be NULL: no heartbeat loads). */
/* tls: NULL for plaintext; borrowed, must outlive the pool. */
int orch_workers_start(const char *targets, long long probe_ms, const char *redis_url,
                       const rpc_client_tls *tls, orch_workers **out, char *err, size_t errlen);
void orch_workers_stop(orch_workers *w);

/* The least loaded live worker other than `avoid` (NULL ok), with its in-flight count raised;
 * NULL when none is live. The worker stays valid until orch_workers_stop. */
orch_worker *orch_workers_pick(orch_workers *w, const orch_worker *avoid);
/* The worker at addr when it is live, with its in-flight count raised; else NULL. */
orch_worker *orch_workers_pick_live(orch_workers *w, const char *addr);
void orch_workers_done(orch_workers *w, orch_worker *k);
/* A call could not reach it: not chosen again before a probe succeeds. */
void orch_workers_mark_down(orch_workers *w, orch_worker *k);
/* The worker with this address, live or not (TerminateSession tells the last one). */
orch_worker *orch_workers_find(orch_workers *w, const char *addr);
/* Live workers now. */
int orch_workers_live(orch_workers *w);

#endif
