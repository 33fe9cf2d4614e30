/* Rows of fp32 vectors times an fp64 matrix, summed in fp64 in one fixed order and rounded to
 * fp32 once: a vector rotates to the same bits whatever batch it comes in, by construction.
 * One call where torch needs a conversion, a product and a conversion back. Driven by
 * kvtune/kernels/native/rotate_rows.py; x, m and out are contiguous. */
#include <stdint.h>

#define MAX_DIM 1024

/* out[n, :] = x[n, :] @ m, for n < rows; m is [dim, dim]. 1 when dim is too large. */
int kvtune_rotate_rows(const float *x, int64_t rows, int64_t dim, const double *m, float *out) {
  if (dim > MAX_DIM) return 1;
  #pragma omp parallel for schedule(static) if (rows * dim * dim >= 1048576)
  for (int64_t n = 0; n < rows; n++) {
    double sums[MAX_DIM];
    for (int64_t j = 0; j < dim; j++) sums[j] = 0.0;
    for (int64_t k = 0; k < dim; k++) {
      const double coordinate = x[n * dim + k];
      const double *row = m + k * dim;
      for (int64_t j = 0; j < dim; j++) sums[j] += coordinate * row[j];
    }
    for (int64_t j = 0; j < dim; j++) out[n * dim + j] = (float)sums[j];
  }
  return 0;
}
