/* Identity from a verified JWT, and minting of short-lived tokens.
 *
 * Verification checks the signature (HS256 with a shared secret for local runs; RS256 or
 * ES256 with a PEM public key in production), `alg` against the configured key type (so
 * `alg: none` and algorithm confusion are refused), `exp`, `nbf` (with leeway) and `aud`
 * (and `iss` when configured). Claims: `sub` (member id), `org_id` (tenant), `clearance`
 * (1..5), `teams` (array of team unit ids). */
#ifndef UPSQUAD_AUTH_H
#define UPSQUAD_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define AUTH_ID_MAX 128   /* longest sub / org_id / team id, including the NUL */
#define AUTH_MAX_TEAMS 32 /* a token with more teams is refused */

typedef struct auth_identity {
    char sub[AUTH_ID_MAX];
    char org_id[AUTH_ID_MAX];
    int clearance; /* 1..5 */
    size_t n_teams;
    char teams[AUTH_MAX_TEAMS][AUTH_ID_MAX];
    int64_t iat, exp; /* seconds since the epoch */
} auth_identity;

enum {
    AUTH_OK = 0,
    AUTH_EMALFORMED = -1, /* not three base64url parts / bad JSON / claim of the wrong type */
    AUTH_EALG = -2,       /* alg none, or an alg the configured key does not allow */
    AUTH_ESIG = -3,       /* signature does not verify */
    AUTH_EEXPIRED = -4,   /* exp in the past */
    AUTH_ENOTYET = -5,    /* nbf in the future */
    AUTH_EAUD = -6,       /* aud missing or not ours */
    AUTH_EISS = -7,       /* iss configured and different */
    AUTH_ECLAIMS = -8,    /* sub/org_id missing, clearance out of 1..5, too many teams */
    AUTH_ECONFIG = -9,    /* bad key material / configuration */
};

typedef struct auth_config {
    const char *hs256_secret;   /* local runs; NULL or "" when a public key is used */
    const char *public_key_pem; /* RS256 or ES256 (P-256) verification key; PEM text */
    const char *audience;       /* required `aud` (string or array member) */
    const char *issuer;         /* optional required `iss` */
    int leeway_s;               /* clock skew allowed for exp/nbf */
} auth_config;

typedef struct auth_verifier auth_verifier;

/* Strings in cfg are copied. Returns AUTH_OK or AUTH_ECONFIG with err filled. */
int auth_verifier_new(const auth_config *cfg, auth_verifier **out, char *err, size_t errlen);
void auth_verifier_free(auth_verifier *v);

/* Verifies `token` (the compact JWS, without "Bearer "). now: seconds since the epoch.
 * Thread-safe. On failure *out is untouched and err says why (never echoes the token). */
int auth_verify(const auth_verifier *v, const char *token, size_t len, int64_t now,
                auth_identity *out, char *err, size_t errlen);

/* Parses an `authorization` metadata value "Bearer <token>" (scheme case-insensitive) and
 * verifies it. */
int auth_verify_bearer(const auth_verifier *v, const char *header, size_t len, int64_t now,
                       auth_identity *out, char *err, size_t errlen);

/* Minting. alg: "HS256" (key = secret) or "RS256"/"ES256" (key = PEM private key). */
typedef struct auth_signer auth_signer;
int auth_signer_new(const char *alg, const char *key, auth_signer **out, char *err, size_t errlen);
void auth_signer_free(auth_signer *s);

typedef struct auth_claims {
    const char *sub, *org_id, *audience, *issuer;
    int clearance;
    const char *const *teams;
    size_t n_teams;
    int64_t iat;            /* 0 = now */
    int64_t ttl_s;          /* exp = iat + ttl_s */
    const char *extra_json; /* optional JSON object whose members are added (e.g. "scope") */
} auth_claims;

/* *out_token: caller frees. */
int auth_mint(const auth_signer *s, const auth_claims *c, char **out_token, char *err,
              size_t errlen);

const char *auth_strerror(int code);

#endif
