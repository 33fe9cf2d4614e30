/* The element decoder of pool_codes.h on its own, so that kvtune/kernels/native/pool_codes.py
 * can check each decode kind against a format's own decode of every byte before a kernel
 * uses it. */
#include "pool_codes.h"

/* The code values of p->head_dim elements stored at src. */
void kvtune_decode_elements(const PoolCodes *p, const uint8_t *src, float *dst) {
  decode_elements(p, src, dst);
}
