/* Claims of a bearer the server has already verified, beyond the identity rpc_identity()
 * carries: the decoded payload, and whether its `scope` claim grants a scope (RFC 8693: a
 * space-separated string; an array of strings is accepted too).
 *
 * These functions check no signature: call them only on a token libcommon verified (a
 * RPC_AUTH_REQUIRED method's `authorization` metadata), or to display a token's claims. */
#ifndef UPSQUAD_AUTH_CLAIMS_H
#define UPSQUAD_AUTH_CLAIMS_H

#include <cjson/cJSON.h>

/* The JSON payload of a compact JWS "header.payload.signature"; caller deletes. NULL when tok
 * is not three dot-separated parts with a base64url JSON object in the middle. */
cJSON *auth_claims_decode(const char *tok);

/* Scopes one service grants another, named once for the minting and the checking side. */
/* ApprovalService.OpenApproval (workflow-engine): the orchestrator opens its sessions' approvals
 * and ask_user prompts (docs/workflow-engine.md "Agent sessions: OpenApproval"). */
#define AUTH_SCOPE_APPROVALS_OPEN "approvals.open"

/* 1 when the bearer in an `authorization` value ("Bearer <jws>", scheme case-insensitive)
 * carries scope in its `scope` claim, else 0. */
int auth_bearer_has_scope(const char *authorization, const char *scope);

#endif
