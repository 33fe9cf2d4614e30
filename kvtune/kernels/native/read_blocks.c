/* Paged blocks of group-scaled codes, dequantized into fp32 [seq, head, token, channel] rows in
 * one pass on a CPU: element decode, group scale and zero point per vector, where torch needs a
 * gather, a decode, a multiply and an add, each a pass over the data and a call from Python.
 * Decode selection's index products read the same way, dotted as they are decoded. Driven by
 * kvtune/kernels/native/read_blocks.py, which checks every argument first; the layouts are
 * KVPool's (kvtune/kernels/cache/pool.py). */
#include "pool_codes.h"

#define MAX_DIM 512 /* the longest index vector the products decode */
#define MAX_QUERY_GROUP 16

typedef struct {
  PoolCodes pool;
  const int32_t *table;            /* [seqs, blocks] block ids, rows table_stride apart */
  int64_t table_stride, seqs, blocks;
  float *out;                      /* [seqs, heads, blocks * block_size, head_dim] */
  int64_t out_seq, out_head, out_token; /* strides in floats; channels are contiguous */
} ReadArgs;

/* 0, or 1 when the table names a block past the pool (nothing is written then). A negative id
 * (table padding) is skipped: its rows are left as they are. */
int kvtune_read_blocks(const ReadArgs *a) {
  const PoolCodes *p = &a->pool;
  for (int64_t s = 0; s < a->seqs; s++)
    for (int64_t b = 0; b < a->blocks; b++)
      if (a->table[s * a->table_stride + b] >= p->num_blocks) return 1;
  const int64_t work = a->seqs * p->heads * a->blocks;
  /* Threads only where the work outweighs waking them (a decode step's index reads are small). */
  #pragma omp parallel for schedule(static) if (work * p->block_size * p->head_dim >= 65536)
  for (int64_t item = 0; item < work; item++) {
    const int64_t s = item / (p->heads * a->blocks);
    const int64_t h = (item / a->blocks) % p->heads, b = item % a->blocks;
    const int64_t id = a->table[s * a->table_stride + b];
    if (id < 0) continue;
    float *dst = a->out + s * a->out_seq + h * a->out_head + b * p->block_size * a->out_token;
    RowScales row;
    for (int64_t t = 0; t < p->block_size; t++, dst += a->out_token) {
      if (p->groups && t % p->rows == 0) load_row_scales(p, id, t, h, &row);
      decode_vector(p, code_row(p, id, t, h), &row, dst);
    }
  }
  return 0;
}

/* q+ . hi + q- . lo (key bounds), summed in sixteen lanes the compiler keeps in vector
 * registers, then the rest. */
static float bounds_product(const float *q_pos, const float *q_neg, const float *hi,
                            const float *lo, int64_t dim) {
  float lanes[16] = {0};
  int64_t c = 0;
  for (; c + 16 <= dim; c += 16)
    for (int64_t l = 0; l < 16; l++) lanes[l] += q_pos[c + l] * hi[c + l] + q_neg[c + l] * lo[c + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < 16; l++) sum += lanes[l];
  for (; c < dim; c++) sum += q_pos[c] * hi[c] + q_neg[c] * lo[c];
  return sum;
}

/* q . key, likewise. */
static float plain_product(const float *q, const float *key, int64_t dim) {
  float lanes[16] = {0};
  int64_t c = 0;
  for (; c + 16 <= dim; c += 16)
    for (int64_t l = 0; l < 16; l++) lanes[l] += q[c + l] * key[c + l];
  float sum = 0.0f;
  for (int64_t l = 0; l < 16; l++) sum += lanes[l];
  for (; c < dim; c++) sum += q[c] * key[c];
  return sum;
}

/* Decode selection's products: each query head of q (one query a sequence, [seq, head,
 * channel] fp32, channels contiguous) with the index vectors of its sequence's blocks in the
 * hi pool (and lo pool: key bounds), out[seq, head, vector] for the first `length` vectors.
 * Blocks with a negative id (table padding) are skipped. 0, or 1 when an id lies past the pool. */
int kvtune_index_products(const ReadArgs *hi, const ReadArgs *lo, const float *q, int64_t q_seq,
                          int64_t q_head, int64_t group, int64_t length, float *out,
                          int64_t out_seq, int64_t out_head) {
  const PoolCodes *high = &hi->pool, *low = lo ? &lo->pool : NULL;
  const int64_t block_size = high->block_size, dim = high->head_dim;
  const int64_t blocks = (length + block_size - 1) / block_size;
  for (int64_t s = 0; s < hi->seqs; s++)
    for (int64_t b = 0; b < blocks; b++)
      if (hi->table[s * hi->table_stride + b] >= high->num_blocks) return 1;
  if (dim > MAX_DIM || group > MAX_QUERY_GROUP) return 1;
  const int64_t work = hi->seqs * high->heads * blocks;
  #pragma omp parallel for schedule(static) if (work * block_size * dim * group >= 65536)
  for (int64_t item = 0; item < work; item++) {
    const int64_t s = item / (high->heads * blocks);
    const int64_t h = (item / blocks) % high->heads, b = item % blocks;
    const int64_t id = hi->table[s * hi->table_stride + b];
    if (id < 0) continue;
    /* The positive and negative parts of each query head (bounds), or the queries. */
    float q_pos[MAX_QUERY_GROUP][MAX_DIM], q_neg[MAX_QUERY_GROUP][MAX_DIM];
    float upper[MAX_DIM], lower[MAX_DIM];
    for (int64_t j = 0; j < group; j++) {
      const float *query = q + s * q_seq + (h * group + j) * q_head;
      for (int64_t c = 0; c < dim; c++) {
        q_pos[j][c] = low ? (query[c] > 0.0f ? query[c] : 0.0f) : query[c];
        q_neg[j][c] = query[c] < 0.0f ? query[c] : 0.0f;
      }
    }
    const PoolCodes *pools[2] = {high, low};
    float *vectors[2] = {upper, lower};
    RowScales rows[2];
    for (int64_t t = 0; t < block_size && b * block_size + t < length; t++) {
      for (int64_t p = 0; p < (low ? 2 : 1); p++) {
        const PoolCodes *pool = pools[p];
        if (pool->groups && t % pool->rows == 0) load_row_scales(pool, id, t, h, &rows[p]);
        decode_vector(pool, code_row(pool, id, t, h), &rows[p], vectors[p]);
      }
      float *products = out + s * out_seq + h * group * out_head + b * block_size + t;
      for (int64_t j = 0; j < group; j++)
        products[j * out_head] = low ? bounds_product(q_pos[j], q_neg[j], upper, lower, dim)
                                     : plain_product(q_pos[j], upper, dim);
    }
  }
  return 0;
}
