/* Workflow agent steps (orch.h): placeholder until the consumer lands. */
#include "orch.h"

int orch_steps_start(orch *o, char *err, size_t errlen) {
    (void)o;
    (void)err;
    (void)errlen;
    return 0;
}

void orch_steps_stop(orch *o) {
    (void)o;
}
