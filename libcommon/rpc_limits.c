/* The server side of docs/rpc.md ("Hardening"): a unary call's request read to its end, the
 * request walked (rpc_walk.c) before it is decoded into the call arena, responses checked
 * before they are encoded, two authorization headers refused, and the connection budgets
 * turned into the C core's channel arguments. */
#include <grpc/byte_buffer_reader.h>
#include <stdio.h>
#include <string.h>

#include "log.h"
#include "rpc_internal.h"

#define W_PATH_MAX 256

/* ---- the server's request path ---- */

int rpc__decode_request(rpc_call *c, ProtobufCAllocator *alloc) {
    if (c->extra)
        return rpc_error(c, RPC_INTERNAL, "protocol error: more than one request message");
    if (c->payload == NULL)
        /* the stream ended without a message, or inside one (a length prefix promising more
         * than arrived): a protocol error, not an empty request */
        return rpc_error(c, RPC_INTERNAL, "protocol error: no complete request message");
    grpc_byte_buffer *bb = c->payload;
    c->payload = NULL;
    return rpc__decode_message(c, bb, alloc, &c->req);
}

int rpc__decode_message(rpc_call *c, grpc_byte_buffer *bb, ProtobufCAllocator *alloc,
                        ProtobufCMessage **out) {
    const rpc_method *m = &c->method->m;
    char msg[W_PATH_MAX + 160];
    grpc_byte_buffer_reader r;
    *out = NULL;
    if (!grpc_byte_buffer_reader_init(&r, bb)) {
        grpc_byte_buffer_destroy(bb);
        return rpc_error(c, RPC_INTERNAL, "protocol error: unreadable request message");
    }
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    /* the raw message is no longer needed: give its memory back before decoding */
    grpc_byte_buffer_destroy(bb);
    const uint8_t *p = GRPC_SLICE_START_PTR(s);
    size_t n = GRPC_SLICE_LENGTH(s);
    size_t max =
        m->max_decoded_bytes ? m->max_decoded_bytes : rpc__server_opts(c->srv)->max_decoded_bytes;
    int rc = rpc__check_request(p, n, m->req_desc, m->limits, m->n_limits, max, msg, sizeof msg);
    if (rc == 0) {
        *out = protobuf_c_message_unpack(m->req_desc, alloc, n, p);
        if (*out == NULL) snprintf(msg, sizeof msg, "request is not a valid %s", m->req_desc->name);
        rc = *out ? 0 : RPC_INVALID_ARGUMENT;
    }
    grpc_slice_unref(s);
    if (rc < 0) rc = RPC_INVALID_ARGUMENT;
    return rc == 0 ? RPC_OK : rpc_error(c, rc, "%s", msg);
}

int rpc__check_response(rpc_call *c, const ProtobufCMessage *resp) {
#ifdef NDEBUG
    (void)c, (void)resp;
    return RPC_OK;
#else
    char path[W_PATH_MAX] = "";
    if (resp == NULL || !rpc__response_bad_string(resp, path, 0, sizeof path, 0)) return RPC_OK;
    /* a bug of the service: a client would fail to decode the whole response */
    return rpc_error(c, RPC_INTERNAL, "response field %s is not valid UTF-8", path);
#endif
}

int rpc__stream_check_response(rpc_call *c, const ProtobufCMessage *msg) {
#ifdef NDEBUG
    (void)c, (void)msg;
    return RPC_OK;
#else
    char path[W_PATH_MAX] = "", text[W_PATH_MAX + 64];
    if (msg == NULL || !rpc__response_bad_string(msg, path, 0, sizeof path, 0)) return RPC_OK;
    snprintf(text, sizeof text, "response field %s is not valid UTF-8", path);
    log_error("rpc.response", "%s %s", rpc_method_path(c), text);
    rpc_stream_finish(c, RPC_INTERNAL, text);
    return RPC_INTERNAL;
#endif
}

/* Two `authorization` headers: which one would a proxy have checked? Refuse the call. */
int rpc__md_count(const grpc_metadata_array *md, const char *key) {
    int n = 0;
    for (size_t i = 0; i < md->count; i++)
        n += grpc_slice_str_cmp(md->metadata[i].key, key) == 0;
    return n;
}

/* ---- the read after the request ---- */

int rpc__expect_request_end(rpc_call *c) {
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &c->extra;
    c->t_recv.kind = RPC__TAG_UNARY_RECV;
    return grpc_call_start_batch(c->call, &op, 1, &c->t_recv, NULL) == GRPC_CALL_OK;
}

/* ---- connection budgets ---- */

void rpc__opts_hardening_defaults(rpc_server_opts *o) {
    if (o->max_decoded_bytes == 0) o->max_decoded_bytes = 16u << 20;
    if (o->max_connection_idle_ms <= 0) o->max_connection_idle_ms = 5 * 60 * 1000;
    if (o->keepalive_time_ms <= 0) o->keepalive_time_ms = 2 * 60 * 1000;
    if (o->keepalive_timeout_ms <= 0) o->keepalive_timeout_ms = 20 * 1000;
    if (o->handshake_timeout_ms <= 0) o->handshake_timeout_ms = 10 * 1000;
    if (o->max_health_watches <= 0) o->max_health_watches = 64;
    if (o->max_reflection_streams <= 0) o->max_reflection_streams = 16;
}

/* The C core closes a connection that has had no call for max_connection_idle (GOAWAY, so a
 * well-behaved client reconnects when it needs to), pings one that has been silent for
 * keepalive_time and drops it when the ping goes unanswered, and drops a connection that has
 * not finished its set-up within handshake_timeout. Clients may ping us, but not more often
 * than every 10 s without calls (the core's default policy answers abuse with GOAWAY). */
size_t rpc__hardening_args(const rpc_server_opts *o, grpc_arg *args) {
    size_t n = 0;
    args[n++] = (grpc_arg){
        GRPC_ARG_INTEGER, GRPC_ARG_MAX_CONNECTION_IDLE_MS, {.integer = o->max_connection_idle_ms}};
    args[n++] =
        (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIME_MS, {.integer = o->keepalive_time_ms}};
    args[n++] = (grpc_arg){
        GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_TIMEOUT_MS, {.integer = o->keepalive_timeout_ms}};
    args[n++] = (grpc_arg){GRPC_ARG_INTEGER,
                           GRPC_ARG_SERVER_HANDSHAKE_TIMEOUT_MS,
                           {.integer = o->handshake_timeout_ms}};
    args[n++] =
        (grpc_arg){GRPC_ARG_INTEGER, GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, {.integer = 1}};
    args[n++] = (grpc_arg){GRPC_ARG_INTEGER,
                           GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                           {.integer = 10000}};
    return n;
}
