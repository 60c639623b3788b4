/* Objects (docs/FORMAT.md, Objects): the 16-byte header, the block table of raw payloads, the
 * codecs raw, zstd, planes+zstd and float-planes (decoded by the kernels the Python extension
 * uses, src/forkpoint/codecs/planes_decode.h), and content-addressed writes. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zstd.h>

#include "internal.h"
#include "planes_decode.h"

#define HEADER 16
#define ALIGNED 4096
#define MAX_HEADER (15 * ALIGNED)

static uint64_t le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static int open_object(fp_repo *r, const char *name, int *fd, char key[80]) {
    if (!fp_is_hex(name, 64)) return fp_fail(r, FP_ERR_FORMAT, "invalid object name '%.80s': expected 64 hex digits", name);
    snprintf(key, 80, "objects/%.2s/%s", name, name);
    char *p = fp_path(r, key);
    if (!p) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    *fd = open(p, O_RDONLY | O_NOFOLLOW);
    int e = errno;
    free(p);
    if (*fd < 0)
        return fp_fail(r, e == ENOENT ? FP_ERR_NOT_FOUND : FP_ERR_IO,
                       "object %s is missing (%s): the version cannot be read; `forkpoint verify` lists what else is damaged",
                       key, strerror(e));
    return FP_OK;
}

static int pread_all(int fd, void *buf, size_t n, uint64_t at) {
    uint8_t *p = buf;
    while (n) {
        ssize_t got = pread(fd, p, n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n, (off_t)at);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) return -1;
        p += got, n -= (size_t)got, at += (uint64_t)got;
    }
    return 0;
}

/* Header fields, checked: codec id, decoded length, header size. */
static int read_header(fp_repo *r, int fd, const char *key, uint64_t limit, uint8_t h[HEADER], int *codec,
                       uint64_t *length, size_t *hsize, uint64_t *fsize) {
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) return fp_fail(r, FP_ERR_IO, "cannot stat object %s", key);
    *fsize = (uint64_t)sb.st_size;
    if (*fsize < HEADER || pread_all(fd, h, HEADER, 0))
        return fp_fail(r, FP_ERR_CORRUPT, "object %s is truncated: %llu bytes, no header", key, (unsigned long long)*fsize);
    if (memcmp(h, "FPO1", 4)) return fp_fail(r, FP_ERR_CORRUPT, "object %s has no forkpoint object header", key);
    *codec = h[4];
    *hsize = (size_t)le(h + 6, 2);
    *length = le(h + 8, 8);
    if (*hsize < HEADER) return fp_fail(r, FP_ERR_CORRUPT, "object %s has an invalid header size %zu", key, *hsize);
    if (*length > limit)
        return fp_fail(r, FP_ERR_CORRUPT, "object %s declares %llu decoded bytes, more than the %llu its manifest allows: "
                       "corrupted or crafted", key, (unsigned long long)*length, (unsigned long long)limit);
    if (*hsize > *fsize)
        return fp_fail(r, FP_ERR_CORRUPT, "object %s is truncated: its header of %zu bytes is longer than the file", key, *hsize);
    return FP_OK;
}

/* An object file opened with its header read and checked (close o->fd when done). */
typedef struct {
    int fd;
    char key[80];
    uint8_t h[HEADER];
    int codec;
    uint64_t length, fsize;
    size_t hsize;
} objfile;

static int open_checked(fp_repo *r, const char *name, uint64_t limit, objfile *o) {
    int st = open_object(r, name, &o->fd, o->key);
    if (st) return st;
    if ((st = read_header(r, o->fd, o->key, limit, o->h, &o->codec, &o->length, &o->hsize, &o->fsize))) close(o->fd);
    return st;
}

static int check_hash(fp_repo *r, const char *key, const uint8_t *data, uint64_t len, const char *name) {
    char hex[65];
    fp_content_hash(data, (size_t)len, hex);
    return strcmp(hex, name) ? fp_fail(r, FP_ERR_CORRUPT, "object %s does not match its hash: corrupted", key) : FP_OK;
}

static int unzstd(fp_repo *r, const char *where, const uint8_t *in, size_t n, uint8_t *out, uint64_t length) {
    unsigned long long declared = ZSTD_getFrameContentSize(in, n);
    if (declared == ZSTD_CONTENTSIZE_ERROR) return fp_fail(r, FP_ERR_CORRUPT, "%s: not a zstd frame: corrupted", where);
    if (declared != ZSTD_CONTENTSIZE_UNKNOWN && declared != length)
        return fp_fail(r, FP_ERR_CORRUPT, "%s: a zstd frame declares %llu bytes where %llu are expected: corrupted", where,
                       declared, (unsigned long long)length);
    size_t got = ZSTD_decompress(out, (size_t)length, in, n);
    if (ZSTD_isError(got) || got != length)
        return fp_fail(r, FP_ERR_CORRUPT, "%s: zstd frame does not decode to %llu bytes (%s): corrupted", where,
                       (unsigned long long)length, ZSTD_isError(got) ? ZSTD_getErrorName(got) : "short");
    return FP_OK;
}

static int inflate_exact(fp_repo *r, const char *where, const uint8_t *in, size_t n, uint8_t *out, size_t length) {
    Decoder *d = malloc(2 * sizeof *d);
    if (!d) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    size_t produced = 0;
    int s = inflate_kernel(in, n, out, length, d, d + 1, &produced);
    free(d);
    if (s == 0) return FP_OK;
    return fp_fail(r, FP_ERR_CORRUPT, "%s: a deflate plane of %zu bytes %s: corrupted", where, length,
                   s == INFLATES_PAST ? "inflates to more" : s == INFLATES_SHORT ? "inflates to fewer"
                                                                              : "has an invalid code or header");
}

enum { RAW = 0, ZSTDC = 1, HUFFMAN = 2, SEVEN = 4, SPARSE = 5 };
enum { ROTATED = 1, GRID = 2, MATCH = 4 };

static int decode_plane(fp_repo *r, const char *where, int coder, const uint8_t *in, size_t n, uint8_t *out, size_t m) {
    switch (coder) {
    case RAW:
        if (n != m) return fp_fail(r, FP_ERR_CORRUPT, "%s: a raw plane of %zu bytes holds %zu: corrupted", where, m, n);
        memcpy(out, in, m);
        return FP_OK;
    case ZSTDC: return unzstd(r, where, in, n, out, m);
    case HUFFMAN: return inflate_exact(r, where, in, n, out, m);
    case SEVEN:
        if (n != (7 * m + 7) / 8) return fp_fail(r, FP_ERR_CORRUPT, "%s: %zu packed bytes cannot hold %zu seven-bit bytes", where, n, m);
        unpack_seven_kernel(in, out, m);
        return FP_OK;
    case SPARSE: {
        if (n < 8) return fp_fail(r, FP_ERR_CORRUPT, "%s: a sparse plane without its head", where);
        uint64_t bitmap_bytes = le(in, 4), count = le(in + 4, 4);
        if (count > m || 8 + bitmap_bytes > n)
            return fp_fail(r, FP_ERR_CORRUPT, "%s: a sparse plane's counts do not fit its bytes: corrupted", where);
        size_t nb = (m + 7) / 8;
        uint8_t *bitmap = malloc(nb + count + 1);
        if (!bitmap) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
        uint8_t *nonzero = bitmap + nb;
        int st = inflate_exact(r, where, in + 8, (size_t)bitmap_bytes, bitmap, nb);
        if (!st) st = inflate_exact(r, where, in + 8 + bitmap_bytes, n - 8 - (size_t)bitmap_bytes, nonzero, (size_t)count);
        if (!st && ((m % 8 && bitmap[m / 8] >> (m % 8)) || popcount_bytes(bitmap, nb) != count))
            st = fp_fail(r, FP_ERR_CORRUPT, "%s: a sparse plane's bitmap does not match its nonzero bytes: corrupted", where);
        if (!st) join_sparse_portable(bitmap, nonzero, (size_t)count, out, m);
        free(bitmap);
        return st;
    }
    }
    return fp_fail(r, FP_ERR_CORRUPT, "%s: unknown plane coder %d", where, coder);
}

/* float-planes (codec 3): docs/FORMAT.md gives every field and check this follows. */
static int decode_float_planes(fp_repo *r, const char *where, const uint8_t *v, size_t plen, uint8_t *out,
                               uint64_t length) {
    if (plen < 16) return fp_fail(r, FP_ERR_CORRUPT, "%s: float-planes payload of %zu bytes has no head", where, plen);
    int version = v[0], w = v[1];
    unsigned field = (unsigned)le(v + 2, 2);
    uint64_t count = le(v + 4, 8), per = le(v + 12, 4);
    unsigned skew = version == 6 ? field : 0;
    if (version > 6)
        return fp_fail(r, FP_ERR_NEWER, "%s: float-planes payload version %d is newer than this library reads (6); "
                       "upgrade libforkpoint", where, version);
    if (version < 1 || (w != 1 && w != 2 && w != 4 && w != 8) || count * (uint64_t)w != length || per < 1 ||
        skew >= ALIGNED || count > length)
        return fp_fail(r, FP_ERR_CORRUPT, "%s: float-planes payload v%d of %llux%d bytes, expected %llu: corrupted", where,
                       version, (unsigned long long)count, w, (unsigned long long)length);
    size_t pos = 16;
    uint64_t row = 0;
    if (version >= 3) {
        if (plen < 20) return fp_fail(r, FP_ERR_CORRUPT, "%s: float-planes payload truncated", where);
        row = le(v + 16, 4);
        pos = 20;
        if (row && (per % row || count % row))
            return fp_fail(r, FP_ERR_CORRUPT, "%s: rows of %llu elements do not tile the segments", where, (unsigned long long)row);
    }
    uint64_t segments = count ? (count + per - 1) / per : 1;
    if (segments * (uint64_t)w * 4 > plen)
        return fp_fail(r, FP_ERR_CORRUPT, "%s: a payload of %zu bytes cannot hold the table of %llu segments", where, plen,
                       (unsigned long long)segments);
    size_t layout_bytes = version == 1 ? (size_t)w : (size_t)segments * (size_t)(w + 1);
    size_t nplanes = (size_t)segments * (size_t)w;
    if (pos + layout_bytes + 4 * nplanes > plen) return fp_fail(r, FP_ERR_CORRUPT, "%s: float-planes table truncated", where);
    const uint8_t *layouts = v + pos;
    pos += layout_bytes;
    const uint8_t *lengths = v + pos;
    pos += 4 * nplanes;
    uint64_t *offsets = malloc((nplanes + 1) * sizeof *offsets);
    if (!offsets) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    int st = FP_OK;
    uint64_t at = pos;
    for (size_t i = 0; i < nplanes && !st; i++) {
        size_t j = i / (size_t)w, k = i % (size_t)w;
        int form = version == 1 ? (int)(field & 1) : layouts[j * (size_t)(w + 1)];
        int coder = version == 1 ? layouts[k] : layouts[j * (size_t)(w + 1) + 1 + k];
        int forms_ok = form <= 3 || (version >= 4 && (form == 4 || form == 5));
        int coder_ok = coder <= 2 || (coder == SEVEN && version >= 3) || (coder == SPARSE && version >= 5);
        if (!forms_ok || ((form & GRID) && !row) || !coder_ok || (w == 1 && (form & ROTATED))) {
            st = fp_fail(r, FP_ERR_CORRUPT, "%s: float-planes payload names an unknown segment form or plane coder", where);
            break;
        }
        uint64_t lo = (uint64_t)j * per, n = count - lo < per ? count - lo : per;
        if (!count) n = 0;
        if (version == 6 && coder == RAW && n % ALIGNED == 0) at += (ALIGNED - (at + skew) % ALIGNED) % ALIGNED;
        offsets[i] = at;
        at += le(lengths + 4 * i, 4);
    }
    if (!st && at != plen)
        st = fp_fail(r, FP_ERR_CORRUPT, "%s: float-planes payload holds %zu bytes, its table says %llu: corrupted", where,
                     plen, (unsigned long long)at);
    uint8_t *planes = NULL;
    if (!st && count && !(planes = malloc((size_t)(per < count ? per : count) * (size_t)w)))
        st = fp_fail(r, FP_ERR_NOMEM, "out of memory");
    for (uint64_t j = 0; j < segments && !st && count; j++) {
        uint64_t lo = j * per, n = count - lo < per ? count - lo : per;
        int form = version == 1 ? (int)(field & 1) : layouts[j * (size_t)(w + 1)];
        const uint8_t *shifts = NULL;
        size_t need = 0;
        for (int k = 0; k < w && !st; k++) {
            size_t i = (size_t)j * (size_t)w + (size_t)k;
            const uint8_t *coded = v + offsets[i];
            size_t clen = (size_t)le(lengths + 4 * i, 4);
            int coder = version == 1 ? layouts[k] : layouts[j * (size_t)(w + 1) + 1 + (size_t)k];
            if (k == w - 1 && (form & (GRID | MATCH))) {
                need = form & GRID ? (size_t)(n / row + row) : 2 * (size_t)((n + 255) / 256);
                if (clen < need) {
                    st = fp_fail(r, FP_ERR_CORRUPT, "%s: segment %llu's side bytes are truncated", where, (unsigned long long)j);
                    break;
                }
                shifts = coded;
                coded += need, clen -= need;
            }
            st = decode_plane(r, where, coder, coded, clen, planes + (size_t)k * n, (size_t)n);
        }
        if (st) break;
        uint8_t *top = planes + (size_t)(w - 1) * n;
        if (shifts && (form & GRID)) {
            size_t rows = (size_t)(n / row);
            apply_grid_kernel(top, top, rows, (size_t)row, shifts, shifts + rows, 1);
        } else if (shifts && unmatch_rows_kernel(top, shifts, (size_t)n, 256) >= 0) {
            st = fp_fail(r, FP_ERR_CORRUPT, "%s: row matching refers to a row before the first: corrupted", where);
            break;
        }
        if (w == 1) memcpy(out + lo, planes, (size_t)n);
        else join_from(planes, out + lo * (uint64_t)w, (size_t)n, 0, w, form & ROTATED);
    }
    free(planes);
    free(offsets);
    return st;
}

int fp_decode_payload(fp_repo *r, const char *where, int codec, const uint8_t *p, size_t n, uint8_t *out, uint64_t length) {
    switch (codec) {
    case 0:
        if (n != length) return fp_fail(r, FP_ERR_CORRUPT, "%s: raw payload of %zu bytes, header says %llu: truncated or corrupted",
                                        where, n, (unsigned long long)length);
        memcpy(out, p, n);
        return FP_OK;
    case 1: return unzstd(r, where, p, n, out, length);
    case 2: {
        if (n < 1) return fp_fail(r, FP_ERR_CORRUPT, "%s: empty planes+zstd payload", where);
        int w = p[0];
        if (w <= 1) return unzstd(r, where, p + 1, n - 1, out, length);
        if (length % (uint64_t)w) return fp_fail(r, FP_ERR_CORRUPT, "%s: %llu bytes are not whole %d-byte elements", where,
                                                 (unsigned long long)length, w);
        uint8_t *planes = malloc(length ? (size_t)length : 1);
        if (!planes) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
        int st = unzstd(r, where, p + 1, n - 1, planes, length);
        size_t count = (size_t)(length / (uint64_t)w);
        for (size_t i = 0; !st && i < count; i++)
            for (int k = 0; k < w; k++) out[i * (size_t)w + (size_t)k] = planes[(size_t)k * count + i];
        free(planes);
        return st;
    }
    case 3: return decode_float_planes(r, where, p, n, out, length);
    }
    return fp_fail(r, FP_ERR_UNSUPPORTED, "%s uses codec id %d, which this library does not know (a newer forkpoint "
                   "wrote it?): upgrade libforkpoint", where, codec);
}

int fp_object_read(fp_repo *r, const char *name, uint64_t limit, uint8_t **data, size_t *len) {
    objfile o;
    int st = open_checked(r, name, limit, &o);
    if (st) return st;
    const char *key = o.key;
    uint64_t length = o.length;
    uint8_t *payload = NULL, *out = NULL;
    /* a payload can be a little larger than what it decodes to (float-planes tables), never much */
    if (o.fsize - o.hsize > length + length / 8 + (1u << 20)) {
        st = fp_fail(r, FP_ERR_CORRUPT, "object %s holds %llu payload bytes for %llu decoded: corrupted", key,
                     (unsigned long long)(o.fsize - o.hsize), (unsigned long long)length);
        goto done;
    }
    size_t plen = (size_t)(o.fsize - o.hsize);
    out = malloc(length ? (size_t)length : 1);
    payload = o.codec == 0 ? out : malloc(plen ? plen : 1);
    if (!out || !payload) {
        st = fp_fail(r, FP_ERR_NOMEM, "out of memory for object %s (%llu bytes)", key, (unsigned long long)length);
        goto done;
    }
    if (pread_all(o.fd, payload, plen, o.hsize)) {
        st = fp_fail(r, FP_ERR_IO, "cannot read object %s: %s", key, strerror(errno));
        goto done;
    }
    if (o.codec == 0) {
        if (plen != length) st = fp_fail(r, FP_ERR_CORRUPT, "object %s is truncated: %zu of %llu bytes", key, plen,
                                         (unsigned long long)length);
    } else {
        st = fp_decode_payload(r, key, o.codec, payload, plen, out, length);
    }
    if (!st) st = check_hash(r, key, out, length, name);
done:
    close(o.fd);
    if (payload != out) free(payload);
    if (st) free(out);
    else *data = out, *len = (size_t)length;
    return st;
}

int fp_object_read_into(fp_repo *r, const char *name, uint8_t *out, uint64_t len) {
    objfile o;
    int st = open_checked(r, name, len, &o);
    if (st) return st;
    if (o.codec != 0) st = FP_ERR_UNSUPPORTED;
    else if (o.length != len || o.fsize - o.hsize != len)
        st = fp_fail(r, FP_ERR_CORRUPT, "object %s holds %llu bytes, its chunk %llu: truncated or corrupted", o.key,
                     (unsigned long long)(o.fsize - o.hsize), (unsigned long long)len);
    else if (pread_all(o.fd, out, (size_t)len, o.hsize))
        st = fp_fail(r, FP_ERR_IO, "cannot read object %s: %s", o.key, strerror(errno));
    else
        st = check_hash(r, o.key, out, len, name);
    close(o.fd);
    return st;
}

int fp_object_range(fp_repo *r, const char *name, uint64_t limit, uint64_t lo, uint64_t hi, uint8_t *out) {
    objfile o;
    int st = open_checked(r, name, limit, &o);
    if (st) return st;
    int fd = o.fd, codec = o.codec;
    const char *key = o.key;
    uint64_t length = o.length, fsize = o.fsize;
    size_t hsize = o.hsize;
    uint8_t *table = NULL, *block = NULL;
    if (hi > length || lo > hi) {
        st = fp_fail(r, FP_ERR_CORRUPT, "object %s holds %llu bytes, a chunk reads up to %llu", key,
                     (unsigned long long)length, (unsigned long long)hi);
        goto done;
    }
    size_t nblocks = (size_t)((length + FP_BLOCK_BYTES - 1) / FP_BLOCK_BYTES);
    int usable = codec == 0 && nblocks >= 2 && HEADER + 32 * nblocks <= hsize && fsize - hsize == length;
    if (usable) {
        table = malloc(32 * nblocks);
        if (!table) { st = fp_fail(r, FP_ERR_NOMEM, "out of memory"); goto done; }
        char root[65];
        if (pread_all(fd, table, 32 * nblocks, HEADER)) usable = 0;
        else fp_block_root(table, nblocks, length, root), usable = !strcmp(root, name);
    }
    if (!usable) { /* no valid table: decode and verify the whole object */
        close(fd);
        fd = -1;
        free(table);
        uint8_t *all;
        size_t n;
        if ((st = fp_object_read(r, name, limit, &all, &n))) return st;
        memcpy(out, all + lo, (size_t)(hi - lo));
        free(all);
        return FP_OK;
    }
    block = malloc(FP_BLOCK_BYTES);
    if (!block) { st = fp_fail(r, FP_ERR_NOMEM, "out of memory"); goto done; }
    for (uint64_t b = lo / FP_BLOCK_BYTES; hi > lo && b <= (hi - 1) / FP_BLOCK_BYTES; b++) {
        uint64_t start = b * FP_BLOCK_BYTES, n = length - start < FP_BLOCK_BYTES ? length - start : FP_BLOCK_BYTES;
        uint8_t digest[32];
        if (pread_all(fd, block, (size_t)n, hsize + start)) {
            st = fp_fail(r, FP_ERR_IO, "cannot read object %s: %s", key, strerror(errno));
            break;
        }
        fp_blake3(block, (size_t)n, digest);
        if (memcmp(digest, table + 32 * b, 32)) {
            st = fp_fail(r, FP_ERR_CORRUPT, "object %s: block %llu does not match its hash: corrupted", key, (unsigned long long)b);
            break;
        }
        uint64_t a = lo > start ? lo : start, z = hi < start + n ? hi : start + n;
        memcpy(out + (a - lo), block + (a - start), (size_t)(z - a));
    }
done:
    if (fd >= 0) close(fd);
    free(table);
    free(block);
    return st;
}

static const char *codec_name_of(int id) {
    static const char *names[] = {"raw", "zstd", "planes+zstd", "float-planes"};
    return id >= 0 && id < 4 ? names[id] : "unknown";
}

int fp_object_write(fp_repo *r, const uint8_t *data, size_t len, fp_codec codec, char name[65], uint64_t *stored,
                    const char **codec_used) {
    size_t nblocks = len > FP_BLOCK_BYTES ? (len + FP_BLOCK_BYTES - 1) / FP_BLOCK_BYTES : 0;
    uint8_t *digests = nblocks ? malloc(32 * nblocks) : NULL;
    if (nblocks && !digests) return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    if (nblocks) { /* the block digests name the object and fill its table: hashed once */
        fp_block_digests(data, len, digests);
        fp_block_root(digests, nblocks, len, name);
    } else {
        fp_content_hash(data, len, name);
    }
    char key[80];
    snprintf(key, sizeof key, "objects/%.2s/%s", name, name);
    *stored = 0;
    *codec_used = "raw";
    int st = fp_hold_lease(r);
    char *path = st ? NULL : fp_path(r, key);
    if (!path) {
        free(digests);
        return st ? st : fp_fail(r, FP_ERR_NOMEM, "out of memory");
    }
    /* dedup: an object of this name holds these bytes; refresh its time so gc keeps it */
    int exists = utimensat(AT_FDCWD, path, NULL, 0) == 0;
    if (exists) { /* the manifest repeats the existing object's codec */
        int fd = open(path, O_RDONLY | O_NOFOLLOW);
        uint8_t h[HEADER];
        if (fd >= 0 && pread_all(fd, h, HEADER, 0) == 0 && !memcmp(h, "FPO1", 4)) *codec_used = codec_name_of(h[4]);
        if (fd >= 0) close(fd);
    }
    free(path);
    if (exists) {
        free(digests);
        return FP_OK;
    }
    uint8_t *encoded = NULL;
    size_t elen = 0;
    if (codec == FP_CODEC_ZSTD && len >= 64) {
        size_t bound = ZSTD_compressBound(len);
        encoded = malloc(bound);
        if (encoded) {
            elen = ZSTD_compress(encoded, bound, data, len, 1);
            if (ZSTD_isError(elen) || elen >= len / 100 * 95) { /* kept only where it saves 5% */
                free(encoded);
                encoded = NULL;
            }
        }
    }
    size_t hsize = HEADER;
    if (!encoded && nblocks) { /* raw and large: an aligned header holding the block table */
        size_t need = (HEADER + 32 * nblocks + ALIGNED - 1) / ALIGNED * ALIGNED;
        hsize = need <= MAX_HEADER ? need : ALIGNED;
    }
    uint8_t *head = calloc(1, hsize);
    if (!head) {
        free(encoded);
        free(digests);
        return fp_fail(r, FP_ERR_NOMEM, "out of memory");
    }
    memcpy(head, "FPO1", 4);
    head[4] = encoded ? 1 : 0;
    head[6] = (uint8_t)hsize, head[7] = (uint8_t)(hsize >> 8);
    for (int i = 0; i < 8; i++) head[8 + i] = (uint8_t)((uint64_t)len >> (8 * i));
    if (!encoded && nblocks && HEADER + 32 * nblocks <= hsize) memcpy(head + HEADER, digests, 32 * nblocks);
    st = fp_write_key(r, key, head, hsize, encoded ? encoded : data, encoded ? elen : len, 0);
    if (!st) *stored = hsize + (encoded ? elen : len), *codec_used = encoded ? "zstd" : "raw";
    free(head);
    free(encoded);
    free(digests);
    return st;
}
