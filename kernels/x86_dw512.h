/* AVX512-VNNI depthwise: for now the shared 256-bit kernel (x86_common.h). */
#ifndef EA_X86_DW512_H
#define EA_X86_DW512_H
#define x86_dw512 x86_dw
#endif
