/* A small JSON reader and canonical writer for forkpoint's records (docs/FORMAT.md).
 * Parsed values live in an arena freed at once; numbers keep their text, so integers of any
 * size and floats round-trip; the canonical form is Python's json.dumps(sort_keys=True,
 * separators=(",", ":")), which a version's id is the hash of. */
#ifndef FP_JSON_H
#define FP_JSON_H
#include <stddef.h>
#include <stdint.h>

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jval {
    jtype t;
    size_t n;              /* string bytes, number text bytes, items or members */
    const char *s;         /* string (UTF-8, NUL-terminated) or number text */
    struct jval **items;   /* array items or member values */
    struct jval **keys;    /* member keys (J_STR) */
    int b;                 /* boolean */
} jval;

typedef struct arena_block arena_block;
typedef struct {
    arena_block *head;
} arena;

void *arena_alloc(arena *a, size_t n);
void arena_free(arena *a);

/* Parse `len` bytes; NULL with a message in `err` when they are not one JSON value (invalid
 * UTF-8, nesting deeper than 512 and duplicate member names are refused too). */
jval *json_parse(arena *a, const char *data, size_t len, char *err, size_t errlen);

const jval *json_get(const jval *obj, const char *key);
/* 1 when `v` is an integer number that fits int64 (stored in *out), else 0. */
int json_int(const jval *v, int64_t *out);
/* 1 when `v` is a finite number (stored in *out), else 0. */
int json_double(const jval *v, double *out);
int json_is_str(const jval *v);

typedef struct {
    char *p;
    size_t n, cap;
    int failed; /* out of memory: every later append is ignored */
} sbuf;

void sb_put(sbuf *b, const void *data, size_t n);
void sb_puts(sbuf *b, const char *s);
void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A JSON string literal as Python's json.dumps writes it (ASCII only, \uXXXX escapes). */
void sb_json_str(sbuf *b, const char *s, size_t n);
/* A float as Python's repr writes it (shortest round-trip digits); 0 for NaN or infinities. */
int sb_json_double(sbuf *b, double x);
/* The canonical JSON of `v` (sorted keys); 0 when it holds a non-finite number. */
int json_canonical(sbuf *b, const jval *v);
void sb_free(sbuf *b);
#endif
