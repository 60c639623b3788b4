/* Save and load throughput of libforkpoint against the floor (fwrite + fsync of the same bytes,
 * fread back), on a set of float32 arrays: bench_io DIR TOTAL_MIB ARRAYS REPEATS. Prints one line
 * per measure: name, median seconds, GB/s. Each save goes to a fresh repository (no dedup). */
#define _POSIX_C_SOURCE 200809L
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../include/forkpoint.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: bench_io DIR TOTAL_MIB ARRAYS REPEATS\n");
        return 2;
    }
    const char *dir = argv[1];
    size_t total = (size_t)atol(argv[2]) << 20, arrays = (size_t)atol(argv[3]);
    int repeats = atoi(argv[4]);
    size_t each = total / arrays / 4 * 4;
    float **data = malloc(arrays * sizeof *data), **back = malloc(arrays * sizeof *back);
    uint32_t x = 12345;
    for (size_t a = 0; a < arrays; a++) {
        data[a] = malloc(each), back[a] = malloc(each);
        for (size_t i = 0; i < each / 4; i++) {
            x = x * 1664525u + 1013904223u;
            data[a][i] = (float)(x >> 8) / 16777216.0f - 0.5f;
        }
        memset(back[a], 0, each);
    }
    double t_fwrite[64], t_save[64], t_fread[64], t_load[64];
    char path[4096], cmd[4200];
    for (int r = 0; r < repeats && r < 64; r++) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s/floor' '%s/repo' && mkdir -p '%s/floor'", dir, dir, dir);
        if (system(cmd)) return 1;
        double t = now();
        for (size_t a = 0; a < arrays; a++) {
            snprintf(path, sizeof path, "%s/floor/a%zu.bin", dir, a);
            FILE *f = fopen(path, "wb");
            if (!f || fwrite(data[a], 1, each, f) != each || fflush(f) || fsync(fileno(f))) return 1;
            fclose(f);
        }
        snprintf(path, sizeof path, "%s/floor", dir);
        int fd = open(path, O_RDONLY);
        fsync(fd);
        close(fd);
        t_fwrite[r] = now() - t;

        fp_repo *repo;
        snprintf(path, sizeof path, "%s/repo", dir);
        if (fp_open(path, FP_CREATE, &repo)) { fprintf(stderr, "%s\n", fp_errmsg(repo)); return 1; }
        t = now();
        fp_save *s;
        int64_t shape[1] = {(int64_t)(each / 4)};
        int st = fp_save_begin(repo, "main", &s);
        for (size_t a = 0; !st && a < arrays; a++) {
            char name[32];
            snprintf(name, sizeof name, "a%zu", a);
            st = fp_save_put(s, name, FP_FLOAT32, 1, shape, data[a]);
        }
        if (!st) st = fp_save_commit(s, NULL);
        t_save[r] = now() - t;
        if (st) { fprintf(stderr, "%s\n", fp_errmsg(repo)); return 1; }

        t = now();
        for (size_t a = 0; a < arrays; a++) {
            snprintf(path, sizeof path, "%s/floor/a%zu.bin", dir, a);
            FILE *f = fopen(path, "rb");
            if (!f || fread(back[a], 1, each, f) != each) return 1;
            fclose(f);
        }
        t_fread[r] = now() - t;

        t = now();
        fp_version *v;
        st = fp_load(repo, "main", &v);
        for (size_t a = 0; !st && a < arrays; a++) {
            char name[32];
            snprintf(name, sizeof name, "a%zu", a);
            st = fp_read(v, name, back[a], each);
        }
        t_load[r] = now() - t;
        if (st) { fprintf(stderr, "%s\n", fp_errmsg(repo)); return 1; }
        for (size_t a = 0; a < arrays; a++)
            if (memcmp(back[a], data[a], each)) { fprintf(stderr, "load returned other bytes\n"); return 1; }
        fp_version_free(v);
        fp_close(repo);
    }
    double bytes = (double)each * (double)arrays;
    const char *names[] = {"fwrite+fsync", "fp_save", "fread", "fp_load"};
    double *times[] = {t_fwrite, t_save, t_fread, t_load};
    for (int k = 0; k < 4; k++) {
        double m = median(times[k], repeats);
        printf("%s\t%.3f\t%.2f\n", names[k], m, bytes / m / 1e9);
    }
    return 0;
}
