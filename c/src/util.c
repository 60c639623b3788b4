/* Errors, files, hashing, dtypes and the writer lease of libforkpoint. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

int fp_fail(fp_repo *r, int status, const char *fmt, ...) {
    if (!r) return status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->msg, sizeof r->msg, fmt, ap);
    va_end(ap);
    return status;
}

const char *fp_errmsg(const fp_repo *r) { return r ? r->msg : "no repository handle (out of memory?)"; }

const char *fp_status_name(int status) {
    static const char *names[] = {"ok", "bad argument", "I/O error", "not found", "format error", "newer format",
                                  "corrupt", "conflict", "out of memory", "unsupported"};
    return status >= 0 && status <= FP_ERR_UNSUPPORTED ? names[status] : "unknown status";
}

double fp_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

char *fp_path(const fp_repo *r, const char *key) {
    size_t n = strlen(r->root) + strlen(key) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", r->root, key);
    return p;
}

int fp_exists(const fp_repo *r, const char *key) {
    char *p = fp_path(r, key);
    struct stat st;
    int ok = p && stat(p, &st) == 0;
    free(p);
    return ok;
}

int fp_mkdirs(fp_repo *r, const char *dir) {
    char *p = fp_path(r, dir);
    if (!p) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    for (char *s = p + strlen(r->root) + 1;; s++) {
        if (*s == '/' || *s == 0) {
            char c = *s;
            *s = 0;
            if (mkdir(p, 0777) != 0 && errno != EEXIST) {
                int e = errno;
                int st = fp_fail(r, FP_ERR_IO, "cannot create directory %s: %s", p, strerror(e));
                free(p);
                return st;
            }
            *s = c;
            if (!c) break;
        }
    }
    free(p);
    return FP_OK;
}

int fp_fsync_dir(fp_repo *r, const char *dir) {
    char *p = fp_path(r, dir);
    if (!p) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    int fd = open(p, O_RDONLY | O_DIRECTORY);
    int st = FP_OK;
    if (fd < 0 || fsync(fd) != 0) st = fp_fail(r, FP_ERR_IO, "cannot fsync directory %s: %s", p, strerror(errno));
    if (fd >= 0) close(fd);
    free(p);
    return st;
}

int fp_read_key(fp_repo *r, const char *key, size_t limit, char **data, size_t *len) {
    char *p = fp_path(r, key);
    if (!p) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    int fd = open(p, O_RDONLY | O_NOFOLLOW);
    if (fd < 0) {
        int e = errno;
        int st = fp_fail(r, e == ENOENT ? FP_ERR_NOT_FOUND : FP_ERR_IO, "cannot open %s: %s", p, strerror(e));
        free(p);
        return st;
    }
    struct stat sb;
    int st = FP_OK;
    char *buf = NULL;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        st = fp_fail(r, FP_ERR_FORMAT, "%s is not a regular file", p);
    } else if ((uint64_t)sb.st_size > limit) {
        st = fp_fail(r, FP_ERR_FORMAT, "%s holds %lld bytes, over the limit of %zu for such a record", p,
                     (long long)sb.st_size, limit);
    } else if (!(buf = malloc((size_t)sb.st_size + 1))) {
        st = fp_fail(r, FP_ERR_NOMEM, "out of memory reading %s (%lld bytes)", p, (long long)sb.st_size);
    } else {
        size_t got = 0, want = (size_t)sb.st_size;
        while (got < want) {
            ssize_t n = read(fd, buf + got, want - got);
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) break;
            got += (size_t)n;
        }
        if (got != want) st = fp_fail(r, FP_ERR_IO, "short read of %s (%zu of %zu bytes)", p, got, want);
        buf[got] = 0;
        *len = got;
    }
    close(fd);
    free(p);
    if (st != FP_OK) free(buf);
    else *data = buf;
    return st;
}

static int write_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t w = write(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w, n -= (size_t)w;
    }
    return 0;
}

int fp_write_key(fp_repo *r, const char *key, const void *head, size_t head_len, const void *body, size_t body_len,
                 int exclusive) {
    char dir[FP_MAX_NAME + 64], tmpkey[128];
    const char *slash = strrchr(key, '/');
    size_t dlen = slash ? (size_t)(slash - key) : 0;
    if (dlen >= sizeof dir) return fp_fail(r, FP_ERR_ARG, "key %.80s... is too long", key);
    memcpy(dir, key, dlen);
    dir[dlen] = 0;
    int st;
    if ((st = fp_mkdirs(r, "tmp")) || (dlen && (st = fp_mkdirs(r, dir)))) return st;
    static const char hexd[] = "0123456789abcdef";
    char rnd[17];
    unsigned long long seed = ((unsigned long long)getpid() << 32) ^ (unsigned long long)(fp_now() * 1e9) ^ (uintptr_t)&rnd;
    for (int i = 0; i < 16; i++) {
        seed = seed * 6364136223846793005ULL + 1442695040888963407ULL;
        rnd[i] = hexd[(seed >> 59) & 15];
    }
    rnd[16] = 0;
    snprintf(tmpkey, sizeof tmpkey, "tmp/c-%d-%s.tmp", (int)getpid(), rnd);
    char *tmp = fp_path(r, tmpkey), *final = fp_path(r, key);
    if (!tmp || !final) {
        free(tmp);
        free(final);
        return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0644);
    st = FP_OK;
    if (fd < 0) {
        st = fp_fail(r, FP_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    } else {
        if ((head_len && write_all(fd, head, head_len)) || (body_len && write_all(fd, body, body_len)) || fsync(fd))
            st = fp_fail(r, FP_ERR_IO, "cannot write %s: %s (is the disk full?); nothing committed was touched", tmp,
                         strerror(errno));
        if (close(fd) && !st) st = fp_fail(r, FP_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    }
    if (!st && exclusive) {
        if (link(tmp, final) != 0)
            st = errno == EEXIST ? fp_fail(r, FP_ERR_CONFLICT, "%s exists: another writer published it first", key)
                                 : fp_fail(r, FP_ERR_IO, "cannot link %s: %s", final, strerror(errno));
        unlink(tmp);
    } else if (!st) {
        if (rename(tmp, final) != 0) st = fp_fail(r, FP_ERR_IO, "cannot rename %s to %s: %s", tmp, final, strerror(errno));
    } else {
        unlink(tmp);
    }
    free(tmp);
    free(final);
    if (!st && dlen) st = fp_fsync_dir(r, dir);
    return st;
}

int fp_is_hex(const char *s, size_t n) {
    if (!s || strlen(s) != n) return 0;
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

void fp_hex(const uint8_t *bytes, size_t n, char *out) {
    static const char hexd[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) out[2 * i] = hexd[bytes[i] >> 4], out[2 * i + 1] = hexd[bytes[i] & 15];
    out[2 * n] = 0;
}

typedef struct {
    const uint8_t *data;
    size_t len, first, last;
    uint8_t *digests;
} digest_job;

static void *digest_range(void *arg) {
    digest_job *j = arg;
    for (size_t b = j->first; b < j->last; b++) {
        size_t lo = b * FP_BLOCK_BYTES, n = j->len - lo < FP_BLOCK_BYTES ? j->len - lo : FP_BLOCK_BYTES;
        fp_blake3(j->data + lo, n, j->digests + 32 * b);
    }
    return NULL;
}

/* Large buffers hash their blocks on several threads (blocks are independent). */
void fp_block_digests(const uint8_t *data, size_t len, uint8_t *digests) {
    size_t nblocks = (len + FP_BLOCK_BYTES - 1) / FP_BLOCK_BYTES;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    size_t threads = cpus > 1 ? (size_t)cpus : 1;
    if (threads > 8) threads = 8;
    if (threads > nblocks / 4) threads = nblocks / 4 ? nblocks / 4 : 1;
    digest_job jobs[8];
    pthread_t tids[8];
    size_t started = 0;
    for (size_t t = 0; t < threads; t++) {
        jobs[t] = (digest_job){data, len, nblocks * t / threads, nblocks * (t + 1) / threads, digests};
        if (t > 0 && pthread_create(&tids[t], NULL, digest_range, &jobs[t]) == 0) started |= (size_t)1 << t;
        else if (t > 0) digest_range(&jobs[t]);
    }
    digest_range(&jobs[0]);
    for (size_t t = 1; t < threads; t++)
        if (started >> t & 1) pthread_join(tids[t], NULL);
}

void fp_block_root(const uint8_t *digests, size_t nblocks, uint64_t len, char hex[65]) {
    fp_blake3_hasher h;
    uint8_t head[12] = {'F', 'P', 'B', '1'}, out[32];
    for (int i = 0; i < 8; i++) head[4 + i] = (uint8_t)(len >> (8 * i));
    fp_blake3_init(&h);
    fp_blake3_update(&h, head, sizeof head);
    fp_blake3_update(&h, digests, 32 * nblocks);
    fp_blake3_final(&h, out);
    fp_hex(out, 32, hex);
}

void fp_content_hash(const uint8_t *data, size_t len, char hex[65]) {
    uint8_t out[32];
    if (len <= FP_BLOCK_BYTES) {
        fp_blake3(data, len, out);
        fp_hex(out, 32, hex);
        return;
    }
    size_t nblocks = (len + FP_BLOCK_BYTES - 1) / FP_BLOCK_BYTES;
    uint8_t *digests = malloc(32 * nblocks);
    if (!digests) { /* hash serially without the table */
        fp_blake3_hasher h;
        uint8_t head[12] = {'F', 'P', 'B', '1'};
        for (int i = 0; i < 8; i++) head[4 + i] = (uint8_t)((uint64_t)len >> (8 * i));
        fp_blake3_init(&h);
        fp_blake3_update(&h, head, sizeof head);
        for (size_t b = 0; b < nblocks; b++) {
            size_t lo = b * FP_BLOCK_BYTES;
            fp_blake3(data + lo, len - lo < FP_BLOCK_BYTES ? len - lo : FP_BLOCK_BYTES, out);
            fp_blake3_update(&h, out, 32);
        }
        fp_blake3_final(&h, out);
        fp_hex(out, 32, hex);
        return;
    }
    fp_block_digests(data, len, digests);
    fp_block_root(digests, nblocks, len, hex);
    free(digests);
}

static const struct {
    const char *name;
    size_t size;
    fp_dtype dtype;
} DTYPES[] = {
    {"bool", 1, FP_BOOL}, {"uint8", 1, FP_UINT8}, {"int8", 1, FP_INT8}, {"uint16", 2, FP_UINT16},
    {"int16", 2, FP_INT16}, {"uint32", 4, FP_UINT32}, {"int32", 4, FP_INT32}, {"uint64", 8, FP_UINT64},
    {"int64", 8, FP_INT64}, {"float16", 2, FP_FLOAT16}, {"bfloat16", 2, FP_BFLOAT16}, {"float32", 4, FP_FLOAT32},
    {"float64", 8, FP_FLOAT64}, {"complex64", 8, FP_COMPLEX64}, {"complex128", 16, FP_COMPLEX128},
    /* names the format allows that have no constant of their own */
    {"complex32", 4, FP_DTYPE_OTHER}, {"float128", 16, FP_DTYPE_OTHER}, {"complex256", 32, FP_DTYPE_OTHER},
    {"float8_e4m3fn", 1, FP_DTYPE_OTHER}, {"float8_e4m3fnuz", 1, FP_DTYPE_OTHER}, {"float8_e5m2", 1, FP_DTYPE_OTHER},
    {"float8_e5m2fnuz", 1, FP_DTYPE_OTHER}, {"float8_e8m0fnu", 1, FP_DTYPE_OTHER}, {"float4_e2m1fn_x2", 1, FP_DTYPE_OTHER},
    {"bits8", 1, FP_DTYPE_OTHER}, {"bits16", 2, FP_DTYPE_OTHER}, {"bits1x8", 1, FP_DTYPE_OTHER},
    {"bits2x4", 1, FP_DTYPE_OTHER}, {"bits4x2", 1, FP_DTYPE_OTHER},
    {"int1", 1, FP_DTYPE_OTHER}, {"int2", 1, FP_DTYPE_OTHER}, {"int3", 1, FP_DTYPE_OTHER}, {"int4", 1, FP_DTYPE_OTHER},
    {"int5", 1, FP_DTYPE_OTHER}, {"int6", 1, FP_DTYPE_OTHER}, {"int7", 1, FP_DTYPE_OTHER}, {"uint1", 1, FP_DTYPE_OTHER},
    {"uint2", 1, FP_DTYPE_OTHER}, {"uint3", 1, FP_DTYPE_OTHER}, {"uint4", 1, FP_DTYPE_OTHER},
    {"uint5", 1, FP_DTYPE_OTHER}, {"uint6", 1, FP_DTYPE_OTHER}, {"uint7", 1, FP_DTYPE_OTHER},
};

size_t fp_itemsize_of(const char *name, fp_dtype *dtype) {
    for (size_t i = 0; i < sizeof DTYPES / sizeof DTYPES[0]; i++)
        if (!strcmp(DTYPES[i].name, name)) {
            if (dtype) *dtype = DTYPES[i].dtype;
            return DTYPES[i].size;
        }
    return 0;
}

const char *fp_dtype_name(fp_dtype dtype) {
    return (int)dtype >= 0 && dtype < FP_DTYPE_OTHER ? DTYPES[dtype].name : "other";
}

size_t fp_dtype_size(fp_dtype dtype) { return (int)dtype >= 0 && dtype < FP_DTYPE_OTHER ? DTYPES[dtype].size : 0; }

static void read_small(const char *path, char *out, size_t cap) {
    out[0] = 0;
    FILE *f = fopen(path, "r");
    if (!f) return;
    size_t n = fread(out, 1, cap - 1, f);
    fclose(f);
    out[n] = 0;
    while (n && (out[n - 1] == '\n' || out[n - 1] == ' ')) out[--n] = 0;
}

/* Linux's boot id and a process's start time (field 22 of /proc/PID/stat), "" where unknown. */
void fp_boot_id(char *out, size_t cap) { read_small("/proc/sys/kernel/random/boot_id", out, cap); }

void fp_start_ticks(long pid, char *out, size_t cap) {
    char path[64], stat[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    read_small(path, stat, sizeof stat);
    out[0] = 0;
    char *p = strrchr(stat, ')');
    if (!p) return;
    int field = 2; /* p is at the end of field 2 */
    for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " "))
        if (++field == 22) {
            snprintf(out, cap, "%s", tok);
            return;
        }
}

/* writers/<writer id>.json before any write, rewritten once a minute (docs/FORMAT.md, gc). */
int fp_hold_lease(fp_repo *r) {
    double now = fp_now();
    if (r->lease_written && now - r->lease_time < FP_LEASE_REFRESH) return FP_OK;
    char boot[128], start[64], key[400];
    fp_boot_id(boot, sizeof boot);
    fp_start_ticks((long)getpid(), start, sizeof start);
    sbuf b = {0};
    sb_puts(&b, "{\"writer\": ");
    sb_json_str(&b, r->writer, strlen(r->writer));
    sb_puts(&b, ", \"host\": ");
    sb_json_str(&b, r->host, strlen(r->host));
    sb_printf(&b, ", \"pid\": %ld, \"time\": ", (long)getpid());
    sb_json_double(&b, now);
    sb_puts(&b, ", \"boot\": ");
    sb_json_str(&b, boot, strlen(boot));
    sb_puts(&b, ", \"start\": ");
    sb_json_str(&b, start, strlen(start));
    sb_puts(&b, "}");
    snprintf(key, sizeof key, "writers/%s.json", r->writer);
    for (char *c = key + 8; *c; c++)
        if (*c == ':') *c = '-';
    int st = b.failed ? fp_fail(r, FP_ERR_NOMEM, "out of memory") : fp_write_key(r, key, b.p, b.n, NULL, 0, 0);
    sb_free(&b);
    if (!st) r->lease_written = 1, r->lease_time = now;
    return st;
}
