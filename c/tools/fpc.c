/* fpc: the command-line face of libforkpoint (list, log, refs, read, verify, save, tag), used
 * by scripts in C-only environments and by the cross-language tests. Exit status: 0, or the
 * fp_status of the failure (its message on stderr). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../include/forkpoint.h"

static int usage(void) {
    fprintf(stderr,
            "usage: fpc ls REPO REF\n"
            "       fpc log REPO [REF] [MAX]\n"
            "       fpc refs REPO\n"
            "       fpc read REPO REF PATH OUT [OFFSETS LENGTHS]   (OUT '-' for stdout; OFFSETS like 0,4)\n"
            "       fpc verify REPO REF                            (reads and checks every leaf)\n"
            "       fpc save REPO BRANCH [--step N] [--message M] [--metric NAME=X] [--meta JSON] [--codec raw|zstd]\n"
            "                [--chunk-bytes N] PATH=DTYPE:SHAPE:FILE ...        (SHAPE like 4x5, empty for a scalar)\n"
            "       fpc tag REPO NAME REF\n");
    return FP_ERR_ARG;
}

static int fail(fp_repo *r, int st) {
    fprintf(stderr, "fpc: %s: %s\n", fp_status_name(st), fp_errmsg(r));
    fp_close(r);
    return st;
}

static int parse_list(const char *s, char sep, int64_t *out) {
    int n = 0;
    if (!*s) return 0;
    for (const char *p = s; n < FP_MAX_DIMS;) {
        char *end;
        out[n++] = strtoll(p, &end, 10);
        if (*end != sep) return *end ? -1 : n;
        p = end + 1;
    }
    return -1;
}

static void print_shape(const int64_t *shape, int ndim) {
    printf("[");
    for (int d = 0; d < ndim; d++) printf(d ? ",%lld" : "%lld", (long long)shape[d]);
    printf("]");
}

static int show_version(const fp_version *v, void *user) {
    (void)user;
    int64_t step;
    printf("%s\t%s\t", fp_version_id(v), fp_version_branch(v));
    if (fp_version_step(v, &step)) printf("%lld", (long long)step);
    else printf("-");
    printf("\t");
    for (int i = 0; i < fp_version_nparents(v); i++) printf(i ? ",%s" : "%s", fp_version_parent(v, i));
    printf("\t{");
    for (int i = 0; i < fp_version_nmetrics(v); i++) {
        const char *name;
        double x;
        if (fp_version_metric(v, i, &name, &x)) printf("%s\"%s\": %.17g", i ? ", " : "", name, x);
    }
    printf("}%s\t%s\n", fp_version_pruned(v) ? "\tpruned" : "", fp_version_message(v));
    return 0;
}

static int show_ref(const char *kind, const char *name, const char *target, void *user) {
    (void)user;
    printf("%s\t%s\t%s\n", strcmp(kind, "heads") ? "tag" : "branch", name, target);
    return 0;
}

static int read_leaf(fp_version *v, const char *path, const char *out, const char *offs, const char *lens) {
    size_t index;
    fp_leaf leaf;
    int st = fp_version_find(v, path, &index);
    if (st || (st = fp_version_leaf(v, index, &leaf))) return st;
    int64_t off[FP_MAX_DIMS] = {0}, len[FP_MAX_DIMS];
    int ndim = leaf.ndim;
    memcpy(len, leaf.shape, (size_t)ndim * sizeof *len);
    if (offs && (parse_list(offs, ',', off) != ndim || parse_list(lens, ',', len) != ndim)) {
        fprintf(stderr, "fpc: a box needs %d offsets and %d lengths\n", ndim, ndim);
        return FP_ERR_ARG;
    }
    uint64_t n = leaf.itemsize;
    for (int d = 0; d < ndim; d++) n *= (uint64_t)(len[d] > 0 ? len[d] : 0);
    void *buf = malloc(n ? (size_t)n : 1);
    if (!buf) return FP_ERR_NOMEM;
    st = fp_read_box(v, path, ndim, off, len, buf, (size_t)n);
    if (!st && out) {
        FILE *f = strcmp(out, "-") ? fopen(out, "wb") : stdout;
        if (!f || fwrite(buf, 1, (size_t)n, f) != n) st = FP_ERR_IO, fprintf(stderr, "fpc: cannot write %s\n", out);
        if (f && f != stdout) fclose(f);
    }
    free(buf);
    return st;
}

static int put_spec(fp_save *s, const char *spec) {
    char path[4200], dtype[40], shape[512], file[4200];
    const char *eq = strrchr(spec, '=');
    if (!eq || sscanf(eq + 1, "%39[^:]:%511[^:]:%4199s", dtype, shape, file) < 2) {
        /* an empty shape leaves the middle field empty: DTYPE::FILE */
        if (!eq || sscanf(eq + 1, "%39[^:]::%4199s", dtype, file) != 2) return -1;
        shape[0] = 0;
    }
    snprintf(path, sizeof path, "%.*s", (int)(eq - spec), spec);
    int64_t dims[FP_MAX_DIMS];
    int ndim = parse_list(shape, 'x', dims);
    if (ndim < 0) return -1;
    fp_dtype dt = FP_DTYPE_OTHER;
    for (int d = 0; d < FP_DTYPE_OTHER; d++)
        if (!strcmp(fp_dtype_name((fp_dtype)d), dtype)) dt = (fp_dtype)d;
    uint64_t n = fp_dtype_size(dt);
    for (int d = 0; d < ndim; d++) n *= (uint64_t)dims[d];
    FILE *f = fopen(file, "rb");
    if (!f) { fprintf(stderr, "fpc: cannot open %s\n", file); return FP_ERR_IO; }
    void *buf = malloc(n ? (size_t)n : 1);
    size_t got = buf ? fread(buf, 1, (size_t)n, f) : 0;
    fclose(f);
    if (!buf || got != n) {
        fprintf(stderr, "fpc: %s holds fewer than the %llu bytes of %s\n", file, (unsigned long long)n, path);
        free(buf);
        return FP_ERR_ARG;
    }
    int st = fp_save_put(s, path, dt, ndim, dims, buf);
    free(buf);
    return st;
}

int main(int argc, char **argv) {
    if (argc < 3) return usage();
    const char *cmd = argv[1];
    fp_repo *r;
    int st = fp_open(argv[2], !strcmp(cmd, "save") ? FP_CREATE : 0, &r);
    if (st) return fail(r, st);
    if (!strcmp(cmd, "ls") && argc == 4) {
        fp_version *v;
        if ((st = fp_load(r, argv[3], &v))) return fail(r, st);
        for (size_t i = 0; i < fp_version_nleaves(v); i++) {
            fp_leaf leaf;
            fp_version_leaf(v, i, &leaf);
            printf("%s\t%s\t%s\t", leaf.path, leaf.kind, leaf.dtype_name);
            print_shape(leaf.shape, leaf.ndim);
            printf("\t%s\t%llu\t%zu\n", leaf.codec, (unsigned long long)leaf.nbytes, leaf.nchunks);
        }
        fp_version_free(v);
    } else if (!strcmp(cmd, "log") && argc >= 3 && argc <= 5) {
        st = fp_log(r, argc >= 4 ? argv[3] : "main", argc == 5 ? atoi(argv[4]) : 0, show_version, NULL);
    } else if (!strcmp(cmd, "refs") && argc == 3) {
        st = fp_refs(r, show_ref, NULL);
    } else if ((!strcmp(cmd, "read") && (argc == 6 || argc == 8)) || (!strcmp(cmd, "verify") && argc == 4)) {
        fp_version *v;
        if ((st = fp_load(r, argv[3], &v))) return fail(r, st);
        if (!strcmp(cmd, "read")) {
            st = read_leaf(v, argv[4], argv[5], argc == 8 ? argv[6] : NULL, argc == 8 ? argv[7] : NULL);
        } else {
            size_t i = 0;
            for (; !st && i < fp_version_nleaves(v); i++) {
                fp_leaf leaf;
                fp_version_leaf(v, i, &leaf);
                st = read_leaf(v, leaf.path, NULL, NULL, NULL);
            }
            if (!st) printf("%s: %zu leaves verified\n", fp_version_id(v), i);
        }
        fp_version_free(v);
    } else if (!strcmp(cmd, "save") && argc >= 5) {
        fp_save *s;
        if ((st = fp_save_begin(r, argv[3], &s))) return fail(r, st);
        for (int i = 4; !st && i < argc; i++) {
            const char *a = argv[i], *next = i + 1 < argc ? argv[i + 1] : NULL;
            if (!strcmp(a, "--step") && next) st = fp_save_set_step(s, atoll(next)), i++;
            else if (!strcmp(a, "--message") && next) st = fp_save_set_message(s, next), i++;
            else if (!strcmp(a, "--meta") && next) st = fp_save_set_meta(s, next), i++;
            else if (!strcmp(a, "--codec") && next) st = fp_save_set_codec(s, strcmp(next, "zstd") ? FP_CODEC_RAW : FP_CODEC_ZSTD), i++;
            else if (!strcmp(a, "--chunk-bytes") && next) st = fp_save_set_chunk_bytes(s, (size_t)atoll(next)), i++;
            else if (!strcmp(a, "--metric") && next && strchr(next, '=')) {
                char name[256];
                snprintf(name, sizeof name, "%.*s", (int)(strchr(next, '=') - next), next);
                st = fp_save_set_metric(s, name, strtod(strchr(next, '=') + 1, NULL)), i++;
            } else if ((st = put_spec(s, a)) < 0) {
                fprintf(stderr, "fpc: cannot parse '%s' (PATH=DTYPE:SHAPE:FILE)\n", a);
                fp_save_abort(s);
                fp_close(r);
                return FP_ERR_ARG;
            }
        }
        char id[FP_ID_LEN + 1];
        if (st) fp_save_abort(s);
        else if (!(st = fp_save_commit(s, id))) printf("%s\n", id);
    } else if (!strcmp(cmd, "tag") && argc == 5) {
        st = fp_tag(r, argv[3], argv[4]);
    } else {
        fp_close(r);
        return usage();
    }
    if (st) return fail(r, st);
    fp_close(r);
    return 0;
}
