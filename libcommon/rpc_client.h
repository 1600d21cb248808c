/* gRPC client on the C core: channels by target, unary calls with deadlines, server-stream
 * readers, TLS/mTLS. Used by the orchestrator towards workers, by tools and by tests.
 *
 * Calls are blocking and thread-safe: any number of threads may call on one channel at once
 * (the channel multiplexes them over its HTTP/2 connections). */
#ifndef UPSQUAD_RPC_CLIENT_H
#define UPSQUAD_RPC_CLIENT_H

#include <protobuf-c/protobuf-c.h>
#include <stddef.h>
#include <stdint.h>

typedef struct rpc_channel rpc_channel;
typedef struct rpc_reader rpc_reader;

typedef struct rpc_client_tls {
    const char *ca_file;              /* roots to verify the server with (PEM file) */
    const char *cert_file, *key_file; /* client certificate for mTLS; NULL for TLS only */
    const char *server_name_override; /* tests: the name the server certificate carries */
} rpc_client_tls;

typedef struct rpc_channel_opts {
    const char *target; /* "127.0.0.1:50051", "ipv4:10.0.0.1:1,10.0.0.2:1", "dns:///w:50051" */
    int round_robin;    /* spread calls over every resolved address */
    int max_recv_bytes; /* default 16 MiB */
    const rpc_client_tls *tls; /* NULL: plaintext */
} rpc_channel_opts;

typedef struct rpc_md {
    const char *key, *value;
} rpc_md;

struct rpc_call; /* rpc.h: a server call being handled */

typedef struct rpc_call_opts {
    int64_t timeout_ms;   /* 0: no deadline */
    const char *bearer;   /* sent as "authorization: Bearer <bearer>" */
    const char *trace_id; /* sent as x-request-id; NULL: the thread's log trace, if any */
    const rpc_md *md;
    size_t n_md;
    /* The server call this call is made for (borrowed; it must outlive this call): its
     * deadline bounds this one and its cancellation (client gone, deadline, shutdown)
     * cancels this one, by the C core's parent-call propagation. NULL: none. */
    const struct rpc_call *parent;
} rpc_call_opts;

/* The status of a finished call. message and details are heap copies: rpc_status_clear. */
typedef struct rpc_status {
    int code;
    char *message;
    uint8_t *details; /* serialized google.rpc.Status from grpc-status-details-bin, or NULL */
    size_t details_len;
} rpc_status;

void rpc_status_clear(rpc_status *st);

int rpc_channel_new(const rpc_channel_opts *opts, rpc_channel **out, char *err, size_t errlen);
void rpc_channel_free(rpc_channel *ch);

/* Returns the status code (0 = OK; *resp set, caller frees with
 * protobuf_c_message_free_unpacked(*resp, NULL)). st may be NULL. */
int rpc_unary_call(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                   ProtobufCMessage **resp, rpc_status *st);

/* Server streaming. rpc_stream_open starts the call; rpc_reader_next returns 1 with a message
 * (caller frees as above), 0 at the end of the stream, negative when it failed (the status
 * says why, from rpc_reader_close). rpc_reader_cancel may be called from another thread. */
int rpc_stream_open(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                    const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                    rpc_reader **out);
int rpc_reader_next(rpc_reader *r, ProtobufCMessage **msg);
void rpc_reader_cancel(rpc_reader *r);
/* Frees the reader (cancelling the call if it is still running); returns the status code. */
int rpc_reader_close(rpc_reader *r, rpc_status *st);

#endif
