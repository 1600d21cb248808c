/* Small helpers every module needs once. */
#ifndef UPSQUAD_UTIL_H
#define UPSQUAD_UTIL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

/* Formats into err (when err && errlen) and returns code: `return util_errf(err, n, -1, ...)`
 * attaches the message where the failure happens. */
int util_errf(char *err, size_t errlen, int code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Length of the well-formed UTF-8 sequence at s (at most n bytes), or 0 when the bytes are not
 * valid UTF-8 (overlongs, surrogates and code points above U+10FFFF included). */
size_t util_utf8_len(const unsigned char *s, size_t n);

/* Offset of the first byte of s[0..n) that does not start a well-formed UTF-8 sequence, or n
 * when all of it is valid UTF-8 (NUL bytes are valid UTF-8; callers that refuse them check). */
size_t util_utf8_check(const void *s, size_t n);

/* 1 when the NUL-terminated string is valid UTF-8 (util_utf8_check over its bytes). */
int util_utf8_valid(const char *s);

/* The longest prefix of the NUL-terminated string s that is at most maxbytes long and does not
 * split a UTF-8 character: every string a service truncates is cut here, so what it sends stays
 * valid UTF-8 (proto3 `string` fields must be; clients refuse the response otherwise). */
size_t util_utf8_cut(const char *s, size_t maxbytes);

/* Reads the whole file at path into a NUL-terminated buffer (*out, caller frees; *len its length
 * without the NUL, len may be NULL). A file larger than max bytes is refused. 0, or -1 with err
 * naming the path and the reason. */
int util_read_file(const char *path, size_t max, char **out, size_t *len, char *err, size_t errlen);

/* The end (one past its '}') of the balanced JSON object starting at s ('{'), strings and
 * escapes respected; NULL when it does not close. For JSON embedded in free text. */
const char *util_json_object_end(const char *s);

/* FNV-1a (64-bit) of n bytes, continuing from h: UTIL_FNV1A_INIT starts a hash. Hash keys of
 * caches and tables; not a checksum against an adversary. */
#define UTIL_FNV1A_INIT 14695981039346656037ULL
uint64_t util_fnv1a(uint64_t h, const void *p, size_t n);

/* Timed waits. Every timed condition wait in the tree runs on CLOCK_MONOTONIC, so a step of
 * the wall clock (NTP, an operator) neither cuts a delay short nor stretches it:
 * util_cond_init_monotonic() makes such a condition variable (0, or the pthread error), and
 * util_deadline() the absolute time, ms from now on that clock, that pthread_cond_timedwait
 * takes (ms < 0 counts as 0). */
int util_cond_init_monotonic(pthread_cond_t *cv);
void util_deadline(struct timespec *ts, int64_t ms);

/* Now on CLOCK_MONOTONIC, in milliseconds / microseconds: for measuring and bounding time spent
 * (never a wall-clock time). */
int64_t util_mono_ms(void);
int64_t util_mono_us(void);

#endif
