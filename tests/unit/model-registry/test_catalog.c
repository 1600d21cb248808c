/* Catalogue data file: the shipped file's content rules, the parser's refusals, dates, prices in
 * force and the cost-efficiency formula. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <string.h>

#include "mr_fixture.h"

/* ---- the shipped data file ---- */

static void test_shipped_file_is_valid_and_current(void **state) {
    (void)state;
    mr_catalog c;
    char err[512];
    unsigned char sha[32] = {0}, zero[32] = {0};
    int rc = mr_catalog_load_file(fx_catalog_path(), &c, sha, err, sizeof err);
    if (rc) fail_msg("%s", err);
    assert_true(memcmp(sha, zero, sizeof sha) != 0);
    assert_true(c.n >= 20);
    static const char *providers[] = {"anthropic", "openai", "google"};
    for (size_t p = 0; p < 3; p++) {
        size_t active_tools = 0, deprecated = 0;
        for (size_t i = 0; i < c.n; i++) {
            const mr_model *m = &c.models[i];
            if (strcmp(m->provider, providers[p]) != 0) continue;
            if (m->status == MR_STATUS_ACTIVE && m->supports_tool_use) active_tools++;
            if (m->status != MR_STATUS_ACTIVE) deprecated++;
        }
        /* each provider: current models usable by agents, and recently deprecated ones */
        assert_true(active_tools >= 3);
        assert_true(deprecated >= 1);
    }
    int history = 0, future = 0;
    for (size_t i = 0; i < c.n; i++) {
        const mr_model *m = &c.models[i];
        assert_true(m->score_basis[0] != '\0');
        if (m->n_prices > 1) history++;
        for (size_t j = 0; j < m->n_prices; j++) {
            assert_int_equal(strncmp(m->prices[j].source_url, "https://", 8), 0);
            assert_true(m->prices[j].verified_on != MR_DATE_NONE);
            if (m->prices[j].effective_from > m->prices[j].verified_on) future++;
        }
        if (m->status != MR_STATUS_ACTIVE) assert_non_null(m->successor);
    }
    assert_true(history >= 2); /* price changes are kept as history */
    assert_true(future >= 1);  /* an announced price change is entered ahead of its date */
    mr_catalog_free(&c);
}

/* ---- parser refusals ---- */

static const char *base_model =
    "{\"model_id\":\"m-1\",\"provider\":\"acme\",\"display_name\":\"M 1\",\"released_on\":null,"
    "\"max_context_tokens\":1000,\"supports_streaming\":true,\"supports_tool_use\":true,"
    "\"tool_use_quality\":0.5,\"capabilities\":{\"reasoning\":0.5,\"code_generation\":0.5,"
    "\"structured_ops\":0.5,\"long_context\":0.5},\"evidence\":\"benchmarks\",\"score_basis\":"
    "\"x\",\"lifecycle\":{\"status\":\"active\",\"deprecated_on\":null,\"shutdown_on\":null,"
    "\"successor\":null},\"prices\":[{\"effective_from\":\"2026-01-01\",\"input_per_million\":1,"
    "\"output_per_million\":2,\"source_url\":\"https://x.test/p\",\"verified_on\":\"2026-12-01\","
    "\"note\":\"\"}]}";

static const char *methodology =
    "{\"scales\":{\"reasoning\":\"a\",\"code_generation\":\"a\",\"structured_ops\":\"a\","
    "\"long_context\":\"a\",\"tool_use_quality\":\"a\",\"cost_efficiency\":\"a\"}}";

/* A document with the base model where `from` (first occurrence) is replaced by `to`; the
 * replacement may also target the methodology or add a second model. */
static int parse_variant(const char *from, const char *to, char *err, size_t errlen) {
    char doc[8192], model[4096];
    snprintf(model, sizeof model, "%s", base_model);
    snprintf(doc, sizeof doc,
             "{\"schema\":\"upsquad.model_catalog/v1\",\"catalog_version\":\"t1\","
             "\"methodology\":%s,\"models\":[%s]}",
             methodology, model);
    if (from) {
        char *at = strstr(doc, from);
        if (!at) fail_msg("fixture text not found: %s", from);
        char out[8192];
        snprintf(out, sizeof out, "%.*s%s%s", (int)(at - doc), doc, to, at + strlen(from));
        snprintf(doc, sizeof doc, "%s", out);
    }
    mr_catalog c;
    int rc = mr_catalog_parse(doc, strlen(doc), &c, err, errlen);
    if (rc == 0) mr_catalog_free(&c);
    return rc;
}

static void expect_refused(const char *from, const char *to, const char *where) {
    char err[512] = "";
    assert_int_equal(parse_variant(from, to, err, sizeof err), -1);
    if (!strstr(err, where)) fail_msg("error \"%s\" does not name \"%s\"", err, where);
}

static void test_minimal_document_parses(void **state) {
    (void)state;
    char err[512] = "";
    if (parse_variant(NULL, NULL, err, sizeof err)) fail_msg("%s", err);
}

static void test_parser_refusals(void **state) {
    (void)state;
    expect_refused("\"evidence\"", "\"evidense\"", "models[0].evidense: unknown key");
    expect_refused("2026-01-01", "2026-02-30", "models[0].prices[0].effective_from");
    expect_refused("\"reasoning\":0.5", "\"reasoning\":1.5", "capabilities.reasoning");
    expect_refused("\"long_context\":0.5}", "\"long_context\":0.5,\"cost_efficiency\":0.3}",
                   "cost_efficiency: derived");
    expect_refused("\"m-1\"", "\"M-1\"", "models[0].model_id");
    expect_refused("\"supports_tool_use\":true", "\"supports_tool_use\":false",
                   "tool_use_quality: must be 0");
    expect_refused("\"successor\":null", "\"successor\":\"nope\"", "lifecycle");
    expect_refused("\"status\":\"active\"", "\"status\":\"retired\"", "shutdown_on");
    expect_refused("\"status\":\"active\"", "\"status\":\"gone\"", "lifecycle.status");
    expect_refused("https://x.test/p", "http://x.test/p", "source_url");
    expect_refused("\"input_per_million\":1", "\"input_per_million\":-1", "input_per_million");
    expect_refused("\"max_context_tokens\":1000", "\"max_context_tokens\":10.5",
                   "max_context_tokens");
    expect_refused("\"tool_use_quality\":\"a\"", "\"tool_use_quality\":\"\"",
                   "methodology.scales.tool_use_quality");
    expect_refused("upsquad.model_catalog/v1", "upsquad.model_catalog/v0", "schema");
    expect_refused("\"catalog_version\":\"t1\"", "\"catalog_version\":\"t1\",\"extra\":1",
                   "extra: unknown key");
    expect_refused("\"note\":\"\"}]",
                   "\"note\":\"\"},{\"effective_from\":\"2025-01-01\",\"input_per_million\":1,"
                   "\"output_per_million\":2,\"source_url\":\"https://x.test/p\","
                   "\"verified_on\":\"2026-12-01\",\"note\":\"\"}]",
                   "strictly ascending");
    expect_refused("]}", ",{\"broken\"]}", "not valid JSON");
}

static void test_duplicate_ids_refused(void **state) {
    (void)state;
    char doc[8192], err[256] = "";
    snprintf(doc, sizeof doc,
             "{\"schema\":\"upsquad.model_catalog/v1\",\"catalog_version\":\"t1\","
             "\"methodology\":%s,\"models\":[%s,%s]}",
             methodology, base_model, base_model);
    mr_catalog c;
    assert_int_equal(mr_catalog_parse(doc, strlen(doc), &c, err, sizeof err), -1);
    assert_non_null(strstr(err, "duplicate model_id \"m-1\""));
    assert_null(c.models);
}

static void test_missing_file(void **state) {
    (void)state;
    mr_catalog c;
    char err[256] = "";
    assert_int_equal(mr_catalog_load_file("/nonexistent/models.json", &c, NULL, err, sizeof err),
                     -1);
    assert_non_null(strstr(err, "/nonexistent/models.json"));
}

/* ---- dates, prices, cost efficiency ---- */

static void test_dates(void **state) {
    (void)state;
    int32_t d;
    assert_int_equal(mr_date_parse("1970-01-01", &d), 0);
    assert_int_equal(d, 0);
    assert_int_equal(mr_date_parse("2026-12-02", &d), 0);
    assert_int_equal(d, 20789);
    assert_int_equal(mr_date_parse("2028-02-29", &d), 0); /* leap year */
    assert_int_equal(mr_date_parse("2027-02-29", &d), -1);
    assert_int_equal(mr_date_parse("2100-02-29", &d), -1); /* century, not leap */
    assert_int_equal(mr_date_parse("2000-02-29", &d), 0);  /* 400-year leap */
    assert_int_equal(mr_date_parse("2026-13-01", &d), -1);
    assert_int_equal(mr_date_parse("2026-1-01", &d), -1);
    assert_int_equal(mr_date_parse("2026-01-01T00", &d), -1);
    char buf[11];
    for (int32_t day = 0; day < 60000; day += 7) {
        mr_date_format(day, buf);
        assert_int_equal(mr_date_parse(buf, &d), 0);
        assert_int_equal(d, day);
    }
    assert_int_equal(mr_day_of(0), 0);
    assert_int_equal(mr_day_of(86399), 0);
    assert_int_equal(mr_day_of(86400), 1);
    assert_int_equal(mr_day_of(-1), -1);
}

static void test_price_in_force(void **state) {
    (void)state;
    mr_model m;
    memset(&m, 0, sizeof m);
    assert_int_equal(mr_model_alloc_prices(&m, 2), 0);
    m.prices[0].effective_from = 100;
    m.prices[0].input_per_million = 0.75;
    m.prices[1].effective_from = 200;
    m.prices[1].input_per_million = 1.5;
    assert_null(mr_model_price_at(&m, 99));
    assert_true(mr_model_price_at(&m, 100)->input_per_million == 0.75);
    assert_true(mr_model_price_at(&m, 199)->input_per_million == 0.75);
    assert_true(mr_model_price_at(&m, 200)->input_per_million == 1.5);
    assert_int_equal(mr_model_next_change(&m, 50), 100);
    assert_int_equal(mr_model_next_change(&m, 150), 200);
    assert_int_equal(mr_model_next_change(&m, 200), MR_DATE_NONE);
    free(m.prices);
}

static void test_cost_efficiency(void **state) {
    (void)state;
    /* blended = (3 in + out) / 4 */
    assert_true(fabs(mr_blended_price(1, 5) - 2.0) < 1e-12);
    assert_true(fabs(mr_cost_efficiency(0.1, 0.1) - 1.0) < 1e-12);
    assert_true(fabs(mr_cost_efficiency(1, 1) - 2.0 / 3.0) < 1e-12);
    assert_true(fabs(mr_cost_efficiency(10, 10) - 1.0 / 3.0) < 1e-12);
    assert_true(fabs(mr_cost_efficiency(100, 100)) < 1e-12);
    assert_true(mr_cost_efficiency(0, 0) == 1.0);
    assert_true(mr_cost_efficiency(1000, 1000) == 0.0);
    double prev = 2;
    for (double p = 0.05; p < 200; p *= 1.3) {
        double ce = mr_cost_efficiency(p, 4 * p);
        assert_true(ce <= prev && ce >= 0 && ce <= 1);
        prev = ce;
    }
}

static void test_version_order(void **state) {
    (void)state;
    assert_true(mr_version_cmp("2026-12-02.10", "2026-12-02.9") > 0);
    assert_true(mr_version_cmp("2026-12-02.1", "2026-12-02.1") == 0);
    assert_true(mr_version_cmp("2026-12-02.1", "2026-12-03.1") < 0);
    assert_true(mr_version_cmp("2026-12-02", "2026-12-02.1") < 0);
    assert_true(mr_version_cmp("2027-01-01.1", "2026-12-31.99") > 0);
    assert_true(mr_version_cmp("v010", "v9") > 0); /* numbers, not characters */
    assert_true(mr_version_cmp("a", "b") < 0);
}

static void test_lower_trim(void **state) {
    (void)state;
    char buf[8];
    assert_int_equal(mr_lower_trim("  OpenAI ", 9, buf, sizeof buf), 6);
    assert_string_equal(buf, "openai");
    assert_int_equal(mr_lower_trim("   ", 3, buf, sizeof buf), 0);
    assert_int_equal(mr_lower_trim("toolongvalue", 12, buf, sizeof buf), -1);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shipped_file_is_valid_and_current),
        cmocka_unit_test(test_minimal_document_parses),
        cmocka_unit_test(test_parser_refusals),
        cmocka_unit_test(test_duplicate_ids_refused),
        cmocka_unit_test(test_missing_file),
        cmocka_unit_test(test_dates),
        cmocka_unit_test(test_price_in_force),
        cmocka_unit_test(test_cost_efficiency),
        cmocka_unit_test(test_version_order),
        cmocka_unit_test(test_lower_trim),
    };
    return cmocka_run_group_tests_name("model-registry catalog", tests, NULL, NULL);
}
