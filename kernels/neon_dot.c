/* AArch64 NEON + dot product (ARMv8.2 SDOT: Cortex-A55/A76, Raspberry Pi 5): vdotq_s32 does
 * 16 exact int8 MACs in one instruction. */
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "neon_dot.c needs an AArch64 compiler with -march=armv8.2-a+dotprod"
#endif
#define EA_ARM_DOT vdotq_s32
#define EA_ARM_VARIANT ea_variant_neon_dot
#define EA_ARM_NAME "neon_dot"
#define EA_ARM_FEATURES "asimd asimddp"
#include "arm_common.h"
