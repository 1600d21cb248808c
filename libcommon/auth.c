/* JWT (compact JWS) verification and minting on OpenSSL 3.
 *
 * A verifier holds exactly one key, and the key decides the one algorithm it accepts:
 * an HS256 secret accepts only HS256, an RSA public key only RS256, a P-256 key only ES256.
 * The header's `alg` is compared with that before anything else, so `none` and algorithm
 * confusion (an HS256 token "signed" with the RSA public key as HMAC secret) are refused.
 * The signature is checked before the payload is parsed: unauthenticated claims are never
 * interpreted. */
#include "auth.h"
#include "ids.h"
#include "util.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <openssl/bn.h>
#include <openssl/crypto.h>
#include <openssl/ec.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#define AUTH__TOKEN_MAX 8192    /* longer tokens are refused unread */
#define AUTH__SECRET_MIN 32     /* RFC 7518 3.2: HS256 keys of at least 256 bits */
#define AUTH__RSA_BITS_MIN 2048 /* smaller RSA keys are refused */
#define AUTH__LEEWAY_MAX 3600   /* sane upper bound for configured clock skew */
#define AUTH__HEADER_MEMBERS 16 /* a JOSE header with more members is refused */
#define AUTH__NUMERIC_MAX 1e15  /* NumericDate values beyond this are not times */

#define AUTH__B64LEN(n) (((n) + 2) / 3 * 4) /* upper bound of the unpadded encoding */

typedef enum { AUTH__HS256 = 1, AUTH__RS256 = 2, AUTH__ES256 = 3 } auth__alg;

static const char *const auth__alg_names[] = {"", "HS256", "RS256", "ES256"};

struct auth_verifier {
    auth__alg alg;
    unsigned char *secret; /* HS256 */
    size_t secret_len;
    EVP_PKEY *pkey; /* RS256 / ES256 */
    char *audience;
    char *issuer; /* NULL: not checked */
    int leeway_s;
};

struct auth_signer {
    auth__alg alg;
    unsigned char *secret;
    size_t secret_len;
    EVP_PKEY *pkey;
};

#define auth__fail util_errf

/* SHA-256 is ids.h's one fetched EVP_MD. */
#define auth__sha256 ids_sha256_md

/* ---- base64url without padding (RFC 7515 section 2) ---- */

static size_t auth__b64u_encode(const unsigned char *in, size_t n, char *out) {
    static const char tab[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    size_t o = 0, i = 0;
    for (; i + 2 < n; i += 3) {
        unsigned v = (unsigned)in[i] << 16 | (unsigned)in[i + 1] << 8 | in[i + 2];
        out[o++] = tab[v >> 18], out[o++] = tab[(v >> 12) & 63];
        out[o++] = tab[(v >> 6) & 63], out[o++] = tab[v & 63];
    }
    if (n - i == 1) {
        unsigned v = (unsigned)in[i] << 16;
        out[o++] = tab[v >> 18], out[o++] = tab[(v >> 12) & 63];
    } else if (n - i == 2) {
        unsigned v = (unsigned)in[i] << 16 | (unsigned)in[i + 1] << 8;
        out[o++] = tab[v >> 18], out[o++] = tab[(v >> 12) & 63], out[o++] = tab[(v >> 6) & 63];
    }
    out[o] = '\0';
    return o;
}

static int auth__b64u_val(unsigned char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '-') return 62;
    if (c == '_') return 63;
    return -1;
}

/* Strict decoding: no padding, no whitespace, no length of 1 mod 4, zero trailing bits. */
static int auth__b64u_decode(const char *in, size_t n, unsigned char *out, size_t cap,
                             size_t *outlen) {
    size_t o = 0, need = n / 4 * 3 + (n % 4 ? n % 4 - 1 : 0);
    unsigned acc = 0;
    int bits = 0;
    if (n % 4 == 1 || need > cap) return -1;
    for (size_t i = 0; i < n; i++) {
        int v = auth__b64u_val((unsigned char)in[i]);
        if (v < 0) return -1;
        acc = (acc << 6) | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (unsigned char)(acc >> bits);
            acc &= (1u << bits) - 1;
        }
    }
    if (acc != 0) return -1;
    *outlen = o;
    return 0;
}

/* ---- keys ---- */

static int auth__no_passphrase(char *buf, int size, int rwflag, void *u) {
    (void)buf, (void)size, (void)rwflag, (void)u;
    return 0; /* encrypted keys are refused instead of prompting on a terminal */
}

/* Decides the algorithm a key allows: RSA >= 2048 bits -> RS256, EC on P-256 -> ES256. */
static int auth__classify(EVP_PKEY *pkey, auth__alg *alg, char *err, size_t errlen) {
    if (EVP_PKEY_is_a(pkey, "RSA")) {
        if (EVP_PKEY_get_bits(pkey) < AUTH__RSA_BITS_MIN)
            return auth__fail(err, errlen, AUTH_ECONFIG, "RSA key shorter than %d bits",
                              AUTH__RSA_BITS_MIN);
        *alg = AUTH__RS256;
        return AUTH_OK;
    }
    if (EVP_PKEY_is_a(pkey, "EC")) {
        char group[64];
        if (EVP_PKEY_get_group_name(pkey, group, sizeof group, NULL) != 1 ||
            (strcmp(group, "prime256v1") != 0 && strcmp(group, "P-256") != 0))
            return auth__fail(err, errlen, AUTH_ECONFIG, "EC key is not on curve P-256");
        *alg = AUTH__ES256;
        return AUTH_OK;
    }
    return auth__fail(err, errlen, AUTH_ECONFIG, "key is neither RSA nor EC P-256");
}

/* Public key from a SubjectPublicKeyInfo PEM ("PUBLIC KEY") or from a certificate. */
static int auth__load_public(const char *pem, EVP_PKEY **out, auth__alg *alg, char *err,
                             size_t errlen) {
    EVP_PKEY *pkey = NULL;
    int rc = AUTH_ECONFIG;
    BIO *bio = BIO_new_mem_buf(pem, -1);
    if (bio) pkey = PEM_read_bio_PUBKEY(bio, NULL, auth__no_passphrase, NULL);
    if (!pkey && bio) {
        X509 *cert;
        BIO_free(bio);
        bio = BIO_new_mem_buf(pem, -1);
        cert = bio ? PEM_read_bio_X509(bio, NULL, auth__no_passphrase, NULL) : NULL;
        if (cert) {
            pkey = X509_get_pubkey(cert);
            X509_free(cert);
        }
    }
    ERR_clear_error();
    if (!pkey) {
        auth__fail(err, errlen, AUTH_ECONFIG,
                   "public key PEM is neither a PUBLIC KEY nor a "
                   "CERTIFICATE");
        goto done;
    }
    rc = auth__classify(pkey, alg, err, errlen);
    if (rc == AUTH_OK) {
        *out = pkey;
        pkey = NULL;
    }
done:
    EVP_PKEY_free(pkey);
    BIO_free(bio);
    return rc;
}

static int auth__load_private(const char *pem, EVP_PKEY **out, auth__alg *alg, char *err,
                              size_t errlen) {
    EVP_PKEY *pkey = NULL;
    int rc = AUTH_ECONFIG;
    BIO *bio = BIO_new_mem_buf(pem, -1);
    if (bio) pkey = PEM_read_bio_PrivateKey(bio, NULL, auth__no_passphrase, NULL);
    ERR_clear_error();
    if (!pkey) {
        auth__fail(err, errlen, AUTH_ECONFIG,
                   "private key PEM could not be read (unencrypted "
                   "PKCS#8 or traditional PEM expected)");
        goto done;
    }
    rc = auth__classify(pkey, alg, err, errlen);
    if (rc == AUTH_OK) {
        *out = pkey;
        pkey = NULL;
    }
done:
    EVP_PKEY_free(pkey);
    BIO_free(bio);
    return rc;
}

/* ---- verifier ---- */

int auth_verifier_new(const auth_config *cfg, auth_verifier **out, char *err, size_t errlen) {
    auth_verifier *v = NULL;
    int rc = AUTH_ECONFIG;
    int has_secret = cfg && cfg->hs256_secret && cfg->hs256_secret[0];
    int has_pem = cfg && cfg->public_key_pem && cfg->public_key_pem[0];
    if (!cfg || !out) return auth__fail(err, errlen, AUTH_ECONFIG, "no configuration");
    if (has_secret == has_pem) {
        return auth__fail(err, errlen, AUTH_ECONFIG,
                          "configure exactly one of an HS256 secret or a public key");
    }
    if (!cfg->audience || !cfg->audience[0])
        return auth__fail(err, errlen, AUTH_ECONFIG, "audience is required");
    if (cfg->leeway_s < 0 || cfg->leeway_s > AUTH__LEEWAY_MAX)
        return auth__fail(err, errlen, AUTH_ECONFIG, "leeway must be within 0..%d seconds",
                          AUTH__LEEWAY_MAX);
    v = calloc(1, sizeof *v);
    if (!v) goto oom;
    v->leeway_s = cfg->leeway_s;
    v->audience = strdup(cfg->audience);
    if (!v->audience) goto oom;
    if (cfg->issuer && cfg->issuer[0] && !(v->issuer = strdup(cfg->issuer))) goto oom;
    if (has_secret) {
        v->secret_len = strlen(cfg->hs256_secret);
        if (v->secret_len < AUTH__SECRET_MIN) {
            rc = auth__fail(err, errlen, AUTH_ECONFIG, "HS256 secret shorter than %d bytes",
                            AUTH__SECRET_MIN);
            goto fail;
        }
        v->secret = (unsigned char *)strdup(cfg->hs256_secret);
        if (!v->secret) goto oom;
        v->alg = AUTH__HS256;
    } else {
        rc = auth__load_public(cfg->public_key_pem, &v->pkey, &v->alg, err, errlen);
        if (rc != AUTH_OK) goto fail;
    }
    *out = v;
    return AUTH_OK;
oom:
    rc = auth__fail(err, errlen, AUTH_ECONFIG, "out of memory");
fail:
    auth_verifier_free(v);
    return rc;
}

void auth_verifier_free(auth_verifier *v) {
    if (!v) return;
    if (v->secret) OPENSSL_cleanse(v->secret, v->secret_len);
    free(v->secret);
    EVP_PKEY_free(v->pkey);
    free(v->audience);
    free(v->issuer);
    free(v);
}

/* Raw ES256 signature (r || s, 32 bytes each, RFC 7518 3.4) -> DER ECDSA-Sig-Value. */
static int auth__es_raw_to_der(const unsigned char raw[64], unsigned char **der, int *derlen) {
    ECDSA_SIG *sig = ECDSA_SIG_new();
    BIGNUM *r = BN_bin2bn(raw, 32, NULL), *s = BN_bin2bn(raw + 32, 32, NULL);
    int rc = -1;
    if (!sig || !r || !s || ECDSA_SIG_set0(sig, r, s) != 1) goto done;
    r = s = NULL; /* owned by sig */
    *der = NULL;
    *derlen = i2d_ECDSA_SIG(sig, der);
    if (*derlen > 0) rc = 0;
done:
    BN_free(r);
    BN_free(s);
    ECDSA_SIG_free(sig);
    return rc;
}

static int auth__verify_pkey(EVP_PKEY *pkey, const unsigned char *sig, size_t siglen,
                             const char *data, size_t n) {
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    int ok = ctx && EVP_DigestVerifyInit(ctx, NULL, auth__sha256(), NULL, pkey) == 1 &&
             EVP_DigestVerify(ctx, sig, siglen, (const unsigned char *)data, n) == 1;
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return ok;
}

static int auth__check_sig(const auth_verifier *v, const char *input, size_t n,
                           const unsigned char *sig, size_t siglen) {
    unsigned char mac[EVP_MAX_MD_SIZE];
    unsigned int maclen = 0;
    unsigned char *der = NULL;
    int derlen = 0, ok = 0;
    switch (v->alg) {
    case AUTH__HS256:
        if (siglen != 32) return 0;
        if (!HMAC(auth__sha256(), v->secret, (int)v->secret_len, (const unsigned char *)input, n,
                  mac, &maclen) ||
            maclen != 32)
            return 0;
        return CRYPTO_memcmp(mac, sig, 32) == 0;
    case AUTH__RS256:
        if (siglen != (size_t)EVP_PKEY_get_size(v->pkey)) return 0;
        return auth__verify_pkey(v->pkey, sig, siglen, input, n);
    case AUTH__ES256:
        if (siglen != 64 || auth__es_raw_to_der(sig, &der, &derlen) != 0) return 0;
        ok = auth__verify_pkey(v->pkey, der, (size_t)derlen, input, n);
        OPENSSL_free(der);
        return ok;
    }
    return 0;
}

/* RFC 7515 5.2 allows refusing duplicate member names; we do, so that no other parser of
 * the same token can read a different `alg` or claim than we did. */
static int auth__has_duplicates(const cJSON *obj) {
    for (const cJSON *a = obj->child; a; a = a->next)
        for (const cJSON *b = a->next; b; b = b->next)
            if (strcmp(a->string, b->string) == 0) return 1;
    return 0;
}

/* A JOSE segment's JSON, strictly: the JSON text must end where the segment ends (nothing
 * smuggled after it), no string may hold a NUL (raw, or escaped as \u0000): claims are
 * compared as C strings, so "HS256\u0000x" would read as "HS256"; and every byte is UTF-8
 * (RFC 7519 7.2, RFC 8259 8.1), in any claim, known or not, and any member name: a token
 * other parsers would read differently, or log as mojibake, is malformed. An escaped lone
 * surrogate (\ud800) is refused by the JSON parser. NULL when refused. */
static cJSON *auth__parse_segment(const unsigned char *json, size_t n) {
    const char *end = NULL;
    if (util_utf8_check(json, n) != n) return NULL;
    for (size_t i = 0; i < n; i++) {
        if (json[i] == 0) return NULL;
        if (json[i] != '\\') continue;
        /* backslashes occur only inside strings: look at the escape */
        if (i + 5 < n && json[i + 1] == 'u' && memcmp(json + i + 2, "0000", 4) == 0) return NULL;
        i++; /* skip the escaped character ("\\" included) */
    }
    cJSON *j = cJSON_ParseWithLengthOpts((const char *)json, n, &end, 0);
    if (j == NULL) return NULL;
    while (end < (const char *)json + n &&
           (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
    if (end != (const char *)json + n) {
        cJSON_Delete(j);
        return NULL;
    }
    return j;
}

static int auth__check_header(const auth_verifier *v, const unsigned char *json, size_t n,
                              char *err, size_t errlen) {
    int rc = AUTH_EMALFORMED, members = 0;
    cJSON *h = auth__parse_segment(json, n);
    const cJSON *alg;
    if (!cJSON_IsObject(h)) {
        auth__fail(err, errlen, rc, "header is not a JSON object");
        goto done;
    }
    for (const cJSON *m = h->child; m; m = m->next)
        members++;
    if (members > AUTH__HEADER_MEMBERS || auth__has_duplicates(h)) {
        auth__fail(err, errlen, rc, "header has duplicate or too many members");
        goto done;
    }
    alg = cJSON_GetObjectItemCaseSensitive(h, "alg");
    if (!cJSON_IsString(alg)) {
        auth__fail(err, errlen, rc, "header has no alg");
        goto done;
    }
    if (strcasecmp(alg->valuestring, "none") == 0) {
        rc = auth__fail(err, errlen, AUTH_EALG, "alg none is not accepted");
        goto done;
    }
    if (strcmp(alg->valuestring, auth__alg_names[v->alg]) != 0) {
        rc = auth__fail(err, errlen, AUTH_EALG, "token alg is not the configured %s",
                        auth__alg_names[v->alg]);
        goto done;
    }
    /* RFC 7515 4.1.11: extensions listed in crit must be understood; we implement none. */
    if (cJSON_GetObjectItemCaseSensitive(h, "crit")) {
        auth__fail(err, errlen, rc, "header lists crit extensions, none are supported");
        goto done;
    }
    rc = AUTH_OK;
done:
    cJSON_Delete(h);
    return rc;
}

/* NumericDate (RFC 7519 2): seconds, possibly fractional; fractions are dropped. */
static int auth__numeric_date(const cJSON *item, int64_t *out) {
    if (!cJSON_IsNumber(item)) return -1;
    double d = item->valuedouble;
    if (!isfinite(d) || d < 0 || d > AUTH__NUMERIC_MAX) return -1;
    *out = (int64_t)d;
    return 0;
}

static int auth__check_times(const auth_verifier *v, const cJSON *p, int64_t now, auth_identity *id,
                             char *err, size_t errlen) {
    const cJSON *exp = cJSON_GetObjectItemCaseSensitive(p, "exp");
    const cJSON *nbf = cJSON_GetObjectItemCaseSensitive(p, "nbf");
    const cJSON *iat = cJSON_GetObjectItemCaseSensitive(p, "iat");
    int64_t t;
    if (!exp) return auth__fail(err, errlen, AUTH_ECLAIMS, "exp missing");
    if (auth__numeric_date(exp, &id->exp) != 0)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "exp is not a NumericDate");
    if (now >= id->exp + v->leeway_s) return auth__fail(err, errlen, AUTH_EEXPIRED, "expired");
    if (nbf) {
        if (auth__numeric_date(nbf, &t) != 0)
            return auth__fail(err, errlen, AUTH_EMALFORMED, "nbf is not a NumericDate");
        if (now + v->leeway_s < t)
            return auth__fail(err, errlen, AUTH_ENOTYET, "not valid yet (nbf)");
    }
    id->iat = 0;
    if (iat && auth__numeric_date(iat, &id->iat) != 0)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "iat is not a NumericDate");
    /* a token issued in the future (beyond the clock skew) was not issued by a sane issuer */
    if (iat && id->iat > now + v->leeway_s)
        return auth__fail(err, errlen, AUTH_ENOTYET, "issued in the future (iat)");
    return AUTH_OK;
}

static int auth__check_aud_iss(const auth_verifier *v, const cJSON *p, char *err, size_t errlen) {
    const cJSON *aud = cJSON_GetObjectItemCaseSensitive(p, "aud");
    const cJSON *iss = cJSON_GetObjectItemCaseSensitive(p, "iss");
    int found = 0;
    if (!aud) return auth__fail(err, errlen, AUTH_EAUD, "aud missing");
    if (cJSON_IsString(aud)) {
        found = strcmp(aud->valuestring, v->audience) == 0;
    } else if (cJSON_IsArray(aud)) {
        const cJSON *a;
        cJSON_ArrayForEach(a, aud) {
            if (!cJSON_IsString(a))
                return auth__fail(err, errlen, AUTH_EMALFORMED, "aud has a non-string member");
            if (strcmp(a->valuestring, v->audience) == 0) found = 1;
        }
    } else {
        return auth__fail(err, errlen, AUTH_EMALFORMED, "aud is neither a string nor an array");
    }
    if (!found) return auth__fail(err, errlen, AUTH_EAUD, "aud is not %s", v->audience);
    if (!v->issuer) return AUTH_OK;
    if (!iss) return auth__fail(err, errlen, AUTH_EISS, "iss missing");
    if (!cJSON_IsString(iss))
        return auth__fail(err, errlen, AUTH_EMALFORMED, "iss is not a string");
    if (strcmp(iss->valuestring, v->issuer) != 0)
        return auth__fail(err, errlen, AUTH_EISS, "iss is not %s", v->issuer);
    return AUTH_OK;
}

static int auth__copy_id(const cJSON *item, const char *name, char dst[AUTH_ID_MAX], char *err,
                         size_t errlen) {
    size_t n;
    if (!item) return auth__fail(err, errlen, AUTH_ECLAIMS, "%s missing", name);
    if (!cJSON_IsString(item))
        return auth__fail(err, errlen, AUTH_EMALFORMED, "%s is not a string", name);
    n = strlen(item->valuestring);
    if (n == 0) return auth__fail(err, errlen, AUTH_ECLAIMS, "%s is empty", name);
    if (n >= AUTH_ID_MAX)
        return auth__fail(err, errlen, AUTH_ECLAIMS, "%s longer than %d bytes", name,
                          AUTH_ID_MAX - 1);
    memcpy(dst, item->valuestring, n + 1);
    return AUTH_OK;
}

static int auth__check_identity(const cJSON *p, auth_identity *id, char *err, size_t errlen) {
    const cJSON *cl = cJSON_GetObjectItemCaseSensitive(p, "clearance");
    const cJSON *teams = cJSON_GetObjectItemCaseSensitive(p, "teams");
    const cJSON *t;
    int rc;
    if ((rc = auth__copy_id(cJSON_GetObjectItemCaseSensitive(p, "sub"), "sub", id->sub, err,
                            errlen)) != AUTH_OK ||
        (rc = auth__copy_id(cJSON_GetObjectItemCaseSensitive(p, "org_id"), "org_id", id->org_id,
                            err, errlen)) != AUTH_OK)
        return rc;
    if (!cl) return auth__fail(err, errlen, AUTH_ECLAIMS, "clearance missing");
    if (!cJSON_IsNumber(cl) || floor(cl->valuedouble) != cl->valuedouble)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "clearance is not an integer");
    if (cl->valuedouble < 1 || cl->valuedouble > 5)
        return auth__fail(err, errlen, AUTH_ECLAIMS, "clearance is not within 1..5");
    id->clearance = (int)cl->valuedouble;
    id->n_teams = 0;
    if (!teams) return AUTH_OK;
    if (!cJSON_IsArray(teams))
        return auth__fail(err, errlen, AUTH_EMALFORMED, "teams is not an array");
    if (cJSON_GetArraySize(teams) > AUTH_MAX_TEAMS)
        return auth__fail(err, errlen, AUTH_ECLAIMS, "more than %d teams", AUTH_MAX_TEAMS);
    cJSON_ArrayForEach(t, teams) {
        rc = auth__copy_id(t, "teams[]", id->teams[id->n_teams], err, errlen);
        if (rc != AUTH_OK) return rc;
        id->n_teams++;
    }
    return AUTH_OK;
}

int auth_verify(const auth_verifier *v, const char *token, size_t len, int64_t now,
                auth_identity *out, char *err, size_t errlen) {
    /* Decoded parts never exceed the token's length (base64 expands by 4/3). */
    unsigned char buf[AUTH__TOKEN_MAX];
    size_t d1 = 0, d2 = 0, dots = 0, hlen, plen, slen;
    cJSON *payload = NULL;
    auth_identity id;
    int rc;
    if (!v || !out) return auth__fail(err, errlen, AUTH_ECONFIG, "no verifier");
    if (!token || len == 0) return auth__fail(err, errlen, AUTH_EMALFORMED, "empty token");
    if (len > AUTH__TOKEN_MAX)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "token longer than %d bytes",
                          AUTH__TOKEN_MAX);
    for (size_t i = 0; i < len; i++) {
        if (token[i] != '.') continue;
        if (++dots == 1)
            d1 = i;
        else
            d2 = i;
    }
    /* An empty signature passes this split so that `alg: none` is refused as such. */
    if (dots != 2 || d1 == 0 || d2 == d1 + 1)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "token is not three base64url parts");
    if (auth__b64u_decode(token, d1, buf, sizeof buf, &hlen) != 0)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "header is not base64url");
    if ((rc = auth__check_header(v, buf, hlen, err, errlen)) != AUTH_OK) return rc;
    if (auth__b64u_decode(token + d2 + 1, len - d2 - 1, buf, sizeof buf, &slen) != 0)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "signature is not base64url");
    if (!auth__check_sig(v, token, d2, buf, slen))
        return auth__fail(err, errlen, AUTH_ESIG, "signature does not verify");
    if (auth__b64u_decode(token + d1 + 1, d2 - d1 - 1, buf, sizeof buf, &plen) != 0)
        return auth__fail(err, errlen, AUTH_EMALFORMED, "payload is not base64url");
    payload = auth__parse_segment(buf, plen);
    if (!cJSON_IsObject(payload) || auth__has_duplicates(payload)) {
        rc = auth__fail(err, errlen, AUTH_EMALFORMED,
                        "payload is not a JSON object with unique members");
        goto done;
    }
    memset(&id, 0, sizeof id);
    if ((rc = auth__check_times(v, payload, now, &id, err, errlen)) != AUTH_OK ||
        (rc = auth__check_aud_iss(v, payload, err, errlen)) != AUTH_OK ||
        (rc = auth__check_identity(payload, &id, err, errlen)) != AUTH_OK)
        goto done;
    *out = id;
done:
    cJSON_Delete(payload);
    return rc;
}

int auth_verify_bearer(const auth_verifier *v, const char *header, size_t len, int64_t now,
                       auth_identity *out, char *err, size_t errlen) {
    size_t i = 6;
    if (!header || len <= 7 || strncasecmp(header, "bearer", 6) != 0 ||
        (header[6] != ' ' && header[6] != '\t'))
        return auth__fail(err, errlen, AUTH_EMALFORMED, "authorization is not a Bearer token");
    while (i < len && (header[i] == ' ' || header[i] == '\t'))
        i++;
    while (len > i && (header[len - 1] == ' ' || header[len - 1] == '\t'))
        len--;
    return auth_verify(v, header + i, len - i, now, out, err, errlen);
}

/* ---- signer ---- */

int auth_signer_new(const char *alg, const char *key, auth_signer **out, char *err, size_t errlen) {
    auth_signer *s = NULL;
    auth__alg want;
    int rc = AUTH_ECONFIG;
    if (!alg || !key || !out) return auth__fail(err, errlen, AUTH_ECONFIG, "alg and key needed");
    if (strcmp(alg, "HS256") == 0)
        want = AUTH__HS256;
    else if (strcmp(alg, "RS256") == 0)
        want = AUTH__RS256;
    else if (strcmp(alg, "ES256") == 0)
        want = AUTH__ES256;
    else
        return auth__fail(err, errlen, AUTH_EALG, "alg must be HS256, RS256 or ES256");
    s = calloc(1, sizeof *s);
    if (!s) goto oom;
    s->alg = want;
    if (want == AUTH__HS256) {
        s->secret_len = strlen(key);
        if (s->secret_len < AUTH__SECRET_MIN) {
            rc = auth__fail(err, errlen, AUTH_ECONFIG, "HS256 secret shorter than %d bytes",
                            AUTH__SECRET_MIN);
            goto fail;
        }
        if (!(s->secret = (unsigned char *)strdup(key))) goto oom;
    } else {
        auth__alg have;
        if ((rc = auth__load_private(key, &s->pkey, &have, err, errlen)) != AUTH_OK) goto fail;
        if (have != want) {
            rc = auth__fail(err, errlen, AUTH_EALG, "%s needs %s key", alg,
                            want == AUTH__RS256 ? "an RSA" : "a P-256 EC");
            goto fail;
        }
    }
    *out = s;
    return AUTH_OK;
oom:
    rc = auth__fail(err, errlen, AUTH_ECONFIG, "out of memory");
fail:
    auth_signer_free(s);
    return rc;
}

void auth_signer_free(auth_signer *s) {
    if (!s) return;
    if (s->secret) OPENSSL_cleanse(s->secret, s->secret_len);
    free(s->secret);
    EVP_PKEY_free(s->pkey);
    free(s);
}

static int auth__valid_id(const char *s) {
    return s && s[0] && strlen(s) < AUTH_ID_MAX;
}

static int auth__check_claims(const auth_claims *c, char *err, size_t errlen) {
    if (!auth__valid_id(c->sub) || !auth__valid_id(c->org_id))
        return auth__fail(err, errlen, AUTH_ECLAIMS, "sub and org_id must be 1..%d bytes",
                          AUTH_ID_MAX - 1);
    if (c->clearance < 1 || c->clearance > 5)
        return auth__fail(err, errlen, AUTH_ECLAIMS, "clearance is not within 1..5");
    if (c->n_teams > AUTH_MAX_TEAMS || (c->n_teams && !c->teams))
        return auth__fail(err, errlen, AUTH_ECLAIMS, "more than %d teams", AUTH_MAX_TEAMS);
    for (size_t i = 0; i < c->n_teams; i++)
        if (!auth__valid_id(c->teams[i]))
            return auth__fail(err, errlen, AUTH_ECLAIMS, "teams[%zu] must be 1..%d bytes", i,
                              AUTH_ID_MAX - 1);
    if (!c->audience || !c->audience[0])
        return auth__fail(err, errlen, AUTH_ECLAIMS, "audience is required");
    if (c->ttl_s <= 0) return auth__fail(err, errlen, AUTH_ECLAIMS, "ttl_s must be positive");
    return AUTH_OK;
}

/* Members of extra_json are appended; a member that would replace a registered or identity
 * claim is refused rather than silently winning or losing. */
static int auth__add_extra(cJSON *payload, const char *extra, char *err, size_t errlen) {
    cJSON *x = cJSON_Parse(extra), *m;
    int rc = AUTH_OK;
    if (!cJSON_IsObject(x)) {
        rc = auth__fail(err, errlen, AUTH_ECLAIMS, "extra_json is not a JSON object");
        goto done;
    }
    while ((m = x->child) != NULL) {
        if (cJSON_GetObjectItemCaseSensitive(payload, m->string)) {
            rc = auth__fail(err, errlen, AUTH_ECLAIMS, "extra_json repeats claim %s", m->string);
            goto done;
        }
        cJSON_DetachItemViaPointer(x, m);
        if (!cJSON_AddItemToObject(payload, m->string, m)) {
            cJSON_Delete(m);
            rc = auth__fail(err, errlen, AUTH_ECONFIG, "out of memory");
            goto done;
        }
    }
done:
    cJSON_Delete(x);
    return rc;
}

static char *auth__payload(const auth_claims *c, char *err, size_t errlen, int *rc) {
    int64_t iat = c->iat ? c->iat : (int64_t)time(NULL);
    cJSON *p = cJSON_CreateObject(), *teams = NULL;
    char *out = NULL;
    *rc = AUTH_ECONFIG;
    if (!p) goto oom;
    if (c->issuer && c->issuer[0] && !cJSON_AddStringToObject(p, "iss", c->issuer)) goto oom;
    if (!cJSON_AddStringToObject(p, "sub", c->sub) ||
        !cJSON_AddStringToObject(p, "aud", c->audience) ||
        !cJSON_AddStringToObject(p, "org_id", c->org_id) ||
        !cJSON_AddNumberToObject(p, "clearance", c->clearance) ||
        !(teams = cJSON_AddArrayToObject(p, "teams")))
        goto oom;
    for (size_t i = 0; i < c->n_teams; i++) {
        cJSON *t = cJSON_CreateString(c->teams[i]);
        if (!t) goto oom;
        if (!cJSON_AddItemToArray(teams, t)) {
            cJSON_Delete(t);
            goto oom;
        }
    }
    if (!cJSON_AddNumberToObject(p, "iat", (double)iat) ||
        !cJSON_AddNumberToObject(p, "exp", (double)(iat + c->ttl_s)))
        goto oom;
    if (c->extra_json && (*rc = auth__add_extra(p, c->extra_json, err, errlen)) != AUTH_OK)
        goto done;
    out = cJSON_PrintUnformatted(p);
    if (!out) goto oom;
    *rc = AUTH_OK;
    goto done;
oom:
    *rc = auth__fail(err, errlen, AUTH_ECONFIG, "out of memory");
done:
    cJSON_Delete(p);
    return out;
}

static int auth__sign(const auth_signer *s, const char *input, size_t n, unsigned char *sig,
                      size_t *siglen) {
    unsigned char der[256];
    size_t derlen = sizeof der;
    unsigned int maclen = 0;
    EVP_MD_CTX *ctx = NULL;
    ECDSA_SIG *es = NULL;
    const unsigned char *p = der;
    const BIGNUM *r, *sv;
    int rc = -1;
    if (s->alg == AUTH__HS256) {
        if (!HMAC(auth__sha256(), s->secret, (int)s->secret_len, (const unsigned char *)input, n,
                  sig, &maclen))
            return -1;
        *siglen = maclen;
        return 0;
    }
    ctx = EVP_MD_CTX_new();
    if (!ctx || EVP_DigestSignInit(ctx, NULL, auth__sha256(), NULL, s->pkey) != 1) goto done;
    if (s->alg == AUTH__RS256) {
        if (EVP_DigestSign(ctx, sig, siglen, (const unsigned char *)input, n) != 1) goto done;
        rc = 0;
        goto done;
    }
    if (EVP_DigestSign(ctx, der, &derlen, (const unsigned char *)input, n) != 1) goto done;
    es = d2i_ECDSA_SIG(NULL, &p, (long)derlen);
    if (!es) goto done;
    ECDSA_SIG_get0(es, &r, &sv);
    if (BN_bn2binpad(r, sig, 32) != 32 || BN_bn2binpad(sv, sig + 32, 32) != 32) goto done;
    *siglen = 64;
    rc = 0;
done:
    ECDSA_SIG_free(es);
    EVP_MD_CTX_free(ctx);
    ERR_clear_error();
    return rc;
}

int auth_mint(const auth_signer *s, const auth_claims *c, char **out_token, char *err,
              size_t errlen) {
    static const char *const headers[] = {"", "{\"alg\":\"HS256\",\"typ\":\"JWT\"}",
                                          "{\"alg\":\"RS256\",\"typ\":\"JWT\"}",
                                          "{\"alg\":\"ES256\",\"typ\":\"JWT\"}"};
    unsigned char sig[1024]; /* RSA keys up to 8192 bits */
    size_t siglen = sizeof sig, hlen, plen, pos;
    char *payload = NULL, *tok = NULL;
    int rc;
    if (!s || !c || !out_token) return auth__fail(err, errlen, AUTH_ECONFIG, "no signer");
    if ((rc = auth__check_claims(c, err, errlen)) != AUTH_OK) return rc;
    if (s->pkey && EVP_PKEY_get_size(s->pkey) > (int)sizeof sig)
        return auth__fail(err, errlen, AUTH_ECONFIG, "key too large");
    payload = auth__payload(c, err, errlen, &rc);
    if (!payload) return rc;
    hlen = strlen(headers[s->alg]);
    plen = strlen(payload);
    tok = malloc(AUTH__B64LEN(hlen) + AUTH__B64LEN(plen) + AUTH__B64LEN(sizeof sig) + 3);
    if (!tok) {
        rc = auth__fail(err, errlen, AUTH_ECONFIG, "out of memory");
        goto done;
    }
    pos = auth__b64u_encode((const unsigned char *)headers[s->alg], hlen, tok);
    tok[pos++] = '.';
    pos += auth__b64u_encode((const unsigned char *)payload, plen, tok + pos);
    if (auth__sign(s, tok, pos, sig, &siglen) != 0) {
        rc = auth__fail(err, errlen, AUTH_ECONFIG, "signing failed");
        goto done;
    }
    tok[pos++] = '.';
    pos += auth__b64u_encode(sig, siglen, tok + pos);
    if (pos > AUTH__TOKEN_MAX) {
        rc = auth__fail(err, errlen, AUTH_ECLAIMS, "token would exceed %d bytes", AUTH__TOKEN_MAX);
        goto done;
    }
    *out_token = tok;
    tok = NULL;
    rc = AUTH_OK;
done:
    free(tok);
    free(payload);
    return rc;
}

const char *auth_strerror(int code) {
    switch (code) {
    case AUTH_OK:
        return "ok";
    case AUTH_EMALFORMED:
        return "malformed token";
    case AUTH_EALG:
        return "algorithm not allowed";
    case AUTH_ESIG:
        return "bad signature";
    case AUTH_EEXPIRED:
        return "token expired";
    case AUTH_ENOTYET:
        return "token not valid yet";
    case AUTH_EAUD:
        return "wrong audience";
    case AUTH_EISS:
        return "wrong issuer";
    case AUTH_ECLAIMS:
        return "missing or invalid claims";
    case AUTH_ECONFIG:
        return "bad key or configuration";
    default:
        return "unknown auth error";
    }
}
