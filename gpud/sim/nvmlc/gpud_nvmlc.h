/* Between the generated trampolines (gen.py) and the embedding runtime (runtime.c). */
#ifndef GPUD_NVMLC_H
#define GPUD_NVMLC_H
#include <stdint.h>

struct gpud_nvmlc_size {
    const char *type;
    unsigned long size;
};

/* Generated tables: "name|ctype|ctype..." per exported function, and sizeof of every pointed-to type. */
extern const char *const gpud_nvmlc_signatures[];
extern const unsigned gpud_nvmlc_nfunctions;
extern const struct gpud_nvmlc_size gpud_nvmlc_sizes[];
extern const unsigned gpud_nvmlc_nsizes;

/* Runs function `index` of the signature table in the simulator; returns an nvmlReturn_t. */
int gpud_nvmlc_call(unsigned index, const uint64_t *args, unsigned nargs);
/* A string that stays valid for the life of the process. */
const char *gpud_nvmlc_error_string(int result);
#endif
