/* stream-hub: wiring only. */
#include <stdio.h>

#include "handlers.h"
#include "hub.h"
#include "service.h"

static hub H;

static int init(void *state, rpc_server *srv, char *err, size_t errlen) {
    hub *h = state;
    if (hub_start(h, hub_config_get(), err, errlen)) return -1;
    if (hub_handlers_register(srv, h) != RPC_OK) {
        snprintf(err, errlen, "cannot register the WorkflowService streaming methods");
        return -1;
    }
    return 0;
}

static int migrate(void *state, char *err, size_t errlen) {
    (void)state;
    return hub_migrate(hub_config_get(), err, errlen);
}

static void fini(void *state) {
    hub_stop(state);
}

int main(int argc, char **argv) {
    size_t n;
    const cfg_var *vars = hub_config_vars(&n);
    svc_def def = {
        .name = "stream-hub",
        .vars = vars,
        .n_vars = n,
        .state = &H,
        .init = init,
        .migrate = migrate,
        .fini = fini,
    };
    return svc_main(&def, argc, argv);
}
