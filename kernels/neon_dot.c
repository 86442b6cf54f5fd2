/* AArch64 NEON + dot product (ARMv8.2 SDOT: Cortex-A55/A76, Raspberry Pi 5): vdotq_s32 does
 * 16 exact int8 MACs in one instruction; on CPUs with i8mm, SMMLA (32 MACs each) for GEMMs and
 * convolutions. */
#if !defined(__aarch64__) || !defined(__ARM_FEATURE_DOTPROD)
#error "neon_dot.c needs an AArch64 compiler with -march=armv8.2-a+dotprod"
#endif
#define EA_ARM_DOT vdotq_s32
#define EA_ARM_VARIANT ea_variant_neon_dot
#define EA_ARM_NAME "neon_dot"
#define EA_ARM_FEATURES "asimd asimddp"
#define EA_ARM_MMLA 1 /* and SMMLA kernels, used where HWCAP2 has i8mm (arm_common.h) */
#include "arm_common.h"
