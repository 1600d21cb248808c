/* orchestrator: wiring only. */
#include <stdio.h>
#include <stdlib.h>

#include "orch.h"
#include "pause.h"
#include "service.h"

static orch state;

static int init(void *st, rpc_server *srv, char *err, size_t errlen) {
    orch *o = st;
    if (orch_start(o, orch_config_get(), err, errlen)) return -1;
    if (orch_lifecycle_register(srv, o) != RPC_OK || orch_pause_register(srv, o) != RPC_OK ||
        orch_tree_register(srv, o) != RPC_OK || orch_runtime_register(srv, o) != RPC_OK) {
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
    /* Every chat turn holds a stream worker for its whole relay: a default sized for that,
     * unless the environment says otherwise (docs/orchestrator.md). The unary handlers that
     * wait on Postgres or on workers are RPC_BLOCKING (the blocking pool), so the completion-
     * queue threads only do I/O: libcommon's one, since each more thread polling the same
     * connections costs wake-ups on every relayed token (docs/benchmarks.md, "orchestrator
     * relay"). */
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
