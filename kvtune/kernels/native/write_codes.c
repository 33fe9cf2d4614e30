/* Quantizing a decode step's new keys or values into their pool on a CPU, one call a pool: the
 * torch reference (kvtune/kernels/formats/quantize.py's quantize_ref, then the slot writes of
 * write_vectors_ref) takes some forty small torch operations a call, which a decode step pays
 * twice a layer. The same arithmetic in the same order (built without contracting multiplies
 * and adds), so the codes and scales have the reference's bits; driven by
 * kvtune/kernels/native/write_codes.py, which checks the format and every argument first.
 *
 * Formats: per-token groups with fp16 scales and zero points of asymmetric integer codes
 * (rounded half to even, or vLLM TurboQuant's halves up from the fp32 range); symmetric codes
 * (FP8 E4M3, FP4 E2M1 nearest even or ties away, int8 halves away) with fp16 scales or fp32
 * ones whose reciprocal multiplies; llama.cpp's q8_0, q4_0, q5_0, q4_1 and q5_1 by ggml's own
 * arithmetic (kvtune/kernels/formats/ggml_codes.py). */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

enum {
  WRITE_UINT = 0,
  WRITE_E4M3 = 1,
  WRITE_E2M1 = 2,
  WRITE_E2M1_AWAY = 3,
  WRITE_INT8_SYMMETRIC = 4,
  WRITE_UINT_HALF_UP = 5,
  WRITE_Q8_0 = 6,
  WRITE_GGML_SIGNED = 7, /* q4_0, q5_0 */
  WRITE_GGML_MIN = 8,    /* q4_1, q5_1 */
};
#define MAX_DIM 1024

typedef struct {
  uint8_t *codes;          /* [num_blocks, block_size, heads, code bytes] */
  int64_t code_block, code_token, code_head; /* strides in bytes */
  uint8_t *scales;         /* [num_blocks, block_size, heads, groups (+ groups)] fp16 */
  int64_t scale_block, scale_token, scale_head; /* strides in bytes */
  int64_t num_blocks, block_size, heads, head_dim, group_size;
  int32_t kind;            /* WRITE_* */
  int32_t bits;            /* bits a code takes (8: one a byte; 2-5: packed little end first) */
  int32_t fp32_scales;     /* symmetric kinds: fp32 scales (floored, reciprocal multiplies) */
  float max_code;          /* the largest code value: 2^bits - 1, 448, 6 or 127 */
  float floor;             /* the smallest exact scale (fp32 scales: 1e-6; fp16: 0) */
  float tensor_scale;      /* every value is divided by it first */
} WritePool;

#define HALF_UP_SCALE_FLOOR 1e-8f /* int_codes.py's HALF_UP_SCALE_FLOOR */

#if defined(__F16C__)
/* fp32 -> fp16 (nearest even, as torch's .half()) -> fp32, and its bits. */
static inline uint16_t half_bits(float value) {
  return (uint16_t)_cvtss_sh(value, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
static inline float half_value(uint16_t bits) { return _cvtsh_ss(bits); }
#endif

/* E4M3 code of a value in code units: nearest even, saturating at 448, NaN -> 0x7f with the
 * sign (quantize.py's encode_e4m3_fast through float8_e4m3fn). */
static inline uint32_t e4m3_code(float x) {
  const uint32_t sign = signbit(x) ? 0x80u : 0u;
  if (isnan(x)) return sign | 0x7fu;
  const float magnitude = fminf(fabsf(x), 448.0f);
  if (magnitude < 0x1p-6f) return sign | (uint32_t)rintf(magnitude * 512.0f); /* 2^-9 steps */
  int exponent;
  frexpf(magnitude, &exponent); /* magnitude = f x 2^exponent, f in [0.5, 1) */
  exponent -= 1;                /* magnitude in [2^exponent, 2^(exponent + 1)) */
  float mantissa = rintf(ldexpf(magnitude, 3 - exponent)); /* 8..16, exact scaling */
  if (mantissa == 16.0f) {
    mantissa = 8.0f;
    exponent += 1;
  }
  return sign | (uint32_t)((exponent + 7) << 3) | ((uint32_t)mantissa - 8u);
}

/* E2M1 nibble of a value in code units (fp_codes.py's encode_e2m1_fast): rounded half to even
 * within its binade's step (0.5, 1, 2), saturating at 6, NaN -> 6, the sign bit kept. */
static inline uint32_t e2m1_code(float x) {
  const uint32_t sign = signbit(x) ? 0x8u : 0u;
  const float magnitude = isnan(x) ? 6.0f : fminf(fabsf(x), 6.0f);
  const float step = magnitude < 2.0f ? 0.5f : (magnitude < 4.0f ? 1.0f : 2.0f);
  const float value = rintf(magnitude / step) * step;
  const float code = value < 2.0f ? 2.0f * value : (value < 4.0f ? value + 2.0f : value / 2.0f + 4.0f);
  return sign | (uint32_t)code;
}

/* E2M1 nibble with halfway values away from zero (fp_codes.py's encode_e2m1_ties_away_ref):
 * within each binade's step floor(m / step + 1/2) is exact in fp32; the sign for x < 0 only. */
static inline uint32_t e2m1_away_code(float x) {
  const float magnitude = fminf(fabsf(x), 6.0f);
  const float step = magnitude < 2.0f ? 0.5f : (magnitude < 4.0f ? 1.0f : 2.0f);
  const float value = floorf(magnitude / step + 0.5f) * step;
  const float code = value < 2.0f ? 2.0f * value : (value < 4.0f ? value + 2.0f : value / 2.0f + 4.0f);
  return (x < 0.0f ? 0x8u : 0u) | (uint32_t)code;
}

/* int8 byte of a value in code units (symmetric_int_codes.py): halves away from zero,
 * clamped to [-128, 127]. */
static inline uint32_t int8_symmetric_code(float x) {
  const float code = fminf(fmaxf(truncf(x + (x >= 0.0f ? 0.5f : -0.5f)), -128.0f), 127.0f);
  return (uint32_t)(uint8_t)(int8_t)code;
}

/* ggml's multiplier id = 1 / d, one IEEE division; 0 where d is 0. */
static inline float reciprocal_or_zero(float d) { return d == 0.0f ? 0.0f : 1.0f / d; }

/* One group of a llama.cpp type (ggml_codes.py's parameters and encoders): its fp16 d (and
 * minimum) stored at scales, its codes at values. */
static void write_ggml_group(const WritePool *p, const float *group, int64_t size,
                             int64_t groups, int64_t g, uint8_t *scales, uint8_t *values) {
  /* The first element of largest magnitude, of the minimum and of the maximum. */
  float amax = fabsf(group[0]), largest = group[0], low = group[0], high = group[0];
  for (int64_t c = 1; c < size; c++) {
    if (fabsf(group[c]) > amax) amax = fabsf(group[c]), largest = group[c];
    if (group[c] < low) low = group[c];
    if (group[c] > high) high = group[c];
  }
  const float levels = (float)(1 << (p->bits - 1)); /* 8 or 16 for the signed types */
  const float top = (float)((1 << p->bits) - 1);     /* the largest code: 15 or 31 */
  float d, id, minimum = 0.0f;
  if (p->kind == WRITE_Q8_0) {
    d = amax / 127.0f;
    id = amax == 0.0f ? 0.0f : 127.0f / amax;
  } else if (p->kind == WRITE_GGML_SIGNED) {
    d = (amax == 0.0f ? 0.0f : largest) / -levels;
    id = reciprocal_or_zero(d);
  } else {
    d = (high - low) / top;
    id = reciprocal_or_zero(d);
    minimum = low;
    const uint16_t stored_min = half_bits(low);
    memcpy(scales + 2 * (groups + g), &stored_min, 2);
  }
  const uint16_t stored = half_bits(d);
  memcpy(scales + 2 * g, &stored, 2);
  for (int64_t c = 0; c < size; c++) {
    const float units = p->kind == WRITE_GGML_MIN ? (group[c] - minimum) * id : group[c] * id;
    uint32_t code;
    if (p->kind == WRITE_Q8_0)
      code = (uint32_t)(uint8_t)(int8_t)fminf(fmaxf(rintf(units), -128.0f), 127.0f);
    else if (p->kind == WRITE_GGML_SIGNED)
      code = (uint32_t)fminf(fmaxf(truncf(units + (levels + 0.5f)), 0.0f), top);
    else
      code = (uint32_t)fminf(fmaxf(truncf(units + 0.5f), 0.0f), top);
    values[c] = (uint8_t)code;
  }
}

/* Quantize one vector (already divided by the tensor scale) into its codes and scale row. */
static void write_vector(const WritePool *p, const float *x, uint8_t *codes, uint8_t *scales) {
  const int64_t dim = p->head_dim, size = p->group_size, groups = dim / size;
  uint8_t values[MAX_DIM];
  for (int64_t g = 0; g < groups; g++) {
    const float *group = x + g * size;
    if (p->kind >= WRITE_Q8_0) {
      write_ggml_group(p, group, size, groups, g, scales, values + g * size);
      continue;
    }
    float low = group[0], high = group[0], amax = fabsf(group[0]);
    for (int64_t c = 1; c < size; c++) {
      low = fminf(low, group[c]);
      high = fmaxf(high, group[c]);
      amax = fmaxf(amax, fabsf(group[c]));
    }
    if (p->kind == WRITE_UINT_HALF_UP) { /* fp32 minimum and range; both stored in fp16 */
      const float scale = fmaxf((high - low) / p->max_code, HALF_UP_SCALE_FLOOR);
      const uint16_t stored_scale = half_bits(scale), stored_low = half_bits(low);
      memcpy(scales + 2 * g, &stored_scale, 2);
      memcpy(scales + 2 * (groups + g), &stored_low, 2);
      for (int64_t c = 0; c < size; c++) {
        const float code = fminf(fmaxf(truncf((group[c] - low) / scale + 0.5f), 0.0f), p->max_code);
        values[g * size + c] = (uint8_t)code;
      }
      continue;
    }
    float scale, zero = 0.0f;
    if (p->kind == WRITE_UINT) { /* zero point: the fp16 minimum; scale: span / max code */
      const uint16_t stored_zero = half_bits(low);
      zero = half_value(stored_zero);
      memcpy(scales + 2 * (groups + g), &stored_zero, 2);
      const uint16_t stored = half_bits(fmaxf(high - zero, 0.0f) / p->max_code);
      memcpy(scales + 2 * g, &stored, 2);
      scale = half_value(stored);
    } else if (p->fp32_scales) { /* the exact scale itself, floored */
      scale = fmaxf(amax / p->max_code, p->floor);
      memcpy(scales + 4 * g, &scale, 4);
    } else {
      const uint16_t stored = half_bits(fmaxf(amax / p->max_code, p->floor));
      memcpy(scales + 2 * g, &stored, 2);
      scale = half_value(stored);
    }
    const float divisor = scale == 0.0f ? 1.0f : scale, inverse = 1.0f / divisor;
    for (int64_t c = 0; c < size; c++) {
      const float shifted = group[c] - zero;
      const float quotient = p->fp32_scales ? shifted * inverse : shifted / divisor;
      const float units = scale == 0.0f ? 0.0f : quotient;
      uint32_t code;
      switch (p->kind) {
        case WRITE_UINT: code = (uint32_t)rintf(fminf(fmaxf(units, 0.0f), p->max_code)); break;
        case WRITE_E4M3: code = e4m3_code(units); break;
        case WRITE_E2M1: code = e2m1_code(units); break;
        case WRITE_E2M1_AWAY: code = e2m1_away_code(units); break;
        default: code = int8_symmetric_code(units);
      }
      values[g * size + c] = (uint8_t)code;
    }
  }
  /* Codes little end first: eight codes fill `bits` bytes, code j at bit j x bits. */
  const int64_t bits = p->bits;
  for (int64_t i = 0; i < dim / 8; i++) {
    uint64_t word = 0;
    for (int64_t j = 0; j < 8; j++) word |= (uint64_t)values[8 * i + j] << (j * bits);
    for (int64_t byte = 0; byte < bits; byte++) codes[i * bits + byte] = (uint8_t)(word >> (8 * byte));
  }
}

/* Write vectors [n, heads, head_dim] (fp32, rows contiguous) into slots [n] (negative: skip).
 * 0; 1 where a slot lies outside the pool (nothing is written then); 2 where this build has no
 * fp16 conversion (no F16C: the torch path runs instead). */
int kvtune_write_codes(const WritePool *p, const float *vectors, const int64_t *slots, int64_t n) {
#if defined(__F16C__)
  const int64_t num_slots = p->num_blocks * p->block_size;
  for (int64_t i = 0; i < n; i++)
    if (slots[i] >= num_slots) return 1;
  float scaled[MAX_DIM];
  for (int64_t i = 0; i < n; i++) {
    if (slots[i] < 0) continue;
    const int64_t block = slots[i] / p->block_size, token = slots[i] % p->block_size;
    for (int64_t h = 0; h < p->heads; h++) {
      const float *x = vectors + (i * p->heads + h) * p->head_dim;
      for (int64_t c = 0; c < p->head_dim; c++) scaled[c] = x[c] / p->tensor_scale;
      write_vector(p, scaled,
                   p->codes + block * p->code_block + token * p->code_token + h * p->code_head,
                   p->scales + block * p->scale_block + token * p->scale_token + h * p->scale_head);
    }
  }
  return 0;
#else
  (void)p, (void)vectors, (void)slots, (void)n;
  return 2;
#endif
}
