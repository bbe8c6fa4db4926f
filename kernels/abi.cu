// Version and error names of the C ABI declared in sgl_pic_kernels.h.
#include "sgl_pic_kernels.h"

extern "C" int pic_abi_version(void) { return PIC_ABI_VERSION; }

extern "C" const char* pic_error_string(int code) {
  switch (code) {
    case PIC_OK:
      return "no error";
    case PIC_ERR_INVALID_ARGUMENT:
      return "sgl-pic kernel: invalid argument";
    case PIC_ERR_UNSUPPORTED_DTYPE:
      return "sgl-pic kernel: unsupported dtype or RoPE layout";
    case PIC_ERR_MISALIGNED:
      return "sgl-pic kernel: buffer addresses are not aligned to the element pair size";
    default:
      return code > 0 ? cudaGetErrorString(static_cast<cudaError_t>(code))
                      : "sgl-pic kernel: unknown error";
  }
}
