/* Redis client (see kv.h). */
#include "kv.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/time.h>

#include "log.h"

#define KV_ARGS_MAX 16 /* arguments inspected to classify a command */

struct kv {
    redisContext *c; /* NULL after a failure, until the next call reconnects */
    char host[256];
    int port;
    char user[128];
    char pass[256];
    int db;
    struct timeval tv;
    int pending; /* pipelined commands whose replies were not read */
    char err[256];
};

typedef struct kv__arg {
    const char *p;
    size_t n;
} kv__arg;

const char *kv_errstr(kv *k) {
    return k ? k->err : "";
}

static int kv__fail(kv *k, int rc, const char *what, const char *detail) {
    snprintf(k->err, sizeof k->err, "%s: %s", what, detail && *detail ? detail : "error");
    return rc;
}

/* Drops a connection whose state is unknown; the next call reconnects. */
static void kv__drop(kv *k) {
    if (k->c) redisFree(k->c);
    k->c = NULL;
    k->pending = 0;
}

/* ---- url ---- */

static int kv__parse_url(kv *k, const char *url) {
    const char *p = url;
    if (strncmp(p, "redis://", 8) != 0) return -1;
    p += 8;
    const char *at = strchr(p, '@');
    if (at) {
        const char *colon = memchr(p, ':', (size_t)(at - p));
        if (!colon) return -1;
        if ((size_t)(colon - p) >= sizeof k->user || (size_t)(at - colon - 1) >= sizeof k->pass)
            return -1;
        memcpy(k->user, p, (size_t)(colon - p));
        memcpy(k->pass, colon + 1, (size_t)(at - colon - 1));
        p = at + 1;
    }
    size_t hl = strcspn(p, ":/");
    if (hl == 0 || hl >= sizeof k->host) return -1;
    memcpy(k->host, p, hl);
    p += hl;
    k->port = 6379;
    if (*p == ':') {
        char *end;
        long port = strtol(p + 1, &end, 10);
        if (end == p + 1 || port < 1 || port > 65535) return -1;
        k->port = (int)port;
        p = end;
    }
    if (*p == '/' && p[1]) {
        char *end;
        long db = strtol(p + 1, &end, 10);
        if (*end || db < 0 || db > 1000) return -1;
        k->db = (int)db;
    } else if (*p && strcmp(p, "/") != 0) {
        return -1;
    }
    return 0;
}

/* ---- connection ---- */

static int kv__simple(kv *k, redisReply *r, const char *what) {
    int rc = KV_OK;
    if (!r) {
        rc = kv__fail(k, KV_EIO, what, k->c->errstr);
    } else if (r->type == REDIS_REPLY_ERROR) {
        rc = kv__fail(k, KV_EREPLY, what, r->str);
    }
    freeReplyObject(r);
    return rc;
}

static int kv__connect(kv *k) {
    redisContext *c = redisConnectWithTimeout(k->host, k->port, k->tv);
    if (!c) return kv__fail(k, KV_ENOMEM, "connect", "out of memory");
    if (c->err) {
        snprintf(k->err, sizeof k->err, "connect %.100s:%d: %.100s", k->host, k->port, c->errstr);
        redisFree(c);
        return KV_EIO;
    }
    k->c = c;
    int rc =
        redisSetTimeout(c, k->tv) == REDIS_OK ? KV_OK : kv__fail(k, KV_EIO, "timeout", c->errstr);
    if (rc == KV_OK) redisEnableKeepAlive(c);
    if (rc == KV_OK && k->pass[0]) {
        redisReply *r = k->user[0] ? redisCommand(c, "AUTH %s %s", k->user, k->pass)
                                   : redisCommand(c, "AUTH %s", k->pass);
        rc = kv__simple(k, r, "AUTH");
    }
    if (rc == KV_OK && k->db) rc = kv__simple(k, redisCommand(c, "SELECT %d", k->db), "SELECT");
    if (rc != KV_OK) kv__drop(k);
    return rc;
}

int kv_connect(const char *url, int timeout_ms, kv **out, char *err, size_t errlen) {
    *out = NULL;
    kv *k = calloc(1, sizeof *k);
    if (!k) {
        snprintf(err, errlen, "out of memory");
        return KV_ENOMEM;
    }
    if (!url || timeout_ms <= 0 || kv__parse_url(k, url) != 0) {
        /* the url may carry a password: never echoed */
        snprintf(err, errlen,
                 "kv_connect: bad url (want redis://[user:password@]host[:port][/db]) "
                 "or timeout");
        free(k);
        return KV_EINVAL;
    }
    k->tv.tv_sec = timeout_ms / 1000;
    k->tv.tv_usec = (timeout_ms % 1000) * 1000;
    int rc = kv__connect(k);
    if (rc != KV_OK) {
        snprintf(err, errlen, "%s", k->err);
        free(k);
        return rc;
    }
    *out = k;
    return KV_OK;
}

void kv_close(kv *k) {
    if (!k) return;
    kv__drop(k);
    memset(k->pass, 0, sizeof k->pass);
    free(k);
}

/* ---- classification ---- */

/* Splits a formatted RESP command ("*N\r\n$L\r\narg\r\n...") into at most max arguments. */
static int kv__args(const char *cmd, size_t len, kv__arg *args, int max) {
    const char *p = cmd, *end = cmd + len;
    if (p >= end || *p != '*') return 0;
    long n = strtol(p + 1, NULL, 10);
    p = memchr(p, '\n', (size_t)(end - p));
    int got = 0;
    while (p && ++p < end && got < n && got < max) {
        if (*p != '$') break;
        long l = strtol(p + 1, NULL, 10);
        p = memchr(p, '\n', (size_t)(end - p));
        if (!p || l < 0 || p + 1 + l + 2 > end) break;
        args[got].p = p + 1;
        args[got].n = (size_t)l;
        got++;
        p += 1 + l + 1; /* the \r\n after the argument: p at '\n' */
    }
    return got;
}

static int kv__is(const kv__arg *a, const char *name) {
    return a->n == strlen(name) && strncasecmp(a->p, name, a->n) == 0;
}

/* 1 when running the command twice leaves the same effect and the same reply. */
static int kv__retryable(const char *cmd, size_t len) {
    static const char *const same_twice[] = {
        "GET",      "MGET",          "EXISTS",    "TTL",     "PTTL",     "TYPE",      "STRLEN",
        "GETRANGE", "HGET",          "HMGET",     "HGETALL", "HEXISTS",  "HLEN",      "HKEYS",
        "HVALS",    "LRANGE",        "LLEN",      "LINDEX",  "SMEMBERS", "SISMEMBER", "SCARD",
        "ZRANGE",   "ZRANGEBYSCORE", "ZREVRANGE", "ZSCORE",  "ZCARD",    "ZCOUNT",    "ZRANK",
        "XRANGE",   "XREVRANGE",     "XLEN",      "PING",    "ECHO",     "DBSIZE",    "TIME",
        "SETEX",    "PSETEX",        "MSET",
    };
    kv__arg a[KV_ARGS_MAX];
    int n = kv__args(cmd, len, a, KV_ARGS_MAX);
    if (n < 1) return 0;
    for (size_t i = 0; i < sizeof same_twice / sizeof same_twice[0]; i++)
        if (kv__is(&a[0], same_twice[i])) return 1;
    if (kv__is(&a[0], "EXPIRE") || kv__is(&a[0], "PEXPIRE")) return n == 3;
    if (kv__is(&a[0], "SET")) {
        if (n >= KV_ARGS_MAX) return 0;
        for (int i = 3; i < n; i++)
            if (kv__is(&a[i], "NX") || kv__is(&a[i], "XX") || kv__is(&a[i], "GET")) return 0;
        return 1;
    }
    return 0;
}

/* ---- commands ---- */

static int kv__ready(kv *k) {
    if (k->pending) return kv__fail(k, KV_EINVAL, "command", "pipeline replies pending");
    if (!k->c) return kv__connect(k);
    return KV_OK;
}

/* Sends one formatted command and reads its reply on the current connection. */
static int kv__roundtrip(kv *k, const char *cmd, size_t len, redisReply **out) {
    void *r = NULL;
    if (redisAppendFormattedCommand(k->c, cmd, len) != REDIS_OK ||
        redisGetReply(k->c, &r) != REDIS_OK) {
        int rc = kv__fail(k, KV_EIO, "command", k->c->errstr);
        kv__drop(k);
        return rc;
    }
    *out = r;
    return KV_OK;
}

/* Takes ownership of cmd (a command formatted by hiredis). */
static int kv__run(kv *k, char *cmd, long long len, redisReply **out) {
    redisReply *r = NULL;
    if (out) *out = NULL;
    if (len < 0 || !cmd) {
        if (cmd) redisFreeCommand(cmd);
        return kv__fail(k, KV_EINVAL, "command", "cannot format");
    }
    int rc = kv__ready(k);
    if (rc == KV_OK) rc = kv__roundtrip(k, cmd, (size_t)len, &r);
    if (rc == KV_EIO && kv__retryable(cmd, (size_t)len)) {
        log_info("kv.retry", "connection lost; retrying an idempotent command once");
        rc = kv__connect(k);
        if (rc == KV_OK) rc = kv__roundtrip(k, cmd, (size_t)len, &r);
    }
    redisFreeCommand(cmd);
    if (rc != KV_OK) return rc;
    if (r->type == REDIS_REPLY_ERROR) {
        rc = kv__fail(k, KV_EREPLY, "reply", r->str);
        freeReplyObject(r);
        return rc;
    }
    k->err[0] = '\0';
    if (out) {
        *out = r;
    } else {
        freeReplyObject(r);
    }
    return KV_OK;
}

static int kv__vcommand(kv *k, redisReply **out, const char *fmt, va_list ap) {
    char *cmd = NULL;
    int len = redisvFormatCommand(&cmd, fmt, ap);
    return kv__run(k, len < 0 ? NULL : cmd, len, out);
}

int kv_command(kv *k, redisReply **out, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = kv__vcommand(k, out, fmt, ap);
    va_end(ap);
    return rc;
}

int kv_commandargv(kv *k, redisReply **out, int argc, const char **argv, const size_t *argvlen) {
    if (argc < 1 || !argv) {
        if (out) *out = NULL;
        return kv__fail(k, KV_EINVAL, "command", "no arguments");
    }
    char *cmd = NULL;
    long long len = redisFormatCommandArgv(&cmd, argc, argv, argvlen);
    return kv__run(k, len < 0 ? NULL : cmd, len, out);
}

/* ---- pipelining ---- */

static int kv__pipe_ready(kv *k) {
    if (k->pending >= KV_PIPELINE_MAX) return kv__fail(k, KV_EFULL, "pipeline", "bound reached");
    if (!k->c) return kv__connect(k); /* only when nothing is pending: a drop empties it */
    return KV_OK;
}

int kv_pipeline_append(kv *k, const char *fmt, ...) {
    int rc = kv__pipe_ready(k);
    if (rc != KV_OK) return rc;
    va_list ap;
    va_start(ap, fmt);
    int st = redisvAppendCommand(k->c, fmt, ap);
    va_end(ap);
    if (st != REDIS_OK) return kv__fail(k, KV_EINVAL, "pipeline", "cannot format");
    k->pending++;
    return KV_OK;
}

int kv_pipeline_appendargv(kv *k, int argc, const char **argv, const size_t *argvlen) {
    if (argc < 1 || !argv) return kv__fail(k, KV_EINVAL, "pipeline", "no arguments");
    int rc = kv__pipe_ready(k);
    if (rc != KV_OK) return rc;
    if (redisAppendCommandArgv(k->c, argc, argv, argvlen) != REDIS_OK)
        return kv__fail(k, KV_ENOMEM, "pipeline", "cannot format");
    k->pending++;
    return KV_OK;
}

int kv_pipeline_get(kv *k, redisReply **out) {
    *out = NULL;
    if (k->pending == 0 || !k->c) return kv__fail(k, KV_EINVAL, "pipeline", "nothing pending");
    void *r = NULL;
    if (redisGetReply(k->c, &r) != REDIS_OK) {
        int rc = kv__fail(k, KV_EIO, "pipeline", k->c->errstr);
        kv__drop(k);
        return rc;
    }
    k->pending--;
    redisReply *rep = r;
    if (rep->type == REDIS_REPLY_ERROR) {
        int rc = kv__fail(k, KV_EREPLY, "reply", rep->str);
        freeReplyObject(rep);
        return rc;
    }
    *out = rep;
    return KV_OK;
}

int kv_pipeline_pending(kv *k) {
    return k->pending;
}

/* ---- conveniences ---- */

int kv_set_ttl(kv *k, const char *key, const void *val, size_t len, int ttl_ms) {
    if (!key || (!val && len) || ttl_ms <= 0)
        return kv__fail(k, KV_EINVAL, "SET", "bad key, value or ttl");
    return kv_command(k, NULL, "SET %s %b PX %d", key, val ? val : "", len, ttl_ms);
}

int kv_get(kv *k, const char *key, char **val, size_t *len, int *found) {
    *val = NULL;
    *found = 0;
    if (len) *len = 0;
    if (!key) return kv__fail(k, KV_EINVAL, "GET", "no key");
    redisReply *r = NULL;
    int rc = kv_command(k, &r, "GET %s", key);
    if (rc != KV_OK) return rc;
    if (r->type == REDIS_REPLY_STRING) {
        char *v = malloc(r->len + 1);
        if (!v) {
            freeReplyObject(r);
            return kv__fail(k, KV_ENOMEM, "GET", "out of memory");
        }
        memcpy(v, r->str, r->len);
        v[r->len] = '\0';
        *val = v;
        if (len) *len = r->len;
        *found = 1;
    } else if (r->type != REDIS_REPLY_NIL) {
        rc = kv__fail(k, KV_EREPLY, "GET", "unexpected reply type");
    }
    freeReplyObject(r);
    return rc;
}

int kv_del(kv *k, const char *key, int *deleted) {
    if (deleted) *deleted = 0;
    if (!key) return kv__fail(k, KV_EINVAL, "DEL", "no key");
    redisReply *r = NULL;
    int rc = kv_command(k, &r, "DEL %s", key);
    if (rc != KV_OK) return rc;
    if (deleted) *deleted = r->type == REDIS_REPLY_INTEGER && r->integer > 0;
    freeReplyObject(r);
    return KV_OK;
}

int kv_set_nx_ttl(kv *k, const char *key, const void *val, size_t len, int ttl_ms, int *was_set) {
    *was_set = 0;
    if (!key || (!val && len) || ttl_ms <= 0)
        return kv__fail(k, KV_EINVAL, "SET NX", "bad key, value or ttl");
    redisReply *r = NULL;
    int rc = kv_command(k, &r, "SET %s %b NX PX %d", key, val ? val : "", len, ttl_ms);
    if (rc != KV_OK) return rc;
    *was_set = r->type == REDIS_REPLY_STATUS;
    freeReplyObject(r);
    return KV_OK;
}

/* One script, so that the increment and the expiry are atomic: a counter can never be left
 * without a TTL (which would rate-limit its key forever). */
static const char kv__incr_script[] =
    "local n = redis.call('INCR', KEYS[1]) "
    "if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end "
    "return n";

int kv_incr_window(kv *k, const char *key, int window_ms, long long *count) {
    *count = 0;
    if (!key || window_ms <= 0) return kv__fail(k, KV_EINVAL, "INCR", "bad key or window");
    redisReply *r = NULL;
    int rc = kv_command(k, &r, "EVAL %s 1 %s %d", kv__incr_script, key, window_ms);
    if (rc != KV_OK) return rc;
    if (r->type == REDIS_REPLY_INTEGER) {
        *count = r->integer;
    } else {
        rc = kv__fail(k, KV_EREPLY, "INCR", "unexpected reply type");
    }
    freeReplyObject(r);
    return rc;
}
