/* Prometheus registry and exposition: see metrics.h.
 *
 * Values are 64-bit atomics. A counter keeps integer increments in `ival` (one fetch_add, the
 * common case) and fractional adds as a double bit pattern in `bits` updated by CAS; its value
 * is their sum. A gauge keeps only `bits`. A histogram counts observations per bucket
 * (non-cumulative, one fetch_add) plus the sum in `bits`; _count is the total of the buckets
 * read at render time, so +Inf always equals _count in one scrape. */
#include "metrics.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <netdb.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include "log.h"
#include "util.h"

typedef enum { METRICS__COUNTER, METRICS__GAUGE, METRICS__HISTOGRAM } metrics__type;

static const char *const metrics__type_names[] = {"counter", "gauge", "histogram"};

typedef struct metrics__family {
    char *name, *help;
    metrics__type type;
    double *bounds; /* histograms */
    size_t nbounds;
    metric **series; /* registration order */
    size_t n, cap;
} metrics__family;

struct metric {
    metrics__family *fam;
    char *labels; /* "" when none */
    metrics__type type;
    _Atomic uint64_t ival;     /* counter: integer increments */
    _Atomic uint64_t bits;     /* double: counter fractions, gauge value, histogram sum */
    _Atomic uint64_t *buckets; /* histogram: nbounds + 1 (last = +Inf) */
};

static const double metrics__default_bounds[] = {.0005, .001, .0025, .005, .01, .025, .05,
                                                 .1,    .25,  .5,    1,    2.5, 5,    10};

/* Registry, guarded by metrics__mu. The hash indexes series by (name, labels). */
static pthread_mutex_t metrics__mu = PTHREAD_MUTEX_INITIALIZER;
static metrics__family **metrics__fams;
static size_t metrics__nfams, metrics__capfams;
static metric **metrics__hash;
static size_t metrics__hcap, metrics__nseries;
static _Atomic int metrics__warned_full, metrics__warned_conflict, metrics__warned_invalid;

/* ---- lock-free updates ---- */

static inline double metrics__d(uint64_t b) {
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}
static inline uint64_t metrics__b(double d) {
    uint64_t b;
    memcpy(&b, &d, sizeof b);
    return b;
}

static void metrics__add_bits(_Atomic uint64_t *p, double v) {
    uint64_t old = atomic_load_explicit(p, memory_order_relaxed);
    while (!atomic_compare_exchange_weak_explicit(p, &old, metrics__b(metrics__d(old) + v),
                                                  memory_order_relaxed, memory_order_relaxed)) {
    }
}

void metric_inc(metric *m) {
    if (!m) return;
    if (m->type == METRICS__COUNTER)
        atomic_fetch_add_explicit(&m->ival, 1, memory_order_relaxed);
    else if (m->type == METRICS__GAUGE)
        metrics__add_bits(&m->bits, 1.0);
}

void metric_add(metric *m, double v) {
    if (!m || isnan(v)) return;
    if (m->type == METRICS__COUNTER && v >= 0)
        metrics__add_bits(&m->bits, v);
    else if (m->type == METRICS__GAUGE)
        metrics__add_bits(&m->bits, v);
}

void metric_set(metric *m, double v) {
    if (m && m->type == METRICS__GAUGE)
        atomic_store_explicit(&m->bits, metrics__b(v), memory_order_relaxed);
}

void metric_observe(metric *m, double v) {
    if (!m || m->type != METRICS__HISTOGRAM || isnan(v)) return;
    const double *b = m->fam->bounds;
    size_t lo = 0, hi = m->fam->nbounds; /* first bucket with v <= bound, else +Inf */
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        if (v <= b[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    atomic_fetch_add_explicit(&m->buckets[lo], 1, memory_order_relaxed);
    metrics__add_bits(&m->bits, v);
}

double metric_value(const metric *m) {
    if (!m) return 0;
    double d = metrics__d(atomic_load_explicit(&m->bits, memory_order_relaxed));
    if (m->type == METRICS__COUNTER)
        d += (double)atomic_load_explicit(&m->ival, memory_order_relaxed);
    return d;
}

/* ---- registry ---- */

static int metrics__valid_name(const char *s) {
    if (!s || !*s) return 0;
    for (size_t i = 0; s[i]; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || c == ':' ||
                 (i > 0 && c >= '0' && c <= '9');
        if (!ok) return 0;
    }
    return 1;
}

static uint64_t metrics__hash_key(const char *name, const char *labels) {
    uint64_t h = util_fnv1a(UTIL_FNV1A_INIT, name, strlen(name));
    h = util_fnv1a(h, "\xff", 1); /* a byte no name holds: ("ab","c") and ("a","bc") differ */
    return util_fnv1a(h, labels, strlen(labels));
}

/* Open addressing, linear probing; the table is at most half full. */
static metric **metrics__slot(metric **tab, size_t cap, const char *name, const char *labels) {
    size_t i = (size_t)metrics__hash_key(name, labels) & (cap - 1);
    while (tab[i] && (strcmp(tab[i]->fam->name, name) != 0 || strcmp(tab[i]->labels, labels) != 0))
        i = (i + 1) & (cap - 1);
    return &tab[i];
}

static int metrics__grow_hash(void) {
    size_t cap = metrics__hcap ? metrics__hcap * 2 : 256;
    metric **tab = calloc(cap, sizeof *tab);
    if (!tab) return -1;
    for (size_t i = 0; i < metrics__hcap; i++)
        if (metrics__hash[i])
            *metrics__slot(tab, cap, metrics__hash[i]->fam->name, metrics__hash[i]->labels) =
                metrics__hash[i];
    free(metrics__hash);
    metrics__hash = tab;
    metrics__hcap = cap;
    return 0;
}

static int metrics__grow(void **arr, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    size_t nc = *cap ? *cap * 2 : 16;
    void *p = realloc(*arr, nc * elem);
    if (!p) return -1;
    *arr = p;
    *cap = nc;
    return 0;
}

static metrics__family *metrics__find_family(const char *name) {
    for (size_t i = 0; i < metrics__nfams; i++)
        if (strcmp(metrics__fams[i]->name, name) == 0) return metrics__fams[i];
    return NULL;
}

static void metrics__family_free(metrics__family *f) {
    if (!f) return;
    for (size_t i = 0; i < f->n; i++) {
        free(f->series[i]->labels);
        free(f->series[i]->buckets);
        free(f->series[i]);
    }
    free(f->series);
    free(f->bounds);
    free(f->name);
    free(f->help);
    free(f);
}

static metrics__family *metrics__family_new(metrics__type t, const char *name, const char *help,
                                            const double *bounds, size_t nb) {
    metrics__family *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->type = t;
    f->name = strdup(name);
    f->help = strdup(help ? help : "");
    if (!f->name || !f->help) goto fail;
    if (t == METRICS__HISTOGRAM) {
        f->bounds = malloc(nb * sizeof *bounds);
        if (!f->bounds) goto fail;
        memcpy(f->bounds, bounds, nb * sizeof *bounds);
        f->nbounds = nb;
    }
    if (metrics__grow((void **)&metrics__fams, &metrics__capfams, metrics__nfams + 1,
                      sizeof *metrics__fams) != 0)
        goto fail;
    metrics__fams[metrics__nfams++] = f;
    return f;
fail:
    metrics__family_free(f);
    return NULL;
}

static metric *metrics__series_new(metrics__family *f, const char *labels) {
    metric *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->fam = f;
    m->type = f->type;
    m->labels = strdup(labels);
    if (!m->labels) goto fail;
    if (f->type == METRICS__HISTOGRAM) {
        m->buckets = calloc(f->nbounds + 1, sizeof *m->buckets);
        if (!m->buckets) goto fail;
    }
    if (metrics__grow((void **)&f->series, &f->cap, f->n + 1, sizeof *f->series) != 0) goto fail;
    f->series[f->n++] = m;
    return m;
fail:
    free(m->labels);
    free(m->buckets);
    free(m);
    return NULL;
}

static int metrics__same_bounds(const metrics__family *f, const double *b, size_t nb) {
    if (f->nbounds != nb) return 0;
    for (size_t i = 0; i < nb; i++)
        if (f->bounds[i] != b[i]) return 0;
    return 1;
}

/* Refusals are logged once per process (callers may retry a refused lookup per request). */
static int metrics__warn_once(_Atomic int *flag) {
    return atomic_exchange_explicit(flag, 1, memory_order_relaxed) == 0;
}

static metric *metrics__register(metrics__type t, const char *name, const char *help,
                                 const char *labels, const double *bounds, size_t nb) {
    metric *m = NULL, **slot;
    metrics__family *f;
    if (!labels) labels = "";
    if (!metrics__valid_name(name) || strchr(labels, '\n')) {
        if (metrics__warn_once(&metrics__warned_invalid))
            log_error("metrics.invalid", "invalid metric name or labels for %s", name ? name : "");
        return NULL;
    }
    pthread_mutex_lock(&metrics__mu);
    if (metrics__nseries * 2 + 2 > metrics__hcap && metrics__grow_hash() != 0) goto done;
    slot = metrics__slot(metrics__hash, metrics__hcap, name, labels);
    if (*slot) {
        m = (*slot)->type == t ? *slot : NULL;
        if (!m && metrics__warn_once(&metrics__warned_conflict))
            log_error("metrics.conflict", "%s registered again with another type", name);
        goto done;
    }
    f = metrics__find_family(name);
    if (f && (f->type != t || (t == METRICS__HISTOGRAM && !metrics__same_bounds(f, bounds, nb)))) {
        if (metrics__warn_once(&metrics__warned_conflict))
            log_error("metrics.conflict", "%s registered again with another type or buckets", name);
        goto done;
    }
    if (metrics__nseries >= METRICS_MAX_SERIES) {
        if (metrics__warn_once(&metrics__warned_full))
            log_error("metrics.full", "more than %d series; %s not recorded", METRICS_MAX_SERIES,
                      name);
        goto done;
    }
    if (!f && !(f = metrics__family_new(t, name, help, bounds, nb))) goto done;
    if ((m = metrics__series_new(f, labels)) != NULL) {
        *slot = m;
        metrics__nseries++;
    }
done:
    pthread_mutex_unlock(&metrics__mu);
    return m;
}

metric *metrics_counter(const char *name, const char *help, const char *labels) {
    return metrics__register(METRICS__COUNTER, name, help, labels, NULL, 0);
}

metric *metrics_gauge(const char *name, const char *help, const char *labels) {
    return metrics__register(METRICS__GAUGE, name, help, labels, NULL, 0);
}

metric *metrics_histogram(const char *name, const char *help, const char *labels,
                          const double *bounds, size_t nbounds) {
    if (!bounds) {
        bounds = metrics__default_bounds;
        nbounds = sizeof metrics__default_bounds / sizeof metrics__default_bounds[0];
    }
    if (nbounds == 0 || nbounds > METRICS_MAX_BUCKETS) goto bad;
    for (size_t i = 0; i < nbounds; i++)
        if (!isfinite(bounds[i]) || (i > 0 && bounds[i] <= bounds[i - 1])) goto bad;
    return metrics__register(METRICS__HISTOGRAM, name, help, labels, bounds, nbounds);
bad:
    if (metrics__warn_once(&metrics__warned_invalid))
        log_error("metrics.invalid", "%s: buckets must be 1..%d increasing finite bounds",
                  name ? name : "", METRICS_MAX_BUCKETS);
    return NULL;
}

void metrics_reset(void) {
    pthread_mutex_lock(&metrics__mu);
    for (size_t i = 0; i < metrics__nfams; i++)
        metrics__family_free(metrics__fams[i]);
    free(metrics__fams);
    free(metrics__hash);
    metrics__fams = NULL;
    metrics__hash = NULL;
    metrics__nfams = metrics__capfams = metrics__hcap = metrics__nseries = 0;
    atomic_store(&metrics__warned_full, 0);
    atomic_store(&metrics__warned_conflict, 0);
    atomic_store(&metrics__warned_invalid, 0);
    pthread_mutex_unlock(&metrics__mu);
}

size_t metrics_label_escape(const char *value, char *out, size_t outlen) {
    size_t n = 0, w = 0;
    int full = 0;
    for (const char *p = value ? value : ""; *p; p++) {
        const char *rep = *p == '\\' ? "\\\\" : *p == '"' ? "\\\"" : *p == '\n' ? "\\n" : p;
        size_t k = rep == p ? 1 : 2;
        if (!full && w + k < outlen) {
            memcpy(out + w, rep, k);
            w += k;
        } else {
            full = 1; /* keep counting what the whole value needs */
        }
        n += k;
    }
    if (outlen) out[w] = '\0';
    return n;
}

/* ---- rendering ---- */

typedef struct metrics__buf {
    char *p;
    size_t len, cap;
    int oom;
} metrics__buf;

static void metrics__put(metrics__buf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->len + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->len + n + 1)
            nc *= 2;
        char *p = realloc(b->p, nc);
        if (!p) {
            b->oom = 1;
            return;
        }
        b->p = p;
        b->cap = nc;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void metrics__puts(metrics__buf *b, const char *s) {
    metrics__put(b, s, strlen(s));
}

/* Shortest of %.15g/%.17g that reads back exactly; Prometheus spellings for non-finite. */
static void metrics__fmt(double v, char *out, size_t len) {
    if (isnan(v))
        snprintf(out, len, "NaN");
    else if (isinf(v))
        snprintf(out, len, v > 0 ? "+Inf" : "-Inf");
    else if (v == floor(v) && fabs(v) < 1e15)
        snprintf(out, len, "%.0f", v);
    else {
        snprintf(out, len, "%.15g", v);
        if (strtod(out, NULL) != v) snprintf(out, len, "%.17g", v);
    }
}

static void metrics__sample(metrics__buf *b, const char *name, const char *suffix,
                            const char *labels, const char *le, double v) {
    char num[40];
    metrics__puts(b, name);
    metrics__puts(b, suffix);
    if (labels[0] || le) {
        metrics__puts(b, "{");
        metrics__puts(b, labels);
        if (le) {
            metrics__puts(b, labels[0] ? ",le=\"" : "le=\"");
            metrics__puts(b, le);
            metrics__puts(b, "\"");
        }
        metrics__puts(b, "}");
    }
    metrics__fmt(v, num, sizeof num);
    metrics__puts(b, " ");
    metrics__puts(b, num);
    metrics__puts(b, "\n");
}

static void metrics__header(metrics__buf *b, const char *name, const char *help, const char *type) {
    metrics__puts(b, "# HELP ");
    metrics__puts(b, name);
    metrics__puts(b, " ");
    for (const char *p = help; *p; p++) {
        if (*p == '\\')
            metrics__puts(b, "\\\\");
        else if (*p == '\n')
            metrics__puts(b, "\\n");
        else
            metrics__put(b, p, 1);
    }
    metrics__puts(b, "\n# TYPE ");
    metrics__puts(b, name);
    metrics__puts(b, " ");
    metrics__puts(b, type);
    metrics__puts(b, "\n");
}

static void metrics__render_histogram(metrics__buf *b, const metrics__family *f, const metric *m) {
    char le[40];
    uint64_t cum = 0;
    for (size_t i = 0; i <= f->nbounds; i++) {
        cum += atomic_load_explicit(&m->buckets[i], memory_order_relaxed);
        if (i < f->nbounds)
            metrics__fmt(f->bounds[i], le, sizeof le);
        else
            snprintf(le, sizeof le, "+Inf");
        metrics__sample(b, f->name, "_bucket", m->labels, le, (double)cum);
    }
    metrics__sample(b, f->name, "_sum", m->labels, NULL, metric_value(m));
    metrics__sample(b, f->name, "_count", m->labels, NULL, (double)cum);
}

/* Process metrics from /proc, computed at render time. */
typedef struct metrics__proc {
    double rss, vsize, cpu, start, open_fds, max_fds;
} metrics__proc;

static double metrics__boot_time(void) {
    char line[256];
    double bt = 0;
    FILE *f = fopen("/proc/stat", "re");
    if (!f) return 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "btime %lf", &bt) == 1) break;
    fclose(f);
    return bt;
}

static void metrics__read_proc(metrics__proc *p) {
    char buf[1024];
    long page = sysconf(_SC_PAGESIZE), tck = sysconf(_SC_CLK_TCK);
    unsigned long long size = 0, res = 0, utime = 0, stime = 0, start = 0;
    struct rlimit rl;
    FILE *f;
    memset(p, 0, sizeof *p);
    if ((f = fopen("/proc/self/statm", "re"))) {
        if (fscanf(f, "%llu %llu", &size, &res) == 2) {
            p->vsize = (double)size * (double)page;
            p->rss = (double)res * (double)page;
        }
        fclose(f);
    }
    if ((f = fopen("/proc/self/stat", "re"))) {
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        buf[n] = '\0';
        fclose(f);
        /* Fields after the parenthesised command name (which may contain spaces): the
         * first is field 3 (state); utime, stime and starttime are fields 14, 15 and 22. */
        char *q = strrchr(buf, ')'), *save = NULL, *tok;
        int field = 3;
        for (tok = q ? strtok_r(q + 1, " ", &save) : NULL; tok && field <= 22;
             tok = strtok_r(NULL, " ", &save), field++) {
            if (field == 14)
                utime = strtoull(tok, NULL, 10);
            else if (field == 15)
                stime = strtoull(tok, NULL, 10);
            else if (field == 22)
                start = strtoull(tok, NULL, 10);
        }
        if (field > 22 && tck > 0) {
            p->cpu = (double)(utime + stime) / (double)tck;
            p->start = metrics__boot_time() + (double)start / (double)tck;
        }
    }
    DIR *d = opendir("/proc/self/fd");
    if (d) {
        struct dirent *e;
        double n = 0;
        while ((e = readdir(d)))
            if (e->d_name[0] != '.') n++;
        closedir(d);
        p->open_fds = n > 0 ? n - 1 : 0; /* minus the directory stream's own descriptor */
    }
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0) p->max_fds = (double)rl.rlim_cur;
}

static void metrics__render_process(metrics__buf *b) {
    static const struct {
        const char *name, *help, *type;
        size_t off;
    } rows[] = {
        {"process_cpu_seconds_total", "Total user and system CPU time spent in seconds.", "counter",
         offsetof(metrics__proc, cpu)},
        {"process_open_fds", "Number of open file descriptors.", "gauge",
         offsetof(metrics__proc, open_fds)},
        {"process_max_fds", "Maximum number of open file descriptors.", "gauge",
         offsetof(metrics__proc, max_fds)},
        {"process_virtual_memory_bytes", "Virtual memory size in bytes.", "gauge",
         offsetof(metrics__proc, vsize)},
        {"process_resident_memory_bytes", "Resident memory size in bytes.", "gauge",
         offsetof(metrics__proc, rss)},
        {"process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
         "gauge", offsetof(metrics__proc, start)},
    };
    metrics__proc p;
    metrics__read_proc(&p);
    for (size_t i = 0; i < sizeof rows / sizeof rows[0]; i++) {
        double v;
        memcpy(&v, (const char *)&p + rows[i].off, sizeof v);
        metrics__header(b, rows[i].name, rows[i].help, rows[i].type);
        metrics__sample(b, rows[i].name, "", "", NULL, v);
    }
}

int metrics_render(char **out, size_t *len) {
    metrics__buf b = {0};
    pthread_mutex_lock(&metrics__mu);
    for (size_t i = 0; i < metrics__nfams; i++) {
        const metrics__family *f = metrics__fams[i];
        metrics__header(&b, f->name, f->help, metrics__type_names[f->type]);
        for (size_t j = 0; j < f->n; j++) {
            const metric *m = f->series[j];
            if (f->type == METRICS__HISTOGRAM)
                metrics__render_histogram(&b, f, m);
            else
                metrics__sample(&b, f->name, "", m->labels, NULL, metric_value(m));
        }
    }
    pthread_mutex_unlock(&metrics__mu);
    metrics__render_process(&b);
    if (b.oom || !b.p) {
        free(b.p);
        return -1;
    }
    *out = b.p;
    if (len) *len = b.len;
    return 0;
}

/* ---- HTTP ---- */

static pthread_mutex_t metrics__srv_mu = PTHREAD_MUTEX_INITIALIZER;
static struct MHD_Daemon *metrics__daemon;
static int metrics__bound_port;

static enum MHD_Result metrics__reply(struct MHD_Connection *c, unsigned code,
                                      struct MHD_Response *r, const char *ctype) {
    enum MHD_Result ret;
    if (!r) return MHD_NO;
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    if (code == MHD_HTTP_METHOD_NOT_ALLOWED) MHD_add_response_header(r, "Allow", "GET, HEAD");
    ret = MHD_queue_response(c, code, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result metrics__handle(void *cls, struct MHD_Connection *c, const char *url,
                                       const char *method, const char *version, const char *upload,
                                       size_t *upload_size, void **state) {
    static const char text[] = "text/plain; charset=utf-8";
    (void)cls, (void)version, (void)upload, (void)state;
    if (*upload_size != 0) { /* GET has no body; drop whatever a client sends */
        *upload_size = 0;
        return MHD_YES;
    }
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        return metrics__reply(c, MHD_HTTP_METHOD_NOT_ALLOWED,
                              MHD_create_response_from_buffer(19, (void *)"method not allowed\n",
                                                              MHD_RESPMEM_PERSISTENT),
                              text);
    if (strcmp(url, "/metrics") == 0) {
        char *body;
        size_t len;
        if (metrics_render(&body, &len) != 0)
            return metrics__reply(c, MHD_HTTP_INTERNAL_SERVER_ERROR,
                                  MHD_create_response_from_buffer(14, (void *)"out of memory\n",
                                                                  MHD_RESPMEM_PERSISTENT),
                                  text);
        struct MHD_Response *r =
            MHD_create_response_from_buffer_with_free_callback(len, body, free);
        if (!r) free(body);
        return metrics__reply(c, MHD_HTTP_OK, r, "text/plain; version=0.0.4; charset=utf-8");
    }
    if (strcmp(url, "/healthz") == 0)
        return metrics__reply(
            c, MHD_HTTP_OK,
            MHD_create_response_from_buffer(2, (void *)"ok", MHD_RESPMEM_PERSISTENT), text);
    return metrics__reply(
        c, MHD_HTTP_NOT_FOUND,
        MHD_create_response_from_buffer(10, (void *)"not found\n", MHD_RESPMEM_PERSISTENT), text);
}

/* MHD logs one line per connection it refuses (over the connection or per-address limit), so a
 * client opening sockets in a loop would write the log at its own pace: at most
 * METRICS_LOG_BURST lines a second pass, and the next line that passes says how many did not. */
#define METRICS_LOG_BURST 5
static pthread_mutex_t metrics__log_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t metrics__log_window;
static unsigned metrics__log_lines, metrics__log_dropped;

static void metrics__mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    int64_t now = util_mono_ms() / 1000;
    unsigned dropped = 0;
    int pass;
    pthread_mutex_lock(&metrics__log_mu);
    if (now != metrics__log_window) {
        metrics__log_window = now;
        metrics__log_lines = 0;
    }
    pass = metrics__log_lines < METRICS_LOG_BURST;
    if (pass) {
        metrics__log_lines++;
        dropped = metrics__log_dropped;
        metrics__log_dropped = 0;
    } else {
        metrics__log_dropped++;
    }
    pthread_mutex_unlock(&metrics__log_mu);
    if (!pass) return;
    if (dropped)
        log_write(LOG_WARN, "metrics.http",
                  "%u more metrics-server messages suppressed (at most %d a second are logged)",
                  dropped, METRICS_LOG_BURST);
    char msg[256];
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    if (n < 0) return;
    size_t len = strlen(msg);
    while (len && (msg[len - 1] == '\n' || msg[len - 1] == ' '))
        msg[--len] = '\0'; /* MHD's own */
    log_write(LOG_WARN, "metrics.http", "%s", msg);
}

#define metrics__fail(err, errlen, ...) util_errf((err), (errlen), -1, __VA_ARGS__)

/* "host:port", ":port" (every interface), "[v6]:port" -> a bound, listening socket. */
static int metrics__listen(const char *addr, int *port, char *err, size_t errlen) {
    char host[256] = "";
    const char *colon, *ps;
    struct addrinfo hints = {0}, *res = NULL;
    int fd = -1, rc, one = 1, last = 0;
    if (!addr || !*addr) return metrics__fail(err, errlen, "metrics address is empty");
    if (addr[0] == '[') {
        const char *end = strchr(addr, ']');
        if (!end || end[1] != ':' || (size_t)(end - addr - 1) >= sizeof host)
            return metrics__fail(err, errlen, "bad metrics address %s", addr);
        memcpy(host, addr + 1, (size_t)(end - addr - 1));
        ps = end + 2;
    } else {
        colon = strrchr(addr, ':');
        if (!colon || (size_t)(colon - addr) >= sizeof host)
            return metrics__fail(err, errlen, "bad metrics address %s (host:port)", addr);
        memcpy(host, addr, (size_t)(colon - addr));
        ps = colon + 1;
    }
    if (!*ps || strspn(ps, "0123456789") != strlen(ps) || atoi(ps) > 65535)
        return metrics__fail(err, errlen, "bad metrics port in %s", addr);
    hints.ai_family = host[0] ? AF_UNSPEC : AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    rc = getaddrinfo(host[0] ? host : NULL, ps, &hints, &res);
    if (rc != 0)
        return metrics__fail(err, errlen, "metrics address %s: %s", addr, gai_strerror(rc));
    for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
        fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0) {
            last = errno;
            continue;
        }
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 && listen(fd, 256) == 0) break;
        last = errno;
        close(fd);
        fd = -1;
    }
    freeaddrinfo(res);
    if (fd < 0) return metrics__fail(err, errlen, "metrics listen on %s: %s", addr, strerror(last));
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    getsockname(fd, (struct sockaddr *)&ss, &sl);
    *port = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                           : ((struct sockaddr_in *)&ss)->sin_port);
    return fd;
}

int metrics_serve(const char *addr, char *err, size_t errlen) {
    return metrics_serve_with(addr, NULL, err, errlen);
}

int metrics_serve_with(const char *addr, const metrics_serve_opts *opts, char *err, size_t errlen) {
    metrics_serve_opts o = {256, 8, 3};
    if (opts && opts->max_connections > 0) o.max_connections = opts->max_connections;
    if (opts && opts->per_ip > 0) o.per_ip = opts->per_ip;
    if (opts && opts->idle_timeout_s > 0) o.idle_timeout_s = opts->idle_timeout_s;
    int fd, port = 0, rc = -1;
    pthread_mutex_lock(&metrics__srv_mu);
    if (metrics__daemon) {
        metrics__fail(err, errlen, "metrics server already running");
        goto done;
    }
    fd = metrics__listen(addr, &port, err, errlen);
    if (fd < 0) goto done;
    /* MHD owns the listening socket from here and closes it in MHD_stop_daemon. */
    metrics__daemon = MHD_start_daemon(
        MHD_USE_AUTO_INTERNAL_THREAD | MHD_USE_ERROR_LOG, 0, NULL, NULL, metrics__handle, NULL,
        MHD_OPTION_EXTERNAL_LOGGER, metrics__mhd_log, NULL, MHD_OPTION_LISTEN_SOCKET, fd,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)o.max_connections,
        MHD_OPTION_PER_IP_CONNECTION_LIMIT, (unsigned)o.per_ip, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)o.idle_timeout_s, MHD_OPTION_END);
    if (!metrics__daemon) {
        close(fd);
        metrics__fail(err, errlen, "metrics HTTP server did not start on %s", addr);
        goto done;
    }
    metrics__bound_port = port;
    rc = 0;
done:
    pthread_mutex_unlock(&metrics__srv_mu);
    return rc;
}

void metrics_stop(void) {
    pthread_mutex_lock(&metrics__srv_mu);
    if (metrics__daemon) MHD_stop_daemon(metrics__daemon);
    metrics__daemon = NULL;
    metrics__bound_port = 0;
    pthread_mutex_unlock(&metrics__srv_mu);
}

int metrics_port(void) {
    pthread_mutex_lock(&metrics__srv_mu);
    int p = metrics__bound_port;
    pthread_mutex_unlock(&metrics__srv_mu);
    return p;
}
