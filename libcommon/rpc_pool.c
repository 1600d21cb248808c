/* The blocking-handler pool: unary handlers of methods flagged RPC_BLOCKING run here, on a
 * fixed set of threads, instead of inline on a completion-queue thread, so that a handler
 * waiting on Postgres never delays Health/Check or the other calls of its queue.
 *
 * Bounds: `threads` handlers run at once; at most `cap` more calls wait in a ring. A call that
 * finds the ring full is refused (rpc__pool_submit returns -1) and the server answers it
 * RESOURCE_EXHAUSTED at once: a saturated service sheds load instead of queueing without
 * limit behind the core's own unbounded queue of incoming calls.
 *
 * Ownership: a submitted call's dispatch reference moves to the pool; `run` consumes it. On
 * stop, the workers drain what is queued (each call still gets its answer) and exit. */
#include <assert.h>
#include <stdlib.h>

#include "rpc_internal.h"

struct rpc__pool {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    rpc_call **q; /* ring of cap */
    size_t cap, head, len;
    int stop;
    int n_threads, started;
    pthread_t *thr;
    void (*run)(rpc_call *c);
    metric *m_queued, *m_busy;
};

static void *pool_worker(void *arg) {
    rpc__pool *p = arg;
    for (;;) {
        pthread_mutex_lock(&p->mu);
        while (p->len == 0 && !p->stop)
            pthread_cond_wait(&p->cv, &p->mu);
        if (p->len == 0) { /* stopping and drained */
            pthread_mutex_unlock(&p->mu);
            break;
        }
        rpc_call *c = p->q[p->head];
        p->head = (p->head + 1) % p->cap;
        p->len--;
        pthread_mutex_unlock(&p->mu);
        metric_add(p->m_queued, -1);
        metric_add(p->m_busy, 1);
        p->run(c);
        metric_add(p->m_busy, -1);
    }
    return NULL;
}

int rpc__pool_new(int threads, int cap, void (*run)(rpc_call *c), rpc__pool **out) {
    rpc__pool *p = calloc(1, sizeof *p);
    if (p == NULL) return RPC_ENOMEM;
    p->cap = (size_t)(cap > 0 ? cap : 1);
    p->q = calloc(p->cap, sizeof *p->q);
    p->thr = calloc((size_t)(threads > 0 ? threads : 1), sizeof *p->thr);
    if (p->q == NULL || p->thr == NULL) {
        free(p->q);
        free(p->thr);
        free(p);
        return RPC_ENOMEM;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    p->n_threads = threads > 0 ? threads : 1;
    p->run = run;
    p->m_queued = metrics_gauge("rpc_server_blocking_queued",
                                "blocking calls waiting for a pool thread", NULL);
    p->m_busy = metrics_gauge("rpc_server_blocking_busy", "pool threads running a handler", NULL);
    *out = p;
    return RPC_OK;
}

int rpc__pool_start(rpc__pool *p) {
    for (; p->started < p->n_threads; p->started++)
        if (rpc__thread_create(&p->thr[p->started], NULL, pool_worker, p) != 0) return RPC_ENOMEM;
    return RPC_OK;
}

int rpc__pool_submit(rpc__pool *p, rpc_call *c) {
    int rc = -1;
    pthread_mutex_lock(&p->mu);
    assert(p->len <= p->cap && "blocking queue bound");
    if (!p->stop && p->len < p->cap) {
        p->q[(p->head + p->len) % p->cap] = c;
        p->len++;
        rc = 0;
        pthread_cond_signal(&p->cv);
    }
    pthread_mutex_unlock(&p->mu);
    if (rc == 0) metric_add(p->m_queued, 1);
    return rc;
}

void rpc__pool_stop(rpc__pool *p) {
    if (p == NULL) return;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++)
        pthread_join(p->thr[i], NULL);
    p->started = 0;
}

void rpc__pool_free(rpc__pool *p) {
    if (p == NULL) return;
    rpc__pool_stop(p);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    free(p->q);
    free(p->thr);
    free(p);
}
