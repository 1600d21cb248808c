/* See util.h. */
#include "util.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int util_errf(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
    }
    return code;
}

size_t util_utf8_len(const unsigned char *s, size_t n) {
    unsigned c = s[0], min;
    size_t len;
    if (c < 0x80) return 1;
    if ((c & 0xE0) == 0xC0) {
        len = 2, min = 0x80, c &= 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
        len = 3, min = 0x800, c &= 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
        len = 4, min = 0x10000, c &= 0x07;
    } else {
        return 0;
    }
    if (len > n) return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80) return 0;
        c = (c << 6) | (s[i] & 0x3F);
    }
    if (c < min || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
    return len;
}

int util_utf8_valid(const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    size_t n = strlen(str);
    while (n > 0) {
        size_t len = util_utf8_len(s, n);
        if (len == 0) return 0;
        s += len;
        n -= len;
    }
    return 1;
}
