/* The durable interpreter: leases runs from the run queue, advances them through the
 * definition they started with, dispatches side effects with idempotency keys, and records
 * every transition (with its outbox events) before acting on it. See docs/workflow-engine.md. */
#ifndef WF_INTERP_H
#define WF_INTERP_H

#include "run.h"
#include "wf.h"

/* Interpreter thread body (arg: wf_engine *). */
void *wf_interp_thread(void *arg);
/* Agent results consumer thread body. */
void *wf_results_thread(void *arg);
/* Outbox relay thread body (relay.c). */
void *wf_relay_thread(void *arg);
/* The relay's publishing plan for outbox rows in id order (subjects, payload lengths): msg[i]
 * the message row i goes in, wave[m] the wave of message m (both arrays of n); returns the
 * number of messages (-1 out of memory). A run's events (wf.status / wf.log) between two
 * other rows go in one RunEventBatch message, up to WF_RELAY_BATCH_EVENTS events and
 * WF_RELAY_BATCH_BYTES bytes, a fuller run's next message in a later wave; any other row is
 * its own message, alone in its wave, after every earlier row's and before every later row's. */
#define WF_RELAY_BATCH_EVENTS 256
#define WF_RELAY_BATCH_BYTES (256 * 1024) /* well under NATS' default max_payload, 1 MiB */
int wf_relay_plan(const char *const *subjects, const int *lens, int n, int *msg, int *wave);
/* Schedule firing thread body. */
void *wf_scheduler_thread(void *arg);

/* CancelRun inside the caller's transaction: every action not yet terminal fails as
 * cancelled (emitting its transition), open governance rows close. */
int wf_interp_cancel(wf_run *r, char *err, size_t errlen);

/* Parses a schedule trigger_config ({"cron": "m h dom mon dow", "timezone": "Area/City"} or
 * {"interval_seconds": N}) and computes the first firing after after_ms. 0, or -1 with err
 * naming the field. */
int wf_schedule_next(db_pool *p, const char *spec_json, int64_t after_ms, int64_t *next_ms,
                     char *err, size_t errlen);

#endif

/* A person decided the parked gate action_id of r (locked by the caller's transaction): the
 * action takes status ("approved", "rejected", "completed" or "escalated") and output (JSON
 * object text; NULL keeps it), and the run walks on in the same transaction. *new_ids (caller
 * frees) is a Postgres uuid[] literal of the actions the walk created. The caller wakes the
 * run's queue row so the next tick dispatches their side effects. */
int wf_interp_decide(wf_engine *e, wf_run *r, const char *action_id, const char *status,
                     const char *output_json, char **new_ids, char *err, size_t errlen);
