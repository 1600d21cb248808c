/* Session creation and worker requests (session.h). */
#include "session.h"

#include <cjson/cJSON.h>
#include <openssl/crypto.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ids.h"
#include "log.h"
#include "upsquad/runtime/v1/model.pb-c.h"

#define INIT_WORKER "/upsquad.runtime.v1.RuntimeService/InitWorkerSession"

/* model_override: known to model-registry and not deprecated (spec AR-F66; issue). */
/* canon (97 bytes): the catalogue's spelling of the model id (ids match case-insensitively). */
static int check_model(orch *o, const char *model, const char *bearer, char canon[97], char *msg,
                       size_t msglen) {
    snprintf(canon, 97, "%s", model);
    if (!o->registry) return RPC_OK; /* not configured: documented, not checked */
    Upsquad__Runtime__V1__CompareModelsRequest rq =
        UPSQUAD__RUNTIME__V1__COMPARE_MODELS_REQUEST__INIT;
    char *ids[1] = {(char *)model};
    rq.n_model_ids = 1;
    rq.model_ids = ids;
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    rpc_call_opts opts = {.timeout_ms = 3000, .bearer = bearer};
    int code = rpc_unary_call(o->registry, "/upsquad.runtime.v1.ModelRegistryService/CompareModels",
                              &rq.base, &upsquad__runtime__v1__compare_models_response__descriptor,
                              &opts, &resp, &st);
    int rc = RPC_OK;
    if (code == RPC_NOT_FOUND || code == RPC_INVALID_ARGUMENT) {
        snprintf(msg, msglen, "model_override: unknown model \"%s\" (not in the model catalogue)",
                 model);
        rc = RPC_INVALID_ARGUMENT;
    } else if (code != RPC_OK) {
        snprintf(msg, msglen, "model_override: the model catalogue could not be asked (%s)",
                 st.message ? st.message : "unavailable");
        rc = RPC_UNAVAILABLE;
    } else {
        Upsquad__Runtime__V1__CompareModelsResponse *r =
            (Upsquad__Runtime__V1__CompareModelsResponse *)resp;
        if (r->n_models == 1) snprintf(canon, 97, "%s", r->models[0]->model_id);
        if (r->n_models == 1 && r->models[0]->is_deprecated) {
            /* the catalogue names no successor on the wire: suggest its best active model of
             * the same provider */
            Upsquad__Runtime__V1__GetModelRecommendationRequest q =
                UPSQUAD__RUNTIME__V1__GET_MODEL_RECOMMENDATION_REQUEST__INIT;
            char *prov[1] = {r->models[0]->provider};
            q.n_connected_providers = 1;
            q.connected_providers = prov;
            q.optimization_goal = (char *)"balanced";
            ProtobufCMessage *rec = NULL;
            int c2 = rpc_unary_call(
                o->registry, "/upsquad.runtime.v1.ModelRegistryService/GetModelRecommendation",
                &q.base, &upsquad__runtime__v1__get_model_recommendation_response__descriptor,
                &opts, &rec, NULL);
            const char *succ = NULL;
            if (c2 == RPC_OK &&
                ((Upsquad__Runtime__V1__GetModelRecommendationResponse *)rec)->recommended)
                succ = ((Upsquad__Runtime__V1__GetModelRecommendationResponse *)rec)
                           ->recommended->model_id;
            if (succ)
                snprintf(msg, msglen,
                         "model_override: model \"%s\" is deprecated (the catalogue recommends "
                         "\"%s\" of the same provider)",
                         model, succ);
            else
                snprintf(msg, msglen, "model_override: model \"%s\" is deprecated", model);
            if (rec) protobuf_c_message_free_unpacked(rec, NULL);
            rc = RPC_INVALID_ARGUMENT;
        }
    }
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_status_clear(&st);
    return rc;
}

int orch_session_init_worker(orch *o, const orch_worker_init *in, char worker[128], char *msg,
                             size_t msglen) {
    orch_worker *k = orch_workers_pick(o->workers, in->avoid);
    if (!k) {
        metric_inc(o->m_no_worker);
        snprintf(msg, msglen, "no live worker: the session cannot be initialised now");
        return RPC_UNAVAILABLE;
    }
    Upsquad__Runtime__V1__InitWorkerSessionRequest rq =
        UPSQUAD__RUNTIME__V1__INIT_WORKER_SESSION_REQUEST__INIT;
    rq.snapshot = (SessionSnapshot *)in->snapshot;
    /* spec: the latest checkpoint's bytes as stored (4-byte version prefix + body) and its
     * loop_iteration; empty on a fresh init */
    rq.resume_checkpoint.data = (uint8_t *)in->checkpoint;
    rq.resume_checkpoint.len = in->checkpoint_len;
    rq.resume_loop_iteration = in->checkpoint_len ? in->loop : 0;
    snprintf(worker, 128, "%s", k->addr);
    ProtobufCMessage *resp = NULL;
    rpc_status st = {0};
    char *bearer = orch_mint_call_token(o, in->snapshot->tenant_id);
    rpc_call_opts opts = {.timeout_ms = in->timeout_ms > 0 ? in->timeout_ms : 10000,
                          .bearer = bearer};
    int code = rpc_unary_call(k->ch, INIT_WORKER, &rq.base,
                              &upsquad__runtime__v1__init_worker_session_response__descriptor,
                              &opts, &resp, &st);
    int rc = RPC_OK;
    if (code != RPC_OK) {
        if (code == RPC_UNAVAILABLE) orch_workers_mark_down(o->workers, k);
        snprintf(msg, msglen, "worker %s could not initialise the session: %s", k->addr,
                 st.message ? st.message : "call failed");
        rc = RPC_UNAVAILABLE;
    } else if (!((Upsquad__Runtime__V1__InitWorkerSessionResponse *)resp)->success) {
        snprintf(msg, msglen, "the worker refused the session: %s",
                 ((Upsquad__Runtime__V1__InitWorkerSessionResponse *)resp)->error_message);
        rc = RPC_FAILED_PRECONDITION;
    }
    orch_workers_done(o->workers, k);
    if (resp) protobuf_c_message_free_unpacked(resp, NULL);
    rpc_status_clear(&st);
    free(bearer);
    return rc;
}

int orch_session_start(orch *o, const orch_new_session *n, char session_id[37], char hash[65],
                       char *msg, size_t msglen) {
    orch_agent_row a = {0};
    char err[512];
    orch_arena ar = {0};
    cJSON *doc = NULL;
    unsigned char *packed = NULL;
    int rc = orch_store_agent_get(o->pool, n->org, n->agent_id, &a, err, sizeof err);
    if (rc == ORCH_ENOTFOUND) {
        snprintf(msg, msglen, "agent_id: no agent %s in this org", n->agent_id);
        return RPC_NOT_FOUND;
    }
    if (rc != DB_OK) {
        log_error("session.agent", "reading agent %s: %s", n->agent_id, err);
        snprintf(msg, msglen, "the agent could not be read");
        return RPC_UNAVAILABLE;
    }
    char model[97] = "";
    if (n->model_override && n->model_override[0]) {
        rc = check_model(o, n->model_override, n->bearer, model, msg, msglen);
        if (rc != RPC_OK) goto done;
    }
    doc = cJSON_Parse(a.definition);
    if (!doc || ids_uuid_v4(session_id)) {
        snprintf(msg, msglen, "the agent definition could not be read");
        rc = RPC_INTERNAL;
        goto done;
    }
    SessionSnapshot *s = agentdef_freeze(&ar, doc, session_id, n->org, a.agent_id, model, n->mode);
    if (!s) {
        snprintf(msg, msglen, "out of memory freezing the snapshot");
        rc = RPC_RESOURCE_EXHAUSTED;
        goto done;
    }
    snprintf(hash, 65, "%s", s->snapshot_hash);
    char worker[128] = "";
    orch_worker_init wi = {.snapshot = s};
    if (n->init_worker && (rc = orch_session_init_worker(o, &wi, worker, msg, msglen)) != RPC_OK)
        goto done;
    size_t len = protobuf_c_message_get_packed_size(&s->base);
    packed = malloc(len ? len : 1);
    if (!packed) {
        rc = RPC_RESOURCE_EXHAUSTED;
        snprintf(msg, msglen, "out of memory");
        goto done;
    }
    protobuf_c_message_pack(&s->base, packed);
    orch_session_new row = {.session_id = session_id,
                            .org_id = n->org,
                            .user_id = n->user,
                            .agent_id = a.agent_id,
                            .model_id = s->model_id,
                            .snapshot_hash = hash,
                            .kind = n->kind,
                            .worker = worker,
                            .execution_mode = s->execution_mode,
                            .max_loops = s->max_loops,
                            .agent_status = 0,
                            .snapshot = packed,
                            .snapshot_len = len};
    if (orch_store_session_create(o->pool, &row, NULL, err, sizeof err) != DB_OK) {
        log_error("session.create", "%s", err);
        snprintf(msg, msglen, "the session could not be stored");
        rc = RPC_UNAVAILABLE;
        goto done;
    }
    rc = RPC_OK;
done:
    free(packed);
    cJSON_Delete(doc);
    orch_arena_free(&ar);
    free(a.definition);
    return rc;
}

int orch_request_build(orch *o, orch_arena *a, const orch_session *s, const char *message, int mode,
                       const orch_turn *turns, size_t nturns, ExecuteStepRequest **out,
                       SessionSnapshot **snap) {
    char err[512];
    ExecuteStepRequest *r = orch_arena_alloc(a, sizeof *r);
    if (!r) return -1;
    upsquad__runtime__v1__execute_step_request__init(r);
    *snap = (SessionSnapshot *)protobuf_c_message_unpack(
        &upsquad__runtime__v1__session_snapshot__descriptor, NULL, s->snapshot_len, s->snapshot);
    if (!*snap) return -1;
    r->session_id = orch_arena_strdup(a, s->session_id);
    r->tenant_id = orch_arena_strdup(a, s->org_id);
    r->agent_id = orch_arena_strdup(a, s->agent_id);
    r->user_message = orch_arena_strdup(a, message);
    /* spec: the snapshot is "the immutable session configuration snapshot" (its hash detects
     * drift): a turn's own mode goes on the request, never into the snapshot */
    r->execution_mode = mode ? (Upsquad__Runtime__V1__ExecutionMode)mode : (*snap)->execution_mode;
    r->snapshot = *snap;
    /* prior turns: final user/assistant texts, oldest first, current turn excluded; spec:
     * "Empty on the autonomous / temporalwf path (that path keeps its in-memory step
     * carryover)": the plan step and every cycle send none */
    if (r->execution_mode == UPSQUAD__RUNTIME__V1__EXECUTION_MODE__EXECUTION_MODE_AUTONOMOUS)
        nturns = 0;
    r->prior_turns = orch_arena_alloc(a, (nturns ? nturns : 1) * sizeof *r->prior_turns);
    for (size_t i = 0; i < nturns && r->prior_turns; i++) {
        Upsquad__Runtime__V1__PriorTurn *t = orch_arena_alloc(a, sizeof *t);
        if (!t) return -1;
        upsquad__runtime__v1__prior_turn__init(t);
        t->role = turns[i].role == 2 ? UPSQUAD__RUNTIME__V1__PRIOR_TURN__ROLE__ROLE_ASSISTANT
                                     : UPSQUAD__RUNTIME__V1__PRIOR_TURN__ROLE__ROLE_USER;
        t->text = orch_arena_strdup(a, turns[i].text);
        r->prior_turns[r->n_prior_turns++] = t;
    }
    /* provider keys: decrypted for this one step only */
    if (o->ring.n > 0) {
        orch_key_row *rows = NULL;
        size_t n = 0;
        if (orch_store_keys_get(o->pool, s->org_id, &rows, &n, err, sizeof err) == DB_OK && n) {
            r->provider_keys = orch_arena_alloc(a, n * sizeof *r->provider_keys);
            for (size_t i = 0; i < n && r->provider_keys; i++) {
                char *plain = NULL;
                size_t plen = 0;
                if (keys_decrypt(&o->ring, rows[i].kid, s->org_id, rows[i].provider, rows[i].nonce,
                                 rows[i].ct, rows[i].ctlen, &plain, &plen)) {
                    log_warn("keys.decrypt", "provider key %s of org %s does not decrypt (kek %s)",
                             rows[i].provider, s->org_id, rows[i].kid);
                    continue;
                }
                Upsquad__Runtime__V1__ExecuteStepRequest__ProviderKeysEntry *e =
                    orch_arena_alloc(a, sizeof *e);
                if (e) {
                    upsquad__runtime__v1__execute_step_request__provider_keys_entry__init(e);
                    e->key = orch_arena_strdup(a, rows[i].provider);
                    e->value = orch_arena_strndup(a, plain, plen);
                    r->provider_keys[r->n_provider_keys++] = e;
                }
                OPENSSL_cleanse(plain, plen);
                free(plain);
            }
        }
        orch_store_keys_free(rows, n);
    }
    *out = r;
    return a->failed ? -1 : 0;
}

void orch_request_wipe(ExecuteStepRequest *r) {
    for (size_t i = 0; r && i < r->n_provider_keys; i++)
        if (r->provider_keys[i]->value)
            OPENSSL_cleanse(r->provider_keys[i]->value, strlen(r->provider_keys[i]->value));
}
