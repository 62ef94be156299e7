/* jconfig.h for datapipe's vendored libjpeg-turbo headers (jpeglib.h and jmorecfg.h are libjpeg-turbo
 * 2.1.5's, unmodified). It describes the libjpeg v6.2 ABI with 8-bit samples that every libjpeg.so.62 built
 * from libjpeg-turbo exports, the one datapipe/_jpegcrop.c loads at run time; nothing here is compiled into
 * a library, the headers only declare the structures and entry points. */
#define JPEG_LIB_VERSION  62
#define LIBJPEG_TURBO_VERSION  2.1.5
#define LIBJPEG_TURBO_VERSION_NUMBER  2001005
#define C_ARITH_CODING_SUPPORTED 1
#define D_ARITH_CODING_SUPPORTED 1
#define MEM_SRCDST_SUPPORTED 1
#define WITH_SIMD 1
#define BITS_IN_JSAMPLE  8
