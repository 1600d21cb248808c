/* The one redaction rule of node data (redaction.h). */
#include "redaction.h"

#include <ctype.h>
#include <string.h>

int redact_floor(const char *c) {
    if (!c || !c[0]) return 2; /* unknown: internal */
    if (!strcmp(c, "public")) return 0;
    if (!strcmp(c, "confidential")) return 3;
    if (!strcmp(c, "restricted")) return 4;
    return 2; /* internal */
}

int redact_sensitive_key(const char *k) {
    static const char *const words[] = {"password", "secret",        "token",      "api_key",
                                        "apikey",   "authorization", "credential", "private_key"};
    char low[128];
    size_t i = 0;
    if (!k) return 0;
    for (; k[i] && i < sizeof low - 1; i++)
        low[i] = (char)tolower((unsigned char)k[i]);
    low[i] = 0;
    for (size_t w = 0; w < sizeof words / sizeof words[0]; w++)
        if (strstr(low, words[w])) return 1;
    return 0;
}

int redact_visible(int clearance, int floor, redact_kind kind, const char *key) {
    switch (kind) {
    case REDACT_STRUCTURAL:
        return 1;
    case REDACT_PAYLOAD:
        if (clearance < floor) return 0;
        return clearance >= REDACT_FREE_TEXT_CLEARANCE || !redact_sensitive_key(key);
    case REDACT_FREE_TEXT:
        return clearance >= floor && clearance >= REDACT_FREE_TEXT_CLEARANCE;
    }
    return 0;
}
