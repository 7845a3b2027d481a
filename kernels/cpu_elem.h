/*
 * The element type of the CPU kernels, chosen by -DDTYPE (0 float32, 1 bfloat16, 2 float16; the
 * codes of cpu_build.DTYPE_CODES), and its conversions to and from float32, in which the
 * kernels compute. bfloat16 rounds to nearest even, as torch does.
 */
#ifndef KVPILOT_CPU_ELEM_H
#define KVPILOT_CPU_ELEM_H

#include <stdint.h>
#include <string.h>

#ifndef DTYPE
#error "build with -DDTYPE=0|1|2"
#endif

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2

#if DTYPE == DTYPE_BF16
typedef uint16_t elem_t;
static inline float to_f32(elem_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
static inline elem_t from_f32(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    bits += 0x7fffu + ((bits >> 16) & 1u); /* round to nearest even */
    return (elem_t)(bits >> 16);
}
#elif DTYPE == DTYPE_F16
typedef _Float16 elem_t;
static inline float to_f32(elem_t h) { return (float)h; }
static inline elem_t from_f32(float f) { return (elem_t)f; }
#else
typedef float elem_t;
static inline float to_f32(elem_t h) { return h; }
static inline elem_t from_f32(float f) { return f; }
#endif

#endif
