/* EchoService: the smallest complete service on libcommon, used to test and benchmark the
 * RPC layer. A real service is built the same way: handlers + a method table + main.c. */
#ifndef ECHO_H
#define ECHO_H

#include "rpc.h"

int echo_register(rpc_server *srv);

#endif
