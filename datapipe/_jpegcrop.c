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
 * Loaded through ctypes (no Python API is used), which releases the GIL for each call: reader threads decode
 * in parallel. See decode_crop in datapipe/samples.py.
 */
#include <dlfcn.h>
#include <limits.h>
#include <setjmp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "jpeglib.h"

#define DATAPIPE_JPEGCROP_ABI 1
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
                                  "jpeg_finish_decompress"};
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

static void limit_scans(j_common_ptr cinfo)
{
    j_decompress_ptr d = (j_decompress_ptr)cinfo;
    if (d->input_scan_number > MAX_SCANS) {
        struct failing_error_mgr *e = (struct failing_error_mgr *)cinfo->err;
        snprintf(e->msg, e->msglen, "more than %d progressive scans", MAX_SCANS);
        longjmp(e->jump, 1);
    }
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
    int rc = -1;

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
    memset(&cinfo, 0, sizeof cinfo);
    cinfo.err = api.std_error(&jerr.pub);
    jerr.pub.error_exit = fail_with_message;
    jerr.pub.emit_message = emit_message;
    jerr.msg = err;
    jerr.msglen = errlen;
    if (setjmp(jerr.jump)) {
        if (created)
            api.destroy_decompress(&cinfo);
        return rc;
    }
    api.create_decompress(&cinfo, JPEG_LIB_VERSION, sizeof cinfo);
    created = 1;
    progress.progress_monitor = limit_scans;
    cinfo.progress = &progress;
    api.mem_src(&cinfo, data, (unsigned long)size);
    api.read_header(&cinfo, TRUE);
    if ((int)cinfo.image_height != expect_h || (int)cinfo.image_width != expect_w) {
        snprintf(err, errlen, "its header says %ux%u, the index %dx%d", cinfo.image_height, cinfo.image_width, expect_h,
                 expect_w);
        api.destroy_decompress(&cinfo);
        return -1;
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
        api.destroy_decompress(&cinfo);
        return -2;
    }
    /* One more column on each side where the image goes on: the upsampler treats the cropped region's first
     * and last columns as the image's edges, whereas in a full decode an edge pixel's chroma blends in its
     * neighbour's. Rows need no margin: jpeg_skip_scanlines decodes the context rows the upsampling reads. */
    const int y0 = y, y1 = y + h;
    JDIMENSION x0 = (JDIMENSION)(x > 0 ? x - 1 : 0), cw = (JDIMENSION)((x + w < sw ? x + w + 1 : sw)) - x0;
    if (x0 > 0 || (int)cw < sw)
        api.crop_scanline(&cinfo, &x0, &cw);
    const size_t stride = (size_t)cw * 3, nrows = (size_t)(y1 - y0);
    if (nrows * stride > capacity) {
        snprintf(err, errlen, "the out buffer holds %zu bytes, the region needs %zu", capacity, nrows * stride);
        api.destroy_decompress(&cinfo);
        return -2;
    }
    if (y0 > 0 && api.skip_scanlines(&cinfo, (JDIMENSION)y0) != (JDIMENSION)y0) {
        snprintf(err, errlen, "could not skip to row %d", y0);
        api.destroy_decompress(&cinfo);
        return -1;
    }
    size_t done = 0;
    while (done < nrows) {
        size_t n = nrows - done < ROWS_PER_CALL ? nrows - done : ROWS_PER_CALL;
        for (size_t i = 0; i < n; i++)
            rows[i] = out + (done + i) * stride;
        JDIMENSION got = api.read_scanlines(&cinfo, rows, (JDIMENSION)n);
        if (got == 0) {
            snprintf(err, errlen, "the decoder stopped at row %zu", (size_t)y0 + done);
            api.destroy_decompress(&cinfo);
            return -1;
        }
        done += got;
    }
    /* A crop that reaches the last row reads on to the end marker, as a whole decode does (data left over
     * there is corrupt data); one that stops earlier leaves the rest unread. */
    if (y1 == sh)
        api.finish_decompress(&cinfo);
    else
        api.abort_decompress(&cinfo);
    api.destroy_decompress(&cinfo);
    geom[0] = y0;
    geom[1] = (int32_t)x0;
    geom[2] = (int32_t)nrows;
    geom[3] = (int32_t)cw;
    geom[4] = sh;
    geom[5] = sw;
    return 0;
}
