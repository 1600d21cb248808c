/* Structured JSON-lines logging, level-gated, with a per-thread trace id.
 *
 * One line per event on stderr:
 *   {"ts":"2026-12-02T14:50:01.123Z","level":"info","svc":"orchestrator",
 *    "event":"rpc.done","trace_id":"...","org_id":"...","run_id":"...","msg":"..."}
 * `event` is a short dotted, greppable name; `msg` is free text (JSON-escaped).
 * Never pass secrets (tokens, keys, passwords) to these functions. */
#ifndef UPSQUAD_LOG_H
#define UPSQUAD_LOG_H

#include <stdarg.h>

enum { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3, LOG_OFF = 4 };

extern int log__level; /* read by the macros; set through log_init */

/* service: copied. level: one of the above. Safe to call again (e.g. in tests). */
void log_init(const char *service, int level);
/* "debug" | "info" | "warn" | "error" | "off" -> level; -1 when unknown. */
int log_level_parse(const char *s);
/* log_init with the level from UPSQUAD_LOG_LEVEL (unset or empty: info). Returns -1 when the
 * variable holds an unknown level (the level is then info), 0 otherwise. */
int log_init_env(const char *service);
/* Thread-local trace id for the lines this thread writes; NULL clears. Copied (<= 64 chars). */
void log_set_trace(const char *trace_id);
const char *log_get_trace(void);
/* Thread-local ids the lines this thread writes carry as fields of their own ("org_id",
 * "run_id", "session_id"), so logs are filtered by field, not by grepping messages. NULL or ""
 * clears one; log_clear_ids clears all (a worker thread between jobs). Copied (<= 64 chars). */
enum { LOG_ID_ORG = 0, LOG_ID_RUN, LOG_ID_SESSION, LOG_ID_N };
void log_set_id(int which, const char *id);
const char *log_get_id(int which);
void log_clear_ids(void);

void log_write(int level, const char *event, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
void log_vwrite(int level, const char *event, const char *fmt, va_list ap);

#define log__at(lvl, ev, ...)                                                                      \
    do {                                                                                           \
        if (log__level <= (lvl)) log_write((lvl), (ev), __VA_ARGS__);                              \
    } while (0)
#define log_debug(ev, ...) log__at(LOG_DEBUG, ev, __VA_ARGS__)
#define log_info(ev, ...) log__at(LOG_INFO, ev, __VA_ARGS__)
#define log_warn(ev, ...) log__at(LOG_WARN, ev, __VA_ARGS__)
#define log_error(ev, ...) log__at(LOG_ERROR, ev, __VA_ARGS__)

#endif
