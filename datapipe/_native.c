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
 *
 * The last part reads memory-mapped shard files under a SIGBUS guard: a file truncated under a
 * reader makes the read return an error instead of killing the process.
 */
#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>

#define DATAPIPE_NATIVE_ABI 5

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

/* ------------------------------------------------------------------------------------------------
 * The hue turn of torchvision's ColorJitter on float RGB in [0, 1], in place: torchvision's _rgb2hsv,
 * the hue moved by f (of a full turn, modulo 1), and its _hsv2rgb, written per pixel with the same
 * float32 operations in the same order (torch needs ~40 full-image temporaries for it; Kornia's
 * version ~4.4 ms per 224 x 224 image on one core here). Pixel (y, x) of channel c is at
 * x[c * sc + y * sy + x * sx] (element strides: planar or channels_last, a batch row of either).
 * ------------------------------------------------------------------------------------------------ */

static inline float clamp01(float v) { return v < 0.0f ? 0.0f : v > 1.0f ? 1.0f : v; }

static inline void hue_pixel(float *r, float *g, float *b, float f)
{
    const float R = *r, G = *g, B = *b;
    const float maxc = fmaxf(fmaxf(R, G), B), minc = fminf(fminf(R, G), B);
    const int eqc = maxc == minc;
    const float cr = maxc - minc;
    const float s = cr / (eqc ? 1.0f : maxc);
    const float crd = eqc ? 1.0f : cr;
    const float rc = (maxc - R) / crd, gc = (maxc - G) / crd, bc = (maxc - B) / crd;
    float h;
    if (maxc == R)
        h = bc - gc;
    else if (maxc == G)
        h = (2.0f + rc) - bc;
    else
        h = (4.0f + gc) - rc;
    /* Each step below is exact as written where torch's call is exact too (no libm call on the way):
     * h / 6 + 1 lies in [0.83, 1.84), so fmod(., 1) subtracts 1 or nothing; h + f lies in (-1.5, 2.5) for
     * |f| <= 0.5, so floor is the truncation less one below zero; h * 6 >= 0, so floor is truncation. */
    h = h / 6.0f + 1.0f;
    h = h >= 1.0f ? h - 1.0f : h;
    h = h + f;
    const int k = (int)h - (h < (float)(int)h);
    h = h - (float)k; /* torch's remainder(h, 1) */
    const int i = (int)(h * 6.0f);
    const float ff = h * 6.0f - (float)i;
    const float v = maxc;
    const float p = clamp01(v * (1.0f - s)), q = clamp01(v * (1.0f - s * ff)), t = clamp01(v * (1.0f - s * (1.0f - ff)));
    switch (i % 6) {
    case 0: *r = v; *g = t; *b = p; break;
    case 1: *r = q; *g = v; *b = p; break;
    case 2: *r = p; *g = v; *b = t; break;
    case 3: *r = p; *g = q; *b = v; break;
    case 4: *r = t; *g = p; *b = v; break;
    default: *r = v; *g = p; *b = q; break;
    }
}

#ifdef HAVE_AVX2_PATH
/* hue_pixel on 8 pixels at a time, with the same operations (no FMA: each product is rounded as the scalar
 * one is), the branches as selects. Rows of packed planes (sx == 1) load and store whole vectors; any other
 * stride gathers and scatters through a small buffer. Returns the pixels done (a multiple of 8). */
__attribute__((target("avx2"))) static ptrdiff_t hue_row_avx2(float *row, ptrdiff_t w, ptrdiff_t sc, ptrdiff_t sx,
                                                               float f)
{
    const ptrdiff_t n = w & ~(ptrdiff_t)7;
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    const __m256 four = _mm256_set1_ps(4.0f), six = _mm256_set1_ps(6.0f), fv = _mm256_set1_ps(f);
    float buf[3][8];
    for (ptrdiff_t x = 0; x < n; x += 8) {
        float *p0 = row + x * sx;
        __m256 R, G, B;
        if (sx == 1) {
            R = _mm256_loadu_ps(p0), G = _mm256_loadu_ps(p0 + sc), B = _mm256_loadu_ps(p0 + 2 * sc);
        } else {
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 3; c++)
                    buf[c][j] = p0[j * sx + c * sc];
            R = _mm256_loadu_ps(buf[0]), G = _mm256_loadu_ps(buf[1]), B = _mm256_loadu_ps(buf[2]);
        }
        const __m256 maxc = _mm256_max_ps(_mm256_max_ps(R, G), B), minc = _mm256_min_ps(_mm256_min_ps(R, G), B);
        const __m256 eqc = _mm256_cmp_ps(maxc, minc, _CMP_EQ_OQ);
        const __m256 cr = _mm256_sub_ps(maxc, minc);
        const __m256 s = _mm256_div_ps(cr, _mm256_blendv_ps(maxc, one, eqc));
        const __m256 crd = _mm256_blendv_ps(cr, one, eqc);
        const __m256 rc = _mm256_div_ps(_mm256_sub_ps(maxc, R), crd);
        const __m256 gc = _mm256_div_ps(_mm256_sub_ps(maxc, G), crd);
        const __m256 bc = _mm256_div_ps(_mm256_sub_ps(maxc, B), crd);
        const __m256 hr = _mm256_sub_ps(bc, gc);
        const __m256 hg = _mm256_sub_ps(_mm256_add_ps(two, rc), bc);
        const __m256 hb = _mm256_sub_ps(_mm256_add_ps(four, gc), rc);
        __m256 h = _mm256_blendv_ps(hb, hg, _mm256_cmp_ps(maxc, G, _CMP_EQ_OQ));
        h = _mm256_blendv_ps(h, hr, _mm256_cmp_ps(maxc, R, _CMP_EQ_OQ));
        h = _mm256_add_ps(_mm256_div_ps(h, six), one);
        h = _mm256_blendv_ps(h, _mm256_sub_ps(h, one), _mm256_cmp_ps(h, one, _CMP_GE_OQ));
        h = _mm256_add_ps(h, fv);
        h = _mm256_sub_ps(h, _mm256_floor_ps(h));
        const __m256 h6 = _mm256_mul_ps(h, six), i6 = _mm256_floor_ps(h6);
        const __m256 ff = _mm256_sub_ps(h6, i6);
        const __m256 v = maxc;
        const __m256 pp = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, _mm256_sub_ps(one, s)), zero), one);
        const __m256 qq = _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, _mm256_sub_ps(one, _mm256_mul_ps(s, ff))), zero), one);
        const __m256 tt = _mm256_min_ps(
            _mm256_max_ps(_mm256_mul_ps(v, _mm256_sub_ps(one, _mm256_mul_ps(s, _mm256_sub_ps(one, ff)))), zero), one);
        __m256 m[6];
        for (int k = 0; k < 6; k++)
            m[k] = _mm256_cmp_ps(i6, _mm256_set1_ps((float)k), _CMP_EQ_OQ);
        m[0] = _mm256_or_ps(m[0], _mm256_cmp_ps(i6, six, _CMP_EQ_OQ)); /* h * 6 rounded up to 6: sector 0 */
        /* sectors 0..5: r = v t p p t v -> (v, q, p, p, t, v); g = (t, v, v, q, p, p); b = (p, p, t, v, v, q) */
        __m256 r = pp, g = pp, b = pp;
        r = _mm256_blendv_ps(r, v, _mm256_or_ps(m[0], m[5]));
        r = _mm256_blendv_ps(r, qq, m[1]);
        r = _mm256_blendv_ps(r, tt, m[4]);
        g = _mm256_blendv_ps(g, tt, m[0]);
        g = _mm256_blendv_ps(g, v, _mm256_or_ps(m[1], m[2]));
        g = _mm256_blendv_ps(g, qq, m[3]);
        b = _mm256_blendv_ps(b, tt, m[2]);
        b = _mm256_blendv_ps(b, v, _mm256_or_ps(m[3], m[4]));
        b = _mm256_blendv_ps(b, qq, m[5]);
        if (sx == 1) {
            _mm256_storeu_ps(p0, r), _mm256_storeu_ps(p0 + sc, g), _mm256_storeu_ps(p0 + 2 * sc, b);
        } else {
            _mm256_storeu_ps(buf[0], r), _mm256_storeu_ps(buf[1], g), _mm256_storeu_ps(buf[2], b);
            for (int j = 0; j < 8; j++)
                for (int c = 0; c < 3; c++)
                    p0[j * sx + c * sc] = buf[c][j];
        }
    }
    return n;
}
#endif

void datapipe_hue_f32(float *x, ptrdiff_t h, ptrdiff_t w, ptrdiff_t sc, ptrdiff_t sy, ptrdiff_t sx, float f)
{
    const int simd = datapipe_native_simd();
    (void)simd;
    for (ptrdiff_t y = 0; y < h; y++) {
        float *row = x + y * sy;
        ptrdiff_t done = 0;
#ifdef HAVE_AVX2_PATH
        if (simd)
            done = hue_row_avx2(row, w, sc, sx, f);
#endif
        for (ptrdiff_t i = done; i < w; i++) {
            float *p = row + i * sx;
            hue_pixel(p, p + sc, p + 2 * sc, f);
        }
    }
}

/* The other three operations of ColorJitter, in place on one float RGB image in [0, 1] (strides as for the
 * hue): torchvision's _blend(img, other, f) = (f * img + (1 - f) * other) clamped to [0, 1], where other is
 * black (brightness), the image's mean grey (contrast) or each pixel's grey (saturation); grey = 0.2989 R +
 * 0.587 G + 0.114 B. The same float32 operations in the same order, so brightness and saturation give
 * torchvision's values bit for bit; the contrast's mean is summed in double (torch sums in float32 in its
 * own order: the mean may differ in its last bit). torch needs ~10 full-image temporaries per operation. */

enum { JITTER_BRIGHTNESS = 0, JITTER_CONTRAST = 1, JITTER_SATURATION = 2 };

static inline float gray_of(float r, float g, float b) { return 0.2989f * r + 0.587f * g + 0.114f * b; }

static inline float blend01(float v, float f, float other_part) { return clamp01(f * v + other_part); }

#ifdef HAVE_AVX2_PATH
__attribute__((target("avx2"))) static ptrdiff_t blend_row_avx2(float *r, float *g, float *b, ptrdiff_t w, int op,
                                                                  float f, float mean_part)
{
    const ptrdiff_t n = w & ~(ptrdiff_t)7;
    const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f), fv = _mm256_set1_ps(f);
    const __m256 rest = _mm256_set1_ps(1.0f - f), part = _mm256_set1_ps(mean_part);
    const __m256 wr = _mm256_set1_ps(0.2989f), wg = _mm256_set1_ps(0.587f), wb = _mm256_set1_ps(0.114f);
    for (ptrdiff_t i = 0; i < n; i += 8) {
        __m256 R = _mm256_loadu_ps(r + i), G = _mm256_loadu_ps(g + i), B = _mm256_loadu_ps(b + i);
        __m256 other = part;
        if (op == JITTER_SATURATION) {
            const __m256 grey = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(wr, R), _mm256_mul_ps(wg, G)), _mm256_mul_ps(wb, B));
            other = _mm256_mul_ps(grey, rest);
        }
        if (op == JITTER_BRIGHTNESS) {
            R = _mm256_mul_ps(fv, R), G = _mm256_mul_ps(fv, G), B = _mm256_mul_ps(fv, B);
        } else {
            R = _mm256_add_ps(_mm256_mul_ps(fv, R), other), G = _mm256_add_ps(_mm256_mul_ps(fv, G), other);
            B = _mm256_add_ps(_mm256_mul_ps(fv, B), other);
        }
        _mm256_storeu_ps(r + i, _mm256_min_ps(_mm256_max_ps(R, zero), one));
        _mm256_storeu_ps(g + i, _mm256_min_ps(_mm256_max_ps(G, zero), one));
        _mm256_storeu_ps(b + i, _mm256_min_ps(_mm256_max_ps(B, zero), one));
    }
    return n;
}
#endif

/* op: JITTER_BRIGHTNESS, JITTER_CONTRAST or JITTER_SATURATION; f: its factor. */
void datapipe_blend_f32(float *x, ptrdiff_t h, ptrdiff_t w, ptrdiff_t sc, ptrdiff_t sy, ptrdiff_t sx, float f, int op)
{
    float mean_part = 0.0f;
    if (op == JITTER_CONTRAST) {
        double sum = 0.0;
        for (ptrdiff_t y = 0; y < h; y++)
            for (ptrdiff_t i = 0; i < w; i++) {
                const float *p = x + y * sy + i * sx;
                sum += gray_of(p[0], p[sc], p[2 * sc]);
            }
        mean_part = (float)(sum / (double)(h * w)) * (1.0f - f);
    }
    const int simd = datapipe_native_simd();
    (void)simd;
    for (ptrdiff_t y = 0; y < h; y++) {
        float *r = x + y * sy, *g = r + sc, *b = r + 2 * sc;
        ptrdiff_t done = 0;
#ifdef HAVE_AVX2_PATH
        if (simd && sx == 1)
            done = blend_row_avx2(r, g, b, w, op, f, mean_part);
#endif
        for (ptrdiff_t i = done; i < w; i++) {
            float *pr = r + i * sx, *pg = g + i * sx, *pb = b + i * sx;
            if (op == JITTER_BRIGHTNESS) {
                *pr = clamp01(f * *pr), *pg = clamp01(f * *pg), *pb = clamp01(f * *pb);
                continue;
            }
            const float other = op == JITTER_SATURATION ? gray_of(*pr, *pg, *pb) * (1.0f - f) : mean_part;
            *pr = blend01(*pr, f, other), *pg = blend01(*pg, f, other), *pb = blend01(*pb, f, other);
        }
    }
}

/* ------------------------------------------------------------------------------------------------
 * Antialiased bilinear resize of packed uint8 RGB, bit-identical to torch's uint8 path
 * (F.interpolate(mode="bilinear", antialias=True) on uint8: aten/src/ATen/native/cpu/UpSampleKernel.cpp,
 * HelperInterpBase::_compute_indices_min_size_weights_aa + _compute_index_ranges_int16_weights, and
 * the separable passes of UpSampleKernelAVXAntialias.h). The weights are the same doubles, rounded
 * to int16 at the same precision, and each pass is the same integer dot product plus half an LSB,
 * shifted and clamped: the width pass first (over every input row), then the height pass.
 *
 * What differs is the work around it: torch copies a strided crop into a contiguous tensor, and for
 * three channels widens every pixel to four bytes and back; here the crop is read in place, the
 * width pass loads each output pixel's taps with one 16-byte load and one byte shuffle, and the
 * height pass runs over whole rows 32 bytes at a time, whatever the channel boundaries.
 * ------------------------------------------------------------------------------------------------ */

typedef struct {
    int32_t *start; /* first input index of each output */
    int32_t *taps;  /* number of input indices of each output */
    int16_t *w;     /* [out][kmax] int16 weights (0 past taps) */
    int kmax;       /* taps allocated per output */
    int precision;  /* weights are scaled by 2^precision */
} axis_t;

static double aa_bilinear(double x)
{
    x = fabs(x);
    return x < 1.0 ? 1.0 - x : 0.0;
}

static int axis_kmax(ptrdiff_t in, ptrdiff_t out)
{
    const double scale = (double)in / (double)out;
    const double support = scale >= 1.0 ? 1.0 * scale : 1.0;
    return (int)ceil(support) * 2 + 1;
}

/* Fills ax (its arrays are preallocated for out outputs of ax->kmax taps), using wd (out * kmax doubles). */
static void axis_fill(axis_t *ax, ptrdiff_t in, ptrdiff_t out, double *wd)
{
    const double scale = (double)in / (double)out;
    const double support = scale >= 1.0 ? 1.0 * scale : 1.0;
    const double invscale = scale >= 1.0 ? 1.0 / scale : 1.0;
    const int kmax = ax->kmax;
    double wt_max = 0.0;
    for (ptrdiff_t i = 0; i < out; i++) {
        const double center = scale * ((double)i + 0.5);
        int64_t xmin = (int64_t)(center - support + 0.5), xsize;
        if (xmin < 0)
            xmin = 0;
        xsize = (int64_t)(center + support + 0.5);
        if (xsize > in)
            xsize = in;
        xsize -= xmin;
        if (xsize < 0)
            xsize = 0;
        if (xsize > kmax)
            xsize = kmax;
        double *w = wd + i * kmax, total = 0.0;
        for (int64_t j = 0; j < xsize; j++) {
            w[j] = aa_bilinear(((double)(j + xmin) - center + 0.5) * invscale);
            total += w[j];
        }
        if (total != 0.0) {
            for (int64_t j = 0; j < xsize; j++) {
                w[j] /= total;
                if (w[j] > wt_max)
                    wt_max = w[j];
            }
        }
        for (int64_t j = xsize; j < kmax; j++)
            w[j] = 0.0;
        ax->start[i] = (int32_t)xmin;
        ax->taps[i] = (int32_t)xsize;
    }
    int precision;
    for (precision = 0; precision < 22; ++precision) {
        const int next_value = (int)(0.5 + wt_max * (1 << (precision + 1)));
        if (next_value >= (1 << 15))
            break;
    }
    ax->precision = precision;
    for (ptrdiff_t i = 0; i < out * kmax; i++) {
        const double v = wd[i] * (1 << precision);
        ax->w[i] = (int16_t)(v < 0 ? (int)(-0.5 + v) : (int)(0.5 + v));
    }
}

static inline uint8_t clamp_u8(int32_t v) { return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v; }

/* The width pass of one row, outputs [x0, out_w), plain C. */
static void hpass_row_scalar(const uint8_t *src, uint8_t *dst, const axis_t *ax, ptrdiff_t x0, ptrdiff_t out_w)
{
    const int32_t round = 1 << (ax->precision - 1);
    for (ptrdiff_t x = x0; x < out_w; x++) {
        const uint8_t *p = src + 3 * (ptrdiff_t)ax->start[x];
        const int16_t *w = ax->w + x * ax->kmax;
        int32_t r = round, g = round, b = round;
        for (int k = 0; k < ax->taps[x]; k++) {
            r += w[k] * p[3 * k];
            g += w[k] * p[3 * k + 1];
            b += w[k] * p[3 * k + 2];
        }
        dst[3 * x] = clamp_u8(r >> ax->precision);
        dst[3 * x + 1] = clamp_u8(g >> ax->precision);
        dst[3 * x + 2] = clamp_u8(b >> ax->precision);
    }
}

/* The height pass of one output row over bytes [i0, n), plain C. */
static void vpass_row_scalar(const uint8_t *src, ptrdiff_t src_row, uint8_t *dst, const axis_t *ax, ptrdiff_t y,
                             ptrdiff_t i0, ptrdiff_t n)
{
    const int32_t round = 1 << (ax->precision - 1);
    const uint8_t *first = src + (ptrdiff_t)ax->start[y] * src_row;
    const int16_t *w = ax->w + y * ax->kmax;
    for (ptrdiff_t i = i0; i < n; i++) {
        int32_t acc = round;
        for (int k = 0; k < ax->taps[y]; k++)
            acc += w[k] * first[k * src_row + i];
        dst[i] = clamp_u8(acc >> ax->precision);
    }
}

#ifdef HAVE_AVX2_PATH
/* Width-pass weights of output x laid out for the shuffle below: per pair of taps, 16 int16
 * (w0 w1 w0 w1 w0 w1 0 0, twice: one 128-bit lane per input row), so that one madd gives, per
 * row, the R, G and B sums of the pair. Taps past an output's last have weight 0. */
static void hweights_avx2(const axis_t *ax, ptrdiff_t out_w, int pairs, int16_t *hw)
{
    for (ptrdiff_t x = 0; x < out_w; x++) {
        const int16_t *w = ax->w + x * ax->kmax;
        for (int j = 0; j < pairs; j++) {
            int16_t *v = hw + (x * pairs + j) * 16;
            const int k = 2 * j;
            const int16_t a = k < ax->taps[x] ? w[k] : 0, b = k + 1 < ax->taps[x] ? w[k + 1] : 0;
            for (int lane = 0; lane < 2; lane++) {
                for (int ch = 0; ch < 3; ch++) {
                    v[8 * lane + 2 * ch] = a;
                    v[8 * lane + 2 * ch + 1] = b;
                }
                v[8 * lane + 6] = v[8 * lane + 7] = 0;
            }
        }
    }
}

/* The first output whose 16-byte loads would read past the end of an input row, or the last output
 * (whose 4-byte store would write past the end of its row): from there on the width pass runs in
 * plain C. */
static ptrdiff_t hpass_vector_end(const axis_t *ax, ptrdiff_t in_w, ptrdiff_t out_w, int pairs)
{
    ptrdiff_t x = 0;
    while (x + 1 < out_w && 3 * (ptrdiff_t)ax->start[x] + 12 * ((pairs - 1) / 2) + 16 <= 3 * in_w)
        x++;
    return x;
}

/* Pairs of taps that the longest output of the axis needs. */
static int hpass_pairs(const axis_t *ax, ptrdiff_t out_w)
{
    int taps = 1;
    for (ptrdiff_t x = 0; x < out_w; x++)
        taps = ax->taps[x] > taps ? ax->taps[x] : taps;
    return (taps + 1) / 2;
}

/* One output x of the width pass for four input rows: its R G B sums, rounded and shifted, as
 * int32 [row 0 | row 1] in *t01 and [row 2 | row 3] in *t23. Two rows share each register (one per
 * 128-bit lane), so each pair of taps costs one shuffle per two rows and the sums need no
 * cross-lane reduction; the output's weights are loaded once for all the rows. */
__attribute__((target("avx2"), always_inline)) static inline void
hpass_sums(const uint8_t *s0, const uint8_t *s1, const uint8_t *s2, const uint8_t *s3, const axis_t *ax, ptrdiff_t x,
           const int16_t *hw, const int pairs, __m256i *t01, __m256i *t23)
{
    /* per lane: pixels 0 and 1 (lo), 2 and 3 (hi) of a 16-byte load as int16 (R0 R1 G0 G1 B0 B1 0 0) */
    const __m256i shuffle_lo = _mm256_setr_epi8(0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1,
                                                0, -1, 3, -1, 1, -1, 4, -1, 2, -1, 5, -1, -1, -1, -1, -1);
    const __m256i shuffle_hi = _mm256_setr_epi8(6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1,
                                                6, -1, 9, -1, 7, -1, 10, -1, 8, -1, 11, -1, -1, -1, -1, -1);
    const ptrdiff_t first = 3 * (ptrdiff_t)ax->start[x];
    const int16_t *wx = hw + x * pairs * 16;
    __m256i a = _mm256_set1_epi32(1 << (ax->precision - 1)), b = a;
    for (int j = 0; j < pairs; j += 2) { /* one load per row covers two pairs */
        const ptrdiff_t o = first + 6 * j;
        const __m256i p01 = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s0 + o))), _mm_loadu_si128((const __m128i *)(s1 + o)), 1);
        const __m256i p23 = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(s2 + o))), _mm_loadu_si128((const __m128i *)(s3 + o)), 1);
        const __m256i wa = _mm256_loadu_si256((const __m256i *)(wx + j * 16));
        a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_shuffle_epi8(p01, shuffle_lo), wa));
        b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_shuffle_epi8(p23, shuffle_lo), wa));
        if (j + 1 < pairs) {
            const __m256i wb = _mm256_loadu_si256((const __m256i *)(wx + (j + 1) * 16));
            a = _mm256_add_epi32(a, _mm256_madd_epi16(_mm256_shuffle_epi8(p01, shuffle_hi), wb));
            b = _mm256_add_epi32(b, _mm256_madd_epi16(_mm256_shuffle_epi8(p23, shuffle_hi), wb));
        }
    }
    *t01 = _mm256_srai_epi32(a, ax->precision);
    *t23 = _mm256_srai_epi32(b, ax->precision);
}

/* The width pass of `rows` (1..4) input rows, outputs [0, xv): four outputs at a time, packed to
 * 12 bytes per row with one shuffle per two rows and written with one 16-byte store per row (its
 * last 4 bytes are overwritten by the next outputs), then one output at a time with 4-byte stores
 * (the 4th byte likewise). xv leaves the row's last output to the plain-C loop. */
__attribute__((target("avx2"), always_inline)) static inline void
hpass_rows_impl(const uint8_t *src, ptrdiff_t src_row, uint8_t *dst, ptrdiff_t dst_row, int rows, const axis_t *ax,
                ptrdiff_t xv, ptrdiff_t out_w, const int16_t *hw, const int pairs)
{
    /* per lane: R G B of 4 pixels stored as R G B 0 -> 12 packed bytes, then 4 zeros */
    const __m256i compact = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                             0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const uint8_t *s1 = src + (rows > 1 ? src_row : 0), *s2 = src + (rows > 2 ? 2 * src_row : 0);
    const uint8_t *s3 = src + (rows > 3 ? 3 * src_row : 0);
    ptrdiff_t x = 0;
    for (; x + 3 < xv && x + 6 <= out_w; x += 4) {
        __m256i t01[4], t23[4];
        for (int i = 0; i < 4; i++)
            hpass_sums(src, s1, s2, s3, ax, x + i, hw, pairs, &t01[i], &t23[i]);
        /* lane 0: row 0 (row 2), lane 1: row 1 (row 3); 4 pixels each */
        const __m256i r01 = _mm256_shuffle_epi8(
            _mm256_packus_epi16(_mm256_packs_epi32(t01[0], t01[1]), _mm256_packs_epi32(t01[2], t01[3])), compact);
        const __m256i r23 = _mm256_shuffle_epi8(
            _mm256_packus_epi16(_mm256_packs_epi32(t23[0], t23[1]), _mm256_packs_epi32(t23[2], t23[3])), compact);
        uint8_t *d = dst + 3 * x;
        _mm_storeu_si128((__m128i *)d, _mm256_castsi256_si128(r01));
        if (rows > 1)
            _mm_storeu_si128((__m128i *)(d + dst_row), _mm256_extracti128_si256(r01, 1));
        if (rows > 2)
            _mm_storeu_si128((__m128i *)(d + 2 * dst_row), _mm256_castsi256_si128(r23));
        if (rows > 3)
            _mm_storeu_si128((__m128i *)(d + 3 * dst_row), _mm256_extracti128_si256(r23, 1));
    }
    for (; x < xv; x++) {
        __m256i t01, t23;
        hpass_sums(src, s1, s2, s3, ax, x, hw, pairs, &t01, &t23);
        const __m256i packed = _mm256_packus_epi16(_mm256_packs_epi32(t01, t23), t01);
        /* lane 0: row 0, row 2; lane 1: row 1, row 3 (4 bytes each) */
        const __m128i lo = _mm256_castsi256_si128(packed), hi = _mm256_extracti128_si256(packed, 1);
        uint8_t *d = dst + 3 * x;
        const int32_t p0 = _mm_cvtsi128_si32(lo), p1 = _mm_cvtsi128_si32(hi);
        const int32_t p2 = _mm_extract_epi32(lo, 1), p3 = _mm_extract_epi32(hi, 1);
        memcpy(d, &p0, 4);
        if (rows > 1)
            memcpy(d + dst_row, &p1, 4);
        if (rows > 2)
            memcpy(d + 2 * dst_row, &p2, 4);
        if (rows > 3)
            memcpy(d + 3 * dst_row, &p3, 4);
    }
}

/* Every output's weights cover `pairs` pairs of taps (zero weights past its own); one or two pairs,
 * every upscale and downscales up to ~1.5x, get loops without an inner loop. */
__attribute__((target("avx2"))) static void
hpass_rows_avx2(const uint8_t *src, ptrdiff_t src_row, uint8_t *dst, ptrdiff_t dst_row, int rows, const axis_t *ax,
                ptrdiff_t xv, ptrdiff_t out_w, const int16_t *hw, int pairs)
{
    if (rows == 4 && pairs == 1)
        hpass_rows_impl(src, src_row, dst, dst_row, 4, ax, xv, out_w, hw, 1);
    else if (rows == 4 && pairs == 2)
        hpass_rows_impl(src, src_row, dst, dst_row, 4, ax, xv, out_w, hw, 2);
    else
        hpass_rows_impl(src, src_row, dst, dst_row, rows, ax, xv, out_w, hw, pairs);
}

/* One output row of the height pass over bytes [0, n & ~31); returns where it stopped. */
__attribute__((target("avx2"))) static ptrdiff_t
vpass_row_avx2(const uint8_t *src, ptrdiff_t src_row, uint8_t *dst, const axis_t *ax, ptrdiff_t y, ptrdiff_t n)
{
    const ptrdiff_t nv = n & ~(ptrdiff_t)31;
    const int precision = ax->precision; /* locals: the stores (bytes) may alias the axis for the compiler */
    const __m256i round = _mm256_set1_epi32(1 << (precision - 1)), zero = _mm256_setzero_si256();
    const uint8_t *first = src + (ptrdiff_t)ax->start[y] * src_row;
    const int16_t *w = ax->w + y * ax->kmax;
    const int taps = ax->taps[y];
    if (taps <= 2) { /* every upscale: one pair of rows, its weights broadcast once for the row */
        const uint8_t *second = taps == 2 ? first + src_row : first; /* weight 0 when one tap */
        const __m256i mk = _mm256_set1_epi32((int32_t)(((uint32_t)(uint16_t)(taps == 2 ? w[1] : 0) << 16) |
                                                       (uint16_t)w[0]));
        for (ptrdiff_t i = 0; i < nv; i += 32) {
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)(first + i));
            const __m256i r1 = _mm256_loadu_si256((const __m256i *)(second + i));
            const __m256i lo = _mm256_unpacklo_epi8(r0, r1), hi = _mm256_unpackhi_epi8(r0, r1);
            const __m256i a0 = _mm256_add_epi32(round, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), mk));
            const __m256i a1 = _mm256_add_epi32(round, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), mk));
            const __m256i a2 = _mm256_add_epi32(round, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), mk));
            const __m256i a3 = _mm256_add_epi32(round, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), mk));
            const __m256i p01 = _mm256_packs_epi32(_mm256_srai_epi32(a0, precision), _mm256_srai_epi32(a1, precision));
            const __m256i p23 = _mm256_packs_epi32(_mm256_srai_epi32(a2, precision), _mm256_srai_epi32(a3, precision));
            _mm256_storeu_si256((__m256i *)(dst + i), _mm256_packus_epi16(p01, p23));
        }
        return nv;
    }
    for (ptrdiff_t i = 0; i < nv; i += 32) {
        __m256i a0 = round, a1 = round, a2 = round, a3 = round;
        for (int k = 0; k < taps; k += 2) {
            const int pair = k + 1 < taps;
            const __m256i mk = _mm256_set1_epi32((int32_t)(((uint32_t)(uint16_t)(pair ? w[k + 1] : 0) << 16) |
                                                           (uint16_t)w[k]));
            const __m256i r0 = _mm256_loadu_si256((const __m256i *)(first + k * src_row + i));
            const __m256i r1 = pair ? _mm256_loadu_si256((const __m256i *)(first + (k + 1) * src_row + i)) : zero;
            const __m256i lo = _mm256_unpacklo_epi8(r0, r1), hi = _mm256_unpackhi_epi8(r0, r1);
            a0 = _mm256_add_epi32(a0, _mm256_madd_epi16(_mm256_unpacklo_epi8(lo, zero), mk));
            a1 = _mm256_add_epi32(a1, _mm256_madd_epi16(_mm256_unpackhi_epi8(lo, zero), mk));
            a2 = _mm256_add_epi32(a2, _mm256_madd_epi16(_mm256_unpacklo_epi8(hi, zero), mk));
            a3 = _mm256_add_epi32(a3, _mm256_madd_epi16(_mm256_unpackhi_epi8(hi, zero), mk));
        }
        /* the unpacks and packs both work within 128-bit lanes, so the bytes come back in order */
        const __m256i p01 = _mm256_packs_epi32(_mm256_srai_epi32(a0, ax->precision), _mm256_srai_epi32(a1, ax->precision));
        const __m256i p23 = _mm256_packs_epi32(_mm256_srai_epi32(a2, ax->precision), _mm256_srai_epi32(a3, ax->precision));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_packus_epi16(p01, p23));
    }
    return nv;
}
#endif

static ptrdiff_t align_up(ptrdiff_t n) { return (n + 63) & ~(ptrdiff_t)63; }

/* Resize src (in_h rows of in_w packed RGB pixels, row r at src + r * src_row bytes) into dst
 * (out_h rows of out_w packed RGB pixels, row r at dst + r * dst_row). ws: scratch of ws_size bytes.
 * Returns 0, or the workspace size needed when ws_size is smaller (nothing is written then). */
ptrdiff_t datapipe_resize_rgb(const uint8_t *src, ptrdiff_t in_h, ptrdiff_t in_w, ptrdiff_t src_row, uint8_t *dst,
                              ptrdiff_t out_h, ptrdiff_t out_w, ptrdiff_t dst_row, uint8_t *ws, ptrdiff_t ws_size)
{
    const int need_h = in_w != out_w, need_v = in_h != out_h;
    const int kx = axis_kmax(in_w, out_w), ky = axis_kmax(in_h, out_h);
    int pairs = (kx + 1) / 2; /* at most; hpass_pairs says how many are used */
    const ptrdiff_t kd = kx > ky ? kx : ky;
    const ptrdiff_t od = out_w > out_h ? out_w : out_h;
    /* workspace: doubles, two axes (start, taps, int16 weights), width-pass vectors, the intermediate image */
    const ptrdiff_t sz_d = align_up(od * kd * 8);
    const ptrdiff_t sz_x = align_up(out_w * 8) + align_up(out_w * kx * 2);
    const ptrdiff_t sz_y = align_up(out_h * 8) + align_up(out_h * ky * 2);
    const ptrdiff_t sz_hw = align_up(out_w * pairs * 32);
    const ptrdiff_t sz_tmp = (need_h && need_v) ? align_up(in_h * out_w * 3) : 0;
    const ptrdiff_t total = sz_d + sz_x + sz_y + sz_hw + sz_tmp + 64;
    if (ws_size < total)
        return total;
    uint8_t *p = (uint8_t *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    double *wd = (double *)p;
    p += sz_d;
    axis_t ax = {(int32_t *)p, (int32_t *)p + out_w, (int16_t *)(p + align_up(out_w * 8)), kx, 0};
    p += sz_x;
    axis_t ay = {(int32_t *)p, (int32_t *)p + out_h, (int16_t *)(p + align_up(out_h * 8)), ky, 0};
    p += sz_y;
    int16_t *hw = (int16_t *)p;
    p += sz_hw;
    uint8_t *tmp = p;

    if (!need_h && !need_v) {
        for (ptrdiff_t y = 0; y < out_h; y++)
            memcpy(dst + y * dst_row, src + y * src_row, (size_t)(3 * out_w));
        return 0;
    }
    const int simd = datapipe_native_simd();
    /* the width pass: every input row, into tmp (or straight into dst when the height is kept) */
    const uint8_t *vsrc = src;
    ptrdiff_t vsrc_row = src_row;
    if (need_h) {
        axis_fill(&ax, in_w, out_w, wd);
        uint8_t *hdst = need_v ? tmp : dst;
        const ptrdiff_t hdst_row = need_v ? 3 * out_w : dst_row;
        ptrdiff_t xv = 0;
#ifdef HAVE_AVX2_PATH
        if (simd) {
            pairs = hpass_pairs(&ax, out_w);
            hweights_avx2(&ax, out_w, pairs, hw);
            xv = hpass_vector_end(&ax, in_w, out_w, pairs);
            for (ptrdiff_t y = 0; y < in_h; y += 4)
                hpass_rows_avx2(src + y * src_row, src_row, hdst + y * hdst_row, hdst_row,
                                in_h - y < 4 ? (int)(in_h - y) : 4, &ax, xv, out_w, hw, pairs);
        }
#endif
        for (ptrdiff_t y = 0; y < in_h; y++)
            hpass_row_scalar(src + y * src_row, hdst + y * hdst_row, &ax, xv, out_w);
        vsrc = tmp;
        vsrc_row = 3 * out_w;
    }
    if (need_v) {
        axis_fill(&ay, in_h, out_h, wd);
        const ptrdiff_t n = 3 * out_w;
        for (ptrdiff_t y = 0; y < out_h; y++) {
            ptrdiff_t i0 = 0;
#ifdef HAVE_AVX2_PATH
            if (simd)
                i0 = vpass_row_avx2(vsrc, vsrc_row, dst + y * dst_row, &ay, y, n);
#endif
            vpass_row_scalar(vsrc, vsrc_row, dst + y * dst_row, &ay, y, i0, n);
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------
 * Guarded reads of memory-mapped files.
 *
 * A page of a mapped file that no longer exists (the file was truncated after it was mapped) raises
 * SIGBUS on access, which kills the process. The guarded entry points below (a gather, and the
 * resize and conversion above) run with a thread-local jump buffer armed and declare the source
 * range they read; one process-wide SIGBUS handler jumps back to the entry point when the fault is
 * inside that range in that thread, and the call returns -1 instead (the fault address is kept for
 * datapipe_guard_fault). Nothing the kernels do needs undoing: they allocate nothing (the resize's
 * workspace is the caller's) and take no locks, so jumping out of them loses only the output.
 *
 * Every other SIGBUS goes on to the handler that was installed before, as if this one had never
 * been there: an SA_SIGINFO or plain handler is called (with its mask and flags applied), SIG_DFL
 * and SIG_IGN restore the default action and re-raise, so the process dies of SIGBUS as it would
 * have. Python's faulthandler (and pytest's) install SIGBUS handlers too, before or after this one;
 * datapipe_guard_arm checks (one sigaction call) that this handler is still the installed one and
 * reinstalls it over a newcomer, which becomes the first handler it chains to. The gather arms on
 * each call; the resize and conversion, called once per sample, leave it to their caller (the
 * cache arms once per batch of mapped views): a sigaction call costs ~2 us here, 1-2% of a sample. A handler that
 * hands the signal back to its own predecessor (faulthandler restores the handler it replaced,
 * this one, and re-raises) re-enters this handler, which then goes on to the next older one; so does
 * a handler that returns from a fault without replacing this one (faulthandler after disable():
 * returning would only fault again at once, forever).
 */
typedef struct {
    sigjmp_buf env;
    uintptr_t lo, hi; /* the source range the call reads */
} guard_t;

/* initial-exec: static TLS, read from the handler without a call that could allocate */
#define GUARD_TLS __thread __attribute__((tls_model("initial-exec")))
static GUARD_TLS guard_t *volatile t_guard;
static GUARD_TLS volatile int t_chain;      /* handlers of the chain this thread is inside (nested delivery) */
static GUARD_TLS volatile uintptr_t t_fault; /* the address of the last fault caught in this thread */

#define GUARD_MAX_PREV 8
static struct sigaction g_prev[GUARD_MAX_PREV]; /* the handlers replaced, oldest first */
static volatile sig_atomic_t g_nprev;
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static long g_faults;             /* faults caught, for tests and diagnostics */
static volatile int g_installed;  /* the handler was installed once */

static void guard_handler(int sig, siginfo_t *si, void *ctx);

static int guard_is_ours(const struct sigaction *sa)
{
    return (sa->sa_flags & SA_SIGINFO) && sa->sa_sigaction == guard_handler;
}

static int guard_is_default(const struct sigaction *sa) { return sa->sa_handler == SIG_DFL; }

/* The default action of sig, now: restore it and re-raise (the process ends unless sig is ignored by default). */
static void guard_default_action(int sig)
{
    struct sigaction dfl;
    sigset_t set;
    memset(&dfl, 0, sizeof dfl);
    dfl.sa_handler = SIG_DFL;
    sigemptyset(&dfl.sa_mask);
    sigaction(sig, &dfl, NULL);
    sigemptyset(&set);
    sigaddset(&set, sig);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    raise(sig);
}

/* Deliver sig to the replaced handler p as the kernel would have: its mask (and sig unless
 * SA_NODEFER) blocked while it runs, its disposition reset first if it asked for SA_RESETHAND. */
static void guard_call(const struct sigaction *p, int sig, siginfo_t *si, void *ctx, int level)
{
    if (p->sa_handler == SIG_DFL || (p->sa_handler == SIG_IGN && si->si_code > 0)) {
        guard_default_action(sig); /* a fault cannot be ignored: the kernel would kill the process */
        return;
    }
    if (p->sa_handler == SIG_IGN)
        return; /* sent by kill() or raise(): ignored, as it would have been */
    sigset_t mask = p->sa_mask, old;
    if (!(p->sa_flags & SA_NODEFER))
        sigaddset(&mask, sig);
    if (p->sa_flags & SA_RESETHAND) {
        struct sigaction dfl;
        memset(&dfl, 0, sizeof dfl);
        dfl.sa_handler = SIG_DFL;
        sigaction(sig, &dfl, NULL);
    }
    pthread_sigmask(SIG_BLOCK, &mask, &old);
    t_chain = level + 1;
    if (p->sa_flags & SA_SIGINFO)
        p->sa_sigaction(sig, si, ctx);
    else
        p->sa_handler(sig);
    pthread_sigmask(SIG_SETMASK, &old, NULL); /* a signal it deferred is delivered here, still nested */
}

static void guard_handler(int sig, siginfo_t *si, void *ctx)
{
    guard_t *g = t_guard;
    const int level = t_chain;
    if (g != NULL && level == 0 && si != NULL && si->si_code > 0 && (uintptr_t)si->si_addr >= g->lo &&
        (uintptr_t)si->si_addr < g->hi) {
        t_guard = NULL;
        t_fault = (uintptr_t)si->si_addr;
        __atomic_add_fetch(&g_faults, 1, __ATOMIC_RELAXED);
        siglongjmp(g->env, 1);
    }
    for (int k = level;; k++) {
        const int n = g_nprev;
        if (k >= n) {
            guard_default_action(sig);
            return;
        }
        const struct sigaction p = g_prev[n - 1 - k];
        guard_call(&p, sig, si, ctx, k);
        t_chain = level;
        struct sigaction cur;
        if (si == NULL || si->si_code <= 0 || sigaction(sig, NULL, &cur) != 0 || !guard_is_ours(&cur))
            return; /* handled, or the handler now installed takes the fault when it recurs */
        /* it returned from a fault and left this handler installed: the next older one decides */
    }
}

/* Install the handler, or reinstall it over a newcomer (which it then chains to first). 0 when installed. */
static int guard_arm(void)
{
    struct sigaction cur, ours;
    if (sigaction(SIGBUS, NULL, &cur) != 0)
        return -1;
    if (guard_is_ours(&cur))
        return 0;
    pthread_mutex_lock(&g_lock);
    int rc = sigaction(SIGBUS, NULL, &cur);
    if (rc == 0 && !guard_is_ours(&cur)) {
        int n = g_nprev;
        if (guard_is_default(&cur)) {
            n = 0; /* the default action: whatever was installed before no longer runs */
        } else {
            int j = 0; /* a handler already in the chain moves to its top (a re-enabled faulthandler) */
            for (int i = 0; i < n; i++)
                if (!(g_prev[i].sa_handler == cur.sa_handler && (g_prev[i].sa_flags & SA_SIGINFO) == (cur.sa_flags & SA_SIGINFO)))
                    g_prev[j++] = g_prev[i];
            n = j;
            if (n == GUARD_MAX_PREV) { /* the oldest is forgotten: the default action takes its place */
                memmove(g_prev, g_prev + 1, (GUARD_MAX_PREV - 1) * sizeof g_prev[0]);
                n--;
            }
            g_prev[n++] = cur;
        }
        g_nprev = n;
        memset(&ours, 0, sizeof ours);
        ours.sa_sigaction = guard_handler;
        ours.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&ours.sa_mask);
        rc = sigaction(SIGBUS, &ours, NULL);
    }
    if (rc == 0)
        g_installed = 1;
    pthread_mutex_unlock(&g_lock);
    return rc == 0 ? 0 : -1;
}

/* For the per-sample kernels: arm only the first time (later, the caller arms once per batch). */
static inline int guard_ready(void) { return g_installed ? 0 : guard_arm(); }

/* 0 when the guard is installed (installing it now if needed), -1 when it cannot be. */
int datapipe_guard_arm(void) { return guard_arm(); }

/* The address of the last fault a guarded call of this thread returned -1 for. */
uintptr_t datapipe_guard_fault(void) { return t_fault; }

/* Faults caught in this process so far. */
long datapipe_guard_faults(void) { return __atomic_load_n(&g_faults, __ATOMIC_RELAXED); }

/* Arm g in this thread (its range set, sigsetjmp done). The compiler must not move the guarded reads
 * above this store, nor below the one that clears it. A guarded call never runs inside a signal
 * handler, so a chain level left over (a handler down the chain that jumped out) is reset. */
static inline void guard_on(guard_t *g)
{
    t_chain = 0;
    t_guard = g;
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
}
static inline void guard_off(void)
{
    __atomic_signal_fence(__ATOMIC_SEQ_CST);
    t_guard = NULL;
}

/* Copy n spans of src (a mapping of src_len bytes) under the guard: span i from src + offsets[i], of sizes[i]
 * bytes to dst + dst_offsets[i], or with sizes NULL of nbytes to dst + i * nbytes. Returns 0; -1 when a page of
 * src faulted (truncated file); -2 when the guard cannot be installed; -3 when a span lies outside src or a size
 * or destination is negative (nothing is read then). */
static int gather_guarded(uint8_t *dst, const uint8_t *src, size_t src_len, const int64_t *offsets, const int64_t *sizes,
                          const int64_t *dst_offsets, ptrdiff_t n, size_t nbytes)
{
    for (ptrdiff_t i = 0; i < n; i++) {
        const int64_t size = sizes ? sizes[i] : (int64_t)nbytes;
        if (offsets[i] < 0 || size < 0 || (sizes && dst_offsets[i] < 0) || (uint64_t)offsets[i] > src_len ||
            src_len - (uint64_t)offsets[i] < (uint64_t)size)
            return -3;
    }
    if (guard_arm() != 0)
        return -2;
    guard_t g;
    g.lo = (uintptr_t)src;
    g.hi = (uintptr_t)src + src_len;
    if (sigsetjmp(g.env, 0))
        return -1;
    guard_on(&g);
    for (ptrdiff_t i = 0; i < n; i++) {
        if (sizes)
            memcpy(dst + dst_offsets[i], src + offsets[i], (size_t)sizes[i]);
        else
            memcpy(dst + i * (ptrdiff_t)nbytes, src + offsets[i], nbytes);
    }
    guard_off();
    return 0;
}

/* Copy n samples of nbytes each, sample i from src + offsets[i], to dst + i * nbytes. src: a mapping
 * of src_len bytes. Returns as gather_guarded. */
int datapipe_gather(uint8_t *dst, const uint8_t *src, size_t src_len, const int64_t *offsets, ptrdiff_t n,
                    size_t nbytes)
{
    return gather_guarded(dst, src, src_len, offsets, NULL, NULL, n, nbytes);
}

/* Copy n spans of src, span i of sizes[i] bytes from src + offsets[i], to dst + dst_offsets[i] (samples of
 * their own sizes, in one call). Returns as gather_guarded. */
int datapipe_gather_spans(uint8_t *dst, const uint8_t *src, size_t src_len, const int64_t *offsets, const int64_t *sizes,
                          const int64_t *dst_offsets, ptrdiff_t n)
{
    return gather_guarded(dst, src, src_len, offsets, sizes, dst_offsets, n, 0);
}

/* The end of what a kernel reads from h rows of w pixels (rows row bytes apart), with room for a
 * vector load's overshoot. */
static uintptr_t guard_end(const uint8_t *src, ptrdiff_t h, ptrdiff_t w, ptrdiff_t row)
{
    return (uintptr_t)src + (uintptr_t)((h > 0 ? h - 1 : 0) * row + 3 * w) + 32;
}

/* datapipe_resize_rgb reading src under the guard: -1 when src faulted, -2 when no guard can be installed. */
ptrdiff_t datapipe_resize_rgb_guarded(const uint8_t *src, ptrdiff_t in_h, ptrdiff_t in_w, ptrdiff_t src_row, uint8_t *dst,
                                      ptrdiff_t out_h, ptrdiff_t out_w, ptrdiff_t dst_row, uint8_t *ws, ptrdiff_t ws_size)
{
    if (guard_ready() != 0)
        return -2;
    guard_t g;
    g.lo = (uintptr_t)src;
    g.hi = guard_end(src, in_h, in_w, src_row);
    if (sigsetjmp(g.env, 0))
        return -1;
    guard_on(&g);
    const ptrdiff_t r = datapipe_resize_rgb(src, in_h, in_w, src_row, dst, out_h, out_w, dst_row, ws, ws_size);
    guard_off();
    return r;
}

/* datapipe_u8_to_f32 reading src under the guard: 0, -1 when src faulted, -2 when no guard can be installed. */
int datapipe_u8_to_f32_guarded(const uint8_t *src, ptrdiff_t h, ptrdiff_t w, ptrdiff_t src_row, int flip, int planar,
                               const float *scale, const float *shift, float *dst, int stream)
{
    if (guard_ready() != 0)
        return -2;
    guard_t g;
    g.lo = (uintptr_t)src;
    g.hi = guard_end(src, h, w, src_row);
    if (sigsetjmp(g.env, 0))
        return -1;
    guard_on(&g);
    datapipe_u8_to_f32(src, h, w, src_row, flip, planar, scale, shift, dst, stream);
    guard_off();
    return 0;
}

/* A private, copy-on-write mapping of len bytes of fd (writes never reach the file), or NULL (errno set). */
void *datapipe_map(int fd, size_t len)
{
    void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    return p == MAP_FAILED ? NULL : p;
}

int datapipe_unmap(void *addr, size_t len) { return munmap(addr, len); }
