/* Environment configuration: see cfg.h. */
#include "cfg.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "log.h"
#include "util.h"

#define CFG__NAME_MAX 128 /* longest variable name, "_FILE" suffix included */
#define CFG__QUOTE_MAX 64 /* bytes of a bad value quoted back in an error */
#define CFG__LOG_MAX 3072 /* cfg_log message budget; the logger truncates beyond */

/* Appends one error to err, "; "-separated. A full buffer keeps what fit (the logger and
 * the caller see a truncated list rather than nothing). */
static void cfg__err(char *err, size_t errlen, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void cfg__err(char *err, size_t errlen, const char *fmt, ...) {
    size_t used;
    va_list ap;
    if (!err || errlen == 0) return;
    used = strnlen(err, errlen);
    if (used >= errlen - 1) return;
    if (used > 0) {
        snprintf(err + used, errlen - used, "; ");
        used = strnlen(err, errlen);
    }
    va_start(ap, fmt);
    vsnprintf(err + used, errlen - used, fmt, ap);
    va_end(ap);
}

int cfg_parse_int(const char *s, long long *out) {
    char *end;
    long long v;
    if (!s || !*s || isspace((unsigned char)*s)) return -1;
    errno = 0;
    v = strtoll(s, &end, 10);
    if (errno != 0 || *end != '\0') return -1;
    *out = v;
    return 0;
}

int cfg_parse_bool(const char *s, int *out) {
    static const char *const yes[] = {"1", "true", "yes", "on"};
    static const char *const no[] = {"0", "false", "no", "off"};
    if (!s) return -1;
    for (size_t i = 0; i < 4; i++) {
        if (strcasecmp(s, yes[i]) == 0 || strcasecmp(s, no[i]) == 0) {
            *out = strcasecmp(s, yes[i]) == 0;
            return 0;
        }
    }
    return -1;
}

int cfg_parse_ms(const char *s, long long *out) {
    static const struct {
        const char *unit;
        long long mult;
    } units[] = {{"", 1}, {"ms", 1}, {"s", 1000}, {"m", 60000}, {"h", 3600000}};
    unsigned long long v = 0;
    const char *p = s;
    if (!s || !isdigit((unsigned char)*s)) return -1;
    for (; isdigit((unsigned char)*p); p++) {
        if (v > (unsigned long long)LLONG_MAX / 10) return -1;
        v = v * 10 + (unsigned)(*p - '0');
    }
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(p, units[i].unit) != 0) continue;
        if (v > (unsigned long long)(LLONG_MAX / units[i].mult)) return -1;
        *out = (long long)v * units[i].mult;
        return 0;
    }
    return -1;
}

/* Reads NAME_FILE's file: at most CFG_FILE_MAX bytes, no NUL, trailing CR/LF removed. */
static char *cfg__read_file(const char *path, const char *name, char *err, size_t errlen) {
    char *buf = NULL, why[512];
    size_t len = 0;
    if (util_read_file(path, CFG_FILE_MAX, &buf, &len, why, sizeof why) != 0) {
        cfg__err(err, errlen, "%s_FILE: %s", name, why);
        return NULL;
    }
    if (memchr(buf, '\0', len)) {
        cfg__err(err, errlen, "%s_FILE: %s contains a NUL byte", name, path);
        free(buf);
        return NULL;
    }
    while (len > 0 && (buf[len - 1] == '\n' || buf[len - 1] == '\r'))
        len--;
    buf[len] = '\0';
    return buf;
}

/* Where a variable's value comes from. *heap is set when the value was read from a file
 * (caller frees). Returns 0 with *val NULL when the variable is unset and has no default,
 * -1 after reporting an error. */
static int cfg__source(const cfg_var *v, const char **val, char **heap, char *err, size_t errlen) {
    const char *env = getenv(v->name);
    const char *file = NULL;
    char fname[CFG__NAME_MAX];
    *val = NULL;
    *heap = NULL;
    if (env && !*env) env = NULL;
    if (v->flags & CFG_SECRET) {
        if ((size_t)snprintf(fname, sizeof fname, "%s_FILE", v->name) >= sizeof fname) {
            cfg__err(err, errlen, "%s: name too long", v->name);
            return -1;
        }
        file = getenv(fname);
        if (file && !*file) file = NULL;
    }
    if (env && file) {
        cfg__err(err, errlen, "%s: set either %s or %s_FILE, not both", v->name, v->name, v->name);
        return -1;
    }
    if (file) {
        *heap = cfg__read_file(file, v->name, err, errlen);
        if (!*heap) return -1;
        *val = *heap;
        return 0;
    }
    *val = env ? env : v->def;
    if (!*val && (v->flags & CFG_REQUIRED)) {
        cfg__err(err, errlen, "%s: required", v->name);
        return -1;
    }
    return 0;
}

static int cfg__range_ok(const cfg_var *v, long long x) {
    return v->min >= v->max || (x >= v->min && x <= v->max);
}

/* Parses val into v->dst. Secret values are never quoted back. */
static int cfg__assign(const cfg_var *v, const char *val, char *err, size_t errlen) {
    int secret = (v->flags & CFG_SECRET) != 0, b;
    long long x;
    const char *what = NULL;
    switch (v->type) {
    case CFG_STR: {
        char *copy = strdup(val);
        if (!copy) {
            cfg__err(err, errlen, "%s: out of memory", v->name);
            return -1;
        }
        *(char **)v->dst = copy;
        return 0;
    }
    case CFG_BOOL:
        if (cfg_parse_bool(val, &b) == 0) {
            *(int *)v->dst = b;
            return 0;
        }
        what = "not a boolean (true/false, 1/0, yes/no, on/off)";
        break;
    case CFG_INT:
    case CFG_MS:
        if ((v->type == CFG_INT ? cfg_parse_int(val, &x) : cfg_parse_ms(val, &x)) != 0) {
            what = v->type == CFG_INT ? "not an integer" : "not a duration (250ms, 5s, 2m, 1h)";
            break;
        }
        if (!cfg__range_ok(v, x)) {
            cfg__err(err, errlen, "%s: out of range %lld..%lld%s%s%.*s%s", v->name, v->min, v->max,
                     v->type == CFG_MS ? " ms" : "", secret ? "" : ": \"",
                     secret ? 0 : CFG__QUOTE_MAX, secret ? "" : val, secret ? "" : "\"");
            return -1;
        }
        *(long long *)v->dst = x;
        return 0;
    }
    if (!what) what = "unknown type";
    if (secret)
        cfg__err(err, errlen, "%s: %s", v->name, what);
    else
        cfg__err(err, errlen, "%s: %s: \"%.*s\"", v->name, what, CFG__QUOTE_MAX, val);
    return -1;
}

int cfg_load(const cfg_var *vars, size_t n, char *err, size_t errlen) {
    int failed = 0;
    if (err && errlen) err[0] = '\0';
    for (size_t i = 0; i < n; i++)
        if (vars[i].type == CFG_STR && vars[i].dst) *(char **)vars[i].dst = NULL;
    for (size_t i = 0; i < n; i++) {
        const cfg_var *v = &vars[i];
        const char *val;
        char *heap;
        if (!v->name || !v->dst) {
            cfg__err(err, errlen, "%s: no destination", v->name ? v->name : "(unnamed)");
            failed = 1;
            continue;
        }
        if (cfg__source(v, &val, &heap, err, errlen) != 0) {
            failed = 1;
            continue;
        }
        if (val && cfg__assign(v, val, err, errlen) != 0) failed = 1;
        free(heap);
    }
    if (failed) cfg_free(vars, n);
    return failed ? -1 : 0;
}

void cfg_free(const cfg_var *vars, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (vars[i].type != CFG_STR || !vars[i].dst) continue;
        char **p = vars[i].dst;
        free(*p);
        *p = NULL;
    }
}

static void cfg__md_escaped(FILE *f, const char *s) {
    for (; s && *s; s++) {
        if (*s == '|')
            fputs("\\|", f);
        else if (*s == '\n')
            fputc(' ', f);
        else
            fputc(*s, f);
    }
}

void cfg_print_markdown(const cfg_var *vars, size_t n, FILE *f) {
    static const char *const types[] = {"string", "integer", "boolean", "duration"};
    fputs("| variable | default | description |\n|---|---|---|\n", f);
    for (size_t i = 0; i < n; i++) {
        const cfg_var *v = &vars[i];
        fprintf(f, "| `%s` | ", v->name);
        if (v->flags & CFG_SECRET)
            fputs("(secret)", f);
        else if (v->def) {
            fputc('`', f);
            cfg__md_escaped(f, v->def);
            fputc('`', f);
        } else
            fputs(v->flags & CFG_REQUIRED ? "(required)" : "(unset)", f);
        fputs(" | ", f);
        cfg__md_escaped(f, v->doc);
        fprintf(f, " (%s", types[v->type]);
        if ((v->type == CFG_INT || v->type == CFG_MS) && v->min < v->max)
            fprintf(f, ", %lld..%lld%s", v->min, v->max, v->type == CFG_MS ? " ms" : "");
        if (v->flags & CFG_REQUIRED) fputs(", required", f);
        if (v->flags & CFG_SECRET)
            fprintf(f, "; or read from the file named by `%s_FILE`", v->name);
        fputs(") |\n", f);
    }
}

/* Copies a string value for the log with credentials masked: the password of a URL's
 * userinfo ("scheme://user:***@host") and "password=***" keywords (libpq key/value strings
 * and URL query parameters). Variables holding credentials should still be CFG_SECRET. */
static void cfg__masked(const char *s, char *out, size_t len) {
    const char *pw = NULL, *at = NULL, *scheme = strstr(s, "://");
    size_t o = 0;
    if (scheme) {
        const char *a = scheme + 3, *end = a + strcspn(a, "/?#");
        for (const char *p = a; p < end; p++)
            if (*p == '@') at = p;
        pw = at ? memchr(a, ':', (size_t)(at - a)) : NULL;
    }
    for (const char *p = s; *p && o + 4 < len; p++) {
        if (pw && p == pw + 1) {
            memcpy(out + o, "***", 3), o += 3;
            p = at - 1;
            continue;
        }
        if (strncasecmp(p, "password=", 9) == 0 && (p == s || strchr(" ?&", p[-1]))) {
            if (o + 13 >= len) break;
            memcpy(out + o, "password=***", 12), o += 12;
            p += 8;             /* at '=' */
            if (p[1] == '\'') { /* libpq quoted value, backslash escapes */
                for (p += 2; *p && *p != '\''; p++)
                    if (*p == '\\' && p[1]) p++;
                if (!*p) break;
            } else {
                while (p[1] && p[1] != ' ' && p[1] != '&')
                    p++;
            }
            continue;
        }
        out[o++] = *p;
    }
    out[o] = '\0';
}

void cfg_log(const cfg_var *vars, size_t n) {
    char msg[CFG__LOG_MAX], val[512];
    size_t used = 0;
    msg[0] = '\0';
    for (size_t i = 0; i < n && used < sizeof msg; i++) {
        const cfg_var *v = &vars[i];
        if (!v->dst) continue;
        if (v->flags & CFG_SECRET) {
            int set = v->type != CFG_STR || *(char **)v->dst != NULL;
            snprintf(val, sizeof val, "%s", set ? "***" : "(unset)");
        } else if (v->type == CFG_STR) {
            const char *s = *(char **)v->dst;
            if (s) {
                char m[sizeof val - 2];
                cfg__masked(s, m, sizeof m);
                snprintf(val, sizeof val, "\"%s\"", m);
            } else
                snprintf(val, sizeof val, "(unset)");
        } else if (v->type == CFG_BOOL) {
            snprintf(val, sizeof val, "%s", *(int *)v->dst ? "true" : "false");
        } else {
            snprintf(val, sizeof val, "%lld%s", *(long long *)v->dst,
                     v->type == CFG_MS ? "ms" : "");
        }
        int w = snprintf(msg + used, sizeof msg - used, "%s%s=%s", used ? " " : "", v->name, val);
        if (w < 0) break;
        used += (size_t)w;
    }
    log_info("config.loaded", "%s", msg);
}
