/* The peak multiply-accumulate rate of one core's vector units: AVX-512 float32 FMA
 * (vfmadd231ps, 16 MACs an instruction) against AVX512_BF16's dot product (vdpbf16ps, 32 MACs
 * an instruction, float32 accumulation). 24 independent accumulators each, so that the rate is
 * the units' throughput, not one instruction's latency. bench_bf16_units.py compiles and runs it;
 * it prints "<fp32 GMAC/s> <bf16 GMAC/s>", the fastest of 5 alternated rounds of each. */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define CHAINS 24
#define REPEAT(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) \
                  X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#define DECLARE(i) __m512 a##i = _mm512_set1_ps((float)(i));
#define FMA(i) a##i = _mm512_fmadd_ps(a##i, b, c);
#define DOT(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
#define SUM(i) s = _mm512_add_ps(s, a##i);

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* The sum is printed where nobody looks for it only if it is impossible, so that the
 * compiler cannot drop the loop. */
static void keep(__m512 s) {
    if (_mm512_reduce_add_ps(s) == -1.0f) puts("");
}

/* Into `seconds`, the time of n iterations of STEP on each of the 24 accumulators, which are
 * then summed and kept. */
#define TIME_CHAINS(STEP, n, seconds)                        \
    do {                                                     \
        __m512 s = _mm512_setzero_ps();                      \
        REPEAT(DECLARE)                                      \
        double start = now();                                \
        for (long k = 0; k < (n); k++) { REPEAT(STEP) }      \
        seconds = now() - start;                             \
        REPEAT(SUM)                                          \
        keep(s);                                             \
    } while (0)

static double fp32_macs(long n) {
    __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-3f);
    double seconds;
    TIME_CHAINS(FMA, n, seconds);
    return n * (double)CHAINS * 16 / seconds;
}

static double bf16_macs(long n) {
    /* bfloat16 1.0 and 0.001 */
    __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80), y = (__m512bh)_mm512_set1_epi16(0x3a83);
    double seconds;
    TIME_CHAINS(DOT, n, seconds);
    return n * (double)CHAINS * 32 / seconds;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 10000000;
    double fp32 = 0, bf16 = 0;
    for (int round = 0; round < 5; round++) {
        double f = fp32_macs(n), d = bf16_macs(n);
        fp32 = f > fp32 ? f : fp32;
        bf16 = d > bf16 ? d : bf16;
    }
    printf("%.2f %.2f\n", fp32 / 1e9, bf16 / 1e9);
    return 0;
}
