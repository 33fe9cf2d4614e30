/* Paged blocks of group-scaled codes, dequantized into fp32 [seq, head, token, channel] rows in
 * one pass on a CPU: element decode, group scale and zero point per vector, where torch needs a
 * gather, a decode, a multiply and an add, each a pass over the data and a call from Python.
 * Decode selection's index products read the same way, dotted as they are decoded. Driven by
 * kvtune/kernels/native/read_blocks.py, which checks every argument first; the layouts are
 * KVPool's (kvtune/kernels/cache/pool.py). */
#include <stdint.h>
#include <string.h>

enum { DECODE_NIBBLES = 0, DECODE_BYTES = 1, DECODE_TABLE = 2 };
enum { SCALE_FP16 = 0, SCALE_FP32 = 1, SCALE_TABLE = 2 };
#define MAX_GROUPS 512
#define MAX_DIM 512 /* the longest index vector the products decode */
#define MAX_QUERY_GROUP 16

typedef struct {
  const uint8_t *codes;            /* [num_blocks, block_size, heads, code bytes] */
  int64_t num_blocks, code_block, code_token, code_head; /* strides in bytes */
  const int32_t *table;            /* [seqs, blocks] block ids, rows table_stride apart */
  int64_t table_stride, seqs, blocks, block_size, heads, head_dim;
  int32_t decode;                  /* DECODE_*: nibbles and bytes are unsigned code values */
  int32_t per_byte;                /* codes a byte holds (DECODE_TABLE) */
  const float *decode_table;       /* [256, per_byte]: the values of every byte (DECODE_TABLE) */
  const uint8_t *scales;           /* [num_blocks, block_size / rows, heads, groups (+ groups)] */
  int64_t scale_block, scale_row, scale_head; /* strides in bytes */
  int32_t scale_kind;              /* SCALE_*: how a stored scale reads */
  const float *scale_table;        /* [256]: the value of every scale byte (SCALE_TABLE) */
  int32_t rows, groups, zero_point;
  float tensor_scale;
  float *out;                      /* [seqs, heads, blocks * block_size, head_dim] */
  int64_t out_seq, out_head, out_token; /* strides in floats; channels are contiguous */
} ReadArgs;

#ifdef __FLT16_MAX__
/* The compiler's half type: a row converts with the CPU's vector instructions where it has
 * them (x86 F16C, Arm). */
static float half_to_float(const uint8_t *bytes) {
  _Float16 half;
  memcpy(&half, bytes, 2);
  return (float)half;
}
#else
/* IEEE binary16 -> float, exactly (subnormals, infinities and NaN included). */
static float half_to_float(const uint8_t *bytes) {
  uint16_t half;
  memcpy(&half, bytes, 2);
  const uint32_t sign = (uint32_t)(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
  uint32_t bits;
  float value;
  if (exponent == 0x1f) {
    bits = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent == 0) {
    value = (float)mantissa * 0x1p-24f; /* exact: at most 10 significant bits */
    memcpy(&bits, &value, 4);
    bits |= sign;
  } else {
    bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
  }
  memcpy(&value, &bits, 4);
  return value;
}
#endif

/* The `count` stored scales (and zero points) of one row, as floats. */
static void load_scales(const ReadArgs *a, const uint8_t *row, int64_t count, float *values) {
  if (a->scale_kind == SCALE_FP16) {
    for (int64_t i = 0; i < count; i++) values[i] = half_to_float(row + 2 * i);
  } else if (a->scale_kind == SCALE_FP32) {
    memcpy(values, row, 4 * count);
  } else {
    for (int64_t i = 0; i < count; i++) values[i] = a->scale_table[row[i]];
  }
}

static void decode_vector(const ReadArgs *a, const uint8_t *src, float *dst) {
  const int64_t dim = a->head_dim;
  if (a->decode == DECODE_NIBBLES) {
    for (int64_t i = 0; i < dim / 2; i++) {
      dst[2 * i] = (float)(src[i] & 15);
      dst[2 * i + 1] = (float)(src[i] >> 4);
    }
  } else if (a->decode == DECODE_BYTES) {
    for (int64_t i = 0; i < dim; i++) dst[i] = (float)src[i];
  } else {
    const int64_t per_byte = a->per_byte;
    for (int64_t i = 0; i < dim / per_byte; i++)
      for (int64_t j = 0; j < per_byte; j++)
        dst[i * per_byte + j] = a->decode_table[src[i] * per_byte + j];
  }
}

/* (code * scale + zero) * tensor scale, rounded after each operation as the torch reference
 * rounds it (built without contracting into fused multiply-adds). */
static void scale_vector(const ReadArgs *a, const float *scale, const float *zero, float *dst) {
  const int64_t dim = a->head_dim, width = dim / a->groups;
  const float tensor_scale = a->tensor_scale;
  if (width == 1) {
    for (int64_t c = 0; c < dim; c++) dst[c] = (dst[c] * scale[c] + zero[c]) * tensor_scale;
    return;
  }
  for (int64_t g = 0; g < a->groups; g++) {
    const float s = scale[g], z = zero[g];
    float *group = dst + g * width;
    for (int64_t c = 0; c < width; c++) group[c] = (group[c] * s + z) * tensor_scale;
  }
}

/* 0, or 1 when the table names a block past the pool (nothing is written then). A negative id
 * (table padding) is skipped: its rows are left as they are. */
int kvtune_read_blocks(const ReadArgs *a) {
  for (int64_t s = 0; s < a->seqs; s++)
    for (int64_t b = 0; b < a->blocks; b++)
      if (a->table[s * a->table_stride + b] >= a->num_blocks) return 1;
  const int64_t work = a->seqs * a->heads * a->blocks;
  /* Threads only where the work outweighs waking them (a decode step's index reads are small). */
  #pragma omp parallel for schedule(static) if (work * a->block_size * a->head_dim >= 65536)
  for (int64_t item = 0; item < work; item++) {
    const int64_t s = item / (a->heads * a->blocks);
    const int64_t h = (item / a->blocks) % a->heads, b = item % a->blocks;
    const int64_t id = a->table[s * a->table_stride + b];
    if (id < 0) continue;
    const uint8_t *src = a->codes + id * a->code_block + h * a->code_head;
    float *dst = a->out + s * a->out_seq + h * a->out_head + b * a->block_size * a->out_token;
    /* The scales, then the zero points (0 where the format keeps none). */
    float params[2 * MAX_GROUPS];
    const float *scale = params, *zero = params + a->groups;
    const int64_t stored = a->zero_point ? 2 * a->groups : a->groups;
    if (!a->zero_point) memset(params + a->groups, 0, sizeof(float) * a->groups);
    for (int64_t t = 0; t < a->block_size; t++, src += a->code_token, dst += a->out_token) {
      if (t % a->rows == 0) { /* a scale row serves `rows` consecutive tokens */
        load_scales(a, a->scales + id * a->scale_block + (t / a->rows) * a->scale_row +
                           h * a->scale_head,
                    stored, params);
      }
      decode_vector(a, src, dst);
      scale_vector(a, scale, zero, dst);
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
  const int64_t block_size = hi->block_size, dim = hi->head_dim;
  const int64_t blocks = (length + block_size - 1) / block_size;
  for (int64_t s = 0; s < hi->seqs; s++)
    for (int64_t b = 0; b < blocks; b++)
      if (hi->table[s * hi->table_stride + b] >= hi->num_blocks) return 1;
  if (dim > MAX_DIM || group > MAX_QUERY_GROUP) return 1;
  const int64_t work = hi->seqs * hi->heads * blocks;
  #pragma omp parallel for schedule(static) if (work * block_size * dim * group >= 65536)
  for (int64_t item = 0; item < work; item++) {
    const int64_t s = item / (hi->heads * blocks);
    const int64_t h = (item / blocks) % hi->heads, b = item % blocks;
    const int64_t id = hi->table[s * hi->table_stride + b];
    if (id < 0) continue;
    /* The positive and negative parts of each query head (bounds), or the queries. */
    float q_pos[MAX_QUERY_GROUP][MAX_DIM], q_neg[MAX_QUERY_GROUP][MAX_DIM];
    float upper[MAX_DIM], lower[MAX_DIM];
    for (int64_t j = 0; j < group; j++) {
      const float *query = q + s * q_seq + (h * group + j) * q_head;
      for (int64_t c = 0; c < dim; c++) {
        q_pos[j][c] = lo ? (query[c] > 0.0f ? query[c] : 0.0f) : query[c];
        q_neg[j][c] = query[c] < 0.0f ? query[c] : 0.0f;
      }
    }
    const ReadArgs *pools[2] = {hi, lo};
    float *vectors[2] = {upper, lower};
    float params[2][2 * MAX_GROUPS];
    for (int64_t p = 0; p < (lo ? 2 : 1); p++)
      if (!pools[p]->zero_point) memset(params[p] + pools[p]->groups, 0, sizeof(float) * pools[p]->groups);
    for (int64_t t = 0; t < block_size && b * block_size + t < length; t++) {
      for (int64_t p = 0; p < (lo ? 2 : 1); p++) {
        const ReadArgs *a = pools[p];
        const int64_t stored = a->zero_point ? 2 * a->groups : a->groups;
        if (t % a->rows == 0)
          load_scales(a, a->scales + id * a->scale_block + (t / a->rows) * a->scale_row +
                             h * a->scale_head, stored, params[p]);
        decode_vector(a, a->codes + id * a->code_block + t * a->code_token + h * a->code_head,
                      vectors[p]);
        scale_vector(a, params[p], params[p] + a->groups, vectors[p]);
      }
      float *products = out + s * out_seq + h * group * out_head + b * block_size + t;
      for (int64_t j = 0; j < group; j++)
        products[j * out_head] = lo ? bounds_product(q_pos[j], q_neg[j], upper, lower, dim)
                                    : plain_product(q_pos[j], upper, dim);
    }
  }
  return 0;
}
