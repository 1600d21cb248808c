/* gRPC client on the C core. Each call runs on its own pluck completion queue, so calls are
 * blocking, independent and safe from any thread. */
#include "rpc_client.h"

#include <errno.h>
#include <grpc/grpc_security.h>
#include <grpc/support/time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "rpc_internal.h"

#define MAX_MD 16

struct rpc_channel {
    grpc_channel *ch;
};

/* Outgoing metadata of one call; the slices are owned here. */
typedef struct call_md {
    grpc_metadata md[MAX_MD];
    size_t n;
} call_md;

struct rpc_reader {
    grpc_completion_queue *cq;
    grpc_call *call;
    const ProtobufCMessageDescriptor *desc;
    call_md out_md;
    grpc_byte_buffer *req;
    grpc_metadata_array init_md, trailing;
    grpc_status_code status;
    grpc_slice details;
    grpc_byte_buffer *msg;
    int tag_send, tag_status, tag_msg;
    int status_done, ended;
};

void rpc_status_clear(rpc_status *st) {
    if (st == NULL) return;
    free(st->message);
    free(st->details);
    memset(st, 0, sizeof *st);
}

static grpc_channel_credentials *client_creds(const rpc_client_tls *tls, char *err, size_t errlen) {
    char *ca = NULL, *cert = NULL, *key = NULL;
    grpc_channel_credentials *creds = NULL;
    if ((tls->ca_file && rpc__read_file(tls->ca_file, &ca, err, errlen) != 0) ||
        (tls->cert_file && rpc__read_file(tls->cert_file, &cert, err, errlen) != 0) ||
        (tls->key_file && rpc__read_file(tls->key_file, &key, err, errlen) != 0))
        goto done;
    grpc_ssl_pem_key_cert_pair pair = {key, cert};
    creds = grpc_ssl_credentials_create(ca, (cert && key) ? &pair : NULL, NULL, NULL);
    if (creds == NULL) snprintf(err, errlen, "invalid TLS material");
done:
    free(ca);
    free(cert);
    free(key);
    return creds;
}

int rpc_channel_new(const rpc_channel_opts *o, rpc_channel **out, char *err, size_t errlen) {
    grpc_arg args[3];
    size_t n = 0;
    grpc_channel_credentials *creds;
    rpc_channel *ch = calloc(1, sizeof *ch);
    if (ch == NULL) {
        snprintf(err, errlen, "out of memory");
        return RPC_ENOMEM;
    }
    rpc__install_log_hook();
    grpc_init();
    args[n++] = (grpc_arg){GRPC_ARG_INTEGER,
                           GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                           {.integer = o->max_recv_bytes > 0 ? o->max_recv_bytes : 16 << 20}};
    if (o->round_robin)
        args[n++] = (grpc_arg){GRPC_ARG_STRING,
                               GRPC_ARG_SERVICE_CONFIG,
                               {.string = "{\"loadBalancingConfig\":[{\"round_robin\":{}}]}"}};
    if (o->tls && o->tls->server_name_override)
        args[n++] = (grpc_arg){GRPC_ARG_STRING,
                               GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                               {.string = (char *)o->tls->server_name_override}};
    grpc_channel_args ca = {n, args};
    creds = o->tls ? client_creds(o->tls, err, errlen) : grpc_insecure_credentials_create();
    if (creds == NULL) {
        free(ch);
        grpc_shutdown();
        return RPC_EINVAL;
    }
    ch->ch = grpc_channel_create(o->target, creds, &ca);
    grpc_channel_credentials_release(creds);
    *out = ch;
    return RPC_OK;
}

void rpc_channel_free(rpc_channel *ch) {
    if (ch == NULL) return;
    grpc_channel_destroy(ch->ch);
    free(ch);
    grpc_shutdown();
}

static void md_add(call_md *m, const char *key, const char *prefix, const char *value) {
    if (m->n == MAX_MD) return;
    char buf[8192];
    snprintf(buf, sizeof buf, "%s%s", prefix, value);
    m->md[m->n].key = grpc_slice_from_copied_string(key);
    m->md[m->n].value = grpc_slice_from_copied_string(buf);
    m->n++;
}

static void md_build(call_md *m, const rpc_call_opts *o) {
    /* the call goes on the trace of the work that makes it (the handler's, a bus message's):
     * the server it reaches logs under the same trace id (docs/libcommon.md, "Traces") */
    const char *trace = o && o->trace_id ? o->trace_id : log_get_trace();
    m->n = 0;
    if (trace) md_add(m, "x-request-id", "", trace);
    if (o == NULL) return;
    if (o->bearer) md_add(m, "authorization", "Bearer ", o->bearer);
    for (size_t i = 0; i < o->n_md; i++)
        md_add(m, o->md[i].key, "", o->md[i].value);
}

static void md_free(call_md *m) {
    for (size_t i = 0; i < m->n; i++) {
        grpc_slice_unref(m->md[i].key);
        grpc_slice_unref(m->md[i].value);
    }
    m->n = 0;
}

static grpc_call *call_create(rpc_channel *ch, grpc_completion_queue *cq, const char *method,
                              const rpc_call_opts *o) {
    gpr_timespec deadline = (o && o->timeout_ms > 0)
                                ? gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                               gpr_time_from_millis(o->timeout_ms, GPR_TIMESPAN))
                                : gpr_inf_future(GPR_CLOCK_MONOTONIC);
    grpc_slice m = grpc_slice_from_copied_string(method);
    /* a parent server call: the core propagates its deadline and cancellation */
    grpc_call *parent = (o && o->parent) ? o->parent->call : NULL;
    grpc_call *call = grpc_channel_create_call(ch->ch, parent, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                               deadline, NULL);
    grpc_slice_unref(m);
    return call;
}

/* ---- for rpc_astream.c ---- */

struct rpc__call_md {
    call_md m;
};

rpc__call_md *rpc__md_new(const rpc_call_opts *o) {
    rpc__call_md *m = calloc(1, sizeof *m);
    if (m) md_build(&m->m, o);
    return m;
}

grpc_metadata *rpc__md_items(rpc__call_md *m, size_t *n) {
    *n = m->m.n;
    return m->m.md;
}

void rpc__md_delete(rpc__call_md *m) {
    if (m == NULL) return;
    md_free(&m->m);
    free(m);
}

grpc_call *rpc__client_call(rpc_channel *ch, grpc_completion_queue *cq, const char *method,
                            const rpc_call_opts *o) {
    return call_create(ch, cq, method, o);
}

void rpc__status_fill(rpc_status *st, grpc_status_code code, grpc_slice details,
                      const grpc_metadata_array *trailing) {
    if (st == NULL) return;
    memset(st, 0, sizeof *st);
    st->code = (int)code;
    st->message = strndup((const char *)GRPC_SLICE_START_PTR(details), GRPC_SLICE_LENGTH(details));
    for (size_t i = 0; trailing && i < trailing->count; i++) {
        if (grpc_slice_str_cmp(trailing->metadata[i].key, "grpc-status-details-bin") != 0) continue;
        size_t n = GRPC_SLICE_LENGTH(trailing->metadata[i].value);
        st->details = malloc(n ? n : 1);
        if (st->details) {
            memcpy(st->details, GRPC_SLICE_START_PTR(trailing->metadata[i].value), n);
            st->details_len = n;
        }
        break;
    }
}

static void cq_free(grpc_completion_queue *cq) {
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_pluck(cq, NULL, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

int rpc_unary_call(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                   ProtobufCMessage **resp, rpc_status *st) {
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = call_create(ch, cq, method, opts);
    grpc_metadata_array init_md, trailing;
    grpc_byte_buffer *reqbb = rpc__encode(req), *respbb = NULL;
    grpc_status_code code = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    call_md md;
    grpc_op ops[6];
    int tag = 1;

    *resp = NULL;
    md_build(&md, opts);
    grpc_metadata_array_init(&init_md);
    grpc_metadata_array_init(&trailing);
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = md.n;
    ops[0].data.send_initial_metadata.metadata = md.md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = reqbb;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &init_md;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &respbb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &code;
    ops[5].data.recv_status_on_client.status_details = &details;
    if (grpc_call_start_batch(call, ops, 6, &tag, NULL) == GRPC_CALL_OK)
        grpc_completion_queue_pluck(cq, &tag, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    else
        details = grpc_slice_from_static_string("call could not be started");

    if (code == GRPC_STATUS_OK) {
        if (respbb == NULL || rpc__decode(respbb, resp_desc, NULL, resp) != 0) {
            code = GRPC_STATUS_INTERNAL;
            grpc_slice_unref(details);
            details = grpc_slice_from_static_string("missing or undecodable response message");
            *resp = NULL;
        }
    }
    rpc__status_fill(st, code, details, &trailing);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&init_md);
    grpc_metadata_array_destroy(&trailing);
    grpc_byte_buffer_destroy(reqbb);
    if (respbb) grpc_byte_buffer_destroy(respbb);
    md_free(&md);
    grpc_call_unref(call);
    cq_free(cq);
    return (int)code;
}

int rpc_stream_open(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                    const ProtobufCMessageDescriptor *resp_desc, const rpc_call_opts *opts,
                    rpc_reader **out) {
    rpc_reader *r = calloc(1, sizeof *r);
    grpc_op ops[4];
    if (r == NULL) return RPC_ENOMEM;
    r->cq = grpc_completion_queue_create_for_pluck(NULL);
    r->call = call_create(ch, r->cq, method, opts);
    r->desc = resp_desc;
    r->req = rpc__encode(req);
    r->details = grpc_empty_slice();
    md_build(&r->out_md, opts);
    grpc_metadata_array_init(&r->init_md);
    grpc_metadata_array_init(&r->trailing);
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[0].data.send_initial_metadata.count = r->out_md.n;
    ops[0].data.send_initial_metadata.metadata = r->out_md.md;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = r->req;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &r->init_md;
    if (grpc_call_start_batch(r->call, ops, 4, &r->tag_send, NULL) != GRPC_CALL_OK) goto fail;
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[0].data.recv_status_on_client.trailing_metadata = &r->trailing;
    ops[0].data.recv_status_on_client.status = &r->status;
    ops[0].data.recv_status_on_client.status_details = &r->details;
    if (grpc_call_start_batch(r->call, ops, 1, &r->tag_status, NULL) != GRPC_CALL_OK) goto fail;
    grpc_completion_queue_pluck(r->cq, &r->tag_send, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    *out = r;
    return RPC_OK;
fail:
    r->status = GRPC_STATUS_INTERNAL;
    r->status_done = 1;
    r->ended = 1;
    *out = r;
    return RPC_OK;
}

int rpc_reader_next(rpc_reader *r, ProtobufCMessage **msg) {
    grpc_op op;
    *msg = NULL;
    if (r->ended) return r->status == GRPC_STATUS_OK ? 0 : -1;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_MESSAGE;
    op.data.recv_message.recv_message = &r->msg;
    r->msg = NULL;
    if (grpc_call_start_batch(r->call, &op, 1, &r->tag_msg, NULL) != GRPC_CALL_OK) {
        r->ended = 1;
        return -1;
    }
    grpc_completion_queue_pluck(r->cq, &r->tag_msg, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
    if (r->msg == NULL) { /* end of stream: the status follows */
        r->ended = 1;
        grpc_completion_queue_pluck(r->cq, &r->tag_status, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                    NULL);
        r->status_done = 1;
        return r->status == GRPC_STATUS_OK ? 0 : -1;
    }
    int rc = rpc__decode(r->msg, r->desc, NULL, msg);
    grpc_byte_buffer_destroy(r->msg);
    r->msg = NULL;
    if (rc != 0) {
        grpc_call_cancel_with_status(r->call, GRPC_STATUS_INTERNAL, "undecodable message", NULL);
        return -1;
    }
    return 1;
}

void rpc_reader_cancel(rpc_reader *r) {
    grpc_call_cancel(r->call, NULL);
}

int rpc_reader_close(rpc_reader *r, rpc_status *st) {
    if (!r->status_done) {
        grpc_call_cancel(r->call, NULL);
        grpc_completion_queue_pluck(r->cq, &r->tag_status, gpr_inf_future(GPR_CLOCK_MONOTONIC),
                                    NULL);
    }
    int code = (int)r->status;
    rpc__status_fill(st, r->status, r->details, &r->trailing);
    grpc_slice_unref(r->details);
    grpc_metadata_array_destroy(&r->init_md);
    grpc_metadata_array_destroy(&r->trailing);
    grpc_byte_buffer_destroy(r->req);
    md_free(&r->out_md);
    grpc_call_unref(r->call);
    cq_free(r->cq);
    free(r);
    return code;
}
