/* Call lifetime (and the per-thread token cache, freed when its thread exits), in-process over real
 * gRPC on loopback: hooks registered with rpc_call_defer run once the call is freed (after the
 * reply, and for a failed call too), and a Struct built by pbjson in the call's arena goes out in
 * the response without a copy or a free. Run under valgrind by `make test`: nothing may leak. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "log.h"
#include "pbjson.h"
#include "rpc.h"
#include "rpc_client.h"
#include "upsquad/test/v1/echo.pb-c.h"

#define PATH(m) "/upsquad.test.v1.EchoService/" m

typedef Upsquad__Test__V1__EchoRequest EchoRequest;
typedef Upsquad__Test__V1__EchoResponse EchoResponse;

#define SECRET "lifetime-test-secret-0123456789abcdefghij"

static rpc_server *srv;
static auth_verifier *verifier;
static char *token;
static rpc_channel *ch;
static atomic_int hooks_run;
static atomic_int order[4], n_order;

static void count_hook(void *arg) {
    int i = atomic_fetch_add(&n_order, 1);
    if (i < 4) atomic_store(&order[i], (int)(intptr_t)arg); /* the first call's order */
    atomic_fetch_add(&hooks_run, 1);
}

static void free_hook(void *arg) {
    free(arg);
    atomic_fetch_add(&hooks_run, 1);
}

/* text = JSON object: returned as meta, built in the arena; a heap string freed by a hook. */
static int struct_echo(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp,
                       void *ud) {
    (void)ud;
    const EchoRequest *r = (const EchoRequest *)req;
    EchoResponse *out = (EchoResponse *)resp;
    char *heap = strdup(r->text); /* memory the response borrows, released by the hook */
    if (heap == NULL || rpc_call_defer(call, free_hook, heap) != RPC_OK) {
        free(heap);
        return rpc_error(call, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    rpc_call_defer(call, count_hook, (void *)(intptr_t)1);
    rpc_call_defer(call, count_hook, (void *)(intptr_t)2);
    out->text = heap;
    cJSON *j = cJSON_Parse(r->text);
    char err[200];
    int rc = pbjson_struct_from_json_a(j, rpc_call_allocator(call), &out->meta, err, sizeof err);
    cJSON_Delete(j);
    if (rc != 0) return rpc_error(call, RPC_INVALID_ARGUMENT, "text: %s", err);
    return RPC_OK;
}

static int setup(void **state) {
    (void)state;
    char err[256];
    auth_config ac = {.hs256_secret = SECRET, .audience = "upsquad"};
    auth_signer *signer = NULL;
    auth_claims claims = {
        .sub = "member-1", .org_id = "org-1", .audience = "upsquad", .clearance = 2, .ttl_s = 600};
    if (auth_verifier_new(&ac, &verifier, err, sizeof err) != AUTH_OK ||
        auth_signer_new("HS256", SECRET, &signer, err, sizeof err) != AUTH_OK ||
        auth_mint(signer, &claims, &token, err, sizeof err) != AUTH_OK)
        return -1;
    auth_signer_free(signer);
    rpc_server_opts o = {.addr = "127.0.0.1:0", .blocking_workers = 1, .auth = verifier};
    rpc_method m[] = {
        {PATH("PublicEcho"), RPC_UNARY, RPC_AUTH_NONE, &upsquad__test__v1__echo_request__descriptor,
         &upsquad__test__v1__echo_response__descriptor, struct_echo, NULL, NULL,
         .flags = RPC_BLOCKING},
        {PATH("Echo"), RPC_UNARY, RPC_AUTH_REQUIRED, &upsquad__test__v1__echo_request__descriptor,
         &upsquad__test__v1__echo_response__descriptor, struct_echo, NULL, NULL},
    };
    if (rpc_server_new(&o, &srv, err, sizeof err) != 0 || rpc_server_add(srv, m, 2) != 0 ||
        rpc_server_start(srv, err, sizeof err) != 0)
        return -1;
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_opts co = {.target = target};
    return rpc_channel_new(&co, &ch, err, sizeof err) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    (void)state;
    rpc_channel_free(ch);
    rpc_server_shutdown(srv, 1000);
    rpc_server_free(srv);
    auth_verifier_free(verifier);
    free(token);
    return 0;
}

static int call(const char *text, EchoResponse **resp) {
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    req.text = (char *)text;
    rpc_call_opts o = {.timeout_ms = 5000};
    return rpc_unary_call(ch, PATH("PublicEcho"), &req.base,
                          &upsquad__test__v1__echo_response__descriptor, &o,
                          (ProtobufCMessage **)resp, NULL);
}

static void wait_hooks(int want) {
    for (int i = 0; i < 500 && atomic_load(&hooks_run) < want; i++)
        usleep(2000);
    assert_int_equal(atomic_load(&hooks_run), want);
}

static void test_struct_in_arena_and_hooks(void **state) {
    (void)state;
    EchoResponse *resp = NULL;
    atomic_store(&hooks_run, 0);
    n_order = 0;
    const char *json = "{\"a\":[1,\"two\",{\"b\":null}],\"c\":true}";
    assert_int_equal(call(json, &resp), RPC_OK);
    assert_string_equal(resp->text, json);
    assert_non_null(resp->meta);
    assert_int_equal(resp->meta->n_fields, 2);
    assert_string_equal(resp->meta->fields[0]->key, "a");
    assert_int_equal(resp->meta->fields[0]->value->list_value->n_values, 3);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    wait_hooks(3); /* the heap string's free and both counters */
    assert_int_equal(n_order, 2);
    assert_int_equal(order[0], 2); /* reverse order of registration */
    assert_int_equal(order[1], 1);
}

static void test_hooks_run_for_failed_call(void **state) {
    (void)state;
    EchoResponse *resp = NULL;
    atomic_store(&hooks_run, 0);
    n_order = 0;
    /* a number JSON cannot carry: refused part-way through the tree, in the arena */
    assert_int_equal(call("{\"ok\":{\"x\":[1,2]},\"bad\":1e400}", &resp), RPC_INVALID_ARGUMENT);
    assert_null(resp);
    wait_hooks(3);
}

/* The verified token is cached by the queue thread; that thread ends at shutdown and its
 * table must go with it (valgrind: "definitely lost" before). */
static void test_authenticated_call_caches_token(void **state) {
    (void)state;
    EchoRequest req = UPSQUAD__TEST__V1__ECHO_REQUEST__INIT;
    EchoResponse *resp = NULL;
    req.text = "{}";
    rpc_call_opts o = {.timeout_ms = 5000, .bearer = token};
    for (int i = 0; i < 2; i++) { /* the second one is a cache hit */
        assert_int_equal(rpc_unary_call(ch, PATH("Echo"), &req.base,
                                        &upsquad__test__v1__echo_response__descriptor, &o,
                                        (ProtobufCMessage **)&resp, NULL),
                         RPC_OK);
        protobuf_c_message_free_unpacked(&resp->base, NULL);
    }
}

static void test_defer_bad_arguments(void **state) {
    (void)state;
    assert_int_equal(rpc_call_defer(NULL, free_hook, NULL), RPC_EINVAL);
}

int main(void) {
    log_init("test_rpc_lifetime", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_struct_in_arena_and_hooks),
        cmocka_unit_test(test_hooks_run_for_failed_call),
        cmocka_unit_test(test_authenticated_call_caches_token),
        cmocka_unit_test(test_defer_bad_arguments),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
