/* Repositories and refs: open and create, write-once ref records (the highest seq wins, a new
 * one is published by exclusive create), ref expressions, log, the list of refs and tags. */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "internal.h"

#define REF_RECORD_MAX 65536
#define REF_KEEP 16
#define REF_PRUNE_AT 32

int fp_check_name(fp_repo *r, const char *name, const char *what) {
    size_t n = name ? strlen(name) : 0;
    int ok = n >= 1 && n <= 128;
    for (size_t i = 0; ok && i < n; i++) {
        char c = name[i];
        int alnum = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9');
        ok = alnum || (i > 0 && (c == '.' || c == '_' || c == '-'));
    }
    if (ok) return FP_OK;
    return fp_fail(r, FP_ERR_ARG, "invalid %s name '%.140s': use letters, digits, '.', '_' and '-' (at most 128), "
                   "starting with a letter or digit", what, name ? name : "(null)");
}

/* Seqs of a ref's records, sorted ascending (malloc'd); *n = 0 when the ref has none. */
static int list_seqs(fp_repo *r, const char *dirkey, int64_t **out, size_t *n) {
    *out = NULL, *n = 0;
    char *p = fp_path(r, dirkey);
    if (!p) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    DIR *d = opendir(p);
    int e = errno;
    free(p);
    if (!d) return e == ENOENT ? FP_OK : fp_fail(r, FP_ERR_IO, "cannot list %s: %s", dirkey, strerror(e));
    size_t cap = 0;
    int st = FP_OK;
    for (struct dirent *de; (de = readdir(d));) {
        size_t len = strlen(de->d_name);
        if (len < 6 || len > 23 || strcmp(de->d_name + len - 5, ".json")) continue;
        int64_t seq = 0;
        size_t i = 0;
        for (; i < len - 5 && de->d_name[i] >= '0' && de->d_name[i] <= '9'; i++) seq = seq * 10 + (de->d_name[i] - '0');
        if (i != len - 5) continue;
        if (*n == cap) {
            cap = cap ? 2 * cap : 64;
            int64_t *nv = realloc(*out, cap * sizeof *nv);
            if (!nv) { st = fp_fail(r, FP_ERR_NOMEM, "out of memory"); break; }
            *out = nv;
        }
        (*out)[(*n)++] = seq;
    }
    closedir(d);
    for (size_t i = 1; i < *n; i++) /* few records: insertion sort */
        for (size_t j = i; j > 0 && (*out)[j - 1] > (*out)[j]; j--) {
            int64_t t = (*out)[j];
            (*out)[j] = (*out)[j - 1], (*out)[j - 1] = t;
        }
    return st;
}

int fp_list_top(fp_repo *r, const char *dirkey, int64_t *seq) {
    int64_t *seqs;
    size_t n;
    int st = list_seqs(r, dirkey, &seqs, &n);
    *seq = !st && n ? seqs[n - 1] : -1;
    free(seqs);
    return st;
}

int fp_ref_read(fp_repo *r, const char *kind, const char *name, char target[FP_ID_LEN + 1], int64_t *seq) {
    char dirkey[200], key[240];
    snprintf(dirkey, sizeof dirkey, "refs/%s/%s", kind, name);
    target[0] = 0, *seq = -1;
    for (int attempt = 0; attempt < 8; attempt++) {
        int64_t *seqs;
        size_t n;
        int st = list_seqs(r, dirkey, &seqs, &n);
        if (st || n == 0) { free(seqs); return st; }
        int64_t top = seqs[n - 1];
        free(seqs);
        snprintf(key, sizeof key, "%s/%016lld.json", dirkey, (long long)top);
        char *data;
        size_t len;
        st = fp_read_key(r, key, REF_RECORD_MAX, &data, &len);
        if (st == FP_ERR_NOT_FOUND) continue; /* deleted as old between the listing and the read: list again */
        if (st) return st;
        arena a = {0};
        char err[200];
        const jval *rec = json_parse(&a, data, len, err, sizeof err);
        const jval *fmt = json_get(rec, "format"), *ver = json_get(rec, "format_version"), *tgt = json_get(rec, "target");
        int64_t major = 0, s = -1;
        const char *hint = "point it at an intact version with `forkpoint branch reset BRANCH REF` (or `forkpoint tag --force`)";
        if (!rec) st = fp_fail(r, FP_ERR_FORMAT, "ref record %s is not valid JSON (%s); the ref is damaged: %s", key, err, hint);
        else if (!json_is_str(fmt) || strcmp(fmt->s, "forkpoint.ref") || !ver || ver->t != J_ARR || ver->n != 2 ||
                 !json_int(ver->items[0], &major))
            st = fp_fail(r, FP_ERR_FORMAT, "%s is not a forkpoint.ref record; the ref is damaged: %s", key, hint);
        else if (major > FP_FORMAT_MAJOR)
            st = fp_fail(r, FP_ERR_NEWER, "ref record %s uses format %lld.x, newer than this library reads (1.x): upgrade "
                         "libforkpoint", key, (long long)major);
        else if (!json_int(json_get(rec, "seq"), &s) || s != top)
            st = fp_fail(r, FP_ERR_FORMAT, "ref record %s holds another seq than its name says; the ref is damaged: %s", key, hint);
        else if (!tgt || (tgt->t != J_NULL && !(json_is_str(tgt) && fp_is_hex(tgt->s, FP_ID_LEN))))
            st = fp_fail(r, FP_ERR_FORMAT, "ref record %s names no version id; the ref is damaged: %s", key, hint);
        else if (tgt->t == J_STR)
            memcpy(target, tgt->s, FP_ID_LEN + 1);
        *seq = top;
        arena_free(&a);
        free(data);
        return st;
    }
    return fp_fail(r, FP_ERR_IO, "the records of %s keep vanishing while read; try again", dirkey);
}

int fp_ref_publish(fp_repo *r, const char *kind, const char *name, int64_t seq, const char *target) {
    char dirkey[200], key[240];
    snprintf(dirkey, sizeof dirkey, "refs/%s/%s", kind, name);
    snprintf(key, sizeof key, "%s/%016lld.json", dirkey, (long long)seq);
    sbuf b = {0};
    sb_printf(&b, "{\"format\": \"forkpoint.ref\", \"format_version\": [%d, %d], \"seq\": %lld, \"target\": ",
              FP_FORMAT_MAJOR, FP_FORMAT_MINOR, (long long)seq);
    if (target) sb_json_str(&b, target, strlen(target));
    else sb_puts(&b, "null");
    sb_puts(&b, ", \"time\": ");
    sb_json_double(&b, fp_now());
    sb_puts(&b, ", \"writer\": ");
    sb_json_str(&b, r->writer, strlen(r->writer));
    sb_puts(&b, "}");
    int st = b.failed ? fp_fail(r, FP_ERR_NOMEM, "out of memory") : fp_write_key(r, key, b.p, b.n, NULL, 0, 1);
    sb_free(&b);
    if (st) return st;
    int64_t *seqs;
    size_t n;
    if ((st = list_seqs(r, dirkey, &seqs, &n))) return st;
    if (n && seqs[n - 1] >= seq + REF_KEEP) { /* our seq had been deleted as old and re-created: not the newest */
        free(seqs);
        return fp_fail(r, FP_ERR_CONFLICT, "%s/%s moved while this record was published (stale read); read it again", kind, name);
    }
    if (n >= REF_PRUNE_AT) /* keep the newest REF_KEEP records so that reading a ref lists few keys */
        for (size_t i = 0; i + REF_KEEP < n; i++) {
            snprintf(key, sizeof key, "%s/%016lld.json", dirkey, (long long)seqs[i]);
            char *p = fp_path(r, key);
            if (p) unlink(p);
            free(p);
        }
    free(seqs);
    return FP_OK;
}

int fp_open(const char *path, int flags, fp_repo **out) {
    fp_repo *r = calloc(1, sizeof *r);
    *out = r;
    if (!r) return FP_ERR_NOMEM;
    if (!path || !*path) return fp_fail(r, FP_ERR_ARG, "no repository path given");
    if (!strncmp(path, "file://", 7)) path += 7;
    else if (strstr(path, "://"))
        return fp_fail(r, FP_ERR_UNSUPPORTED, "'%s': libforkpoint reads and writes local repositories (a directory); copy "
                       "an object-store repository down with `forkpoint export` first", path);
    r->root = strdup(path);
    if (!r->root) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    size_t n = strlen(r->root);
    while (n > 1 && r->root[n - 1] == '/') r->root[--n] = 0;
    if (gethostname(r->host, sizeof r->host - 1) != 0) strcpy(r->host, "localhost");
    unsigned long long seed = (unsigned long long)(fp_now() * 1e9) ^ ((unsigned long long)getpid() << 20) ^ (uintptr_t)r;
    seed ^= seed >> 33, seed *= 0xff51afd7ed558ccdULL, seed ^= seed >> 33;
    snprintf(r->writer, sizeof r->writer, "%s:%ld:%08llx", r->host, (long)getpid(), seed & 0xffffffffULL);
    int st;
    if (flags & FP_CREATE) {
        struct stat sb;
        if (stat(r->root, &sb) != 0 && mkdir(r->root, 0777) != 0 && errno != EEXIST) {
            /* make the parents too, as the Python side does */
            char *copy = strdup(r->root);
            for (char *s = copy + 1; copy && *s; s++)
                if (*s == '/') { *s = 0; mkdir(copy, 0777); *s = '/'; }
            free(copy);
            if (mkdir(r->root, 0777) != 0 && errno != EEXIST)
                return fp_fail(r, FP_ERR_IO, "cannot create repository directory %s: %s", r->root, strerror(errno));
        }
        if (!fp_exists(r, "forkpoint.json")) {
            sbuf b = {0};
            sb_printf(&b, "{\"format\": \"forkpoint.repository\", \"format_version\": [1, 1], \"created\": ");
            sb_json_double(&b, fp_now());
            sb_puts(&b, "}");
            st = fp_write_key(r, "forkpoint.json", b.p, b.n, NULL, 0, 1);
            sb_free(&b);
            if (st && st != FP_ERR_CONFLICT) return st; /* CONFLICT: another process created it first */
        }
    }
    char *data;
    size_t len;
    st = fp_read_key(r, "forkpoint.json", REF_RECORD_MAX, &data, &len);
    if (st == FP_ERR_NOT_FOUND)
        return fp_fail(r, FP_ERR_NOT_FOUND, "no forkpoint repository at %s (no forkpoint.json there): check the path, or "
                       "pass FP_CREATE to make one", r->root);
    if (st) return st;
    arena a = {0};
    char err[200];
    const jval *rec = json_parse(&a, data, len, err, sizeof err);
    const jval *fmt = json_get(rec, "format"), *ver = json_get(rec, "format_version");
    int64_t major = 0;
    if (!json_is_str(fmt) || strcmp(fmt->s, "forkpoint.repository") || !ver || ver->t != J_ARR || ver->n != 2 ||
        !json_int(ver->items[0], &major))
        st = fp_fail(r, FP_ERR_FORMAT, "%s/forkpoint.json is not a forkpoint repository marker", r->root);
    else if (major > FP_FORMAT_MAJOR)
        st = fp_fail(r, FP_ERR_NEWER, "the repository at %s uses format %lld.x, newer than this library reads (1.x): "
                     "upgrade libforkpoint", r->root, (long long)major);
    else
        st = fp_ok(r);
    arena_free(&a);
    free(data);
    return st;
}

void fp_close(fp_repo *r) {
    if (!r) return;
    if (r->lease_written && r->root) {
        char key[400];
        snprintf(key, sizeof key, "writers/%s.json", r->writer);
        for (char *c = key + 8; *c; c++)
            if (*c == ':') *c = '-';
        char *p = fp_path(r, key);
        if (p) unlink(p);
        free(p);
    }
    free(r->root);
    free(r);
}

/* The version a ref base (no ~) names: branch, then tag, then id or unique id prefix. */
static int resolve_base(fp_repo *r, const char *base, char id[FP_ID_LEN + 1]) {
    int64_t seq;
    int st;
    if (fp_check_name(r, base, "ref") == FP_OK) {
        if ((st = fp_ref_read(r, "heads", base, id, &seq))) return st;
        if (id[0]) return FP_OK;
        if ((st = fp_ref_read(r, "tags", base, id, &seq))) return st;
        if (id[0]) return FP_OK;
    }
    size_t n = strlen(base);
    int hex = n >= 4 && n <= FP_ID_LEN;
    for (size_t i = 0; hex && i < n; i++) hex = (base[i] >= '0' && base[i] <= '9') || (base[i] >= 'a' && base[i] <= 'f');
    if (hex) {
        char *p = fp_path(r, "versions");
        DIR *d = p ? opendir(p) : NULL;
        free(p);
        int found = 0;
        for (struct dirent *de; d && (de = readdir(d));) {
            if (strlen(de->d_name) != FP_ID_LEN + 5 || strcmp(de->d_name + FP_ID_LEN, ".json") ||
                strncmp(de->d_name, base, n))
                continue;
            char cand[FP_ID_LEN + 1];
            memcpy(cand, de->d_name, FP_ID_LEN);
            cand[FP_ID_LEN] = 0;
            if (!fp_is_hex(cand, FP_ID_LEN) || (found && !strcmp(cand, id))) continue;
            memcpy(id, cand, FP_ID_LEN + 1);
            found++;
        }
        if (d) closedir(d);
        if (found == 1) return FP_OK;
        if (found > 1)
            return fp_fail(r, FP_ERR_ARG, "'%s' is a prefix of %d version ids: give more digits", base, found);
    }
    id[0] = 0;
    return fp_fail(r, FP_ERR_NOT_FOUND, "no branch, tag or version '%.200s' in %s: `forkpoint log -r %s` lists the versions "
                   "and `forkpoint branch` the branches", base, r->root, r->root);
}

int fp_resolve(fp_repo *r, const char *ref, char *id) {
    if (!r) return FP_ERR_ARG;
    if (!ref || !*ref || !id) return fp_fail(r, FP_ERR_ARG, "fp_resolve: no ref or no room for the id");
    size_t n = strlen(ref);
    if (n > FP_MAX_NAME) return fp_fail(r, FP_ERR_ARG, "ref expression too long");
    const char *tilde = strchr(ref, '~');
    size_t blen = tilde ? (size_t)(tilde - ref) : n;
    int64_t ups = 0;
    for (const char *p = tilde; p && *p;) { /* (~N | ~)* */
        if (*p != '~') return fp_fail(r, FP_ERR_ARG, "invalid ref expression '%.200s'", ref);
        p++;
        if (*p < '0' || *p > '9') { ups++; continue; }
        int64_t k = 0;
        for (; *p >= '0' && *p <= '9'; p++) {
            k = k * 10 + (*p - '0');
            if (k > 100000000) return fp_fail(r, FP_ERR_ARG, "invalid ref expression '%.200s'", ref);
        }
        ups += k;
    }
    if (!blen) return fp_fail(r, FP_ERR_ARG, "invalid ref expression '%.200s'", ref);
    char base[FP_MAX_NAME + 1];
    memcpy(base, ref, blen);
    base[blen] = 0;
    int st = resolve_base(r, base, id);
    for (int64_t i = 0; !st && i < ups; i++) {
        fp_version *v;
        if ((st = fp_version_open(r, id, 0, &v))) break;
        if (v->nparents == 0)
            st = fp_fail(r, FP_ERR_NOT_FOUND, "'%s' goes back past the first version of its history (%lld generations "
                         "reach %s)", ref, (long long)i, id);
        else
            memcpy(id, v->parents[0], FP_ID_LEN + 1);
        fp_version_free(v);
    }
    return st ? st : fp_ok(r);
}

int fp_log(fp_repo *r, const char *ref, int max, fp_log_fn fn, void *user) {
    if (!r) return FP_ERR_ARG;
    if (!fn) return fp_fail(r, FP_ERR_ARG, "fp_log: no callback");
    char id[FP_ID_LEN + 1];
    int st = fp_resolve(r, ref ? ref : "main", id);
    for (long shown = 0; !st && (max <= 0 || shown < max); shown++) {
        if (shown > 10000000) return fp_fail(r, FP_ERR_FORMAT, "the parents of %s loop: the history is damaged", ref);
        fp_version *v;
        if ((st = fp_version_open(r, id, 0, &v))) break;
        int stop = fn(v, user);
        int more = v->nparents > 0;
        if (more) memcpy(id, v->parents[0], FP_ID_LEN + 1);
        fp_version_free(v);
        if (stop || !more) break;
    }
    return st ? st : fp_ok(r);
}

int fp_refs(fp_repo *r, fp_ref_fn fn, void *user) {
    if (!r) return FP_ERR_ARG;
    if (!fn) return fp_fail(r, FP_ERR_ARG, "fp_refs: no callback");
    static const char *kinds[] = {"heads", "tags"};
    for (int k = 0; k < 2; k++) {
        char dirkey[32];
        snprintf(dirkey, sizeof dirkey, "refs/%s", kinds[k]);
        char *p = fp_path(r, dirkey);
        DIR *d = p ? opendir(p) : NULL;
        free(p);
        if (!d) continue;
        /* names sorted, so that listings are stable */
        char **names = NULL;
        size_t n = 0, cap = 0;
        for (struct dirent *de; (de = readdir(d));) {
            if (de->d_name[0] == '.' || strlen(de->d_name) > 128) continue;
            if (n == cap) {
                cap = cap ? 2 * cap : 16;
                char **nn = realloc(names, cap * sizeof *nn);
                if (!nn) break;
                names = nn;
            }
            names[n++] = strdup(de->d_name);
        }
        closedir(d);
        for (size_t i = 1; i < n; i++)
            for (size_t j = i; j > 0 && names[j] && names[j - 1] && strcmp(names[j - 1], names[j]) > 0; j--) {
                char *t = names[j];
                names[j] = names[j - 1], names[j - 1] = t;
            }
        int st = FP_OK, stop = 0;
        for (size_t i = 0; i < n; i++) {
            char target[FP_ID_LEN + 1];
            int64_t seq;
            if (!stop && !st && names[i] && fp_check_name(r, names[i], "ref") == FP_OK &&
                !(st = fp_ref_read(r, kinds[k], names[i], target, &seq)) && target[0])
                stop = fn(kinds[k], names[i], target, user);
            free(names[i]);
        }
        free(names);
        if (st) return st;
        if (stop) break;
    }
    return fp_ok(r);
}

int fp_tag(fp_repo *r, const char *name, const char *ref) {
    if (!r) return FP_ERR_ARG;
    int st = fp_check_name(r, name, "tag");
    char id[FP_ID_LEN + 1], now[FP_ID_LEN + 1];
    int64_t seq;
    if (st || (st = fp_resolve(r, ref, id)) || (st = fp_ref_read(r, "tags", name, now, &seq))) return st;
    if (now[0] && !strcmp(now, id)) return fp_ok(r);
    char branch[FP_ID_LEN + 1];
    int64_t branch_seq;
    if ((st = fp_ref_read(r, "heads", name, branch, &branch_seq))) return st;
    if (branch[0])
        return fp_fail(r, FP_ERR_ARG, "'%s' is a branch (at %.12s): a tag of that name could not be read by name "
                       "(the branch comes first). Use another tag name", name, branch);
    if (now[0])
        return fp_fail(r, FP_ERR_CONFLICT, "tag '%s' already names version %s: tags do not move (use another name, or "
                       "`forkpoint tag --force`)", name, now);
    if ((st = fp_hold_lease(r)) || (st = fp_ref_publish(r, "tags", name, seq + 1, id))) return st;
    return fp_ok(r);
}
