/* NATS and JetStream client (see bus.h). */
#include "bus.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "ctx.h"
#include "log.h"
#include "util.h"

#define BUS_TOKEN_MAX 128
#define BUS_FETCH_MAX 256        /* messages per fetch */
#define BUS_FETCH_MORE_MS 5      /* a fetch's wait for a message behind the first */
#define BUS_MAX_ACK_PENDING 1024 /* unacked messages per pull consumer before it pauses */
#define BUS_CLOSE_WAIT_MS 5000   /* bound on waiting for nats.c's closed/complete callbacks */

struct bus {
    natsConnection *nc;
    jsCtx *js;
    bus_opts o;
    char name[64];
    atomic_ullong slow;
    /* set by the closed callback, the last one nats.c delivers for a connection */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int closed;
    /* bus_js_publish_batch: one batch at a time on the inbox subscription of its acks */
    pthread_mutex_t batch_mu;
    natsSubscription *acks; /* made by the first batch, "<ack_inbox>.*" */
    char ack_inbox[128];
    unsigned long long batch_gen;
};

struct bus_sub {
    bus *b;
    natsSubscription *sub;
    bus_msg_cb cb;
    void *ud;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int done; /* nats.c's on-complete callback ran: the message callback never runs again */
};

struct bus_pull {
    bus *b;
    natsSubscription *sub;
};

/* ---- errors ---- */

static int bus__code(natsStatus s) {
    switch (s) {
    case NATS_OK:
        return BUS_OK;
    case NATS_TIMEOUT:
        return BUS_ETIMEOUT;
    case NATS_NO_RESPONDERS:
        return BUS_ENORESP;
    case NATS_INSUFFICIENT_BUFFER:
        return BUS_EFULL;
    case NATS_CONNECTION_CLOSED:
        return BUS_ECLOSED;
    case NATS_NO_MEMORY:
        return BUS_ENOMEM;
    case NATS_INVALID_ARG:
    case NATS_INVALID_SUBJECT:
        return BUS_EINVAL;
    default:
        return BUS_ERR;
    }
}

/* Message from nats.c's thread-local last error, which carries the server's detail. */
static int bus__fail(char *err, size_t errlen, const char *what, natsStatus s, jsErrCode jerr) {
    if (err && errlen) {
        natsStatus ls;
        const char *detail = nats_GetLastError(&ls);
        if (!detail || !*detail) detail = natsStatus_GetText(s);
        if (jerr)
            snprintf(err, errlen, "%s: %s (JetStream error %d)", what, detail, (int)jerr);
        else
            snprintf(err, errlen, "%s: %s", what, detail);
    }
    return bus__code(s);
}

/* ---- connection ---- */

static atomic_int bus__delivery_threads = 2;

void bus_set_delivery_threads(int n) {
    if (n >= 0) atomic_store(&bus__delivery_threads, n);
}

void bus_opts_default(bus_opts *o) {
    memset(o, 0, sizeof *o);
    o->delivery_threads = atomic_load(&bus__delivery_threads);
    o->reconnect_wait_ms = 500;
    o->reconnect_buf_bytes = 8 << 20;
    o->sub_pending_msgs = 8192;
    o->sub_pending_bytes = 16 << 20;
    o->js_timeout_ms = 5000;
}

static void bus__on_disconnected(natsConnection *nc, void *closure) {
    (void)nc;
    bus *b = closure;
    log_warn("bus.disconnected",
             "%s: reconnecting every %d ms; publishes buffered up to %d bytes meanwhile", b->name,
             b->o.reconnect_wait_ms, b->o.reconnect_buf_bytes);
}

static void bus__on_reconnected(natsConnection *nc, void *closure) {
    bus *b = closure;
    char url[256] = "";
    natsConnection_GetConnectedUrl(nc, url, sizeof url);
    log_info("bus.reconnected", "%s: connected to %s", b->name, url);
}

static void bus__on_connected(natsConnection *nc, void *closure) {
    bus *b = closure;
    char url[256] = "";
    natsConnection_GetConnectedUrl(nc, url, sizeof url);
    log_info("bus.connected", "%s: connected to %s", b->name, url);
}

static void bus__on_closed(natsConnection *nc, void *closure) {
    (void)nc;
    bus *b = closure;
    pthread_mutex_lock(&b->mu);
    b->closed = 1;
    pthread_cond_broadcast(&b->cv);
    pthread_mutex_unlock(&b->mu);
}

static void bus__on_error(natsConnection *nc, natsSubscription *sub, natsStatus s, void *closure) {
    (void)nc;
    bus *b = closure;
    if (s == NATS_SLOW_CONSUMER && sub) {
        unsigned long long n = atomic_fetch_add(&b->slow, 1) + 1;
        int64_t dropped = 0;
        natsSubscription_GetDropped(sub, &dropped);
        log_warn("bus.slow_consumer",
                 "%s: subscription on %s is over its pending limit; newest messages dropped "
                 "(%lld so far, episode %llu)",
                 b->name, natsSubscription_GetSubject(sub), (long long)dropped, n);
        return;
    }
    log_warn("bus.async_error", "%s: %s", b->name, natsStatus_GetText(s));
}

static void bus__free(bus *b) {
    pthread_mutex_destroy(&b->batch_mu);
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
    free(b);
}

static int bus__options(const char *url, bus *b, natsOptions **out, char *err, size_t errlen) {
    natsOptions *o = NULL;
    natsStatus s = natsOptions_Create(&o);
    if (s == NATS_OK) s = natsOptions_SetURL(o, url);
    if (s == NATS_OK) s = natsOptions_SetName(o, b->name);
    if (s == NATS_OK) s = natsOptions_SetTimeout(o, 2000);
    if (s == NATS_OK) s = natsOptions_SetMaxReconnect(o, -1);
    if (s == NATS_OK) s = natsOptions_SetReconnectWait(o, b->o.reconnect_wait_ms);
    if (s == NATS_OK) s = natsOptions_SetReconnectJitter(o, 100, 1000);
    if (s == NATS_OK) s = natsOptions_SetReconnectBufSize(o, b->o.reconnect_buf_bytes);
    if (s == NATS_OK) s = natsOptions_SetMaxPendingMsgs(o, b->o.sub_pending_msgs);
    /* a half-open TCP connection is detected within ~30 s */
    if (s == NATS_OK) s = natsOptions_SetPingInterval(o, 10000);
    if (s == NATS_OK) s = natsOptions_SetMaxPingsOut(o, 3);
    if (s == NATS_OK) s = natsOptions_SetDisconnectedCB(o, bus__on_disconnected, b);
    if (s == NATS_OK) s = natsOptions_SetReconnectedCB(o, bus__on_reconnected, b);
    if (s == NATS_OK) s = natsOptions_SetClosedCB(o, bus__on_closed, b);
    if (s == NATS_OK) s = natsOptions_SetErrorHandler(o, bus__on_error, b);
    /* callbacks on the shared pool: a few threads for any number of subscriptions, order kept
     * per subscription (bus.h) */
    if (s == NATS_OK && b->o.delivery_threads > 0)
        s = nats_SetMessageDeliveryPoolSize(b->o.delivery_threads);
    if (s == NATS_OK && b->o.delivery_threads > 0)
        s = natsOptions_UseGlobalMessageDelivery(o, true);
    if (s == NATS_OK && b->o.connect_retry)
        s = natsOptions_SetRetryOnFailedConnect(o, true, bus__on_connected, b);
    if (s != NATS_OK) {
        natsOptions_Destroy(o);
        return bus__fail(err, errlen, "nats options", s, 0);
    }
    *out = o;
    return BUS_OK;
}

int bus_connect_ex(const char *url, const char *name, const bus_opts *opts, bus **out, char *err,
                   size_t errlen) {
    *out = NULL;
    bus_opts o;
    if (opts) {
        o = *opts;
    } else {
        bus_opts_default(&o);
    }
    if (!url || !*url || o.reconnect_wait_ms < 1 || o.reconnect_buf_bytes < 0 ||
        o.sub_pending_msgs < 1 || o.sub_pending_bytes < 1 || o.js_timeout_ms < 1 ||
        o.delivery_threads < 0 || o.delivery_threads > 1024) {
        snprintf(err, errlen, "bus_connect: bad url or options");
        return BUS_EINVAL;
    }
    bus *b = calloc(1, sizeof *b);
    if (!b) {
        snprintf(err, errlen, "out of memory");
        return BUS_ENOMEM;
    }
    b->o = o;
    snprintf(b->name, sizeof b->name, "%s", name && *name ? name : "upsquad");
    pthread_mutex_init(&b->mu, NULL);
    pthread_mutex_init(&b->batch_mu, NULL);
    util_cond_init_monotonic(&b->cv);
    natsOptions *no = NULL;
    int rc = bus__options(url, b, &no, err, errlen);
    if (rc != BUS_OK) {
        bus__free(b);
        return rc;
    }
    natsStatus s = natsConnection_Connect(&b->nc, no);
    natsOptions_Destroy(no);
    if (s == NATS_NOT_YET_CONNECTED) s = NATS_OK; /* connect_retry: continues in background */
    if (s != NATS_OK) {
        rc = bus__fail(err, errlen, "nats connect", s, 0);
        bus__free(b); /* no connection: no callback can follow */
        return rc;
    }
    jsOptions jo;
    jsOptions_Init(&jo);
    jo.Wait = o.js_timeout_ms;
    s = natsConnection_JetStream(&b->js, b->nc, &jo);
    if (s != NATS_OK) {
        rc = bus__fail(err, errlen, "jetstream context", s, 0);
        bus_close(b);
        return rc;
    }
    *out = b;
    return BUS_OK;
}

int bus_connect(const char *url, const char *name, bus **out, char *err, size_t errlen) {
    return bus_connect_ex(url, name, NULL, out, err, errlen);
}

/* Waits (bounded) for flag to become 1 under mu. 1 when it did. */
static int bus__wait_flag(pthread_mutex_t *mu, pthread_cond_t *cv, int *flag) {
    struct timespec dl;
    util_deadline(&dl, BUS_CLOSE_WAIT_MS);
    pthread_mutex_lock(mu);
    while (!*flag)
        if (pthread_cond_timedwait(cv, mu, &dl) == ETIMEDOUT) break;
    int ok = *flag;
    pthread_mutex_unlock(mu);
    return ok;
}

void bus_close(bus *b) {
    if (!b) return;
    if (natsConnection_Status(b->nc) == NATS_CONN_STATUS_CONNECTED)
        natsConnection_FlushTimeout(b->nc, 1000);
    natsConnection_Close(b->nc);
    natsSubscription_Destroy(b->acks);
    b->acks = NULL;
    int closed = bus__wait_flag(&b->mu, &b->cv, &b->closed);
    jsCtx_Destroy(b->js);
    natsConnection_Destroy(b->nc);
    if (!closed) {
        /* a late callback could still use b: keeping it is the safe side of the bound */
        log_error("bus.close", "%s: closed callback not seen within %d ms", b->name,
                  BUS_CLOSE_WAIT_MS);
        return;
    }
    bus__free(b);
}

void bus_library_shutdown(void) {
    nats_CloseAndWait(BUS_CLOSE_WAIT_MS);
}

int bus_connected(bus *b) {
    return b && natsConnection_Status(b->nc) == NATS_CONN_STATUS_CONNECTED;
}

int bus_flush(bus *b, int timeout_ms) {
    return bus__code(natsConnection_FlushTimeout(b->nc, timeout_ms));
}

void bus_get_stats(bus *b, bus_stats *out) {
    memset(out, 0, sizeof *out);
    natsStatistics *st = NULL;
    if (natsStatistics_Create(&st) == NATS_OK && natsConnection_GetStats(b->nc, st) == NATS_OK)
        natsStatistics_GetCounts(st, &out->in_msgs, NULL, &out->out_msgs, NULL, &out->reconnects);
    natsStatistics_Destroy(st);
    out->slow_consumer_events = atomic_load(&b->slow);
}

/* ---- subjects ---- */

int bus_token_valid(const char *t) {
    if (!t || !*t) return 0;
    size_t n = 0;
    for (const unsigned char *q = (const unsigned char *)t; *q; q++, n++) {
        if (n >= BUS_TOKEN_MAX) return 0;
        if (*q == '.' || *q == '*' || *q == '>' || *q <= ' ' || *q == 0x7f) return 0;
    }
    return 1;
}

int bus_subject(char *out, size_t outlen, const char *first, ...) {
    va_list ap;
    size_t len = 0;
    int rc = BUS_OK;
    if (!out || outlen == 0) return BUS_EINVAL;
    out[0] = '\0';
    va_start(ap, first);
    for (const char *t = first; t; t = va_arg(ap, const char *)) {
        size_t n = strlen(t);
        if (!bus_token_valid(t) || len + (len ? 1 : 0) + n + 1 > outlen) {
            rc = BUS_EINVAL;
            break;
        }
        if (len) out[len++] = '.';
        memcpy(out + len, t, n + 1);
        len += n;
    }
    va_end(ap);
    if (rc != BUS_OK || len == 0) {
        out[0] = '\0';
        return BUS_EINVAL;
    }
    return BUS_OK;
}

/* ---- trace context (W3C traceparent in the message headers) ---- */

static int bus__is_hex(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

/* "00-<trace id>-<span id>-01" for trace (NULL or "": this thread's trace id) when it is a W3C
 * one (32 lowercase hex, what rpc_server generates or takes from a traceparent); 0 otherwise
 * (no header). */
static int bus__traceparent_of(const char *t, char out[BUS_TRACEPARENT_LEN + 1]) {
    static _Thread_local uint64_t rng;
    static const char hex[] = "0123456789abcdef";
    if (!t || !t[0]) t = log_get_trace();
    if (!t || strlen(t) != 32 || !bus__is_hex(t, 32)) return 0;
    if (rng == 0) rng = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)&rng ^ 0x9e3779b97f4a7c15ull;
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    memcpy(out, "00-", 3);
    memcpy(out + 3, t, 32);
    out[35] = '-';
    for (int i = 0; i < 16; i++) /* the span: this publish (never all zero: rng != 0) */
        out[36 + i] = hex[(rng >> (4 * i)) & 15];
    memcpy(out + 52, "-01", 4);
    return 1;
}

static int bus__traceparent(char out[BUS_TRACEPARENT_LEN + 1]) {
    return bus__traceparent_of(NULL, out);
}

int bus_msg_trace(natsMsg *m, char out[33]) {
    const char *tp = NULL;
    out[0] = '\0';
    if (!m || natsMsgHeader_Get(m, "traceparent", &tp) != NATS_OK || !tp) return 0;
    /* version 00: 2-32-16-2 hex; a malformed header is ignored, never logged as given */
    if (strlen(tp) < BUS_TRACEPARENT_LEN || tp[2] != '-' || tp[35] != '-' ||
        !bus__is_hex(tp + 3, 32) || !strncmp(tp + 3, "00000000000000000000000000000000", 32))
        return 0;
    memcpy(out, tp + 3, 32);
    out[32] = '\0';
    return 1;
}

/* A message carrying this thread's trace (header) when there is one, else NULL. */
static natsStatus bus__traced_msg(natsMsg **m, const char *subject, const char *reply,
                                  const void *data, int len) {
    char tp[BUS_TRACEPARENT_LEN + 1];
    *m = NULL;
    if (!bus__traceparent(tp)) return NATS_OK;
    natsStatus s = natsMsg_Create(m, subject, reply, data, len);
    if (s == NATS_OK) s = natsMsgHeader_Set(*m, "traceparent", tp);
    if (s != NATS_OK) {
        natsMsg_Destroy(*m);
        *m = NULL;
    }
    return s;
}

/* ---- core ---- */

int bus_publish(bus *b, const char *subject, const void *data, int len) {
    natsMsg *m = NULL;
    if (!b || !subject || len < 0 || (len > 0 && !data)) return BUS_EINVAL;
    natsStatus s = bus__traced_msg(&m, subject, NULL, data, len);
    if (s == NATS_OK)
        s = m ? natsConnection_PublishMsg(b->nc, m)
              : natsConnection_Publish(b->nc, subject, data, len);
    natsMsg_Destroy(m);
    return bus__code(s);
}

int bus_request(bus *b, const char *subject, const void *data, int len, int timeout_ms,
                natsMsg **reply) {
    *reply = NULL;
    if (!b || !subject || len < 0 || timeout_ms < 1) return BUS_EINVAL;
    /* no longer than the caller of the handler this runs for waits (ctx.h) */
    int64_t left = ctx_deadline_ms();
    if (left <= 0) return BUS_ETIMEOUT;
    if (left < timeout_ms) timeout_ms = (int)left;
    return bus__code(natsConnection_Request(reply, b->nc, subject, data, len, timeout_ms));
}

int bus_respond(bus *b, natsMsg *request, const void *data, int len) {
    const char *to = request ? natsMsg_GetReply(request) : NULL;
    if (!b || !to || !*to || len < 0) return BUS_EINVAL;
    return bus__code(natsConnection_Publish(b->nc, to, data, len));
}

/* The subscription whose callback runs on this thread (bus_cb_pending). */
static _Thread_local natsSubscription *bus__cb_sub;

static void bus__on_msg(natsConnection *nc, natsSubscription *sub, natsMsg *msg, void *closure) {
    (void)nc;
    bus_sub *s = closure;
    char trace[33];
    /* the callback's lines (and the calls it makes) go on the publisher's trace */
    int traced = bus_msg_trace(msg, trace);
    if (traced) log_set_trace(trace);
    bus__cb_sub = sub;
    s->cb(s->b, msg, s->ud);
    bus__cb_sub = NULL;
    if (traced) log_set_trace(NULL);
    natsMsg_Destroy(msg);
}

int bus_cb_pending(void) {
    int n = 0;
    if (!bus__cb_sub || natsSubscription_GetPending(bus__cb_sub, &n, NULL) != NATS_OK) return 0;
    return n;
}

static void bus__on_sub_complete(void *closure) {
    bus_sub *s = closure;
    pthread_mutex_lock(&s->mu);
    s->done = 1;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

static void bus__sub_free(bus_sub *s) {
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* A subscription record before nats.c knows it (caller frees with bus__sub_free); NULL out of
 * memory, with err set. */
/* A subscription just made: its completion callback (so bus_unsubscribe can wait for the last
 * delivery) and the connection's pending limits. On failure it is taken apart and *out stays
 * NULL; on success *out = s. */
static int sub_arm(bus *b, bus_sub *s, const char *what, bus_sub **out, char *err, size_t errlen) {
    natsStatus st = natsSubscription_SetOnCompleteCB(s->sub, bus__on_sub_complete, s);
    if (st == NATS_OK)
        st = natsSubscription_SetPendingLimits(s->sub, b->o.sub_pending_msgs,
                                               b->o.sub_pending_bytes);
    if (st != NATS_OK) {
        int rc = bus__fail(err, errlen, what, st, 0);
        bus_unsubscribe(s); /* waits for the callback to be done with s, then frees it */
        return rc;
    }
    *out = s;
    return BUS_OK;
}

static bus_sub *sub_new(bus *b, bus_msg_cb cb, void *ud, char *err, size_t errlen) {
    bus_sub *s = calloc(1, sizeof *s);
    if (!s) {
        snprintf(err, errlen, "out of memory");
        return NULL;
    }
    s->b = b;
    s->cb = cb;
    s->ud = ud;
    pthread_mutex_init(&s->mu, NULL);
    util_cond_init_monotonic(&s->cv);
    return s;
}

int bus_subscribe(bus *b, const char *subject, const char *queue_group, bus_msg_cb cb, void *ud,
                  bus_sub **out, char *err, size_t errlen) {
    *out = NULL;
    if (!b || !subject || !*subject || !cb || (queue_group && !*queue_group)) {
        snprintf(err, errlen, "bus_subscribe: bad subject, queue group or callback");
        return BUS_EINVAL;
    }
    bus_sub *s = sub_new(b, cb, ud, err, errlen);
    if (!s) return BUS_ENOMEM;
    natsStatus st;
    if (queue_group)
        st = natsConnection_QueueSubscribe(&s->sub, b->nc, subject, queue_group, bus__on_msg, s);
    else
        st = natsConnection_Subscribe(&s->sub, b->nc, subject, bus__on_msg, s);
    if (st != NATS_OK) {
        int rc = bus__fail(err, errlen, "subscribe", st, 0);
        bus__sub_free(s); /* never subscribed: no callback can run */
        return rc;
    }
    return sub_arm(b, s, "subscribe", out, err, errlen);
}

void bus_unsubscribe(bus_sub *s) {
    if (!s) return;
    natsSubscription_Unsubscribe(s->sub);
    int done = bus__wait_flag(&s->mu, &s->cv, &s->done);
    natsSubscription_Destroy(s->sub);
    if (!done) {
        log_error("bus.unsubscribe", "callback still running after %d ms; not freed",
                  BUS_CLOSE_WAIT_MS);
        return;
    }
    bus__sub_free(s);
}

int bus_js_subscribe_ordered(bus *b, const char *stream, const char *subject, bus_msg_cb cb,
                             void *ud, bus_sub **out, char *err, size_t errlen) {
    *out = NULL;
    if (!b || !stream || !*stream || !subject || !*subject || !cb) {
        snprintf(err, errlen, "bus_js_subscribe_ordered: bad stream, subject or callback");
        return BUS_EINVAL;
    }
    bus_sub *s = sub_new(b, cb, ud, err, errlen);
    if (!s) return BUS_ENOMEM;
    jsSubOptions so;
    jsErrCode jerr = 0;
    jsSubOptions_Init(&so);
    so.Stream = stream;
    so.Ordered = true; /* nats.c recreates the consumer after the last delivered sequence */
    so.Config.DeliverPolicy = js_DeliverAll;
    natsStatus st = js_Subscribe(&s->sub, b->js, subject, bus__on_msg, s, NULL, &so, &jerr);
    if (st != NATS_OK) {
        int rc = bus__fail(err, errlen, "ordered subscribe", st, jerr);
        bus__sub_free(s); /* never subscribed: no callback can run */
        return rc;
    }
    return sub_arm(b, s, "ordered subscribe", out, err, errlen);
}

int bus_sub_caught_up(bus_sub *s) {
    jsConsumerInfo *ci = NULL;
    int queued = 0;
    if (!s || natsSubscription_GetConsumerInfo(&ci, s->sub, NULL, NULL) != NATS_OK) return 0;
    int ok = ci->NumPending == 0 && natsSubscription_GetPending(s->sub, &queued, NULL) == NATS_OK &&
             queued == 0;
    jsConsumerInfo_Destroy(ci);
    return ok;
}

int64_t bus_sub_dropped(bus_sub *s) {
    int64_t n = 0;
    natsSubscription_GetDropped(s->sub, &n);
    return n;
}

/* ---- JetStream ---- */

void bus_stream_limits_default(bus_stream_limits *l) {
    memset(l, 0, sizeof *l);
    l->replicas = 1;
    l->max_msgs = -1;
    l->max_bytes = 64LL << 20;
    l->duplicate_window_s = 120;
    l->memory = 0;
}

int bus_js_stream_ensure(bus *b, const char *name, const char *const *subjects, int nsubjects,
                         int retention, int64_t max_age_s, const bus_stream_limits *limits,
                         char *err, size_t errlen) {
    bus_stream_limits l;
    if (limits) {
        l = *limits;
    } else {
        bus_stream_limits_default(&l);
    }
    if (!b || !bus_token_valid(name) || !subjects || nsubjects < 1 || max_age_s < 0 ||
        retention < BUS_RETENTION_LIMITS || retention > BUS_RETENTION_INTEREST ||
        l.duplicate_window_s < 0 || l.replicas < 1 || l.replicas > 5) {
        snprintf(err, errlen, "bus_js_stream_ensure: bad name, subjects, retention or limits");
        return BUS_EINVAL;
    }
    jsStreamConfig cfg;
    jsStreamConfig_Init(&cfg);
    cfg.Name = name;
    cfg.Subjects = (const char **)subjects;
    cfg.SubjectsLen = nsubjects;
    cfg.Retention = retention == BUS_RETENTION_WORKQUEUE  ? js_WorkQueuePolicy
                    : retention == BUS_RETENTION_INTEREST ? js_InterestPolicy
                                                          : js_LimitsPolicy;
    cfg.MaxAge = max_age_s * 1000000000LL;
    cfg.MaxMsgs = l.max_msgs;
    cfg.MaxBytes = l.max_bytes;
    cfg.Duplicates = l.duplicate_window_s * 1000000000LL;
    cfg.Storage = l.memory ? js_MemoryStorage : js_FileStorage;
    cfg.Replicas = l.replicas;
    cfg.Discard = retention == BUS_RETENTION_LIMITS ? js_DiscardOld : js_DiscardNew;
    jsErrCode jerr = 0;
    jsStreamInfo *si = NULL;
    natsStatus s = js_AddStream(&si, b->js, &cfg, NULL, &jerr);
    if (s != NATS_OK && jerr == JSStreamNameExistErr) {
        jerr = 0;
        s = js_UpdateStream(&si, b->js, &cfg, NULL, &jerr);
    }
    jsStreamInfo_Destroy(si);
    if (s != NATS_OK) return bus__fail(err, errlen, "stream ensure", s, jerr);
    return BUS_OK;
}

int bus_js_stream_delete(bus *b, const char *name, char *err, size_t errlen) {
    jsErrCode jerr = 0;
    natsStatus s = js_DeleteStream(b->js, name, NULL, &jerr);
    if (s == NATS_OK || jerr == JSStreamNotFoundErr) return BUS_OK;
    return bus__fail(err, errlen, "stream delete", s, jerr);
}

int bus_js_stream_msgs(bus *b, const char *name, uint64_t *msgs, char *err, size_t errlen) {
    jsErrCode jerr = 0;
    jsStreamInfo *si = NULL;
    natsStatus s = js_GetStreamInfo(&si, b->js, name, NULL, &jerr);
    if (s != NATS_OK) return bus__fail(err, errlen, "stream info", s, jerr);
    *msgs = si->State.Msgs;
    jsStreamInfo_Destroy(si);
    return BUS_OK;
}

int bus_js_publish(bus *b, const char *subject, const void *data, int len, const char *msg_id,
                   int *duplicate, char *err, size_t errlen) {
    if (duplicate) *duplicate = 0;
    if (!b || !subject || len < 0 || (len > 0 && !data) || (msg_id && !*msg_id)) {
        snprintf(err, errlen, "bus_js_publish: bad subject, data or msg_id");
        return BUS_EINVAL;
    }
    jsPubOptions po;
    jsPubOptions_Init(&po);
    po.MsgId = msg_id;
    po.MaxWait = b->o.js_timeout_ms;
    jsPubAck *pa = NULL;
    jsErrCode jerr = 0;
    natsMsg *m = NULL;
    natsStatus s = bus__traced_msg(&m, subject, NULL, data, len);
    if (s == NATS_OK)
        s = m ? js_PublishMsg(&pa, b->js, m, &po, &jerr)
              : js_Publish(&pa, b->js, subject, data, len, &po, &jerr);
    natsMsg_Destroy(m);
    if (s != NATS_OK) {
        if (s == NATS_NO_RESPONDERS) {
            snprintf(err, errlen, "js publish %s: no stream captures this subject", subject);
            return BUS_ENORESP;
        }
        return bus__fail(err, errlen, "js publish", s, jerr);
    }
    if (duplicate) *duplicate = pa->Duplicate ? 1 : 0;
    jsPubAck_Destroy(pa);
    return BUS_OK;
}

int bus_js_pull_subscribe(bus *b, const char *stream, const char *durable,
                          const char *filter_subject, int ack_wait_ms, int max_deliver,
                          bus_pull **out, char *err, size_t errlen) {
    return bus_js_pull_subscribe_ex(b, stream, durable, filter_subject, ack_wait_ms, max_deliver, 0,
                                    out, err, errlen);
}

int bus_js_pull_subscribe_ex(bus *b, const char *stream, const char *durable,
                             const char *filter_subject, int ack_wait_ms, int max_deliver,
                             int deliver_new, bus_pull **out, char *err, size_t errlen) {
    *out = NULL;
    if (!b || !bus_token_valid(stream) || !bus_token_valid(durable) || !filter_subject ||
        !*filter_subject || ack_wait_ms < 1 || max_deliver == 0 || max_deliver < -1) {
        snprintf(err, errlen, "bus_js_pull_subscribe: bad stream, durable, filter or limits");
        return BUS_EINVAL;
    }
    /* The consumer is created explicitly and then bound to: nats.c deletes a consumer that
     * its subscribe call created when that subscription is unsubscribed, and this one's state
     * (acks, redeliveries) must outlive the process. */
    jsConsumerConfig cc;
    jsConsumerConfig_Init(&cc);
    cc.Durable = durable;
    cc.FilterSubject = filter_subject;
    cc.AckPolicy = js_AckExplicit;
    cc.AckWait = (int64_t)ack_wait_ms * 1000000LL;
    cc.MaxDeliver = max_deliver;
    cc.MaxAckPending = BUS_MAX_ACK_PENDING;
    if (deliver_new) cc.DeliverPolicy = js_DeliverNew;
    jsErrCode jerr = 0;
    jsConsumerInfo *ci = NULL;
    natsStatus s = js_AddConsumer(&ci, b->js, stream, &cc, NULL, &jerr);
    jsConsumerInfo_Destroy(ci);
    ci = NULL;
    if (s != NATS_OK && jerr != JSStreamNotFoundErr) {
        jsErrCode uerr = 0;
        if (js_UpdateConsumer(&ci, b->js, stream, &cc, NULL, &uerr) == NATS_OK) {
            s = NATS_OK;
            jerr = 0;
        }
        jsConsumerInfo_Destroy(ci);
    }
    if (s != NATS_OK) return bus__fail(err, errlen, "consumer ensure", s, jerr);

    bus_pull *p = calloc(1, sizeof *p);
    if (!p) {
        snprintf(err, errlen, "out of memory");
        return BUS_ENOMEM;
    }
    p->b = b;
    jsSubOptions so;
    jsSubOptions_Init(&so);
    so.Stream = stream;
    so.Consumer = durable;
    s = js_PullSubscribe(&p->sub, b->js, filter_subject, durable, NULL, &so, &jerr);
    if (s != NATS_OK) {
        free(p);
        return bus__fail(err, errlen, "pull subscribe", s, jerr);
    }
    *out = p;
    return BUS_OK;
}

/* Waits up to timeout_ms for one message. nats.c ends a fetch early when the late "request
 * timeout" status of an earlier fetch arrives during it; fetch again until this call's own
 * deadline. */
static int fetch_first(bus_pull *p, int timeout_ms, natsMsgList *out, char *err, size_t errlen) {
    int64_t deadline = nats_Now() + timeout_ms;
    for (;;) {
        jsErrCode jerr = 0;
        int64_t left = deadline - nats_Now();
        natsStatus s = natsSubscription_Fetch(out, p->sub, 1, left > 0 ? left : 1, &jerr);
        if (out->Count > 0) return BUS_OK;
        if (s != NATS_OK && s != NATS_TIMEOUT) return bus__fail(err, errlen, "fetch", s, jerr);
        natsMsgList_Destroy(out);
        memset(out, 0, sizeof *out);
        if (deadline - nats_Now() < 5) return BUS_OK; /* nothing to deliver in time */
    }
}

/* The messages the consumer held behind m when it was delivered (its metadata). */
static int pending_behind(natsMsg *m) {
    jsMsgMetaData *md = NULL;
    uint64_t n = 0;
    if (natsMsg_GetMetaData(&md, m) == NATS_OK) {
        n = md->NumPending;
        jsMsgMetaData_Destroy(md);
    }
    return n > BUS_FETCH_MAX ? BUS_FETCH_MAX : (int)n;
}

/* Never a pull request for several messages: the server keeps a waiting one open until it has
 * them all or it expires, and nats.c's fetch waits with it, so a message that came into a
 * waiting fetch of 128 sat there until its timeout (300 to 500 ms for 3% of the projection's
 * messages, docs/libcommon.md). And nats.c 3.4's fetch of n that finds k >= n/2 messages
 * already queued to the subscription reads on past its array of n (seen under ASan). So one
 * message a request: the first waits up to timeout_ms, then, while the last one's metadata says
 * the consumer held more behind it, the next (BUS_FETCH_MORE_MS at most: another puller may
 * have taken them). The first message goes at once, and a backlog still comes in batches. */
int bus_js_fetch(bus_pull *p, int batch, int timeout_ms, natsMsgList *out, char *err,
                 size_t errlen) {
    memset(out, 0, sizeof *out);
    if (!p || batch < 1 || batch > BUS_FETCH_MAX || timeout_ms < 1) {
        snprintf(err, errlen, "bus_js_fetch: batch must be 1..%d and timeout positive",
                 BUS_FETCH_MAX);
        return BUS_EINVAL;
    }
    int rc = fetch_first(p, timeout_ms, out, err, errlen);
    if (rc != BUS_OK || out->Count == 0 || batch == 1) return rc;
    natsMsg **v = malloc((size_t)batch * sizeof *v); /* freed by natsMsgList_Destroy */
    if (!v) return BUS_OK;                           /* the one we have goes */
    int n = 0;
    v[n++] = out->Msgs[0];
    out->Msgs[0] = NULL; /* moved: the destroy frees the array only */
    natsMsgList_Destroy(out);
    while (n < batch && pending_behind(v[n - 1]) > 0) {
        natsMsgList one = {0};
        jsErrCode jerr = 0;
        if (natsSubscription_Fetch(&one, p->sub, 1, BUS_FETCH_MORE_MS, &jerr) != NATS_OK ||
            one.Count == 0) {
            natsMsgList_Destroy(&one);
            break;
        }
        v[n++] = one.Msgs[0];
        one.Msgs[0] = NULL;
        natsMsgList_Destroy(&one);
    }
    out->Msgs = v;
    out->Count = n;
    return BUS_OK;
}

/* A message the server handed to a fetch that had already timed out sits in this
 * subscription; if it is closed before another fetch takes it, the message comes back after
 * ack_wait (at-least-once). */
void bus_pull_close(bus_pull *p) {
    if (!p) return;
    natsSubscription_Unsubscribe(p->sub); /* the consumer stays: this call did not create it */
    natsSubscription_Destroy(p->sub);
    free(p);
}

int bus_pull_pending(bus_pull *p) {
    int n = 0;
    if (!p || natsSubscription_GetPending(p->sub, &n, NULL) != NATS_OK) return 0;
    return n;
}

int bus_ack(natsMsg *m) {
    return bus__code(natsMsg_Ack(m, NULL));
}

int bus_nak(natsMsg *m, int delay_ms) {
    if (delay_ms < 0) return BUS_EINVAL;
    return bus__code(delay_ms ? natsMsg_NakWithDelay(m, delay_ms, NULL) : natsMsg_Nak(m, NULL));
}

int bus_term(natsMsg *m) {
    return bus__code(natsMsg_Term(m, NULL));
}

int bus_in_progress(natsMsg *m) {
    return bus__code(natsMsg_InProgress(m, NULL));
}

int bus_delivery_count(natsMsg *m) {
    jsMsgMetaData *meta = NULL;
    if (natsMsg_GetMetaData(&meta, m) != NATS_OK) return 0;
    int n = (int)meta->NumDelivered;
    jsMsgMetaData_Destroy(meta);
    return n;
}

/* ---- pipelined JetStream publishing (bus.h) ----
 *
 * A JetStream publish is a core request whose reply is the stream's PubAck JSON
 * ({"stream":..,"seq":..,"duplicate":true} or {"error":{"code":..,"description":..}}), or a
 * no-responders status when no stream captures the subject. The acks of every batch come to
 * one synchronous inbox subscription of the connection, made by the first batch (before its
 * first publish, on the same connection, so the server knows it before any ack is sent):
 * "<inbox>.<batch>.<i>" answers msgs[i] of batch number <batch>, so a late ack of an earlier
 * batch is recognised and dropped. The reader thread hands each ack straight to the waiting
 * caller (no delivery thread in between, no subscription per batch).
 *
 * nats.c turns a no-responders reply on a synchronous subscription into NATS_NO_RESPONDERS
 * without the message, so which message it answered is unknown: it is counted, and once
 * every message was answered the ones without an ack are the ones nobody stored. A stray
 * no-responders of an earlier batch can only make a stored message count as not stored: the
 * caller sends it again later, a duplicate by its id. */

/* The outcome of one ack (borrowed). */
static void bus__take_ack(natsMsg *r, bus_js_msg *m) {
    cJSON *j = cJSON_ParseWithLength(natsMsg_GetData(r), (size_t)natsMsg_GetDataLength(r));
    const cJSON *stream = cJSON_GetObjectItemCaseSensitive(j, "stream");
    if (cJSON_IsString(stream) && !cJSON_GetObjectItemCaseSensitive(j, "error")) {
        m->rc = BUS_OK;
        m->duplicate = cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(j, "duplicate"));
    } else {
        m->rc = BUS_ERR;
    }
    cJSON_Delete(j);
}

/* Which message of batch gen an ack answers; -1 when none of this batch. */
static long bus__ack_index(const char *subject, size_t prefix_len, unsigned long long gen, int n) {
    char *end = NULL;
    const char *p = subject + prefix_len; /* past "<inbox>." */
    unsigned long long g = strtoull(p, &end, 10);
    if (end == p || *end != '.' || g != gen) return -1;
    p = end + 1;
    long i = strtol(p, &end, 10);
    return end != p && !*end && i >= 0 && i < n ? i : -1;
}

int bus_js_publish_batch(bus *b, bus_js_msg *msgs, int n, char *err, size_t errlen) {
    char reply[256];
    int rc = BUS_OK, waiting = 0;
    if (!b || n < 0 || n > BUS_JS_BATCH_MAX || (n > 0 && !msgs)) {
        snprintf(err, errlen, "bus_js_publish_batch: bad arguments");
        return BUS_EINVAL;
    }
    for (int i = 0; i < n; i++) {
        msgs[i].rc = BUS_ETIMEOUT;
        msgs[i].duplicate = 0;
        if (!msgs[i].subject || msgs[i].len < 0 || (msgs[i].len > 0 && !msgs[i].data) ||
            (msgs[i].msg_id && !*msgs[i].msg_id))
            msgs[i].rc = BUS_EINVAL;
    }
    if (n == 0) return BUS_OK;
    pthread_mutex_lock(&b->batch_mu);
    natsStatus s = NATS_OK;
    if (!b->acks) {
        natsInbox *inbox = NULL;
        char wild[160];
        s = natsInbox_Create(&inbox);
        if (s == NATS_OK) {
            snprintf(b->ack_inbox, sizeof b->ack_inbox, "%s", (const char *)inbox);
            snprintf(wild, sizeof wild, "%s.>", b->ack_inbox);
            s = natsConnection_SubscribeSync(&b->acks, b->nc, wild);
        }
        natsInbox_Destroy(inbox);
        if (s != NATS_OK) {
            b->acks = NULL;
            rc = bus__fail(err, errlen, "js publish batch", s, 0);
            for (int i = 0; i < n; i++)
                if (msgs[i].rc == BUS_ETIMEOUT) msgs[i].rc = rc;
            pthread_mutex_unlock(&b->batch_mu);
            return rc;
        }
    }
    unsigned long long gen = ++b->batch_gen;
    size_t prefix = strlen(b->ack_inbox) + 1;
    char tp[BUS_TRACEPARENT_LEN + 1];
    for (int i = 0; i < n; i++) {
        natsMsg *m = NULL;
        if (msgs[i].rc == BUS_EINVAL) continue;
        int traced = bus__traceparent_of(msgs[i].trace_id, tp);
        snprintf(reply, sizeof reply, "%s.%llu.%d", b->ack_inbox, gen, i);
        s = natsMsg_Create(&m, msgs[i].subject, reply, msgs[i].data, msgs[i].len);
        if (s == NATS_OK && msgs[i].msg_id) s = natsMsgHeader_Set(m, "Nats-Msg-Id", msgs[i].msg_id);
        if (s == NATS_OK && traced) s = natsMsgHeader_Set(m, "traceparent", tp);
        if (s == NATS_OK) s = natsConnection_PublishMsg(b->nc, m);
        natsMsg_Destroy(m);
        if (s != NATS_OK)
            msgs[i].rc = bus__code(s); /* not sent: no ack will come */
        else
            waiting++;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    int64_t deadline = (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000 + b->o.js_timeout_ms;
    int unnamed = 0; /* no-responders replies (which message each answered is unknown) */
    while (waiting > 0) {
        clock_gettime(CLOCK_MONOTONIC, &ts);
        int64_t left = deadline - ((int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000);
        if (left <= 0) break;
        natsMsg *r = NULL;
        s = natsSubscription_NextMsg(&r, b->acks, left);
        if (s == NATS_NO_RESPONDERS) {
            unnamed++;
            waiting--;
            continue;
        }
        if (s != NATS_OK) break; /* timeout, or the connection closed: the rest failed */
        long i = bus__ack_index(natsMsg_GetSubject(r), prefix, gen, n);
        if (i >= 0 && msgs[i].rc == BUS_ETIMEOUT) {
            bus__take_ack(r, &msgs[i]);
            waiting--;
        }
        natsMsg_Destroy(r);
    }
    pthread_mutex_unlock(&b->batch_mu);
    if (waiting == 0 && unnamed > 0) /* all answered: those without an ack had no stream */
        for (int i = 0; i < n; i++)
            if (msgs[i].rc == BUS_ETIMEOUT) msgs[i].rc = BUS_ENORESP;
    for (int i = 0; i < n && rc == BUS_OK; i++)
        if (msgs[i].rc != BUS_OK) {
            rc = msgs[i].rc;
            snprintf(err, errlen, "js publish %s: %s", msgs[i].subject,
                     rc == BUS_ETIMEOUT  ? "no ack in time"
                     : rc == BUS_ENORESP ? "no stream captures this subject"
                     : rc == BUS_EINVAL  ? "bad subject, data or msg_id"
                                         : "refused by the stream");
        }
    return rc;
}
