/* Heat diffusion on a 2-D grid over MPI, checkpointed with libforkpoint's collective save.
 *
 *     make -C c mpi
 *     mpiexec -n 4 c/build/heat_mpi runs/heat --steps 400 --every 100 --stop-at 200
 *     mpiexec -n 2 c/build/heat_mpi runs/heat --steps 400 --every 100   # resumes at step 200
 *
 * The n x n grid (zero at its edges) is split into a Cartesian grid of blocks, one per rank
 * (2 x 2 on 4 ranks, 2 x 1 on 2), each with a one-cell halo exchanged every step. Every
 * `--every` steps the ranks save their blocks of the global field "u" as one version with its
 * step; `--stop-at K` exits after step K, as a preempted job would. Started
 * again on the same repository and branch, the run resumes from the branch head on however
 * many ranks it now has, each reading its own box, and ends bit-identical to an uninterrupted
 * run: a cell's update reads only its neighbours, in the same order on any decomposition. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <forkpoint.h>
#include <forkpoint_mpi.h>

#define ALPHA 0.2

typedef struct {
    const char *repo, *branch;
    int n, steps, every, stop_at;
} options;

typedef struct {
    MPI_Comm cart;
    int rank, size, dims[2], up, down, left, right;
    int64_t off[2], len[2]; /* this rank's block of the global grid */
    double *u, *next;       /* (len[0] + 2) x (len[1] + 2), halo included */
    MPI_Datatype column;
} domain;

static void fail(const domain *d, fp_repo *repo, int st, const char *what) {
    fprintf(stderr, "rank %d: %s failed (%s): %s\n", d->rank, what, fp_status_name(st), fp_errmsg(repo));
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static int parse(int argc, char **argv, options *o) {
    *o = (options){argc > 1 ? argv[1] : NULL, "main", 96, 400, 100, -1};
    for (int i = 2; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--branch")) o->branch = argv[i + 1];
        else if (!strcmp(argv[i], "--n")) o->n = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--steps")) o->steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--every")) o->every = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--stop-at")) o->stop_at = atoi(argv[i + 1]);
        else return 0;
    }
    return o->repo && argc % 2 == 0 && o->n > 1 && o->steps >= 0 && o->every > 0;
}

/* [first, first + count) of an n-cell dimension split into `parts`, for part `k`. */
static void split(int n, int parts, int k, int64_t *first, int64_t *count) {
    *first = (int64_t)n * k / parts;
    *count = (int64_t)n * (k + 1) / parts - *first;
}

static void setup(domain *d, int n) {
    int periods[2] = {0, 0}, coords[2];
    MPI_Comm_size(MPI_COMM_WORLD, &d->size);
    d->dims[0] = d->dims[1] = 0;
    MPI_Dims_create(d->size, 2, d->dims);
    MPI_Cart_create(MPI_COMM_WORLD, 2, d->dims, periods, 0, &d->cart);
    MPI_Comm_rank(d->cart, &d->rank);
    MPI_Cart_coords(d->cart, d->rank, 2, coords);
    MPI_Cart_shift(d->cart, 0, 1, &d->up, &d->down);
    MPI_Cart_shift(d->cart, 1, 1, &d->left, &d->right);
    for (int k = 0; k < 2; k++) split(n, d->dims[k], coords[k], &d->off[k], &d->len[k]);
    size_t cells = (size_t)(d->len[0] + 2) * (size_t)(d->len[1] + 2);
    d->u = calloc(cells, sizeof *d->u), d->next = calloc(cells, sizeof *d->next);
    if (!d->u || !d->next) MPI_Abort(MPI_COMM_WORLD, 1);
    MPI_Type_vector((int)d->len[0], 1, (int)d->len[1] + 2, MPI_DOUBLE, &d->column);
    MPI_Type_commit(&d->column);
}

#define AT(d, a, i, j) (a)[(size_t)(i) * (size_t)((d)->len[1] + 2) + (size_t)(j)]

/* A hot square off the centre on a ripple, the same cells on every decomposition. */
static void initial(domain *d, int n) {
    for (int64_t i = 0; i < d->len[0]; i++)
        for (int64_t j = 0; j < d->len[1]; j++) {
            int64_t gi = d->off[0] + i, gj = d->off[1] + j;
            int hot = gi > n / 4 && gi < n / 2 && gj > n / 3 && gj < 2 * n / 3;
            AT(d, d->u, i + 1, j + 1) = (hot ? 1.0 : 0.0) + 0.01 * (double)((gi * 31 + gj * 17) % 13);
        }
}

static void exchange(domain *d) {
    int64_t r = d->len[0], c = d->len[1];
    MPI_Sendrecv(&AT(d, d->u, 1, 1), (int)c, MPI_DOUBLE, d->up, 0, &AT(d, d->u, r + 1, 1), (int)c, MPI_DOUBLE, d->down,
                 0, d->cart, MPI_STATUS_IGNORE);
    MPI_Sendrecv(&AT(d, d->u, r, 1), (int)c, MPI_DOUBLE, d->down, 1, &AT(d, d->u, 0, 1), (int)c, MPI_DOUBLE, d->up, 1,
                 d->cart, MPI_STATUS_IGNORE);
    MPI_Sendrecv(&AT(d, d->u, 1, 1), 1, d->column, d->left, 2, &AT(d, d->u, 1, c + 1), 1, d->column, d->right, 2,
                 d->cart, MPI_STATUS_IGNORE);
    MPI_Sendrecv(&AT(d, d->u, 1, c), 1, d->column, d->right, 3, &AT(d, d->u, 1, 0), 1, d->column, d->left, 3, d->cart,
                 MPI_STATUS_IGNORE);
}

static void step(domain *d) {
    exchange(d);
    for (int64_t i = 1; i <= d->len[0]; i++)
        for (int64_t j = 1; j <= d->len[1]; j++) {
            double c = AT(d, d->u, i, j);
            double around = (AT(d, d->u, i - 1, j) + AT(d, d->u, i + 1, j)) + (AT(d, d->u, i, j - 1) + AT(d, d->u, i, j + 1));
            AT(d, d->next, i, j) = c + ALPHA * (around - 4.0 * c);
        }
    double *t = d->u;
    d->u = d->next, d->next = t;
}

/* The interior of this rank's block to or from `out`, row-major (what its box of "u" holds). */
static void interior(const domain *d, double *a, double *out, int to_halo) {
    for (int64_t i = 0; i < d->len[0]; i++) {
        double *cells = &AT(d, a, i + 1, 1), *row = out + (size_t)i * (size_t)d->len[1];
        if (to_halo) memcpy(cells, row, (size_t)d->len[1] * sizeof *row);
        else memcpy(row, cells, (size_t)d->len[1] * sizeof *row);
    }
}

static void checkpoint(domain *d, fp_repo *repo, const options *o, int64_t at, double *block) {
    int64_t global[2] = {o->n, o->n};
    double local = 0, total;
    interior(d, d->u, block, 0);
    for (int64_t i = 0; i < d->len[0] * d->len[1]; i++) local += block[i];
    MPI_Allreduce(&local, &total, 1, MPI_DOUBLE, MPI_SUM, d->cart);
    fp_save *save;
    char id[FP_ID_LEN + 1], message[96];
    int st = fp_mpi_save_begin(repo, d->cart, o->branch, &save);
    if (st) fail(d, repo, st, "fp_mpi_save_begin");
    snprintf(message, sizeof message, "heat step %lld on %d ranks", (long long)at, d->size);
    fp_save_set_step(save, at);
    fp_save_set_message(save, message);
    fp_save_set_metric(save, "heat", total);
    fp_save_put_block(save, "u", FP_FLOAT64, 2, global, d->off, d->len, block);
    fp_save_put(save, "step", FP_INT64, 0, NULL, &at); /* stored once, from rank 0 */
    if ((st = fp_mpi_save_commit(save, id))) fail(d, repo, st, "fp_mpi_save_commit");
    if (d->rank == 0) printf("step %lld: version %s (heat %.6f)\n", (long long)at, id, total);
}

/* The step of the branch head, its box of "u" read into this rank's block; -1 for a new branch. */
static int64_t resume(domain *d, fp_repo *repo, const options *o, double *block) {
    char id[FP_ID_LEN + 1];
    int st = fp_resolve(repo, o->branch, id);
    if (st == FP_ERR_NOT_FOUND) return -1;
    fp_version *v;
    int64_t at, global[2] = {o->n, o->n};
    size_t bytes = (size_t)(d->len[0] * d->len[1]) * sizeof *block;
    if (st || (st = fp_load(repo, id, &v))) fail(d, repo, st, "opening the branch head");
    if ((st = fp_read_as(v, "step", FP_INT64, 0, NULL, &at, sizeof at))) fail(d, repo, st, "reading the step");
    size_t index;
    fp_leaf leaf;
    if ((st = fp_version_find(v, "u", &index)) || (st = fp_version_leaf(v, index, &leaf))) fail(d, repo, st, "finding u");
    if (leaf.ndim != 2 || leaf.shape[0] != global[0] || leaf.shape[1] != global[1]) {
        fprintf(stderr, "rank %d: version %s holds a %lld x %lld grid, not --n %d\n", d->rank, id,
                (long long)leaf.shape[0], (long long)(leaf.ndim > 1 ? leaf.shape[1] : 0), o->n);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if ((st = fp_read_box(v, "u", 2, d->off, d->len, block, bytes))) fail(d, repo, st, "reading this rank's box of u");
    interior(d, d->u, block, 1);
    if (d->rank == 0) printf("resumed from version %s at step %lld on %d ranks\n", id, (long long)at, d->size);
    fp_version_free(v);
    return at;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    options o;
    if (!parse(argc, argv, &o)) {
        fprintf(stderr, "usage: heat_mpi REPO [--branch B] [--n N] [--steps S] [--every E] [--stop-at K]\n");
        MPI_Finalize();
        return 2;
    }
    domain d;
    setup(&d, o.n);
    double *block = malloc((size_t)(d.len[0] * d.len[1] + 1) * sizeof *block);
    fp_repo *repo;
    int st = fp_open(o.repo, FP_CREATE, &repo);
    if (st || !block) fail(&d, repo, st, "fp_open");
    int64_t at = resume(&d, repo, &o, block);
    if (at < 0) initial(&d, o.n), at = 0;
    while (at < o.steps) {
        step(&d);
        at++;
        if (at % o.every == 0 || at == o.steps) checkpoint(&d, repo, &o, at, block);
        if (at == o.stop_at) {
            if (d.rank == 0) printf("stopped at step %lld\n", (long long)at);
            break;
        }
    }
    fp_close(repo);
    free(block), free(d.u), free(d.next);
    MPI_Type_free(&d.column);
    MPI_Comm_free(&d.cart);
    MPI_Finalize();
    return 0;
}
