/* psguard's row digest (psguard.agent.tiers.copy_frames.rows_digest) in C: the same arithmetic, bit for bit.

   Why C: a new agent fetching a peer's copy hashes every row it receives, on four threads, beside the PS it is
   starting. numpy's version (a matrix-vector product over 64-bit words, then the mix) ran at 2.5 GB/s a thread
   in cache and took the interpreter's lock about ten times a piece; this runs at 6-7 GB/s and releases the lock
   once (ctypes). Built by `psguard build-op` (psguard.handoff.native); without it the numpy version serves.

   Each row: h = sum_j word_j * w_j + (id + 1) * w_width (mod 2^64, word_j the row's j-th little-endian 32-bit
   word), the digest the sum of splitmix64's finaliser of each h (mod 2^64). Plain C99, no CPU-specific flags:
   a library built for an image runs on every machine the image does. */
#include <stddef.h>
#include <stdint.h>

static inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xBF58476D1CE4E5B9ULL;
  x ^= x >> 27;
  x *= 0x94D049BB133111EBULL;
  x ^= x >> 31;
  return x;
}

/* rows x width 32-bit words, C order; ids: one per row, or NULL for first, first + 1, ...; w: width + 1 weights. */
uint64_t psguard_rows_digest(const uint32_t *words, uint64_t rows, uint64_t width, const int64_t *ids,
                             int64_t first, const uint64_t *w) {
  uint64_t total = 0;
  const uint64_t wid = w[width];
  for (uint64_t r = 0; r < rows; r++) {
    const uint32_t *row = words + r * width;
    uint64_t h = 0;
    for (uint64_t j = 0; j < width; j++) h += (uint64_t)row[j] * w[j];
    const uint64_t id = ids ? (uint64_t)ids[r] : (uint64_t)first + r;
    total += mix(h + (id + 1) * wid);
  }
  return total;
}
