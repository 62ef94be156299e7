/* datapipe's optional CPU kernel: uint8 RGB pixels -> normalised float32, mirrored on request.
 *
 * One pass over an H x W x 3 uint8 image (rows may be strided: a crop of a larger image) writes
 * dst[c][y][x] (planar, NCHW) or dst[y][x][c] (interleaved, channels_last) = src * scale[c] + shift[c],
 * reading column W-1-x instead of x when flip is set. torch needs a converting copy plus a separate
 * broadcast multiply-add whose strided inner loop does not vectorise (~0.12 ms for 224 x 224 here);
 * this does both at once with AVX2 byte shuffles and, for large outputs, non-temporal stores that
 * skip reading the destination into the cache first (~0.04 ms).
 *
 * Loaded through ctypes (no Python API is used), which releases the GIL for each call, so reader
 * threads convert in parallel. Built at install time when a C compiler is present; without one,
 * datapipe uses the torch kernels. See datapipe/native.py.
 */
#include <stddef.h>
#include <stdint.h>

#define DATAPIPE_NATIVE_ABI 1

int datapipe_native_abi(void) { return DATAPIPE_NATIVE_ABI; }

static void convert_scalar(const uint8_t *src, ptrdiff_t h, ptrdiff_t w, ptrdiff_t src_row, int flip, int planar,
                           const float *scale, const float *shift, float *dst, ptrdiff_t x0)
{
    const ptrdiff_t plane = h * w;
    for (ptrdiff_t y = 0; y < h; y++) {
        const uint8_t *row = src + y * src_row;
        for (ptrdiff_t x = x0; x < w; x++) {
            const uint8_t *p = row + 3 * (flip ? w - 1 - x : x);
            for (int c = 0; c < 3; c++) {
                float v = p[c] * scale[c] + shift[c];
                if (planar)
                    dst[c * plane + y * w + x] = v;
                else
                    dst[(y * w + x) * 3 + c] = v;
            }
        }
    }
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_AVX2_PATH 1

/* Blocks of 8 pixels (24 source bytes, read as two overlapping 16-byte loads at +0 and +8). Each
 * of the three output groups of 8 floats picks its 8 source bytes with one shuffle per load:
 * planar: group c = channel c of pixels 0..7; interleaved: group g = output bytes 8g..8g+7. */
__attribute__((target("avx2,fma"))) static ptrdiff_t
convert_avx2(const uint8_t *src, ptrdiff_t h, ptrdiff_t w, ptrdiff_t src_row, int flip, int planar,
             const float *scale, const float *shift, float *dst, int stream)
{
    const ptrdiff_t plane = h * w, wv = w & ~(ptrdiff_t)7;
    __m128i mlo[3], mhi[3];
    __m256 sc[3], sh[3];
    for (int g = 0; g < 3; g++) {
        int8_t lo[16], hi[16];
        float s[8], b[8];
        for (int i = 0; i < 16; i++)
            lo[i] = hi[i] = -1; /* pshufb writes 0 for a negative index */
        for (int j = 0; j < 8; j++) {
            const int pixel = planar ? j : (8 * g + j) / 3, c = planar ? g : (8 * g + j) % 3;
            const int byte = 3 * (flip ? 7 - pixel : pixel) + c;
            if (byte < 16)
                lo[j] = (int8_t)byte;
            else
                hi[j] = (int8_t)(byte - 8);
            s[j] = scale[c];
            b[j] = shift[c];
        }
        mlo[g] = _mm_loadu_si128((const __m128i *)lo);
        mhi[g] = _mm_loadu_si128((const __m128i *)hi);
        sc[g] = _mm256_loadu_ps(s);
        sh[g] = _mm256_loadu_ps(b);
    }
    for (ptrdiff_t y = 0; y < h; y++) {
        const uint8_t *row = src + y * src_row;
        for (ptrdiff_t x = 0; x < wv; x += 8) {
            const uint8_t *p = row + 3 * (flip ? w - 8 - x : x); /* the block's first source pixel */
            const __m128i lo = _mm_loadu_si128((const __m128i *)p);
            const __m128i hi = _mm_loadu_si128((const __m128i *)(p + 8));
            for (int g = 0; g < 3; g++) {
                const __m128i bytes = _mm_or_si128(_mm_shuffle_epi8(lo, mlo[g]), _mm_shuffle_epi8(hi, mhi[g]));
                const __m256 v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), sc[g], sh[g]);
                float *d = planar ? dst + g * plane + y * w + x : dst + (y * w + x) * 3 + 8 * g;
                if (stream)
                    _mm256_stream_ps(d, v);
                else
                    _mm256_storeu_ps(d, v);
            }
        }
    }
    if (stream)
        _mm_sfence();
    return wv;
}
#endif

/* 1 when the vector path runs on this CPU, 0 when the scalar loop does (then torch is faster). */
int datapipe_native_simd(void)
{
#ifdef HAVE_AVX2_PATH
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#else
    return 0;
#endif
}

/* src: h rows of w RGB pixels, row r at src + r * src_row bytes. dst: float32, 3 * h * w, contiguous in
 * the chosen layout. stream: prefer non-temporal stores (used only when dst is 32-byte aligned and
 * w % 8 == 0, so that every store is aligned). */
void datapipe_u8_to_f32(const uint8_t *src, ptrdiff_t h, ptrdiff_t w, ptrdiff_t src_row, int flip, int planar,
                        const float *scale, const float *shift, float *dst, int stream)
{
    ptrdiff_t done = 0;
#ifdef HAVE_AVX2_PATH
    if (w >= 8 && datapipe_native_simd()) {
        stream = stream && ((uintptr_t)dst % 32 == 0) && (w % 8 == 0);
        done = convert_avx2(src, h, w, src_row, flip, planar, scale, shift, dst, stream);
    }
#endif
    if (done < w)
        convert_scalar(src, h, w, src_row, flip, planar, scale, shift, dst, done);
}
