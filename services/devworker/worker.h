/* devworker: a RuntimeService worker with a scripted, deterministic "model" (docs/devworker.md).
 *
 * The process state shared by the handlers (handlers.c), the step runner (step.c) and the
 * reporter thread (reporter.c): configuration, the bounded table of sessions this worker was
 * told about, the in-flight steps, and the outgoing queue of checkpoints for the orchestrator.
 *
 * Locking: w->mu guards sessions, steps and the checkpoint queue; it is never held across an
 * RPC or a sleep. */
#ifndef UPSQUAD_DW_WORKER_H
#define UPSQUAD_DW_WORKER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "cfg.h"
#include "metrics.h"
#include "rpc.h"
#include "rpc_client.h"

#define DW_ID_MAX 128           /* session / tenant / model id, including the NUL */
#define DW_CHECKPOINT_VERSION 1 /* default schema version written in the 4-byte prefix */

typedef struct dw_config {
    char *orchestrator_addr;    /* UPSQUAD_ORCHESTRATOR_ADDR; empty: no heartbeats/checkpoints */
    char *worker_id;            /* UPSQUAD_DEVWORKER_ID; empty: the advertised address */
    char *advertise_addr;       /* UPSQUAD_DEVWORKER_ADVERTISE_ADDR; empty: from the listen addr */
    char *grpc_addr;            /* UPSQUAD_GRPC_ADDR (read again for the advertised address) */
    char *require_scope;        /* UPSQUAD_DEVWORKER_REQUIRE_SCOPE; "any": any valid token */
    long long heartbeat_ms;     /* UPSQUAD_DEVWORKER_HEARTBEAT_INTERVAL */
    long long backoff_max_ms;   /* UPSQUAD_DEVWORKER_HEARTBEAT_BACKOFF_MAX */
    long long rpc_timeout_ms;   /* UPSQUAD_DEVWORKER_ORCHESTRATOR_TIMEOUT */
    long long token_ttl_ms;     /* UPSQUAD_DEVWORKER_TOKEN_TTL */
    long long max_sessions;     /* UPSQUAD_DEVWORKER_MAX_SESSIONS */
    long long checkpoint_queue; /* UPSQUAD_DEVWORKER_CHECKPOINT_QUEUE */
    long long checkpoint_ver;   /* UPSQUAD_DEVWORKER_CHECKPOINT_VERSION */
    long long max_script;       /* UPSQUAD_DEVWORKER_MAX_SCRIPT_ELEMENTS */
    int checkpoints_enabled;    /* UPSQUAD_DEVWORKER_CHECKPOINTS */
    int allow_crash;            /* UPSQUAD_DEVWORKER_ALLOW_CRASH */
    /* signing (shared variables, read again here: the worker mints its own bearer) */
    char *jwt_secret, *jwt_audience, *jwt_issuer;
    /* the service's certificate doubles as the client certificate towards the orchestrator */
    char *tls_cert, *tls_key, *tls_ca;
} dw_config;

/* A session this worker was initialised for (InitWorkerSession) or ran a step of. */
typedef struct dw_session {
    char id[DW_ID_MAX];
    char tenant[DW_ID_MAX];
    char model[DW_ID_MAX];
    int32_t next_iter; /* loop_iteration of the next checkpoint */
    int32_t ck_shift;  /* added to an iteration to key its checkpoint (reporter: collisions) */
    uint8_t *state;    /* latest checkpoint blob (prefix + body), owned; NULL: none */
    size_t state_len;
    char state_hash[65];
    uint64_t last_used; /* LRU eviction when the table is full */
    /* a suspension restored by InitWorkerSession(resume_checkpoint): the next step running the
     * same message resumes at element resume_at (after an approved interrupt) */
    int32_t resume_at;   /* 0: none */
    char resume_sha[65]; /* message_sha256 of the suspended script */
    char resume_call[DW_ID_MAX], resume_tool[DW_ID_MAX];
    /* what InitWorkerSession did to it, for the inspect directive (a recovery's proof) */
    int32_t inits;         /* InitWorkerSession calls for this session on this worker */
    int32_t restored_loop; /* loop_iteration of the restored checkpoint; -1: none */
} dw_session;

/* The session's InitWorkerSession history (dw_session_info). */
typedef struct dw_session_inits {
    int32_t inits, restored_loop, next_iter;
} dw_session_inits;

/* An ExecuteStep in flight: heartbeats name its session, TerminateSession stops it. */
typedef struct dw_step_ref {
    char session_id[DW_ID_MAX];
    atomic_int terminated;
    struct dw_step_ref *next;
} dw_step_ref;

/* One checkpoint waiting to be sent to the orchestrator (owned by the queue). */
typedef struct dw_ckpt {
    char session_id[DW_ID_MAX];
    char tenant[DW_ID_MAX];
    int32_t loop_iteration; /* the key it goes (went) out with */
    int32_t iteration;      /* the iteration the step reserved */
    uint8_t *bytes;
    size_t len;
    char sha256[65];
    int renumbered; /* times re-keyed after another worker's checkpoint held the iteration */
} dw_ckpt;

#define DW_MSG_RUNS 256 /* messages whose runs are counted (first_runs) */

typedef struct dw_worker {
    const dw_config *cfg;
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* reporter wake-ups: a checkpoint queued, stop */
    dw_session *sessions; /* cfg->max_sessions slots; id[0] == 0: free */
    size_t n_sessions;
    uint64_t clock;     /* LRU counter */
    dw_step_ref *steps; /* in-flight steps (list) */
    int n_steps;
    dw_ckpt *ckq; /* ring of cfg->checkpoint_queue entries */
    size_t ckq_head, ckq_len, ckq_cap;
    int stop;
    rpc_server *srv;    /* borrowed: the advertised port */
    char addr[256];     /* advertised address, once known */
    char id[DW_ID_MAX]; /* worker id, once known */
    auth_signer *signer;
    rpc_channel *orch;
    pthread_t reporter;
    int reporter_started;
    metric *m_steps, *m_steps_cancelled, *m_tokens, *m_scripts_invalid;
    metric *m_hb_ok, *m_hb_fail, *m_ck_ok, *m_ck_fail, *m_ck_dropped, *m_ck_refused;
    metric *m_inflight;
    /* how often each recent message ran here (the first_runs modifier); a ring, oldest
     * forgotten */
    struct {
        char sha[65];
        long long runs;
    } msg_runs[DW_MSG_RUNS];
    size_t msg_runs_next;
} dw_worker;

const cfg_var *dw_config_vars(size_t *n);
dw_config *dw_config_get(void);

/* Loads the signing variables, opens the orchestrator channel, starts the reporter thread. */
int dw_worker_start(dw_worker *w, const dw_config *cfg, rpc_server *srv, char *err, size_t errlen);
void dw_worker_stop(dw_worker *w);

/* Sessions (thread-safe). dw_session_touch creates the entry when absent (evicting the least
 * recently used one when the table is full) and fills tenant/model when given; it returns the
 * next loop iteration to use. */
int32_t dw_session_touch(dw_worker *w, const char *id, const char *tenant, const char *model);
/* Reserves the session's next loop iteration (two steps of one session in flight on this
 * worker never use the same number). */
int32_t dw_session_reserve_iter(dw_worker *w, const char *id);
/* The key the checkpoint of iteration `iter` goes out with: iter plus the session's shift (0
 * until another worker's checkpoint was found holding a key). */
int32_t dw_session_ck_key(dw_worker *w, const char *id, int32_t iter);
/* Iteration `iter` went out as `key` and another worker holds that key: the session's shift
 * grows so this and every later iteration go above it, in the same order. */
void dw_session_ck_taken(dw_worker *w, const char *id, int32_t iter, int32_t key);
/* Records the blob as the session's latest state (copied) and advances next_iter past iter. */
void dw_session_set_state(dw_worker *w, const char *id, int32_t iter, const uint8_t *blob,
                          size_t len, const char *hash);
/* Copies the latest state into the call arena; RPC_NOT_FOUND when the session has none. */
int dw_session_get_state(dw_worker *w, rpc_call *call, const char *id, uint8_t **blob, size_t *len,
                         char **hash);
/* Initialises (or re-initialises) a session; next_iter = next; restored_loop: the resumed
 * checkpoint's loop_iteration, -1 on a fresh init. Counts the init. */
void dw_session_init(dw_worker *w, const char *id, const char *tenant, const char *model,
                     int32_t next, int32_t restored_loop);
/* 1 with *out filled when this worker knows the session, else 0. */
int dw_session_info(dw_worker *w, const char *id, dw_session_inits *out);
/* Records a suspension to resume (InitWorkerSession with a suspended checkpoint). */
void dw_session_set_resume(dw_worker *w, const char *id, int32_t at, const char *sha,
                           const char *call_id, const char *tool);
/* Counts one more step of the message whose SHA-256 hex is sha on this worker; returns the
 * count including this one (1 the first time; a message forgotten by the ring starts again). */
long long dw_message_run(dw_worker *w, const char *sha);
/* Takes the pending suspension of a session (cleared either way): 1 with *at, call_id and tool
 * filled when the step's message is the suspended one (sha), else 0. */
int dw_session_take_resume(dw_worker *w, const char *id, const char *sha, int32_t *at,
                           char call_id[DW_ID_MAX], char tool[DW_ID_MAX]);
/* Forgets the session and marks its in-flight steps terminated. */
void dw_session_terminate(dw_worker *w, const char *id);
/* The model id recorded for a session ("" when unknown), copied into out. */
void dw_session_model(dw_worker *w, const char *id, char out[DW_ID_MAX]);

void dw_step_register(dw_worker *w, dw_step_ref *s);
void dw_step_unregister(dw_worker *w, dw_step_ref *s);

/* Queues a checkpoint for the orchestrator (copied). Full queue: the oldest is dropped. */
void dw_checkpoint_enqueue(dw_worker *w, const char *session_id, const char *tenant, int32_t iter,
                           const uint8_t *blob, size_t len, const char *sha256);

/* Reporter thread (reporter.c). */
void *dw_reporter_main(void *arg);

/* Copies s into a fixed buffer, truncating at a UTF-8 boundary is not needed for ids: ids
 * longer than DW_ID_MAX-1 are refused by the handlers. */
void dw_copy_id(char dst[DW_ID_MAX], const char *s);

#endif
