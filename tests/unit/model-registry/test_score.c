/* Recommendation scoring, ListModels ordering/filtering and CompareModels selection, on small
 * fixtures whose expected outcomes are computed by hand from the documented formulas. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mr_fixture.h"
#include "../../../services/model-registry/score.h"
#include "util.h"

/* Prices chosen so cost efficiencies are round: blended 1 -> 2/3, blended 10 -> 1/3,
 * blended 0.1 -> 1. */
static const fx_model team[] = {
    /* id           provider     reas  code  str   long  tool  tools status                in    out
     */
    {"big-a", "anthropic", 0.95, 0.95, 0.95, 0.95, 0.95, 1, MR_STATUS_ACTIVE, 10, 10},
    {"mid-o", "openai", 0.80, 0.80, 0.80, 0.80, 0.80, 1, MR_STATUS_ACTIVE, 1, 1},
    {"tiny-g", "google", 0.50, 0.50, 0.50, 0.50, 0.50, 1, MR_STATUS_ACTIVE, 0.1, 0.1},
    /* best on paper, but deprecated / without tools: must never be chosen */
    {"old-a", "anthropic", 1.00, 1.00, 1.00, 1.00, 1.00, 1, MR_STATUS_DEPRECATED, 0.1, 0.1},
    {"gone-o", "openai", 1.00, 1.00, 1.00, 1.00, 1.00, 1, MR_STATUS_RETIRED, 0.1, 0.1},
    {"notools-g", "google", 1.00, 1.00, 1.00, 1.00, 0.00, 0, MR_STATUS_ACTIVE, 0.1, 0.1},
};

static int setup(void **state) {
    mr_catalog c;
    mr_snapshot *s;
    char err[256];
    fx_catalog(&c, team, sizeof team / sizeof team[0]);
    if (mr_snapshot_build(&c, 10, &s, err, sizeof err)) return -1;
    *state = s;
    return 0;
}

static int teardown(void **state) {
    mr_snapshot_unref(*state);
    return 0;
}

static int recommend(const mr_snapshot *s, const char *role, const char *goal,
                     const char *const *prov, size_t np, size_t alts, mr_rec_result *out, char *err,
                     size_t errlen) {
    mr_rec_request rq = {role, prov, np, goal, alts};
    return mr_recommend(s, &rq, out, err, errlen);
}

static void test_role_table(void **state) {
    (void)state;
    static const char *required[] = {"architect",  "backend-sme", "qa-engineer", "planner",
                                     "researcher", "frontend",    "devops",      "reviewer",
                                     "writer",     "general"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++)
        assert_non_null(mr_role_find(required[i], strlen(required[i])));
    for (size_t i = 0; i < mr_role_count(); i++) {
        const mr_role *r = mr_role_at(i);
        double sum =
            r->w_reasoning + r->w_code + r->w_structured + r->w_long_context + r->w_tool_use;
        assert_true(fabs(sum - 1.0) < 1e-9);
        assert_true(r->agent);
    }
    assert_null(mr_role_at(mr_role_count()));
    assert_string_equal(mr_role_find(" QA_Engineer ", 13)->name, "qa-engineer");
    assert_string_equal(mr_role_find("Backend SME", 11)->name, "backend-sme");
    assert_string_equal(mr_role_find("backend", 7)->name, "backend-sme");
    assert_string_equal(mr_role_find("qa", 2)->name, "qa-engineer");
    assert_null(mr_role_find("astronaut", 9));
    assert_null(mr_role_find("", 0));
    assert_string_equal(mr_role_general()->name, "general");
}

static void test_goal_parse(void **state) {
    (void)state;
    int g = -1;
    assert_int_equal(mr_goal_parse("", 0, &g), 0);
    assert_int_equal(g, MR_GOAL_BALANCED);
    assert_int_equal(mr_goal_parse("  ", 2, &g), 0);
    assert_int_equal(g, MR_GOAL_BALANCED);
    assert_int_equal(mr_goal_parse("Quality", 7, &g), 0);
    assert_int_equal(g, MR_GOAL_QUALITY);
    assert_int_equal(mr_goal_parse("COST", 4, &g), 0);
    assert_int_equal(g, MR_GOAL_COST);
    assert_int_equal(mr_goal_parse("fast", 4, &g), -1);
    assert_int_equal(mr_goal_parse("cheapest-possible-model", 23, &g), -1);
    assert_true(mr_goal_price_weight(MR_GOAL_QUALITY) < mr_goal_price_weight(MR_GOAL_BALANCED));
    assert_true(mr_goal_price_weight(MR_GOAL_BALANCED) < mr_goal_price_weight(MR_GOAL_COST));
}

static void test_goals_trade_quality_against_price(void **state) {
    const mr_snapshot *s = *state;
    mr_rec_result r;
    char err[256];
    /* quality: big-a 0.95*0.95 + 0.05/3 = 0.9192 > mid-o 0.8*0.95 + 0.05*2/3 = 0.7933 */
    assert_int_equal(recommend(s, "architect", "quality", NULL, 0, 5, &r, err, sizeof err), MR_OK);
    assert_string_equal(r.best.e->m->model_id, "big-a");
    assert_true(fabs(r.best.score - (0.95 * 0.95 + 0.05 / 3.0)) < 1e-9);
    assert_true(fabs(r.best.quality - 0.95) < 1e-9);
    /* balanced: big-a 0.8*0.95 + 0.2/3 = 0.8267 > mid-o 0.64 + 0.1333 = 0.7733 */
    assert_int_equal(recommend(s, "architect", "", NULL, 0, 5, &r, err, sizeof err), MR_OK);
    assert_string_equal(r.best.e->m->model_id, "big-a");
    assert_int_equal(r.goal, MR_GOAL_BALANCED);
    /* cost: tiny-g 0.5*0.5 + 0.5*1 = 0.75 > mid-o 0.4 + 0.3333 = 0.7333 > big-a 0.475 + 0.1667 */
    assert_int_equal(recommend(s, "architect", "cost", NULL, 0, 5, &r, err, sizeof err), MR_OK);
    assert_string_equal(r.best.e->m->model_id, "tiny-g");
    assert_true(fabs(r.best.score - 0.75) < 1e-9);
    assert_int_equal(r.n_alternatives, 2);
    assert_string_equal(r.alternatives[0].e->m->model_id, "mid-o");
    assert_string_equal(r.alternatives[1].e->m->model_id, "big-a");
    assert_true(r.alternatives[0].score >= r.alternatives[1].score);
}

static void test_deprecated_and_toolless_never_win(void **state) {
    const mr_snapshot *s = *state;
    mr_rec_result r;
    char err[256];
    const char *goals[] = {"quality", "balanced", "cost"};
    for (size_t ri = 0; ri < mr_role_count(); ri++)
        for (size_t g = 0; g < 3; g++) {
            assert_int_equal(
                recommend(s, mr_role_at(ri)->name, goals[g], NULL, 0, 10, &r, err, sizeof err),
                MR_OK);
            const char *ids[11] = {r.best.e->m->model_id};
            for (size_t a = 0; a < r.n_alternatives; a++)
                ids[a + 1] = r.alternatives[a].e->m->model_id;
            for (size_t a = 0; a <= r.n_alternatives; a++) {
                assert_string_not_equal(ids[a], "old-a");
                assert_string_not_equal(ids[a], "gone-o");
                assert_string_not_equal(ids[a], "notools-g");
            }
            assert_non_null(strstr(r.reasoning, "excluded 2 deprecated or retired and 1 without "
                                                "tool use"));
        }
}

static void test_connected_providers(void **state) {
    const mr_snapshot *s = *state;
    mr_rec_result r;
    char err[256];
    const char *openai[] = {"  OpenAI "};
    assert_int_equal(recommend(s, "planner", "quality", openai, 1, 3, &r, err, sizeof err), MR_OK);
    assert_string_equal(r.best.e->m->model_id, "mid-o");
    assert_int_equal(r.n_alternatives, 0);
    assert_non_null(strstr(r.reasoning, "the only qualifying model"));
    assert_non_null(strstr(r.reasoning, "providers considered: openai"));

    /* unknown names are ignored, and said so */
    const char *mixed[] = {"google", "Mistral", "GOOGLE"};
    assert_int_equal(recommend(s, "planner", "quality", mixed, 3, 3, &r, err, sizeof err), MR_OK);
    assert_string_equal(r.best.e->m->model_id, "tiny-g");
    assert_non_null(strstr(r.reasoning, "ignored providers not in the catalogue: \"Mistral\""));

    /* empty list: every provider, and the reasoning says so */
    assert_int_equal(recommend(s, "planner", "quality", NULL, 0, 3, &r, err, sizeof err), MR_OK);
    assert_non_null(strstr(r.reasoning, "connected_providers was empty, so all catalogued "
                                        "providers were considered (anthropic, google, openai)"));

    /* only unknown providers: nothing qualifies, and the message says why */
    const char *unknown[] = {"mistral", "cohere"};
    assert_int_equal(recommend(s, "planner", "quality", unknown, 2, 3, &r, err, sizeof err),
                     MR_ENONE);
    assert_non_null(strstr(err, "none of connected_providers (\"mistral\", \"cohere\")"));
    assert_non_null(strstr(err, "anthropic, google, openai"));

    const char *blank[] = {"openai", "  "};
    assert_int_equal(recommend(s, "planner", "quality", blank, 2, 3, &r, err, sizeof err),
                     MR_EINVAL);
    assert_string_equal(err, "connected_providers[1]: empty provider name");

    const char *many[17];
    for (size_t i = 0; i < 17; i++)
        many[i] = "openai";
    assert_int_equal(recommend(s, "planner", "quality", many, 17, 3, &r, err, sizeof err),
                     MR_EINVAL);
    assert_non_null(strstr(err, "connected_providers: more than 16"));
}

static void test_no_qualifying_model(void **state) {
    (void)state;
    static const fx_model only_bad[] = {
        {"old", "acme", .9, .9, .9, .9, .9, 1, MR_STATUS_DEPRECATED, 1, 1},
        {"notools", "acme", .9, .9, .9, .9, 0, 0, MR_STATUS_ACTIVE, 1, 1},
    };
    mr_catalog c;
    mr_snapshot *s;
    mr_rec_result r;
    char err[512];
    fx_catalog(&c, only_bad, 2);
    assert_int_equal(mr_snapshot_build(&c, 10, &s, err, sizeof err), 0);
    assert_int_equal(recommend(s, "devops", "", NULL, 0, 3, &r, err, sizeof err), MR_ENONE);
    assert_string_equal(err, "no model qualifies for the devops role among providers acme: of 2 "
                             "models, 1 are deprecated or retired and 1 lack tool use, which "
                             "agent roles require");
    mr_snapshot_unref(s);

    mr_catalog empty;
    fx_catalog(&empty, NULL, 0);
    assert_int_equal(mr_snapshot_build(&empty, 10, &s, err, sizeof err), 0);
    assert_int_equal(recommend(s, "devops", "", NULL, 0, 3, &r, err, sizeof err), MR_ENONE);
    assert_string_equal(err, "the model catalogue is empty");
    mr_snapshot_unref(s);
}

static void test_bad_goal_and_role(void **state) {
    const mr_snapshot *s = *state;
    mr_rec_result r;
    char err[256];
    assert_int_equal(recommend(s, "architect", "fastest", NULL, 0, 3, &r, err, sizeof err),
                     MR_EINVAL);
    assert_non_null(strstr(err, "optimization_goal: unknown goal \"fastest\""));

    char longrole[80];
    memset(longrole, 'x', sizeof longrole - 1);
    longrole[sizeof longrole - 1] = '\0';
    assert_int_equal(recommend(s, longrole, "", NULL, 0, 3, &r, err, sizeof err), MR_EINVAL);
    assert_non_null(strstr(err, "agent_role"));

    assert_int_equal(recommend(s, "Astronaut", "", NULL, 0, 3, &r, err, sizeof err), MR_OK);
    assert_string_equal(r.role->name, "general");
    assert_non_null(strstr(r.reasoning, "agent_role \"Astronaut\" is not a known role, so the "
                                        "general profile was used"));
    assert_int_equal(recommend(s, "", "", NULL, 0, 3, &r, err, sizeof err), MR_OK);
    assert_non_null(strstr(r.reasoning, "agent_role was empty, so the general profile was used"));
    assert_int_equal(recommend(s, "architect", "", NULL, 0, 3, &r, err, sizeof err), MR_OK);
    assert_null(strstr(r.reasoning, "general profile"));
}

static void test_reasoning_has_deciding_numbers(void **state) {
    const mr_snapshot *s = *state;
    mr_rec_result r;
    char err[256], expect[128];
    assert_int_equal(recommend(s, "writer", "cost", NULL, 0, 2, &r, err, sizeof err), MR_OK);
    snprintf(expect, sizeof expect,
             "tiny-g is recommended for the writer role with the cost goal: "
             "score 0.750 = 0.50 x role quality 0.500 + 0.50 x cost");
    assert_non_null(strstr(r.reasoning, expect));
    assert_non_null(strstr(r.reasoning, "(USD 0.10/0.10 per million input/output tokens)"));
    assert_non_null(strstr(r.reasoning, "ahead of mid-o at 0.733"));
    assert_non_null(strstr(r.reasoning, "3 of 6 catalogued models qualified"));
    size_t n = strlen(r.reasoning);
    assert_true(n > 0 && r.reasoning[n - 1] == '.');
    assert_null(strchr(r.reasoning, '\n'));
}

static void test_alternatives_bounded_and_deterministic(void **state) {
    (void)state;
    /* identical scores: ties broken by quality, then cheaper blended price, then model_id */
    static const fx_model ties[] = {
        {"b-same", "p", .7, .7, .7, .7, .7, 1, MR_STATUS_ACTIVE, 1, 1},
        {"a-same", "p", .7, .7, .7, .7, .7, 1, MR_STATUS_ACTIVE, 1, 1},
        {"c-better", "p", .8, .8, .8, .8, .8, 1, MR_STATUS_ACTIVE, 1, 1},
        {"d", "p", .6, .6, .6, .6, .6, 1, MR_STATUS_ACTIVE, 1, 1},
        {"e", "p", .5, .5, .5, .5, .5, 1, MR_STATUS_ACTIVE, 1, 1},
    };
    mr_catalog c;
    mr_snapshot *s;
    mr_rec_result r1, r2;
    char err[256];
    fx_catalog(&c, ties, 5);
    assert_int_equal(mr_snapshot_build(&c, 10, &s, err, sizeof err), 0);
    assert_int_equal(recommend(s, "general", "quality", NULL, 0, 2, &r1, err, sizeof err), MR_OK);
    assert_string_equal(r1.best.e->m->model_id, "c-better");
    assert_int_equal(r1.n_alternatives, 2);
    assert_string_equal(r1.alternatives[0].e->m->model_id, "a-same");
    assert_string_equal(r1.alternatives[1].e->m->model_id, "b-same");
    assert_int_equal(recommend(s, "general", "quality", NULL, 0, 2, &r2, err, sizeof err), MR_OK);
    assert_string_equal(r1.reasoning, r2.reasoning);
    assert_int_equal(recommend(s, "general", "quality", NULL, 0, 0, &r1, err, sizeof err), MR_OK);
    assert_int_equal(r1.n_alternatives, 0);
    assert_int_equal(recommend(s, "general", "quality", NULL, 0, 99, &r1, err, sizeof err), MR_OK);
    assert_int_equal(r1.n_alternatives, 4); /* all the others, never more than there are */
    mr_snapshot_unref(s);
}

static void test_list_order_and_filter(void **state) {
    const mr_snapshot *s = *state;
    const mr_entry *out[16];
    size_t n = mr_list(s, "", out);
    static const char *order[] = {"big-a", "old-a", "notools-g", "tiny-g", "mid-o", "gone-o"};
    assert_int_equal(n, 6);
    for (size_t i = 0; i < n; i++)
        assert_string_equal(out[i]->m->model_id, order[i]);
    n = mr_list(s, " OpenAI", out);
    assert_int_equal(n, 2);
    assert_string_equal(out[0]->m->model_id, "mid-o");
    assert_string_equal(out[1]->m->model_id, "gone-o");
    assert_true(out[1]->deprecated);
    assert_int_equal(mr_list(s, "mistral", out), 0);
    assert_int_equal(mr_list(s, NULL, out), 6);
}

static void test_compare(void **state) {
    const mr_snapshot *s = *state;
    const mr_entry *out[MR_COMPARE_MAX];
    size_t n;
    char err[512];
    const char *ids[] = {"tiny-g", "BIG-A", "tiny-g ", "gone-o"};
    assert_int_equal(mr_compare(s, ids, 4, out, &n, err, sizeof err), MR_OK);
    assert_int_equal(n, 3);
    assert_string_equal(out[0]->m->model_id, "tiny-g");
    assert_string_equal(out[1]->m->model_id, "big-a");
    assert_string_equal(out[2]->m->model_id, "gone-o");

    assert_int_equal(mr_compare(s, NULL, 0, out, &n, err, sizeof err), MR_EINVAL);
    assert_non_null(strstr(err, "model_ids: at least one"));

    const char *many[MR_COMPARE_MAX + 1];
    for (size_t i = 0; i < MR_COMPARE_MAX + 1; i++)
        many[i] = "big-a";
    assert_int_equal(mr_compare(s, many, MR_COMPARE_MAX + 1, out, &n, err, sizeof err), MR_EINVAL);
    assert_non_null(strstr(err, "model_ids: at most 100 ids per request (got 101)"));
    assert_int_equal(mr_compare(s, many, MR_COMPARE_MAX, out, &n, err, sizeof err), MR_OK);
    assert_int_equal(n, 1);

    const char *blank[] = {"big-a", ""};
    assert_int_equal(mr_compare(s, blank, 2, out, &n, err, sizeof err), MR_EINVAL);
    assert_string_equal(err, "model_ids[1]: empty model id");

    const char *unknown[] = {"nope-1", "big-a", "NOPE-1", "nope-2"};
    assert_int_equal(mr_compare(s, unknown, 4, out, &n, err, sizeof err), MR_ENOTFOUND);
    assert_string_equal(err, "model_ids: unknown models: \"nope-1\", \"nope-2\"");
    assert_int_equal(n, 0);

    char huge[300];
    memset(huge, 'z', sizeof huge - 1);
    huge[sizeof huge - 1] = '\0';
    const char *hug[] = {huge};
    assert_int_equal(mr_compare(s, hug, 1, out, &n, err, sizeof err), MR_ENOTFOUND);
    assert_non_null(strstr(err, "...\""));
}

/* Every text quoted back is cut on a character boundary: 47 x 'a' + 'é' (2 bytes) straddles the
 * 48-byte quote, and multi-byte provider names overflow the 255-byte ignored-provider list. */
static void test_truncation_keeps_utf8(void **state) {
    const mr_snapshot *s = *state;
    mr_rec_result r;
    char err[768];
    char role[64];
    memset(role, 'a', 47);
    memcpy(role + 47, "\xC3\xA9", 3);
    assert_int_equal(recommend(s, role, "quality", NULL, 0, 3, &r, err, sizeof err), MR_OK);
    assert_true(util_utf8_valid(r.reasoning));
    assert_non_null(strstr(r.reasoning, "aaaa...\""));

    const char *prov[16];
    char names[16][40];
    for (size_t i = 0; i < 16; i++) {
        /* 9 x U+20AC (3 bytes each) + a distinct suffix: none is a catalogued provider */
        size_t o = 0;
        for (int k = 0; k < 9; k++) {
            memcpy(names[i] + o, "\xE2\x82\xAC", 3);
            o += 3;
        }
        snprintf(names[i] + o, sizeof names[i] - o, "%zu", i);
        prov[i] = names[i];
    }
    prov[15] = "openai";
    assert_int_equal(recommend(s, "planner", "quality", prov, 16, 3, &r, err, sizeof err), MR_OK);
    assert_true(util_utf8_valid(r.reasoning));
    prov[15] = names[15];
    assert_int_equal(recommend(s, "planner", "quality", prov, 16, 3, &r, err, sizeof err),
                     MR_ENONE);
    assert_true(util_utf8_valid(err));

    /* a status message cut by its buffer stays UTF-8 too */
    char small[40];
    assert_int_equal(recommend(s, "planner", "quality", prov, 16, 3, &r, small, sizeof small),
                     MR_ENONE);
    assert_true(util_utf8_valid(small));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_role_table),
        cmocka_unit_test(test_goal_parse),
        cmocka_unit_test_setup_teardown(test_goals_trade_quality_against_price, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deprecated_and_toolless_never_win, setup, teardown),
        cmocka_unit_test_setup_teardown(test_connected_providers, setup, teardown),
        cmocka_unit_test(test_no_qualifying_model),
        cmocka_unit_test_setup_teardown(test_bad_goal_and_role, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reasoning_has_deciding_numbers, setup, teardown),
        cmocka_unit_test(test_alternatives_bounded_and_deterministic),
        cmocka_unit_test_setup_teardown(test_list_order_and_filter, setup, teardown),
        cmocka_unit_test_setup_teardown(test_compare, setup, teardown),
        cmocka_unit_test_setup_teardown(test_truncation_keeps_utf8, setup, teardown),
    };
    return cmocka_run_group_tests_name("model-registry scoring", tests, NULL, NULL);
}
