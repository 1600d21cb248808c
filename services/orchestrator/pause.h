/* PauseSession, ResumeSession and GetProvenanceChain of LifecycleService (pause.c;
 * docs/orchestrator.md, "Pause, resume and provenance"). */
#ifndef UPSQUAD_ORCH_PAUSE_H
#define UPSQUAD_ORCH_PAUSE_H

#include "orch.h"
#include "store.h"

/* Registers the three methods (called by orch_lifecycle_register). */
int orch_pause_register(rpc_server *srv, orch *o);

#endif
