/* One KV head's slice of paged blocks copied between two pools of one layout on a CPU: a row of
 * bytes per token row (or scale row), block after block, in one call, where torch needs index
 * arithmetic, a gather and a scatter. Driven by kvtune/kernels/native/copy_rows.py; the layout
 * is KVPool's [blocks, rows, heads, row bytes], contiguous. */
#include <stdint.h>
#include <string.h>

/* 0, or 1 when a block or head lies outside its pool (nothing is copied then). */
int kvtune_copy_head_rows(const uint8_t *src, int64_t src_blocks, uint8_t *dst, int64_t dst_blocks,
                          int64_t rows, int64_t heads, int64_t row_bytes, const int64_t *read,
                          const int64_t *write, const int64_t *head, int64_t count) {
  for (int64_t i = 0; i < count; i++)
    if (read[i] < 0 || read[i] >= src_blocks || write[i] < 0 || write[i] >= dst_blocks ||
        head[i] < 0 || head[i] >= heads)
      return 1;
  const int64_t head_stride = row_bytes, row_stride = heads * row_bytes;
  const int64_t block_stride = rows * row_stride;
  for (int64_t i = 0; i < count; i++) {
    const uint8_t *from = src + read[i] * block_stride + head[i] * head_stride;
    uint8_t *to = dst + write[i] * block_stride + head[i] * head_stride;
    for (int64_t r = 0; r < rows; r++) memcpy(to + r * row_stride, from + r * row_stride, row_bytes);
  }
  return 0;
}
