/* Version manifests as untrusted input (docs/FORMAT.md, Validation rules and limits), and
 * reading leaves and boxes of leaves into a caller's buffer, every byte verified. */
#define _GNU_SOURCE
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define MAX_TREE_DEPTH 200

static int bad(fp_version *v, const char *fmt, const char *a, const char *b) {
    char what[600];
    snprintf(what, sizeof what, fmt, a ? a : "", b ? b : "");
    return fp_fail(v->repo, FP_ERR_FORMAT, "manifest versions/%s.json: %s; the version cannot be trusted "
                   "(`forkpoint verify` checks the repository)", v->id, what);
}

static int int_of(const jval *x, int64_t *out) { return json_int(x, out); }

/* The hash (hex) of record `rec` in canonical JSON with its field `field` set to "": how a
 * manifest's id and a stub's stub_hash are computed. 0 when it cannot be encoded. */
static int hash_with_emptied(const jval *rec, const char *field, char hex[65]) {
    jval empty = {.t = J_STR, .s = "", .n = 0}, copy = *rec;
    jval **items = malloc((rec->n ? rec->n : 1) * sizeof *items);
    if (!items) return 0;
    size_t flen = strlen(field);
    for (size_t i = 0; i < rec->n; i++)
        items[i] = rec->keys[i]->n == flen && !memcmp(rec->keys[i]->s, field, flen) ? &empty : rec->items[i];
    copy.items = items;
    sbuf b = {0};
    int ok = json_canonical(&b, &copy) && !b.failed;
    free(items);
    if (ok) {
        uint8_t out[32];
        fp_blake3(b.p, b.n, out);
        fp_hex(out, 32, hex);
    }
    sb_free(&b);
    return ok;
}

static int id_matches(fp_version *v, const char *data, size_t len, const jval *rec) {
    char marker[64];
    snprintf(marker, sizeof marker, "\"id\":\"%s\"", v->id);
    const char *at = memmem(data, len, marker, strlen(marker));
    uint8_t out[32];
    char hex[65];
    if (at) { /* canonical bytes: hash them as they are, the id's value left out */
        fp_blake3_hasher h;
        fp_blake3_init(&h);
        fp_blake3_update(&h, data, (size_t)(at - data) + 6);
        fp_blake3_update(&h, at + strlen(marker) - 1, len - (size_t)(at - data) - strlen(marker) + 1);
        fp_blake3_final(&h, out);
        fp_hex(out, 32, hex);
        if (!strncmp(hex, v->id, FP_ID_LEN)) return 1;
    }
    /* another layout: re-encode canonically with an empty id */
    return hash_with_emptied(rec, "id", hex) && !strncmp(hex, v->id, FP_ID_LEN);
}

static int stub_matches(const jval *rec) {
    const jval *sh = json_get(rec, "stub_hash");
    if (!sh) return 1; /* stubs written before format 1.3 carry none */
    char hex[65];
    return json_is_str(sh) && fp_is_hex(sh->s, 64) && hash_with_emptied(rec, "stub_hash", hex) && !strcmp(hex, sh->s);
}

static int check_tree(fp_version *v, const jval *node, int depth, size_t nleaves) {
    if (depth > MAX_TREE_DEPTH) return bad(v, "its tree is nested deeper than 200 containers%s%s", NULL, NULL);
    const jval *t = json_get(node, "t"), *val = json_get(node, "v");
    if (!json_is_str(t)) return bad(v, "a tree node has no type tag%s%s", NULL, NULL);
    const char *s = t->s;
    if (!strcmp(s, "dict") || !strcmp(s, "odict")) {
        const jval *k = json_get(node, "k");
        if (!k || k->t != J_ARR || !val || val->t != J_ARR || k->n != val->n)
            return bad(v, "a %s node's keys and values do not pair up%s", s, NULL);
        for (size_t i = 0; i < k->n; i++) {
            int64_t dummy;
            if (!json_is_str(k->items[i]) && !int_of(k->items[i], &dummy) && k->items[i]->t != J_NUM)
                return bad(v, "a dict key is neither a string nor an integer%s%s", NULL, NULL);
            int st = check_tree(v, val->items[i], depth + 1, nleaves);
            if (st) return st;
        }
        return FP_OK;
    }
    if (!strcmp(s, "list") || !strcmp(s, "tuple") || !strcmp(s, "ranks")) {
        if (!val || val->t != J_ARR) return bad(v, "a %s node holds no list of children%s", s, NULL);
        for (size_t i = 0; i < val->n; i++) {
            int st = check_tree(v, val->items[i], depth + 1, nleaves);
            if (st) return st;
        }
        return FP_OK;
    }
    if (!strcmp(s, "leaf")) {
        int64_t i;
        if (!int_of(json_get(node, "i"), &i) || i < 0 || (uint64_t)i >= nleaves)
            return bad(v, "a leaf node's index lies outside the leaf table%s%s", NULL, NULL);
        return FP_OK;
    }
    if (!strcmp(s, "none")) return FP_OK;
    if (!strcmp(s, "bool")) return val && val->t == J_BOOL ? FP_OK : bad(v, "a bool node holds no boolean%s%s", NULL, NULL);
    if (!strcmp(s, "int")) return val && val->t == J_NUM && !strpbrk(val->s, ".eE") ? FP_OK
                                                                                  : bad(v, "an int node holds no integer%s%s", NULL, NULL);
    if (!strcmp(s, "float") || !strcmp(s, "str") || !strcmp(s, "bytes") || !strcmp(s, "torch.dtype") ||
        !strcmp(s, "torch.device"))
        return json_is_str(val) ? FP_OK : bad(v, "a %s node holds no string%s", s, NULL);
    if (!strcmp(s, "complex"))
        return val && val->t == J_ARR && val->n == 2 && json_is_str(val->items[0]) && json_is_str(val->items[1])
                   ? FP_OK : bad(v, "a complex node holds no [real, imag] pair%s%s", NULL, NULL);
    return bad(v, "a tree node has the unknown type '%.60s'%s", s, NULL);
}

static int boxes_overlap(const fp_chunk *a, const fp_chunk *b, int ndim) {
    for (int d = 0; d < ndim; d++)
        if (a->off[d] + a->len[d] <= b->off[d] || b->off[d] + b->len[d] <= a->off[d]) return 0;
    return 1;
}

static int cmp_first_offset(const void *x, const void *y) {
    const fp_chunk *a = *(const fp_chunk *const *)x, *b = *(const fp_chunk *const *)y;
    return (a->off[0] > b->off[0]) - (a->off[0] < b->off[0]);
}

int fp_boxes_tile(const int64_t *shape, int ndim, const fp_chunk *chunks, size_t n) {
    uint64_t total = 1, sum = 0;
    for (int d = 0; d < ndim; d++) total *= (uint64_t)shape[d];
    if (total == 0) return n == 0;
    for (size_t i = 0; i < n; i++) {
        uint64_t vol = 1;
        for (int d = 0; d < ndim; d++) {
            if (chunks[i].len[d] < 1 || chunks[i].off[d] < 0 || chunks[i].off[d] + chunks[i].len[d] > shape[d]) return 0;
            vol *= (uint64_t)chunks[i].len[d];
        }
        sum += vol;
        if (sum > total) return 0;
    }
    if (sum != total) return 0;
    if (n <= 2048) { /* equal volumes and no overlap: an exact tiling */
        for (size_t i = 0; i < n; i++)
            for (size_t j = i + 1; j < n; j++)
                if (boxes_overlap(&chunks[i], &chunks[j], ndim)) return 0;
        return 1;
    }
    /* many chunks: accepted as slabs along the first dimension, each spanning the others */
    const fp_chunk **sorted = malloc(n * sizeof *sorted);
    if (!sorted) return 0;
    int ok = ndim >= 1;
    for (size_t i = 0; i < n && ok; i++) {
        sorted[i] = &chunks[i];
        for (int d = 1; d < ndim && ok; d++) ok = chunks[i].off[d] == 0 && chunks[i].len[d] == shape[d];
    }
    if (ok) qsort(sorted, n, sizeof *sorted, cmp_first_offset);
    for (size_t i = 0; ok && i < n; i++) ok = sorted[i]->off[0] == (i ? sorted[i - 1]->off[0] + sorted[i - 1]->len[0] : 0);
    free(sorted);
    return ok;
}

static int parse_ints(fp_version *v, const jval *arr, int ndim, int64_t *out, const char *what, const char *path) {
    if (!arr || arr->t != J_ARR || (int)arr->n != ndim) return bad(v, "leaf '%.200s': a chunk's %s do not match its shape", path, what);
    for (int d = 0; d < ndim; d++)
        if (!int_of(arr->items[d], &out[d])) return bad(v, "leaf '%.200s': a chunk's %s are not integers", path, what);
    return FP_OK;
}

static int parse_leaf(fp_version *v, const jval *L, size_t index) {
    fp_leafrec *leaf = &v->leaves[index];
    memset(leaf, 0, sizeof *leaf);
    leaf->alias_of = -1;
    const jval *path = json_get(L, "path"), *kind = json_get(L, "kind"), *dt = json_get(L, "dtype"),
               *shape = json_get(L, "shape"), *chunks = json_get(L, "chunks"), *alias = json_get(L, "alias_of");
    if (!json_is_str(path) || path->n > FP_MAX_NAME) return bad(v, "a leaf has no path (or one over 4,096 bytes)%s%s", NULL, NULL);
    const char *p = path->s;
    leaf->path = p;
    static const char *kinds[] = {"torch", "numpy", "numpy_scalar", "bytes", "pickle"};
    int known = 0;
    for (int i = 0; json_is_str(kind) && i < 5; i++) known |= !strcmp(kind->s, kinds[i]);
    if (!known) return bad(v, "leaf '%.200s' has an unknown kind%s", p, NULL);
    leaf->kind = kind->s;
    if (!json_is_str(dt) || !(leaf->itemsize = fp_itemsize_of(dt->s, &leaf->dtype)))
        return bad(v, "leaf '%.200s' has an unknown dtype '%.40s'", p, json_is_str(dt) ? dt->s : "");
    leaf->dtype_name = dt->s;
    if (!shape || shape->t != J_ARR || shape->n > FP_MAX_DIMS) return bad(v, "leaf '%.200s' has no shape of at most 64 dimensions%s", p, NULL);
    leaf->ndim = (int)shape->n;
    leaf->shape = arena_alloc(&v->a, (shape->n + 1) * sizeof(int64_t));
    if (!leaf->shape) return fp_fail(v->repo, FP_ERR_NOMEM, "out of memory");
    uint64_t elems = 1;
    for (int d = 0; d < leaf->ndim; d++) {
        if (!int_of(shape->items[d], &leaf->shape[d]) || leaf->shape[d] < 0 || leaf->shape[d] > ((int64_t)1 << 50))
            return bad(v, "leaf '%.200s' has a shape that is not non-negative integers%s", p, NULL);
        if (leaf->shape[d] && elems > ((uint64_t)1 << 50) / (uint64_t)leaf->shape[d]) elems = ((uint64_t)1 << 51);
        else elems *= (uint64_t)leaf->shape[d];
    }
    int64_t nbytes;
    if (elems > ((uint64_t)1 << 50) / leaf->itemsize || !int_of(json_get(L, "nbytes"), &nbytes) ||
        (uint64_t)nbytes != elems * leaf->itemsize)
        return bad(v, "leaf '%.200s': nbytes is not its shape's elements times its element size (or over 2^50)%s", p, NULL);
    leaf->nbytes = (uint64_t)nbytes;
    if ((!strcmp(leaf->kind, "bytes") || !strcmp(leaf->kind, "pickle")) && (strcmp(leaf->dtype_name, "uint8") || leaf->ndim != 1))
        return bad(v, "leaf '%.200s' of kind bytes or pickle is not uint8 of shape [n]%s", p, NULL);
    if (!chunks || chunks->t != J_ARR || chunks->n > FP_MAX_CHUNKS) return bad(v, "leaf '%.200s' has no chunk list%s", p, NULL);
    if (alias) {
        int64_t a;
        if (!int_of(alias, &a) || a < 0 || (size_t)a >= index || v->leaves[a].alias_of >= 0 || chunks->n ||
            strcmp(v->leaves[a].dtype_name, leaf->dtype_name) || v->leaves[a].ndim != leaf->ndim ||
            memcmp(v->leaves[a].shape, leaf->shape, (size_t)leaf->ndim * sizeof(int64_t)))
            return bad(v, "leaf '%.200s' is an alias of no earlier leaf of its dtype and shape%s", p, NULL);
        leaf->alias_of = (long)a;
        leaf->codec = v->leaves[a].codec;
        return FP_OK;
    }
    leaf->nchunks = chunks->n;
    leaf->chunks = arena_alloc(&v->a, (chunks->n + 1) * sizeof(fp_chunk));
    if (!leaf->chunks) return fp_fail(v->repo, FP_ERR_NOMEM, "out of memory");
    for (size_t i = 0; i < chunks->n; i++) {
        const jval *C = chunks->items[i];
        fp_chunk *c = &leaf->chunks[i];
        memset(c, 0, sizeof *c);
        c->off = arena_alloc(&v->a, (size_t)(2 * leaf->ndim + 1) * sizeof(int64_t));
        if (!c->off) return fp_fail(v->repo, FP_ERR_NOMEM, "out of memory");
        c->len = c->off + leaf->ndim;
        int st;
        if ((st = parse_ints(v, json_get(C, "offsets"), leaf->ndim, c->off, "offsets", p)) ||
            (st = parse_ints(v, json_get(C, "lengths"), leaf->ndim, c->len, "lengths", p)))
            return st;
        const jval *h = json_get(C, "hash"), *o = json_get(C, "object"), *codec = json_get(C, "codec"),
                   *delta = json_get(C, "delta");
        int64_t start, size;
        if (!json_is_str(h) || !fp_is_hex(h->s, 64) || !json_is_str(o) || !fp_is_hex(o->s, 64))
            return bad(v, "leaf '%.200s': a chunk's hash or object is not 64 hex digits%s", p, NULL);
        if (!int_of(json_get(C, "start"), &start) || start < 0 || !int_of(json_get(C, "size"), &size) || size < 0)
            return bad(v, "leaf '%.200s': a chunk's start or size is not a non-negative integer%s", p, NULL);
        uint64_t vol = 1;
        for (int d = 0; d < leaf->ndim; d++) vol *= c->len[d] > 0 && c->len[d] <= leaf->shape[d] ? (uint64_t)c->len[d] : 0;
        if ((uint64_t)size != vol * leaf->itemsize)
            return bad(v, "leaf '%.200s': a chunk's size is not its box's elements times the element size%s", p, NULL);
        c->hash = h->s, c->object = o->s, c->start = (uint64_t)start, c->size = (uint64_t)size;
        c->codec = json_is_str(codec) ? codec->s : "raw";
        if (delta) {
            const jval *op = json_get(delta, "op"), *chain = json_get(delta, "chain");
            if (!json_is_str(op) || (strcmp(op->s, "xor") && strcmp(op->s, "sub")) || !chain || chain->t != J_ARR ||
                chain->n < 1 || chain->n > 1024 || start != 0)
                return bad(v, "leaf '%.200s': a chunk's delta is not {op: xor|sub, chain of 1 to 1,024 objects}%s", p, NULL);
            if (!strcmp(op->s, "sub") && (strstr(leaf->dtype_name, "int") == NULL || leaf->itemsize > 8))
                return bad(v, "leaf '%.200s': a sub delta on a dtype that is not an integer%s", p, NULL);
            c->delta_op = !strcmp(op->s, "xor") ? 1 : 2;
            c->chain_n = chain->n;
            c->chain = arena_alloc(&v->a, chain->n * sizeof(char *));
            if (!c->chain) return fp_fail(v->repo, FP_ERR_NOMEM, "out of memory");
            for (size_t k = 0; k < chain->n; k++) {
                if (!json_is_str(chain->items[k]) || !fp_is_hex(chain->items[k]->s, 64))
                    return bad(v, "leaf '%.200s': a delta chain names an object that is not 64 hex digits%s", p, NULL);
                c->chain[k] = chain->items[k]->s;
            }
        }
        if (!leaf->codec) leaf->codec = c->codec;
        else if (strcmp(leaf->codec, c->codec)) leaf->codec = "mixed";
    }
    if (!leaf->codec) leaf->codec = "raw";
    if (!fp_boxes_tile(leaf->shape, leaf->ndim, leaf->chunks, leaf->nchunks))
        return bad(v, "the chunks of leaf '%.200s' do not tile its shape exactly (a gap, an overlap or a box outside it)%s", p, NULL);
    return FP_OK;
}

int fp_version_open(fp_repo *r, const char *id, int with_leaves, fp_version **out) {
    *out = NULL;
    if (!fp_is_hex(id, FP_ID_LEN)) return fp_fail(r, FP_ERR_ARG, "'%.80s' is not a version id (24 hex digits)", id);
    fp_version *v = calloc(1, sizeof *v);
    if (!v) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    v->repo = r;
    memcpy(v->id, id, FP_ID_LEN + 1);
    char key[64];
    snprintf(key, sizeof key, "versions/%s.json", id);
    char *data = NULL;
    size_t len;
    int st = fp_read_key(r, key, FP_MAX_MANIFEST, &data, &len);
    if (st == FP_ERR_NOT_FOUND)
        st = fp_fail(r, FP_ERR_NOT_FOUND, "version %s has no manifest in %s (pruned by gc, or on another tier): `forkpoint "
                     "log` lists the versions", id, r->root);
    char err[200];
    const jval *rec = st ? NULL : json_parse(&v->a, data, len, err, sizeof err);
    if (!st && !rec)
        st = fp_fail(r, FP_ERR_FORMAT, "manifest %s is not valid JSON (%s); it may be truncated", key, err);
    int64_t major = 0;
    const jval *fmt = json_get(rec, "format"), *ver = json_get(rec, "format_version"), *rid = json_get(rec, "id"),
               *pruned = json_get(rec, "pruned");
    if (!st && (!json_is_str(fmt) || strcmp(fmt->s, "forkpoint.version") || !ver || ver->t != J_ARR || ver->n != 2 ||
                !int_of(ver->items[0], &major)))
        st = fp_fail(r, FP_ERR_FORMAT, "%s is not a forkpoint.version record", key);
    if (!st && major > FP_FORMAT_MAJOR)
        st = fp_fail(r, FP_ERR_NEWER, "manifest %s uses format %lld.x, newer than this library reads (1.x): upgrade "
                     "libforkpoint", key, (long long)major);
    if (!st && (!json_is_str(rid) || strcmp(rid->s, id)))
        st = fp_fail(r, FP_ERR_CORRUPT, "manifest %s holds another id: it was corrupted or moved", key);
    v->pruned = pruned && pruned->t == J_BOOL && pruned->b;
    if (!st && v->pruned && !stub_matches(rec))
        st = fp_fail(r, FP_ERR_CORRUPT, "pruned record %s does not match its stub_hash: it was corrupted or edited, and "
                     "the history behind it cannot be trusted", key);
    if (!st && !v->pruned && !id_matches(v, data, len, rec))
        st = fp_fail(r, FP_ERR_CORRUPT, "manifest %s does not match its id %s: it was corrupted or edited", key, id);
    free(data);
    if (st) {
        fp_version_free(v);
        return st;
    }
    v->rec = rec;
    const jval *parents = json_get(rec, "parents"), *branch = json_get(rec, "branch"), *step = json_get(rec, "step"),
               *time = json_get(rec, "time"), *message = json_get(rec, "message"), *meta = json_get(rec, "meta"),
               *leaves = json_get(rec, "leaves"), *tree = json_get(rec, "tree");
    v->metrics = json_get(rec, "metrics");
    if (!parents || parents->t != J_ARR || parents->n > 64) st = bad(v, "parents is not a list of at most 64 ids%s%s", NULL, NULL);
    for (size_t i = 0; !st && i < parents->n; i++) {
        if (!json_is_str(parents->items[i]) || !fp_is_hex(parents->items[i]->s, FP_ID_LEN) || !strcmp(parents->items[i]->s, id))
            st = bad(v, "a parent is not another version's id%s%s", NULL, NULL);
        else
            v->parents[v->nparents++] = parents->items[i]->s;
    }
    if (!st && step && step->t != J_NULL && !int_of(step, &v->step)) st = bad(v, "step is not an integer or null%s%s", NULL, NULL);
    v->has_step = !st && step && step->t != J_NULL;
    if (!st && !json_double(time, &v->time)) st = bad(v, "time is not a finite number%s%s", NULL, NULL);
    if (!st && (!json_is_str(branch) || (message && !json_is_str(message))))
        st = bad(v, "branch or message is not a string%s%s", NULL, NULL);
    if (!st && ((v->metrics && v->metrics->t != J_OBJ) || (meta && meta->t != J_OBJ)))
        st = bad(v, "metrics or meta is not an object%s%s", NULL, NULL);
    if (st) {
        fp_version_free(v);
        return st;
    }
    v->branch = branch->s;
    v->message = message ? message->s : "";
    sbuf b = {0};
    if (meta) json_canonical(&b, meta);
    else sb_puts(&b, "{}");
    char *m = b.failed ? NULL : arena_alloc(&v->a, b.n + 1);
    if (m) memcpy(m, b.p, b.n + 1);
    sb_free(&b);
    v->meta = m ? m : "{}";
    if (!v->pruned && with_leaves) {
        if (!leaves || leaves->t != J_ARR || leaves->n > FP_MAX_LEAVES) st = bad(v, "leaves is not a table of at most 5,000,000%s%s", NULL, NULL);
        else if (!(v->leaves = arena_alloc(&v->a, (leaves->n + 1) * sizeof(fp_leafrec)))) st = fp_fail(r, FP_ERR_NOMEM, "out of memory");
        for (size_t i = 0; !st && i < leaves->n; i++, v->nleaves++) st = parse_leaf(v, leaves->items[i], i);
        if (!st && tree && tree->t != J_NULL) st = check_tree(v, tree, 0, leaves->n);
    }
    if (st) {
        fp_version_free(v);
        return st;
    }
    *out = v;
    return fp_ok(r);
}

int fp_load(fp_repo *r, const char *ref, fp_version **out) {
    if (!r) return FP_ERR_ARG;
    if (!out) return fp_fail(r, FP_ERR_ARG, "fp_load: no place for the version");
    *out = NULL;
    char id[FP_ID_LEN + 1];
    int st = fp_resolve(r, ref, id);
    if (st) return st;
    if ((st = fp_version_open(r, id, 1, out))) return st;
    if ((*out)->pruned) {
        fp_version_free(*out);
        *out = NULL;
        return fp_fail(r, FP_ERR_NOT_FOUND, "version %s (%s) was pruned by retention: only its lineage is kept; load a "
                       "kept version (`forkpoint log` marks pruned ones)", id, ref);
    }
    return FP_OK;
}


void fp_version_free(fp_version *v) {
    if (!v) return;
    arena_free(&v->a);
    free(v);
}

const char *fp_version_id(const fp_version *v) { return v->id; }
const char *fp_version_branch(const fp_version *v) { return v->branch; }
int fp_version_step(const fp_version *v, int64_t *step) {
    if (v->has_step && step) *step = v->step;
    return v->has_step;
}
double fp_version_time(const fp_version *v) { return v->time; }
const char *fp_version_message(const fp_version *v) { return v->message; }
int fp_version_nparents(const fp_version *v) { return v->nparents; }
const char *fp_version_parent(const fp_version *v, int i) { return i >= 0 && i < v->nparents ? v->parents[i] : NULL; }
int fp_version_nmetrics(const fp_version *v) { return v->metrics ? (int)v->metrics->n : 0; }
int fp_version_metric(const fp_version *v, int i, const char **name, double *value) {
    if (!v->metrics || i < 0 || (size_t)i >= v->metrics->n) return 0;
    if (name) *name = v->metrics->keys[i]->s;
    double x;
    if (!json_double(v->metrics->items[i], &x)) return 0;
    if (value) *value = x;
    return 1;
}
const char *fp_version_meta(const fp_version *v) { return v->meta; }
int fp_version_pruned(const fp_version *v) { return v->pruned; }
size_t fp_version_nleaves(const fp_version *v) { return v->nleaves; }

int fp_version_leaf(const fp_version *v, size_t i, fp_leaf *out) {
    if (i >= v->nleaves || !out) return fp_fail(v->repo, FP_ERR_ARG, "leaf index %zu is out of range (%zu leaves)", i, v->nleaves);
    const fp_leafrec *L = &v->leaves[i];
    *out = (fp_leaf){L->path, L->kind, L->dtype_name, L->dtype, L->itemsize, L->ndim, L->shape, L->nbytes,
                     L->alias_of >= 0 ? v->leaves[L->alias_of].nchunks : L->nchunks, L->codec};
    return FP_OK;
}

int fp_version_find(const fp_version *v, const char *path, size_t *index) {
    for (size_t i = 0; path && i < v->nleaves; i++)
        if (!strcmp(v->leaves[i].path, path)) {
            if (index) *index = i;
            return FP_OK;
        }
    return fp_fail(v->repo, FP_ERR_NOT_FOUND, "version %s has no leaf '%.300s' (fp_version_leaf lists its %zu leaves)",
                   v->id, path ? path : "(null)", v->nleaves);
}

/* The whole decoded bytes of a chunk (delta chains combined), verified against its hash. */
static int chunk_bytes(fp_version *v, const fp_chunk *c, size_t itemsize, uint8_t **out) {
    fp_repo *r = v->repo;
    uint8_t *data = NULL, *part = NULL;
    size_t len, plen;
    int st;
    if (c->delta_op) {
        if ((st = fp_object_read(r, c->chain[0], c->size, &data, &len))) return st;
        for (size_t k = 1; !st && k <= c->chain_n; k++) {
            const char *name = k < c->chain_n ? c->chain[k] : c->object;
            if ((st = fp_object_read(r, name, c->size, &part, &plen))) break;
            if (plen != c->size || len != c->size) {
                st = fp_fail(r, FP_ERR_CORRUPT, "delta object %s holds %zu bytes, its chunk %llu: corrupted", name, plen,
                             (unsigned long long)c->size);
            } else if (c->delta_op == 1) {
                for (size_t i = 0; i < len; i++) data[i] ^= part[i];
            } else {
                for (size_t i = 0; i + itemsize <= len; i += itemsize) { /* element-wise, modulo 2^(8 x size) */
                    uint64_t a = 0, b = 0;
                    memcpy(&a, data + i, itemsize);
                    memcpy(&b, part + i, itemsize);
                    a += b;
                    memcpy(data + i, &a, itemsize);
                }
            }
            free(part);
            part = NULL;
        }
    } else {
        uint64_t limit = c->object && !strcmp(c->object, c->hash) ? c->size
                         : (c->start + c->size > FP_MAX_PACK_DECODE ? c->start + c->size : FP_MAX_PACK_DECODE);
        if ((st = fp_object_read(r, c->object, limit, &data, &len))) return st;
        if (c->start + c->size > len) {
            st = fp_fail(r, FP_ERR_CORRUPT, "object %s holds %zu bytes, a chunk reads up to %llu: corrupted", c->object, len,
                         (unsigned long long)(c->start + c->size));
        } else if (c->start) {
            memmove(data, data + c->start, (size_t)c->size);
        }
    }
    if (!st && (c->delta_op || strcmp(c->object, c->hash))) {
        char hex[65];
        fp_content_hash(data, (size_t)c->size, hex);
        if (strcmp(hex, c->hash))
            st = fp_fail(r, FP_ERR_CORRUPT, "a chunk of object %s does not match its hash %s: corrupted", c->object, c->hash);
    }
    if (st) free(data);
    else *out = data;
    return st;
}

/* Row-major linear index of `idx` in a box of lengths `len`. */
static uint64_t linear(const int64_t *idx, const int64_t *len, int ndim) {
    uint64_t at = 0;
    for (int d = 0; d < ndim; d++) at = at * (uint64_t)len[d] + (uint64_t)idx[d];
    return at;
}

int fp_read_box(fp_version *v, const char *path, int ndim, const int64_t *offset, const int64_t *shape, void *buf,
                size_t bufsize) {
    fp_repo *r = v ? v->repo : NULL;
    if (!v || !buf) return fp_fail(r, FP_ERR_ARG, "fp_read_box: no version or no buffer");
    size_t index;
    int st = fp_version_find(v, path, &index);
    if (st) return st;
    const fp_leafrec *L = &v->leaves[index];
    const fp_leafrec *src = L->alias_of >= 0 ? &v->leaves[L->alias_of] : L;
    if (ndim != L->ndim) return fp_fail(r, FP_ERR_ARG, "leaf '%s' has %d dimensions, the box %d", path, L->ndim, ndim);
    uint64_t elems = 1;
    for (int d = 0; d < ndim; d++) {
        if (offset[d] < 0 || shape[d] < 0 || offset[d] + shape[d] > L->shape[d])
            return fp_fail(r, FP_ERR_ARG, "the box does not fit leaf '%s': dimension %d is [%lld, %lld) of %lld", path, d,
                           (long long)offset[d], (long long)(offset[d] + shape[d]), (long long)L->shape[d]);
        elems *= (uint64_t)shape[d];
    }
    size_t w = L->itemsize;
    if (bufsize < elems * w)
        return fp_fail(r, FP_ERR_ARG, "a buffer of %zu bytes cannot hold the %llu bytes of the box of '%s'", bufsize,
                       (unsigned long long)(elems * w), path);
    if (!elems) return fp_ok(r);
    uint8_t *dst = buf;
    int64_t lo[FP_MAX_DIMS + 1], hi[FP_MAX_DIMS + 1], idx[FP_MAX_DIMS + 1], rel[FP_MAX_DIMS + 1];
    for (size_t ci = 0; ci < src->nchunks; ci++) {
        const fp_chunk *c = &src->chunks[ci];
        int empty = 0, whole = 1, contiguous = 1;
        for (int d = 0; d < ndim; d++) {
            lo[d] = c->off[d] > offset[d] ? c->off[d] : offset[d];
            hi[d] = c->off[d] + c->len[d] < offset[d] + shape[d] ? c->off[d] + c->len[d] : offset[d] + shape[d];
            empty |= hi[d] <= lo[d];
            whole &= lo[d] == c->off[d] && hi[d] == c->off[d] + c->len[d];
            if (d > 0) contiguous &= c->len[d] == shape[d];
        }
        if (empty) continue;
        /* the chunk-local byte range that covers the intersection */
        for (int d = 0; d < ndim; d++) idx[d] = lo[d] - c->off[d];
        uint64_t first = linear(idx, c->len, ndim) * w;
        for (int d = 0; d < ndim; d++) idx[d] = hi[d] - 1 - c->off[d];
        uint64_t last = (linear(idx, c->len, ndim) + 1) * w;
        int standalone = !c->delta_op && c->start == 0 && !strcmp(c->object, c->hash);
        if (whole && contiguous && standalone) { /* straight into the caller's buffer */
            for (int d = 0; d < ndim; d++) rel[d] = c->off[d] - offset[d];
            uint8_t *to = dst + linear(rel, shape, ndim) * w;
            st = fp_object_read_into(r, c->object, to, c->size);
            if (st == FP_ERR_UNSUPPORTED) st = fp_object_range(r, c->object, c->size, 0, c->size, to);
            if (st) return st;
            continue;
        }
        uint8_t *bytes = NULL;
        uint64_t base = 0;
        if (standalone) {
            if (!(bytes = malloc((size_t)(last - first)))) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
            if ((st = fp_object_range(r, c->object, c->size, first, last, bytes))) { free(bytes); return st; }
            base = first;
        } else if ((st = chunk_bytes(v, c, w, &bytes))) {
            return st;
        }
        /* copy the intersection, a run along the last dimension at a time */
        int inner = ndim - 1;
        size_t run = ndim ? (size_t)(hi[inner] - lo[inner]) * w : w;
        for (int d = 0; d < ndim; d++) idx[d] = lo[d];
        for (;;) {
            for (int d = 0; d < ndim; d++) rel[d] = idx[d] - c->off[d];
            uint64_t from = linear(rel, c->len, ndim) * w - base;
            for (int d = 0; d < ndim; d++) rel[d] = idx[d] - offset[d];
            memcpy(dst + linear(rel, shape, ndim) * w, bytes + from, run);
            int d = inner - 1;
            for (; d >= 0; d--) {
                if (++idx[d] < hi[d]) break;
                idx[d] = lo[d];
            }
            if (d < 0) break;
        }
        free(bytes);
    }
    return fp_ok(r);
}

int fp_read(fp_version *v, const char *path, void *buf, size_t bufsize) {
    if (!v) return FP_ERR_ARG;
    size_t index;
    int st = fp_version_find(v, path, &index);
    if (st) return st;
    const fp_leafrec *L = &v->leaves[index];
    int64_t zeros[FP_MAX_DIMS + 1] = {0};
    return fp_read_box(v, path, L->ndim, zeros, L->shape, buf, bufsize);
}

int fp_read_as(fp_version *v, const char *path, fp_dtype dtype, int ndim, const int64_t *shape, void *buf, size_t bufsize) {
    if (!v) return FP_ERR_ARG;
    size_t index;
    int st = fp_version_find(v, path, &index);
    if (st) return st;
    const fp_leafrec *L = &v->leaves[index];
    int same = L->dtype == dtype && dtype != FP_DTYPE_OTHER && L->ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = shape && L->shape[d] == shape[d];
    if (!same) {
        sbuf want = {0}, have = {0};
        for (int d = 0; d < ndim && shape; d++) sb_printf(&want, d ? ", %lld" : "%lld", (long long)shape[d]);
        for (int d = 0; d < L->ndim; d++) sb_printf(&have, d ? ", %lld" : "%lld", (long long)L->shape[d]);
        st = fp_fail(v->repo, FP_ERR_ARG, "'%s' in version %s is %s [%s], not the %s [%s] asked for: read it into an "
                     "array of its dtype and shape (shapes here are row-major: a Fortran a(n1, n2) is [n2, n1])", path, v->id, L->dtype_name, have.p ? have.p : "",
                     fp_dtype_name(dtype), want.p ? want.p : "");
        sb_free(&want), sb_free(&have);
        return st;
    }
    return fp_read(v, path, buf, bufsize);
}
