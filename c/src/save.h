/* The save session shared by fp_save_* (save.c) and the collective save (mpi.c). */
#ifndef FP_SAVE_H
#define FP_SAVE_H
#include "internal.h"

typedef struct {
    int64_t off[FP_MAX_DIMS], len[FP_MAX_DIMS];
    char hash[65], object[65];
    uint64_t start, size;
    const char *codec;
} fp_schunk;

typedef struct {
    char *path;
    fp_dtype dtype;
    size_t itemsize;
    int ndim;
    int64_t shape[FP_MAX_DIMS];
    fp_schunk *chunks;
    size_t nchunks, cap;
} fp_sleaf;

typedef struct {
    uint8_t *buf;
    size_t n, cap;
    size_t *members; /* (leaf, chunk) index pairs placed in this pack */
    size_t nmembers, mcap;
} fp_pack;

struct fp_save {
    fp_repo *repo;
    char *branch;
    char head[FP_ID_LEN + 1]; /* the branch head when the save began ("" for a new branch) */
    int64_t head_seq;
    int has_step;
    int64_t step;
    char *message;
    char **metric_names;
    double *metric_values;
    size_t nmetrics;
    char *meta; /* canonical JSON */
    fp_codec codec;
    size_t chunk_bytes;
    fp_sleaf *leaves;
    size_t nleaves, cap;
    fp_pack packs[5]; /* by element class: other, 2-, 4-, 8- and 16-byte floating point */
    uint64_t stored;
    int world_size;
    int skip_whole; /* collective saves: ranks other than 0 leave whole arrays to rank 0 */
    int failed;     /* collective saves: the first failed put, reported to every rank by the commit */
    char failed_msg[2048];
    void *coll;     /* collective saves: the communicator (mpi.c), released by coll_free */
    void (*coll_free)(void *coll);
};

fp_save *fp_save_new(fp_repo *r, const char *branch);
int fp_save_flush(fp_save *s);
/* This save's leaves and chunks as JSON (what a rank sends the committing rank). */
int fp_save_describe(fp_save *s, sbuf *out);
/* Add the leaves and chunks another rank described. */
int fp_save_absorb(fp_save *s, const char *json, size_t len);
/* Check that every leaf is tiled, write the manifest and publish the branch record. */
int fp_save_finish(fp_save *s, char *id);
int fp_save_check_branch(fp_save *s);
#endif
