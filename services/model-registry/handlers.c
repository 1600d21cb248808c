/* ModelRegistryService over a catalogue snapshot. Rules (docs/model-registry.md):
 *   ListModels: provider, then active before deprecated, then model_id; provider_filter matches
 *     case-insensitively; an unknown provider gives an empty list.
 *   GetModelRecommendation: score.h; an unknown goal is INVALID_ARGUMENT (optimization_goal),
 *     nothing qualifying is FAILED_PRECONDITION with the reason.
 *   CompareModels: the order requested, duplicates collapsed; 1..MR_COMPARE_MAX ids, else
 *     INVALID_ARGUMENT; unknown ids are NOT_FOUND naming every one of them. */
#include "handlers.h"

#include <string.h>

#include "reccache.h"
#include "score.h"
#include "util.h"
#include "upsquad/runtime/v1/model.pb-c.h"

typedef Upsquad__Runtime__V1__ModelEntry ModelEntry;
typedef Upsquad__Runtime__V1__CapabilityProfile CapabilityProfile;
typedef Upsquad__Runtime__V1__ModelPricing ModelPricing;
typedef Upsquad__Runtime__V1__ListModelsRequest ListModelsRequest;
typedef Upsquad__Runtime__V1__ListModelsResponse ListModelsResponse;
typedef Upsquad__Runtime__V1__GetModelRecommendationRequest RecRequest;
typedef Upsquad__Runtime__V1__GetModelRecommendationResponse RecResponse;
typedef Upsquad__Runtime__V1__CompareModelsRequest CompareRequest;
typedef Upsquad__Runtime__V1__CompareModelsResponse CompareResponse;

/* The wire form of one entry, every byte in the call arena (the snapshot may be released
 * before the response is encoded). */
static ModelEntry *entry_msg(rpc_call *call, const mr_entry *e) {
    ModelEntry *m = rpc_alloc(call, sizeof *m);
    CapabilityProfile *cap = rpc_alloc(call, sizeof *cap);
    ModelPricing *price = rpc_alloc(call, sizeof *price);
    if (!m || !cap || !price) return NULL;
    upsquad__runtime__v1__model_entry__init(m);
    upsquad__runtime__v1__capability_profile__init(cap);
    upsquad__runtime__v1__model_pricing__init(price);
    m->model_id = rpc_strdup(call, e->m->model_id);
    m->provider = rpc_strdup(call, e->m->provider);
    m->display_name = rpc_strdup(call, e->m->display_name);
    if (!m->model_id || !m->provider || !m->display_name) return NULL;
    cap->reasoning = e->m->reasoning;
    cap->code_generation = e->m->code_generation;
    cap->structured_ops = e->m->structured_ops;
    cap->long_context = e->m->long_context;
    cap->cost_efficiency = e->cost_efficiency;
    price->input_per_million_tokens = e->input_per_million;
    price->output_per_million_tokens = e->output_per_million;
    m->capabilities = cap;
    m->pricing = price;
    m->max_context_tokens = e->m->max_context_tokens;
    m->supports_streaming = e->m->supports_streaming;
    m->supports_tool_use = e->m->supports_tool_use;
    m->tool_use_quality_score = e->m->tool_use_quality;
    m->is_deprecated = e->deprecated;
    return m;
}

/* Fills an arena array of n entries; NULL on allocation failure. */
static ModelEntry **entries_msg(rpc_call *call, const mr_entry *const *in, size_t n) {
    ModelEntry **out = rpc_alloc(call, (n ? n : 1) * sizeof *out);
    if (!out) return NULL;
    for (size_t i = 0; i < n; i++)
        if (!(out[i] = entry_msg(call, in[i]))) return NULL;
    return out;
}

static int no_memory(rpc_call *call) {
    return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "response too large for this call's memory");
}

static mr_snapshot *snapshot_or_error(rpc_call *call, mr_registry *r, int *rc) {
    mr_snapshot *s = mr_registry_snapshot(r);
    *rc = s ? RPC_OK : rpc_error(call, RPC_UNAVAILABLE, "the model catalogue is not loaded yet");
    return s;
}

static int list_models(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                       void *ud) {
    const ListModelsRequest *rq = (const ListModelsRequest *)req;
    ListModelsResponse *out = (ListModelsResponse *)resp;
    int rc;
    mr_snapshot *s = snapshot_or_error(call, ud, &rc);
    if (!s) return rc;
    const mr_entry **sel = rpc_alloc(call, (s->n ? s->n : 1) * sizeof *sel);
    if (!sel) {
        rc = no_memory(call);
        goto done;
    }
    size_t n = mr_list(s, rq->provider_filter, sel);
    out->models = entries_msg(call, sel, n);
    out->n_models = out->models ? n : 0;
    rc = out->models ? RPC_OK : no_memory(call);
done:
    mr_snapshot_unref(s);
    return rc;
}

/* The cache key of a request: every field mr_recommend reads, as NUL-terminated strings in
 * order (a protobuf-c string holds no NUL, so the sequence is unambiguous). 0 when it does not
 * fit (such a request is answered without the cache). */
static size_t rec_key(const RecRequest *rq, char *buf, size_t cap) {
    size_t n = 0;
    const char *role = rq->agent_role ? rq->agent_role : "";
    const char *goal = rq->optimization_goal ? rq->optimization_goal : "";
    for (size_t i = 0; i < 2 + rq->n_connected_providers; i++) {
        const char *f = i == 0 ? role : i == 1 ? goal : rq->connected_providers[i - 2];
        size_t len = strlen(f ? f : "") + 1;
        if (len > cap - n) return 0;
        memcpy(buf + n, f ? f : "", len);
        n += len;
    }
    return n;
}

static int entry_utf8(const ModelEntry *m) {
    return util_utf8_valid(m->model_id) && util_utf8_valid(m->provider) &&
           util_utf8_valid(m->display_name);
}

/* Encodes the response into this thread's cache and replies with those bytes. The checks the
 * RPC layer would run on the message (valid UTF-8 strings) are made here, so a cached reply
 * carries only bytes that passed them; a response failing them is left to the RPC layer. */
static void rec_remember(rpc_call *call, const mr_registry *r, uint64_t version, const char *key,
                         size_t klen, const RecResponse *out) {
    int ok = entry_utf8(out->recommended) && util_utf8_valid(out->reasoning);
    for (size_t i = 0; ok && i < out->n_alternatives; i++)
        ok = entry_utf8(out->alternatives[i]);
    if (!ok) return;
    uint8_t *bytes;
    size_t len = protobuf_c_message_get_packed_size(&out->base);
    if (mr_reccache_put(r, version, key, klen, len, &bytes) != 0) return;
    protobuf_c_message_pack(&out->base, bytes);
    rpc_reply_encoded(call, bytes, len); /* on failure the message is encoded as usual */
}

static int recommend(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                     void *ud) {
    const RecRequest *rq = (const RecRequest *)req;
    RecResponse *out = (RecResponse *)resp;
    mr_registry *r = ud;
    mr_rec_result res;
    char err[768];
    int rc;
    char key[MR_RECCACHE_KEY_MAX];
    const uint8_t *cached;
    size_t n_cached;
    mr_snapshot *s = snapshot_or_error(call, r, &rc);
    if (!s) return rc;
    /* the same question on the same snapshot: the same answer, already encoded */
    size_t klen = rec_key(rq, key, sizeof key);
    if (klen && mr_reccache_get(r, s->version, key, klen, &cached, &n_cached) == 0) {
        rc = rpc_reply_encoded(call, cached, n_cached) == RPC_OK ? RPC_OK : no_memory(call);
        goto done;
    }
    mr_rec_request mq = {rq->agent_role, (const char *const *)rq->connected_providers,
                         rq->n_connected_providers, rq->optimization_goal,
                         (size_t)r->cfg->alternatives};
    switch (mr_recommend(s, &mq, &res, err, sizeof err)) {
    case MR_OK:
        break;
    case MR_EINVAL:
        rc = rpc_error(call, RPC_INVALID_ARGUMENT, "%s", err);
        goto done;
    case MR_ENONE:
        rc = rpc_error(call, RPC_FAILED_PRECONDITION, "%s", err);
        goto done;
    default:
        rc = rpc_error(call, RPC_INTERNAL, "recommendation failed");
        goto done;
    }
    const mr_entry *alts[MR_MAX_ALTERNATIVES];
    for (size_t i = 0; i < res.n_alternatives; i++)
        alts[i] = res.alternatives[i].e;
    out->recommended = entry_msg(call, res.best.e);
    out->alternatives = entries_msg(call, alts, res.n_alternatives);
    out->n_alternatives = out->alternatives ? res.n_alternatives : 0;
    out->reasoning = rpc_strdup(call, res.reasoning);
    rc = out->recommended && out->alternatives && out->reasoning ? RPC_OK : no_memory(call);
    if (rc == RPC_OK && klen) rec_remember(call, r, s->version, key, klen, out);
done:
    mr_snapshot_unref(s);
    return rc;
}

static int compare(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    const CompareRequest *rq = (const CompareRequest *)req;
    CompareResponse *out = (CompareResponse *)resp;
    const mr_entry *sel[MR_COMPARE_MAX];
    size_t n = 0;
    char err[1024];
    int rc;
    mr_snapshot *s = snapshot_or_error(call, ud, &rc);
    if (!s) return rc;
    switch (mr_compare(s, (const char *const *)rq->model_ids, rq->n_model_ids, sel, &n, err,
                       sizeof err)) {
    case MR_OK:
        break;
    case MR_EINVAL:
        rc = rpc_error(call, RPC_INVALID_ARGUMENT, "%s", err);
        goto done;
    case MR_ENOTFOUND:
        rc = rpc_error(call, RPC_NOT_FOUND, "%s", err);
        goto done;
    default:
        rc = rpc_error(call, RPC_INTERNAL, "comparison failed");
        goto done;
    }
    out->models = entries_msg(call, sel, n);
    out->n_models = out->models ? n : 0;
    rc = out->models ? RPC_OK : no_memory(call);
done:
    mr_snapshot_unref(s);
    return rc;
}

#define SVC "/upsquad.runtime.v1.ModelRegistryService/"
#define DESC(x) &upsquad__runtime__v1__##x##__descriptor

/* Checked on the wire before decoding: a request of millions of ids costs a scan, not memory. */
static const rpc_field_limit rec_limits[] = {{"connected_providers", MR_MAX_PROVIDERS_REQ}};
static const rpc_field_limit compare_limits[] = {{"model_ids", MR_COMPARE_MAX}};

int mr_handlers_register(rpc_server *srv, mr_registry *r) {
    const rpc_method methods[] = {
        {SVC "ListModels", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(list_models_request),
         DESC(list_models_response), list_models, NULL, r},
        {SVC "GetModelRecommendation", RPC_UNARY, RPC_AUTH_REQUIRED,
         DESC(get_model_recommendation_request), DESC(get_model_recommendation_response), recommend,
         NULL, r, rec_limits, 1},
        {SVC "CompareModels", RPC_UNARY, RPC_AUTH_REQUIRED, DESC(compare_models_request),
         DESC(compare_models_response), compare, NULL, r, compare_limits, 1},
    };
    return rpc_server_add(srv, methods, sizeof methods / sizeof methods[0]);
}
