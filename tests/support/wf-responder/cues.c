/* Cues in an agent step's goal text: #fail[=code], #fail_retryable, #fail_attempts=N,
 * #input_required, #interrupt_required, #sleep_ms=N, #output={json}, #output@N={json},
 * #usage=IN,OUT, #cost=USD. */
#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#include "responder.h"
#include "util.h"

static int is(const char *name, size_t len, const char *want) {
    return strlen(want) == len && strncmp(name, want, len) == 0;
}

/* #output[@N]={...}: kept when it applies to this attempt; @N wins over the plain form. */
static const char *take_output(wr_cues *c, const char *val, int at, int attempt, int *specific) {
    const char *end = *val == '{' ? util_json_object_end(val) : NULL;
    if (!end) return val;
    if ((at && at != attempt) || (!at && *specific)) return end;
    cJSON *o = cJSON_ParseWithLength(val, (size_t)(end - val));
    if (!cJSON_IsObject(o)) {
        cJSON_Delete(o);
        return end;
    }
    cJSON_Delete(c->output);
    c->output = o;
    if (at) *specific = 1;
    return end;
}

void wr_cues_parse(const char *goal, int attempt, wr_cues *c) {
    memset(c, 0, sizeof *c);
    c->input_tokens = c->output_tokens = -1;
    c->cost_usd = -1;
    int specific = 0;
    for (const char *p = goal ? strchr(goal, '#') : NULL; p; p = strchr(p, '#')) {
        const char *name = ++p, *q = name;
        while (islower((unsigned char)*q) || *q == '_')
            q++;
        size_t len = (size_t)(q - name);
        int at = 0;
        if (*q == '@' && is(name, len, "output")) {
            at = atoi(q + 1);
            q++;
            while (isdigit((unsigned char)*q))
                q++;
        }
        const char *val = *q == '=' ? q + 1 : NULL;
        p = q;
        if (is(name, len, "fail")) {
            c->outcome = WR_FAILED;
            size_t n = 0;
            while (val && (isalnum((unsigned char)val[n]) || val[n] == '_') && n < 63)
                n++;
            memcpy(c->fail_code, val ? val : "", n);
            c->fail_code[n] = '\0';
        } else if (is(name, len, "fail_retryable")) {
            c->outcome = WR_FAILED;
            c->fail_retryable = 1;
        } else if (is(name, len, "fail_attempts") && val) {
            c->fail_attempts = atoi(val);
        } else if (is(name, len, "input_required")) {
            c->outcome = WR_INPUT_REQUIRED;
        } else if (is(name, len, "interrupt_required")) {
            c->outcome = WR_INTERRUPT_REQUIRED;
        } else if (is(name, len, "sleep_ms") && val) {
            long long ms = atoll(val);
            c->sleep_ms = ms < 0 ? 0 : ms > WR_CUE_MAX_MS ? WR_CUE_MAX_MS : ms;
        } else if (is(name, len, "output") && val) {
            p = take_output(c, val, at, attempt, &specific);
        } else if (is(name, len, "usage") && val) {
            char *comma = NULL;
            c->input_tokens = strtoll(val, &comma, 10);
            c->output_tokens = comma && *comma == ',' ? strtoll(comma + 1, NULL, 10) : 0;
        } else if (is(name, len, "cost") && val) {
            c->cost_usd = strtod(val, NULL);
        }
    }
    if (c->fail_attempts > 0 && attempt <= c->fail_attempts && c->outcome == WR_COMPLETED) {
        c->outcome = WR_FAILED;
        c->fail_retryable = 1;
    }
    if (c->outcome == WR_FAILED && !c->fail_code[0]) strcpy(c->fail_code, "worker_error");
}

void wr_cues_free(wr_cues *c) {
    cJSON_Delete(c->output);
    c->output = NULL;
}
