/* JWT verification and minting (libcommon/auth.c).
 *
 * Tokens for the negative cases are built here with OpenSSL directly (own base64url, own
 * HMAC / RSA / ECDSA signing, raw r||s for ES256), so the verifier is checked against an
 * independent encoder, not only against its own minting. Keys are generated per run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <pthread.h>

#include <cmocka.h>

#include <cjson/cJSON.h>
#include <openssl/bn.h>
#include <openssl/ec.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "auth.h"

#define SECRET "0123456789abcdef0123456789abcdef-local-dev"
#define OTHER_SECRET "fedcba9876543210fedcba9876543210-other-key"
#define AUD "upsquad"
#define HDR_HS "{\"alg\":\"HS256\",\"typ\":\"JWT\"}"
#define HDR_RS "{\"alg\":\"RS256\",\"typ\":\"JWT\"}"
#define HDR_ES "{\"alg\":\"ES256\",\"typ\":\"JWT\"}"

typedef enum { SIGN_HS, SIGN_RS, SIGN_ES, SIGN_NONE } sign_kind;

static EVP_PKEY *rsa_key, *ec_key;
static char *rsa_priv_pem, *rsa_pub_pem, *ec_priv_pem, *ec_pub_pem;
static int64_t now;

/* ---- helpers: PEM, base64url, independent signing ---- */

static char *bio_string(BIO *b) {
    char *data;
    long n = BIO_get_mem_data(b, &data);
    char *s = malloc((size_t)n + 1);
    assert_non_null(s);
    memcpy(s, data, (size_t)n);
    s[n] = '\0';
    return s;
}

static char *pem_private(EVP_PKEY *k) {
    BIO *b = BIO_new(BIO_s_mem());
    assert_int_equal(PEM_write_bio_PrivateKey(b, k, NULL, NULL, 0, NULL, NULL), 1);
    char *s = bio_string(b);
    BIO_free(b);
    return s;
}

static char *pem_public(EVP_PKEY *k) {
    BIO *b = BIO_new(BIO_s_mem());
    assert_int_equal(PEM_write_bio_PUBKEY(b, k), 1);
    char *s = bio_string(b);
    BIO_free(b);
    return s;
}

static void b64u(const unsigned char *in, size_t n, char *out) {
    static const char t[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    size_t o = 0;
    for (size_t i = 0; i < n; i += 3) {
        unsigned v = (unsigned)in[i] << 16;
        if (i + 1 < n) v |= (unsigned)in[i + 1] << 8;
        if (i + 2 < n) v |= in[i + 2];
        out[o++] = t[v >> 18];
        out[o++] = t[(v >> 12) & 63];
        if (i + 1 < n) out[o++] = t[(v >> 6) & 63];
        if (i + 2 < n) out[o++] = t[v & 63];
    }
    out[o] = '\0';
}

static int b64u_val(char c) {
    const char *t = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    const char *p = strchr(t, c);
    return p && c ? (int)(p - t) : -1;
}

static size_t b64u_dec(const char *in, size_t n, unsigned char *out) {
    size_t o = 0;
    unsigned acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        int v = b64u_val(in[i]);
        assert_true(v >= 0);
        acc = acc << 6 | (unsigned)v;
        bits += 6;
        if (bits >= 8) {
            bits -= 8;
            out[o++] = (unsigned char)(acc >> bits);
        }
    }
    return o;
}

static size_t sign_raw(sign_kind k, const void *key, const char *in, size_t n, unsigned char *sig) {
    size_t len = 1024;
    unsigned int mlen = 0;
    if (k == SIGN_NONE) return 0;
    if (k == SIGN_HS) {
        const char *secret = key;
        assert_non_null(HMAC(EVP_sha256(), secret, (int)strlen(secret), (const unsigned char *)in,
                             n, sig, &mlen));
        return mlen;
    }
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    unsigned char der[256];
    assert_int_equal(EVP_DigestSignInit(ctx, NULL, EVP_sha256(), NULL, (EVP_PKEY *)key), 1);
    if (k == SIGN_RS) {
        assert_int_equal(EVP_DigestSign(ctx, sig, &len, (const unsigned char *)in, n), 1);
        EVP_MD_CTX_free(ctx);
        return len;
    }
    len = sizeof der;
    assert_int_equal(EVP_DigestSign(ctx, der, &len, (const unsigned char *)in, n), 1);
    EVP_MD_CTX_free(ctx);
    const unsigned char *p = der;
    ECDSA_SIG *es = d2i_ECDSA_SIG(NULL, &p, (long)len);
    assert_non_null(es);
    const BIGNUM *r, *s;
    ECDSA_SIG_get0(es, &r, &s);
    BN_bn2binpad(r, sig, 32);
    BN_bn2binpad(s, sig + 32, 32);
    ECDSA_SIG_free(es);
    return 64;
}

/* header.payload.signature, signed by the test itself. Caller frees. */
static char *make_token(sign_kind k, const void *key, const char *header, const char *payload) {
    size_t hl = strlen(header), pl = strlen(payload);
    char *tok = malloc((hl + pl) * 2 + 2048);
    unsigned char sig[1024];
    assert_non_null(tok);
    b64u((const unsigned char *)header, hl, tok);
    strcat(tok, ".");
    b64u((const unsigned char *)payload, pl, tok + strlen(tok));
    size_t sl = sign_raw(k, key, tok, strlen(tok), sig);
    strcat(tok, ".");
    b64u(sig, sl, tok + strlen(tok));
    return tok;
}

static char *fmt(const char *f, ...) __attribute__((format(printf, 1, 2)));
static char *fmt(const char *f, ...) {
    va_list ap;
    char *s = NULL;
    va_start(ap, f);
    assert_true(vasprintf(&s, f, ap) >= 0);
    va_end(ap);
    return s;
}

/* A valid payload with one member replaced or added: claims(",\"extra\":1") etc. */
static char *claims_with(const char *tail) {
    return fmt("{\"sub\":\"m-1\",\"org_id\":\"org-1\",\"clearance\":3,\"teams\":[\"t-a\",\"t-b\"],"
               "\"aud\":\"" AUD "\",\"iat\":%lld,\"exp\":%lld%s}",
               (long long)now, (long long)now + 600, tail);
}

static auth_verifier *hs_verifier(const char *issuer) {
    auth_verifier *v = NULL;
    char err[256];
    auth_config cfg = {.hs256_secret = SECRET, .audience = AUD, .issuer = issuer, .leeway_s = 30};
    assert_int_equal(auth_verifier_new(&cfg, &v, err, sizeof err), AUTH_OK);
    return v;
}

static auth_verifier *pem_verifier(const char *pem) {
    auth_verifier *v = NULL;
    char err[256];
    auth_config cfg = {.public_key_pem = pem, .audience = AUD, .leeway_s = 30};
    assert_int_equal(auth_verifier_new(&cfg, &v, err, sizeof err), AUTH_OK);
    return v;
}

/* Verifies and expects `want`; on failure checks that *out is untouched and that err names a
 * reason without quoting any part of the token. */
static void expect_verify(const auth_verifier *v, const char *tok, int want) {
    auth_identity id, before;
    char err[256] = "";
    memset(&id, 0xAB, sizeof id);
    before = id;
    int rc = auth_verify(v, tok, strlen(tok), now, &id, err, sizeof err);
    if (rc != want) print_error("got %d (%s), want %d\n", rc, err, want);
    assert_int_equal(rc, want);
    if (want == AUTH_OK) return;
    assert_memory_equal(&id, &before, sizeof id);
    assert_true(strlen(err) > 0);
    for (const char *seg = tok; *seg;) {
        const char *dot = strchr(seg, '.');
        size_t n = dot ? (size_t)(dot - seg) : strlen(seg);
        if (n >= 12) {
            char piece[13];
            memcpy(piece, seg, 12);
            piece[12] = '\0';
            assert_null(strstr(err, piece));
        }
        seg += n + (dot ? 1 : 0);
    }
}

static void expect_hs(const char *payload, int want) {
    auth_verifier *v = hs_verifier(NULL);
    char *tok = make_token(SIGN_HS, SECRET, HDR_HS, payload);
    expect_verify(v, tok, want);
    free(tok);
    auth_verifier_free(v);
}

static int setup(void **state) {
    (void)state;
    now = (int64_t)time(NULL);
    rsa_key = EVP_PKEY_Q_keygen(NULL, NULL, "RSA", (size_t)2048);
    ec_key = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
    if (!rsa_key || !ec_key) return -1;
    rsa_priv_pem = pem_private(rsa_key);
    rsa_pub_pem = pem_public(rsa_key);
    ec_priv_pem = pem_private(ec_key);
    ec_pub_pem = pem_public(ec_key);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    EVP_PKEY_free(rsa_key);
    EVP_PKEY_free(ec_key);
    free(rsa_priv_pem);
    free(rsa_pub_pem);
    free(ec_priv_pem);
    free(ec_pub_pem);
    return 0;
}

/* ---- positive ---- */

static void mint_and_verify(const char *alg, const char *priv, auth_verifier *v) {
    static const char *const teams[] = {"team-1", "team-2", "team-3"};
    auth_signer *s = NULL;
    auth_identity id;
    char err[256], *tok = NULL;
    auth_claims c = {.sub = "member-7",
                     .org_id = "org-42",
                     .audience = AUD,
                     .clearance = 4,
                     .teams = teams,
                     .n_teams = 3,
                     .iat = now - 5,
                     .ttl_s = 900};
    assert_int_equal(auth_signer_new(alg, priv, &s, err, sizeof err), AUTH_OK);
    assert_int_equal(auth_mint(s, &c, &tok, err, sizeof err), AUTH_OK);
    assert_int_equal(auth_verify(v, tok, strlen(tok), now, &id, err, sizeof err), AUTH_OK);
    assert_string_equal(id.sub, "member-7");
    assert_string_equal(id.org_id, "org-42");
    assert_int_equal(id.clearance, 4);
    assert_int_equal(id.n_teams, 3);
    assert_string_equal(id.teams[0], "team-1");
    assert_string_equal(id.teams[2], "team-3");
    assert_int_equal(id.iat, now - 5);
    assert_int_equal(id.exp, now - 5 + 900);
    /* The header names the algorithm and the token is three base64url parts. */
    char *dot = strchr(tok, '.');
    unsigned char hdr[128];
    size_t hl = b64u_dec(tok, (size_t)(dot - tok), hdr);
    hdr[hl] = '\0';
    cJSON *h = cJSON_Parse((const char *)hdr);
    assert_string_equal(cJSON_GetObjectItem(h, "alg")->valuestring, alg);
    cJSON_Delete(h);
    free(tok);
    auth_signer_free(s);
}

static void test_hs256_roundtrip(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier(NULL);
    mint_and_verify("HS256", SECRET, v);
    auth_verifier_free(v);
}

static void test_rs256_roundtrip(void **state) {
    (void)state;
    auth_verifier *v = pem_verifier(rsa_pub_pem);
    mint_and_verify("RS256", rsa_priv_pem, v);
    auth_verifier_free(v);
}

static void test_es256_roundtrip(void **state) {
    (void)state;
    auth_verifier *v = pem_verifier(ec_pub_pem);
    mint_and_verify("ES256", ec_priv_pem, v);
    auth_verifier_free(v);
}

/* Tokens from an independent encoder verify; ES256 minted signatures are raw r||s that an
 * independent DER conversion verifies. */
static void test_independent_tokens(void **state) {
    (void)state;
    char *p = claims_with("");
    auth_verifier *rv = pem_verifier(rsa_pub_pem), *ev = pem_verifier(ec_pub_pem);
    char *t1 = make_token(SIGN_HS, SECRET, HDR_HS, p);
    char *t2 = make_token(SIGN_RS, rsa_key, HDR_RS, p);
    char *t3 = make_token(SIGN_ES, ec_key, HDR_ES, p);
    auth_verifier *hv = hs_verifier(NULL);
    expect_verify(hv, t1, AUTH_OK);
    expect_verify(rv, t2, AUTH_OK);
    expect_verify(ev, t3, AUTH_OK);

    auth_signer *s = NULL;
    char err[256], *tok = NULL;
    auth_claims c = {.sub = "a", .org_id = "b", .audience = AUD, .clearance = 1, .ttl_s = 60};
    assert_int_equal(auth_signer_new("ES256", ec_priv_pem, &s, err, sizeof err), AUTH_OK);
    assert_int_equal(auth_mint(s, &c, &tok, err, sizeof err), AUTH_OK);
    const char *d2 = strrchr(tok, '.');
    unsigned char raw[128];
    assert_int_equal(b64u_dec(d2 + 1, strlen(d2 + 1), raw), 64);
    ECDSA_SIG *es = ECDSA_SIG_new();
    ECDSA_SIG_set0(es, BN_bin2bn(raw, 32, NULL), BN_bin2bn(raw + 32, 32, NULL));
    unsigned char *der = NULL;
    int derlen = i2d_ECDSA_SIG(es, &der);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    assert_int_equal(EVP_DigestVerifyInit(ctx, NULL, EVP_sha256(), NULL, ec_key), 1);
    assert_int_equal(
        EVP_DigestVerify(ctx, der, (size_t)derlen, (const unsigned char *)tok, (size_t)(d2 - tok)),
        1);
    EVP_MD_CTX_free(ctx);
    OPENSSL_free(der);
    ECDSA_SIG_free(es);
    free(tok);
    auth_signer_free(s);
    free(t1);
    free(t2);
    free(t3);
    free(p);
    auth_verifier_free(hv);
    auth_verifier_free(rv);
    auth_verifier_free(ev);
}

static void test_bearer(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier(NULL);
    char *p = claims_with("");
    char *tok = make_token(SIGN_HS, SECRET, HDR_HS, p);
    const char *ok_forms[] = {"Bearer %s", "bearer %s", "BEARER   %s  "};
    const char *bad_forms[] = {"Basic %s", "Bearer", "Bearer ", "Bearer%s", "%s"};
    auth_identity id;
    char err[256];
    for (size_t i = 0; i < 3; i++) {
        char *h = fmt(ok_forms[i], tok);
        assert_int_equal(auth_verify_bearer(v, h, strlen(h), now, &id, err, sizeof err), AUTH_OK);
        assert_string_equal(id.sub, "m-1");
        free(h);
    }
    for (size_t i = 0; i < 5; i++) {
        char *h = strstr(bad_forms[i], "%s") ? fmt(bad_forms[i], tok) : strdup(bad_forms[i]);
        assert_int_not_equal(auth_verify_bearer(v, h, strlen(h), now, &id, err, sizeof err),
                             AUTH_OK);
        free(h);
    }
    free(tok);
    free(p);
    auth_verifier_free(v);
}

/* A public key inside a certificate works as well as a bare SubjectPublicKeyInfo. */
static void test_certificate_key(void **state) {
    (void)state;
    X509 *x = X509_new();
    X509_set_version(x, 2);
    ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
    X509_gmtime_adj(X509_getm_notBefore(x), 0);
    X509_gmtime_adj(X509_getm_notAfter(x), 3600);
    X509_NAME_add_entry_by_txt(X509_get_subject_name(x), "CN", MBSTRING_ASC,
                               (const unsigned char *)"gateway", -1, -1, 0);
    X509_set_issuer_name(x, X509_get_subject_name(x));
    X509_set_pubkey(x, ec_key);
    assert_true(X509_sign(x, ec_key, EVP_sha256()) > 0);
    BIO *b = BIO_new(BIO_s_mem());
    PEM_write_bio_X509(b, x);
    char *pem = bio_string(b);
    auth_verifier *v = pem_verifier(pem);
    char *p = claims_with("");
    char *tok = make_token(SIGN_ES, ec_key, HDR_ES, p);
    expect_verify(v, tok, AUTH_OK);
    free(tok);
    free(p);
    auth_verifier_free(v);
    free(pem);
    BIO_free(b);
    X509_free(x);
}

/* ---- algorithm handling ---- */

static void test_alg_none(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier(NULL);
    char *p = claims_with("");
    char *t1 = make_token(SIGN_NONE, NULL, "{\"alg\":\"none\",\"typ\":\"JWT\"}", p);
    char *t2 = make_token(SIGN_HS, SECRET, "{\"alg\":\"none\"}", p);
    char *t3 = make_token(SIGN_HS, SECRET, "{\"alg\":\"NoNe\"}", p);
    expect_verify(v, t1, AUTH_EALG);
    expect_verify(v, t2, AUTH_EALG);
    expect_verify(v, t3, AUTH_EALG);
    /* An HS256 header with an empty signature is a bad signature, not a pass. */
    char *t4 = make_token(SIGN_NONE, NULL, HDR_HS, p);
    expect_verify(v, t4, AUTH_ESIG);
    free(t1);
    free(t2);
    free(t3);
    free(t4);
    free(p);
    auth_verifier_free(v);
}

static void test_alg_confusion(void **state) {
    (void)state;
    auth_verifier *hv = hs_verifier(NULL), *rv = pem_verifier(rsa_pub_pem),
                  *ev = pem_verifier(ec_pub_pem);
    char *p = claims_with("");
    char *hs = make_token(SIGN_HS, SECRET, HDR_HS, p);
    char *rs = make_token(SIGN_RS, rsa_key, HDR_RS, p);
    char *es = make_token(SIGN_ES, ec_key, HDR_ES, p);
    /* The classic attack: HMAC keyed with the verifier's public key PEM. */
    char *conf = make_token(SIGN_HS, rsa_pub_pem, HDR_HS, p);
    char *hs512 = make_token(SIGN_HS, SECRET, "{\"alg\":\"HS512\"}", p);
    expect_verify(rv, hs, AUTH_EALG);
    expect_verify(rv, conf, AUTH_EALG);
    expect_verify(rv, es, AUTH_EALG);
    expect_verify(ev, rs, AUTH_EALG);
    expect_verify(ev, hs, AUTH_EALG);
    expect_verify(hv, rs, AUTH_EALG);
    expect_verify(hv, es, AUTH_EALG);
    expect_verify(hv, hs512, AUTH_EALG);
    free(hs);
    free(rs);
    free(es);
    free(conf);
    free(hs512);
    free(p);
    auth_verifier_free(hv);
    auth_verifier_free(rv);
    auth_verifier_free(ev);
}

static void test_header_rules(void **state) {
    (void)state;
    char *p = claims_with("");
    auth_verifier *v = hs_verifier(NULL);
    char *crit = make_token(SIGN_HS, SECRET, "{\"alg\":\"HS256\",\"crit\":[\"exp\"],\"exp\":1}", p);
    char *dup = make_token(SIGN_HS, SECRET, "{\"alg\":\"HS256\",\"alg\":\"HS256\"}", p);
    char *noalg = make_token(SIGN_HS, SECRET, "{\"typ\":\"JWT\"}", p);
    char *notjson = make_token(SIGN_HS, SECRET, "{\"alg\":\"HS256\"", p);
    char *numalg = make_token(SIGN_HS, SECRET, "{\"alg\":256}", p);
    expect_verify(v, crit, AUTH_EMALFORMED);
    expect_verify(v, dup, AUTH_EMALFORMED);
    expect_verify(v, noalg, AUTH_EMALFORMED);
    expect_verify(v, notjson, AUTH_EMALFORMED);
    expect_verify(v, numalg, AUTH_EMALFORMED);
    free(crit);
    free(dup);
    free(noalg);
    free(notjson);
    free(numalg);
    free(p);
    auth_verifier_free(v);
}

/* ---- signatures ---- */

static void test_bad_signatures(void **state) {
    (void)state;
    auth_verifier *hv = hs_verifier(NULL), *rv = pem_verifier(rsa_pub_pem),
                  *ev = pem_verifier(ec_pub_pem);
    char *p = claims_with("");
    char *forged = claims_with(",\"x\":1");
    struct {
        sign_kind k;
        const void *key;
        const char *hdr;
        auth_verifier *v;
    } cases[] = {
        {SIGN_HS, SECRET, HDR_HS, hv}, {SIGN_RS, NULL, HDR_RS, rv}, {SIGN_ES, NULL, HDR_ES, ev}};
    cases[1].key = rsa_key;
    cases[2].key = ec_key;
    for (size_t i = 0; i < 3; i++) {
        char *tok = make_token(cases[i].k, cases[i].key, cases[i].hdr, p);
        expect_verify(cases[i].v, tok, AUTH_OK);
        /* Flip one signature character (not the last, whose low bits may be padding). */
        char *bad = strdup(tok);
        char *sig = strrchr(bad, '.') + 1;
        sig[3] = sig[3] == 'A' ? 'B' : 'A';
        expect_verify(cases[i].v, bad, AUTH_ESIG);
        /* Tampered payload: another payload under the original signature. */
        char *other = make_token(cases[i].k, cases[i].key, cases[i].hdr, forged);
        char *mix = fmt("%.*s%s", (int)(strrchr(other, '.') - other), other, strrchr(tok, '.'));
        expect_verify(cases[i].v, mix, AUTH_ESIG);
        /* A signature missing its last 8 bytes (canonically encoded). */
        char *d2 = strrchr(tok, '.');
        unsigned char raw[1024];
        size_t rl = b64u_dec(d2 + 1, strlen(d2 + 1), raw);
        char *shortsig = malloc(strlen(tok) + 1);
        memcpy(shortsig, tok, (size_t)(d2 - tok) + 1);
        b64u(raw, rl - 8, shortsig + (d2 - tok) + 1);
        expect_verify(cases[i].v, shortsig, AUTH_ESIG);
        free(tok);
        free(bad);
        free(other);
        free(mix);
        free(shortsig);
    }
    /* Signed with another secret / another key pair. */
    char *t = make_token(SIGN_HS, OTHER_SECRET, HDR_HS, p);
    expect_verify(hv, t, AUTH_ESIG);
    free(t);
    EVP_PKEY *ec2 = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-256");
    t = make_token(SIGN_ES, ec2, HDR_ES, p);
    expect_verify(ev, t, AUTH_ESIG);
    free(t);
    EVP_PKEY_free(ec2);
    free(p);
    free(forged);
    auth_verifier_free(hv);
    auth_verifier_free(rv);
    auth_verifier_free(ev);
}

static void test_malformed(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier(NULL);
    char *p = claims_with("");
    char *tok = make_token(SIGN_HS, SECRET, HDR_HS, p);
    char *four = fmt("%s.abc", tok);
    char *padded = fmt("%s=", tok);
    char *spaced = strdup(tok);
    spaced[5] = ' ';
    char *two = strdup(tok);
    *strrchr(two, '.') = '\0';
    char *notobj = make_token(SIGN_HS, SECRET, HDR_HS, "[1,2]");
    char *notjson = make_token(SIGN_HS, SECRET, HDR_HS, "{\"sub\":");
    char *dupclaim = claims_with(",\"sub\":\"admin\"");
    char *dup = make_token(SIGN_HS, SECRET, HDR_HS, dupclaim);
    expect_verify(v, "", AUTH_EMALFORMED);
    expect_verify(v, "abc", AUTH_EMALFORMED);
    expect_verify(v, "..", AUTH_EMALFORMED);
    expect_verify(v, four, AUTH_EMALFORMED);
    expect_verify(v, padded, AUTH_EMALFORMED);
    expect_verify(v, spaced, AUTH_EMALFORMED);
    expect_verify(v, two, AUTH_EMALFORMED);
    expect_verify(v, notobj, AUTH_EMALFORMED);
    expect_verify(v, notjson, AUTH_EMALFORMED);
    expect_verify(v, dup, AUTH_EMALFORMED);
    free(tok);
    free(four);
    free(padded);
    free(spaced);
    free(two);
    free(notobj);
    free(notjson);
    free(dupclaim);
    free(dup);
    free(p);
    auth_verifier_free(v);
}

static void test_token_size_limit(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier(NULL);
    /* Grow a claim until the signed token crosses 8 KiB: the last one under verifies. */
    char pad[8192];
    size_t n = 5000;
    char *tok = NULL;
    for (;; n += 1) {
        memset(pad, 'x', n);
        pad[n] = '\0';
        char *tail = fmt(",\"pad\":\"%s\"", pad);
        char *p = claims_with(tail);
        free(tail);
        char *t = make_token(SIGN_HS, SECRET, HDR_HS, p);
        free(p);
        if (strlen(t) > 8192) {
            expect_verify(v, t, AUTH_EMALFORMED);
            free(t);
            break;
        }
        free(tok);
        tok = t;
    }
    assert_true(strlen(tok) <= 8192);
    expect_verify(v, tok, AUTH_OK);
    free(tok);
    auth_verifier_free(v);
}

/* ---- claims ---- */

static void test_times(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier(NULL);
    struct {
        long long exp_off;
        const char *nbf;
        long long nbf_off;
        int want;
    } cases[] = {
        {-100, NULL, 0, AUTH_EEXPIRED}, /* beyond the 30 s leeway */
        {-30, NULL, 0, AUTH_EEXPIRED},  /* exactly at exp + leeway */
        {-10, NULL, 0, AUTH_OK},        /* within leeway */
        {600, "nbf", 100, AUTH_ENOTYET}, {600, "nbf", 10, AUTH_OK}, {600, "nbf", -10, AUTH_OK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char nbf[64] = "";
        if (cases[i].nbf)
            snprintf(nbf, sizeof nbf, ",\"nbf\":%lld", (long long)now + cases[i].nbf_off);
        char *p = fmt("{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"" AUD
                      "\",\"exp\":%lld%s}",
                      (long long)now + cases[i].exp_off, nbf);
        char *t = make_token(SIGN_HS, SECRET, HDR_HS, p);
        expect_verify(v, t, cases[i].want);
        free(t);
        free(p);
    }
    /* exp is required and must be a number. */
    expect_hs("{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"" AUD "\"}", AUTH_ECLAIMS);
    expect_hs("{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"" AUD
              "\",\"exp\":\"tomorrow\"}",
              AUTH_EMALFORMED);
    auth_verifier_free(v);
}

static void test_audience(void **state) {
    (void)state;
    const char *base = "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"exp\":%lld%s}";
    struct {
        const char *aud;
        int want;
    } cases[] = {
        {",\"aud\":\"" AUD "\"", AUTH_OK},
        {",\"aud\":[\"other\",\"" AUD "\"]", AUTH_OK},
        {",\"aud\":\"other\"", AUTH_EAUD},
        {",\"aud\":\"Upsquad\"", AUTH_EAUD},
        {",\"aud\":[\"other\",\"more\"]", AUTH_EAUD},
        {",\"aud\":[]", AUTH_EAUD},
        {"", AUTH_EAUD},
        {",\"aud\":[\"" AUD "\",7]", AUTH_EMALFORMED},
        {",\"aud\":7", AUTH_EMALFORMED},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *p = fmt(base, (long long)now + 60, cases[i].aud);
        expect_hs(p, cases[i].want);
        free(p);
    }
}

static void test_issuer(void **state) {
    (void)state;
    auth_verifier *with = hs_verifier("https://gateway.upsquad"), *without = hs_verifier(NULL);
    struct {
        const char *tail;
        int want_with, want_without;
    } cases[] = {
        {",\"iss\":\"https://gateway.upsquad\"", AUTH_OK, AUTH_OK},
        {",\"iss\":\"https://evil\"", AUTH_EISS, AUTH_OK},
        {"", AUTH_EISS, AUTH_OK},
    };
    for (size_t i = 0; i < 3; i++) {
        char *p = claims_with(cases[i].tail);
        char *t = make_token(SIGN_HS, SECRET, HDR_HS, p);
        expect_verify(with, t, cases[i].want_with);
        expect_verify(without, t, cases[i].want_without);
        free(t);
        free(p);
    }
    auth_verifier_free(with);
    auth_verifier_free(without);
}

static void test_identity_claims(void **state) {
    (void)state;
    const char *base = "{\"aud\":\"" AUD "\",\"exp\":%lld%s}";
    char long_id[200], max_id[200];
    memset(long_id, 'i', AUTH_ID_MAX);
    long_id[AUTH_ID_MAX] = '\0'; /* 128 bytes: one too many */
    memset(max_id, 'i', AUTH_ID_MAX - 1);
    max_id[AUTH_ID_MAX - 1] = '\0';
    char *long_sub = fmt(",\"sub\":\"%s\",\"org_id\":\"o\",\"clearance\":1", long_id);
    char *max_sub = fmt(",\"sub\":\"%s\",\"org_id\":\"o\",\"clearance\":1", max_id);
    char *long_org = fmt(",\"sub\":\"s\",\"org_id\":\"%s\",\"clearance\":1", long_id);
    char *long_team =
        fmt(",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":1,\"teams\":[\"%s\"]", long_id);
    struct {
        const char *tail;
        int want;
    } cases[] = {
        {",\"org_id\":\"o\",\"clearance\":1", AUTH_ECLAIMS},              /* no sub */
        {",\"sub\":\"s\",\"clearance\":1", AUTH_ECLAIMS},                 /* no org_id */
        {",\"sub\":\"\",\"org_id\":\"o\",\"clearance\":1", AUTH_ECLAIMS}, /* empty sub */
        {",\"sub\":12,\"org_id\":\"o\",\"clearance\":1", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":null,\"clearance\":1", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":\"o\"", AUTH_ECLAIMS}, /* no clearance */
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":0", AUTH_ECLAIMS},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":6", AUTH_ECLAIMS},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":-1", AUTH_ECLAIMS},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":2.5", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":\"3\"", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":true", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":5", AUTH_OK},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":1,\"teams\":\"t\"", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":1,\"teams\":[\"t\",3]", AUTH_EMALFORMED},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":1,\"teams\":[\"\"]", AUTH_ECLAIMS},
        {",\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":1,\"teams\":[]", AUTH_OK},
        {long_sub, AUTH_ECLAIMS},
        {long_org, AUTH_ECLAIMS},
        {long_team, AUTH_ECLAIMS},
        {max_sub, AUTH_OK},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *p = fmt(base, (long long)now + 60, cases[i].tail);
        expect_hs(p, cases[i].want);
        free(p);
    }
    free(long_sub);
    free(max_sub);
    free(long_org);
    free(long_team);
}

static void test_team_count(void **state) {
    (void)state;
    for (int n = AUTH_MAX_TEAMS; n <= AUTH_MAX_TEAMS + 1; n++) {
        char teams[2048] = ",\"teams\":[";
        for (int i = 0; i < n; i++)
            snprintf(teams + strlen(teams), sizeof teams - strlen(teams), "%s\"team-%d\"",
                     i ? "," : "", i);
        strcat(teams, "]");
        char *p = fmt("{\"sub\":\"s\",\"org_id\":\"o\",\"clearance\":2,\"aud\":\"" AUD
                      "\",\"exp\":%lld%s}",
                      (long long)now + 60, teams);
        auth_verifier *v = hs_verifier(NULL);
        char *t = make_token(SIGN_HS, SECRET, HDR_HS, p);
        auth_identity id;
        char err[256];
        int rc = auth_verify(v, t, strlen(t), now, &id, err, sizeof err);
        if (n == AUTH_MAX_TEAMS) {
            assert_int_equal(rc, AUTH_OK);
            assert_int_equal(id.n_teams, AUTH_MAX_TEAMS);
            assert_string_equal(id.teams[AUTH_MAX_TEAMS - 1], "team-31");
        } else {
            assert_int_equal(rc, AUTH_ECLAIMS);
        }
        free(t);
        free(p);
        auth_verifier_free(v);
    }
}

/* ---- configuration and minting ---- */

static void test_verifier_config(void **state) {
    (void)state;
    auth_verifier *v = NULL;
    char err[256];
    EVP_PKEY *small = EVP_PKEY_Q_keygen(NULL, NULL, "RSA", (size_t)1024);
    EVP_PKEY *p384 = EVP_PKEY_Q_keygen(NULL, NULL, "EC", "P-384");
    char *small_pem = pem_public(small), *p384_pem = pem_public(p384);
    auth_config bad[] = {
        {.hs256_secret = SECRET, .public_key_pem = rsa_pub_pem, .audience = AUD},
        {.audience = AUD},
        {.hs256_secret = "short", .audience = AUD},
        {.hs256_secret = SECRET},
        {.hs256_secret = SECRET, .audience = AUD, .leeway_s = -1},
        {.public_key_pem = "-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n",
         .audience = AUD},
        {.public_key_pem = small_pem, .audience = AUD},
        {.public_key_pem = p384_pem, .audience = AUD},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = '\0';
        assert_int_equal(auth_verifier_new(&bad[i], &v, err, sizeof err), AUTH_ECONFIG);
        assert_true(strlen(err) > 0);
        assert_null(strstr(err, SECRET));
    }
    EVP_PKEY_free(small);
    EVP_PKEY_free(p384);
    free(small_pem);
    free(p384_pem);
}

static void test_signer_rules(void **state) {
    (void)state;
    auth_signer *s = NULL;
    char err[256], *tok = NULL;
    assert_int_equal(auth_signer_new("RS256", ec_priv_pem, &s, err, sizeof err), AUTH_EALG);
    assert_int_equal(auth_signer_new("ES256", rsa_priv_pem, &s, err, sizeof err), AUTH_EALG);
    assert_int_equal(auth_signer_new("none", SECRET, &s, err, sizeof err), AUTH_EALG);
    assert_int_equal(auth_signer_new("HS256", "short", &s, err, sizeof err), AUTH_ECONFIG);
    assert_int_equal(auth_signer_new("RS256", rsa_pub_pem, &s, err, sizeof err), AUTH_ECONFIG);
    assert_int_equal(auth_signer_new("HS256", SECRET, &s, err, sizeof err), AUTH_OK);

    auth_claims bad[] = {
        {.sub = "s", .org_id = "o", .audience = AUD, .clearance = 0, .ttl_s = 60},
        {.sub = "s", .org_id = "o", .audience = AUD, .clearance = 6, .ttl_s = 60},
        {.sub = "", .org_id = "o", .audience = AUD, .clearance = 1, .ttl_s = 60},
        {.sub = "s", .org_id = NULL, .audience = AUD, .clearance = 1, .ttl_s = 60},
        {.sub = "s", .org_id = "o", .audience = NULL, .clearance = 1, .ttl_s = 60},
        {.sub = "s", .org_id = "o", .audience = AUD, .clearance = 1, .ttl_s = 0},
        {.sub = "s",
         .org_id = "o",
         .audience = AUD,
         .clearance = 1,
         .ttl_s = 60,
         .n_teams = AUTH_MAX_TEAMS + 1},
        {.sub = "s",
         .org_id = "o",
         .audience = AUD,
         .clearance = 1,
         .ttl_s = 60,
         .extra_json = "{\"sub\":\"admin\"}"},
        {.sub = "s",
         .org_id = "o",
         .audience = AUD,
         .clearance = 1,
         .ttl_s = 60,
         .extra_json = "[1]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_int_equal(auth_mint(s, &bad[i], &tok, err, sizeof err), AUTH_ECLAIMS);
        assert_null(tok);
    }

    /* extra_json members land in the payload next to the identity claims; iat 0 = now. */
    auth_claims c = {.sub = "agent:9",
                     .org_id = "o",
                     .audience = AUD,
                     .issuer = "orchestrator",
                     .clearance = 2,
                     .ttl_s = 120,
                     .extra_json = "{\"scope\":\"agent-gateway\",\"sid\":\"s-1\"}"};
    assert_int_equal(auth_mint(s, &c, &tok, err, sizeof err), AUTH_OK);
    const char *d1 = strchr(tok, '.'), *d2 = strrchr(tok, '.');
    unsigned char body[1024];
    size_t bl = b64u_dec(d1 + 1, (size_t)(d2 - d1 - 1), body);
    body[bl] = '\0';
    cJSON *pj = cJSON_Parse((const char *)body);
    assert_non_null(pj);
    assert_string_equal(cJSON_GetObjectItem(pj, "scope")->valuestring, "agent-gateway");
    assert_string_equal(cJSON_GetObjectItem(pj, "sid")->valuestring, "s-1");
    assert_string_equal(cJSON_GetObjectItem(pj, "iss")->valuestring, "orchestrator");
    double iat = cJSON_GetObjectItem(pj, "iat")->valuedouble;
    assert_true(iat >= (double)now && iat <= (double)time(NULL));
    assert_true(cJSON_GetObjectItem(pj, "exp")->valuedouble == iat + 120);
    cJSON_Delete(pj);
    /* the token was minted with the real clock, later than the suite's `now` by the time the
     * suite took (long under valgrind): verify at the real time, or its iat reads as future */
    now = (int64_t)time(NULL);
    auth_verifier *v = hs_verifier("orchestrator");
    expect_verify(v, tok, AUTH_OK);
    auth_verifier_free(v);
    free(tok);
    auth_signer_free(s);
    assert_string_equal(auth_strerror(AUTH_ESIG), "bad signature");
}

/* One verifier shared by several threads (as the RPC layer shares it) gives the same
 * answers as alone. */
typedef struct {
    auth_verifier *v;
    const char *good, *bad;
    int ok, refused;
} verify_job;

static void *verify_worker(void *arg) {
    verify_job *j = arg;
    auth_identity id;
    char err[128];
    for (int i = 0; i < 300; i++) {
        j->ok += auth_verify(j->v, j->good, strlen(j->good), now, &id, err, sizeof err) == AUTH_OK;
        j->refused +=
            auth_verify(j->v, j->bad, strlen(j->bad), now, &id, err, sizeof err) == AUTH_ESIG;
    }
    return NULL;
}

static void test_concurrent_verify(void **state) {
    (void)state;
    auth_verifier *rv = pem_verifier(rsa_pub_pem), *ev = pem_verifier(ec_pub_pem);
    char *p = claims_with("");
    char *other = claims_with(",\"x\":2");
    char *rs = make_token(SIGN_RS, rsa_key, HDR_RS, p);
    char *es = make_token(SIGN_ES, ec_key, HDR_ES, p);
    char *rs_o = make_token(SIGN_RS, rsa_key, HDR_RS, other);
    char *es_o = make_token(SIGN_ES, ec_key, HDR_ES, other);
    /* Bad tokens: the other payload under the good token's signature. */
    char *rs_bad = fmt("%.*s%s", (int)(strrchr(rs_o, '.') - rs_o), rs_o, strrchr(rs, '.'));
    char *es_bad = fmt("%.*s%s", (int)(strrchr(es_o, '.') - es_o), es_o, strrchr(es, '.'));
    verify_job jobs[4] = {{rv, rs, rs_bad, 0, 0},
                          {ev, es, es_bad, 0, 0},
                          {rv, rs, rs_bad, 0, 0},
                          {ev, es, es_bad, 0, 0}};
    pthread_t th[4];
    for (int i = 0; i < 4; i++)
        pthread_create(&th[i], NULL, verify_worker, &jobs[i]);
    for (int i = 0; i < 4; i++)
        pthread_join(th[i], NULL);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(jobs[i].ok, 300);
        assert_int_equal(jobs[i].refused, 300);
    }
    free(p);
    free(other);
    free(rs);
    free(es);
    free(rs_o);
    free(es_o);
    free(rs_bad);
    free(es_bad);
    auth_verifier_free(rv);
    auth_verifier_free(ev);
}

/* ---- strictness (issue: a signed token must mean exactly one thing) ---- */

/* Tokens correctly signed, each with one defect the verifier used to overlook: a NUL inside a
 * string compared as a C string, bytes after the JSON, an `iat` in the future. */
static void test_strict_segments(void **state) {
    (void)state;
    auth_verifier *v = hs_verifier("gw"), *plain = hs_verifier(NULL);
    long long n = (long long)now;
    struct {
        const char *header, *payload_fmt;
        int want;
    } cases[] = {
        /* the reference: accepted */
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\",\"iss\":\"gw\","
         "\"iat\":%lld,\"exp\":%lld}",
         AUTH_OK},
        /* trailing whitespace is still JSON */
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\",\"iss\":\"gw\","
         "\"iat\":%lld,\"exp\":%lld} \n",
         AUTH_OK},
        /* NUL in alg, aud, iss, sub, org_id, teams */
        {"{\"alg\":\"HS256\\u0000x\",\"typ\":\"JWT\"}",
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\",\"iss\":\"gw\","
         "\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\\u0000evil\","
         "\"iss\":\"gw\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":[\"upsquad\\u0000x\"],"
         "\"iss\":\"gw\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\","
         "\"iss\":\"gw\\u0000x\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\\u0000admin\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\","
         "\"iss\":\"gw\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\\u0000other\",\"clearance\":1,\"aud\":\"upsquad\","
         "\"iss\":\"gw\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"teams\":[\"t\\u0000x\"],"
         "\"aud\":\"upsquad\",\"iss\":\"gw\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
        /* an escaped backslash followed by u0000 is text, not a NUL */
        {HDR_HS,
         "{\"sub\":\"m\\\\u0000\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\","
         "\"iss\":\"gw\",\"iat\":%lld,\"exp\":%lld}",
         AUTH_OK},
        /* characters after the JSON, in the payload and in the header */
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\",\"iss\":\"gw\","
         "\"iat\":%lld,\"exp\":%lld}{\"org_id\":\"other\"}",
         AUTH_EMALFORMED},
        {HDR_HS,
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\",\"iss\":\"gw\","
         "\"iat\":%lld,\"exp\":%lld}x",
         AUTH_EMALFORMED},
        {HDR_HS "x",
         "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\",\"iss\":\"gw\","
         "\"iat\":%lld,\"exp\":%lld}",
         AUTH_EMALFORMED},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *p = fmt(cases[i].payload_fmt, n, n + 600);
        char *t = make_token(SIGN_HS, SECRET, cases[i].header, p);
        expect_verify(v, t, cases[i].want);
        free(t);
        free(p);
    }
    /* bytes that are not UTF-8 anywhere in a segment (RFC 7519 7.2: the JOSE header and the
     * claims set are UTF-8): unknown and nested claims, member names, the header; overlongs
     * and surrogates too. Well-formed multi-byte text is accepted. */
    static const char *const claims = "{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,"
                                      "\"aud\":\"upsquad\",\"iss\":\"gw\",\"iat\":%lld,"
                                      "\"exp\":%lld,";
    struct {
        const char *header, *extra;
        int want;
    } utf8[] = {
        {HDR_HS, "\"name\":\"Zo\xc3\xab \xe6\x97\xa5\xf0\x9f\x98\x80\"}", AUTH_OK},
        {HDR_HS, "\"name\":\"\xff\"}", AUTH_EMALFORMED},
        {HDR_HS, "\"x\":{\"y\":[\"ok\",\"\xc3\"]}}", AUTH_EMALFORMED},
        {HDR_HS, "\"k\xfe\":1}", AUTH_EMALFORMED},
        {HDR_HS, "\"name\":\"\xc0\xaf\"}", AUTH_EMALFORMED},     /* overlong "/" */
        {HDR_HS, "\"name\":\"\xed\xa0\x80\"}", AUTH_EMALFORMED}, /* a surrogate */
        {HDR_HS, "\"name\":\"\\ud800\"}", AUTH_EMALFORMED},      /* a lone escaped one */
        {"{\"alg\":\"HS256\",\"typ\":\"JWT\",\"kid\":\"\x80\"}", "\"n\":1}", AUTH_EMALFORMED},
    };
    for (size_t i = 0; i < sizeof utf8 / sizeof utf8[0]; i++) {
        char *f = fmt("%s%s", claims, utf8[i].extra);
        char *p = fmt(f, n, n + 600);
        char *t = make_token(SIGN_HS, SECRET, utf8[i].header, p);
        expect_verify(v, t, utf8[i].want);
        free(t);
        free(p);
        free(f);
    }
    /* iat: within the leeway accepted, beyond it refused; absent is fine */
    struct {
        long long iat_off;
        int want;
    } times[] = {
        {0, AUTH_OK}, {-3600, AUTH_OK}, {20, AUTH_OK}, {31, AUTH_ENOTYET}, {86400, AUTH_ENOTYET}};
    for (size_t i = 0; i < sizeof times / sizeof times[0]; i++) {
        char *p = fmt("{\"sub\":\"m\",\"org_id\":\"o\",\"clearance\":1,\"aud\":\"upsquad\","
                      "\"iat\":%lld,\"exp\":%lld}",
                      n + times[i].iat_off, n + 100000);
        char *t = make_token(SIGN_HS, SECRET, HDR_HS, p);
        expect_verify(plain, t, times[i].want);
        free(t);
        free(p);
    }
    auth_verifier_free(v);
    auth_verifier_free(plain);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hs256_roundtrip), cmocka_unit_test(test_rs256_roundtrip),
        cmocka_unit_test(test_es256_roundtrip), cmocka_unit_test(test_independent_tokens),
        cmocka_unit_test(test_bearer),          cmocka_unit_test(test_certificate_key),
        cmocka_unit_test(test_alg_none),        cmocka_unit_test(test_alg_confusion),
        cmocka_unit_test(test_header_rules),    cmocka_unit_test(test_bad_signatures),
        cmocka_unit_test(test_malformed),       cmocka_unit_test(test_token_size_limit),
        cmocka_unit_test(test_times),           cmocka_unit_test(test_audience),
        cmocka_unit_test(test_issuer),          cmocka_unit_test(test_identity_claims),
        cmocka_unit_test(test_team_count),      cmocka_unit_test(test_verifier_config),
        cmocka_unit_test(test_signer_rules),    cmocka_unit_test(test_concurrent_verify),
        cmocka_unit_test(test_strict_segments),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
