/* Pointers, violations and small JSON/text helpers of the definition validator. */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "defn_internal.h"

#define DEFN__MSG_MAX 1024

int defn__ptr_init(defn__ptr *p) {
    p->cap = 256;
    p->len = 0;
    p->buf = malloc(p->cap);
    if (!p->buf) return DEFN_ERR_NOMEM;
    p->buf[0] = '\0';
    return 0;
}

void defn__ptr_free(defn__ptr *p) {
    free(p->buf);
    p->buf = NULL;
    p->len = p->cap = 0;
}

static int ptr_reserve(defn__ptr *p, size_t extra) {
    if (p->len + extra + 1 <= p->cap) return 0;
    size_t cap = p->cap;
    while (p->len + extra + 1 > cap)
        cap *= 2;
    char *b = realloc(p->buf, cap);
    if (!b) return DEFN_ERR_NOMEM;
    p->buf = b;
    p->cap = cap;
    return 0;
}

int defn__ptr_set(defn__ptr *p, const char *text) {
    size_t n = strlen(text);
    p->len = 0;
    if (ptr_reserve(p, n) != 0) return DEFN_ERR_NOMEM;
    memcpy(p->buf, text, n + 1);
    p->len = n;
    return 0;
}

size_t defn__ptr_push_key(defn__ptr *p, const char *key) {
    size_t old = p->len;
    size_t klen = strlen(key);
    /* Worst case every byte escapes to two ("~0" / "~1"). */
    if (ptr_reserve(p, 1 + 2 * klen) != 0) return (size_t)-1;
    char *w = p->buf + p->len;
    *w++ = '/';
    for (size_t i = 0; i < klen; i++) {
        if (key[i] == '~') {
            *w++ = '~';
            *w++ = '0';
        } else if (key[i] == '/') {
            *w++ = '~';
            *w++ = '1';
        } else {
            *w++ = key[i];
        }
    }
    *w = '\0';
    p->len = (size_t)(w - p->buf);
    return old;
}

size_t defn__ptr_push_index(defn__ptr *p, size_t index) {
    size_t old = p->len;
    if (ptr_reserve(p, 24) != 0) return (size_t)-1;
    int n = snprintf(p->buf + p->len, p->cap - p->len, "/%zu", index);
    p->len += (size_t)n;
    return old;
}

void defn__ptr_pop(defn__ptr *p, size_t len) {
    p->len = len;
    p->buf[len] = '\0';
}

int defn__add(defn_violations *v, const char *loc, const char *fmt, ...) {
    if (v->n >= DEFN_MAX_VIOLATIONS) {
        v->dropped++;
        return 0;
    }
    if (v->n == v->cap) {
        size_t cap = v->cap ? v->cap * 2 : 8;
        defn_violation *items = realloc(v->items, cap * sizeof(*items));
        if (!items) return DEFN_ERR_NOMEM;
        v->items = items;
        v->cap = cap;
    }
    char msg[DEFN__MSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof(msg)) {
        /* Clip on a code point boundary and mark the cut. */
        size_t cut = sizeof(msg) - 4;
        while (cut > 0 && ((unsigned char)msg[cut] & 0xC0) == 0x80)
            cut--;
        memcpy(msg + cut, "...", 4);
    }
    char *l = strdup(loc);
    char *m = strdup(msg);
    if (!l || !m) {
        free(l);
        free(m);
        return DEFN_ERR_NOMEM;
    }
    v->items[v->n].instance_location = l;
    v->items[v->n].message = m;
    v->n++;
    return 0;
}

int defn__add_overflow_note(defn_violations *v) {
    if (v->dropped == 0) return 0;
    size_t dropped = v->dropped;
    v->n--; /* make room: the note replaces the last stored violation */
    free(v->items[v->n].instance_location);
    free(v->items[v->n].message);
    dropped++;
    v->dropped = 0;
    int rc = defn__add(v, "", "%zu more violations not reported (at most %d are)", dropped,
                       DEFN_MAX_VIOLATIONS);
    v->dropped = dropped;
    return rc;
}

void defn__truncate(defn_violations *v, size_t n) {
    while (v->n > n) {
        v->n--;
        free(v->items[v->n].instance_location);
        free(v->items[v->n].message);
    }
}

void defn_violations_init(defn_violations *v) {
    memset(v, 0, sizeof(*v));
}

void defn_violations_free(defn_violations *v) {
    if (!v) return;
    defn__truncate(v, 0);
    free(v->items);
    memset(v, 0, sizeof(*v));
}

size_t defn__utf8_len(const char *s) {
    size_t n = 0;
    for (; *s; s++)
        if (((unsigned char)*s & 0xC0) != 0x80) n++;
    return n;
}

size_t defn__utf8_check(const unsigned char *s, size_t len) {
    size_t i = 0;
    while (i < len) {
        unsigned char c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t need;
        unsigned int cp;
        if (c >= 0xC2 && c <= 0xDF) {
            need = 1;
            cp = c & 0x1F;
        } else if (c >= 0xE0 && c <= 0xEF) {
            need = 2;
            cp = c & 0x0F;
        } else if (c >= 0xF0 && c <= 0xF4) {
            need = 3;
            cp = c & 0x07;
        } else {
            return i;
        }
        if (i + need >= len) return i;
        for (size_t k = 1; k <= need; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return i;
            cp = (cp << 6) | (s[i + k] & 0x3F);
        }
        /* Overlong forms, surrogates and code points past U+10FFFF are not UTF-8. */
        if ((need == 2 && cp < 0x800) || (need == 3 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return i;
        i += need + 1;
    }
    return len;
}

void defn__fmt_num(double d, char *buf, size_t len) {
    if (isfinite(d) && d == floor(d) && fabs(d) < 1e15) {
        snprintf(buf, len, "%.0f", d);
        return;
    }
    /* Shortest representation that reads back as the same double. */
    for (int prec = 1; prec <= 17; prec++) {
        snprintf(buf, len, "%.*g", prec, d);
        if (strtod(buf, NULL) == d) return;
    }
}

bool defn__json_equal(const cJSON *a, const cJSON *b) {
    if (cJSON_IsNumber(a) && cJSON_IsNumber(b)) return a->valuedouble == b->valuedouble;
    if (cJSON_IsString(a) && cJSON_IsString(b)) return strcmp(a->valuestring, b->valuestring) == 0;
    if (cJSON_IsBool(a) && cJSON_IsBool(b)) return cJSON_IsTrue(a) == cJSON_IsTrue(b);
    if (cJSON_IsNull(a) && cJSON_IsNull(b)) return true;
    if (cJSON_IsArray(a) && cJSON_IsArray(b)) {
        const cJSON *x = a->child, *y = b->child;
        for (; x && y; x = x->next, y = y->next)
            if (!defn__json_equal(x, y)) return false;
        return !x && !y;
    }
    if (cJSON_IsObject(a) && cJSON_IsObject(b)) {
        if (cJSON_GetArraySize(a) != cJSON_GetArraySize(b)) return false;
        for (const cJSON *x = a->child; x; x = x->next) {
            const cJSON *y = cJSON_GetObjectItemCaseSensitive(b, x->string);
            if (!y || !defn__json_equal(x, y)) return false;
        }
        return true;
    }
    return false;
}

/* Decodes one reference token of length n into out (cap bytes); -1 on a bad escape. */
static int unescape_token(const char *tok, size_t n, char *out, size_t cap) {
    size_t w = 0;
    for (size_t i = 0; i < n; i++) {
        char c = tok[i];
        if (c == '~') {
            if (i + 1 >= n || (tok[i + 1] != '0' && tok[i + 1] != '1')) return -1;
            c = tok[i + 1] == '0' ? '~' : '/';
            i++;
        }
        if (w + 1 >= cap) return -1;
        out[w++] = c;
    }
    out[w] = '\0';
    return 0;
}

const cJSON *defn__resolve(const cJSON *doc, const char *ptr) {
    const cJSON *cur = doc;
    char tok[1024];
    if (*ptr == '\0') return doc;
    if (*ptr != '/') return NULL;
    while (cur && *ptr == '/') {
        ptr++;
        size_t n = strcspn(ptr, "/");
        if (unescape_token(ptr, n, tok, sizeof(tok)) != 0) return NULL;
        ptr += n;
        if (cJSON_IsObject(cur)) {
            cur = cJSON_GetObjectItemCaseSensitive(cur, tok);
        } else if (cJSON_IsArray(cur)) {
            char *end;
            unsigned long idx = strtoul(tok, &end, 10);
            if (*tok == '\0' || *end != '\0' || (tok[0] == '0' && tok[1] != '\0') ||
                idx > 0x7fffffffUL)
                return NULL;
            cur = cJSON_GetArrayItem(cur, (int)idx);
        } else {
            return NULL;
        }
    }
    return cur;
}
