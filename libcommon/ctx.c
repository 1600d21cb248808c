/* See ctx.h. */
#include "ctx.h"

#include <time.h>

static _Thread_local int64_t ctx__deadline_ns; /* CLOCK_MONOTONIC; 0 = none */

static int64_t ctx__now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

void ctx_set_deadline_ms(int64_t ms) {
    if (ms == CTX_NO_DEADLINE) {
        ctx__deadline_ns = 0;
        return;
    }
    if (ms < 0) ms = 0;
    if (ms > INT64_MAX / 2000000) ms = INT64_MAX / 2000000; /* no overflow: centuries */
    int64_t d = ctx__now_ns() + ms * 1000000;
    ctx__deadline_ns = d ? d : 1;
}

void ctx_clear(void) {
    ctx__deadline_ns = 0;
}

int64_t ctx_deadline_ms(void) {
    if (ctx__deadline_ns == 0) return CTX_NO_DEADLINE;
    int64_t left = ctx__deadline_ns - ctx__now_ns();
    /* round up: 0.4 ms left is not yet expired */
    return left <= 0 ? left / 1000000 : (left + 999999) / 1000000;
}

int ctx_expired(void) {
    return ctx__deadline_ns != 0 && ctx__now_ns() >= ctx__deadline_ns;
}
