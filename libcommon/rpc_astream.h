/* Asynchronous server-stream reader: many client streams read by a few threads.
 *
 * rpc_reader_next blocks a thread per stream; relaying N concurrent worker streams that way
 * takes N threads. An rpc_aclient owns a fixed set of I/O threads, each polling one completion
 * queue; every stream opened on it is bound to one of them, and its messages are handed to a
 * callback on that thread, one at a time, in order.
 *
 * Bounds and flow control
 *   One receive is in flight per stream: the next message is asked for only when the callback
 *   has returned. A callback that cannot take more (its consumer's queue is full) returns
 *   RPC_ASTREAM_PAUSE; nothing more is read until rpc_astream_resume(), and meanwhile the
 *   sender is held back by HTTP/2 flow control. So what a stream buffers is bounded by the
 *   transport window, never by the sender's speed.
 *
 * Cancellation
 *   From the consumer's side, any thread: rpc_astream_cancel() (the server sees CANCELLED),
 *   or return RPC_ASTREAM_CANCEL from the callback. From a parent server call: set
 *   rpc_call_opts.parent, and the C core cancels the stream when that call ends and bounds its
 *   deadline by the parent's.
 *
 * Callbacks run on the I/O threads and must not block (push to a stream with
 * rpc_stream_push, queue, or pause). on_done runs exactly once per opened stream, last. */
#ifndef UPSQUAD_RPC_ASTREAM_H
#define UPSQUAD_RPC_ASTREAM_H

#include "rpc_client.h"

typedef struct rpc_aclient rpc_aclient;
typedef struct rpc_astream rpc_astream;

enum { RPC_ASTREAM_CONTINUE = 0, RPC_ASTREAM_PAUSE = 1, RPC_ASTREAM_CANCEL = 2 };

/* msg is borrowed: valid during the call only. Returns RPC_ASTREAM_*. */
typedef int (*rpc_astream_msg_fn)(rpc_astream *s, const ProtobufCMessage *msg, void *ud);
/* The final status (borrowed). The stream's reference held for the callbacks is dropped
 * after it returns. */
typedef void (*rpc_astream_done_fn)(rpc_astream *s, const rpc_status *st, void *ud);

/* threads: I/O threads (1..64). *out owned: rpc_aclient_free, after every stream is done. */
int rpc_aclient_new(int threads, rpc_aclient **out);
void rpc_aclient_free(rpc_aclient *a);

/* Starts the call. On success *out holds a reference for the caller (rpc_astream_unref when
 * done with it; the stream lives on until on_done has run either way). RPC_OK, or RPC_ENOMEM /
 * RPC_EINVAL and no callback will run. */
int rpc_astream_open(rpc_aclient *a, rpc_channel *ch, const char *method,
                     const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                     const rpc_call_opts *opts, rpc_astream_msg_fn on_msg,
                     rpc_astream_done_fn on_done, void *ud, rpc_astream **out);
/* Any thread. Idempotent. */
void rpc_astream_cancel(rpc_astream *s);
/* Reads again after RPC_ASTREAM_PAUSE; any thread; a no-op when not paused. */
void rpc_astream_resume(rpc_astream *s);
void rpc_astream_unref(rpc_astream *s);
/* The I/O threads' count (the thread cost of any number of streams). */
int rpc_aclient_threads(const rpc_aclient *a);

#endif
