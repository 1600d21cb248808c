/* The request walk of libcommon/rpc_limits.c: UTF-8 and NUL in `string` fields, declared
 * limits on repeated fields and the decoded-size bound, all on the wire bytes before decoding,
 * each refusal naming the field. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "rpc_internal.h"
#include "upsquad/runtime/v1/model.pb-c.h"
#include "upsquad/test/v1/echo.pb-c.h"

typedef Upsquad__Runtime__V1__CompareModelsRequest CompareReq;
typedef Upsquad__Runtime__V1__GetModelRecommendationRequest RecReq;

static uint8_t *pack(const ProtobufCMessage *m, size_t *n) {
    *n = protobuf_c_message_get_packed_size(m);
    uint8_t *b = malloc(*n ? *n : 1);
    assert_non_null(b);
    protobuf_c_message_pack(m, b);
    return b;
}

static int check(const ProtobufCMessage *m, const rpc_field_limit *lim, size_t nl, size_t max,
                 char *msg, size_t msglen) {
    size_t n;
    uint8_t *b = pack(m, &n);
    int rc = rpc__check_request(b, n, m->descriptor, lim, nl, max, msg, msglen);
    free(b);
    return rc;
}

static void test_strings_utf8_and_nul(void **state) {
    (void)state;
    char msg[300];
    RecReq r = UPSQUAD__RUNTIME__V1__GET_MODEL_RECOMMENDATION_REQUEST__INIT;
    char *prov[3] = {"openai", "caf\xC3\xA9", "ok"};
    r.agent_role = "architect";
    r.connected_providers = prov;
    r.n_connected_providers = 3;
    assert_int_equal(check(&r.base, NULL, 0, 0, msg, sizeof msg), 0);

    r.agent_role = "arch\xC3"; /* truncated sequence */
    assert_int_equal(check(&r.base, NULL, 0, 0, msg, sizeof msg), RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "agent_role: is not valid UTF-8");

    r.agent_role = "architect";
    prov[2] = "\xFF";
    assert_int_equal(check(&r.base, NULL, 0, 0, msg, sizeof msg), RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "connected_providers[2]: is not valid UTF-8");

    /* a NUL can't be put in a C string: write the wire bytes by hand (field 1, "ab\0c") */
    const uint8_t nul[] = {0x0a, 4, 'a', 'b', 0, 'c'};
    assert_int_equal(
        rpc__check_request(nul, sizeof nul, r.base.descriptor, NULL, 0, 0, msg, sizeof msg),
        RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "agent_role: contains a NUL character");

    /* nested: a Struct's string value inside EchoRequest.meta */
    Google__Protobuf__Value v = GOOGLE__PROTOBUF__VALUE__INIT;
    v.kind_case = GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE;
    v.string_value = "bad\xC0\xAF";
    Google__Protobuf__Struct__FieldsEntry e = GOOGLE__PROTOBUF__STRUCT__FIELDS_ENTRY__INIT;
    e.key = "k";
    e.value = &v;
    Google__Protobuf__Struct__FieldsEntry *ep = &e;
    Google__Protobuf__Struct st = GOOGLE__PROTOBUF__STRUCT__INIT;
    st.n_fields = 1;
    st.fields = &ep;
    Upsquad__Test__V1__EchoRequest er = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    er.meta = &st;
    assert_int_equal(check(&er.base, NULL, 0, 0, msg, sizeof msg), RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "meta.fields[0].value.string_value: is not valid UTF-8");
}

static void test_repeated_limit(void **state) {
    (void)state;
    char msg[300];
    static const rpc_field_limit lim[] = {{"model_ids", 10}};
    CompareReq c = UPSQUAD__RUNTIME__V1__COMPARE_MODELS_REQUEST__INIT;
    char *ids[11];
    for (int i = 0; i < 11; i++)
        ids[i] = "";
    c.model_ids = ids;
    c.n_model_ids = 10;
    assert_int_equal(check(&c.base, lim, 1, 0, msg, sizeof msg), 0);
    c.n_model_ids = 11;
    assert_int_equal(check(&c.base, lim, 1, 0, msg, sizeof msg), RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "model_ids: at most 10 entries per request");

    /* 2.1 million empty ids: refused at the 11th, and fast (no allocation per element) */
    size_t big = 2100000, n = big * 2;
    uint8_t *b = malloc(n);
    assert_non_null(b);
    for (size_t i = 0; i < big; i++)
        b[2 * i] = 0x0a, b[2 * i + 1] = 0;
    assert_int_equal(rpc__check_request(b, n, c.base.descriptor, lim, 1, 0, msg, sizeof msg),
                     RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "model_ids: at most 10 entries per request");
    /* without a declared limit, the decoded-size bound refuses it, naming where it overflowed */
    assert_int_equal(
        rpc__check_request(b, n, c.base.descriptor, NULL, 0, 16u << 20, msg, sizeof msg),
        RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "request: the request would decode to more than 16777216 bytes");
    /* ... and with no bound at all it is a valid message */
    assert_int_equal(rpc__check_request(b, n, c.base.descriptor, NULL, 0, 0, msg, sizeof msg), 0);
    free(b);
}

static void test_nested_limit_path(void **state) {
    (void)state;
    char msg[300];
    /* EchoRequest.meta.fields: a map is a repeated message field */
    static const rpc_field_limit lim[] = {{"meta.fields", 2}, {"text", 1}};
    Google__Protobuf__Value v = GOOGLE__PROTOBUF__VALUE__INIT;
    v.kind_case = GOOGLE__PROTOBUF__VALUE__KIND_BOOL_VALUE;
    Google__Protobuf__Struct__FieldsEntry e[3];
    Google__Protobuf__Struct__FieldsEntry *ep[3];
    for (int i = 0; i < 3; i++) {
        google__protobuf__struct__fields_entry__init(&e[i]);
        e[i].key = i == 0 ? "a" : i == 1 ? "b" : "c";
        e[i].value = &v;
        ep[i] = &e[i];
    }
    Google__Protobuf__Struct st = GOOGLE__PROTOBUF__STRUCT__INIT;
    st.fields = ep;
    st.n_fields = 2;
    Upsquad__Test__V1__EchoRequest er = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    er.meta = &st;
    er.text = "a limit on a singular field is not a repeated bound";
    assert_int_equal(check(&er.base, lim, 2, 0, msg, sizeof msg), 0);
    st.n_fields = 3;
    assert_int_equal(check(&er.base, lim, 2, 0, msg, sizeof msg), RPC_INVALID_ARGUMENT);
    assert_string_equal(msg, "meta.fields: at most 2 entries per request");
}

static void test_malformed(void **state) {
    (void)state;
    char msg[300];
    const ProtobufCMessageDescriptor *d = &upsquad__runtime__v1__compare_models_request__descriptor;
    const uint8_t cases[][6] = {
        {0x0a, 5, 'a'},                 /* length beyond the end */
        {0x09, 1, 2, 3},                /* fixed64 cut short */
        {0x0d, 1},                      /* fixed32 cut short */
        {0x0b, 0},                      /* group start */
        {0x00, 0},                      /* field number 0 */
        {0x08, 0x80, 0x80, 0x80, 0x80}, /* varint that never ends */
        {0x08, 0x01},                   /* a varint where a string is declared */
    };
    const size_t lens[] = {3, 4, 2, 2, 2, 5, 2};
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        int rc = rpc__check_request(cases[i], lens[i], d, NULL, 0, 0, msg, sizeof msg);
        if (rc != -1) print_error("case %zu: %d %s\n", i, rc, msg);
        assert_int_equal(rc, -1);
        assert_string_equal(msg, "request is not a valid upsquad.runtime.v1.CompareModelsRequest");
    }
    /* unknown fields are fine (and counted in the decoded size) */
    const uint8_t unknown[] = {0x12, 2, 'h', 'i', 0x18, 7};
    assert_int_equal(rpc__check_request(unknown, sizeof unknown, d, NULL, 0, 0, msg, sizeof msg),
                     0);
}

static size_t put_varint(uint8_t *p, size_t v) {
    size_t n = 0;
    do {
        p[n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
    return n;
}

/* google.protobuf.Value nested `pairs` times as Value{list_value{values[Value{...}]}}: each pair
 * is two message levels. Returns the wire bytes (caller frees). */
static uint8_t *deep_value(int pairs, size_t *len) {
    size_t cap = 64 + (size_t)pairs * 16, n = 0;
    uint8_t *b = malloc(cap), *t = malloc(cap);
    assert_non_null(b);
    assert_non_null(t);
    for (int i = 0; i < pairs; i++) {
        size_t m = 0;
        t[m++] = 0x0a; /* ListValue.values = 1 */
        m += put_varint(t + m, n);
        memcpy(t + m, b, n), m += n;
        n = 0;
        b[n++] = 0x32; /* Value.list_value = 6 */
        n += put_varint(b + n, m);
        memcpy(b + n, t, m), n += m;
    }
    free(t);
    *len = n;
    return b;
}

static void test_nesting(void **state) {
    (void)state;
    char msg[300];
    size_t n;
    uint8_t *b = deep_value(RPC_MAX_NESTING / 2 - 1, &n);
    assert_int_equal(
        rpc__check_request(b, n, &google__protobuf__value__descriptor, NULL, 0, 0, msg, sizeof msg),
        0);
    free(b);
    b = deep_value(RPC_MAX_NESTING, &n);
    assert_int_equal(
        rpc__check_request(b, n, &google__protobuf__value__descriptor, NULL, 0, 0, msg, sizeof msg),
        RPC_INVALID_ARGUMENT);
    assert_non_null(strstr(msg, "nests messages deeper than 64 levels"));
    free(b);
}

/* ---- the decoded-size estimate against what protobuf-c really allocates ---- */

static size_t counted;
static void *count_alloc(void *ud, size_t n) {
    (void)ud;
    counted += (n + 15) & ~(size_t)15; /* the arena's rounding */
    return malloc(n);
}
static void count_free(void *ud, void *p) {
    (void)ud;
    free(p);
}

/* The smallest max_decoded the walk accepts: its estimate. */
static size_t estimate(const uint8_t *b, size_t n, const ProtobufCMessageDescriptor *d) {
    char msg[300];
    size_t lo = 1, hi = (size_t)1 << 34;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (rpc__check_request(b, n, d, NULL, 0, mid, msg, sizeof msg) == 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

static void test_estimate_bounds_real_allocation(void **state) {
    (void)state;
    /* a Struct of 2,000 short string fields, as a workflow definition carries */
    enum { N = 2000 };
    static Google__Protobuf__Value v[N];
    static Google__Protobuf__Struct__FieldsEntry e[N];
    static Google__Protobuf__Struct__FieldsEntry *ep[N];
    static char keys[N][16];
    for (int i = 0; i < N; i++) {
        google__protobuf__value__init(&v[i]);
        v[i].kind_case = GOOGLE__PROTOBUF__VALUE__KIND_STRING_VALUE;
        v[i].string_value = "value";
        google__protobuf__struct__fields_entry__init(&e[i]);
        snprintf(keys[i], sizeof keys[i], "key-%d", i);
        e[i].key = keys[i];
        e[i].value = &v[i];
        ep[i] = &e[i];
    }
    Google__Protobuf__Struct st = GOOGLE__PROTOBUF__STRUCT__INIT;
    st.fields = ep;
    st.n_fields = N;
    Upsquad__Test__V1__EchoRequest er = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    er.meta = &st;
    er.text = "hello";
    /* and a flat repeated field of empty strings, the amplification case */
    CompareReq c = UPSQUAD__RUNTIME__V1__COMPARE_MODELS_REQUEST__INIT;
    static char *ids[50000];
    for (int i = 0; i < 50000; i++)
        ids[i] = "";
    c.model_ids = ids;
    c.n_model_ids = 50000;
    const ProtobufCMessage *msgs[] = {&er.base, &c.base};
    for (size_t i = 0; i < 2; i++) {
        size_t n;
        uint8_t *b = pack(msgs[i], &n);
        ProtobufCAllocator a = {count_alloc, count_free, NULL};
        counted = 0;
        ProtobufCMessage *m = protobuf_c_message_unpack(msgs[i]->descriptor, &a, n, b);
        assert_non_null(m);
        protobuf_c_message_free_unpacked(m, &a);
        size_t est = estimate(b, n, msgs[i]->descriptor);
        print_message("%s: %zu wire bytes, %zu allocated, %zu estimated\n",
                      msgs[i]->descriptor->name, n, counted, est);
        assert_true(est >= counted);     /* an upper bound ... */
        assert_true(est <= 3 * counted); /* ... that is not wildly pessimistic */
        free(b);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strings_utf8_and_nul),
        cmocka_unit_test(test_repeated_limit),
        cmocka_unit_test(test_nested_limit_path),
        cmocka_unit_test(test_malformed),
        cmocka_unit_test(test_nesting),
        cmocka_unit_test(test_estimate_bounds_real_allocation),
    };
    return cmocka_run_group_tests_name("rpc request limits", tests, NULL, NULL);
}
