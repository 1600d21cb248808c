/* The worker pool (workers.h). */
#include "workers.h"

#include <netdb.h>
#include <arpa/inet.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "grpc/health/v1/health.pb-c.h"
#include "kv.h"
#include "log.h"
#include "util.h"

struct orch_workers {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    orch_worker *w[ORCH_WORKERS_MAX];
    size_t n;
    char *targets;
    long long probe_ms;
    char *redis_url;
    const rpc_client_tls *tls;
    kv *kv; /* the probe thread's */
    int stop;
    unsigned rr;
    pthread_t thread;
    int started;
};

/* Adds a target address once (under mu); present = 1. */
static void add_addr(orch_workers *p, const char *addr) {
    for (size_t i = 0; i < p->n; i++)
        if (!strcmp(p->w[i]->addr, addr)) {
            p->w[i]->present = 1;
            return;
        }
    if (p->n == ORCH_WORKERS_MAX) {
        log_warn("workers.full", "more than %d worker addresses; %s ignored", ORCH_WORKERS_MAX,
                 addr);
        return;
    }
    orch_worker *k = calloc(1, sizeof *k);
    char err[256];
    if (!k) return;
    snprintf(k->addr, sizeof k->addr, "%s", addr);
    k->hb_load = -1;
    k->present = 1;
    rpc_channel_opts o = {.target = k->addr, .tls = p->tls};
    if (rpc_channel_new(&o, &k->ch, err, sizeof err)) {
        log_warn("workers.channel", "%s: %s", addr, err);
        free(k);
        return;
    }
    p->w[p->n++] = k;
    log_info("workers.added", "worker target %s", addr);
}

/* Re-reads the targets: plain addresses as they are, dns:/// names resolved. */
static void resolve(orch_workers *p) {
    char *list = strdup(p->targets), *save = NULL;
    if (!list) return;
    char(*found)[128] = calloc(ORCH_WORKERS_MAX, sizeof *found);
    size_t nf = 0;
    for (char *t = strtok_r(list, ", ", &save); t && found; t = strtok_r(NULL, ", ", &save)) {
        if (strncmp(t, "dns:///", 7) != 0) {
            if (nf < ORCH_WORKERS_MAX) snprintf(found[nf++], 128, "%s", t);
            continue;
        }
        char host[256], *colon;
        snprintf(host, sizeof host, "%s", t + 7);
        colon = strrchr(host, ':');
        if (!colon) continue;
        *colon = 0;
        struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *res = NULL;
        if (getaddrinfo(host, colon + 1, &hints, &res) != 0) continue;
        for (struct addrinfo *a = res; a && nf < ORCH_WORKERS_MAX; a = a->ai_next) {
            char ip[INET6_ADDRSTRLEN];
            if (a->ai_family == AF_INET)
                inet_ntop(AF_INET, &((struct sockaddr_in *)a->ai_addr)->sin_addr, ip, sizeof ip);
            else
                inet_ntop(AF_INET6, &((struct sockaddr_in6 *)a->ai_addr)->sin6_addr, ip, sizeof ip);
            snprintf(found[nf++], 128, a->ai_family == AF_INET6 ? "[%s]:%s" : "%s:%s", ip,
                     colon + 1);
        }
        freeaddrinfo(res);
    }
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n; i++)
        p->w[i]->present = 0;
    for (size_t i = 0; i < nf; i++)
        add_addr(p, found[i]);
    for (size_t i = 0; i < p->n; i++)
        if (!p->w[i]->present) p->w[i]->up = 0;
    pthread_mutex_unlock(&p->mu);
    free(found);
    free(list);
}

static int probe_one(orch_worker *k) {
    Grpc__Health__V1__HealthCheckRequest rq = GRPC__HEALTH__V1__HEALTH_CHECK_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    rpc_call_opts o = {.timeout_ms = 1000};
    int code =
        rpc_unary_call(k->ch, "/grpc.health.v1.Health/Check", &rq.base,
                       &grpc__health__v1__health_check_response__descriptor, &o, &resp, NULL);
    int up = 0;
    if (code == 0) {
        up = ((Grpc__Health__V1__HealthCheckResponse *)resp)->status ==
             GRPC__HEALTH__V1__HEALTH_CHECK_RESPONSE__SERVING_STATUS__SERVING;
        protobuf_c_message_free_unpacked(resp, NULL);
    } else if (code == 12 /* UNIMPLEMENTED: it answers, without the health service */) {
        up = 1;
    }
    return up;
}

static int heartbeat_load(orch_workers *p, const char *addr) {
    char key[192], *val = NULL, err[256];
    size_t len = 0;
    int found = 0, load = -1;
    if (!p->redis_url || !p->redis_url[0]) return -1;
    if (!p->kv && kv_connect(p->redis_url, 1000, &p->kv, err, sizeof err) != KV_OK) return -1;
    snprintf(key, sizeof key, ORCH_WORKER_KEY "%s", addr);
    if (kv_get(p->kv, key, &val, &len, &found) == KV_OK && found) load = atoi(val);
    free(val);
    return load;
}

static void probe_round(orch_workers *p) {
    orch_worker *list[ORCH_WORKERS_MAX];
    size_t n;
    resolve(p);
    pthread_mutex_lock(&p->mu);
    n = p->n;
    memcpy(list, p->w, n * sizeof *list);
    pthread_mutex_unlock(&p->mu);
    for (size_t i = 0; i < n; i++) {
        if (!list[i]->present) continue;
        int up = probe_one(list[i]);
        int load = heartbeat_load(p, list[i]->addr);
        pthread_mutex_lock(&p->mu);
        if (up != list[i]->up)
            log_info(up ? "workers.up" : "workers.down", "worker %s is %s", list[i]->addr,
                     up ? "live" : "not answering");
        list[i]->up = up;
        list[i]->hb_load = load;
        pthread_mutex_unlock(&p->mu);
    }
}

static void *probe_main(void *arg) {
    orch_workers *p = arg;
    pthread_mutex_lock(&p->mu);
    while (!p->stop) {
        pthread_mutex_unlock(&p->mu);
        probe_round(p);
        pthread_mutex_lock(&p->mu);
        struct timespec ts;
        util_deadline(&ts, p->probe_ms);
        if (!p->stop) pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

int orch_workers_start(const char *targets, long long probe_ms, const char *redis_url,
                       const rpc_client_tls *tls, orch_workers **out, char *err, size_t errlen) {
    orch_workers *p = calloc(1, sizeof *p);
    if (!p) return util_errf(err, errlen, -1, "out of memory");
    p->tls = tls;
    pthread_mutex_init(&p->mu, NULL);
    util_cond_init_monotonic(&p->cv);
    p->targets = strdup(targets ? targets : "");
    p->redis_url = redis_url ? strdup(redis_url) : NULL;
    p->probe_ms = probe_ms > 0 ? probe_ms : 1000;
    if (!p->targets) {
        orch_workers_stop(p);
        return util_errf(err, errlen, -1, "out of memory");
    }
    probe_round(p); /* the first round before serving: a fresh replica knows its workers */
    if (pthread_create(&p->thread, NULL, probe_main, p)) {
        orch_workers_stop(p);
        return util_errf(err, errlen, -1, "cannot start the worker probe thread");
    }
    p->started = 1;
    *out = p;
    return 0;
}

void orch_workers_stop(orch_workers *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    if (p->started) pthread_join(p->thread, NULL);
    for (size_t i = 0; i < p->n; i++) {
        rpc_channel_free(p->w[i]->ch);
        free(p->w[i]);
    }
    kv_close(p->kv);
    free(p->targets);
    free(p->redis_url);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p);
}

orch_worker *orch_workers_pick(orch_workers *p, const orch_worker *avoid) {
    orch_worker *best = NULL;
    int best_load = 0;
    pthread_mutex_lock(&p->mu);
    size_t n = p->n, start = n ? p->rr++ % n : 0;
    for (size_t j = 0; j < n; j++) {
        orch_worker *k = p->w[(start + j) % n];
        if (!k->up || !k->present || k == avoid) continue;
        int load = k->hb_load >= 0 ? k->hb_load + k->inflight : k->inflight;
        if (!best || load < best_load) {
            best = k;
            best_load = load;
        }
    }
    if (best) best->inflight++;
    pthread_mutex_unlock(&p->mu);
    return best;
}

orch_worker *orch_workers_pick_live(orch_workers *p, const char *addr) {
    orch_worker *hit = NULL;
    pthread_mutex_lock(&p->mu);
    for (size_t j = 0; j < p->n && !hit; j++) {
        orch_worker *k = p->w[j];
        if (k->up && k->present && !strcmp(k->addr, addr)) hit = k;
    }
    if (hit) hit->inflight++;
    pthread_mutex_unlock(&p->mu);
    return hit;
}

void orch_workers_done(orch_workers *p, orch_worker *k) {
    pthread_mutex_lock(&p->mu);
    if (k->inflight > 0) k->inflight--;
    pthread_mutex_unlock(&p->mu);
}

void orch_workers_mark_down(orch_workers *p, orch_worker *k) {
    pthread_mutex_lock(&p->mu);
    if (k->up)
        log_warn("workers.down", "worker %s failed a call; not chosen until it answers a probe",
                 k->addr);
    k->up = 0;
    pthread_mutex_unlock(&p->mu);
}

orch_worker *orch_workers_find(orch_workers *p, const char *addr) {
    orch_worker *k = NULL;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n && !k; i++)
        if (!strcmp(p->w[i]->addr, addr)) k = p->w[i];
    pthread_mutex_unlock(&p->mu);
    return k;
}

int orch_workers_live(orch_workers *p) {
    int n = 0;
    pthread_mutex_lock(&p->mu);
    for (size_t i = 0; i < p->n; i++)
        n += p->w[i]->up && p->w[i]->present;
    pthread_mutex_unlock(&p->mu);
    return n;
}
