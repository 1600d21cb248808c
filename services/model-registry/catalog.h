/* The model catalogue as data: parsing and validation of the reviewed data file
 * (catalog/models.json), prices in force on a given day, and the derived cost-efficiency score.
 *
 * Dates are whole UTC days counted from 1970-01-01 (int32_t); MR_DATE_NONE marks "unknown" or
 * "not set". Everything here is pure (no I/O but mr_catalog_load_file) and thread-compatible. */
#ifndef UPSQUAD_MR_CATALOG_H
#define UPSQUAD_MR_CATALOG_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define MR_DATE_NONE INT32_MIN
#define MR_ID_MAX 96       /* longest model id, including the NUL */
#define MR_PROVIDER_MAX 33 /* longest provider name, including the NUL */
#define MR_MAX_MODELS 512  /* a catalogue with more models is refused */
#define MR_MAX_PRICES 64   /* price rows per model */
#define MR_MAX_FILE_BYTES (4 * 1024 * 1024)
#define MR_CATALOG_SCHEMA "upsquad.model_catalog/v1"

enum { MR_STATUS_ACTIVE = 0, MR_STATUS_DEPRECATED = 1, MR_STATUS_RETIRED = 2 };

typedef struct mr_price {
    int32_t effective_from;                       /* first day this price applies */
    double input_per_million, output_per_million; /* USD per million tokens */
    char *source_url;
    int32_t verified_on; /* day the price was last checked against source_url */
    char *note;          /* may be "" */
} mr_price;

typedef struct mr_model {
    char *model_id; /* canonical, lowercase [a-z0-9._-] */
    char *provider; /* lowercase [a-z0-9-] */
    char *display_name;
    int32_t released_on; /* MR_DATE_NONE when unknown */
    int32_t max_context_tokens;
    bool supports_streaming, supports_tool_use;
    double tool_use_quality;
    double reasoning, code_generation, structured_ops, long_context;
    char *evidence; /* "benchmarks" | "family-position" */
    char *score_basis;
    int status;                         /* MR_STATUS_* */
    int32_t deprecated_on, shutdown_on; /* MR_DATE_NONE when not set */
    char *successor;                    /* NULL when not set */
    size_t n_prices;
    mr_price *prices; /* strictly ascending effective_from */
} mr_model;

typedef struct mr_catalog {
    char *catalog_version;
    size_t n;
    mr_model *models;
} mr_catalog;

/* Parses the data file's JSON text (strict: unknown keys are errors, so a typo cannot be
 * silently ignored) and validates it. On success *out owns everything (mr_catalog_free); on
 * failure *out is zeroed and err names the offending location, e.g.
 * "models[3].prices[1].effective_from: not a YYYY-MM-DD date". Returns 0 or -1. */
int mr_catalog_parse(const char *json, size_t len, mr_catalog *out, char *err, size_t errlen);

/* Reads and parses a data file. sha256_out (optional, 32 bytes) receives the digest of the
 * file's bytes, recorded with each load. Returns 0 or -1. */
int mr_catalog_load_file(const char *path, mr_catalog *out, unsigned char *sha256_out, char *err,
                         size_t errlen);

/* Range and consistency checks shared by the file parser and the store's reader: ids, scores in
 * 0..1, prices ascending, lifecycle coherent, ids unique. check_successors: successor ids must
 * name a model of the catalogue (true for the data file; the database may keep a successor that
 * was since removed from the file). */
int mr_catalog_validate(const mr_catalog *c, bool check_successors, char *err, size_t errlen);

void mr_catalog_free(mr_catalog *c);

/* Helpers for builders of a catalogue (the store): allocate models/prices zeroed. */
int mr_catalog_alloc(mr_catalog *c, size_t n_models);
int mr_model_alloc_prices(mr_model *m, size_t n_prices);

/* The price in force on `day` (the row with the latest effective_from <= day), or NULL when the
 * model's first price starts later. */
const mr_price *mr_model_price_at(const mr_model *m, int32_t day);
/* The first effective_from after `day`, or MR_DATE_NONE. */
int32_t mr_model_next_change(const mr_model *m, int32_t day);

/* (3 * input + output) / 4: the price of a 3:1 input:output token mix, USD per million. */
double mr_blended_price(double input_per_million, double output_per_million);
/* Log-scaled 0..1: blended $0.10/M -> 1, $100/M -> 0 (see the data file's methodology). */
double mr_cost_efficiency(double input_per_million, double output_per_million);

/* "YYYY-MM-DD" (exactly) -> days since 1970-01-01. Returns 0 or -1. */
int mr_date_parse(const char *s, int32_t *days);
/* days -> "YYYY-MM-DD" into buf (>= 11 bytes). */
void mr_date_format(int32_t days, char buf[11]);
/* The UTC day of a Unix time. */
int32_t mr_day_of(int64_t unix_seconds);

/* Orders catalog_version strings: runs of digits compare as numbers, everything else byte-wise,
 * so "2026-12-02.10" > "2026-12-02.9". <0, 0 or >0 like strcmp. */
int mr_version_cmp(const char *a, const char *b);

const char *mr_status_name(int status);
int mr_status_parse(const char *s, int *status);

/* Lowercase ASCII copy of s (trimmed of ASCII spaces) into buf of size cap; returns the length,
 * or -1 if it does not fit. */
int mr_lower_trim(const char *s, size_t len, char *buf, size_t cap);

#endif
