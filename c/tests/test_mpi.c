/* The collective save's protocol under mpiexec (tests/test_c.py runs it):
 *     test_mpi MODE REPO
 * ok: every rank puts its rows of "a" and a whole "w" of its own rank number (rank 0's is kept);
 * gap: rank 1 puts nothing; badput: rank 1 puts a block outside "a"; branch: rank 1 names
 * another branch; conflict: another writer moves the branch between begin and commit.
 * Each rank prints "RANK STATUS ID-OR-MESSAGE" on one line. */
#include <mpi.h>
#include <stdio.h>
#include <string.h>

#include <forkpoint.h>
#include <forkpoint_mpi.h>

#define ROWS 3
#define COLS 4

static void report(int rank, int st, fp_repo *repo, const char *id) {
    printf("%d %d %s\n", rank, st, st ? fp_errmsg(repo) : id);
    fflush(stdout);
}

/* A plain save on `branch` from this rank alone, as another writer would. */
static int move_branch(fp_repo *repo, const char *branch) {
    fp_save *other;
    int32_t x = 7;
    int st = fp_save_begin(repo, branch, &other);
    if (!st) st = fp_save_put(other, "x", FP_INT32, 0, NULL, &x);
    return st ? st : fp_save_commit(other, NULL);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (argc != 3) {
        if (rank == 0) fprintf(stderr, "usage: test_mpi ok|gap|badput|branch|conflict REPO\n");
        MPI_Finalize();
        return 2;
    }
    const char *mode = argv[1];
    fp_repo *repo;
    char id[FP_ID_LEN + 1] = "";
    int st = fp_open(argv[2], FP_CREATE, &repo);
    if (st) {
        report(rank, st, repo, id);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    fp_save *save;
    const char *branch = !strcmp(mode, "branch") && rank == 1 ? "elsewhere" : "main";
    st = fp_mpi_save_begin(repo, MPI_COMM_WORLD, branch, &save);
    if (!st) {
        int32_t rows[ROWS][COLS], w[2] = {rank, rank};
        for (int i = 0; i < ROWS; i++)
            for (int j = 0; j < COLS; j++) rows[i][j] = (rank * ROWS + i) * 100 + j;
        int64_t global[2] = {(int64_t)size * ROWS, COLS}, off[2] = {(int64_t)rank * ROWS, 0}, len[2] = {ROWS, COLS};
        int64_t wshape[1] = {2};
        if (!strcmp(mode, "badput") && rank == 1) off[0] = (int64_t)size * ROWS; /* past the end */
        fp_save_set_step(save, 10 + rank);
        fp_save_set_message(save, "collective");
        if (!(!strcmp(mode, "gap") && rank == 1)) fp_save_put_block(save, "a", FP_INT32, 2, global, off, len, rows);
        fp_save_put(save, "w", FP_INT32, 1, wshape, w);
        if (!strcmp(mode, "conflict") && rank == 0 && (st = move_branch(repo, "main"))) report(rank, st, repo, id);
        st = fp_mpi_save_commit(save, id);
    }
    report(rank, st, repo, id);
    fp_close(repo);
    MPI_Finalize();
    return 0;
}
