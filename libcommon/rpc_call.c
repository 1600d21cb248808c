/* Call lifetime: hooks that run when a call is freed, and the call's arena as a protobuf-c
 * allocator (pbjson's *_a builders, protobuf_c_message_unpack), so a handler can hand the
 * response memory it does not own (a PGresult, a heap tree) to the call instead of deep-copying
 * it into the arena. */
#include "rpc_internal.h"

typedef struct rpc__defer {
    struct rpc__defer *next;
    rpc_defer_fn fn;
    void *arg;
} rpc__defer;

int rpc_call_defer(rpc_call *c, rpc_defer_fn fn, void *arg) {
    if (c == NULL || fn == NULL) return RPC_EINVAL;
    rpc__defer *d = rpc__arena_alloc(&c->arena, sizeof *d);
    if (d == NULL) return RPC_ENOMEM;
    d->fn = fn;
    d->arg = arg;
    d->next = c->defers; /* newest first: run in reverse order of registration */
    c->defers = d;
    return RPC_OK;
}

/* From call_free, once no thread uses the call: the reply was sent (or the call failed). */
void rpc__call_run_defers(rpc_call *c) {
    while (c->defers) {
        rpc__defer *d = c->defers;
        c->defers = d->next;
        d->fn(d->arg);
    }
}

static void *arena_alloc(void *ud, size_t n) {
    return rpc__arena_alloc(&((rpc_call *)ud)->arena, n);
}

static void arena_free(void *ud, void *p) { /* the arena is released with the call */
    (void)ud;
    (void)p;
}

ProtobufCAllocator *rpc_call_allocator(rpc_call *c) {
    ProtobufCAllocator *a = rpc__arena_alloc(&c->arena, sizeof *a);
    if (a == NULL) return NULL;
    a->alloc = arena_alloc;
    a->free = arena_free;
    a->allocator_data = c;
    return a;
}
