/* See arena.h. */
#include "arena.h"

#include <stdlib.h>
#include <string.h>

typedef struct block {
    struct block *next;
    max_align_t data[];
} block;

void *orch_arena_alloc(orch_arena *a, size_t n) {
    block *b = calloc(1, sizeof *b + (n ? n : 1));
    if (b == NULL) {
        a->failed = 1;
        return NULL;
    }
    b->next = a->blocks;
    a->blocks = b;
    return b->data;
}

char *orch_arena_strndup(orch_arena *a, const char *s, size_t n) {
    char *p = orch_arena_alloc(a, n + 1);
    if (p && n) memcpy(p, s, n);
    return p;
}

char *orch_arena_strdup(orch_arena *a, const char *s) {
    return orch_arena_strndup(a, s ? s : "", s ? strlen(s) : 0);
}

void orch_arena_free(orch_arena *a) {
    block *b = a->blocks;
    while (b) {
        block *n = b->next;
        free(b);
        b = n;
    }
    a->blocks = NULL;
    a->failed = 0;
}
