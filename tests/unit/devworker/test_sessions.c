/* devworker's session table and checkpoint queue (worker.c): LRU eviction, termination,
 * iteration reservation, restored suspensions, the bounded queue's drop-oldest policy. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "../../../services/devworker/worker.h"
#include "util.h"

static dw_config cfg;
static dw_worker w;

static int setup(void **st) {
    (void)st;
    memset(&w, 0, sizeof w);
    memset(&cfg, 0, sizeof cfg);
    cfg.max_sessions = 3;
    cfg.checkpoint_queue = 2;
    w.cfg = &cfg;
    pthread_mutex_init(&w.mu, NULL);
    util_cond_init_monotonic(&w.cv);
    w.sessions = calloc(3, sizeof *w.sessions);
    w.ckq_cap = 2;
    w.ckq = calloc(2, sizeof *w.ckq);
    return w.sessions && w.ckq ? 0 : -1;
}

static int teardown(void **st) {
    (void)st;
    for (size_t i = 0; i < w.n_sessions; i++)
        free(w.sessions[i].state);
    while (w.ckq_len) {
        free(w.ckq[w.ckq_head].bytes);
        w.ckq_head = (w.ckq_head + 1) % w.ckq_cap;
        w.ckq_len--;
    }
    free(w.sessions);
    free(w.ckq);
    return 0;
}

static void test_lru_eviction(void **st) {
    (void)st;
    char model[DW_ID_MAX];
    dw_session_init(&w, "a", "org", "m-a", 5, -1);
    dw_session_init(&w, "b", "org", "m-b", 0, -1);
    dw_session_init(&w, "c", "org", "m-c", 0, -1);
    assert_int_equal(dw_session_touch(&w, "a", NULL, NULL), 5); /* a is now the most recent */
    dw_session_init(&w, "d", "org", "m-d", 0, -1);              /* full: b (oldest) goes */
    assert_int_equal(w.n_sessions, 3);
    dw_session_model(&w, "b", model);
    assert_string_equal(model, "");
    dw_session_model(&w, "a", model);
    assert_string_equal(model, "m-a");
    dw_session_model(&w, "d", model);
    assert_string_equal(model, "m-d");
}

static void test_terminate_and_steps(void **st) {
    (void)st;
    dw_step_ref r1 = {.session_id = "x"}, r2 = {.session_id = "y"};
    atomic_init(&r1.terminated, 0);
    atomic_init(&r2.terminated, 0);
    dw_session_init(&w, "x", "", "", 0, -1);
    dw_session_init(&w, "y", "", "", 0, -1);
    dw_step_register(&w, &r1);
    dw_step_register(&w, &r2);
    assert_int_equal(w.n_steps, 2);
    dw_session_terminate(&w, "x");
    assert_int_equal(atomic_load(&r1.terminated), 1);
    assert_int_equal(atomic_load(&r2.terminated), 0);
    assert_int_equal(w.n_sessions, 1);
    assert_string_equal(w.sessions[0].id, "y"); /* the last slot filled the hole */
    dw_session_terminate(&w, "x");              /* idempotent */
    dw_session_terminate(&w, "y");
    assert_int_equal(w.n_sessions, 0);
    dw_step_unregister(&w, &r1);
    dw_step_unregister(&w, &r2);
    assert_int_equal(w.n_steps, 0);
    assert_null(w.steps);
}

static void test_iterations_and_state(void **st) {
    (void)st;
    uint8_t blob[] = {0, 0, 0, 1, '{', '}'};
    assert_int_equal(dw_session_reserve_iter(&w, "s"), 0);
    assert_int_equal(dw_session_reserve_iter(&w, "s"), 1);
    dw_session_set_state(&w, "s", 7, blob, sizeof blob, "h");
    assert_int_equal(dw_session_touch(&w, "s", NULL, NULL), 8); /* past the stored iteration */
    dw_session_set_state(&w, "s", 3, blob, sizeof blob, "h2");  /* an older one: no step back */
    assert_int_equal(dw_session_reserve_iter(&w, "s"), 8);
}

static void test_resume_taken_once(void **st) {
    (void)st;
    char call[DW_ID_MAX], tool[DW_ID_MAX];
    int32_t at = 0;
    dw_session_set_resume(&w, "r", 4, "sha1", "call-3", "merge");
    assert_int_equal(dw_session_take_resume(&w, "r", "other", &at, call, tool), 0);
    assert_int_equal(dw_session_take_resume(&w, "r", "sha1", &at, call, tool), 0); /* consumed */
    dw_session_set_resume(&w, "r", 4, "sha1", "call-3", "merge");
    assert_int_equal(dw_session_take_resume(&w, "r", "sha1", &at, call, tool), 1);
    assert_int_equal(at, 4);
    assert_string_equal(call, "call-3");
    assert_string_equal(tool, "merge");
    assert_int_equal(dw_session_take_resume(&w, "nobody", "sha1", &at, call, tool), 0);
}

static void test_queue_drops_oldest(void **st) {
    (void)st;
    uint8_t b[4] = {0, 0, 0, 1};
    dw_checkpoint_enqueue(&w, "q", "t", 1, b, 4, "h1");
    dw_checkpoint_enqueue(&w, "q", "t", 2, b, 4, "h2");
    dw_checkpoint_enqueue(&w, "q", "t", 3, b, 4, "h3");
    assert_int_equal(w.ckq_len, 2);
    assert_int_equal(w.ckq[w.ckq_head].loop_iteration, 2);
    assert_int_equal(w.ckq[(w.ckq_head + 1) % w.ckq_cap].loop_iteration, 3);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_lru_eviction, setup, teardown),
        cmocka_unit_test_setup_teardown(test_terminate_and_steps, setup, teardown),
        cmocka_unit_test_setup_teardown(test_iterations_and_state, setup, teardown),
        cmocka_unit_test_setup_teardown(test_resume_taken_once, setup, teardown),
        cmocka_unit_test_setup_teardown(test_queue_drops_oldest, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
