/* PauseSession, ResumeSession and GetProvenanceChain of LifecycleService (pause.c;
 * docs/orchestrator.md, "Pause, resume and provenance"). */
#ifndef UPSQUAD_ORCH_PAUSE_H
#define UPSQUAD_ORCH_PAUSE_H

#include "orch.h"
#include "store.h"

/* Registers the three methods (called by orch_lifecycle_register). */
int orch_pause_register(rpc_server *srv, orch *o);

/* Sends SessionPausedEvent for a committed pause on a SendMessage stream. */
int orch_pause_send_event(rpc_call *call, const orch_pause *pz);

#endif
