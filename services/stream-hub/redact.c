/* Clearance redaction (see redact.h). */
#include "redact.h"

#include <stdlib.h>
#include <string.h>

/* The free-text content fields of a transcript event, by event type (spec TranscriptEvent):
 * assistant_message { text }, tool_call { arguments }, tool_result { result }. Names,
 * ids, is_error and duration_ms are structural and stay. */
static const char *const TEXT_FIELDS[] = {"text", "arguments", "result"};

/* Live frames and transcripts carry no classification floor of their own here: the floor a
 * workflow can set is at most REDACT_FREE_TEXT_CLEARANCE, where free text starts anyway. */
int redact_full(int clearance) {
    return redact_visible(clearance, 0, REDACT_FREE_TEXT, NULL);
}

static int is_text_field(const char *k) {
    for (size_t i = 0; i < sizeof TEXT_FIELDS / sizeof TEXT_FIELDS[0]; i++)
        if (strcmp(k, TEXT_FIELDS[i]) == 0) return 1;
    return 0;
}

/* A transcript content key under the one rule: the free-text fields as free text, any other
 * key as node data (names and ids pass; a key naming a secret waits for clearance 4). */
static int key_visible(const char *k, int clearance) {
    return redact_visible(clearance, 0, is_text_field(k) ? REDACT_FREE_TEXT : REDACT_PAYLOAD, k);
}

void redact_transcript(Upsquad__Workflow__V1__TranscriptEvent *ev, int clearance,
                       ProtobufCAllocator *alloc, void (*on_removed)(const char *key, void *ud),
                       void *ud) {
    Google__Protobuf__Struct *c = ev->content;
    if (redact_full(clearance) || c == NULL) return;
    size_t w = 0;
    for (size_t i = 0; i < c->n_fields; i++) {
        Google__Protobuf__Struct__FieldsEntry *e = c->fields[i];
        if (e && e->key && !key_visible(e->key, clearance)) {
            if (on_removed) on_removed(e->key, ud);
            protobuf_c_message_free_unpacked(&e->base, alloc);
            continue;
        }
        c->fields[w++] = e;
    }
    c->n_fields = w;
}

int redact_frame(Upsquad__Workflow__V1__NodeIOFrame *f, redact_saved *keep) {
    memset(keep, 0, sizeof *keep);
    int changed = 0;
    if (f->event_case == UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOKEN_TEXT) {
        keep->token = f->token_text;
        keep->had_token = 1;
        f->event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT__NOT_SET;
        changed = 1;
    } else if (f->event_case == UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOOL_RESULT &&
               f->tool_result && f->tool_result->summary && f->tool_result->summary[0]) {
        keep->summary = f->tool_result->summary;
        f->tool_result->summary = (char *)protobuf_c_empty_string;
        changed = 1;
    }
    return changed;
}

void redact_frame_restore(Upsquad__Workflow__V1__NodeIOFrame *f, const redact_saved *keep) {
    if (keep->had_token) {
        f->event_case = UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT_TOKEN_TEXT;
        f->token_text = keep->token;
    }
    if (keep->summary) f->tool_result->summary = keep->summary;
}

/* spec NodeIOFrame: "Exactly one event arm is set"; below clearance 4 a caller "receives
 * STRUCTURAL frames only (status, tool_call name/id, tool_result is_error/timing,
 * user_prompt)". An armless frame is neither: the caller is not sent it. An arm unknown to
 * this hub (a newer publisher) unpacks as no arm and is not relayed either: its content
 * cannot be told structural, so it fails closed at every clearance. */
int redact_frame_sendable(const Upsquad__Workflow__V1__NodeIOFrame *f) {
    return f->event_case != UPSQUAD__WORKFLOW__V1__NODE_IOFRAME__EVENT__NOT_SET;
}
