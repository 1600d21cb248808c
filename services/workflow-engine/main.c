/* workflow-engine: wiring only. */
#include <stdio.h>

#include "gates.h"
#include "handlers.h"
#include "service.h"
#include "wf.h"

static wf_engine engine;

static int init(void *state, rpc_server *srv, char *err, size_t errlen) {
    wf_engine *e = state;
    if (wf_engine_start(e, wf_config_get(), err, errlen)) return -1;
    if (wf_handlers_register(srv, e) != RPC_OK) {
        snprintf(err, errlen, "cannot register WorkflowService");
        return -1;
    }
    if (wf_gates_register(srv, e) != RPC_OK) {
        snprintf(err, errlen, "cannot register the gate RPCs and ApprovalService");
        return -1;
    }
    return 0;
}

static int migrate(void *state, char *err, size_t errlen) {
    (void)state;
    return wf_engine_migrate(wf_config_get(), err, errlen);
}

static void fini(void *state) {
    wf_engine_stop(state);
}

int main(int argc, char **argv) {
    size_t n;
    const cfg_var *vars = wf_config_vars(&n);
    svc_def def = {
        .name = "workflow-engine",
        .vars = vars,
        .n_vars = n,
        .state = &engine,
        .init = init,
        .migrate = migrate,
        .fini = fini,
    };
    return svc_main(&def, argc, argv);
}
