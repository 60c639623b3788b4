/* libforkpoint: read and write forkpoint repositories (docs/FORMAT.md, format 1.x) from C,
 * C++ and Fortran. A second implementation of the format, beside the Python package.
 *
 * Every function returns an fp_status (FP_OK is 0); on any other status, fp_errmsg(repo)
 * says what failed, where, and what to do next. A repository handle, and the versions and
 * saves made from it, are used by one thread at a time; the library keeps no global state.
 * Arrays are little-endian, row-major (C order); a Fortran array a(n1, n2) is the row-major
 * array of shape [n2, n1] (the Fortran module reverses shapes for you). */
#ifndef FORKPOINT_H
#define FORKPOINT_H
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FP_LIB_VERSION "0.1.0"
#define FP_ID_LEN 24   /* hex digits of a version id */
#define FP_MAX_DIMS 64

typedef enum {
    FP_OK = 0,
    FP_ERR_ARG = 1,         /* a wrong argument: null pointer, bad name, wrong shape or box, small buffer */
    FP_ERR_IO = 2,          /* the file system refused a read or a write (full disk, permissions) */
    FP_ERR_NOT_FOUND = 3,   /* no repository, ref, version, leaf or object of that name */
    FP_ERR_FORMAT = 4,      /* a record that breaks the format's rules (hostile or damaged manifest, ref) */
    FP_ERR_NEWER = 5,       /* written by a newer format version than this library reads: upgrade */
    FP_ERR_CORRUPT = 6,     /* stored bytes that do not match their hash or cannot be decoded */
    FP_ERR_CONFLICT = 7,    /* the branch moved since the save began, or another live run holds it */
    FP_ERR_NOMEM = 8,
    FP_ERR_UNSUPPORTED = 9  /* a codec or leaf this library does not read (e.g. pickled objects) */
} fp_status;

typedef enum {
    FP_BOOL, FP_UINT8, FP_INT8, FP_UINT16, FP_INT16, FP_UINT32, FP_INT32, FP_UINT64, FP_INT64,
    FP_FLOAT16, FP_BFLOAT16, FP_FLOAT32, FP_FLOAT64, FP_COMPLEX64, FP_COMPLEX128,
    FP_DTYPE_OTHER /* a dtype the format names that has no constant here (fp_leaf.dtype_name says which) */
} fp_dtype;

typedef enum { FP_CODEC_RAW = 0, FP_CODEC_ZSTD = 1 } fp_codec;

typedef struct fp_repo fp_repo;
typedef struct fp_version fp_version;
typedef struct fp_save fp_save;

/* The format's name for a dtype ("float32") and its element size in bytes (0 for FP_DTYPE_OTHER). */
const char *fp_dtype_name(fp_dtype dtype);
size_t fp_dtype_size(fp_dtype dtype);
/* A short name of a status ("corrupt"). */
const char *fp_status_name(int status);

/* ---- repositories ---- */
enum { FP_CREATE = 1 };
/* Open the repository at `path` (a local directory); with FP_CREATE, make it when absent.
 * *repo is set even when opening fails (except FP_ERR_NOMEM), so that fp_errmsg can say why;
 * close it with fp_close in every case. */
int fp_open(const char *path, int flags, fp_repo **repo);
/* Release the handle (and this process's writer lease). NULL is allowed. */
void fp_close(fp_repo *repo);
/* The message of the last error on this handle ("" after success). */
const char *fp_errmsg(const fp_repo *repo);

/* ---- saving a version ---- */
/* Begin a version on `branch` (created by the first save). The version's parent is the branch
 * head now; the commit fails with FP_ERR_CONFLICT if another writer moves the branch first. */
int fp_save_begin(fp_repo *repo, const char *branch, fp_save **save);
int fp_save_set_step(fp_save *save, int64_t step);
int fp_save_set_message(fp_save *save, const char *message);
/* A metric (finite) such as the loss; a later call with the same name replaces it. */
int fp_save_set_metric(fp_save *save, const char *name, double value);
/* User metadata: a JSON object's text, stored as it parses. */
int fp_save_set_meta(fp_save *save, const char *json_object);
/* How the following arrays are stored: raw (default) or zstd (kept only where it saves 5%). */
int fp_save_set_codec(fp_save *save, fp_codec codec);
/* Largest chunk a big array is split into along its first dimension (default 32 MiB). */
int fp_save_set_chunk_bytes(fp_save *save, size_t bytes);
/* Store a whole array under `path` ("model/w": '/' makes the tree; "~1" writes a '/' inside a
 * key, "~0" a '~'). The data is written (or packed) before the call returns: the caller may
 * reuse its buffer. ndim may be 0 (a scalar). */
int fp_save_put(fp_save *save, const char *path, fp_dtype dtype, int ndim, const int64_t *shape, const void *data);
/* Store one block of a global array: the box at `offset` with shape `block_shape` (row-major
 * data) of an array of `global_shape`. Blocks of one path, from this or (collective saves)
 * other processes, must tile the global array exactly; the commit checks it. */
int fp_save_put_block(fp_save *save, const char *path, fp_dtype dtype, int ndim, const int64_t *global_shape,
                      const int64_t *offset, const int64_t *block_shape, const void *data);
/* Write the manifest after every object is durable, then publish the branch record. On
 * success `id` (FP_ID_LEN + 1 bytes, may be NULL) holds the new version's id. The save is
 * released whatever the outcome. */
int fp_save_commit(fp_save *save, char *id);
/* Drop a save without committing (objects already written are left for gc). NULL is allowed. */
void fp_save_abort(fp_save *save);

/* ---- loading ---- */
typedef struct {
    const char *path;        /* the leaf's state path, "model/0.weight" */
    const char *kind;        /* "numpy", "torch", "numpy_scalar", "bytes", "pickle" */
    const char *dtype_name;  /* the format's dtype name */
    fp_dtype dtype;
    size_t itemsize;
    int ndim;
    const int64_t *shape;
    uint64_t nbytes;
    size_t nchunks;
    const char *codec;       /* the chunks' codec, or "mixed" */
} fp_leaf;

/* Open version `ref`: a branch, a tag, a version id or a unique prefix of one (4 hex digits
 * or more), each optionally followed by ~N (N first parents back). The manifest is checked
 * whole (its id, every leaf and chunk box) before this returns. */
int fp_load(fp_repo *repo, const char *ref, fp_version **version);
void fp_version_free(fp_version *version);
const char *fp_version_id(const fp_version *v);
const char *fp_version_branch(const fp_version *v);
/* 1 and *step when the version has a step, else 0. */
int fp_version_step(const fp_version *v, int64_t *step);
double fp_version_time(const fp_version *v);
const char *fp_version_message(const fp_version *v);
int fp_version_nparents(const fp_version *v);
const char *fp_version_parent(const fp_version *v, int i);
int fp_version_nmetrics(const fp_version *v);
/* Metric i: its name and, when it is a number, 1 and its value (else 0). */
int fp_version_metric(const fp_version *v, int i, const char **name, double *value);
/* The version's metadata as canonical JSON text. */
const char *fp_version_meta(const fp_version *v);
/* 1 for a version whose data retention released (a stub: lineage only, no leaves). */
int fp_version_pruned(const fp_version *v);
size_t fp_version_nleaves(const fp_version *v);
int fp_version_leaf(const fp_version *v, size_t i, fp_leaf *leaf);
/* The index of the leaf at `path` (FP_ERR_NOT_FOUND when there is none). */
int fp_version_find(const fp_version *v, const char *path, size_t *index);
/* Read a whole leaf into `buf` (at least its nbytes), verifying every byte against its hash. */
int fp_read(fp_version *v, const char *path, void *buf, size_t bufsize);
/* fp_read, first checking that the leaf has this dtype and shape (FP_ERR_ARG saying what it
 * has when it differs): for callers whose buffer is a typed array, as Fortran's. */
int fp_read_as(fp_version *v, const char *path, fp_dtype dtype, int ndim, const int64_t *shape, void *buf, size_t bufsize);
/* Read the box at `offset` of shape `shape` of a leaf (row-major into `buf`), reading only the
 * chunks, and of raw chunks only the 1 MiB blocks, that it covers; every byte verified. */
int fp_read_box(fp_version *v, const char *path, int ndim, const int64_t *offset, const int64_t *shape, void *buf,
                size_t bufsize);

/* ---- history and refs ---- */
/* Resolve a ref expression to a version id (FP_ID_LEN + 1 bytes). */
int fp_resolve(fp_repo *repo, const char *ref, char *id);
/* Call `fn` for `ref` and each first parent before it, newest first, until `fn` returns
 * nonzero or `max` versions (0: no limit) were shown. The version is valid during the call. */
typedef int (*fp_log_fn)(const fp_version *v, void *user);
int fp_log(fp_repo *repo, const char *ref, int max, fp_log_fn fn, void *user);
/* Call `fn` for every branch ("heads") and tag ("tags") with the version it names. */
typedef int (*fp_ref_fn)(const char *kind, const char *name, const char *target, void *user);
int fp_refs(fp_repo *repo, fp_ref_fn fn, void *user);
/* Point tag `name` at `ref` (FP_ERR_CONFLICT when it names another version already, FP_ERR_ARG
 * when a branch has that name). */
int fp_tag(fp_repo *repo, const char *name, const char *ref);

#ifdef __cplusplus
}
#endif
#endif
