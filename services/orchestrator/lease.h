/* Leases of the chat turns in flight (docs/orchestrator.md, "Dead turns"): this replica renews
 * the leases of the turns it relays, and reclaims the turns of any replica that stopped renewing
 * theirs (a replica killed mid-turn), so a dead turn stops counting in flight, stops showing
 * THINKING and lets a pending pause commit within a bounded time. One keeper thread per process
 * does both, every third of UPSQUAD_TURN_LEASE_TTL. */
#ifndef UPSQUAD_ORCH_LEASE_H
#define UPSQUAD_ORCH_LEASE_H

#include "orch.h"

/* One held lease; lives in its relay's frame (no allocation, so no bound beyond the relays
 * themselves: UPSQUAD_RPC_STREAM_WORKERS). */
typedef struct orch_lease {
    char action_id[37];
    struct orch_lease *prev, *next;
    int held;
} orch_lease;

/* From the commit of the turn's begin (orch_store_turn_begin wrote the lease) to the commit of
 * its end; dropping twice, or a lease never held, is a no-op. */
void orch_lease_hold(orch_lease *l, const char *action_id);
void orch_lease_drop(orch_lease *l);

/* The keeper thread (one per process); its first round runs at once, so a restarted replica
 * reclaims what it finds stale without waiting. */
int orch_lease_start(orch *o);
void orch_lease_stop(void);

#endif
