/* One agent turn on the worker pool: ExecuteStep on the least loaded live worker, every worker
 * event handed to a sink the moment it arrives, cancellation, and one retry on another worker
 * when the first failed before anything reached the caller. Shared by SendMessage (the sink
 * relays to the caller's stream) and workflow agent steps (the sink tees node I/O frames). */
#ifndef UPSQUAD_ORCH_TURN_H
#define UPSQUAD_ORCH_TURN_H

#include <stdint.h>

#include "orch.h"
#include "relay.h"
#include "store.h"

typedef Upsquad__Runtime__V1__ExecuteStepRequest ExecuteStepRequest;

typedef struct orch_sink {
    /* Every worker event, in order. Returns 1 when it reached the caller, 0 when it was kept
     * back, -1 when the caller is gone (the turn is cancelled). */
    int (*on_event)(void *ud, const ExecuteStepEvent *ev);
    /* Polled about every 20 ms while the worker streams: non-zero cancels the worker call. */
    int (*cancelled)(void *ud);
    void *ud;
} orch_sink;

enum {
    TURN_COMPLETED = 0,
    TURN_FAILED = 1,         /* error event, worker failure, stream without completion */
    TURN_CANCELLED = 2,      /* the caller went away */
    TURN_NO_WORKER = 3,      /* nothing live to run it on */
    TURN_INPUT_REQUIRED = 4, /* the agent asked the user (ask_user) */
    TURN_INTERRUPT = 5,      /* a tool call needs approval */
};

typedef struct orch_turn_result {
    int outcome;
    char *final_text; /* heap */
    int64_t input_tokens, output_tokens;
    double cost_usd;
    char model[97];
    int loop_iterations;
    int relayed; /* events that reached the caller */
    char error_code[64];
    char *error_message; /* heap */
    int retryable;
    char worker[128];       /* the worker that ran it */
    int worker_answered;    /* the worker sent at least one event (it was alive) */
    ExecuteStepEvent *stop; /* input_required / interrupt_required event (caller frees) */
} orch_turn_result;

/* req: fully built except the bearer tokens, which are minted here for each attempt.
 * timeout_ms bounds the whole turn. */
int orch_turn_run(orch *o, ExecuteStepRequest *req, int64_t timeout_ms, const orch_sink *sink,
                  orch_turn_result *out);
/* The same, on the worker at address prefer when it is live (a turn resumed where its frozen
 * state was restored), else as orch_turn_run. */
int orch_turn_run_on(orch *o, ExecuteStepRequest *req, int64_t timeout_ms, const orch_sink *sink,
                     const char *prefer, orch_turn_result *out);
void orch_turn_result_clear(orch_turn_result *r);
/* The session's side of a turn's end, from its result (borrowed: e points into res).
 * loop_base: the session's loop_count when the turn began. */
void orch_turn_end_of(const orch_turn_result *res, int loop_base, orch_turn_end *e);

/* Starts/stops the cancellation watcher (one thread per process). */
int orch_turn_watcher_start(void);
void orch_turn_watcher_stop(void);

#endif
