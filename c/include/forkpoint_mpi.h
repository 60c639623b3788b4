/* libforkpoint's collective save over MPI: every rank of a communicator writes the objects of
 * its own blocks of the global arrays, and rank 0 commits one version holding all of them (the
 * chunk boxes of docs/FORMAT.md). Link with -lforkpoint_mpi -lforkpoint -lzstd, built by mpicc.
 *
 * Every rank opens the repository itself (fp_open), and calls fp_mpi_save_begin and
 * fp_mpi_save_commit with the same arguments; in between each rank puts its blocks with
 * fp_save_put_block. A whole array (fp_save_put, or a block that is the whole array) is
 * stored once, from rank 0. The step, message, metrics and meta of rank 0 are recorded. A
 * failure on any rank (a refused put, a full disk, a moved branch) makes the commit fail on
 * every rank with the same status and message, and nothing is committed. Restart on any
 * number of ranks: each one opens the version with fp_load and reads its boxes with
 * fp_read_box (no collective call is needed to read). */
#ifndef FORKPOINT_MPI_H
#define FORKPOINT_MPI_H
#include <mpi.h>

#include "forkpoint.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Collective: begin a version on `branch` across `comm` (the branch checked on rank 0). */
int fp_mpi_save_begin(fp_repo *repo, MPI_Comm comm, const char *branch, fp_save **save);
/* Collective: make every rank's objects durable, then rank 0 writes the manifest and publishes
 * the branch record; every rank gets the same status and (on success) the version `id`
 * (FP_ID_LEN + 1 bytes, may be NULL). The save is released whatever the outcome. */
int fp_mpi_save_commit(fp_save *save, char *id);

#ifdef __cplusplus
}
#endif
#endif
