#include "json.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_DEPTH 512

struct arena_block {
    arena_block *next;
    size_t used, cap;
    max_align_t data[];
};

void *arena_alloc(arena *a, size_t n) {
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    arena_block *h = a->head;
    if (!h || h->cap - h->used < n) {
        size_t cap = n > (1u << 16) ? n : (1u << 16);
        h = malloc(sizeof *h + cap);
        if (!h) return NULL;
        h->next = a->head, h->used = 0, h->cap = cap;
        a->head = h;
    }
    void *p = (char *)h->data + h->used;
    h->used += n;
    return p;
}

void arena_free(arena *a) {
    for (arena_block *h = a->head, *next; h; h = next) {
        next = h->next;
        free(h);
    }
    a->head = NULL;
}

typedef struct {
    arena *a;
    const unsigned char *p, *end, *start;
    char *err;
    size_t errlen;
} parser;

static jval *fail(parser *ps, const char *what) {
    if (ps->err && !ps->err[0]) snprintf(ps->err, ps->errlen, "%s at byte %zu", what, (size_t)(ps->p - ps->start));
    return NULL;
}

static void skip_ws(parser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r')) ps->p++;
}

static jval *new_val(parser *ps, jtype t) {
    jval *v = arena_alloc(ps->a, sizeof *v);
    if (!v) return fail(ps, "out of memory");
    memset(v, 0, sizeof *v);
    v->t = t;
    return v;
}

static int hex4(const unsigned char *p, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int c = p[i], d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                        : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return 0;
        v = v << 4 | (unsigned)d;
    }
    *out = v;
    return 1;
}

static size_t put_utf8(unsigned char *o, unsigned cp) {
    if (cp < 0x80) { o[0] = (unsigned char)cp; return 1; }
    if (cp < 0x800) { o[0] = (unsigned char)(0xC0 | cp >> 6); o[1] = (unsigned char)(0x80 | (cp & 63)); return 2; }
    if (cp < 0x10000) {
        o[0] = (unsigned char)(0xE0 | cp >> 12);
        o[1] = (unsigned char)(0x80 | (cp >> 6 & 63));
        o[2] = (unsigned char)(0x80 | (cp & 63));
        return 3;
    }
    o[0] = (unsigned char)(0xF0 | cp >> 18);
    o[1] = (unsigned char)(0x80 | (cp >> 12 & 63));
    o[2] = (unsigned char)(0x80 | (cp >> 6 & 63));
    o[3] = (unsigned char)(0x80 | (cp & 63));
    return 4;
}

/* Length of the valid UTF-8 sequence at p (no surrogates, no overlong forms), 0 if invalid. */
static size_t utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0];
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!n || (size_t)(end - p) < n) return 0;
    unsigned cp = n == 1 ? c : n == 2 ? c & 31 : n == 3 ? c & 15 : c & 7;
    for (size_t i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        cp = cp << 6 | (p[i] & 63);
    }
    static const unsigned least[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < least[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp < 0xE000)) return 0;
    return n;
}

static jval *parse_string(parser *ps) {
    const unsigned char *p = ps->p + 1;
    const unsigned char *q = p;
    while (q < ps->end && *q != '"') {
        if (*q == '\\') q++;
        q++;
    }
    if (q >= ps->end) return fail(ps, "unterminated string");
    unsigned char *out = arena_alloc(ps->a, (size_t)(q - p) + 1);
    if (!out) return fail(ps, "out of memory");
    size_t o = 0;
    while (*p != '"') {
        unsigned c = *p;
        if (c < 0x20) { ps->p = p; return fail(ps, "control character in a string"); }
        if (c != '\\') {
            size_t n = utf8_len(p, ps->end);
            if (!n) { ps->p = p; return fail(ps, "invalid UTF-8 in a string"); }
            memcpy(out + o, p, n);
            o += n, p += n;
            continue;
        }
        p++;
        switch (*p) {
        case '"': out[o++] = '"'; p++; break;
        case '\\': out[o++] = '\\'; p++; break;
        case '/': out[o++] = '/'; p++; break;
        case 'b': out[o++] = '\b'; p++; break;
        case 'f': out[o++] = '\f'; p++; break;
        case 'n': out[o++] = '\n'; p++; break;
        case 'r': out[o++] = '\r'; p++; break;
        case 't': out[o++] = '\t'; p++; break;
        case 'u': {
            unsigned cp, lo;
            if (ps->end - p < 5 || !hex4(p + 1, &cp)) { ps->p = p; return fail(ps, "invalid \\u escape"); }
            p += 5;
            if (cp >= 0xD800 && cp < 0xDC00 && ps->end - p >= 6 && p[0] == '\\' && p[1] == 'u' && hex4(p + 2, &lo)
                && lo >= 0xDC00 && lo < 0xE000) {
                cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                p += 6;
            }
            /* a lone surrogate is kept (as Python keeps it), written in the 3-byte form */
            o += put_utf8(out + o, cp);
            break;
        }
        default: ps->p = p; return fail(ps, "invalid escape in a string");
        }
    }
    out[o] = 0;
    jval *v = new_val(ps, J_STR);
    if (!v) return NULL;
    v->s = (const char *)out, v->n = o;
    ps->p = p + 1;
    return v;
}

static jval *parse_number(parser *ps) {
    const unsigned char *p = ps->p, *s = p;
    if (p < ps->end && *p == '-') p++;
    if (p < ps->end && *p == '0') p++;
    else if (p < ps->end && *p >= '1' && *p <= '9') while (p < ps->end && *p >= '0' && *p <= '9') p++;
    else return fail(ps, "invalid number");
    if (p < ps->end && *p == '.') {
        p++;
        if (!(p < ps->end && *p >= '0' && *p <= '9')) return fail(ps, "invalid number");
        while (p < ps->end && *p >= '0' && *p <= '9') p++;
    }
    if (p < ps->end && (*p == 'e' || *p == 'E')) {
        p++;
        if (p < ps->end && (*p == '+' || *p == '-')) p++;
        if (!(p < ps->end && *p >= '0' && *p <= '9')) return fail(ps, "invalid number");
        while (p < ps->end && *p >= '0' && *p <= '9') p++;
    }
    char *text = arena_alloc(ps->a, (size_t)(p - s) + 1);
    jval *v = text ? new_val(ps, J_NUM) : fail(ps, "out of memory");
    if (!v) return NULL;
    memcpy(text, s, (size_t)(p - s));
    text[p - s] = 0;
    v->s = text, v->n = (size_t)(p - s);
    ps->p = p;
    return v;
}

static int key_cmp(const void *a, const void *b) {
    const jval *x = *(jval *const *)a, *y = *(jval *const *)b;
    size_t n = x->n < y->n ? x->n : y->n;
    int c = memcmp(x->s, y->s, n);
    return c ? c : (x->n > y->n) - (x->n < y->n);
}

/* Items of an array or object are gathered on a growable list, then copied into the arena. */
typedef struct {
    jval **v;
    size_t n, cap;
} vlist;

static int vpush(vlist *l, jval *v) {
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 8;
        jval **nv = realloc(l->v, cap * sizeof *nv);
        if (!nv) return 0;
        l->v = nv, l->cap = cap;
    }
    l->v[l->n++] = v;
    return 1;
}

static jval **vfreeze(parser *ps, vlist *l) {
    jval **out = arena_alloc(ps->a, (l->n ? l->n : 1) * sizeof *out);
    if (out && l->n) memcpy(out, l->v, l->n * sizeof *out);
    return out;
}

static jval *parse_value(parser *ps, int depth);

static jval *parse_container(parser *ps, int depth, int object) {
    if (depth > MAX_DEPTH) return fail(ps, "nested too deeply");
    jval *v = new_val(ps, object ? J_OBJ : J_ARR);
    if (!v) return NULL;
    vlist keys = {0}, vals = {0};
    ps->p++;
    skip_ws(ps);
    char close = object ? '}' : ']';
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
    } else {
        for (;;) {
            skip_ws(ps);
            if (object) {
                if (!(ps->p < ps->end && *ps->p == '"')) { fail(ps, "expected a member name"); goto bad; }
                jval *k = parse_string(ps);
                if (!k || !vpush(&keys, k)) { fail(ps, "out of memory"); goto bad; }
                skip_ws(ps);
                if (!(ps->p < ps->end && *ps->p == ':')) { fail(ps, "expected ':'"); goto bad; }
                ps->p++;
            }
            jval *item = parse_value(ps, depth + 1);
            if (!item || !vpush(&vals, item)) { fail(ps, "out of memory"); goto bad; }
            skip_ws(ps);
            if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
            if (ps->p < ps->end && *ps->p == close) { ps->p++; break; }
            fail(ps, object ? "expected ',' or '}'" : "expected ',' or ']'");
            goto bad;
        }
    }
    v->n = vals.n;
    v->items = vfreeze(ps, &vals);
    if (object) v->keys = vfreeze(ps, &keys);
    if (!v->items || (object && !v->keys)) { fail(ps, "out of memory"); goto bad; }
    if (object && v->n > 1) { /* duplicate member names are refused: readers could disagree on them */
        jval **sorted = malloc(v->n * sizeof *sorted);
        if (!sorted) { fail(ps, "out of memory"); goto bad; }
        memcpy(sorted, v->keys, v->n * sizeof *sorted);
        qsort(sorted, v->n, sizeof *sorted, key_cmp);
        int dup = 0;
        for (size_t i = 1; i < v->n && !dup; i++) dup = key_cmp(&sorted[i - 1], &sorted[i]) == 0;
        free(sorted);
        if (dup) { fail(ps, "duplicate member name"); goto bad; }
    }
    free(keys.v);
    free(vals.v);
    return v;
bad:
    free(keys.v);
    free(vals.v);
    return NULL;
}

static jval *parse_value(parser *ps, int depth) {
    skip_ws(ps);
    if (ps->p >= ps->end) return fail(ps, "unexpected end");
    switch (*ps->p) {
    case '{': return parse_container(ps, depth, 1);
    case '[': return parse_container(ps, depth, 0);
    case '"': return parse_string(ps);
    case 't':
    case 'f':
    case 'n': {
        const char *word = *ps->p == 't' ? "true" : *ps->p == 'f' ? "false" : "null";
        size_t n = strlen(word);
        if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n)) return fail(ps, "invalid literal");
        jval *v = new_val(ps, *word == 'n' ? J_NULL : J_BOOL);
        if (v) v->b = *word == 't';
        ps->p += n;
        return v;
    }
    default: return parse_number(ps);
    }
}

jval *json_parse(arena *a, const char *data, size_t len, char *err, size_t errlen) {
    parser ps = {a, (const unsigned char *)data, (const unsigned char *)data + len, (const unsigned char *)data, err, errlen};
    if (err && errlen) err[0] = 0;
    jval *v = parse_value(&ps, 0);
    if (!v) return NULL;
    skip_ws(&ps);
    if (ps.p != ps.end) return fail(&ps, "trailing bytes after the value");
    return v;
}

const jval *json_get(const jval *obj, const char *key) {
    if (!obj || obj->t != J_OBJ) return NULL;
    size_t n = strlen(key);
    for (size_t i = 0; i < obj->n; i++)
        if (obj->keys[i]->n == n && !memcmp(obj->keys[i]->s, key, n)) return obj->items[i];
    return NULL;
}

static int is_integer_text(const jval *v) {
    return v && v->t == J_NUM && !strpbrk(v->s, ".eE");
}

int json_int(const jval *v, int64_t *out) {
    if (!is_integer_text(v)) return 0;
    const char *p = v->s;
    int neg = *p == '-';
    p += neg;
    uint64_t acc = 0;
    for (; *p; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (acc > (UINT64_MAX - d) / 10) return 0;
        acc = acc * 10 + d;
    }
    if (acc > (uint64_t)INT64_MAX + (uint64_t)neg) return 0;
    *out = neg ? (int64_t)(0 - acc) : (int64_t)acc;
    return 1;
}

int json_double(const jval *v, double *out) {
    if (!v || v->t != J_NUM) return 0;
    double x = strtod(v->s, NULL);
    if (!isfinite(x)) return 0;
    *out = x;
    return 1;
}

int json_is_str(const jval *v) { return v && v->t == J_STR; }

void sb_put(sbuf *b, const void *data, size_t n) {
    if (b->failed) return;
    if (b->cap - b->n < n + 1) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->n < n + 1) cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) { b->failed = 1; return; }
        b->p = p, b->cap = cap;
    }
    memcpy(b->p + b->n, data, n);
    b->n += n;
    b->p[b->n] = 0;
}

void sb_puts(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

void sb_printf(sbuf *b, const char *fmt, ...) {
    char small[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) { b->failed = 1; return; }
    if ((size_t)n < sizeof small) { sb_put(b, small, (size_t)n); return; }
    char *big = malloc((size_t)n + 1);
    if (!big) { b->failed = 1; return; }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_put(b, big, (size_t)n);
    free(big);
}

void sb_free(sbuf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

void sb_json_str(sbuf *b, const char *s, size_t n) {
    static const char hex[] = "0123456789abcdef";
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    sb_put(b, "\"", 1);
    while (p < end) {
        const unsigned char *run = p;
        while (p < end && *p >= 0x20 && *p < 0x7f && *p != '"' && *p != '\\') p++;
        sb_put(b, run, (size_t)(p - run));
        if (p >= end) break;
        unsigned c = *p, cp;
        char esc[16];
        switch (c) {
        case '"': sb_put(b, "\\\"", 2); p++; continue;
        case '\\': sb_put(b, "\\\\", 2); p++; continue;
        case '\n': sb_put(b, "\\n", 2); p++; continue;
        case '\r': sb_put(b, "\\r", 2); p++; continue;
        case '\t': sb_put(b, "\\t", 2); p++; continue;
        case '\b': sb_put(b, "\\b", 2); p++; continue;
        case '\f': sb_put(b, "\\f", 2); p++; continue;
        }
        /* decode one sequence (lone surrogates in 3-byte form included) and escape it */
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : 4;
        if ((size_t)(end - p) < len) len = 1;
        cp = len == 1 ? c : len == 2 ? c & 31 : len == 3 ? c & 15 : c & 7;
        for (size_t i = 1; i < len; i++) cp = cp << 6 | (p[i] & 63);
        p += len;
        if (cp >= 0x10000) {
            unsigned v = cp - 0x10000, hi = 0xD800 | v >> 10, lo = 0xDC00 | (v & 0x3FF);
            snprintf(esc, sizeof esc, "\\u%c%c%c%c\\u%c%c%c%c", hex[hi >> 12], hex[hi >> 8 & 15], hex[hi >> 4 & 15],
                     hex[hi & 15], hex[lo >> 12], hex[lo >> 8 & 15], hex[lo >> 4 & 15], hex[lo & 15]);
        } else {
            snprintf(esc, sizeof esc, "\\u%c%c%c%c", hex[cp >> 12 & 15], hex[cp >> 8 & 15], hex[cp >> 4 & 15], hex[cp & 15]);
        }
        sb_puts(b, esc);
    }
    sb_put(b, "\"", 1);
}

int sb_json_double(sbuf *b, double x) {
    if (!isfinite(x)) return 0;
    if (x == 0) { sb_puts(b, signbit(x) ? "-0.0" : "0.0"); return 1; }
    char buf[40];
    int p = 1;
    for (; p <= 17; p++) {
        snprintf(buf, sizeof buf, "%.*e", p - 1, x);
        if (strtod(buf, NULL) == x) break;
    }
    /* buf: [-]d[.ddd]e[+-]XX -> digits and the decimal point's position (Python's 'r' format) */
    char digits[24];
    int nd = 0, neg = buf[0] == '-';
    const char *q = buf + neg;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[nd++] = *q;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = 0;
    int decpt = atoi(q + 1) + 1;
    if (neg) sb_put(b, "-", 1);
    if (decpt > -4 && decpt <= 16) {
        if (decpt <= 0) {
            sb_puts(b, "0.");
            for (int i = 0; i < -decpt; i++) sb_put(b, "0", 1);
            sb_put(b, digits, (size_t)nd);
        } else if (decpt >= nd) {
            sb_put(b, digits, (size_t)nd);
            for (int i = nd; i < decpt; i++) sb_put(b, "0", 1);
            sb_puts(b, ".0");
        } else {
            sb_put(b, digits, (size_t)decpt);
            sb_put(b, ".", 1);
            sb_put(b, digits + decpt, (size_t)(nd - decpt));
        }
    } else {
        sb_put(b, digits, 1);
        if (nd > 1) {
            sb_put(b, ".", 1);
            sb_put(b, digits + 1, (size_t)(nd - 1));
        }
        int e = decpt - 1;
        sb_printf(b, "e%c%02d", e < 0 ? '-' : '+', e < 0 ? -e : e);
    }
    return 1;
}

int json_canonical(sbuf *b, const jval *v) {
    switch (v->t) {
    case J_NULL: sb_puts(b, "null"); return 1;
    case J_BOOL: sb_puts(b, v->b ? "true" : "false"); return 1;
    case J_STR: sb_json_str(b, v->s, v->n); return 1;
    case J_NUM:
        if (is_integer_text(v)) { /* Python reads integers exactly and writes them back ("-0" as 0) */
            sb_puts(b, strcmp(v->s, "-0") ? v->s : "0");
            return 1;
        }
        return sb_json_double(b, strtod(v->s, NULL));
    case J_ARR:
        sb_put(b, "[", 1);
        for (size_t i = 0; i < v->n; i++) {
            if (i) sb_put(b, ",", 1);
            if (!json_canonical(b, v->items[i])) return 0;
        }
        sb_put(b, "]", 1);
        return 1;
    case J_OBJ: {
        jval **pairs = malloc((v->n ? v->n : 1) * 2 * sizeof *pairs); /* (key, value) pairs sorted by key */
        if (!pairs) { b->failed = 1; return 1; }
        for (size_t i = 0; i < v->n; i++) pairs[2 * i] = v->keys[i], pairs[2 * i + 1] = v->items[i];
        qsort(pairs, v->n, 2 * sizeof *pairs, key_cmp);
        sb_put(b, "{", 1);
        int ok = 1;
        for (size_t i = 0; i < v->n && ok; i++) {
            if (i) sb_put(b, ",", 1);
            sb_json_str(b, pairs[2 * i]->s, pairs[2 * i]->n);
            sb_put(b, ":", 1);
            ok = json_canonical(b, pairs[2 * i + 1]);
        }
        sb_put(b, "}", 1);
        free(pairs);
        return ok;
    }
    }
    return 0;
}
