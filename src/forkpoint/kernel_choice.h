/* FORKPOINT_PORTABLE_KERNELS, read the same way by every native module of forkpoint: unset,
 * empty or "0" allows every vector path (0), "avx512" leaves out the AVX-512 ones (1), any
 * other value keeps the portable paths only (2). */
#ifndef FORKPOINT_KERNEL_CHOICE_H
#define FORKPOINT_KERNEL_CHOICE_H
#include <stdlib.h>
#include <string.h>

__attribute__((unused)) static int portable_kernels(void) {
    const char *setting = getenv("FORKPOINT_PORTABLE_KERNELS");
    if (!setting || !*setting || !strcmp(setting, "0")) return 0;
    return strcmp(setting, "avx512") ? 2 : 1;
}
#endif
