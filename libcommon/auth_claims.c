/* See auth_claims.h. */
#include "auth_claims.h"

#include <openssl/evp.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define CLAIMS_MAX 65536 /* base64url characters of a payload we decode */

cJSON *auth_claims_decode(const char *tok) {
    const char *dot1 = tok ? strchr(tok, '.') : NULL, *dot2 = dot1 ? strchr(dot1 + 1, '.') : NULL;
    cJSON *out = NULL;
    if (!dot2) return NULL;
    size_t n = (size_t)(dot2 - dot1 - 1);
    if (n == 0 || n > CLAIMS_MAX) return NULL;
    char *b64 = malloc(n + 4), *raw = malloc(n + 4);
    if (b64 && raw) {
        for (size_t i = 0; i < n; i++) { /* base64url -> base64, padded */
            char c = dot1[1 + i];
            b64[i] = c == '-' ? '+' : c == '_' ? '/' : c;
        }
        size_t m = n, pad = 0;
        while (m % 4) {
            b64[m++] = '=';
            pad++;
        }
        /* EVP_DecodeBlock counts the padding as zero bytes */
        int len = EVP_DecodeBlock((unsigned char *)raw, (unsigned char *)b64, (int)m);
        if (len >= (int)pad) out = cJSON_ParseWithLength(raw, (size_t)len - pad);
    }
    free(b64);
    free(raw);
    if (out && !cJSON_IsObject(out)) {
        cJSON_Delete(out);
        out = NULL;
    }
    return out;
}

int auth_bearer_has_scope(const char *authorization, const char *scope) {
    const char *t = authorization;
    if (t == NULL || scope == NULL || !scope[0]) return 0;
    while (*t == ' ')
        t++;
    if (strncasecmp(t, "bearer ", 7) != 0) return 0;
    t += 7;
    while (*t == ' ')
        t++;
    cJSON *o = auth_claims_decode(t);
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(o, "scope"), *it;
    size_t sl = strlen(scope);
    int found = 0;
    if (cJSON_IsString(s)) {
        for (const char *p = s->valuestring; *p && !found;) {
            while (*p == ' ')
                p++;
            size_t wl = strcspn(p, " ");
            found = wl == sl && strncmp(p, scope, sl) == 0;
            p += wl;
        }
    } else if (cJSON_IsArray(s)) {
        cJSON_ArrayForEach(it, s) found |=
            cJSON_IsString(it) && strcmp(it->valuestring, scope) == 0;
    }
    cJSON_Delete(o);
    return found;
}
