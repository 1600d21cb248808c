/* UUIDs and SHA-256: see ids.h. */
#include "ids.h"

#include <openssl/evp.h>
#include <openssl/rand.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

/* EVP_sha256() fetches the implementation on every use in OpenSSL 3; fetch it once. */
static pthread_once_t ids__md_once = PTHREAD_ONCE_INIT;
static EVP_MD *ids__md_fetched;
static void ids__md_init(void) {
    ids__md_fetched = EVP_MD_fetch(NULL, "SHA256", NULL);
}
const EVP_MD *ids_sha256_md(void) {
    pthread_once(&ids__md_once, ids__md_init);
    return ids__md_fetched ? ids__md_fetched : EVP_sha256();
}
#define ids__sha256 ids_sha256_md

int ids_sha256_raw(const void *data, size_t len, unsigned char out[32]) {
    unsigned int mdlen = 0;
    return EVP_Digest(data, len, out, &mdlen, ids__sha256(), NULL) == 1 && mdlen == 32 ? 0 : -1;
}

void ids_hex(const unsigned char *in, size_t n, char *out) {
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hex[in[i] >> 4];
        out[2 * i + 1] = hex[in[i] & 15];
    }
    out[2 * n] = '\0';
}

static void ids__format(const unsigned char b[16], char out[37]) {
    static const char hex[] = "0123456789abcdef";
    size_t o = 0;
    for (size_t i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) out[o++] = '-';
        out[o++] = hex[b[i] >> 4];
        out[o++] = hex[b[i] & 15];
    }
    out[o] = '\0';
}

int ids_uuid_v4(char out[37]) {
    unsigned char b[16];
    if (RAND_bytes(b, sizeof b) != 1) {
        out[0] = '\0';
        return -1;
    }
    b[6] = (unsigned char)(0x40 | (b[6] & 0x0F));
    b[8] = (unsigned char)(0x80 | (b[8] & 0x3F));
    ids__format(b, out);
    return 0;
}

/* Last issued (unix_ms << 12 | sequence). Each id takes max(now, last + 1): a new millisecond
 * starts its sequence at a random value below 1024 (leaving 3072 steps before the sequence
 * carries into the timestamp, which RFC 9562 6.2 allows). */
static _Atomic uint64_t ids__v7_last;

int ids_uuid_v7(char out[37]) {
    unsigned char b[16];
    struct timespec ts;
    uint64_t last, next, now;
    if (RAND_bytes(b, sizeof b) != 1) {
        out[0] = '\0';
        return -1;
    }
    clock_gettime(CLOCK_REALTIME, &ts);
    now = ((uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u) << 12 |
          (((uint64_t)b[6] << 8 | b[7]) & 0x3FF);
    last = atomic_load_explicit(&ids__v7_last, memory_order_relaxed);
    do {
        next = now > last ? now : last + 1;
    } while (!atomic_compare_exchange_weak_explicit(&ids__v7_last, &last, next,
                                                    memory_order_relaxed, memory_order_relaxed));
    uint64_t ms = next >> 12;
    unsigned seq = (unsigned)(next & 0xFFF);
    for (int i = 0; i < 6; i++)
        b[i] = (unsigned char)(ms >> (40 - 8 * i));
    b[6] = (unsigned char)(0x70 | (seq >> 8));
    b[7] = (unsigned char)(seq & 0xFF);
    b[8] = (unsigned char)(0x80 | (b[8] & 0x3F));
    ids__format(b, out);
    return 0;
}

int ids_uuid_valid(const char *s) {
    if (!s) return 0;
    for (size_t i = 0; i < 36; i++) {
        char c = s[i];
        if (i == 8 || i == 13 || i == 18 || i == 23) {
            if (c != '-') return 0;
        } else if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'))) {
            return 0; /* also stops at a NUL of a short string */
        }
    }
    return s[36] == '\0';
}

void ids_sha256_hex(const void *data, size_t len, char out[65]) {
    unsigned char md[32];
    unsigned int mdlen = 0;
    if (EVP_Digest(data, len, md, &mdlen, ids__sha256(), NULL) != 1 || mdlen != 32) {
        out[0] = '\0'; /* allocation failure inside OpenSSL: never a valid digest */
        return;
    }
    ids_hex(md, 32, out);
}

int ids_sha256_init(ids_sha256 *h) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    h->ctx = NULL;
    if (!ctx) return -1;
    if (EVP_DigestInit_ex(ctx, ids__sha256(), NULL) != 1) {
        EVP_MD_CTX_free(ctx);
        return -1;
    }
    h->ctx = ctx;
    return 0;
}

void ids_sha256_update(ids_sha256 *h, const void *data, size_t len) {
    if (h->ctx && len) EVP_DigestUpdate(h->ctx, data, len);
}

void ids_sha256_update_str(ids_sha256 *h, const char *s) {
    if (s) ids_sha256_update(h, s, strlen(s));
}

int ids_sha256_final_raw(ids_sha256 *h, unsigned char out[32]) {
    unsigned int n = 0;
    int ok = h->ctx && EVP_DigestFinal_ex(h->ctx, out, &n) == 1 && n == 32;
    ids_sha256_free(h);
    return ok ? 0 : -1;
}

int ids_sha256_final_hex(ids_sha256 *h, char out[65]) {
    unsigned char md[32];
    if (ids_sha256_final_raw(h, md) != 0) {
        out[0] = '\0';
        return -1;
    }
    ids_hex(md, 32, out);
    return 0;
}

void ids_sha256_free(ids_sha256 *h) {
    EVP_MD_CTX_free(h->ctx);
    h->ctx = NULL;
}
