/* Validation violations as the wire's upsquad.workflow.v1.DefinitionValidationError, the
 * google.rpc.Status detail attached to INVALID_ARGUMENT (rpc_error_detail). Kept apart from
 * defn.h so the validator itself needs no protobuf. */
#ifndef DEFN_PB_H
#define DEFN_PB_H

#include "defn.h"
#include "upsquad/workflow/v1/workflow.pb-c.h"

typedef Upsquad__Workflow__V1__DefinitionValidationError defn_pb_error;

/* *out borrows the strings of v (free it first, with defn_violations_pb_free). */
int defn_violations_to_pb(const defn_violations *v, defn_pb_error **out);
void defn_violations_pb_free(defn_pb_error *m);

#endif
