/* upsquad.runtime.v1.ModelRegistryService handlers: ListModels, GetModelRecommendation,
 * CompareModels. Every method requires a valid token (RPC_AUTH_REQUIRED). Handlers read one
 * snapshot reference for the whole call and never touch the database. */
#ifndef UPSQUAD_MR_HANDLERS_H
#define UPSQUAD_MR_HANDLERS_H

#include "registry.h"
#include "rpc.h"

/* Registers the three methods with `r` (borrowed; must outlive the server) as their state. */
int mr_handlers_register(rpc_server *srv, mr_registry *r);

#endif
