/* The collective save of forkpoint_mpi.h: ranks agree on every step's outcome, so a failure on
 * one rank fails the save on all of them instead of leaving some waiting in a collective. */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "../include/forkpoint_mpi.h"
#include "save.h"

typedef struct {
    MPI_Comm comm;
    int rank, size;
} coll;

static void coll_free(void *p) {
    coll *c = p;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Comm_free(&c->comm);
    free(c);
}

/* Every rank's status in, one out: the failure of the lowest failing rank, with its message,
 * on every rank ("rank K: ..."), or FP_OK everywhere. */
static int agree(fp_repo *r, const coll *c, int st) {
    int mine = st ? c->rank : c->size, first;
    MPI_Allreduce(&mine, &first, 1, MPI_INT, MPI_MIN, c->comm);
    if (first == c->size) return FP_OK;
    struct {
        int status;
        char msg[sizeof r->msg];
    } out = {st, ""};
    if (c->rank == first) snprintf(out.msg, sizeof out.msg, "%s", fp_errmsg(r));
    MPI_Bcast(&out, (int)sizeof out, MPI_BYTE, first, c->comm);
    out.msg[sizeof out.msg - 1] = 0;
    if (c->size == 1) return fp_fail(r, out.status, "%s", out.msg);
    return fp_fail(r, out.status, "rank %d of %d: %s", first, c->size, out.msg);
}

/* The same branch on every rank, or a clear error on all. */
static int same_branch(fp_repo *r, const coll *c, const char *branch) {
    char root[FP_MAX_NAME + 1] = "";
    snprintf(root, sizeof root, "%s", branch);
    MPI_Bcast(root, (int)sizeof root, MPI_CHAR, 0, c->comm);
    if (strcmp(root, branch))
        return fp_fail(r, FP_ERR_ARG, "began a collective save on branch '%.200s', and rank 0 on '%.200s': give every "
                       "rank the same branch", branch, root);
    return FP_OK;
}

int fp_mpi_save_begin(fp_repo *r, MPI_Comm comm, const char *branch, fp_save **out) {
    if (!r) return FP_ERR_ARG;
    if (!out) return fp_fail(r, FP_ERR_ARG, "fp_mpi_save_begin: no place for the save");
    *out = NULL;
    coll *c = calloc(1, sizeof *c);
    if (!c) return fp_fail(r, FP_ERR_NOMEM, "out of memory"); /* the others fail in their commit's agreement */
    MPI_Comm_dup(comm, &c->comm);
    MPI_Comm_rank(c->comm, &c->rank);
    MPI_Comm_size(c->comm, &c->size);
    int st = fp_check_name(r, branch ? branch : "", "branch");
    fp_save *s = NULL;
    if (!st && !(s = fp_save_new(r, branch))) st = fp_fail(r, FP_ERR_NOMEM, "out of memory");
    if (!st && c->rank == 0) st = fp_save_check_branch(s);
    if ((st = agree(r, c, st))) {
        fp_save_abort(s);
        coll_free(c);
        return st;
    }
    if ((st = agree(r, c, same_branch(r, c, branch)))) {
        fp_save_abort(s);
        coll_free(c);
        return st;
    }
    s->coll = c, s->coll_free = coll_free;
    s->skip_whole = c->rank != 0;
    s->world_size = c->size;
    *out = s;
    return fp_ok(r);
}

/* Rank 0: the descriptions of every other rank's leaves (lens and displs: one int per rank
 * there), absorbed into its own save. */
static int gather_descriptions(fp_save *s, const coll *c, const sbuf *mine, int *lens, int *displs) {
    fp_repo *r = s->repo;
    int len = (int)mine->n, st = FP_OK;
    char *all = NULL;
    MPI_Gather(&len, 1, MPI_INT, lens, 1, MPI_INT, 0, c->comm);
    if (c->rank == 0) {
        long long total = 0;
        for (int k = 0; k < c->size; k++) displs[k] = (int)total, total += lens[k];
        if (total > INT_MAX) st = fp_fail(r, FP_ERR_ARG, "the ranks' block lists exceed 2 GiB: use larger blocks");
        else if (!(all = malloc((size_t)total + 1))) st = fp_fail(r, FP_ERR_NOMEM, "out of memory");
        /* a failed root still takes part, receiving nothing, so that no rank waits forever */
        if (st) memset(lens, 0, (size_t)c->size * sizeof *lens), memset(displs, 0, (size_t)c->size * sizeof *displs);
    }
    MPI_Gatherv(mine->p ? mine->p : "", len, MPI_CHAR, all, lens, displs, MPI_CHAR, 0, c->comm);
    for (int k = 1; c->rank == 0 && !st && k < c->size; k++) st = fp_save_absorb(s, all + displs[k], (size_t)lens[k]);
    free(all);
    return st;
}

int fp_mpi_save_commit(fp_save *s, char *id_out) {
    if (!s) return FP_ERR_ARG;
    fp_repo *r = s->repo;
    if (!s->coll) return fp_fail(r, FP_ERR_ARG, "not a collective save: commit a save of fp_save_begin with fp_save_commit");
    const coll *c = s->coll;
    int st = s->failed ? fp_fail(r, s->failed, "%s", s->failed_msg) : fp_save_flush(s);
    sbuf mine = {0};
    int *lens = NULL, *displs = NULL;
    if (!st && c->rank) st = fp_save_describe(s, &mine);
    if (!st && mine.n > INT_MAX) st = fp_fail(r, FP_ERR_ARG, "this rank's block list exceeds 2 GiB: use larger blocks");
    if (!st && c->rank == 0 && (!(lens = calloc((size_t)c->size, sizeof *lens)) ||
                                !(displs = calloc((size_t)c->size, sizeof *displs))))
        st = fp_fail(r, FP_ERR_NOMEM, "out of memory");
    if (!(st = agree(r, c, st))) {
        int rst = gather_descriptions(s, c, &mine, lens, displs);
        char id[FP_ID_LEN + 1] = "";
        if (c->rank == 0 && !rst) rst = fp_save_finish(s, id);
        MPI_Bcast(id, (int)sizeof id, MPI_CHAR, 0, c->comm);
        st = agree(r, c, c->rank == 0 ? rst : FP_OK);
        if (!st && id_out) memcpy(id_out, id, sizeof id);
    }
    free(lens), free(displs);
    sb_free(&mine);
    fp_save_abort(s);
    return st;
}
