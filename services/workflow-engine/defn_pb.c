/* See defn_pb.h. One allocation for the message, its pointer array and its items. */
#include "defn_pb.h"

#include <stdlib.h>

typedef Upsquad__Workflow__V1__DefinitionValidationError__FieldViolation defn_pb_violation;

int defn_violations_to_pb(const defn_violations *v, defn_pb_error **out) {
    if (!v || !out) return DEFN_ERR_ARG;
    defn_pb_error *m =
        malloc(sizeof *m + v->n * (sizeof(defn_pb_violation *) + sizeof(defn_pb_violation)));
    if (!m) return DEFN_ERR_NOMEM;
    upsquad__workflow__v1__definition_validation_error__init(m);
    defn_pb_violation **ptrs = (defn_pb_violation **)(m + 1);
    defn_pb_violation *items = (defn_pb_violation *)(ptrs + v->n);
    for (size_t i = 0; i < v->n; i++) {
        upsquad__workflow__v1__definition_validation_error__field_violation__init(&items[i]);
        items[i].instance_location = v->items[i].instance_location;
        items[i].message = v->items[i].message;
        ptrs[i] = &items[i];
    }
    m->n_violations = v->n;
    m->violations = v->n ? ptrs : NULL;
    *out = m;
    return DEFN_OK;
}

void defn_violations_pb_free(defn_pb_error *m) {
    free(m);
}
