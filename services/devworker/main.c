/* devworker: wiring only (docs/devworker.md). */
#include <stdio.h>
#include <stdlib.h>

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
    /* A devworker step mostly waits (delay_ms, sleep_ms, hang), holding a stream worker thread
     * all along: a larger default pool, so a test with many waiting steps does not queue the
     * next one behind them. The variable still wins when set (docs/devworker.md). */
    setenv("UPSQUAD_RPC_STREAM_WORKERS", "128", 0);
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
