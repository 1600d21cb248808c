/* LifecycleService's subagent-tree methods: ListChildren, GetParentSession, GetSubagentTree,
 * TerminateSubagentTree (spec: upsquad/runtime/v1/lifecycle.proto; docs/orchestrator.md,
 * "Subagent trees"). A tree is the sessions' parent_session_id links; each edge's bridge row
 * (subagent_invocations) carries the role and the result. Tenant from the token only: another
 * org's session reads as NOT_FOUND (row-level security makes it invisible). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fields.h"
#include "ids.h"
#include "log.h"
#include "pagetok.h"
#include "session.h"
#include "util.h"

typedef Upsquad__Runtime__V1__SubagentLink SubagentLink;
typedef Upsquad__Runtime__V1__ListChildrenRequest ListChildrenRequest;
typedef Upsquad__Runtime__V1__ListChildrenResponse ListChildrenResponse;
typedef Upsquad__Runtime__V1__GetParentSessionRequest GetParentSessionRequest;
typedef Upsquad__Runtime__V1__GetParentSessionResponse GetParentSessionResponse;
typedef Upsquad__Runtime__V1__GetSubagentTreeRequest GetSubagentTreeRequest;
typedef Upsquad__Runtime__V1__GetSubagentTreeResponse GetSubagentTreeResponse;
typedef Upsquad__Runtime__V1__TerminateSubagentTreeRequest TerminateTreeRequest;
typedef Upsquad__Runtime__V1__TerminateSubagentTreeResponse TerminateTreeResponse;

#define CHILDREN_DEFAULT 20 /* spec: page_size 0 uses the default (20) */
#define CHILDREN_MAX 100    /* spec: 1..100; more is served as 100 */
#define TREE_DEPTH_DEFAULT 3
#define TREE_DEPTH_MAX 10
#define TREE_FANOUT 50        /* children of one node in a tree response */
#define TREE_NODES 1000       /* nodes of one tree response */
#define TERMINATE_MAX 1000    /* sessions one cascade ends (more: FAILED_PRECONDITION) */
#define TERMINATE_TELL_MAX 32 /* workers told per cascade; the others release on their own */
#define REASON_MAX 1024

/* HMAC key of ListChildren's page tokens: derived from the service's token secret so every
 * replica accepts the others' tokens; set once by orch_tree_register before serving. */
static unsigned char page_key[32];

static int not_found(rpc_call *call, const char *sid) {
    return rpc_error(call, RPC_NOT_FOUND, "session_id: no session %s", sid);
}

/* A SubagentLink in the call's arena; NULL when out of memory. */
static SubagentLink *link_msg(rpc_call *call, const orch_link *l) {
    SubagentLink *m = rpc_alloc(call, sizeof *m);
    if (!m) return NULL;
    upsquad__runtime__v1__subagent_link__init(m);
    m->session_id = rpc_strdup(call, l->session_id);
    m->parent_session_id = rpc_strdup(call, l->parent_session_id);
    m->root_session_id = rpc_strdup(call, l->root_session_id);
    m->delegation_depth = l->depth;
    m->agent_id = rpc_strdup(call, l->agent_id);
    m->subagent_role = rpc_strdup(call, l->role);
    m->subagent_invocation_id = rpc_strdup(call, l->invocation_id);
    m->status = rpc_strdup(call, l->state); /* the lifecycle state, lowercase */
    if (l->started_us) m->started_at = orch_ts_us(call, l->started_us);
    if (l->ended_us) m->ended_at = orch_ts_us(call, l->ended_us); /* unset on live sessions */
    m->result_status = rpc_strdup(call, l->result_status);
    m->result_error_code = rpc_strdup(call, l->error_code);
    return m;
}

/* rows as repeated SubagentLink (arena); RPC_OK or RESOURCE_EXHAUSTED. */
static int links(rpc_call *call, const orch_link *rows, size_t n, SubagentLink ***out,
                 size_t *nout) {
    *out = rpc_alloc(call, (n ? n : 1) * sizeof **out);
    if (!*out) return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < n; i++) {
        if (!((*out)[i] = link_msg(call, &rows[i])))
            return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
        *nout = i + 1;
    }
    return RPC_OK;
}

/* ---- GetParentSession ---- */

/* The parent link carries the PARENT session's fields (its id, its own parent, root, depth,
 * agent, state, times) and the bridge fields of the edge parent -> the queried session (the
 * invocation that created the queried session). A root: is_root, parent unset. */
static int get_parent_session(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                              void *ud) {
    orch *o = ud;
    const GetParentSessionRequest *rq = (const GetParentSessionRequest *)req;
    GetParentSessionResponse *out = (GetParentSessionResponse *)resp;
    const auth_identity *id;
    orch_link parent;
    int is_root = 0;
    char err[512];
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "session_id", rq->session_id, 1))) return rc;
    rc = orch_store_parent_get(o->pool, id->org_id, rq->session_id, &is_root, &parent, err,
                               sizeof err);
    if (rc == ORCH_ENOTFOUND) return not_found(call, rq->session_id);
    if (rc != DB_OK) return orch_store_failed(call, "reading the session", err);
    out->is_root = is_root;
    if (!is_root && !(out->parent = link_msg(call, &parent)))
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    return RPC_OK;
}

/* ---- ListChildren ---- */

static int list_children(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                         void *ud) {
    orch *o = ud;
    const ListChildrenRequest *rq = (const ListChildrenRequest *)req;
    ListChildrenResponse *out = (ListChildrenResponse *)resp;
    const auth_identity *id;
    char err[512], query[65], after[37] = "";
    int64_t after_us = 0, total = 0;
    orch_link *rows = NULL;
    size_t n = 0;
    int more = 0;
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "session_id", rq->session_id, 1))) return rc;
    if (rq->page_size < 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "page_size: must not be negative");
    int size = rq->page_size == 0             ? CHILDREN_DEFAULT
               : rq->page_size > CHILDREN_MAX ? CHILDREN_MAX
                                              : rq->page_size;
    /* a token verifies only for the listing it came from: this org, this parent */
    const char *parts[] = {"ListChildren", id->org_id, rq->session_id};
    pagetok_query(query, parts, 3);
    if (rq->page_token[0] && pagetok_parse(page_key, query, rq->page_token, &after_us, after))
        return rpc_error(call, RPC_INVALID_ARGUMENT,
                         "page_token: not a token of this session's children");
    rc = orch_store_children(o->pool, id->org_id, rq->session_id, after_us, after, size, &rows, &n,
                             &more, &total, err, sizeof err);
    if (rc == ORCH_ENOTFOUND) return not_found(call, rq->session_id);
    if (rc != DB_OK) return orch_store_failed(call, "listing the children", err);
    rc = links(call, rows, n, &out->children, &out->n_children);
    if (rc == RPC_OK && more && n) {
        char tok[PAGETOK_MAX + 1];
        if (pagetok_make(page_key, query, rows[n - 1].started_us, rows[n - 1].session_id, tok,
                         sizeof tok) == 0)
            out->next_page_token = rpc_strdup(call, tok);
        else
            rc = rpc_error(call, RPC_INTERNAL, "page_token: could not be made");
    }
    out->total_count = total > INT32_MAX ? INT32_MAX : (int32_t)total;
    free(rows);
    return rc;
}

/* ---- GetSubagentTree ---- */

static int get_subagent_tree(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                             void *ud) {
    orch *o = ud;
    const GetSubagentTreeRequest *rq = (const GetSubagentTreeRequest *)req;
    GetSubagentTreeResponse *out = (GetSubagentTreeResponse *)resp;
    const auth_identity *id;
    char err[512];
    orch_link *rows = NULL;
    size_t n = 0;
    int cut_depth = 0, cut_fanout = 0;
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "session_id", rq->session_id, 1))) return rc;
    if (rq->max_depth < 0)
        return rpc_error(call, RPC_INVALID_ARGUMENT, "max_depth: must not be negative");
    /* spec: 1..10, 0 the default; above 10 the walk is served at 10 (truncated_at_depth says
     * which depth was applied) */
    int depth = rq->max_depth == 0               ? TREE_DEPTH_DEFAULT
                : rq->max_depth > TREE_DEPTH_MAX ? TREE_DEPTH_MAX
                                                 : rq->max_depth;
    rc = orch_store_tree(o->pool, id->org_id, rq->session_id, depth, TREE_FANOUT, TREE_NODES, &rows,
                         &n, &cut_depth, &cut_fanout, err, sizeof err);
    if (rc == ORCH_ENOTFOUND) return not_found(call, rq->session_id);
    if (rc != DB_OK) return orch_store_failed(call, "reading the tree", err);
    rc = links(call, rows, n, &out->nodes, &out->n_nodes);
    out->truncated_at_depth = cut_depth;
    out->truncated_at_fanout = cut_fanout;
    free(rows);
    return rc;
}

/* ---- TerminateSubagentTree ---- */

static int terminate_subagent_tree(rpc_call *call, const ProtobufCMessage *req,
                                   ProtobufCMessage *resp, void *ud) {
    orch *o = ud;
    const TerminateTreeRequest *rq = (const TerminateTreeRequest *)req;
    TerminateTreeResponse *out = (TerminateTreeResponse *)resp;
    const auth_identity *id;
    char err[512];
    orch_ended *e = NULL;
    size_t n = 0;
    int bridge = 0;
    int rc = rpc_tenant(call, 0, &id);
    if (rc || (rc = orch_uuid_field(call, "session_id", rq->session_id, 1)) ||
        (rc = orch_text_field(call, "reason", rq->reason, REASON_MAX)))
        return rc;
    const char *reason = rq->reason[0] ? rq->reason : "terminated with its subagent tree";
    rc = orch_store_tree_terminate(o->pool, id->org_id, rq->session_id, rq->include_root, reason,
                                   TERMINATE_MAX, &e, &n, &bridge, err, sizeof err);
    if (rc == ORCH_ENOTFOUND) return not_found(call, rq->session_id);
    if (rc == ORCH_ESTATE) return rpc_error(call, RPC_FAILED_PRECONDITION, "%s", err);
    if (rc != DB_OK) return orch_store_failed(call, "terminating the tree", err);
    out->terminated_session_ids = rpc_alloc(call, (n ? n : 1) * sizeof(char *));
    out->skipped_session_ids = rpc_alloc(call, (n ? n : 1) * sizeof(char *));
    if (!out->terminated_session_ids || !out->skipped_session_ids) {
        free(e);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    for (size_t i = 0; i < n; i++) {
        if (e[i].terminated)
            out->terminated_session_ids[out->n_terminated_session_ids++] =
                rpc_strdup(call, e[i].session_id);
        else
            out->skipped_session_ids[out->n_skipped_session_ids++] =
                rpc_strdup(call, e[i].session_id);
    }
    out->updated_bridge_row_count = bridge;
    log_info("tree.terminated", "session %s org %s: %zu terminated, %zu skipped, %d bridge rows",
             rq->session_id, id->org_id, out->n_terminated_session_ids, out->n_skipped_session_ids,
             bridge);
    /* committed: the workers release what they hold, best effort (as TerminateSession), while
     * the call has time for another 3 s call */
    int told = 0;
    for (size_t i = 0; i < n && told < TERMINATE_TELL_MAX; i++) {
        if (!e[i].terminated) continue;
        if (rpc_deadline_ms(call) < 3500) break;
        orch_session_tell_end(o, id->org_id, e[i].worker, e[i].session_id, reason);
        told++;
    }
    free(e);
    return RPC_OK;
}

/* ---- registration ---- */

/* The page-token key: sha256 over a label and the service's token secret (the signing key,
 * else UPSQUAD_JWT_SECRET); without either, a random per-process key (tokens then only work
 * on the replica that issued them, and a warning says so). -1 when hashing fails. */
static int page_key_init(const orch *o) {
    const char *k = o->cfg && o->cfg->token_key && o->cfg->token_key[0]
                        ? o->cfg->token_key
                        : getenv("UPSQUAD_JWT_SECRET");
    char rnd[37] = "";
    if (!k || !k[0]) {
        ids_uuid_v4(rnd);
        k = rnd;
        log_warn("tree.page_key", "no token secret: ListChildren page tokens are per process");
    }
    ids_sha256 h;
    if (ids_sha256_init(&h) != 0) return -1;
    ids_sha256_update_str(&h, "orchestrator ListChildren page tokens:");
    ids_sha256_update_str(&h, k);
    return ids_sha256_final_raw(&h, page_key) == 0 ? 0 : -1;
}

#define SVC "/upsquad.runtime.v1.LifecycleService/"
#define DESC(x) &upsquad__runtime__v1__##x##__descriptor
#define METHOD(name, req, resp, fn)                                                                \
    {                                                                                              \
        SVC name, RPC_UNARY, RPC_AUTH_REQUIRED, DESC(req), DESC(resp), fn, NULL, o,                \
            .flags = RPC_BLOCKING                                                                  \
    }

int orch_tree_register(rpc_server *srv, orch *o) {
    if (page_key_init(o)) {
        log_error("tree.page_key", "the page-token key could not be derived");
        return RPC_INTERNAL;
    }
    const rpc_method methods[] = {
        METHOD("ListChildren", list_children_request, list_children_response, list_children),
        METHOD("GetParentSession", get_parent_session_request, get_parent_session_response,
               get_parent_session),
        METHOD("GetSubagentTree", get_subagent_tree_request, get_subagent_tree_response,
               get_subagent_tree),
        METHOD("TerminateSubagentTree", terminate_subagent_tree_request,
               terminate_subagent_tree_response, terminate_subagent_tree),
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
