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

/* 1 when the bearer in an `authorization` value ("Bearer <jws>", scheme case-insensitive)
 * carries scope in its `scope` claim, else 0. */
int auth_bearer_has_scope(const char *authorization, const char *scope);

#endif
