/* devworker: wiring only (docs/devworker.md). */
#include <stdio.h>

#include "handlers.h"
#include "service.h"
#include "worker.h"

static dw_worker worker;

static int init(void *state, rpc_server *srv, char *err, size_t errlen) {
    dw_worker *w = state;
    if (dw_worker_start(w, dw_config_get(), srv, err, errlen) != 0) return -1;
    if (dw_handlers_register(srv, w) != RPC_OK) {
        snprintf(err, errlen, "cannot register RuntimeService");
        return -1;
    }
    return 0;
}

static void fini(void *state) {
    dw_worker_stop(state);
}

int main(int argc, char **argv) {
    size_t n;
    const cfg_var *vars = dw_config_vars(&n);
    svc_def def = {
        .name = "devworker",
        .vars = vars,
        .n_vars = n,
        .state = &worker,
        .init = init,
        .fini = fini,
    };
    return svc_main(&def, argc, argv);
}
