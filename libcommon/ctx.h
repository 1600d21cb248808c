/* The deadline of the work this thread is doing, carried implicitly.
 *
 * A handler's caller gave it a deadline; everything the handler does on its thread (a
 * Postgres transaction, a call to another service) should end by then, because nobody waits
 * for an answer after it. The RPC server sets the calling thread's deadline before it runs a
 * unary handler (inline or on the blocking pool) and clears it afterwards; `db` reads it to set
 * Postgres' statement_timeout (SET LOCAL) so that a query never outlives its caller.
 *
 * The value is per thread (no locks): code that hands work to another thread passes the
 * deadline explicitly (ctx_deadline_ms / ctx_set_deadline_ms on the other side). */
#ifndef UPSQUAD_CTX_H
#define UPSQUAD_CTX_H

#include <stdint.h>

#define CTX_NO_DEADLINE INT64_MAX

/* Sets this thread's deadline `ms_from_now` milliseconds from now (<= 0: already passed);
 * CTX_NO_DEADLINE clears it. */
void ctx_set_deadline_ms(int64_t ms_from_now);
/* Clears this thread's deadline. */
void ctx_clear(void);
/* Milliseconds left (<= 0 once passed); CTX_NO_DEADLINE when the thread has none. */
int64_t ctx_deadline_ms(void);
/* Non-zero when this thread has a deadline and it has passed. */
int ctx_expired(void);

#endif
