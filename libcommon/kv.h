/* Redis on hiredis: short-lived keyed state that may be lost without harm (liveness keys,
 * de-duplication windows, rate limits, replay buffers).
 *
 * Threading: a kv is one connection and is NOT thread-safe. Use one kv per thread (handler
 * threads open theirs lazily); pipelines are per-connection state, which this keeps simple
 * and lock-free.
 *
 * Failures and reconnects: any I/O error, timeout or protocol error closes the connection
 * (its state is unknown: a late reply could be read as the answer to the next command); the
 * next call reconnects. A command is retried once, on a fresh connection, only when running
 * it twice cannot change its effect or its reply: reads (GET, MGET, EXISTS, TTL, HGETALL,
 * ...), plain SET/SETEX/PSETEX/MSET (without NX, XX or GET), EXPIRE/PEXPIRE without options,
 * PING. Everything else (INCR, SET NX, DEL, EVAL, ...) fails with KV_EIO and the caller
 * decides: the command may or may not have run.
 *
 * Bounds: every command waits at most the timeout given to kv_connect; a pipeline holds at
 * most KV_PIPELINE_MAX commands not yet read (kv_pipeline_append then fails with KV_EFULL).
 *
 * Errors: functions return KV_OK (0) or a negative KV_E*; the message is kept in the kv and
 * read with kv_errstr() (valid until the next call on that kv). */
#ifndef UPSQUAD_KV_H
#define UPSQUAD_KV_H

#include <stddef.h>
#include <hiredis/hiredis.h>

enum {
    KV_OK = 0,
    KV_EIO = -301,    /* connection failed, lost or timed out */
    KV_EREPLY = -302, /* Redis answered with an error reply */
    KV_EINVAL = -303, /* bad argument, or call out of order (pipeline) */
    KV_ENOMEM = -304,
    KV_EFULL = -305, /* pipeline bound reached */
};

#define KV_PIPELINE_MAX 65536

typedef struct kv kv;

/* url: redis://[[user]:password@]host[:port][/db] (port 6379, db 0 by default).
 * timeout_ms bounds the connect and every command (> 0). Connects now.
 * On success *out is owned by the caller: kv_close. */
int kv_connect(const char *url, int timeout_ms, kv **out, char *err, size_t errlen);
void kv_close(kv *k);
const char *kv_errstr(kv *k);

/* One command, hiredis format ("SET %s %b", key, val, len). On success *out (non-NULL) is
 * the reply, owned by the caller (freeReplyObject); an error reply is KV_EREPLY. */
int kv_command(kv *k, redisReply **out, const char *fmt, ...);
int kv_commandargv(kv *k, redisReply **out, int argc, const char **argv, const size_t *argvlen);

/* Pipelining: append commands, then read exactly one reply per command, in order, with
 * kv_pipeline_get (KV_EREPLY for an error reply, after which the next reply can be read).
 * No other command may run on this kv while replies are pending. On KV_EIO the remaining
 * replies are lost and the pipeline is empty. */
int kv_pipeline_append(kv *k, const char *fmt, ...);
int kv_pipeline_appendargv(kv *k, int argc, const char **argv, const size_t *argvlen);
int kv_pipeline_get(kv *k, redisReply **out);
int kv_pipeline_pending(kv *k);

/* SET key value PX ttl_ms (ttl_ms > 0). Retried once on a lost connection. */
int kv_set_ttl(kv *k, const char *key, const void *val, size_t len, int ttl_ms);
/* GET: *found 0 when the key does not exist (then *val NULL); otherwise *val (NUL-terminated,
 * *len bytes) is owned by the caller (free). */
int kv_get(kv *k, const char *key, char **val, size_t *len, int *found);
/* DEL: *deleted (NULL ok) is 1 when the key existed. */
int kv_del(kv *k, const char *key, int *deleted);
/* De-duplication window: SET key value NX PX ttl_ms. *was_set 1 when this call created the
 * key (first sighting), 0 when it already existed (a duplicate within the window). */
int kv_set_nx_ttl(kv *k, const char *key, const void *val, size_t len, int ttl_ms, int *was_set);
/* Fixed-window counter (rate limits): atomically increments key and, when it has no expiry
 * yet, expires it window_ms later. *count is the value after the increment. */
int kv_incr_window(kv *k, const char *key, int window_ms, long long *count);

#endif
