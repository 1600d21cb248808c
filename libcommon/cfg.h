/* Configuration from the environment, through one table per service.
 *
 * Each service declares a `cfg_var` array naming every variable it reads, its type, default
 * and a one-line description; `cfg_load` fills the destinations and reports every problem at
 * once, `cfg_print_markdown` renders the same table for the documentation, and `cfg_log`
 * records the effective values at start-up (secrets masked).
 *
 * Values
 *   CFG_STR   any string (char **dst, heap copy; release with cfg_free)
 *   CFG_INT   decimal integer, optional sign (long long *dst)
 *   CFG_BOOL  1/0, true/false, yes/no, on/off, case-insensitive (int *dst, 1 or 0)
 *   CFG_MS    a duration in milliseconds (long long *dst): "250ms", "5s", "2m", "1h" or a
 *             plain non-negative integer of milliseconds
 *   An empty variable counts as unset. For INT and MS, min/max bound the value when min < max.
 *
 * Secrets
 *   A CFG_SECRET variable is never printed (markdown shows "(secret)", logs show "***", error
 *   messages never quote its value) and may instead be read from a file: when NAME is unset
 *   and NAME_FILE is set, the value is the content of that file with trailing newlines removed
 *   (Kubernetes mounts Secrets as files). Setting both is an error. Files above
 *   CFG_FILE_MAX bytes are refused. */
#ifndef UPSQUAD_CFG_H
#define UPSQUAD_CFG_H

#include <stddef.h>
#include <stdio.h>

typedef enum { CFG_STR, CFG_INT, CFG_BOOL, CFG_MS } cfg_type;

enum {
    CFG_REQUIRED = 1 << 0, /* unset (and no default) is an error */
    CFG_SECRET = 1 << 1,   /* never printed; NAME_FILE accepted */
};

#define CFG_FILE_MAX 65536

typedef struct cfg_var {
    const char *name;
    cfg_type type;
    const char *def; /* NULL = no default: STR gets NULL, INT/MS/BOOL keep the caller's value */
    const char *doc;
    void *dst;          /* char ** for STR (caller frees via cfg_free), long long * for INT/MS,
                           int * for BOOL */
    long long min, max; /* INT/MS range when min < max */
    int flags;          /* CFG_REQUIRED | CFG_SECRET */
} cfg_var;

/* Loads every variable. Collects ALL errors into err, separated by "; "
 * ("UPSQUAD_X: not an integer: \"abc\"; UPSQUAD_Y: required"), and returns -1 when there
 * is any; the strings loaded so far are then released (dst NULL). 0 on success. */
int cfg_load(const cfg_var *vars, size_t n, char *err, size_t errlen);
/* Frees the CFG_STR destinations and sets them to NULL; safe to call twice. */
void cfg_free(const cfg_var *vars, size_t n);
/* "| variable | default | description |" table for the documentation. */
void cfg_print_markdown(const cfg_var *vars, size_t n, FILE *f);
/* One info line ("config.loaded") with the effective values, secrets masked. */
void cfg_log(const cfg_var *vars, size_t n);

/* Parsers used by cfg_load, exposed for flags and tests. 0 on success, -1 otherwise. */
int cfg_parse_int(const char *s, long long *out);
int cfg_parse_bool(const char *s, int *out);
int cfg_parse_ms(const char *s, long long *out);

#endif
