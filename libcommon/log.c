/* JSON-lines logger. Each line is built in one stack buffer of LOG__LINE_MAX bytes and
 * written with a single write(2): on Linux a pipe write of at most PIPE_BUF (4096) bytes is
 * atomic, so lines from concurrent threads and processes sharing stderr never interleave.
 * A message that does not fit is cut on a UTF-8 character boundary and ends with "…". */
#include "log.h"
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

#define LOG__LINE_MAX 4096
#define LOG__SVC_MAX 64
#define LOG__TRACE_MAX 65 /* 64 chars + NUL */
#define LOG__EVENT_MAX 128

int log__level = LOG_INFO;

static char log__svc[LOG__SVC_MAX] = "";
static _Thread_local char log__trace[LOG__TRACE_MAX];
static _Thread_local char log__ids[LOG_ID_N][LOG__TRACE_MAX];
static const char *const log__id_names[LOG_ID_N] = {"org_id", "run_id", "session_id"};

static const char *const log__names[] = {"debug", "info", "warn", "error", "off"};

void log_init(const char *service, int level) {
    snprintf(log__svc, sizeof log__svc, "%s", service ? service : "");
    log__level = (level >= LOG_DEBUG && level <= LOG_OFF) ? level : LOG_INFO;
}

int log_init_env(const char *service) {
    const char *s = getenv("UPSQUAD_LOG_LEVEL");
    int level = (s && *s) ? log_level_parse(s) : LOG_INFO;
    log_init(service, level < 0 ? LOG_INFO : level);
    return level < 0 ? -1 : 0;
}

int log_level_parse(const char *s) {
    if (!s) return -1;
    for (int i = LOG_DEBUG; i <= LOG_OFF; i++)
        if (strcasecmp(s, log__names[i]) == 0) return i;
    if (strcasecmp(s, "warning") == 0) return LOG_WARN;
    return -1;
}

void log_set_trace(const char *trace_id) {
    if (!trace_id) {
        log__trace[0] = '\0';
        return;
    }
    snprintf(log__trace, sizeof log__trace, "%s", trace_id);
}

const char *log_get_trace(void) {
    return log__trace[0] ? log__trace : NULL;
}

void log_set_id(int which, const char *id) {
    if (which < 0 || which >= LOG_ID_N) return;
    snprintf(log__ids[which], sizeof log__ids[which], "%s", id ? id : "");
}

const char *log_get_id(int which) {
    return which >= 0 && which < LOG_ID_N && log__ids[which][0] ? log__ids[which] : NULL;
}

void log_clear_ids(void) {
    for (int i = 0; i < LOG_ID_N; i++)
        log__ids[i][0] = '\0';
}

/* Appends the JSON-escaped form of s[0..n) to buf at *pos without passing cap. Invalid UTF-8
 * becomes U+FFFD so that every line is valid JSON. Returns 1 when everything fit, 0 when it
 * stopped early (always on a character boundary). */
static int log__escape(char *buf, size_t *pos, size_t cap, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *u = (const unsigned char *)s;
    size_t p = *pos, i = 0;
    int ok = 1;
    while (i < n) {
        char tmp[8];
        const char *out = tmp;
        size_t outlen, adv = 1;
        unsigned c = u[i];
        if (c == '"' || c == '\\') {
            tmp[0] = '\\', tmp[1] = (char)c, outlen = 2;
        } else if (c == '\n') {
            memcpy(tmp, "\\n", 2), outlen = 2;
        } else if (c == '\r') {
            memcpy(tmp, "\\r", 2), outlen = 2;
        } else if (c == '\t') {
            memcpy(tmp, "\\t", 2), outlen = 2;
        } else if (c < 0x20 || c == 0x7F) {
            memcpy(tmp, "\\u00", 4);
            tmp[4] = hex[c >> 4], tmp[5] = hex[c & 15], outlen = 6;
        } else if (c < 0x80) {
            tmp[0] = (char)c, outlen = 1;
        } else {
            adv = util_utf8_len(u + i, n - i);
            if (adv == 0) {
                adv = 1, out = "\xEF\xBF\xBD", outlen = 3;
            } else {
                out = s + i, outlen = adv;
            }
        }
        if (p + outlen > cap) {
            ok = 0;
            break;
        }
        memcpy(buf + p, out, outlen);
        p += outlen;
        i += adv;
    }
    *pos = p;
    return ok;
}

static void log__append(char *buf, size_t *pos, size_t cap, const char *lit) {
    size_t n = strlen(lit);
    if (*pos + n > cap) n = cap - *pos;
    memcpy(buf + *pos, lit, n);
    *pos += n;
}

static size_t log__timestamp(char *out, size_t len) {
    struct timespec ts;
    struct tm tm;
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n =
        snprintf(out, len, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ", tm.tm_year + 1900, tm.tm_mon + 1,
                 tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L);
    return n < 0 ? 0 : ((size_t)n < len ? (size_t)n : len - 1);
}

static void log__write_all(const char *buf, size_t len) {
    while (len > 0) {
        ssize_t w = write(STDERR_FILENO, buf, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return; /* nowhere left to report a failing stderr */
        }
        buf += w;
        len -= (size_t)w;
    }
}

void log_vwrite(int level, const char *event, const char *fmt, va_list ap) {
    /* Tail reserved after msg: the ellipsis (3 bytes) and "\"}\n". */
    static const char ellipsis[] = "\xE2\x80\xA6";
    const size_t tail = 3 + 3;
    char line[LOG__LINE_MAX];
    char msg[LOG__LINE_MAX];
    char ts[40];
    size_t pos = 0, cap = sizeof line - tail;
    if (level < LOG_DEBUG || level >= LOG_OFF || level < log__level) return;

    int n = vsnprintf(msg, sizeof msg, fmt ? fmt : "", ap);
    size_t msglen = n < 0 ? 0 : ((size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    int cut = n < 0 || (size_t)n >= sizeof msg;

    size_t tslen = log__timestamp(ts, sizeof ts);
    log__append(line, &pos, cap, "{\"ts\":\"");
    log__escape(line, &pos, cap, ts, tslen);
    log__append(line, &pos, cap, "\",\"level\":\"");
    log__append(line, &pos, cap, log__names[level]);
    log__append(line, &pos, cap, "\",\"svc\":\"");
    log__escape(line, &pos, cap, log__svc, strlen(log__svc));
    log__append(line, &pos, cap, "\",\"event\":\"");
    const char *ev = event ? event : "";
    log__escape(line, &pos, cap, ev, strnlen(ev, LOG__EVENT_MAX));
    if (log__trace[0]) {
        log__append(line, &pos, cap, "\",\"trace_id\":\"");
        log__escape(line, &pos, cap, log__trace, strlen(log__trace));
    }
    for (int i = 0; i < LOG_ID_N; i++) {
        if (!log__ids[i][0]) continue;
        log__append(line, &pos, cap, "\",\"");
        log__append(line, &pos, cap, log__id_names[i]);
        log__append(line, &pos, cap, "\":\"");
        log__escape(line, &pos, cap, log__ids[i], strlen(log__ids[i]));
    }
    log__append(line, &pos, cap, "\",\"msg\":\"");
    if (!log__escape(line, &pos, cap, msg, msglen)) cut = 1;
    if (cut) {
        memcpy(line + pos, ellipsis, 3);
        pos += 3;
    }
    memcpy(line + pos, "\"}\n", 3);
    pos += 3;
    log__write_all(line, pos);
}

void log_write(int level, const char *event, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    log_vwrite(level, event, fmt, ap);
    va_end(ap);
}
