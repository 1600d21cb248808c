/* model-registry: wiring only. */
#include <stdio.h>

#include "handlers.h"
#include "registry.h"
#include "service.h"

static mr_registry registry;

static int init(void *state, rpc_server *srv, char *err, size_t errlen) {
    mr_registry *r = state;
    if (mr_registry_start(r, mr_config_get(), err, errlen)) return -1;
    if (mr_handlers_register(srv, r) != RPC_OK) {
        snprintf(err, errlen, "cannot register ModelRegistryService");
        return -1;
    }
    return 0;
}

static int migrate(void *state, char *err, size_t errlen) {
    (void)state;
    return mr_registry_migrate(mr_config_get(), err, errlen);
}

static void reload(void *state) {
    mr_registry_request(state, MR_WANT_FILE);
}

static void fini(void *state) {
    mr_registry_stop(state);
}

int main(int argc, char **argv) {
    size_t n;
    const cfg_var *vars = mr_config_vars(&n);
    svc_def def = {
        .name = "model-registry",
        .vars = vars,
        .n_vars = n,
        .state = &registry,
        .init = init,
        .migrate = migrate,
        .reload = reload,
        .fini = fini,
    };
    return svc_main(&def, argc, argv);
}
