/* AES-256-GCM provider keys (keys.h). */
#include "keys.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util.h"

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

int keys_ring_parse(const char *spec, keys_ring *out, char *err, size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!spec || !spec[0]) return util_errf(err, errlen, -1, "UPSQUAD_KEK: no key-encryption key");
    const char *p = spec;
    while (*p) {
        const char *colon = strchr(p, ':');
        const char *end = strchr(p, ',');
        if (!end) end = p + strlen(p);
        if (!colon || colon > end || colon == p || (size_t)(colon - p) >= KEYS_KID_MAX)
            return util_errf(err, errlen, -1, "UPSQUAD_KEK: entry %zu: expected kid:64-hex-digits",
                             out->n + 1);
        if (out->n == KEYS_MAX_KEKS)
            return util_errf(err, errlen, -1, "UPSQUAD_KEK: at most %d keys", KEYS_MAX_KEKS);
        if (end - colon - 1 != 64)
            return util_errf(err, errlen, -1,
                             "UPSQUAD_KEK: entry %zu: the key must be 64 hex digits (32 bytes)",
                             out->n + 1);
        for (int i = 0; i < 32; i++) {
            int hi = hexval(colon[1 + 2 * i]), lo = hexval(colon[2 + 2 * i]);
            if (hi < 0 || lo < 0) {
                keys_ring_wipe(out);
                return util_errf(err, errlen, -1, "UPSQUAD_KEK: entry %zu: not hex", out->n + 1);
            }
            out->key[out->n][i] = (unsigned char)(hi << 4 | lo);
        }
        memcpy(out->kid[out->n], p, (size_t)(colon - p));
        out->n++;
        p = *end ? end + 1 : end;
    }
    return 0;
}

void keys_ring_wipe(keys_ring *r) {
    OPENSSL_cleanse(r, sizeof *r);
}

static int aad(const char *org_id, const char *provider, char *out, size_t len) {
    int n = snprintf(out, len, "%s:%s", org_id, provider);
    return n < 0 || (size_t)n >= len ? -1 : n;
}

int keys_encrypt(const keys_ring *r, const char *org_id, const char *provider,
                 const unsigned char *plain, size_t plen, unsigned char nonce[KEYS_NONCE],
                 unsigned char **ct, size_t *ctlen, const char **kid) {
    char ad[256];
    int adl = aad(org_id, provider, ad, sizeof ad), n = 0, rc = -1;
    unsigned char *out = NULL;
    EVP_CIPHER_CTX *x = NULL;
    if (r->n == 0 || adl < 0 || plen == 0 || plen > KEYS_PLAIN_MAX) return -1;
    if (RAND_bytes(nonce, KEYS_NONCE) != 1) return -1;
    out = malloc(plen + KEYS_TAG);
    x = EVP_CIPHER_CTX_new();
    if (!out || !x) goto done;
    if (EVP_EncryptInit_ex(x, EVP_aes_256_gcm(), NULL, NULL, NULL) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_IVLEN, KEYS_NONCE, NULL) != 1 ||
        EVP_EncryptInit_ex(x, NULL, NULL, r->key[0], nonce) != 1 ||
        EVP_EncryptUpdate(x, NULL, &n, (const unsigned char *)ad, adl) != 1 ||
        EVP_EncryptUpdate(x, out, &n, plain, (int)plen) != 1 ||
        EVP_EncryptFinal_ex(x, out + n, &n) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, KEYS_TAG, out + plen) != 1)
        goto done;
    *ct = out;
    *ctlen = plen + KEYS_TAG;
    *kid = r->kid[0];
    out = NULL;
    rc = 0;
done:
    EVP_CIPHER_CTX_free(x);
    free(out);
    return rc;
}

int keys_decrypt(const keys_ring *r, const char *kid, const char *org_id, const char *provider,
                 const unsigned char nonce[KEYS_NONCE], const unsigned char *ct, size_t ctlen,
                 char **plain, size_t *plen) {
    char ad[256];
    int adl = aad(org_id, provider, ad, sizeof ad), n = 0, rc = -1;
    const unsigned char *key = NULL;
    unsigned char *out = NULL;
    EVP_CIPHER_CTX *x = NULL;
    for (size_t i = 0; i < r->n; i++)
        if (!strcmp(r->kid[i], kid)) key = r->key[i];
    if (!key || adl < 0 || ctlen <= KEYS_TAG || ctlen > KEYS_PLAIN_MAX + KEYS_TAG) return -1;
    size_t len = ctlen - KEYS_TAG;
    out = malloc(len + 1);
    x = EVP_CIPHER_CTX_new();
    if (!out || !x) goto done;
    if (EVP_DecryptInit_ex(x, EVP_aes_256_gcm(), NULL, NULL, NULL) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_IVLEN, KEYS_NONCE, NULL) != 1 ||
        EVP_DecryptInit_ex(x, NULL, NULL, key, nonce) != 1 ||
        EVP_DecryptUpdate(x, NULL, &n, (const unsigned char *)ad, adl) != 1 ||
        EVP_DecryptUpdate(x, out, &n, ct, (int)len) != 1 ||
        EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_SET_TAG, KEYS_TAG, (void *)(ct + len)) != 1 ||
        EVP_DecryptFinal_ex(x, out + n, &n) != 1)
        goto done;
    out[len] = 0;
    *plain = (char *)out;
    *plen = len;
    out = NULL;
    rc = 0;
done:
    EVP_CIPHER_CTX_free(x);
    if (out) {
        OPENSSL_cleanse(out, len + 1);
        free(out);
    }
    return rc;
}
