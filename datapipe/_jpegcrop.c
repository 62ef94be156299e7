/* datapipe's optional partial JPEG decoder: one crop of a stored JPEG sample, decoded with libjpeg-turbo.
 *
 * A training crop (RandomResizedCrop) covers about half of a sample on average, yet a plain decode produces
 * every pixel and the crop then discards the rest. Here libjpeg-turbo decodes only the crop's region:
 * jpeg_crop_scanline limits the columns (the left edge snapped down to an iMCU boundary), jpeg_skip_scanlines
 * passes over the rows above the crop without colour conversion or upsampling, reading stops after the
 * crop's last row (jpeg_abort_decompress), and scale_num/8 scales the image down in the DCT domain when the
 * crop is much larger than the output. The pixels are those of a full decode with the same settings
 * (JDCT_ISLOW, fancy upsampling, RGB): the region is widened by one column on each side where the image goes
 * on, so that the chroma upsampling at the crop's edges sees the same neighbours as in a full decode.
 *
 * Neither the build nor the run needs a system package: the structures come from libjpeg-turbo's public
 * headers vendored in datapipe/_vendor/libjpeg (the libjpeg v6.2 ABI), and the library is opened at run time
 * (datapipe_jpeg_open: Pillow's bundled libjpeg-turbo, else the system's libjpeg.so.62), its dozen entry
 * points looked up by name. jpeg_CreateDecompress checks the ABI (library version 62, the structure's size).
 *
 * Errors never exit: the error manager jumps back (setjmp/longjmp) and the call returns -1 with libjpeg's
 * message; warnings (corrupt data) are errors too, as in simplejpeg's strict mode. Progressive files are
 * limited to MAX_SCANS scans, so that no sample can make a decode run unbounded. Since reading stops after the
 * crop's last row, damage further on goes unseen by that crop (a later crop lower in the image sees it),
 * except a cut-short file: the data must end with the JPEG end marker.
 *
 * Restart markers make the crop's entropy decoding partial too. Huffman decoding cannot start in the middle
 * of a scan, so jpeg_skip_scanlines still decodes every coefficient above the crop, and every row's full
 * width: for 256-pixel samples that is about two thirds of a whole decode. A baseline JPEG with a restart
 * interval that divides its MCU rows (datapipe's build writes one after every MCU: 16-pixel tiles in 4:2:0)
 * consists of tiles whose coded data is byte aligned and independent (the DC predictions restart at each).
 * splice_tiles copies the tiles that cover the crop, plus one pixel of context on each side (at any DCT
 * scale), into a new stream of a smaller image (the header's size patched, the restart markers renumbered)
 * and the decode runs on that: only the crop's tiles are Huffman decoded. The pixels are again the full decode's: the upsampler
 * reads one chroma sample beyond an output pixel, which the one-pixel margin keeps inside the spliced image.
 *
 * Loaded through ctypes (no Python API is used), which releases the GIL for each call: reader threads decode
 * in parallel. See decode_crop in datapipe/samples.py.
 */
#include <dlfcn.h>
#include <limits.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "jpeglib.h"

#define DATAPIPE_JPEGCROP_ABI 2
#define MAX_SCANS 500
#define ROWS_PER_CALL 16

int datapipe_jpegcrop_abi(void) { return DATAPIPE_JPEGCROP_ABI; }

static struct {
    struct jpeg_error_mgr *(*std_error)(struct jpeg_error_mgr *);
    void (*create_decompress)(j_decompress_ptr, int, size_t);
    void (*destroy_decompress)(j_decompress_ptr);
    void (*mem_src)(j_decompress_ptr, const unsigned char *, unsigned long);
    int (*read_header)(j_decompress_ptr, boolean);
    boolean (*start_decompress)(j_decompress_ptr);
    void (*crop_scanline)(j_decompress_ptr, JDIMENSION *, JDIMENSION *);
    JDIMENSION (*skip_scanlines)(j_decompress_ptr, JDIMENSION);
    JDIMENSION (*read_scanlines)(j_decompress_ptr, JSAMPARRAY, JDIMENSION);
    void (*abort_decompress)(j_decompress_ptr);
    boolean (*finish_decompress)(j_decompress_ptr);
    void (*create_compress)(j_compress_ptr, int, size_t);
    void (*destroy_compress)(j_compress_ptr);
    void (*mem_dest)(j_compress_ptr, unsigned char **, unsigned long *);
    void (*set_defaults)(j_compress_ptr);
    void (*set_quality)(j_compress_ptr, int, boolean);
    void (*start_compress)(j_compress_ptr, boolean);
    JDIMENSION (*write_scanlines)(j_compress_ptr, JSAMPARRAY, JDIMENSION);
    void (*finish_compress)(j_compress_ptr);
} api;
static void *handle;

/* Open the libjpeg at path and look up the entry points. Not thread-safe: called once, under the caller's
 * lock, before any decode. 0 on success, else -1 with a message in err. */
int datapipe_jpeg_open(const char *path, char *err, size_t errlen)
{
    if (handle)
        return 0;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        snprintf(err, errlen, "%s", dlerror());
        return -1;
    }
    static const char *names[] = {"jpeg_std_error", "jpeg_CreateDecompress", "jpeg_destroy_decompress", "jpeg_mem_src",
                                  "jpeg_read_header", "jpeg_start_decompress", "jpeg_crop_scanline",
                                  "jpeg_skip_scanlines", "jpeg_read_scanlines", "jpeg_abort_decompress",
                                  "jpeg_finish_decompress", "jpeg_CreateCompress", "jpeg_destroy_compress",
                                  "jpeg_mem_dest", "jpeg_set_defaults", "jpeg_set_quality", "jpeg_start_compress",
                                  "jpeg_write_scanlines", "jpeg_finish_compress"};
    void *found[sizeof names / sizeof names[0]];
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        found[i] = dlsym(h, names[i]);
        if (!found[i]) {
            snprintf(err, errlen, "%s lacks %s (not libjpeg-turbo)", path, names[i]);
            dlclose(h);
            return -1;
        }
    }
    /* POSIX guarantees that data and function pointers convert through void *. */
    memcpy(&api.std_error, &found[0], sizeof(void *));
    memcpy(&api.create_decompress, &found[1], sizeof(void *));
    memcpy(&api.destroy_decompress, &found[2], sizeof(void *));
    memcpy(&api.mem_src, &found[3], sizeof(void *));
    memcpy(&api.read_header, &found[4], sizeof(void *));
    memcpy(&api.start_decompress, &found[5], sizeof(void *));
    memcpy(&api.crop_scanline, &found[6], sizeof(void *));
    memcpy(&api.skip_scanlines, &found[7], sizeof(void *));
    memcpy(&api.read_scanlines, &found[8], sizeof(void *));
    memcpy(&api.abort_decompress, &found[9], sizeof(void *));
    memcpy(&api.finish_decompress, &found[10], sizeof(void *));
    memcpy(&api.create_compress, &found[11], sizeof(void *));
    memcpy(&api.destroy_compress, &found[12], sizeof(void *));
    memcpy(&api.mem_dest, &found[13], sizeof(void *));
    memcpy(&api.set_defaults, &found[14], sizeof(void *));
    memcpy(&api.set_quality, &found[15], sizeof(void *));
    memcpy(&api.start_compress, &found[16], sizeof(void *));
    memcpy(&api.write_scanlines, &found[17], sizeof(void *));
    memcpy(&api.finish_compress, &found[18], sizeof(void *));
    handle = h;
    return 0;
}

struct failing_error_mgr {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char *msg;
    size_t msglen;
};

static void fail_with_message(j_common_ptr cinfo)
{
    struct failing_error_mgr *e = (struct failing_error_mgr *)cinfo->err;
    char buf[JMSG_LENGTH_MAX];
    e->pub.format_message(cinfo, buf);
    snprintf(e->msg, e->msglen, "%s", buf);
    longjmp(e->jump, 1);
}

/* Warnings (level -1: corrupt data that libjpeg would patch over) fail like errors; trace messages are dropped. */
static void emit_message(j_common_ptr cinfo, int level)
{
    if (level < 0)
        fail_with_message(cinfo);
}

/* libjpeg's standard error manager, made to fail (jump back) with its message in msg on errors and warnings. */
static struct jpeg_error_mgr *failing_errors(struct failing_error_mgr *e, char *msg, size_t msglen)
{
    struct jpeg_error_mgr *pub = api.std_error(&e->pub);
    e->pub.error_exit = fail_with_message;
    e->pub.emit_message = emit_message;
    e->msg = msg;
    e->msglen = msglen;
    return pub;
}

static void limit_scans(j_common_ptr cinfo)
{
    j_decompress_ptr d = (j_decompress_ptr)cinfo;
    if (d->input_scan_number > MAX_SCANS) {
        struct failing_error_mgr *e = (struct failing_error_mgr *)cinfo->err;
        snprintf(e->msg, e->msglen, "more than %d progressive scans", MAX_SCANS);
        longjmp(e->jump, 1);
    }
}

static unsigned be16(const uint8_t *p) { return (unsigned)p[0] << 8 | p[1]; }

/* The tiles of a baseline, interleaved JPEG with restart intervals aligned to its MCU rows that cover rows
 * [y, y + h) and columns [x, x + w) of the image decoded at scale_m/8 with one pixel of context on each side
 * where the image goes on, as a JPEG stream of their own in a malloc'ed *out (the caller frees it) of *out_size
 * bytes, *out_h x *out_w, whose first pixel is (*dy, *dx) of the scaled image (a tile's scaled sides are
 * whole numbers of pixels, and even: the chroma samples the upsampler reads stay inside). Returns 1 when
 * spliced; 0 when the data does not allow it (no restart markers, another layout) or the tiles would be the
 * whole image: the caller then decodes the data as it is, and reports any damage; -1 when out of memory. */
static int splice_tiles(const uint8_t *data, size_t size, int expect_h, int expect_w, int scale_m, int y, int x, int h,
                        int w, uint8_t **out, size_t *out_size, int *dy, int *dx, int *out_h, int *out_w)
{
    size_t pos = 2, sof = 0, sos_end = 0;
    unsigned width = 0, height = 0, interval = 0, hmax = 1, vmax = 1, ncomp = 0;
    while (!sos_end) { /* the markers before the scan */
        if (pos + 4 > size || data[pos] != 0xFF)
            return 0;
        const unsigned marker = data[pos + 1], len = be16(data + pos + 2);
        if (marker == 0xFF) { /* fill byte */
            pos++;
            continue;
        }
        if (len < 2 || pos + 2 + len > size)
            return 0;
        const uint8_t *seg = data + pos + 4;
        if (marker == 0xC0 || marker == 0xC1) { /* baseline or extended sequential, Huffman coded */
            if (len < 8 || seg[0] != 8)
                return 0;
            sof = pos;
            height = be16(seg + 1);
            width = be16(seg + 3);
            ncomp = seg[5];
            if (ncomp != 3 || len != 8 + 3 * ncomp)
                return 0;
            for (unsigned c = 0; c < ncomp; c++) {
                const unsigned hs = seg[6 + 3 * c + 1] >> 4, vs = seg[6 + 3 * c + 1] & 15;
                if (hs < 1 || hs > 2 || vs < 1 || vs > 2)
                    return 0;
                hmax = hs > hmax ? hs : hmax;
                vmax = vs > vmax ? vs : vmax;
            }
        } else if ((marker >= 0xC2 && marker <= 0xCF && marker != 0xC4 && marker != 0xC8 && marker != 0xCC) ||
                   marker == 0xDC) {
            return 0; /* progressive, lossless, arithmetic coding, DNL */
        } else if (marker == 0xDD) {
            if (len != 4)
                return 0;
            interval = be16(seg);
        } else if (marker == 0xDA) { /* one scan of every component, the whole spectrum */
            if (!sof || seg[0] != ncomp || len != 6 + 2 * ncomp)
                return 0;
            const uint8_t *tail = seg + 1 + 2 * ncomp;
            if (tail[0] != 0 || tail[1] != 63 || tail[2] != 0)
                return 0;
            sos_end = pos + 2 + len;
        }
        pos += 2 + len;
    }
    /* a wrong size or a region outside the (scaled) image: the decode reports it */
    const long long sh = ((long long)expect_h * scale_m + 7) / 8, sw = ((long long)expect_w * scale_m + 7) / 8;
    if (!interval || (int)width != expect_w || (int)height != expect_h || y + h > sh || x + w > sw)
        return 0;
    const unsigned mcu_w = 8 * hmax, mcu_h = 8 * vmax;
    const unsigned mcus_x = (width + mcu_w - 1) / mcu_w, mcus_y = (height + mcu_h - 1) / mcu_h;
    if (mcus_x % interval)
        return 0;
    const unsigned tiles_x = mcus_x / interval, tile_w = interval * mcu_w;
    const unsigned tile_hs = vmax * (unsigned)scale_m, tile_ws = interval * hmax * (unsigned)scale_m; /* scaled */
    unsigned r0 = y > 0 ? (unsigned)(y - 1) / tile_hs : 0, t0 = x > 0 ? (unsigned)(x - 1) / tile_ws : 0;
    unsigned r1 = ((unsigned)(y + h) + 1 + tile_hs - 1) / tile_hs, t1 = ((unsigned)(x + w) + 1 + tile_ws - 1) / tile_ws;
    r1 = r1 < mcus_y ? r1 : mcus_y;
    t1 = t1 < tiles_x ? t1 : tiles_x;
    /* At least two tiles each way where the image has them: libjpeg-turbo upsamples a scaled image one tile
     * (a few pixels) wide differently at its edge from a whole decode. */
    if (t1 - t0 < 2 && tiles_x >= 2)
        t1 < tiles_x ? t1++ : t0--;
    if (r1 - r0 < 2 && mcus_y >= 2)
        r1 < mcus_y ? r1++ : r0--;
    if (r0 == 0 && t0 == 0 && r1 == mcus_y && t1 == tiles_x)
        return 0;
    /* Find the restart markers up to the end of the last tile needed: tile k (row-major) ends where the
     * k-th marker (RST k mod 8) begins, and the next starts after it. */
    const size_t last = (size_t)(r1 - 1) * tiles_x + (t1 - 1), ntiles = (size_t)(r1 - r0) * (t1 - t0);
    size_t *starts = malloc(2 * (last + 1) * sizeof(size_t));
    if (!starts)
        return -1;
    size_t *ends = starts + last + 1, k = 0, p = sos_end, total = 0;
    starts[0] = sos_end;
    while (k <= last) {
        const uint8_t *ff = memchr(data + p, 0xFF, size - p);
        if (!ff || (size_t)(ff - data) + 1 >= size) {
            free(starts);
            return 0;
        }
        p = (size_t)(ff - data);
        const unsigned b = data[p + 1];
        if (b == 0x00 || b == 0xFF) { /* a stuffed 0xFF data byte; fill */
            p += 1 + (b == 0x00);
            continue;
        }
        if (b >= 0xD0 && b <= 0xD7) {
            if (b != 0xD0 + k % 8) {
                free(starts);
                return 0;
            }
        } else if (k != (size_t)mcus_y * tiles_x - 1) { /* another marker ends the scan: only after the last tile */
            free(starts);
            return 0;
        }
        ends[k] = p;
        if (k < last)
            starts[k + 1] = p + 2;
        k++;
        p += 2;
    }
    for (unsigned r = r0; r < r1; r++)
        total += ends[(size_t)r * tiles_x + t1 - 1] - starts[(size_t)r * tiles_x + t0] + 2 * ntiles;
    uint8_t *o = malloc(sos_end + total + 2);
    if (!o) {
        free(starts);
        return -1;
    }
    memcpy(o, data, sos_end);
    const unsigned new_h = r1 == mcus_y ? height - r0 * mcu_h : (r1 - r0) * mcu_h;
    const unsigned new_w = t1 == tiles_x ? width - t0 * tile_w : (t1 - t0) * tile_w;
    o[sof + 5] = (uint8_t)(new_h >> 8);
    o[sof + 6] = (uint8_t)new_h;
    o[sof + 7] = (uint8_t)(new_w >> 8);
    o[sof + 8] = (uint8_t)new_w;
    size_t n = sos_end, done = 0;
    for (unsigned r = r0; r < r1; r++) {
        for (unsigned t = t0; t < t1; t++) {
            const size_t i = (size_t)r * tiles_x + t;
            memcpy(o + n, data + starts[i], ends[i] - starts[i]);
            n += ends[i] - starts[i];
            if (++done < ntiles) {
                o[n++] = 0xFF;
                o[n++] = (uint8_t)(0xD0 + (done - 1) % 8);
            }
        }
    }
    o[n++] = 0xFF;
    o[n++] = 0xD9;
    free(starts);
    *out = o;
    *out_size = n;
    *dy = (int)(r0 * tile_hs);
    *dx = (int)(t0 * tile_ws);
    *out_h = (int)new_h;
    *out_w = (int)new_w;
    return 1;
}

/* Decode rows [y, y + h) and columns [x, x + w) of the image scaled by scale_m/8 (1..8) into out, RGB rows of
 * geom[3] * 3 bytes. geom = {first row, first column, rows, columns} of the decoded region within the scaled
 * image, then {scaled height, scaled width}. The region holds the requested one: the same rows; its left edge
 * snapped down to an iMCU boundary, and one more column on each side where the image goes on. The header must
 * say expect_h x expect_w. Returns 0; -1 with a message in err for data that does not decode; -2 for a region
 * outside the image or an out buffer of capacity bytes too small for it. */
int datapipe_jpeg_decode_crop(const uint8_t *data, size_t size, int expect_h, int expect_w, int scale_m, int y, int x,
                              int h, int w, uint8_t *out, size_t capacity, int32_t *geom, char *err, size_t errlen)
{
    struct jpeg_decompress_struct cinfo;
    struct failing_error_mgr jerr;
    struct jpeg_progress_mgr progress;
    JSAMPROW rows[ROWS_PER_CALL];
    volatile int created = 0;
    int rc = -1, dy = 0, dx = 0, eh = expect_h, ew = expect_w;
    uint8_t *volatile spliced = NULL;

    if (!handle) {
        snprintf(err, errlen, "no libjpeg opened");
        return -2;
    }
    if (scale_m < 1 || scale_m > 8 || y < 0 || x < 0 || h < 1 || w < 1 || size == 0 || size > (size_t)ULONG_MAX) {
        snprintf(err, errlen, "bad arguments");
        return -2;
    }
    /* Reading stops after the crop's last row, so a file cut short further on would decode without an error:
     * check its end first (every stored sample is one JPEG stream, from SOI to EOI). */
    if (size < 4 || data[0] != 0xFF || data[1] != 0xD8 || data[size - 2] != 0xFF || data[size - 1] != 0xD9) {
        snprintf(err, errlen, "%s", size >= 2 && data[0] == 0xFF && data[1] == 0xD8
                 ? "the data ends before the JPEG's end marker (truncated)" : "the data does not start as a JPEG");
        return -1;
    }
    {
        uint8_t *tiles;
        size_t tiles_size;
        const int found = splice_tiles(data, size, expect_h, expect_w, scale_m, y, x, h, w, &tiles, &tiles_size, &dy,
                                       &dx, &eh, &ew);
        if (found < 0) {
            snprintf(err, errlen, "out of memory");
            return -2;
        }
        if (found) {
            spliced = tiles;
            data = tiles;
            size = tiles_size;
            y -= dy;
            x -= dx;
        }
    }
    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = failing_errors(&jerr, err, errlen);
    if (setjmp(jerr.jump)) {
        if (created)
            api.destroy_decompress(&cinfo);
        free(spliced);
        return -1;
    }
    api.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof cinfo);
    created = 1;
    progress.progress_monitor = limit_scans;
    cinfo.progress = &progress;
    api.mem_src(&cinfo, data, (unsigned long)size);
    api.read_header(&cinfo, TRUE);
    if ((int)cinfo.image_height != eh || (int)cinfo.image_width != ew) {
        snprintf(err, errlen, "its header says %ux%u, the index %dx%d", cinfo.image_height, cinfo.image_width, expect_h,
                 expect_w);
        goto finish; /* rc -1 */
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.dct_method = JDCT_ISLOW;
    cinfo.do_fancy_upsampling = TRUE;
    cinfo.scale_num = (unsigned int)scale_m;
    cinfo.scale_denom = 8;
    api.start_decompress(&cinfo);

    const int sh = (int)cinfo.output_height, sw = (int)cinfo.output_width;
    if ((long long)y + h > sh || (long long)x + w > sw || cinfo.output_components != 3) {
        snprintf(err, errlen, "the region %d+%d x %d+%d lies outside the %dx%d image", y, h, x, w, sh, sw);
        rc = -2;
        goto finish;
    }
    const int y0 = y, y1 = y + h;
    JDIMENSION x0 = 0, cw = (JDIMENSION)sw;
    if (!spliced) { /* the spliced tiles are decoded whole (jpeg_crop_scanline of a region one chroma sample wide
                     * differs from a full decode in some rows) */
        /* One more column on each side where the image goes on: the upsampler treats the cropped region's first
         * and last columns as the image's edges, whereas in a full decode an edge pixel's chroma blends in its
         * neighbour's. Rows need no margin: jpeg_skip_scanlines decodes the context rows the upsampling reads. */
        x0 = (JDIMENSION)(x > 0 ? x - 1 : 0);
        cw = (JDIMENSION)((x + w < sw ? x + w + 1 : sw)) - x0;
        if (cw < 4) /* a region of one 4:2:0 chroma column upsamples differently from a full decode: take two */
            cw = (JDIMENSION)sw - x0 < 4 ? (JDIMENSION)sw - x0 : 4;
        if (x0 > 0 || (int)cw < sw)
            api.crop_scanline(&cinfo, &x0, &cw);
    }
    const size_t stride = (size_t)cw * 3, nrows = (size_t)(y1 - y0);
    if (nrows * stride > capacity) {
        snprintf(err, errlen, "the out buffer holds %zu bytes, the region needs %zu", capacity, nrows * stride);
        rc = -2;
        goto finish;
    }
    if (y0 > 0 && api.skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) {
        snprintf(err, errlen, "could not skip to row %d", y0);
        goto finish; /* rc -1 */
    }
    size_t done = 0;
    while (done < nrows) {
        size_t n = nrows - done < ROWS_PER_CALL ? nrows - done : ROWS_PER_CALL;
        for (size_t i = 0; i < n; i++)
            rows[i] = out + (done + i) * stride;
        JDIMENSION got = api.read_scanlines(&cinfo, rows, (JDIMENSION)n);
        if (got == 0) {
            snprintf(err, errlen, "the decoder stopped at row %zu", (size_t)y0 + dy + done);
            goto finish; /* rc -1 */
        }
        done += got;
    }
    /* A crop that reaches the last row reads on to the end marker, as a whole decode does (data left over
     * there is corrupt data); one that stops earlier leaves the rest unread. */
    if (y1 == sh)
        api.finish_decompress(&cinfo);
    else
        api.abort_decompress(&cinfo);
    geom[0] = y0 + dy;
    geom[1] = (int32_t)x0 + dx;
    geom[2] = (int32_t)nrows;
    geom[3] = (int32_t)cw;
    geom[4] = (int32_t)(((long long)expect_h * scale_m + 7) / 8); /* libjpeg's scaled size, of the whole image */
    geom[5] = (int32_t)(((long long)expect_w * scale_m + 7) / 8);
    rc = 0;
finish:
    api.destroy_decompress(&cinfo);
    free(spliced);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * The training crops of a batch of stored samples in one call: decode, resize, mirror, normalise.
 *
 * The resize and the conversion are datapipe/_native.c's kernels, passed in as addresses (their
 * library is loaded once by datapipe.native): one call per batch instead of three per sample keeps
 * a reader thread out of the interpreter (and off the GIL) for the whole batch.
 * ------------------------------------------------------------------------------------------------ */
typedef ptrdiff_t (*resize_fn)(const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, uint8_t *, ptrdiff_t, ptrdiff_t,
                               ptrdiff_t, uint8_t *, ptrdiff_t);
typedef void (*convert_fn)(const uint8_t *, ptrdiff_t, ptrdiff_t, ptrdiff_t, int, int, const float *, const float *,
                           float *, int);

/* Sample i: datas[i], sizes[i] bytes; shapes[2i], shapes[2i + 1] its height and width; boxes[4i .. 4i + 3] its crop
 * (top, left, height, width) on the image decoded at eighths[i]/8; flips[i] mirrors it. Its crop is resized to
 * size x size and converted, (x / 255 - mean) / std as x * scale + shift, into out + i * out_step floats (planar:
 * [3, size, size], else [size, size, 3]). Returns 0; else *failed = i and -1 (the data does not decode, err says
 * why), -2 (bad arguments, err says which) or -3 (out of memory). */
int datapipe_jpeg_train_batch(int n, const uint64_t *datas, const uint64_t *sizes, const int32_t *shapes,
                              const int32_t *boxes, const int32_t *eighths, const uint8_t *flips, int size, void *resize,
                              void *convert, const float *scale, const float *shift, float *out, ptrdiff_t out_step,
                              int planar, int32_t *failed, char *err, size_t errlen)
{
    resize_fn resize_rgb;
    convert_fn to_float;
    memcpy(&resize_rgb, &resize, sizeof resize_rgb);
    memcpy(&to_float, &convert, sizeof to_float);
    size_t region = 0;
    for (int i = 0; i < n; i++) {
        const size_t px = (size_t)shapes[2 * i] * (size_t)shapes[2 * i + 1] * 3;
        region = px > region ? px : region;
    }
    const size_t tmp_size = (size_t)size * (size_t)size * 3;
    ptrdiff_t ws_size = 1 << 20;
    uint8_t *scratch = malloc(region + tmp_size + 64), *ws = malloc((size_t)ws_size);
    int rc = 0;
    if (!scratch || !ws) {
        snprintf(err, errlen, "out of memory");
        *failed = 0;
        rc = -3;
    }
    uint8_t *tmp = scratch ? scratch + region + 64 : NULL;
    int32_t geom[6];
    for (int i = 0; i < n && rc == 0; i++) {
        const int32_t *b = boxes + 4 * i;
        rc = datapipe_jpeg_decode_crop((const uint8_t *)(uintptr_t)datas[i], (size_t)sizes[i], shapes[2 * i],
                                       shapes[2 * i + 1], eighths[i], b[0], b[1], b[2], b[3], scratch, region, geom, err,
                                       errlen);
        if (rc != 0) {
            *failed = i;
            break;
        }
        const ptrdiff_t row = (ptrdiff_t)geom[3] * 3;
        const uint8_t *src = scratch + (ptrdiff_t)(b[0] - geom[0]) * row + (ptrdiff_t)(b[1] - geom[1]) * 3;
        ptrdiff_t need = resize_rgb(src, b[2], b[3], row, tmp, size, size, 3 * (ptrdiff_t)size, ws, ws_size);
        if (need) {
            free(ws);
            ws_size = need;
            ws = malloc((size_t)ws_size);
            if (!ws) {
                snprintf(err, errlen, "out of memory");
                *failed = i;
                rc = -3;
                break;
            }
            resize_rgb(src, b[2], b[3], row, tmp, size, size, 3 * (ptrdiff_t)size, ws, ws_size);
        }
        to_float(tmp, size, size, 3 * (ptrdiff_t)size, flips[i], planar, scale, shift, out + (ptrdiff_t)i * out_step, 0);
    }
    free(scratch);
    free(ws);
    return rc;
}

/* ------------------------------------------------------------------------------------------------
 * Encoding a sample: what Pillow's JPEG encoder writes for the build's options (baseline, 4:2:0, quality,
 * a restart marker every `restart` MCUs, JDCT_ISLOW), byte for byte, without its per-image Python work.
 * ------------------------------------------------------------------------------------------------ */

/* Encode h rows of w RGB pixels (row r at rgb + r * row bytes). On success *out is a malloc'ed buffer of
 * *out_size bytes (free it with datapipe_jpeg_free) and 0 is returned; else -1 with a message in err. */
int datapipe_jpeg_encode(const uint8_t *rgb, int h, int w, ptrdiff_t row, int quality, int restart, uint8_t **out,
                         unsigned long *out_size, char *err, size_t errlen)
{
    struct jpeg_compress_struct cinfo;
    struct failing_error_mgr jerr;
    volatile int created = 0;
    unsigned char *volatile buffer = NULL;
    unsigned long size = 0;

    if (!handle) {
        snprintf(err, errlen, "no libjpeg opened");
        return -1;
    }
    if (h < 1 || w < 1 || h > 65500 || w > 65500 || quality < 1 || quality > 100 || restart < 0 || restart > 65535) {
        snprintf(err, errlen, "bad arguments");
        return -1;
    }
    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = failing_errors(&jerr, err, errlen);
    if (setjmp(jerr.jump)) {
        if (created)
            api.destroy_compress(&cinfo);
        free(buffer);
        return -1;
    }
    api.create_compress(&cinfo, JPEG_LIB_VERSION, sizeof cinfo);
    created = 1;
    api.mem_dest(&cinfo, (unsigned char **)&buffer, &size);
    cinfo.image_width = (JDIMENSION)w;
    cinfo.image_height = (JDIMENSION)h;
    cinfo.input_components = 3;
    cinfo.in_color_space = JCS_RGB;
    api.set_defaults(&cinfo); /* YCbCr 4:2:0 (luma 2x2), JDCT_ISLOW, JFIF */
    api.set_quality(&cinfo, quality, TRUE);
    cinfo.restart_interval = (unsigned int)restart;
    api.start_compress(&cinfo, TRUE);
    while (cinfo.next_scanline < cinfo.image_height) {
        JSAMPROW r = (JSAMPROW)(rgb + (ptrdiff_t)cinfo.next_scanline * row);
        api.write_scanlines(&cinfo, &r, 1);
    }
    api.finish_compress(&cinfo);
    api.destroy_compress(&cinfo);
    *out = buffer;
    *out_size = size;
    return 0;
}

void datapipe_jpeg_free(void *p) { free(p); }
