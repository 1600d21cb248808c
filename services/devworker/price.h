/* The devworker's price table: USD per million input and output tokens by model id, used for
 * the cost of echo replies and of script completions without an explicit token_usage. The
 * figures are the list prices of services/model-registry/catalog/models.json at the time of
 * writing (docs/devworker.md lists them); they are a deterministic stand-in, not billing. */
#ifndef UPSQUAD_DW_PRICE_H
#define UPSQUAD_DW_PRICE_H

#include <stddef.h>

typedef struct dw_price {
    const char *model_id;
    double input_per_million, output_per_million;
} dw_price;

/* The entry for model_id, or NULL (unknown model: cost 0). */
const dw_price *dw_price_lookup(const char *model_id);
/* in/out tokens priced by the table; 0 for an unknown or empty model id. */
double dw_price_cost(const char *model_id, long in_tokens, long out_tokens);
/* The whole table (documentation, tests). */
const dw_price *dw_price_table(size_t *n);

#endif
