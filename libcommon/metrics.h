/* Prometheus metrics: counters, gauges and histograms in one process-wide registry, rendered
 * in the text exposition format 0.0.4 and served over HTTP (GET /metrics, GET /healthz).
 *
 * Registration looks a series up by (name, labels) under a lock and always returns the same
 * pointer for the same pair: callers look up once and keep the pointer. Updates on that
 * pointer are lock-free (C11 atomics) and safe from any thread.
 *
 * Bounds: at most METRICS_MAX_SERIES series. Beyond that (and on OOM, an invalid name or a
 * name already registered with another type or other buckets) registration returns NULL and
 * logs once; every metric_* call on NULL is a no-op, so instrumentation never fails a request.
 *
 * Labels are passed preformatted, e.g. `method="/a.B/C",code="OK"`; values must already be
 * escaped (metrics_label_escape). Rendering adds process_* metrics (resident and virtual
 * memory, start time, CPU seconds, open and max file descriptors). */
#ifndef UPSQUAD_METRICS_H
#define UPSQUAD_METRICS_H

#include <stddef.h>

#define METRICS_MAX_SERIES 10000
#define METRICS_MAX_BUCKETS 64

typedef struct metric metric;

/* labels: NULL or "" for none. name: [a-zA-Z_:][a-zA-Z0-9_:]*. Strings are copied. */
metric *metrics_counter(const char *name, const char *help, const char *labels);
metric *metrics_gauge(const char *name, const char *help, const char *labels);
/* bounds: strictly increasing finite upper bounds (+Inf is implicit); NULL -> the default
 * latency buckets in seconds .0005 .001 .0025 .005 .01 .025 .05 .1 .25 .5 1 2.5 5 10.
 * All series of one name share the buckets of the first registration. */
metric *metrics_histogram(const char *name, const char *help, const char *labels,
                          const double *bounds, size_t nbounds);

void metric_inc(metric *m);               /* counter or gauge: +1 */
void metric_add(metric *m, double v);     /* counter: v >= 0 (negative is ignored); gauge: any */
void metric_set(metric *m, double v);     /* gauge only */
void metric_observe(metric *m, double v); /* histogram only; NaN is ignored */
double metric_value(const metric *m);     /* counter/gauge value, histogram sum; 0 for NULL */

/* Text exposition format 0.0.4, grouped by name, # HELP / # TYPE once per name, in
 * registration order. *out: caller frees. 0 on success, -1 on OOM. */
int metrics_render(char **out, size_t *len);

/* Serves GET /metrics and GET /healthz ("ok") on addr ("127.0.0.1:9101", ":9101" for every
 * interface, "[::1]:9101"; port 0 picks a free one) from one internal thread, at most
 * 16 connections, 10 s idle timeout. 0 on success, -1 with err filled. */
int metrics_serve(const char *addr, char *err, size_t errlen);
/* The same with the connection budget of the metrics port, so idle or slow clients cannot
 * stop Prometheus from scraping: at most max_connections open (default 256), at most per_ip
 * from one address (default 8), each closed after idle_timeout_s silent seconds (default 3).
 * Zero fields take the defaults; metrics_serve uses them all. */
typedef struct metrics_serve_opts {
    int max_connections, per_ip, idle_timeout_s;
} metrics_serve_opts;
int metrics_serve_with(const char *addr, const metrics_serve_opts *o, char *err, size_t errlen);
void metrics_stop(void);
int metrics_port(void); /* the bound port, 0 when not serving */

/* Writes value escaped for a label value (\\, \", \n) into out; returns the length it needs
 * (excluding the NUL), like snprintf. */
size_t metrics_label_escape(const char *value, char *out, size_t outlen);

/* Drops every series (their pointers become invalid). For tests and process exit only:
 * no other thread may use metrics meanwhile. */
void metrics_reset(void);

#endif
