/* Worker event -> caller event (relay.h). */
#include "relay.h"

#include <string.h>

#include "util.h"

size_t relay_clamp_len(const char *s, size_t max) {
    size_t n = strlen(s);
    if (n <= max) return n;
    n = max;
    /* back off continuation bytes so a multi-byte character is never cut */
    while (n > 0 && ((unsigned char)s[n] & 0xC0) == 0x80)
        n--;
    return n;
}

int relay_answer_ok(const StructuredAnswerEvent *s, const char **why) {
    if (strlen(s->summary) > RELAY_SUMMARY_MAX) return *why = "summary over 4 KiB", -1;
    if (strlen(s->note) > RELAY_NOTE_MAX) return *why = "note over 2 KiB", -1;
    if (s->n_columns > RELAY_COLUMNS_MAX) return *why = "more than 32 columns", -1;
    for (size_t i = 0; i < s->n_columns; i++)
        if (strlen(s->columns[i]) > RELAY_COLUMN_BYTES) return *why = "a column over 64 bytes", -1;
    if (s->n_rows > RELAY_ROWS_MAX) return *why = "more than 200 rows", -1;
    for (size_t r = 0; r < s->n_rows; r++) {
        if (!s->rows[r]) continue;
        if (s->rows[r]->n_cells > RELAY_CELLS_MAX)
            return *why = "a row with more than 32 cells", -1;
        for (size_t c = 0; c < s->rows[r]->n_cells; c++)
            if (strlen(s->rows[r]->cells[c]) > RELAY_CELL_BYTES)
                return *why = "a cell over 1 KiB", -1;
    }
    if (s->n_followups > RELAY_FOLLOWUPS_MAX) return *why = "more than 8 followups", -1;
    for (size_t i = 0; i < s->n_followups; i++)
        if (strlen(s->followups[i]) > RELAY_FOLLOWUP_BYTES)
            return *why = "a followup over 256 bytes", -1;
    return 0;
}

static char *clamped(orch_arena *a, const char *s, size_t max) {
    return orch_arena_strndup(a, s, relay_clamp_len(s, max));
}

/* approval_id: a UUID or nothing; deep_link: a relative path ("/..."), never a scheme or a
 * host (an open redirect); action_type: [a-z0-9_.-]; required_clearance: 0..5. */
static WriteConfirmEvent *write_confirm(orch_arena *a, const WriteConfirmEvent *in) {
    WriteConfirmEvent *w = orch_arena_alloc(a, sizeof *w);
    if (!w) return NULL;
    upsquad__runtime__v1__write_confirm_event__init(w);
    w->approval_id = clamped(a, in->approval_id, RELAY_WC_APPROVAL_ID);
    for (char *p = w->approval_id; p && *p; p++)
        if (!((*p >= '0' && *p <= '9') || (*p >= 'a' && *p <= 'f') || (*p >= 'A' && *p <= 'F') ||
              *p == '-')) {
            w->approval_id[0] = 0;
            break;
        }
    w->summary = clamped(a, in->summary, RELAY_WC_SUMMARY);
    const char *dl = in->deep_link;
    int relative = dl[0] == '/' && dl[1] != '/' && dl[1] != '\\' && !strpbrk(dl, "\r\n\t ");
    w->deep_link = relative ? clamped(a, dl, RELAY_WC_DEEP_LINK) : orch_arena_strdup(a, "");
    w->action_type = clamped(a, in->action_type, RELAY_WC_ACTION_TYPE);
    for (char *p = w->action_type; p && *p; p++)
        if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') || *p == '_' || *p == '.' ||
              *p == '-')) {
            w->action_type[0] = 0;
            break;
        }
    int rc = in->required_clearance;
    w->required_clearance = rc < 0 ? 0 : rc > 5 ? 5 : rc;
    return a->failed ? NULL : w;
}

int relay_project(orch_arena *a, const ExecuteStepEvent *ev, AgentEvent *out, const char **why) {
    upsquad__runtime__v1__agent_event__init(out);
    *why = NULL;
    switch (ev->event_case) {
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOKEN:
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_TOKEN;
        out->token = ev->token;
        return 1;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STATUS:
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_STATUS;
        out->status = ev->status;
        return 1;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_COMPLETION:
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_COMPLETION;
        out->completion = ev->completion;
        return 1;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_ERROR:
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_ERROR;
        out->error = ev->error;
        return 1;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STRUCTURED_ANSWER:
        if (relay_answer_ok(ev->structured_answer, why)) return 0;
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_STRUCTURED_ANSWER;
        out->structured_answer = ev->structured_answer;
        /* schema_id is an opaque tag ("reserved — empty in v1"), not among the spec's budgets
         * that drop an answer: one over 64 bytes is not passed on (the answer is, for the v1
         * table renderer) */
        if (strlen(ev->structured_answer->schema_id) > RELAY_SCHEMA_ID_BYTES) {
            StructuredAnswerEvent *s = orch_arena_alloc(a, sizeof *s);
            if (!s) return *why = "out of memory", 0;
            *s = *ev->structured_answer;
            s->schema_id = (char *)"";
            out->structured_answer = s;
        }
        return 1;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_WRITE_CONFIRM:
        out->write_confirm = write_confirm(a, ev->write_confirm);
        if (!out->write_confirm) return *why = "out of memory", 0;
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_WRITE_CONFIRM;
        return 1;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_METRICS:
        return *why = "metrics are recorded, not relayed", 0;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_CHECKPOINT:
        return *why = "checkpoints are internal", 0;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_SECURITY:
        return *why = "security events are audited, never relayed", 0;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_STEP_PROGRESS:
        return *why = "step progress is internal", 0;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_CALL:
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_TOOL_RESULT:
        return *why = "tool events are audited, not relayed", 0;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_DECOMPOSITION:
        return *why = "plans belong to the autonomous loop", 0;
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INTERRUPT_REQUIRED: {
        /* the client-safe projection: the gated tool's name and call id only; the raw intent
         * (pending_tool_intent) never leaves the service */
        Upsquad__Runtime__V1__InterruptRequiredEvent *e = orch_arena_alloc(a, sizeof *e);
        if (!e) return *why = "out of memory", 0;
        upsquad__runtime__v1__interrupt_required_event__init(e);
        e->tool_name = clamped(a, ev->interrupt_required->tool_name, RELAY_WC_ACTION_TYPE * 2);
        e->tool_call_id =
            clamped(a, ev->interrupt_required->tool_call_id, RELAY_WC_APPROVAL_ID * 2);
        /* reason stays empty: "Empty when no specific reason is known beyond 'requires
         * approval'", and the worker's InterruptRequired carries none */
        if (a->failed) return *why = "out of memory", 0;
        out->event_case = UPSQUAD__RUNTIME__V1__AGENT_EVENT__EVENT_INTERRUPT_REQUIRED;
        out->interrupt_required = e;
        return 1;
    }
    case UPSQUAD__RUNTIME__V1__EXECUTE_STEP_EVENT__EVENT_INPUT_REQUIRED:
        /* no public arm: the session parks on the prompt (SessionPausedEvent, chat.c) */
        return *why = "ask_user parks the session on its prompt", 0;
    default:
        return *why = "unknown event", 0;
    }
}
