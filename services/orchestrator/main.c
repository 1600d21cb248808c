/* orchestrator: wiring only. */
#include <stdio.h>
#include <stdlib.h>

#include "orch.h"
#include "service.h"

static orch state;

static int init(void *st, rpc_server *srv, char *err, size_t errlen) {
    orch *o = st;
    if (orch_start(o, orch_config_get(), err, errlen)) return -1;
    if (orch_lifecycle_register(srv, o) != RPC_OK || orch_runtime_register(srv, o) != RPC_OK) {
        snprintf(err, errlen, "cannot register LifecycleService / RuntimeService");
        return -1;
    }
    return 0;
}

static int migrate(void *st, char *err, size_t errlen) {
    (void)st;
    return orch_migrate(orch_config_get(), err, errlen);
}

static void fini(void *st) {
    orch_stop(st);
}

int main(int argc, char **argv) {
    size_t n;
    /* Unary handlers block on Postgres and on worker calls (InitWorkerSession), and every chat
     * turn holds a stream worker for its whole relay: defaults sized for that, unless the
     * environment says otherwise (docs/orchestrator.md). */
    setenv("UPSQUAD_RPC_UNARY_THREADS", "4", 0);
    setenv("UPSQUAD_RPC_STREAM_WORKERS", "64", 0);
    const cfg_var *vars = orch_config_vars(&n);
    svc_def def = {
        .name = "orchestrator",
        .vars = vars,
        .n_vars = n,
        .state = &state,
        .init = init,
        .migrate = migrate,
        .fini = fini,
    };
    return svc_main(&def, argc, argv);
}
