/* Page tokens (pagetok.h). */
#include "pagetok.h"

#include <inttypes.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdio.h>
#include <string.h>

#include "ids.h"

static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";

static size_t b64url(const unsigned char *in, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)in[i] << 16;
        if (i + 1 < n) v |= (uint32_t)in[i + 1] << 8;
        if (i + 2 < n) v |= in[i + 2];
        out[o++] = B64[(v >> 18) & 63];
        out[o++] = B64[(v >> 12) & 63];
        if (i + 1 < n) out[o++] = B64[(v >> 6) & 63];
        if (i + 2 < n) out[o++] = B64[v & 63];
    }
    out[o] = 0;
    return o;
}

static int b64val(char c) {
    const char *p = c ? strchr(B64, c) : NULL;
    return p ? (int)(p - B64) : -1;
}

static long unb64url(const char *in, size_t n, unsigned char *out, size_t cap) {
    size_t o = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int v = b64val(in[i]);
        if (v < 0) return -1;
        acc = (acc << 6) | (uint32_t)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            if (o >= cap) return -1;
            out[o++] = (unsigned char)(acc >> bits);
        }
    }
    return (long)o;
}

void pagetok_query(char out[65], const char *const *parts, size_t n) {
    ids_sha256 h;
    if (ids_sha256_init(&h) != 0) {
        out[0] = 0;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        ids_sha256_update_str(&h, parts[i] ? parts[i] : "");
        ids_sha256_update(&h, "", 1);
    }
    ids_sha256_final_hex(&h, out);
}

static void mac(const unsigned char key[32], const char *msg, size_t n, unsigned char out[32]) {
    unsigned int len = 32;
    HMAC(EVP_sha256(), key, 32, (const unsigned char *)msg, n, out, &len);
}

int pagetok_make(const unsigned char key[32], const char *query, int64_t after_us,
                 const char *after_id, char *out, size_t outlen) {
    char payload[160], enc[224], sig_enc[48];
    unsigned char sig[32];
    /* the query digest is signed, not carried: a token only verifies for its own query */
    int n = snprintf(payload, sizeof payload, "1|%" PRId64 "|%s", after_us, after_id);
    if (n < 0 || (size_t)n >= sizeof payload) return -1;
    b64url((const unsigned char *)payload, (size_t)n, enc);
    char signed_text[300];
    int m = snprintf(signed_text, sizeof signed_text, "%s.%s", query, enc);
    if (m < 0 || (size_t)m >= sizeof signed_text) return -1;
    mac(key, signed_text, (size_t)m, sig);
    b64url(sig, 16, sig_enc);
    n = snprintf(out, outlen, "%s.%s", enc, sig_enc);
    return n < 0 || (size_t)n >= outlen ? -1 : 0;
}

int pagetok_parse(const unsigned char key[32], const char *query, const char *tok,
                  int64_t *after_us, char after_id[37]) {
    size_t len = strlen(tok);
    const char *dot = strchr(tok, '.');
    if (len > PAGETOK_MAX || !dot) return -1;
    char signed_text[300];
    unsigned char sig[32], got[32];
    int m = snprintf(signed_text, sizeof signed_text, "%s.%.*s", query, (int)(dot - tok), tok);
    if (m < 0 || (size_t)m >= sizeof signed_text) return -1;
    mac(key, signed_text, (size_t)m, sig);
    if (unb64url(dot + 1, strlen(dot + 1), got, sizeof got) != 16) return -1;
    if (CRYPTO_memcmp(sig, got, 16) != 0) return -1;
    unsigned char payload[160];
    long n = unb64url(tok, (size_t)(dot - tok), payload, sizeof payload - 1);
    if (n <= 0) return -1;
    payload[n] = 0;
    long long us;
    char id[40];
    if (sscanf((char *)payload, "1|%lld|%39s", &us, id) != 2 || !ids_uuid_valid(id)) return -1;
    *after_us = us;
    memcpy(after_id, id, 36);
    after_id[36] = 0;
    return 0;
}
