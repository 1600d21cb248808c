/* Small helpers every module needs once. */
#ifndef UPSQUAD_UTIL_H
#define UPSQUAD_UTIL_H

#include <stddef.h>

/* Formats into err (when err && errlen) and returns code: `return util_errf(err, n, -1, ...)`
 * attaches the message where the failure happens. */
int util_errf(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Length of the well-formed UTF-8 sequence at s (at most n bytes), or 0 when the bytes are not
 * valid UTF-8 (overlongs, surrogates and code points above U+10FFFF included). */
size_t util_utf8_len(const unsigned char *s, size_t n);

/* 1 when the NUL-terminated string is valid UTF-8. */
int util_utf8_valid(const char *s);

#endif
