/* upsquad-health: a gRPC health probe (grpc.health.v1.Health/Check) for Kubernetes exec probes.
 *
 *   upsquad-health -addr=HOST:PORT [-service=NAME] [-timeout=MS]
 *                  [-tls -tls-ca-cert=F [-tls-client-cert=F -tls-client-key=F]
 *                   [-tls-server-name=NAME]]
 *
 * The flags are those of grpc_health_probe, so a probe written for it runs unchanged; the image
 * ships this one, built from our sources, instead of a downloaded binary. The kubelet's own gRPC
 * probe cannot present a client certificate, which an mTLS service requires.
 * Exit status (grpc_health_probe's): 0 SERVING, 1 bad arguments, 2 connection failure (the
 * channel could not be made, or the call failed UNAVAILABLE or past the deadline), 3 the call
 * failed otherwise (NOT_FOUND: an unknown service), 4 answered but not SERVING. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "log.h"
#include "rpc_client.h"

enum { HP_OK = 0, HP_ARGS = 1, HP_CONN = 2, HP_RPC = 3, HP_UNHEALTHY = 4 };

typedef struct hp_opts {
    const char *addr, *service;
    long timeout_ms;
    int tls;
    rpc_client_tls t;
} hp_opts;

static int hp_parse(int argc, char **argv, hp_opts *o) {
    static const struct option opts[] = {{"addr", required_argument, 0, 'a'},
                                         {"service", required_argument, 0, 's'},
                                         {"timeout", required_argument, 0, 'T'},
                                         {"tls", no_argument, 0, 't'},
                                         {"tls-ca-cert", required_argument, 0, 'c'},
                                         {"tls-client-cert", required_argument, 0, 'C'},
                                         {"tls-client-key", required_argument, 0, 'K'},
                                         {"tls-server-name", required_argument, 0, 'n'},
                                         {0, 0, 0, 0}};
    char *end;
    int opt;
    *o = (hp_opts){.service = "", .timeout_ms = 1000};
    while ((opt = getopt_long_only(argc, argv, "", opts, NULL)) != -1) {
        switch (opt) {
        case 'a':
            o->addr = optarg;
            break;
        case 's':
            o->service = optarg;
            break;
        case 't':
            o->tls = 1;
            break;
        case 'c':
            o->t.ca_file = optarg;
            break;
        case 'C':
            o->t.cert_file = optarg;
            break;
        case 'K':
            o->t.key_file = optarg;
            break;
        case 'n':
            o->t.server_name_override = optarg;
            break;
        case 'T':
            o->timeout_ms = strtol(optarg, &end, 10);
            if (*optarg == '\0' || *end != '\0' || o->timeout_ms < 1 || o->timeout_ms > 600000) {
                fprintf(stderr, "upsquad-health: -timeout: milliseconds 1..600000, got \"%s\"\n",
                        optarg);
                return -1;
            }
            break;
        default:
            return -1;
        }
    }
    if (optind != argc || o->addr == NULL) {
        fprintf(stderr, "usage: upsquad-health -addr=HOST:PORT [-service=NAME] [-timeout=MS] "
                        "[-tls -tls-ca-cert=F [-tls-client-cert=F -tls-client-key=F] "
                        "[-tls-server-name=NAME]]\n");
        return -1;
    }
    if (!o->tls && (o->t.ca_file || o->t.cert_file || o->t.key_file)) {
        fprintf(stderr, "upsquad-health: -tls-* flags need -tls\n");
        return -1;
    }
    if (o->tls && (o->t.ca_file == NULL || (o->t.cert_file == NULL) != (o->t.key_file == NULL))) {
        fprintf(stderr, "upsquad-health: -tls needs -tls-ca-cert, and -tls-client-cert with "
                        "-tls-client-key\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    Grpc__Health__V1__HealthCheckRequest req = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    rpc_channel *ch = NULL;
    hp_opts o;
    char err[512];
    int rc = HP_ARGS;

    log_init("upsquad-health", LOG_ERROR);
    if (hp_parse(argc, argv, &o) != 0) goto done;
    rpc_channel_opts co = {.target = o.addr, .tls = o.tls ? &o.t : NULL};
    if (rpc_channel_new(&co, &ch, err, sizeof err) != 0) {
        fprintf(stderr, "upsquad-health: %s: %s\n", o.addr, err);
        rc = HP_CONN;
        goto done;
    }
    req.service = (char *)o.service;
    rpc_call_opts copts = {.timeout_ms = o.timeout_ms};
    int code =
        rpc_unary_call(ch, "/grpc.health.v1.Health/Check", &req.base,
                       &grpc__health__v1__health_check_response__descriptor, &copts, &resp, &st);
    if (code != 0) {
        /* 14 UNAVAILABLE, 4 DEADLINE_EXCEEDED: nothing answered */
        rc = (code == 14 || code == 4) ? HP_CONN : HP_RPC;
        fprintf(stderr, "upsquad-health: %s: status %d: %s\n", o.addr, code,
                st.message ? st.message : "");
        goto done;
    }
    Grpc__Health__V1__HealthCheckResponse *r = (Grpc__Health__V1__HealthCheckResponse *)resp;
    if (r->status == GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING) {
        printf("status: SERVING\n");
        rc = HP_OK;
    } else {
        printf("status: %d (not SERVING)\n", (int)r->status);
        rc = HP_UNHEALTHY;
    }
done:
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_status_clear(&st);
    rpc_channel_free(ch);
    return rc;
}
