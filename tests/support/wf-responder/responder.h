/* wf-responder: a test consumer of the workflow engine's agent steps (docs/devtools.md,
 * "wf-responder"). It takes AgentStepDispatch from the JetStream work queue AGENT_STEPS and
 * publishes one AgentStepResult per step on agent.step.result.<org>.<run>, chosen by cues in
 * the step's goal text, and counts dispatches and executions per idempotency key. */
#ifndef WF_RESPONDER_H
#define WF_RESPONDER_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "bus.h"

typedef struct wr_opts {
    const char *durable;       /* durable pull consumer of AGENT_STEPS */
    const char *stats_subject; /* request/reply JSON stats */
    long long workers;         /* threads, each with its own pull subscription */
    long long keys;            /* bound of the per-key record (LRU) */
    long long ack_wait_ms;     /* redelivery of an unacked dispatch */
} wr_opts;

/* What the goal's cues ask for (cues.c). */
enum { WR_COMPLETED, WR_FAILED, WR_INPUT_REQUIRED, WR_INTERRUPT_REQUIRED };

typedef struct wr_cues {
    int outcome;
    char fail_code[64];
    int fail_retryable;
    int fail_attempts; /* #fail_attempts=N: attempts 1..N fail (retryable), later complete */
    long long sleep_ms;
    cJSON *output; /* owned: #output={...} or #output@<attempt>={...} for this attempt */
    long long input_tokens, output_tokens; /* -1: computed */
    double cost_usd;                       /* < 0: computed */
} wr_cues;

#define WR_CUE_MAX_MS (10 * 60 * 1000)

/* Reads the cues of goal for the given attempt. Unknown #words (Markdown, "#42") are text. */
void wr_cues_parse(const char *goal, int attempt, wr_cues *out);
void wr_cues_free(wr_cues *c);

typedef struct wr wr;

/* Ensures the streams exist (created when missing, left alone when present), binds the durable
 * consumer, starts the workers and the stats subscription. b borrowed. *out: wr_stop. */
int wr_start(bus *b, const wr_opts *o, wr **out, char *err, size_t errlen);
void wr_stop(wr *r);

#endif
