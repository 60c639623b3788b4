/* Saving a version: arrays become objects as they are put (small ones packed by element
 * class, large ones split along their first dimension), then the commit protocol of
 * docs/FORMAT.md: every object durable, the manifest, then the branch record by exclusive
 * create. */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "save.h"

#define DEFAULT_CHUNK_BYTES ((size_t)32 << 20)

fp_save *fp_save_new(fp_repo *r, const char *branch) {
    fp_save *s = calloc(1, sizeof *s);
    if (!s || !(s->branch = strdup(branch)) || !(s->meta = strdup("{}")) || !(s->message = strdup(""))) {
        if (s) free(s->branch), free(s->meta), free(s);
        return NULL;
    }
    s->repo = r;
    s->codec = FP_CODEC_RAW;
    s->chunk_bytes = DEFAULT_CHUNK_BYTES;
    s->world_size = 1;
    s->head_seq = -1;
    return s;
}

void fp_save_abort(fp_save *s) {
    if (!s) return;
    if (s->coll && s->coll_free) s->coll_free(s->coll);
    for (size_t i = 0; i < s->nleaves; i++) free(s->leaves[i].path), free(s->leaves[i].chunks);
    for (int k = 0; k < 5; k++) free(s->packs[k].buf), free(s->packs[k].members);
    for (size_t i = 0; i < s->nmetrics; i++) free(s->metric_names[i]);
    free(s->metric_names);
    free(s->metric_values);
    free(s->leaves);
    free(s->branch);
    free(s->message);
    free(s->meta);
    free(s);
}

/* A live holder of another process refuses the save (docs/FORMAT.md, Branch holders). */
static int holder_blocks(fp_save *s) {
    fp_repo *r = s->repo;
    char dirkey[200], key[260];
    snprintf(dirkey, sizeof dirkey, "holders/%s", s->branch);
    int64_t seq;
    char *p = fp_path(r, dirkey);
    if (!p) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    struct stat sb;
    int present = stat(p, &sb) == 0;
    free(p);
    if (!present) return FP_OK;
    /* the highest seq, by the same listing the refs use */
    if (fp_list_top(r, dirkey, &seq) != FP_OK || seq < 0) return FP_OK;
    snprintf(key, sizeof key, "%s/%016lld.json", dirkey, (long long)seq);
    char *data;
    size_t len;
    if (fp_read_key(r, key, 65536, &data, &len) != FP_OK) return fp_ok(r); /* an unreadable record holds nothing */
    arena a = {0};
    char err[100];
    const jval *rec = json_parse(&a, data, len, err, sizeof err);
    const jval *host = json_get(rec, "host"), *pid = json_get(rec, "pid"), *boot = json_get(rec, "boot"),
               *start = json_get(rec, "start"), *run = json_get(rec, "run");
    int64_t hpid = 0;
    int live = 0;
    if (json_is_str(host) && json_int(pid, &hpid)) {
        if (!strcmp(host->s, r->host)) {
            char here[128], ticks[64];
            fp_boot_id(here, sizeof here);
            int same_boot = !json_is_str(boot) || !boot->s[0] || !here[0] || !strcmp(boot->s, here);
            if (same_boot && hpid != (int64_t)getpid() && hpid > 0 && (kill((pid_t)hpid, 0) == 0 || errno == EPERM)) {
                fp_start_ticks((long)hpid, ticks, sizeof ticks);
                live = !json_is_str(start) || !start->s[0] || !ticks[0] || !strcmp(start->s, ticks);
            }
        } else {
            char *kp = fp_path(r, key);
            live = kp && stat(kp, &sb) == 0 && fp_now() - (double)sb.st_mtime < FP_HOLD_EXPIRY;
            free(kp);
        }
    }
    int st = live ? fp_fail(r, FP_ERR_CONFLICT, "branch '%s' is held by run '%s' (host %s, pid %lld): a running "
                            "Checkpointer owns it; save on another branch, or stop that run first", s->branch,
                            json_is_str(run) ? run->s : "?", host->s, (long long)hpid)
                  : fp_ok(r);
    arena_free(&a);
    free(data);
    return st;
}

int fp_save_check_branch(fp_save *s) {
    int st = holder_blocks(s);
    if (!st) st = fp_ref_read(s->repo, "heads", s->branch, s->head, &s->head_seq);
    if (!st && !s->head[0]) {
        /* a new branch named like a tag would shadow it: the name reads as the branch first */
        char tag[FP_ID_LEN + 1];
        int64_t seq;
        if (!(st = fp_ref_read(s->repo, "tags", s->branch, tag, &seq)) && tag[0])
            st = fp_fail(s->repo, FP_ERR_ARG, "'%s' is a tag (at %.12s): a branch of that name would shadow it, "
                         "and reading the name would give the branch instead of the tag. Use another branch "
                         "name, or delete the tag first", s->branch, tag);
    }
    return st;
}

int fp_save_begin(fp_repo *r, const char *branch, fp_save **out) {
    if (!r) return FP_ERR_ARG;
    if (!out) return fp_fail(r, FP_ERR_ARG, "fp_save_begin: no place for the save");
    *out = NULL;
    int st = fp_check_name(r, branch, "branch");
    if (st) return st;
    fp_save *s = fp_save_new(r, branch);
    if (!s) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    if ((st = fp_save_check_branch(s))) {
        fp_save_abort(s);
        return st;
    }
    *out = s;
    return fp_ok(r);
}

int fp_save_set_step(fp_save *s, int64_t step) {
    if (!s) return FP_ERR_ARG;
    s->has_step = 1, s->step = step;
    return FP_OK;
}

int fp_save_set_message(fp_save *s, const char *message) {
    if (!s) return FP_ERR_ARG;
    char *m = strdup(message ? message : "");
    if (!m) return fp_fail(s->repo, FP_ERR_NOMEM, "out of memory");
    free(s->message);
    s->message = m;
    return FP_OK;
}

int fp_save_set_metric(fp_save *s, const char *name, double value) {
    if (!s) return FP_ERR_ARG;
    if (!name || !*name || strlen(name) > FP_MAX_NAME) return fp_fail(s->repo, FP_ERR_ARG, "a metric needs a name");
    if (value != value || value - value != 0)
        return fp_fail(s->repo, FP_ERR_ARG, "metric '%s' is not finite (%g): store finite values (JSON has no NaN)", name, value);
    for (size_t i = 0; i < s->nmetrics; i++)
        if (!strcmp(s->metric_names[i], name)) {
            s->metric_values[i] = value;
            return FP_OK;
        }
    char **names = realloc(s->metric_names, (s->nmetrics + 1) * sizeof *names);
    if (names) s->metric_names = names;
    double *values = realloc(s->metric_values, (s->nmetrics + 1) * sizeof *values);
    if (values) s->metric_values = values;
    char *copy = strdup(name);
    if (!names || !values || !copy) {
        free(copy);
        return fp_fail(s->repo, FP_ERR_NOMEM, "out of memory");
    }
    s->metric_names[s->nmetrics] = copy;
    s->metric_values[s->nmetrics++] = value;
    return FP_OK;
}

int fp_save_set_meta(fp_save *s, const char *json) {
    if (!s) return FP_ERR_ARG;
    arena a = {0};
    char err[200];
    const jval *v = json ? json_parse(&a, json, strlen(json), err, sizeof err) : NULL;
    if (!v || v->t != J_OBJ) {
        arena_free(&a);
        return fp_fail(s->repo, FP_ERR_ARG, "meta must be the text of a JSON object (%s)", json ? (v ? "not an object" : err) : "none given");
    }
    sbuf b = {0};
    int finite = json_canonical(&b, v);
    arena_free(&a);
    if (!finite || b.failed) {
        sb_free(&b);
        return fp_fail(s->repo, finite ? FP_ERR_NOMEM : FP_ERR_ARG, "meta holds a number JSON cannot carry exactly");
    }
    free(s->meta);
    s->meta = b.p;
    return FP_OK;
}

int fp_save_set_codec(fp_save *s, fp_codec codec) {
    if (!s) return FP_ERR_ARG;
    if (codec != FP_CODEC_RAW && codec != FP_CODEC_ZSTD) return fp_fail(s->repo, FP_ERR_ARG, "unknown codec %d", (int)codec);
    s->codec = codec;
    return FP_OK;
}

int fp_save_set_chunk_bytes(fp_save *s, size_t bytes) {
    if (!s) return FP_ERR_ARG;
    if (bytes < 4096 || bytes > ((size_t)1 << 31)) return fp_fail(s->repo, FP_ERR_ARG, "chunk bytes must lie in [4 KiB, 2 GiB]");
    s->chunk_bytes = bytes;
    return FP_OK;
}

static int is_float(fp_dtype d) {
    return d == FP_FLOAT16 || d == FP_BFLOAT16 || d == FP_FLOAT32 || d == FP_FLOAT64 || d == FP_COMPLEX64 || d == FP_COMPLEX128;
}

static fp_schunk *add_chunk(fp_save *s, fp_sleaf *L) {
    if (L->nchunks == L->cap) {
        size_t cap = L->cap ? 2 * L->cap : 4;
        fp_schunk *c = realloc(L->chunks, cap * sizeof *c);
        if (!c) return NULL;
        L->chunks = c, L->cap = cap;
    }
    fp_schunk *c = &L->chunks[L->nchunks++];
    memset(c, 0, sizeof *c);
    (void)s;
    return c;
}

static fp_sleaf *leaf_for(fp_save *s, const char *path, fp_dtype dtype, int ndim, const int64_t *shape, int *st) {
    fp_repo *r = s->repo;
    for (size_t i = 0; i < s->nleaves; i++) {
        fp_sleaf *L = &s->leaves[i];
        if (strcmp(L->path, path)) continue;
        if (L->dtype != dtype || L->ndim != ndim || memcmp(L->shape, shape, (size_t)ndim * sizeof *shape)) {
            *st = fp_fail(r, FP_ERR_ARG, "'%s' was put as another dtype or global shape before in this save", path);
            return NULL;
        }
        return L;
    }
    if (s->nleaves == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 16;
        fp_sleaf *nl = realloc(s->leaves, cap * sizeof *nl);
        if (!nl) { *st = fp_fail(r, FP_ERR_NOMEM, "out of memory"); return NULL; }
        s->leaves = nl, s->cap = cap;
    }
    fp_sleaf *L = &s->leaves[s->nleaves];
    memset(L, 0, sizeof *L);
    if (!(L->path = strdup(path))) { *st = fp_fail(r, FP_ERR_NOMEM, "out of memory"); return NULL; }
    L->dtype = dtype, L->itemsize = fp_dtype_size(dtype), L->ndim = ndim;
    memcpy(L->shape, shape, (size_t)ndim * sizeof *shape);
    s->nleaves++;
    return L;
}

static int flush_pack(fp_save *s, fp_pack *p) {
    if (!p->nmembers) return FP_OK;
    char name[65];
    uint64_t stored;
    const char *codec;
    int st = fp_object_write(s->repo, p->buf, p->n, s->codec, name, &stored, &codec);
    if (st) return st;
    s->stored += stored;
    for (size_t m = 0; m < p->nmembers; m++) {
        fp_schunk *c = &s->leaves[p->members[2 * m]].chunks[p->members[2 * m + 1]];
        memcpy(c->object, name, 65);
        c->codec = codec;
    }
    p->n = 0, p->nmembers = 0;
    return FP_OK;
}

int fp_save_flush(fp_save *s) {
    for (int k = 0; k < 5; k++) {
        int st = flush_pack(s, &s->packs[k]);
        if (st) return st;
    }
    return FP_OK;
}

static int pack_put(fp_save *s, size_t leaf, size_t chunk, const void *data, size_t n, fp_dtype dtype) {
    size_t w = fp_dtype_size(dtype);
    int k = !is_float(dtype) ? 0 : w == 2 ? 1 : w == 4 ? 2 : w == 8 ? 3 : 4;
    fp_pack *p = &s->packs[k];
    int st;
    if (p->n + n > FP_PACK_BYTES && (st = flush_pack(s, p))) return st;
    if (p->cap - p->n < n) {
        size_t cap = p->cap ? p->cap : (1u << 16);
        while (cap - p->n < n) cap *= 2;
        uint8_t *nb = realloc(p->buf, cap);
        if (!nb) return fp_fail(s->repo, FP_ERR_NOMEM, "out of memory");
        p->buf = nb, p->cap = cap;
    }
    if (p->nmembers == p->mcap) {
        size_t cap = p->mcap ? 2 * p->mcap : 64;
        size_t *nm = realloc(p->members, 2 * cap * sizeof *nm);
        if (!nm) return fp_fail(s->repo, FP_ERR_NOMEM, "out of memory");
        p->members = nm, p->mcap = cap;
    }
    fp_schunk *c = &s->leaves[leaf].chunks[chunk];
    c->start = p->n;
    memcpy(p->buf + p->n, data, n);
    p->n += n;
    p->members[2 * p->nmembers] = leaf, p->members[2 * p->nmembers + 1] = chunk;
    p->nmembers++;
    return FP_OK;
}

static int check_path(fp_repo *r, const char *path) {
    size_t n = path ? strlen(path) : 0;
    if (!n || n > FP_MAX_NAME || path[0] == '/' || path[n - 1] == '/' || strstr(path, "//"))
        return fp_fail(r, FP_ERR_ARG, "invalid leaf path '%.200s': give keys joined by '/', none empty", path ? path : "(null)");
    for (const char *p = path; *p; p++)
        if (*p == '~' && p[1] != '0' && p[1] != '1')
            return fp_fail(r, FP_ERR_ARG, "invalid leaf path '%.200s': '~' is written '~0' (and '/' inside a key '~1')", path);
    return FP_OK;
}

static int put_block(fp_save *s, const char *path, fp_dtype dtype, int ndim, const int64_t *global_shape,
                     const int64_t *offset, const int64_t *block_shape, const void *data) {
    fp_repo *r = s->repo;
    int st = check_path(r, path);
    if (st) return st;
    if ((int)dtype < 0 || dtype >= FP_DTYPE_OTHER) return fp_fail(r, FP_ERR_ARG, "'%s': unknown dtype %d", path, (int)dtype);
    if (ndim < 0 || ndim > FP_MAX_DIMS || (ndim && (!global_shape || !offset || !block_shape)))
        return fp_fail(r, FP_ERR_ARG, "'%s': ndim %d is not in [0, 64], or a shape is missing", path, ndim);
    size_t w = fp_dtype_size(dtype);
    uint64_t elems = 1, total = 1;
    int whole = 1;
    for (int d = 0; d < ndim; d++) {
        if (global_shape[d] < 0 || offset[d] < 0 || block_shape[d] < 0 || offset[d] + block_shape[d] > global_shape[d])
            return fp_fail(r, FP_ERR_ARG, "'%s': the block [%lld, %lld) of dimension %d does not fit the global size %lld",
                           path, (long long)offset[d], (long long)(offset[d] + block_shape[d]), d, (long long)global_shape[d]);
        if (block_shape[d] && elems > ((uint64_t)1 << 50) / (uint64_t)block_shape[d]) elems = (uint64_t)1 << 51;
        else elems *= (uint64_t)block_shape[d];
        total = global_shape[d] && total <= ((uint64_t)1 << 50) / (uint64_t)global_shape[d] ? total * (uint64_t)global_shape[d] : (global_shape[d] ? (uint64_t)1 << 51 : 0);
        whole &= offset[d] == 0 && block_shape[d] == global_shape[d];
    }
    if (total * w > ((uint64_t)1 << 50)) return fp_fail(r, FP_ERR_ARG, "'%s' is larger than 2^50 bytes", path);
    if (elems && !data) return fp_fail(r, FP_ERR_ARG, "'%s': no data pointer", path);
    if (whole && s->skip_whole) return FP_OK;
    fp_sleaf *L = leaf_for(s, path, dtype, ndim, global_shape, &st);
    if (!L) return st;
    if (!elems) return fp_ok(r); /* an empty box adds nothing (an empty leaf has no chunks) */
    uint64_t nbytes = elems * w;
    size_t leaf = (size_t)(L - s->leaves);
    if (whole && nbytes < FP_PACK_LEAF_MAX) {
        fp_schunk *c = add_chunk(s, L);
        if (!c) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
        memcpy(c->off, offset, (size_t)ndim * sizeof *offset);
        memcpy(c->len, block_shape, (size_t)ndim * sizeof *offset);
        c->size = nbytes;
        fp_content_hash(data, (size_t)nbytes, c->hash);
        return pack_put(s, leaf, L->nchunks - 1, data, (size_t)nbytes, dtype);
    }
    /* chunks along the first dimension of the block, each an object of its own */
    uint64_t rows = ndim ? (uint64_t)block_shape[0] : 1, row_bytes = nbytes / rows;
    uint64_t per = s->chunk_bytes / row_bytes ? s->chunk_bytes / row_bytes : 1;
    const uint8_t *bytes = data;
    for (uint64_t at = 0; at < rows; at += per) {
        uint64_t n = rows - at < per ? rows - at : per;
        fp_schunk *c = add_chunk(s, L);
        if (!c) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
        memcpy(c->off, offset, (size_t)ndim * sizeof *offset);
        memcpy(c->len, block_shape, (size_t)ndim * sizeof *offset);
        if (ndim) c->off[0] += (int64_t)at, c->len[0] = (int64_t)n;
        c->size = n * row_bytes;
        uint64_t stored;
        if ((st = fp_object_write(r, bytes + at * row_bytes, (size_t)c->size, s->codec, c->hash, &stored, &c->codec))) {
            L->nchunks--;
            return st;
        }
        memcpy(c->object, c->hash, 65);
        s->stored += stored;
    }
    return fp_ok(r);
}

int fp_save_put_block(fp_save *s, const char *path, fp_dtype dtype, int ndim, const int64_t *global_shape,
                      const int64_t *offset, const int64_t *block_shape, const void *data) {
    if (!s) return FP_ERR_ARG;
    int st = put_block(s, path, dtype, ndim, global_shape, offset, block_shape, data);
    if (st && s->coll && !s->failed) { /* a collective commit must fail on every rank */
        s->failed = st;
        snprintf(s->failed_msg, sizeof s->failed_msg, "%s", fp_errmsg(s->repo));
    }
    return st;
}

int fp_save_put(fp_save *s, const char *path, fp_dtype dtype, int ndim, const int64_t *shape, const void *data) {
    int64_t zeros[FP_MAX_DIMS] = {0};
    if (s && ndim > 0 && !shape) return fp_fail(s->repo, FP_ERR_ARG, "'%s': no shape", path ? path : "(null)");
    return fp_save_put_block(s, path, dtype, ndim, shape, zeros, shape, data);
}

/* ---- the manifest ---- */
typedef struct tnode {
    char *key;
    long leaf; /* -1: a dict */
    struct tnode **kids;
    size_t n, cap;
} tnode;

static void tree_free(tnode *t) {
    if (!t) return;
    for (size_t i = 0; i < t->n; i++) tree_free(t->kids[i]);
    free(t->kids);
    free(t->key);
    free(t);
}

static tnode *tree_child(tnode *t, const char *key, size_t klen, int create) {
    for (size_t i = 0; i < t->n; i++)
        if (strlen(t->kids[i]->key) == klen && !memcmp(t->kids[i]->key, key, klen)) return t->kids[i];
    if (!create) return NULL;
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 4;
        tnode **k = realloc(t->kids, cap * sizeof *k);
        if (!k) return NULL;
        t->kids = k, t->cap = cap;
    }
    tnode *c = calloc(1, sizeof *c);
    if (!c || !(c->key = strndup(key, klen))) {
        free(c);
        return NULL;
    }
    c->leaf = -1;
    t->kids[t->n++] = c;
    return c;
}

/* Unescape one path segment ("~1" is '/', "~0" is '~') into `out`. */
static size_t unescape(const char *seg, size_t n, char *out) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (seg[i] == '~' && i + 1 < n && (seg[i + 1] == '0' || seg[i + 1] == '1')) {
            out[o++] = seg[i + 1] == '1' ? '/' : '~';
            i++;
        } else {
            out[o++] = seg[i];
        }
    }
    return o;
}

static int build_tree(fp_save *s, tnode **out) {
    tnode *root = calloc(1, sizeof *root);
    char *key = malloc(FP_MAX_NAME + 1);
    if (!root || !key) {
        free(root);
        free(key);
        return fp_fail(s->repo, FP_ERR_NOMEM, "out of memory");
    }
    root->leaf = -1;
    int st = FP_OK;
    for (size_t i = 0; i < s->nleaves && !st; i++) {
        const char *p = s->leaves[i].path;
        tnode *t = root;
        while (!st) {
            const char *slash = strchr(p, '/');
            size_t n = slash ? (size_t)(slash - p) : strlen(p);
            size_t kn = unescape(p, n, key);
            tnode *c = tree_child(t, key, kn, 1);
            if (!c) st = fp_fail(s->repo, FP_ERR_NOMEM, "out of memory");
            else if ((slash && c->leaf >= 0) || (!slash && (c->leaf >= 0 || c->n)))
                st = fp_fail(s->repo, FP_ERR_ARG, "leaf path '%s' collides with another leaf's path (one is inside the other)",
                             s->leaves[i].path);
            else if (!slash) c->leaf = (long)i;
            if (!slash || st) break;
            t = c;
            p = slash + 1;
        }
    }
    free(key);
    if (st) tree_free(root);
    else *out = root;
    return st;
}

static void tree_json(sbuf *b, const tnode *t) {
    if (t->leaf >= 0) {
        sb_printf(b, "{\"i\":%ld,\"t\":\"leaf\"}", t->leaf);
        return;
    }
    sb_puts(b, "{\"k\":[");
    for (size_t i = 0; i < t->n; i++) {
        if (i) sb_put(b, ",", 1);
        sb_json_str(b, t->kids[i]->key, strlen(t->kids[i]->key));
    }
    sb_puts(b, "],\"t\":\"dict\",\"v\":[");
    for (size_t i = 0; i < t->n; i++) {
        if (i) sb_put(b, ",", 1);
        tree_json(b, t->kids[i]);
    }
    sb_puts(b, "]}");
}

static void ints_json(sbuf *b, const int64_t *v, int n) {
    sb_put(b, "[", 1);
    for (int i = 0; i < n; i++) sb_printf(b, i ? ",%lld" : "%lld", (long long)v[i]);
    sb_put(b, "]", 1);
}

static void leaf_json(sbuf *b, const fp_sleaf *L) {
    sb_puts(b, "{\"chunks\":[");
    for (size_t i = 0; i < L->nchunks; i++) {
        const fp_schunk *c = &L->chunks[i];
        if (i) sb_put(b, ",", 1);
        sb_printf(b, "{\"codec\":\"%s\",\"hash\":\"%s\",\"lengths\":", c->codec ? c->codec : "raw", c->hash);
        ints_json(b, c->len, L->ndim);
        sb_printf(b, ",\"object\":\"%s\",\"offsets\":", c->object);
        ints_json(b, c->off, L->ndim);
        sb_printf(b, ",\"size\":%llu,\"start\":%llu}", (unsigned long long)c->size, (unsigned long long)c->start);
    }
    uint64_t nbytes = L->itemsize;
    for (int d = 0; d < L->ndim; d++) nbytes *= (uint64_t)L->shape[d];
    sb_printf(b, "],\"device\":\"cpu\",\"dtype\":\"%s\",\"kind\":\"numpy\",\"nbytes\":%llu,\"path\":", fp_dtype_name(L->dtype),
              (unsigned long long)nbytes);
    sb_json_str(b, L->path, strlen(L->path));
    sb_puts(b, ",\"shape\":");
    ints_json(b, L->shape, L->ndim);
    sb_puts(b, "}");
}

int fp_save_finish(fp_save *s, char *id_out) {
    fp_repo *r = s->repo;
    int st;
    uint64_t logical = 0;
    for (size_t i = 0; i < s->nleaves; i++) { /* blocks must tile each global array */
        fp_sleaf *L = &s->leaves[i];
        fp_chunk *views = malloc((L->nchunks + 1) * sizeof *views);
        if (!views) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
        for (size_t k = 0; k < L->nchunks; k++) views[k].off = L->chunks[k].off, views[k].len = L->chunks[k].len;
        int ok = fp_boxes_tile(L->shape, L->ndim, views, L->nchunks);
        free(views);
        if (!ok)
            return fp_fail(r, FP_ERR_ARG, "the blocks put under '%s' do not cover its global shape exactly once (a gap or "
                           "an overlap): nothing was committed", L->path);
        uint64_t n = L->itemsize;
        for (int d = 0; d < L->ndim; d++) n *= (uint64_t)L->shape[d];
        logical += n;
    }
    tnode *tree = NULL;
    if ((st = build_tree(s, &tree))) return st;
    char head_now[FP_ID_LEN + 1];
    int64_t seq;
    if ((st = fp_ref_read(r, "heads", s->branch, head_now, &seq))) {
        tree_free(tree);
        return st;
    }
    if (strcmp(head_now, s->head) || seq != s->head_seq) {
        tree_free(tree);
        return fp_fail(r, FP_ERR_CONFLICT, "branch '%s' moved since this save began (its head is now %s): nothing was "
                       "committed; begin the save again to build on the new head", s->branch, head_now[0] ? head_now : "deleted");
    }
    /* the canonical manifest (sorted keys), split where the id goes */
    sbuf h = {0}, t = {0};
    sb_puts(&h, "{\"branch\":");
    sb_json_str(&h, s->branch, strlen(s->branch));
    sb_puts(&h, ",\"env\":{\"hostname\":");
    sb_json_str(&h, r->host, strlen(r->host));
    sb_printf(&h, ",\"libforkpoint\":\"%s\",\"pid\":%ld,\"world_size\":%d},\"format\":\"forkpoint.version\","
              "\"format_version\":[%d,%d],\"id\":\"", FP_LIB_VERSION, (long)getpid(), s->world_size, FP_FORMAT_MAJOR,
              FP_FORMAT_MINOR);
    sb_puts(&t, "\",\"leaves\":[");
    for (size_t i = 0; i < s->nleaves; i++) {
        if (i) sb_put(&t, ",", 1);
        leaf_json(&t, &s->leaves[i]);
    }
    sb_printf(&t, "],\"logical_bytes\":%llu,\"message\":", (unsigned long long)logical);
    sb_json_str(&t, s->message, strlen(s->message));
    sb_printf(&t, ",\"meta\":%s,\"metrics\":{", s->meta);
    size_t *order = malloc((s->nmetrics + 1) * sizeof *order);
    for (size_t i = 0; order && i < s->nmetrics; i++) order[i] = i;
    for (size_t i = 1; order && i < s->nmetrics; i++)
        for (size_t j = i; j > 0 && strcmp(s->metric_names[order[j - 1]], s->metric_names[order[j]]) > 0; j--) {
            size_t x = order[j];
            order[j] = order[j - 1], order[j - 1] = x;
        }
    for (size_t i = 0; order && i < s->nmetrics; i++) {
        if (i) sb_put(&t, ",", 1);
        sb_json_str(&t, s->metric_names[order[i]], strlen(s->metric_names[order[i]]));
        sb_put(&t, ":", 1);
        sb_json_double(&t, s->metric_values[order[i]]);
    }
    free(order);
    sb_puts(&t, "},\"parents\":[");
    if (s->head[0]) sb_printf(&t, "\"%s\"", s->head);
    sb_puts(&t, "],\"pickle\":false,\"pruned\":false,\"step\":");
    if (s->has_step) sb_printf(&t, "%lld", (long long)s->step);
    else sb_puts(&t, "null");
    sb_printf(&t, ",\"stored_bytes\":%llu,\"tiers\":[],\"time\":", (unsigned long long)s->stored);
    sb_json_double(&t, fp_now());
    sb_puts(&t, ",\"tree\":");
    tree_json(&t, tree);
    sb_puts(&t, "}");
    tree_free(tree);
    if (h.failed || t.failed || !order) {
        sb_free(&h);
        sb_free(&t);
        return fp_fail(r, FP_ERR_NOMEM, "out of memory building the manifest");
    }
    fp_blake3_hasher hs;
    uint8_t digest[32];
    char hex[65], id[FP_ID_LEN + 1], key[64];
    fp_blake3_init(&hs);
    fp_blake3_update(&hs, h.p, h.n);
    fp_blake3_update(&hs, t.p, t.n);
    fp_blake3_final(&hs, digest);
    fp_hex(digest, 32, hex);
    memcpy(id, hex, FP_ID_LEN);
    id[FP_ID_LEN] = 0;
    sb_puts(&h, id);
    snprintf(key, sizeof key, "versions/%s.json", id);
    st = fp_hold_lease(r);
    /* every object is durable (each was fsynced with its directory): the manifest, then the ref */
    if (!st) st = fp_write_key(r, key, h.p, h.n, t.p, t.n, 0);
    sb_free(&h);
    sb_free(&t);
    if (st) return st;
    st = fp_ref_publish(r, "heads", s->branch, s->head_seq + 1, id);
    if (st == FP_ERR_CONFLICT)
        return fp_fail(r, FP_ERR_CONFLICT, "branch '%s' moved while version %s was committed: it is complete but not on the "
                       "branch (fork it with `forkpoint branch NAME %s`, or save again)", s->branch, id, id);
    if (st) return st;
    if (id_out) memcpy(id_out, id, FP_ID_LEN + 1);
    return fp_ok(r);
}

int fp_save_commit(fp_save *s, char *id) {
    if (!s) return FP_ERR_ARG;
    if (s->coll) return fp_fail(s->repo, FP_ERR_ARG, "a collective save (fp_mpi_save_begin) is committed by every rank "
                                "calling fp_mpi_save_commit");
    int st = fp_save_flush(s);
    if (!st) st = fp_save_finish(s, id);
    fp_save_abort(s);
    return st;
}

/* ---- what one rank tells the committing rank ---- */
int fp_save_describe(fp_save *s, sbuf *b) {
    sb_printf(b, "{\"stored\":%llu,\"leaves\":[", (unsigned long long)s->stored);
    for (size_t i = 0; i < s->nleaves; i++) {
        const fp_sleaf *L = &s->leaves[i];
        if (i) sb_put(b, ",", 1);
        sb_printf(b, "{\"dtype\":%d,\"path\":", (int)L->dtype);
        sb_json_str(b, L->path, strlen(L->path));
        sb_puts(b, ",\"shape\":");
        ints_json(b, L->shape, L->ndim);
        sb_puts(b, ",\"chunks\":[");
        for (size_t k = 0; k < L->nchunks; k++) {
            const fp_schunk *c = &L->chunks[k];
            if (k) sb_put(b, ",", 1);
            sb_printf(b, "[\"%s\",\"%s\",\"%s\",%llu,%llu,", c->hash, c->object, c->codec ? c->codec : "raw",
                      (unsigned long long)c->start, (unsigned long long)c->size);
            ints_json(b, c->off, L->ndim);
            sb_put(b, ",", 1);
            ints_json(b, c->len, L->ndim);
            sb_put(b, "]", 1);
        }
        sb_puts(b, "]}");
    }
    sb_puts(b, "]}");
    return b->failed ? fp_fail(s->repo, FP_ERR_NOMEM, "out of memory") : FP_OK;
}

int fp_save_absorb(fp_save *s, const char *json, size_t len) {
    fp_repo *r = s->repo;
    arena a = {0};
    char err[200];
    const jval *rec = json_parse(&a, json, len, err, sizeof err), *leaves = json_get(rec, "leaves");
    int64_t stored = 0;
    int st = FP_OK;
    if (!leaves || leaves->t != J_ARR || !json_int(json_get(rec, "stored"), &stored))
        st = fp_fail(r, FP_ERR_FORMAT, "a rank's description of its save does not parse (%s)", err);
    else
        s->stored += (uint64_t)stored;
    for (size_t i = 0; !st && i < leaves->n; i++) {
        const jval *Lj = leaves->items[i], *path = json_get(Lj, "path"), *shape = json_get(Lj, "shape"),
                   *chunks = json_get(Lj, "chunks");
        int64_t dtype, gs[FP_MAX_DIMS];
        if (!json_is_str(path) || !json_int(json_get(Lj, "dtype"), &dtype) || !shape || shape->t != J_ARR ||
            shape->n > FP_MAX_DIMS || !chunks || chunks->t != J_ARR) {
            st = fp_fail(r, FP_ERR_FORMAT, "a rank's description of its save is malformed");
            break;
        }
        int ndim = (int)shape->n;
        for (int d = 0; d < ndim; d++) json_int(shape->items[d], &gs[d]);
        fp_sleaf *L = leaf_for(s, path->s, (fp_dtype)dtype, ndim, gs, &st);
        for (size_t k = 0; L && !st && k < chunks->n; k++) {
            const jval *c = chunks->items[k];
            fp_schunk *out = add_chunk(s, L);
            if (!out || c->t != J_ARR || c->n != 7) { st = fp_fail(r, FP_ERR_FORMAT, "a rank's chunk is malformed"); break; }
            snprintf(out->hash, 65, "%s", c->items[0]->s ? c->items[0]->s : "");
            snprintf(out->object, 65, "%s", c->items[1]->s ? c->items[1]->s : "");
            out->codec = c->items[2]->s && !strcmp(c->items[2]->s, "zstd") ? "zstd" : "raw";
            int64_t start, size;
            json_int(c->items[3], &start), json_int(c->items[4], &size);
            out->start = (uint64_t)start, out->size = (uint64_t)size;
            for (int d = 0; d < ndim && c->items[5]->n == (size_t)ndim && c->items[6]->n == (size_t)ndim; d++)
                json_int(c->items[5]->items[d], &out->off[d]), json_int(c->items[6]->items[d], &out->len[d]);
        }
    }
    arena_free(&a);
    return st;
}
