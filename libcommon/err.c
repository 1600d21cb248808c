/* See err.h. */
#include "err.h"

#include <grpc/status.h>

#include "bus.h"
#include "db.h"
#include "kv.h"
#include "rpc.h"

/* RPC_* are sent as grpc_status_code values: they must be the same numbers. */
#define ERR_SAME(a, b) _Static_assert((int)(a) == (int)(b), #a " != " #b)
ERR_SAME(RPC_OK, GRPC_STATUS_OK);
ERR_SAME(RPC_CANCELLED, GRPC_STATUS_CANCELLED);
ERR_SAME(RPC_UNKNOWN, GRPC_STATUS_UNKNOWN);
ERR_SAME(RPC_INVALID_ARGUMENT, GRPC_STATUS_INVALID_ARGUMENT);
ERR_SAME(RPC_DEADLINE_EXCEEDED, GRPC_STATUS_DEADLINE_EXCEEDED);
ERR_SAME(RPC_NOT_FOUND, GRPC_STATUS_NOT_FOUND);
ERR_SAME(RPC_ALREADY_EXISTS, GRPC_STATUS_ALREADY_EXISTS);
ERR_SAME(RPC_PERMISSION_DENIED, GRPC_STATUS_PERMISSION_DENIED);
ERR_SAME(RPC_RESOURCE_EXHAUSTED, GRPC_STATUS_RESOURCE_EXHAUSTED);
ERR_SAME(RPC_FAILED_PRECONDITION, GRPC_STATUS_FAILED_PRECONDITION);
ERR_SAME(RPC_ABORTED, GRPC_STATUS_ABORTED);
ERR_SAME(RPC_OUT_OF_RANGE, GRPC_STATUS_OUT_OF_RANGE);
ERR_SAME(RPC_UNIMPLEMENTED, GRPC_STATUS_UNIMPLEMENTED);
ERR_SAME(RPC_INTERNAL, GRPC_STATUS_INTERNAL);
ERR_SAME(RPC_UNAVAILABLE, GRPC_STATUS_UNAVAILABLE);
ERR_SAME(RPC_DATA_LOSS, GRPC_STATUS_DATA_LOSS);
ERR_SAME(RPC_UNAUTHENTICATED, GRPC_STATUS_UNAUTHENTICATED);

/* The modules' ranges are disjoint (the old overlap: DB_ETIMEOUT == RPC_ECLOSED). */
#define ERR_IN(code, base) _Static_assert((int)(code) < -(base) && (int)(code) > -(base)-100, #code)
ERR_IN(RPC_EFULL, ERR_RPC_BASE);
ERR_IN(RPC_EDETACHED, ERR_RPC_BASE);
ERR_IN(DB_ERR, ERR_DB_BASE);
ERR_IN(DB_EDEADLINE, ERR_DB_BASE);
ERR_IN(BUS_ERR, ERR_BUS_BASE);
ERR_IN(BUS_ENOMEM, ERR_BUS_BASE);
ERR_IN(KV_EIO, ERR_KV_BASE);
ERR_IN(KV_EFULL, ERR_KV_BASE);

static const char *const status_names[17] = {
    "OK",        "CANCELLED",      "UNKNOWN",           "INVALID_ARGUMENT",   "DEADLINE_EXCEEDED",
    "NOT_FOUND", "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED",   "OUT_OF_RANGE",   "UNIMPLEMENTED",     "INTERNAL",           "UNAVAILABLE",
    "DATA_LOSS", "UNAUTHENTICATED"};

int err_to_status(int code) {
    if (code >= 0) return code <= RPC_UNAUTHENTICATED ? code : RPC_UNKNOWN;
    switch (code) {
    case RPC_EFULL:
    case RPC_ENOMEM:
    case DB_ENOMEM:
    case BUS_ENOMEM:
    case KV_ENOMEM:
    case KV_EFULL:
        return RPC_RESOURCE_EXHAUSTED;
    case RPC_ECLOSED:
        return RPC_CANCELLED;
    case DB_EDEADLINE:
    case BUS_ETIMEOUT:
        return RPC_DEADLINE_EXCEEDED;
    case DB_ETIMEOUT:
    case DB_ECONN:
    case DB_ECANCELED:
    case BUS_ENORESP:
    case BUS_EFULL:
    case BUS_ECLOSED:
    case KV_EIO:
        return RPC_UNAVAILABLE;
    case DB_EUNIQUE:
        return RPC_ALREADY_EXISTS;
    case DB_EFOREIGN:
        return RPC_FAILED_PRECONDITION;
    case DB_ECHECK:
        return RPC_INVALID_ARGUMENT;
    case DB_ESERIALIZE:
        return RPC_ABORTED;
    case DB_EPRIVILEGE:
        return RPC_PERMISSION_DENIED;
    default: /* DB_ERR, DB_EINVAL, DB_ECHECKSUM, DB_EIO, BUS_ERR, BUS_EINVAL, KV_EREPLY, ... */
        return RPC_INTERNAL;
    }
}

const char *err_module(int code) {
    if (code >= 0) return "status";
    if (code > -ERR_DB_BASE) return "rpc";
    if (code > -ERR_BUS_BASE) return "db";
    if (code > -ERR_KV_BASE) return "bus";
    if (code > -(ERR_KV_BASE + 100)) return "kv";
    return "unknown";
}

const char *err_str(int code) {
    if (code >= 0) return code <= RPC_UNAUTHENTICATED ? status_names[code] : "unknown status";
    if (code <= -ERR_DB_BASE && code > -ERR_BUS_BASE) return db_strerror(code);
    switch (code) {
    case RPC_EFULL:
        return "stream queue full";
    case RPC_ECLOSED:
        return "stream closed";
    case RPC_ENOMEM:
    case BUS_ENOMEM:
    case KV_ENOMEM:
        return "out of memory";
    case RPC_EINVAL:
    case BUS_EINVAL:
    case KV_EINVAL:
        return "invalid argument";
    case RPC_EDETACHED:
        return "stream detached";
    case BUS_ERR:
        return "bus error";
    case BUS_ETIMEOUT:
        return "bus timeout";
    case BUS_ENORESP:
        return "no responders";
    case BUS_EFULL:
        return "bus reconnect buffer full";
    case BUS_ECLOSED:
        return "bus connection closed";
    case KV_EIO:
        return "redis connection failed";
    case KV_EREPLY:
        return "redis error reply";
    case KV_EFULL:
        return "redis pipeline full";
    default:
        return "unknown error";
    }
}
