/* Identifiers and hashes: random UUIDs (v4), time-ordered UUIDs (v7, RFC 9562) for primary
 * keys, and SHA-256 in hex (idempotency keys, snapshot and audit-chain hashes).
 * Randomness comes from OpenSSL's RAND_bytes (a CSPRNG seeded by the kernel). */
#ifndef UPSQUAD_IDS_H
#define UPSQUAD_IDS_H

#include <stddef.h>
#include <stdint.h>

#define IDS_UUID_LEN 36 /* text form without the NUL */

/* Lowercase canonical text "xxxxxxxx-xxxx-4xxx-yxxx-xxxxxxxxxxxx". 0, or -1 when the random
 * generator fails (out is then ""). */
int ids_uuid_v4(char out[37]);
/* UUIDv7: 48-bit Unix milliseconds, then a 12-bit sequence (RFC 9562 6.2 method 1) and
 * 62 random bits. Ids from one process are strictly increasing, also within a millisecond
 * and when the wall clock steps back (the timestamp then stays at the last one issued), so
 * they sort in creation order as text and as Postgres `uuid`. 0, or -1 (out is then ""). */
int ids_uuid_v7(char out[37]);
/* 1 when s is a canonical 8-4-4-4-12 hex UUID (either case), else 0. */
int ids_uuid_valid(const char *s);

/* The one SHA-256 of libcommon (OpenSSL's, fetched once): every module that hashes or MACs
 * uses these rather than a wrapper of its own. */
void ids_sha256_hex(const void *data, size_t len, char out[65]);         /* out "" on failure */
int ids_sha256_raw(const void *data, size_t len, unsigned char out[32]); /* 0, or -1 */
/* The fetched EVP_MD (for HMAC and signatures): OpenSSL 3 fetches EVP_sha256() on every use. */
struct evp_md_st;
const struct evp_md_st *ids_sha256_md(void);

/* Streaming SHA-256 over several fields. init allocates; final_* and free release it, so
 * every init is followed by exactly one final_hex, final_raw or free. */
typedef struct ids_sha256 {
    void *ctx; /* EVP_MD_CTX */
} ids_sha256;
int ids_sha256_init(ids_sha256 *h); /* 0, or -1 on OOM */
void ids_sha256_update(ids_sha256 *h, const void *data, size_t len);
void ids_sha256_update_str(ids_sha256 *h, const char *s); /* the bytes of s, no NUL */
int ids_sha256_final_hex(ids_sha256 *h, char out[65]);
int ids_sha256_final_raw(ids_sha256 *h, unsigned char out[32]);
void ids_sha256_free(ids_sha256 *h);

/* Lowercase hex of n bytes into out (2n + 1 bytes). */
void ids_hex(const unsigned char *in, size_t n, char *out);

#endif
