/* See util.h. */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int util_errf(char *err, size_t errlen, int code, const char *fmt, ...) {
    if (err && errlen) {
        va_list ap;
        va_start(ap, fmt);
        int n = vsnprintf(err, errlen, fmt, ap);
        va_end(ap);
        /* a message cut short ends on a character boundary: it may become a gRPC status */
        if (n >= 0 && (size_t)n >= errlen) err[util_utf8_cut(err, errlen - 1)] = '\0';
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

size_t util_utf8_check(const void *str, size_t n) {
    const unsigned char *s = str;
    size_t i = 0;
    while (i < n) {
        if (s[i] < 0x80) { /* the common case: ASCII runs */
            i++;
            continue;
        }
        size_t len = util_utf8_len(s + i, n - i);
        if (len == 0) return i;
        i += len;
    }
    return n;
}

int util_utf8_valid(const char *s) {
    size_t n = strlen(s);
    return util_utf8_check(s, n) == n;
}

size_t util_utf8_cut(const char *str, size_t maxbytes) {
    const unsigned char *s = (const unsigned char *)str;
    size_t n = strnlen(str, maxbytes), lead = n;
    /* the last character must be whole: find its lead byte (at most 3 continuation bytes back)
     * and cut before it when its sequence runs past n (cut by maxbytes, or by a buffer) */
    while (lead > 0 && n - lead < 4 && (s[lead - 1] & 0xC0) == 0x80)
        lead--;
    if (lead == 0 || n - lead >= 4) return n; /* not UTF-8 there: nothing to keep whole */
    lead--;
    unsigned c = s[lead];
    size_t len = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : 4;
    return lead + len > n ? lead : n;
}

int util_read_file(const char *path, size_t max, char **out, size_t *len, char *err,
                   size_t errlen) {
    char *buf = NULL;
    size_t n = 0, cap = 0;
    int fd = open(path ? path : "", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return util_errf(err, errlen, -1, "cannot open %s: %s", path, strerror(errno));
    for (;;) {
        if (n == cap) { /* grow; one byte more than max tells a file that is too large */
            size_t ncap = cap ? cap * 2 : 4096;
            if (ncap > max + 1) ncap = max + 1;
            if (ncap <= n) {
                util_errf(err, errlen, -1, "%s: larger than %zu bytes", path, max);
                goto fail;
            }
            char *nb = realloc(buf, ncap + 1);
            if (nb == NULL) {
                util_errf(err, errlen, -1, "%s: out of memory", path);
                goto fail;
            }
            buf = nb, cap = ncap;
        }
        ssize_t r = read(fd, buf + n, cap - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) {
            util_errf(err, errlen, -1, "cannot read %s: %s", path, strerror(errno));
            goto fail;
        }
        if (r == 0) break;
        n += (size_t)r;
        if (n > max) {
            util_errf(err, errlen, -1, "%s: larger than %zu bytes", path, max);
            goto fail;
        }
    }
    close(fd);
    if (buf == NULL && (buf = malloc(1)) == NULL)
        return util_errf(err, errlen, -1, "%s: out of memory", path);
    buf[n] = 0;
    *out = buf;
    if (len) *len = n;
    return 0;
fail:
    close(fd);
    free(buf);
    return -1;
}

const char *util_json_object_end(const char *s) {
    int depth = 0, in_str = 0;
    for (const char *p = s; *p; p++) {
        if (in_str) {
            if (*p == '\\' && p[1])
                p++;
            else if (*p == '"')
                in_str = 0;
        } else if (*p == '"') {
            in_str = 1;
        } else if (*p == '{') {
            depth++;
        } else if (*p == '}' && --depth == 0) {
            return p + 1;
        }
    }
    return NULL;
}

uint64_t util_fnv1a(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 1099511628211ULL;
    return h;
}

int util_cond_init_monotonic(pthread_cond_t *cv) {
    pthread_condattr_t ca;
    int rc = pthread_condattr_init(&ca);
    if (rc) return rc;
    rc = pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (!rc) rc = pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
    return rc;
}

void util_deadline(struct timespec *ts, int64_t ms) {
    if (ms < 0) ms = 0;
    clock_gettime(CLOCK_MONOTONIC, ts);
    ts->tv_sec += (time_t)(ms / 1000);
    ts->tv_nsec += (long)(ms % 1000) * 1000000L;
    if (ts->tv_nsec >= 1000000000L) {
        ts->tv_sec++;
        ts->tv_nsec -= 1000000000L;
    }
}

int64_t util_mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000 + ts.tv_nsec / 1000;
}

int64_t util_mono_ms(void) {
    return util_mono_us() / 1000;
}
