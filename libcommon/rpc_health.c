/* grpc.health.v1.Health: Check and Watch, for Kubernetes gRPC probes and load balancers.
 * Watch streams are detached: a status change is pushed to every watcher of the service
 * from whichever thread changes it. */
#include <stdlib.h>
#include <string.h>

#include "grpc/health/v1/health.pb-c.h"
#include "rpc_internal.h"

#define HEALTH_MAX_SERVICES 64
#define HEALTH_NAME_MAX 128

typedef Grpc__Health__V1__HealthCheckResponse HealthResp;

typedef struct watcher {
    struct watcher *next;
    rpc_call *call;
    char service[HEALTH_NAME_MAX];
} watcher;

struct rpc__health {
    pthread_mutex_t mu;
    size_t n;
    char names[HEALTH_MAX_SERVICES][HEALTH_NAME_MAX];
    int status[HEALTH_MAX_SERVICES]; /* ServingStatus values */
    watcher *watchers;
    int n_watchers; /* bounded by the server's max_health_watches */
};

int rpc__health_new(rpc__health **out) {
    rpc__health *h = calloc(1, sizeof *h);
    if (h == NULL) return -1;
    pthread_mutex_init(&h->mu, NULL);
    *out = h;
    return 0;
}

void rpc__health_free(rpc__health *h) {
    if (h == NULL) return;
    /* watchers are gone by now: their streams were finished at shutdown */
    pthread_mutex_destroy(&h->mu);
    free(h);
}

static int find_locked(rpc__health *h, const char *service) {
    for (size_t i = 0; i < h->n; i++)
        if (strcmp(h->names[i], service) == 0) return (int)i;
    return -1;
}

static rpc_frame *status_frame(int status) {
    HealthResp r = GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__INIT;
    r.status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)status;
    return rpc_frame_encode(&r.base);
}

static void push_status(rpc_call *c, int status) {
    rpc_frame *f = status_frame(status);
    if (f == NULL) return;
    (void)rpc_stream_push(c, f);
    rpc_frame_unref(f);
}

void rpc__health_set(rpc__health *h, const char *service, int serving) {
    int st = serving ? GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING
                     : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__NOT_SERVING;
    pthread_mutex_lock(&h->mu);
    int i = find_locked(h, service);
    if (i < 0 && h->n < HEALTH_MAX_SERVICES && strlen(service) < HEALTH_NAME_MAX) {
        i = (int)h->n++;
        strcpy(h->names[i], service);
        h->status[i] = -1;
    }
    if (i >= 0 && h->status[i] != st) {
        h->status[i] = st;
        /* encoded once, the frame shared by every watcher of the service (refcounted). A
         * watcher whose queue is full missed nothing that matters: the newest status is what
         * counts and a later change is pushed again. */
        rpc_frame *f = NULL;
        for (watcher *w = h->watchers; w; w = w->next) {
            if (strcmp(w->service, service) != 0) continue;
            if (f == NULL && (f = status_frame(st)) == NULL) break;
            (void)rpc_stream_push(w->call, f);
        }
        rpc_frame_unref(f);
    }
    pthread_mutex_unlock(&h->mu);
}

void rpc__health_set_all(rpc__health *h, int serving) {
    char names[HEALTH_MAX_SERVICES][HEALTH_NAME_MAX];
    pthread_mutex_lock(&h->mu);
    size_t n = h->n;
    memcpy(names, h->names, sizeof names);
    pthread_mutex_unlock(&h->mu);
    for (size_t i = 0; i < n; i++)
        rpc__health_set(h, names[i], serving);
}

static int health_check(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                        void *ud) {
    rpc__health *h = ud;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    HealthResp *out = (HealthResp *)resp;
    pthread_mutex_lock(&h->mu);
    int i = find_locked(h, r->service);
    int st = i >= 0 ? h->status[i] : -1;
    pthread_mutex_unlock(&h->mu);
    if (st < 0) return rpc_error(call, RPC_NOT_FOUND, "unknown service \"%s\"", r->service);
    out->status = (Grpc__Health__V1__HealthCheckResponse__ServingStatus)st;
    return RPC_OK;
}

static void watch_closed(rpc_call *call, void *ud) {
    rpc__health *h = call->method->m.ud;
    watcher *w = ud;
    pthread_mutex_lock(&h->mu);
    for (watcher **p = &h->watchers; *p; p = &(*p)->next)
        if (*p == w) {
            *p = w->next;
            h->n_watchers--;
            break;
        }
    pthread_mutex_unlock(&h->mu);
    rpc_call_unref(w->call);
    free(w);
}

static void watch_unreserve(rpc__health *h) {
    pthread_mutex_lock(&h->mu);
    h->n_watchers--;
    pthread_mutex_unlock(&h->mu);
}

static int health_watch(rpc_call *call, const ProtobufCMessage *req, void *ud) {
    rpc__health *h = ud;
    const Grpc__Health__V1__HealthCheckRequest *r = (const void *)req;
    if (strlen(r->service) >= HEALTH_NAME_MAX)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "service: longer than %d bytes",
                         HEALTH_NAME_MAX - 1);
    /* Watches need no token: their own small budget keeps anonymous clients from holding the
     * stream slots authenticated streams need (docs/rpc.md, "Hardening"). */
    int budget = rpc__server_opts(call->srv)->max_health_watches;
    pthread_mutex_lock(&h->mu);
    int full = h->n_watchers >= budget;
    if (!full) h->n_watchers++; /* reserved; released below or by watch_closed */
    pthread_mutex_unlock(&h->mu);
    if (full)
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "too many health watches (limit %d)",
                         budget);
    watcher *w = calloc(1, sizeof *w);
    if (w == NULL) {
        watch_unreserve(h);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    strcpy(w->service, r->service);
    /* Registered under h->mu before detaching, so watch_closed (which takes h->mu) can never
     * run before the watcher is in the list. */
    pthread_mutex_lock(&h->mu);
    w->call = rpc_stream_detach(call, watch_closed, w);
    if (w->call == NULL) {
        h->n_watchers--;
        pthread_mutex_unlock(&h->mu);
        free(w);
        return RPC_CANCELLED;
    }
    w->next = h->watchers;
    h->watchers = w;
    int i = find_locked(h, r->service);
    push_status(w->call,
                i >= 0 ? h->status[i]
                       : GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVICE_UNKNOWN);
    pthread_mutex_unlock(&h->mu);
    return RPC_EDETACHED;
}

int rpc__health_register(rpc_server *s) {
    rpc__health *h = rpc__server_health(s);
    rpc_method m[2] = {
        {"/grpc.health.v1.Health/Check", RPC_UNARY, RPC_AUTH_NONE,
         &grpc__health__v1__health_check_request__descriptor,
         &grpc__health__v1__health_check_response__descriptor, health_check, NULL, h},
        {"/grpc.health.v1.Health/Watch", RPC_SERVER_STREAM, RPC_AUTH_NONE,
         &grpc__health__v1__health_check_request__descriptor,
         &grpc__health__v1__health_check_response__descriptor, NULL, health_watch, h},
    };
    return rpc_server_add(s, m, 2);
}
