// CRC32C (Castagnoli, RFC 3720) of host buffers: the NVMe tier's block checksums
// (offload/nvme.py, kernels/checksum.py).
//
// [Note: three streams] The SSE4.2 crc32 instruction has a latency of three cycles and a
// throughput of one per cycle, so a single CRC runs at a third of the instruction's speed. A
// buffer is cut into three parts (the first two a multiple of 8 bytes long, the last one the
// rest), whose CRC32Cs are computed in one loop and returned as three values: the checksum of
// the buffer is the triple, so no combining step is needed. Without SSE4.2 a table gives the
// same values, slower.
#include <cstdint>
#include <cstring>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#define CHECKSUM_HAVE_SSE42 1
#else
#define CHECKSUM_HAVE_SSE42 0
#endif

namespace {

constexpr uint32_t kPoly = 0x82F63B78u;  // CRC32C, reflected

struct Table {
  uint32_t entry[256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (kPoly & (0u - (c & 1u)));
      entry[i] = c;
    }
  }
};

const Table& table() {
  static const Table t;
  return t;
}

inline uint32_t crc_byte(uint32_t crc, uint8_t byte) {
#if CHECKSUM_HAVE_SSE42
  return _mm_crc32_u8(crc, byte);
#else
  return table().entry[(crc ^ byte) & 0xFFu] ^ (crc >> 8);
#endif
}

inline uint32_t crc_word(uint32_t crc, const unsigned char* p) {
#if CHECKSUM_HAVE_SSE42
  uint64_t word;
  std::memcpy(&word, p, 8);
  return static_cast<uint32_t>(_mm_crc32_u64(crc, word));
#else
  for (int k = 0; k < 8; ++k) crc = crc_byte(crc, p[k]);
  return crc;
#endif
}

// The raw CRC (no pre/post inversion) of n bytes continuing from crc.
uint32_t crc_bytes(uint32_t crc, const unsigned char* p, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) crc = crc_word(crc, p + i);
  for (; i < n; ++i) crc = crc_byte(crc, p[i]);
  return crc;
}

}  // namespace

extern "C" {

int cmk_checksum_has_sse42() { return CHECKSUM_HAVE_SSE42; }

// out[0..2]: the CRC32Cs of the three parts of data[0, n) (see [Note: three streams]).
int cmk_crc32c_3(const void* data, int64_t n, uint32_t* out) {
  if (n < 0 || (n > 0 && data == nullptr) || out == nullptr) return 1;
  const auto* p = static_cast<const unsigned char*>(data);
  const int64_t part = (n / 3) & ~int64_t{7};
  const unsigned char* p1 = p + part;
  const unsigned char* p2 = p + 2 * part;
  uint32_t c0 = 0xFFFFFFFFu, c1 = 0xFFFFFFFFu, c2 = 0xFFFFFFFFu;
  for (int64_t i = 0; i < part; i += 8) {
    c0 = crc_word(c0, p + i);
    c1 = crc_word(c1, p1 + i);
    c2 = crc_word(c2, p2 + i);
  }
  c2 = crc_bytes(c2, p2 + part, n - 3 * part);
  out[0] = ~c0;
  out[1] = ~c1;
  out[2] = ~c2;
  return 0;
}

}  // extern "C"
