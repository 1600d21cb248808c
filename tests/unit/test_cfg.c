/* Environment configuration (libcommon/cfg.c): defaults, every parse error collected in one
 * message, ranges, secrets (never echoed, NAME_FILE), the markdown table and the log line. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "cfg.h"
#include "log.h"

static const char *const all_names[] = {
    "UPSQUAD_T_ADDR", "UPSQUAD_T_PORT",   "UPSQUAD_T_DEBUG",       "UPSQUAD_T_TIMEOUT",
    "UPSQUAD_T_DSN",  "UPSQUAD_T_SECRET", "UPSQUAD_T_SECRET_FILE", "UPSQUAD_T_OPT",
    "UPSQUAD_T_N",    "UPSQUAD_T_PIN",    "UPSQUAD_T_PIN_FILE",    "UPSQUAD_T_PLAIN_FILE",
    "UPSQUAD_T_PLAIN"};

static int clean_env(void **state) {
    (void)state;
    for (size_t i = 0; i < sizeof all_names / sizeof all_names[0]; i++)
        unsetenv(all_names[i]);
    log_init("test-cfg", LOG_INFO);
    return 0;
}

static char *addr, *dsn, *secret, *opt;
static long long port, timeout_ms, n_untouched;
static int debug;

static const cfg_var vars[] = {
    {"UPSQUAD_T_ADDR", CFG_STR, "127.0.0.1:7000", "gRPC listen address", &addr, 0, 0, 0},
    {"UPSQUAD_T_PORT", CFG_INT, "9101", "metrics port", &port, 0, 65535, 0},
    {"UPSQUAD_T_DEBUG", CFG_BOOL, "false", "verbose mode", &debug, 0, 0, 0},
    {"UPSQUAD_T_TIMEOUT", CFG_MS, "5s", "RPC deadline | upper bound", &timeout_ms, 1, 3600000, 0},
    {"UPSQUAD_T_DSN", CFG_STR, NULL, "Postgres DSN", &dsn, 0, 0, CFG_REQUIRED},
    {"UPSQUAD_T_SECRET", CFG_STR, "dev-default-secret", "signing secret", &secret, 0, 0,
     CFG_SECRET},
    {"UPSQUAD_T_OPT", CFG_STR, NULL, "optional thing", &opt, 0, 0, 0},
    {"UPSQUAD_T_N", CFG_INT, NULL, "no default", &n_untouched, 0, 0, 0},
};
#define NVARS (sizeof vars / sizeof vars[0])

static void test_defaults(void **state) {
    (void)state;
    char err[512];
    setenv("UPSQUAD_T_DSN", "postgres://localhost/db", 1);
    n_untouched = 77;
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), 0);
    assert_string_equal(err, "");
    assert_string_equal(addr, "127.0.0.1:7000");
    assert_int_equal(port, 9101);
    assert_int_equal(debug, 0);
    assert_int_equal(timeout_ms, 5000);
    assert_string_equal(dsn, "postgres://localhost/db");
    assert_string_equal(secret, "dev-default-secret");
    assert_null(opt);
    assert_int_equal(n_untouched, 77);
    cfg_free(vars, NVARS);
    assert_null(addr);
    assert_null(dsn);
    cfg_free(vars, NVARS); /* twice is harmless */
}

static void test_values(void **state) {
    (void)state;
    char err[512];
    setenv("UPSQUAD_T_ADDR", "0.0.0.0:1", 1);
    setenv("UPSQUAD_T_PORT", "-0", 1);
    setenv("UPSQUAD_T_DEBUG", "YES", 1);
    setenv("UPSQUAD_T_TIMEOUT", "2m", 1);
    setenv("UPSQUAD_T_DSN", "x", 1);
    setenv("UPSQUAD_T_OPT", "", 1); /* empty = unset */
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), 0);
    assert_string_equal(addr, "0.0.0.0:1");
    assert_int_equal(port, 0);
    assert_int_equal(debug, 1);
    assert_int_equal(timeout_ms, 120000);
    assert_null(opt);
    cfg_free(vars, NVARS);
}

static void test_errors_collected(void **state) {
    (void)state;
    char err[1024];
    setenv("UPSQUAD_T_PORT", "abc", 1);
    setenv("UPSQUAD_T_DEBUG", "maybe", 1);
    setenv("UPSQUAD_T_TIMEOUT", "5x", 1);
    /* UPSQUAD_T_DSN required and unset */
    addr = (char *)"sentinel";
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), -1);
    assert_string_equal(err, "UPSQUAD_T_PORT: not an integer: \"abc\"; "
                             "UPSQUAD_T_DEBUG: not a boolean (true/false, 1/0, yes/no, on/off): "
                             "\"maybe\"; "
                             "UPSQUAD_T_TIMEOUT: not a duration (250ms, 5s, 2m, 1h): \"5x\"; "
                             "UPSQUAD_T_DSN: required");
    /* Strings loaded before the failure were released. */
    assert_null(addr);
    assert_null(secret);

    setenv("UPSQUAD_T_PORT", "70000", 1);
    setenv("UPSQUAD_T_DEBUG", "on", 1);
    setenv("UPSQUAD_T_TIMEOUT", "2h", 1);
    setenv("UPSQUAD_T_DSN", "x", 1);
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), -1);
    assert_string_equal(err, "UPSQUAD_T_PORT: out of range 0..65535: \"70000\"; "
                             "UPSQUAD_T_TIMEOUT: out of range 1..3600000 ms: \"2h\"");

    setenv("UPSQUAD_T_PORT", "99999999999999999999", 1);
    setenv("UPSQUAD_T_TIMEOUT", "0ms", 1);
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), -1);
    assert_non_null(strstr(err, "UPSQUAD_T_PORT: not an integer"));
    assert_non_null(strstr(err, "UPSQUAD_T_TIMEOUT: out of range"));

    /* A tiny buffer still gets a terminated prefix. */
    char small[16];
    assert_int_equal(cfg_load(vars, NVARS, small, sizeof small), -1);
    assert_int_equal(strlen(small), sizeof small - 1);
}

static void test_parsers(void **state) {
    (void)state;
    long long v;
    int b;
    struct {
        const char *s;
        long long want; /* -1: invalid */
    } ms[] = {{"250ms", 250},
              {"5s", 5000},
              {"2m", 120000},
              {"1h", 3600000},
              {"1500", 1500},
              {"0", 0},
              {"", -1},
              {"-5s", -1},
              {"5 s", -1},
              {"5S", -1},
              {"s", -1},
              {"1.5s", -1},
              {"5sec", -1},
              {" 5s", -1},
              {"9223372036854775807ms", 9223372036854775807LL},
              {"9223372036854775807s", -1},
              {"99999999999999999999", -1}};
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
        int rc = cfg_parse_ms(ms[i].s, &v);
        if (ms[i].want < 0) {
            assert_int_equal(rc, -1);
        } else {
            assert_int_equal(rc, 0);
            assert_int_equal(v, ms[i].want);
        }
    }
    assert_int_equal(cfg_parse_int("42", &v), 0);
    assert_int_equal(v, 42);
    assert_int_equal(cfg_parse_int("-7", &v), 0);
    assert_int_equal(v, -7);
    assert_int_equal(cfg_parse_int("+7", &v), 0);
    assert_int_equal(cfg_parse_int(" 7", &v), -1);
    assert_int_equal(cfg_parse_int("7 ", &v), -1);
    assert_int_equal(cfg_parse_int("0x10", &v), -1);
    assert_int_equal(cfg_parse_int("", &v), -1);
    const char *yes[] = {"1", "true", "TRUE", "yes", "On"}, *no[] = {"0", "false", "No", "off"};
    for (size_t i = 0; i < 5; i++) {
        assert_int_equal(cfg_parse_bool(yes[i], &b), 0);
        assert_int_equal(b, 1);
    }
    for (size_t i = 0; i < 4; i++) {
        assert_int_equal(cfg_parse_bool(no[i], &b), 0);
        assert_int_equal(b, 0);
    }
    assert_int_equal(cfg_parse_bool("2", &b), -1);
    assert_int_equal(cfg_parse_bool("", &b), -1);
    assert_int_equal(cfg_parse_bool("truee", &b), -1);
}

static char *pin_secret;
static long long pin_num;
static char *plain;
static const cfg_var secret_vars[] = {
    {"UPSQUAD_T_PIN", CFG_STR, NULL, "API key", &pin_secret, 0, 0, CFG_SECRET | CFG_REQUIRED},
    {"UPSQUAD_T_N", CFG_INT, NULL, "secret number", &pin_num, 1, 10, CFG_SECRET},
    {"UPSQUAD_T_PLAIN", CFG_STR, "dflt", "not secret", &plain, 0, 0, 0},
};

static char *write_temp(const char *content) {
    char *path = strdup("/tmp/test_cfg_XXXXXX");
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, content, strlen(content)), (ssize_t)strlen(content));
    close(fd);
    return path;
}

static void test_secrets(void **state) {
    (void)state;
    char err[512];
    /* Values of secrets are never quoted back. */
    setenv("UPSQUAD_T_PIN", "s3cr3t-value", 1);
    setenv("UPSQUAD_T_N", "hunter2", 1);
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), -1);
    assert_string_equal(err, "UPSQUAD_T_N: not an integer");
    setenv("UPSQUAD_T_N", "11", 1);
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), -1);
    assert_string_equal(err, "UPSQUAD_T_N: out of range 1..10");
    unsetenv("UPSQUAD_T_N");

    /* NAME_FILE: trailing newlines removed. */
    unsetenv("UPSQUAD_T_PIN");
    char *path = write_temp("from-file-secret\r\n\n");
    setenv("UPSQUAD_T_PIN_FILE", path, 1);
    /* _FILE is only for secrets: a plain variable ignores it. */
    setenv("UPSQUAD_T_PLAIN_FILE", path, 1);
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), 0);
    assert_string_equal(pin_secret, "from-file-secret");
    assert_string_equal(plain, "dflt");
    cfg_free(secret_vars, 3);

    /* Both set: refused. */
    setenv("UPSQUAD_T_PIN", "env-value", 1);
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), -1);
    assert_string_equal(err,
                        "UPSQUAD_T_PIN: set either UPSQUAD_T_PIN or UPSQUAD_T_PIN_FILE, not both");
    unsetenv("UPSQUAD_T_PIN");

    /* Missing file: the error names the variable and the path, not a value. */
    setenv("UPSQUAD_T_PIN_FILE", "/nonexistent/secret", 1);
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), -1);
    assert_non_null(strstr(err, "UPSQUAD_T_PIN_FILE: cannot open /nonexistent/secret"));

    /* Oversized file refused. */
    char *huge = malloc(CFG_FILE_MAX + 2);
    memset(huge, 'k', CFG_FILE_MAX + 1);
    huge[CFG_FILE_MAX + 1] = '\0';
    char *bigpath = write_temp(huge);
    setenv("UPSQUAD_T_PIN_FILE", bigpath, 1);
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), -1);
    assert_non_null(strstr(err, "larger than"));
    unlink(bigpath);
    free(bigpath);
    free(huge);

    /* Required secret with neither form. */
    unsetenv("UPSQUAD_T_PIN_FILE");
    assert_int_equal(cfg_load(secret_vars, 3, err, sizeof err), -1);
    assert_string_equal(err, "UPSQUAD_T_PIN: required");
    unsetenv("UPSQUAD_T_PLAIN_FILE");
    unlink(path);
    free(path);
}

static void test_markdown(void **state) {
    (void)state;
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    cfg_print_markdown(vars, NVARS, f);
    fclose(f);
    assert_true(strncmp(buf, "| variable | default | description |\n|---|---|---|\n", 50) == 0);
    assert_non_null(strstr(buf, "| `UPSQUAD_T_ADDR` | `127.0.0.1:7000` | gRPC listen address "
                                "(string) |\n"));
    assert_non_null(strstr(buf, "| `UPSQUAD_T_TIMEOUT` | `5s` | RPC deadline \\| upper bound "
                                "(duration, 1..3600000 ms) |\n"));
    assert_non_null(strstr(buf, "| `UPSQUAD_T_DSN` | (required) | Postgres DSN (string, "
                                "required) |\n"));
    assert_non_null(strstr(buf, "| `UPSQUAD_T_SECRET` | (secret) | signing secret (string; or "
                                "read from the file named by `UPSQUAD_T_SECRET_FILE`) |\n"));
    assert_null(strstr(buf, "dev-default-secret"));
    /* One header, one separator, one row per variable. */
    size_t lines = 0;
    for (char *p = buf; *p; p++)
        lines += *p == '\n';
    assert_int_equal(lines, NVARS + 2);
    free(buf);
}

static char *capture_log(const cfg_var *v, size_t n) {
    FILE *tf = tmpfile();
    int saved = dup(STDERR_FILENO);
    dup2(fileno(tf), STDERR_FILENO);
    cfg_log(v, n);
    dup2(saved, STDERR_FILENO);
    close(saved);
    fseek(tf, 0, SEEK_END);
    long len = ftell(tf);
    rewind(tf);
    char *s = calloc(1, (size_t)len + 1);
    assert_int_equal(fread(s, 1, (size_t)len, tf), (size_t)len);
    fclose(tf);
    return s;
}

static void test_log_masks(void **state) {
    (void)state;
    char err[512];
    setenv("UPSQUAD_T_DSN", "postgres://app:hunter2@db:5432/x?sslmode=disable", 1);
    setenv("UPSQUAD_T_SECRET", "topsecret-value", 1);
    setenv("UPSQUAD_T_OPT", "host=db user=app password=hunter2 dbname=x", 1);
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), 0);
    char *line = capture_log(vars, NVARS);
    assert_non_null(strstr(line, "\"event\":\"config.loaded\""));
    assert_null(strstr(line, "hunter2"));
    assert_null(strstr(line, "topsecret"));
    assert_non_null(strstr(line, "UPSQUAD_T_SECRET=***"));
    assert_non_null(strstr(line, "postgres://app:***@db:5432/x?sslmode=disable"));
    assert_non_null(strstr(line, "host=db user=app password=*** dbname=x"));
    assert_non_null(strstr(line, "UPSQUAD_T_TIMEOUT=5000ms"));
    assert_non_null(strstr(line, "UPSQUAD_T_DEBUG=false"));
    assert_non_null(strstr(line, "UPSQUAD_T_PORT=9101"));
    free(line);
    cfg_free(vars, NVARS);

    /* Quoted libpq passwords and URL query passwords, and a URL with '@' only in the path. */
    setenv("UPSQUAD_T_DSN", "password='a b\\' c' host=db", 1);
    setenv("UPSQUAD_T_OPT", "redis://cache:6379/0?user=x&password=hunter2&db=1", 1);
    setenv("UPSQUAD_T_ADDR", "nats://host:4222/path@x", 1);
    assert_int_equal(cfg_load(vars, NVARS, err, sizeof err), 0);
    line = capture_log(vars, NVARS);
    assert_non_null(strstr(line, "password=*** host=db"));
    assert_non_null(strstr(line, "?user=x&password=***&db=1"));
    assert_non_null(strstr(line, "nats://host:4222/path@x"));
    assert_null(strstr(line, "hunter2"));
    assert_null(strstr(line, " c'"));
    free(line);
    cfg_free(vars, NVARS);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup(test_defaults, clean_env),
        cmocka_unit_test_setup(test_values, clean_env),
        cmocka_unit_test_setup(test_errors_collected, clean_env),
        cmocka_unit_test_setup(test_parsers, clean_env),
        cmocka_unit_test_setup(test_secrets, clean_env),
        cmocka_unit_test_setup(test_markdown, clean_env),
        cmocka_unit_test_setup(test_log_masks, clean_env),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
