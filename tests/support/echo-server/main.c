/* echo-server: wiring only. */
#include <stdio.h>

#include "echo.h"
#include "service.h"

static int init(void *state, rpc_server *srv, char *err, size_t errlen) {
    (void)state;
    if (echo_register(srv) != RPC_OK) {
        snprintf(err, errlen, "cannot register EchoService");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    svc_def def = {.name = "echo-server", .init = init};
    return svc_main(&def, argc, argv);
}
