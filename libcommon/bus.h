/* NATS (core and JetStream) on nats.c: one connection per process, reconnecting forever.
 *
 * Delivery guarantees
 *   Core subjects (bus_publish / bus_subscribe / bus_request) are at-most-once: use them for
 *   live fan-out where a loss is tolerable or repaired (stream frames with gap markers,
 *   request/reply with a timeout). Anything that must not be lost goes through JetStream
 *   (bus_js_publish, durable pull consumers with explicit acks), fed from an outbox.
 *
 * Bounds and policies
 *   - Disconnected: the library reconnects forever, every reconnect_wait_ms (+ jitter).
 *     Core publishes made meanwhile are buffered up to reconnect_buf_bytes (the last one
 *     accepted may overshoot by its own size) and sent after the subscriptions are
 *     re-established; a publish beyond the bound fails with BUS_EFULL
 *     (nothing is dropped silently; an outbox relay simply retries later). JetStream
 *     publishes wait for their ack up to js_timeout_ms and fail with BUS_ETIMEOUT.
 *   - Slow subscriber: each subscription holds at most sub_pending_msgs messages and
 *     sub_pending_bytes bytes not yet handed to its callback. Beyond that nats.c drops the
 *     newest messages for that subscription and reports a slow consumer: logged once per
 *     episode ("bus.slow_consumer") and counted (bus_stats, bus_sub_dropped). Publishers
 *     and other subscribers are never slowed down.
 *   - JetStream streams are bounded by max_age, max_msgs and max_bytes; when full, "limits"
 *     streams drop their oldest messages, "workqueue" streams refuse new ones (the publisher
 *     sees an error and retries; work is never lost silently).
 *
 * Delivery threads and ordering
 *   Subscription callbacks run on nats.c's shared delivery pool (delivery_threads, default 2,
 *   UPSQUAD_BUS_DELIVERY_THREADS for services), not on a thread per subscription, so ten
 *   thousand subscriptions cost a few threads. Each subscription is bound to one pool thread:
 *   its messages are delivered one at a time, in the order the server sent them. There is no
 *   order between subscriptions, and callbacks of subscriptions that share a thread wait for
 *   each other, so a callback must not block: hand the message on (rpc_stream_push, a
 *   bounded queue) and return. delivery_threads 0 gives each subscription its own thread.
 *   Messages passed to callbacks are borrowed and freed when the callback returns. All
 *   functions are thread-safe.
 * Return codes: BUS_OK (0) or a negative BUS_E*; err receives a message when given. */
#ifndef UPSQUAD_BUS_H
#define UPSQUAD_BUS_H

#include <stddef.h>
#include <stdint.h>
#include <nats/nats.h>

enum {
    BUS_OK = 0,
    BUS_ERR = -201,      /* server or library error (message in err) */
    BUS_ETIMEOUT = -202, /* no reply / ack in time */
    BUS_ENORESP = -203,  /* request: nobody subscribes to the subject */
    BUS_EFULL = -204,    /* reconnect buffer full while disconnected */
    BUS_EINVAL = -205,   /* bad argument (subject token, sizes) */
    BUS_ECLOSED = -206,  /* connection closed */
    BUS_ENOMEM = -207,
};

typedef struct bus bus;
typedef struct bus_sub bus_sub;
typedef struct bus_pull bus_pull;

typedef struct bus_opts {
    int reconnect_wait_ms;   /* between reconnect attempts (default 500) */
    int reconnect_buf_bytes; /* publishes kept while disconnected (default 8 MiB) */
    int sub_pending_msgs;    /* per subscription, undelivered messages (default 8192) */
    int sub_pending_bytes;   /* per subscription, undelivered bytes (default 16 MiB) */
    int js_timeout_ms;       /* JetStream API calls and publish acks (default 5000) */
    int connect_retry;       /* 1: bus_connect succeeds while the server is down and the
                                connection is made in the background (default 0: fail) */
    int delivery_threads;    /* nats.c's shared delivery pool, process-wide (it grows to the
                                largest value asked, never shrinks); 0: a thread per
                                subscription (default: bus_set_delivery_threads, 2) */
} bus_opts;

void bus_opts_default(bus_opts *o);
/* The delivery_threads bus_opts_default gives (svc_main sets it from
 * UPSQUAD_BUS_DELIVERY_THREADS); n < 0 is ignored. */
void bus_set_delivery_threads(int n);

/* url: "nats://host:port" (comma-separated list accepted). name: shown by the server
 * (copied). On success the caller owns *out: bus_close. */
int bus_connect(const char *url, const char *name, bus **out, char *err, size_t errlen);
int bus_connect_ex(const char *url, const char *name, const bus_opts *opts, bus **out, char *err,
                   size_t errlen);
/* Flushes what is buffered (bounded wait), closes and frees. b NULL is a no-op.
 * Unsubscribe first; pull subscriptions must be closed first. */
void bus_close(bus *b);
/* Releases nats.c's global threads and memory at process exit (after every bus_close). */
void bus_library_shutdown(void);

/* 1 when connected now (readiness probes), 0 while connecting/reconnecting or closed. */
int bus_connected(bus *b);
/* Waits until the server has processed everything sent so far (subscriptions included). */
int bus_flush(bus *b, int timeout_ms);

typedef struct bus_stats {
    uint64_t in_msgs, out_msgs, reconnects;
    uint64_t slow_consumer_events; /* episodes reported by nats.c across all subscriptions */
} bus_stats;
void bus_get_stats(bus *b, bus_stats *out);

/* Subjects: tokens joined with '.', each checked: non-empty, no '.', '*', '>' or whitespace,
 * at most 128 bytes; the whole subject fits in outlen. NULL-terminated token list, e.g.
 * bus_subject(buf, sizeof buf, "wf", "status", org_id, run_id, NULL). A token that is not
 * valid (an id with a dot in it) is refused with BUS_EINVAL rather than escaped, so that
 * subject permissions and wildcards keep their meaning. */
int bus_subject(char *out, size_t outlen, const char *first, ...) __attribute__((sentinel));
int bus_token_valid(const char *token);

/* ---- core NATS ---- */

int bus_publish(bus *b, const char *subject, const void *data, int len);

/* Waits up to timeout_ms for one reply, and no longer than the calling thread's deadline
 * (ctx.h: inside an RPC handler, the call's); *reply owned by the caller (natsMsg_Destroy).
 * BUS_ETIMEOUT at once when that deadline has passed. */
int bus_request(bus *b, const char *subject, const void *data, int len, int timeout_ms,
                natsMsg **reply);
/* Answers a request received by a subscription callback (msg borrowed). */
int bus_respond(bus *b, natsMsg *request, const void *data, int len);

/* msg is borrowed: valid during the call only. */
typedef void (*bus_msg_cb)(bus *b, natsMsg *msg, void *ud);

/* Trace context. Every publish (core, JetStream, batch) made on a thread whose log trace id
 * (log_set_trace) is a W3C trace id (32 lowercase hex: what the RPC server takes from a
 * caller's traceparent or generates) carries it in a `traceparent` header
 * ("00-<trace>-<span>-01", a fresh span per publish); a subscription callback runs with the
 * message's trace as its thread's log trace (its lines and the RPCs it makes carry it). A pull
 * consumer adopts it per message with bus_msg_trace: 1 and the trace id in out (33 bytes) when
 * m carries a valid traceparent, else 0 and out "". */
#define BUS_TRACEPARENT_LEN 55
int bus_msg_trace(natsMsg *m, char out[33]);

/* queue_group NULL: every subscriber gets every message; otherwise each message goes to one
 * member of the group. Pending limits from the bus options. *out owned: bus_unsubscribe. */
int bus_subscribe(bus *b, const char *subject, const char *queue_group, bus_msg_cb cb, void *ud,
                  bus_sub **out, char *err, size_t errlen);
/* Stops delivery and waits until the callback is no longer running, so ud may be freed
 * afterwards. Must not be called from that subscription's own callback. s NULL: no-op. */
void bus_unsubscribe(bus_sub *s);
/* Every message of JetStream stream `stream` on `subject` (wildcards allowed): those the stream
 * holds, then each new one, through an ordered consumer (ephemeral, no acks, in stream order).
 * When the connection comes back it resumes after the last message it delivered, so messages
 * published while this process was disconnected still arrive (while the stream keeps them).
 * A fan-out: every subscriber gets every message. cb and freeing as for bus_subscribe. */
int bus_js_subscribe_ordered(bus *b, const char *stream, const char *subject, bus_msg_cb cb,
                             void *ud, bus_sub **out, char *err, size_t errlen);
/* 1 when a bus_js_subscribe_ordered subscription has handed its callback every message the
 * stream holds now (none left at the server nor queued here); 0 otherwise or on error. */
int bus_sub_caught_up(bus_sub *s);
/* Inside a bus_subscribe / bus_js_subscribe_ordered callback: how many messages of that
 * subscription were received and wait behind the one being handled (0 outside a callback).
 * A callback that fans out can tell that more messages follow at once (stream-hub shares the
 * writes of a burst). */
int bus_cb_pending(void);
/* Messages dropped for this subscription because it was slow. */
int64_t bus_sub_dropped(bus_sub *s);

/* ---- JetStream ---- */

enum { BUS_RETENTION_LIMITS = 0, BUS_RETENTION_WORKQUEUE = 1, BUS_RETENTION_INTEREST = 2 };

typedef struct bus_stream_limits {
    int64_t max_msgs;           /* default -1: unbounded by count (bytes and age bound it) */
    int64_t max_bytes;          /* default 64 MiB (reserved against the server's store limit) */
    int64_t duplicate_window_s; /* Nats-Msg-Id de-duplication window (default 120) */
    int memory;                 /* 1: memory storage (default 0: file) */
    int replicas;               /* copies in a JetStream cluster, 1..5 (default 1) */
} bus_stream_limits;

/* Fills l with the defaults above. */
void bus_stream_limits_default(bus_stream_limits *l);

/* Creates the stream or updates its configuration to these values (idempotent; replicas may
 * call it together). limits NULL = defaults. */
int bus_js_stream_ensure(bus *b, const char *name, const char *const *subjects, int nsubjects,
                         int retention, int64_t max_age_s, const bus_stream_limits *limits,
                         char *err, size_t errlen);
int bus_js_stream_delete(bus *b, const char *name, char *err, size_t errlen);
/* Messages currently stored in the stream. */
int bus_js_stream_msgs(bus *b, const char *name, uint64_t *msgs, char *err, size_t errlen);

/* Publishes and waits for the stream's ack. msg_id (NULL = none) sets Nats-Msg-Id: a second
 * publish with the same id inside the stream's duplicate window is not stored again, and
 * *duplicate (NULL ok) is set to 1 — still a success. */
int bus_js_publish(bus *b, const char *subject, const void *data, int len, const char *msg_id,
                   int *duplicate, char *err, size_t errlen);

/* Binds to (creating when missing) the durable pull consumer `durable` of `stream`, limited to
 * filter_subject (NULL = all). Explicit acks: a message not acked within ack_wait_ms is
 * delivered again, at most max_deliver times (-1 = unlimited). Replicas using the same
 * durable share the work. *out owned: bus_pull_close. */
int bus_js_pull_subscribe(bus *b, const char *stream, const char *durable,
                          const char *filter_subject, int ack_wait_ms, int max_deliver,
                          bus_pull **out, char *err, size_t errlen);
/* The same; deliver_new 1: a consumer this call creates starts with the messages published
 * after its creation instead of the stream's whole history. A durable's start cannot change
 * later: bind it with the value it was created with. */
int bus_js_pull_subscribe_ex(bus *b, const char *stream, const char *durable,
                             const char *filter_subject, int ack_wait_ms, int max_deliver,
                             int deliver_new, bus_pull **out, char *err, size_t errlen);
/* Fetches up to batch messages, waiting up to timeout_ms for the first: it returns as soon as
 * one is there, with those the consumer held behind it (never waiting for a full batch). A
 * timeout with nothing to deliver is BUS_OK with out->Count == 0. The caller owns the list:
 * ack/nak/term each message, then natsMsgList_Destroy(out). */
int bus_js_fetch(bus_pull *p, int batch, int timeout_ms, natsMsgList *out, char *err,
                 size_t errlen);
/* Stops fetching; the durable consumer and its state stay on the server. Messages in flight
 * to this subscriber are delivered again after ack_wait. p NULL: no-op. */
void bus_pull_close(bus_pull *p);
/* Messages the server already delivered to p that no fetch has taken yet (a fetch that ended
 * early can leave its pull request alive at the server, which then delivers the next message
 * to this subscription); a bus_js_fetch of that many returns them at once. 0 when none. */
int bus_pull_pending(bus_pull *p);

/* Acknowledgements of a fetched message (borrowed). */
int bus_ack(natsMsg *m);               /* done */
int bus_nak(natsMsg *m, int delay_ms); /* redeliver after delay_ms (0 = now) */
int bus_term(natsMsg *m);              /* never redeliver (poison message) */
int bus_in_progress(natsMsg *m);       /* still working: restarts the ack_wait timer */
/* How many times this message has been delivered (1 on the first delivery); 0 if unknown. */
int bus_delivery_count(natsMsg *m);

/* ---- pipelined JetStream publishing ----
 * One message of bus_js_publish_batch: the caller fills subject, data, len, msg_id and
 * trace_id (all borrowed; msg_id NULL = none); the call sets rc (BUS_OK once the stream acked it, a
 * duplicate included, else the BUS_E* of that message) and duplicate. */
typedef struct bus_js_msg {
    const char *subject;
    const void *data;
    int len;
    const char *msg_id;
    const char *trace_id; /* the message's W3C trace id (borrowed); NULL or "": the thread's */
    int rc;
    int duplicate;
} bus_js_msg;

#define BUS_JS_BATCH_MAX 1024

/* Publishes msgs[0..n) (n <= BUS_JS_BATCH_MAX) to JetStream without waiting between them,
 * then waits for all their acks, js_timeout_ms in all: one round trip for the batch instead
 * of one per message. The server receives them in array order, but each succeeds or fails on
 * its own (a timed-out message may be stored after a later one that was acked), so a caller
 * that needs order between two messages must not put both in one batch: it sends the later
 * one in a later batch, and only once the earlier one was acked (the workflow engine's outbox
 * relay: one message per run per batch). Returns BUS_OK when every message was acked, else
 * the rc of the first message that failed (err names it). */
int bus_js_publish_batch(bus *b, bus_js_msg *msgs, int n, char *err, size_t errlen);

#endif
