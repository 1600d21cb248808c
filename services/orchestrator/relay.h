/* The projection of a worker's ExecuteStepEvent onto the caller's AgentEvent (spec:
 * AgentEvent "carries a subset of ExecuteStepEvent types relevant to the portal/user").
 *
 *   token, status, completion, error      forwarded as they are
 *   structured_answer                     forwarded when within every budget of the spec
 *                                         (summary <= 4 KiB, note <= 2 KiB, <= 32 columns of
 *                                         <= 64 bytes, <= 200 rows, <= 32 cells of <= 1 KiB per
 *                                         row, <= 8 followups of <= 256 bytes); over budget:
 *                                         dropped whole, debug log, the stream goes on; a
 *                                         schema_id over 64 bytes is emptied, not relayed
 *   write_confirm                         forwarded with every field re-clamped (relay.c)
 *   interrupt_required                    InterruptRequiredEvent with the tool's name and call
 *                                         id only (never pending_tool_intent)
 *   metrics, checkpoint, security, step_progress, tool_call, tool_result, decomposition,
 *   input_required                        never reach the caller (recorded / audited) */
#ifndef UPSQUAD_ORCH_RELAY_H
#define UPSQUAD_ORCH_RELAY_H

#include <stddef.h>

#include "arena.h"
#include "upsquad/runtime/v1/lifecycle.pb-c.h"
#include "upsquad/runtime/v1/runtime.pb-c.h"

typedef Upsquad__Runtime__V1__ExecuteStepEvent ExecuteStepEvent;
typedef Upsquad__Runtime__V1__AgentEvent AgentEvent;
typedef Upsquad__Runtime__V1__StructuredAnswerEvent StructuredAnswerEvent;
typedef Upsquad__Runtime__V1__WriteConfirmEvent WriteConfirmEvent;

#define RELAY_SUMMARY_MAX 4096
#define RELAY_NOTE_MAX 2048
#define RELAY_COLUMNS_MAX 32
#define RELAY_COLUMN_BYTES 64
#define RELAY_ROWS_MAX 200
#define RELAY_CELLS_MAX 32
#define RELAY_CELL_BYTES 1024
#define RELAY_FOLLOWUPS_MAX 8
#define RELAY_FOLLOWUP_BYTES 256
#define RELAY_SCHEMA_ID_BYTES 64

#define RELAY_WC_APPROVAL_ID 64
#define RELAY_WC_SUMMARY 2048
#define RELAY_WC_DEEP_LINK 512
#define RELAY_WC_ACTION_TYPE 64

/* Fills *out (in `a`; it may borrow sub-messages of ev, so ev must outlive it) and returns 1
 * when the event reaches the caller, 0 when it does not (*why names the reason). */
int relay_project(orch_arena *a, const ExecuteStepEvent *ev, AgentEvent *out, const char **why);

/* 0 when a structured answer is within every budget, else -1 with *why naming the field. */
int relay_answer_ok(const StructuredAnswerEvent *s, const char **why);

/* The longest prefix of s of at most max bytes that ends on a UTF-8 character boundary. */
size_t relay_clamp_len(const char *s, size_t max);

#endif
