/* A server whose start fails part-way is taken apart cleanly (the process exits 1 with a
 * message, it does not crash in shutdown), and an incomplete TLS configuration is refused at
 * start instead of serving plaintext or reading a file named NULL. Each case runs in a child
 * process, so a crash is a failed test, not a dead test runner. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <cmocka.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "rpc.h"
#include "rpc_internal.h"
#include "upsquad/test/v1/echo.pb-c.h"

static int echo_fn(rpc_call *call, const ProtobufCMessage *req, ProtobufCMessage *resp, void *ud) {
    (void)call, (void)req, (void)resp, (void)ud;
    return RPC_OK;
}

static const rpc_method methods[] = {
    {"/upsquad.test.v1.EchoService/PublicEcho", RPC_UNARY, RPC_AUTH_NONE,
     &upsquad__test__v1__echo_request__descriptor, &upsquad__test__v1__echo_response__descriptor,
     echo_fn, NULL, NULL, .flags = RPC_BLOCKING},
};

/* rpc_server_new/add/start/free as svc_main does: 0 started, 1 refused (message on stderr). */
static int start_and_free(const rpc_server_opts *o, char *msg, size_t len) {
    rpc_server *s = NULL;
    int rc = rpc_server_new(o, &s, msg, len);
    if (rc == 0) rc = rpc_server_add(s, methods, 1);
    if (rc == 0) rc = rpc_server_start(s, msg, len);
    if (s) rpc_server_shutdown(s, 0);
    rpc_server_free(s);
    return rc == 0 ? 0 : 1;
}

/* Runs fn in a child; returns its exit code, or 100 + signal when it crashed. */
static int in_child(void (*fn)(void)) {
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        fn();
        _exit(0);
    }
    int st = 0;
    waitpid(pid, &st, 0);
    return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
}

/* Thread creation fails part-way: the server's thread factory refuses after a few threads
 * (as pthread_create does when memory or the thread limit runs out). */
static int threads_left;
static int failing_create(pthread_t *t, const pthread_attr_t *a, void *(*fn)(void *), void *arg) {
    if (threads_left-- <= 0) return EAGAIN;
    return pthread_create(t, a, fn, arg);
}

static void child_threads_fail(void) {
    char msg[256] = "";
    rpc_server *s = NULL;
    rpc_server_opts o = {.addr = "127.0.0.1:0", .stream_workers = 200, .blocking_workers = 4};
    if (rpc_server_new(&o, &s, msg, sizeof msg) != 0 || rpc_server_add(s, methods, 1) != 0)
        _exit(51);
    threads_left = 5;
    rpc__thread_create = failing_create;
    int rc = rpc_server_start(s, msg, sizeof msg);
    fprintf(stderr, "start: %s\n", msg);
    rpc_server_shutdown(s, 0); /* what svc_main does on a failed start */
    rpc_server_free(s);
    _exit(rc != 0 && strstr(msg, "cannot start threads") ? 1 : 53);
}

static void test_thread_creation_fails_part_way(void **state) {
    (void)state;
    assert_int_equal(in_child(child_threads_fail), 1);
}

/* The listener cannot be created: the port is taken by a server that runs. */
static void child_listen_fails(void) {
    char msg[256] = "";
    rpc_server *s = NULL;
    rpc_server_opts o = {.addr = "127.0.0.1:0"};
    if (rpc_server_new(&o, &s, msg, sizeof msg) != 0 || rpc_server_add(s, methods, 1) != 0 ||
        rpc_server_start(s, msg, sizeof msg) != 0)
        _exit(60);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", rpc_server_port(s));
    rpc_server_opts o2 = {.addr = addr};
    int rc = start_and_free(&o2, msg, sizeof msg);
    rpc_server_shutdown(s, 0);
    rpc_server_free(s);
    _exit(rc == 1 && strstr(msg, "cannot listen") ? 1 : 61);
}

static void test_listener_fails(void **state) {
    (void)state;
    assert_int_equal(in_child(child_listen_fails), 1);
}

static const char *tls_case_msg;
static rpc_tls tls_case;

static void child_tls(void) {
    char msg[256] = "";
    rpc_server_opts o = {.addr = "127.0.0.1:0", .tls = &tls_case};
    int rc = start_and_free(&o, msg, sizeof msg);
    _exit(rc == 1 && strstr(msg, tls_case_msg) ? 1 : 70);
}

static void test_tls_incomplete_refused(void **state) {
    (void)state;
    char dir[] = "/tmp/upsquad-tlscfg-XXXXXX", pem[300];
    assert_non_null(mkdtemp(dir));
    snprintf(pem, sizeof pem, "%s/any.pem", dir); /* content never read: refused before */
    FILE *f = fopen(pem, "w");
    assert_non_null(f);
    fputs("-----BEGIN CERTIFICATE-----\n-----END CERTIFICATE-----\n", f);
    fclose(f);
    /* a client CA alone would have served plaintext without client authentication */
    tls_case = (rpc_tls){NULL, NULL, pem};
    tls_case_msg = "client CA is set but no server certificate";
    assert_int_equal(in_child(child_tls), 1);
    /* a certificate without its key reached fopen(NULL) */
    tls_case = (rpc_tls){pem, NULL, NULL};
    tls_case_msg = "without its key";
    assert_int_equal(in_child(child_tls), 1);
    tls_case = (rpc_tls){NULL, pem, pem};
    tls_case_msg = "without its certificate";
    assert_int_equal(in_child(child_tls), 1);
    unlink(pem);
    rmdir(dir);
}

/* The service executable: the same configuration through the environment exits 1. */
static void test_service_refuses_ca_without_cert(void **state) {
    (void)state;
    const char *b = getenv("BUILD");
    char bin[512];
    snprintf(bin, sizeof bin, "%s/bin/echo-server", b ? b : "build");
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("UPSQUAD_GRPC_ADDR", "127.0.0.1:0", 1);
        setenv("UPSQUAD_JWT_SECRET", "start-test-secret-0123456789abcdefghij", 1);
        setenv("UPSQUAD_TLS_CLIENT_CA_FILE", "/etc/hostname", 1);
        setenv("UPSQUAD_LOG_LEVEL", "error", 1);
        int devnull = open("/dev/null", O_WRONLY);
        if (devnull >= 0) dup2(devnull, 1), dup2(devnull, 2);
        execl(bin, bin, (char *)NULL);
        _exit(127);
    }
    int st = 0;
    for (int i = 0; i < 500 && waitpid(pid, &st, WNOHANG) == 0; i++)
        usleep(10000);
    if (waitpid(pid, &st, WNOHANG) == 0) { /* still serving: plaintext, the defect */
        kill(pid, SIGKILL);
        waitpid(pid, &st, 0);
        fail_msg("echo-server served with a client CA and no certificate");
    }
    assert_true(WIFEXITED(st));
    assert_int_equal(WEXITSTATUS(st), 1);
}

int main(void) {
    log_init("test_rpc_start", LOG_ERROR);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_thread_creation_fails_part_way),
        cmocka_unit_test(test_listener_fails),
        cmocka_unit_test(test_tls_incomplete_refused),
        cmocka_unit_test(test_service_refuses_ca_without_cert),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
