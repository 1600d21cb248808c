/* BYOK provider keys: AES-256-GCM under a key-encryption key (KEK) from configuration.
 *
 * UPSQUAD_KEK holds one or more KEKs, "kid:hex64[,kid:hex64...]": the FIRST encrypts, every
 * one decrypts (rotation: put the new KEK first and keep the old ones until `keys set` has
 * re-encrypted every row that names them). Each row records its kid. The additional authenticated
 * data is "org_id:provider", so a ciphertext copied to another org or provider does not decrypt.
 * Clear keys are never logged. */
#ifndef UPSQUAD_ORCH_KEYS_H
#define UPSQUAD_ORCH_KEYS_H

#include <stddef.h>

#define KEYS_MAX_KEKS 8
#define KEYS_KID_MAX 64
#define KEYS_NONCE 12
#define KEYS_TAG 16
#define KEYS_PLAIN_MAX 4096

typedef struct keys_ring {
    size_t n;
    char kid[KEYS_MAX_KEKS][KEYS_KID_MAX];
    unsigned char key[KEYS_MAX_KEKS][32];
} keys_ring;

/* Parses spec ("kid:hex64,..."). 0, or -1 with err (never quoting key material). */
int keys_ring_parse(const char *spec, keys_ring *out, char *err, size_t errlen);
void keys_ring_wipe(keys_ring *r);

/* Encrypts plain (plen <= KEYS_PLAIN_MAX) under the first KEK. *ct (heap, caller frees) is
 * ciphertext || tag, *ctlen its length; nonce receives 12 random bytes; kid names the KEK. */
int keys_encrypt(const keys_ring *r, const char *org_id, const char *provider,
                 const unsigned char *plain, size_t plen, unsigned char nonce[KEYS_NONCE],
                 unsigned char **ct, size_t *ctlen, const char **kid);
/* Decrypts with the KEK named kid. *plain (heap, NUL-terminated, caller wipes and frees).
 * -1 when the kid is unknown or authentication fails. */
int keys_decrypt(const keys_ring *r, const char *kid, const char *org_id, const char *provider,
                 const unsigned char nonce[KEYS_NONCE], const unsigned char *ct, size_t ctlen,
                 char **plain, size_t *plen);

#endif
