/* Shared internals of libforkpoint: the handle, errors, file helpers, hashing, objects,
 * refs and parsed manifests. Nothing here is part of the public API. */
#ifndef FP_INTERNAL_H
#define FP_INTERNAL_H
#include <stdarg.h>
#include <stdio.h>

#include "../include/forkpoint.h"
#include "blake3.h"
#include "json.h"

#define FP_FORMAT_MAJOR 1
#define FP_FORMAT_MINOR 3
#define FP_BLOCK_BYTES ((size_t)1 << 20)
#define FP_PACK_LEAF_MAX ((size_t)1 << 20)   /* leaves below this are packed */
#define FP_PACK_BYTES ((size_t)16 << 20)
#define FP_MAX_PACK_DECODE ((uint64_t)256 << 20)
#define FP_MAX_MANIFEST ((size_t)1 << 30)
#define FP_MAX_LEAVES 5000000
#define FP_MAX_CHUNKS 1000000
#define FP_MAX_NAME 4096
#define FP_LEASE_REFRESH 60.0
#define FP_HOLD_EXPIRY 120.0

struct fp_repo {
    char *root;
    char msg[2048];
    char host[256];
    char writer[320];
    int lease_written;
    double lease_time;
};

int fp_fail(fp_repo *r, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline int fp_ok(fp_repo *r) { r->msg[0] = 0; return FP_OK; }

/* files, by key relative to the repository root */
char *fp_path(const fp_repo *r, const char *key);
int fp_mkdirs(fp_repo *r, const char *dir);
int fp_fsync_dir(fp_repo *r, const char *dir);
/* The whole file of `key` (malloc'd, NUL-terminated); FP_ERR_NOT_FOUND when absent, FP_ERR_FORMAT
 * when it is larger than `limit`. */
int fp_read_key(fp_repo *r, const char *key, size_t limit, char **data, size_t *len);
/* Write `key` durably: a temp file under tmp/, fsync, then rename (or, with `exclusive`, link,
 * which fails with FP_ERR_CONFLICT when the key exists); the key's directory is fsynced. */
int fp_write_key(fp_repo *r, const char *key, const void *head, size_t head_len, const void *body, size_t body_len,
                 int exclusive);
int fp_exists(const fp_repo *r, const char *key);
double fp_now(void);
int fp_hold_lease(fp_repo *r);

/* hashing */
int fp_is_hex(const char *s, size_t n);
void fp_hex(const uint8_t *bytes, size_t n, char *out);
/* Content hash of docs/FORMAT.md: blake3 up to one block, else blake3("FPB1" | len | block digests). */
void fp_content_hash(const uint8_t *data, size_t len, char hex[65]);
void fp_block_digests(const uint8_t *data, size_t len, uint8_t *digests);
void fp_block_root(const uint8_t *digests, size_t nblocks, uint64_t len, char hex[65]);

/* objects */
/* Decode the object `name` whole (decoded length at most `limit`) and check it against its name. */
int fp_object_read(fp_repo *r, const char *name, uint64_t limit, uint8_t **data, size_t *len);
/* Bytes [lo, hi) of the decoded object `name` into `out`, verified: through the block table of
 * a raw object when it has a valid one, else by decoding it whole. */
int fp_object_range(fp_repo *r, const char *name, uint64_t limit, uint64_t lo, uint64_t hi, uint8_t *out);
/* Read a raw standalone object's payload straight into `out` (`len` bytes) and verify it;
 * FP_ERR_UNSUPPORTED (nothing reported) when the object is not raw, so the caller decodes it. */
int fp_object_read_into(fp_repo *r, const char *name, uint8_t *out, uint64_t len);
/* Decode a payload of codec `codec_id` into `out` (`length` bytes). */
int fp_decode_payload(fp_repo *r, const char *where, int codec_id, const uint8_t *payload, size_t plen, uint8_t *out,
                      uint64_t length);
/* Write `data` as the object of its content hash (raw, or zstd where that saves 5%); sets
 * `name` and `*stored` (bytes newly written, 0 when it existed: its mtime is refreshed). */
int fp_object_write(fp_repo *r, const uint8_t *data, size_t len, fp_codec codec, char name[65], uint64_t *stored,
                    const char **codec_used);
/* The highest seq of the write-once records under `dirkey` (-1 when there are none). */
int fp_list_top(fp_repo *r, const char *dirkey, int64_t *seq);
/* Linux's boot id, and a process's start time in clock ticks ("" where unknown). */
void fp_boot_id(char *out, size_t cap);
void fp_start_ticks(long pid, char *out, size_t cap);

/* refs */
int fp_check_name(fp_repo *r, const char *name, const char *what);
/* The target of ref `kind`/`name` ("heads" or "tags") and its highest seq; target "" when the ref
 * does not exist (or was deleted); seq -1 when it has no records. */
int fp_ref_read(fp_repo *r, const char *kind, const char *name, char target[FP_ID_LEN + 1], int64_t *seq);
/* Publish record seq for ref kind/name exclusively (FP_ERR_CONFLICT when another writer did first). */
int fp_ref_publish(fp_repo *r, const char *kind, const char *name, int64_t seq, const char *target);

/* manifests */
typedef struct {
    int64_t *off, *len;
    const char *hash, *object, *codec;
    uint64_t start, size;
    int delta_op; /* 0 none, 1 xor, 2 sub */
    size_t chain_n;
    const char **chain;
} fp_chunk;

typedef struct {
    const char *path, *kind, *dtype_name, *codec;
    fp_dtype dtype;
    size_t itemsize;
    int ndim;
    int64_t *shape;
    uint64_t nbytes;
    size_t nchunks;
    fp_chunk *chunks;
    long alias_of;
} fp_leafrec;

struct fp_version {
    fp_repo *repo;
    arena a;
    char id[FP_ID_LEN + 1];
    const jval *rec;
    const char *branch, *message, *meta;
    int has_step, pruned;
    int64_t step;
    double time;
    int nparents;
    const char *parents[64];
    const jval *metrics;
    size_t nleaves;
    fp_leafrec *leaves;
};

/* Read and check versions/<id>.json; `leaves` 0 parses only the record (for log). */
int fp_version_open(fp_repo *r, const char *id, int leaves, fp_version **out);
size_t fp_itemsize_of(const char *dtype_name, fp_dtype *dtype);
int fp_boxes_tile(const int64_t *shape, int ndim, const fp_chunk *chunks, size_t n);
#endif
