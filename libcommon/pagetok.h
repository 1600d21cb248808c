/* Opaque, tamper-evident keyset page tokens: base64url(payload) "." base64url(HMAC-SHA256).
 * The payload binds the cursor (started_at in microseconds, id) to a query digest (method,
 * org, member, filters), so a token from another query or org is refused. Used by the
 * workflow-engine's ListRuns/ListVisibleRuns and the orchestrator's ListChildren; the key is
 * the same on every replica of a service (each derives it from its configuration). */
#ifndef UPSQUAD_PAGETOK_H
#define UPSQUAD_PAGETOK_H

#include <stddef.h>
#include <stdint.h>

#define PAGETOK_MAX 256

/* Digest of the query a token belongs to: sha256 over the NUL-separated parts (hex, 64). */
void pagetok_query(char out[65], const char *const *parts, size_t n);
/* 0, or -1 when out is too small. */
int pagetok_make(const unsigned char key[32], const char *query, int64_t after_us,
                 const char *after_id, char *out, size_t outlen);
/* 0 with the cursor, or -1 when the token is malformed, forged or from another query. */
int pagetok_parse(const unsigned char key[32], const char *query, const char *tok,
                  int64_t *after_us, char after_id[37]);

#endif
