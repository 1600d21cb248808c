/* See price.h. Keep docs/devworker.md ("Prices") in step with this table. */
#include "price.h"

#include <string.h>

static const dw_price prices[] = {
    {"claude-opus-5-5", 4.00, 20.00},
    {"claude-sonnet-5-5", 2.00, 10.00},
    {"claude-haiku-5-5", 0.10, 0.50},
    {"claude-opus-4-8", 5.00, 25.00},
    {"claude-sonnet-4-6", 3.00, 15.00},
    {"claude-haiku-4-5-20251001", 1.00, 5.00},
    {"claude-sonnet-4-20250514", 3.00, 15.00},
    {"gpt-6.1-sol", 2.00, 10.00},
    {"gpt-6.1-terra", 1.00, 5.00},
    {"gpt-5.5", 5.00, 30.00},
    {"gpt-5.4", 2.50, 15.00},
    {"gpt-4o", 2.50, 10.00},
    {"gemini-3.1-pro-preview", 2.00, 12.00},
    {"gemini-3.5-flash", 1.50, 9.00},
};

const dw_price *dw_price_table(size_t *n) {
    *n = sizeof prices / sizeof prices[0];
    return prices;
}

const dw_price *dw_price_lookup(const char *model_id) {
    if (model_id == NULL || model_id[0] == 0) return NULL;
    for (size_t i = 0; i < sizeof prices / sizeof prices[0]; i++)
        if (strcmp(prices[i].model_id, model_id) == 0) return &prices[i];
    return NULL;
}

double dw_price_cost(const char *model_id, long in_tokens, long out_tokens) {
    const dw_price *p = dw_price_lookup(model_id);
    if (p == NULL) return 0.0;
    return ((double)in_tokens * p->input_per_million + (double)out_tokens * p->output_per_million) /
           1e6;
}
