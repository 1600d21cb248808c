/* One error vocabulary for libcommon.
 *
 * Every module returns 0 for success and a negative code of its own on failure; the ranges are
 * disjoint, so a code says which module it came from and can be passed up unchanged:
 *
 *   RPC_E*   -1 ..  -99   rpc.h      (library codes, never on the wire)
 *   DB_E*  -101 .. -199   db.h
 *   BUS_E* -201 .. -299   bus.h
 *   KV_E*  -301 .. -399   kv.h
 *
 * Non-negative values are gRPC status codes (RPC_OK .. RPC_UNAUTHENTICATED, equal to
 * grpc_status_code, checked at compile time in err.c). A handler maps a failure to the status
 * it sends with err_to_status(), so no service writes that switch:
 *
 *   return rpc_error(call, err_to_status(rc), "loading the run: %s", err);
 *
 * The mapping (gRPC's own guidance): a missed deadline is DEADLINE_EXCEEDED; what a retry may
 * fix (connection lost, pool exhausted, server-side timeout, nobody listening) is UNAVAILABLE;
 * a concurrency conflict is ABORTED; a unique violation ALREADY_EXISTS; a foreign-key
 * violation FAILED_PRECONDITION; a check violation INVALID_ARGUMENT (the handler should have
 * refused the input first, naming the field); a privilege refusal PERMISSION_DENIED; memory
 * and bounds RESOURCE_EXHAUSTED; everything else (a bug, a bad argument of ours) INTERNAL.
 * Auth codes (auth.h) are not mapped: a failed verification is always UNAUTHENTICATED. */
#ifndef UPSQUAD_ERR_H
#define UPSQUAD_ERR_H

enum {
    ERR_RPC_BASE = 0,   /* RPC_E*: -1 .. -99 */
    ERR_DB_BASE = 100,  /* DB_E*: -101 .. -199 */
    ERR_BUS_BASE = 200, /* BUS_E*: -201 .. -299 */
    ERR_KV_BASE = 300,  /* KV_E*: -301 .. -399 */
};

/* The gRPC status (0..16) for any libcommon code: a status passes through unchanged, a
 * negative module code is mapped as above, an unknown one is RPC_INTERNAL. */
int err_to_status(int code);

/* Short constant text of any libcommon code or gRPC status ("deadline exceeded",
 * "NOT_FOUND"); never NULL. */
const char *err_str(int code);

/* "db", "bus", "kv", "rpc" or "status" for a code, by its range. */
const char *err_module(int code);

#endif
