/* A small allocation arena: many blocks, one free. Used to build protobuf-c messages whose
 * strings and arrays are released together (snapshots, worker requests). Not thread-safe. */
#ifndef UPSQUAD_ORCH_ARENA_H
#define UPSQUAD_ORCH_ARENA_H

#include <stddef.h>

typedef struct orch_arena {
    void *blocks; /* singly linked list of allocations */
    int failed;   /* an allocation failed; every later call still returns NULL safely */
} orch_arena;

void *orch_arena_alloc(orch_arena *a, size_t n); /* zeroed; NULL on OOM */
char *orch_arena_strdup(orch_arena *a, const char *s);
char *orch_arena_strndup(orch_arena *a, const char *s, size_t n);
void orch_arena_free(orch_arena *a); /* frees every block; the arena is reusable */

#endif
