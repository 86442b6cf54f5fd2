/* NEON variant: AArch64 ("neon") and ARMv7 with NEON ("armv7_neon", Raspberry Pi 2/3/4 on a
 * 32-bit OS). vmull_s8 + vpadalq_s16: 16 exact int8 MACs per 4 instructions. */
#if !defined(__ARM_NEON) && !defined(__ARM_NEON__)
#error "neon.c needs an ARM compiler with NEON enabled (-mfpu=neon on armv7)"
#endif
#include <arm_neon.h>
static inline int32x4_t ea_neon_dot(int32x4_t acc, int8x16_t a, int8x16_t b) {
    acc = vpadalq_s16(acc, vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    return vpadalq_s16(acc, vmull_s8(vget_high_s8(a), vget_high_s8(b)));
}
#define EA_ARM_DOT ea_neon_dot
#define EA_ARM_VARIANT ea_variant_neon
#if defined(__aarch64__)
#define EA_ARM_NAME "neon"
#define EA_ARM_FEATURES "asimd"
#else
#define EA_ARM_NAME "armv7_neon"
#define EA_ARM_FEATURES "neon"
#endif
#include "arm_common.h"
