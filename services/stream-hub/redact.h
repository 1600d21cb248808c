/* The hub's side of the one redaction rule (libcommon redaction.h; spec: StreamNodeIO "Live
 * redaction floor", GetNodeTranscript "clearance-redacted on READ"): a caller below
 * REDACT_FREE_TEXT_CLEARANCE gets structural content only. Live frames lose token_text (such a
 * frame, left without an arm, is not sent below the floor) and tool_result.summary; transcript
 * events lose their free-text content fields (TEXT_FIELDS) and any key naming a secret, which
 * are named in redacted_fields. Raw at rest, redacted at the boundary. */
#ifndef UPSQUAD_HUB_REDACT_H
#define UPSQUAD_HUB_REDACT_H

#include "redaction.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

/* 1 when a caller of this clearance receives free text. */
int redact_full(int clearance);

/* Strips the free-text fields of ev->content in place (the removed entries are freed with the
 * allocator `alloc`, the one ev was unpacked with). Each removed key is passed to on_removed (may
 * be NULL). */
void redact_transcript(Upsquad__Workflow__V1__TranscriptEvent *ev, int clearance,
                       ProtobufCAllocator *alloc, void (*on_removed)(const char *key, void *ud),
                       void *ud);

/* Makes f structural in place (token arm unset, tool_result summary emptied). Returns 1 when
 * it changed anything. Strings it drops are not freed: it points them at "" and keeps the
 * originals in *keep (free with redact_frame_restore to restore before freeing f). A frame
 * whose arm it unsets is no longer sendable (redact_frame_sendable). */
typedef struct redact_saved {
    char *token, *summary;
    int had_token;
} redact_saved;
int redact_frame(Upsquad__Workflow__V1__NodeIOFrame *f, redact_saved *keep);
void redact_frame_restore(Upsquad__Workflow__V1__NodeIOFrame *f, const redact_saved *keep);

/* 1 when f may be sent as a live frame: exactly one event arm is set (spec NodeIOFrame). A
 * frame with none -- a token frame once redacted, or one published without an arm this hub
 * knows -- is not sent at all: there is nothing structural left in it. */
int redact_frame_sendable(const Upsquad__Workflow__V1__NodeIOFrame *f);

#endif
