/* The one redaction rule of node data (docs/security.md, "One redaction rule").
 *
 * Every path that returns a step's input or output, a run's context, a gate's spec, an agent's
 * transcript or its live frames decides what a caller sees with redact_visible: the
 * workflow-engine's reads (GetNodeIO, GetWorkflowStatus, ListRuns, ListVisibleRuns,
 * ListPendingApprovals, the ApprovalService) and the stream-hub's (StreamNodeIO,
 * GetNodeTranscript). A value is one of three kinds:
 *
 *   REDACT_STRUCTURAL  names, ids, statuses, timings, a user prompt's frame: every clearance
 *                      (spec NodeIOFrame: "STRUCTURAL frames" reach every caller);
 *   REDACT_PAYLOAD     a top-level key of node data: from the workflow's classification floor
 *                      (redact_floor) up; a key naming a secret (redact_sensitive_key) from
 *                      clearance REDACT_FREE_TEXT_CLEARANCE up, whatever the floor;
 *   REDACT_FREE_TEXT   what the agent said or did in words (token text, tool result summaries,
 *                      transcript text, tool arguments and results): from
 *                      REDACT_FREE_TEXT_CLEARANCE up (spec StreamNodeIO "Live redaction
 *                      floor"), and never below the floor.
 */
#ifndef UPSQUAD_REDACTION_H
#define UPSQUAD_REDACTION_H

#define REDACT_FREE_TEXT_CLEARANCE 4

typedef enum { REDACT_STRUCTURAL, REDACT_PAYLOAD, REDACT_FREE_TEXT } redact_kind;

/* The clearance floor of a data_classification: public 0, internal (and anything unknown) 2,
 * confidential 3, restricted 4. */
int redact_floor(const char *classification);
/* 1 when key (case-insensitive) names a secret: password, secret, token, api_key, apikey,
 * authorization, credential, private_key. */
int redact_sensitive_key(const char *key);
/* 1 when a caller of clearance sees a value of this kind named key (may be NULL) of data
 * whose floor is floor. */
int redact_visible(int clearance, int floor, redact_kind kind, const char *key);

#endif
