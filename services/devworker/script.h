/* The directive language (docs/devworker.md): a message whose first line is `#!script` carries
 * a JSON array; each element is an object with exactly one directive, and every event
 * directive maps to the ExecuteStepEvent arm of the same name, its object written with the
 * arm's proto field names.
 *
 * dw_script_parse validates the whole script before anything runs: a malformed script runs
 * nothing and is reported as one ErrorEvent naming the element index and the field. Fields
 * the author leaves out that the Python worker always fills (a status timestamp, a
 * completion's usage, an interrupt's idempotency key, …) are filled when the op runs
 * (step.c), flagged by DW_F_*. */
#ifndef UPSQUAD_DW_SCRIPT_H
#define UPSQUAD_DW_SCRIPT_H

#include <stddef.h>

#include "upsquad/runtime/v1/runtime.pb-c.h"

typedef Upsquad__Runtime__V1__ExecuteStepEvent DwEvent;

typedef enum {
    DW_OP_EVENT,      /* send ev (after the DW_F_* fix-ups) */
    DW_OP_TOKEN,      /* one TokenEvent with text */
    DW_OP_TOKENS,     /* one TokenEvent per word of text, delay_ms before each */
    DW_OP_SLEEP,      /* wait ms (cancellable) */
    DW_OP_HANG,       /* wait until cancelled or the session is terminated */
    DW_OP_CRASH,      /* flush what was sent, then the process exits */
    DW_OP_CHECKPOINT, /* CheckpointEvent + RuntimeService.Checkpoint; text: optional state */
    DW_OP_INSPECT,    /* one TokenEvent: the request as received, secrets redacted (inspect.h) */
    DW_OP_FAIL,       /* the step ends with gRPC status `code` and text as its message */
} dw_op_kind;

/* Fix-ups applied when an event op runs. */
enum {
    DW_F_TIMESTAMP = 1 << 0,  /* status.timestamp = now */
    DW_F_USAGE = 1 << 1,      /* completion.token_usage computed (words, price table) */
    DW_F_ITERATIONS = 1 << 2, /* completion.loop_iterations = iterations of this step */
    DW_F_DURATION = 1 << 3,   /* completion.duration_ms = elapsed */
    DW_F_CALL_ID = 1 << 4,    /* tool_call_id = "call-<element index>" */
    DW_F_IDEM_KEY = 1 << 5,   /* idempotency_key = sha256(session_id:loop_iteration:tool_call_id) */
    DW_F_ASK_CKPT = 1 << 6,   /* input_required.checkpoint = the frozen turn (resume point) */
    DW_F_RESULT_ID = 1 << 7,  /* tool_result.tool_call_id = the last tool_call's id */
    DW_F_RESULT_NAME = 1 << 8, /* tool_result.tool_name = the last tool_call's name */
    DW_F_METRICS = 1 << 9,     /* metrics.model = the snapshot's model when absent */
    DW_F_CREATED = 1 << 10,    /* checkpoint created_at = now */
};

typedef struct dw_op {
    dw_op_kind kind;
    int index;        /* element index in the script (0-based) */
    const char *name; /* directive name */
    DwEvent *ev;      /* DW_OP_EVENT */
    const char *text; /* DW_OP_TOKEN(S); DW_OP_CHECKPOINT: the state text or NULL */
    long long ms;     /* DW_OP_SLEEP; DW_OP_TOKENS: delay before each token */
    unsigned flags;   /* DW_F_* */
    int ends_step;    /* interrupt / ask_user: the worker suspends, the stream ends */
    int code;         /* DW_OP_FAIL: a gRPC status code, 1..16 */
    /* modifiers: the element runs only on the worker whose id or address is if_worker, or
     * on every worker but unless_worker (tests with several workers) */
    const char *if_worker, *unless_worker;
    /* modifier: the element runs only while this worker has run this message at most
     * first_runs times (0: always) — a flaky model that fails once, then succeeds on a retry */
    long long first_runs;
} dw_op;

typedef struct dw_script dw_script;

/* 1 when the first line of msg is "#!script" (trailing blanks and CR allowed); *body then
 * points after that line. */
int dw_script_detect(const char *msg, const char **body);

/* Parses and validates body. 0 with *out (free with dw_script_free), or -1 with err
 * ("script element 3: tool_call.arguments: expected a JSON object") and pointer (the JSON
 * pointer of the offending value, "/3/tool_call/arguments"). */
int dw_script_parse(const char *body, size_t max_elements, dw_script **out, char *err,
                    size_t errlen, char *pointer, size_t pointerlen);
const dw_op *dw_script_ops(const dw_script *s, size_t *n);
void dw_script_free(dw_script *s);

/* Splits text into tokens the way echo replies and `tokens` stream them: each token is a run
 * of whitespace followed by a run of non-whitespace (the first has no leading whitespace;
 * trailing whitespace joins the last token), so the tokens concatenate to text. Returns the
 * length of the token starting at text (0 at the end). */
size_t dw_next_token(const char *text);
/* Number of whitespace-separated words. */
long dw_word_count(const char *text);

#endif
