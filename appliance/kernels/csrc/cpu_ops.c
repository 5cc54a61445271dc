/*
 * Native CPU kernels for the Llama-family forward (AVX2 + FMA, OpenMP), dense or
 * mixture of experts (moe_forward: the routing is a callback, the experts grouped).
 *
 * One call runs a whole forward step over the flattened token batch:
 * embedding, every decoder layer (RMSNorm, packed QKV GEMM, q/k norm, rope,
 * paged KV write, paged attention read in place from the block pool,
 * o_proj with the residual add fused, RMSNorm, packed gate|up GEMM, SiLU*up,
 * down with the residual add fused), the final norm on the sampled rows and
 * the LM head. Weights are fp32, bf16, int8 with one fp32 scale per
 * output channel, 4-bit with an fp16 or fp32 scale and min per group of k
 * (see "int4 panels"), or int8 with an fp32 scale and min per group (see
 * "grouped int8"), packed in panels of 16 output channels
 * (kernels/cpu_native.py packs them), or int8 per output channel with the
 * rows quantized to int8 per call (see "W8A8 int8"); the embedding table is
 * fp32 or bf16. Activations and accumulation are fp32 whatever the weights
 * (except W8A8's int32 sums, and where batched bf16 GEMMs run on
 * AVX512-BF16 or AMX, see below); the KV cache is fp32,
 * bf16 or fp8 (e4m3 or e5m2, holding k / k_scale and v / v_scale with a
 * scale per layer, 1 unless the checkpoint gives one). Beside the step: an
 * MXFP4 GEMM for gpt-oss's experts (see "MXFP4").
 *
 * Built at first use by kernels/cpu_native.py (gcc -O3 -mavx2 -mfma -mf16c -ffp-contract=off
 * -fopenmp; the AVX-512 functions (F/BW, BF16, VNNI) and the AMX ones by target attribute, chosen
 * at run time); OpenMP resolves to the libgomp torch has already loaded, so the
 * kernels share torch's thread count.
 */
#include <cpuid.h>
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define KV_F32 0
#define KV_BF16 1
#define KV_FP8_E4M3 2 /* e4m3fn: no infinities, largest finite 448 */
#define KV_FP8_E5M2 3 /* the top byte of an fp16 */

#define WTYPE_F32 0
#define WTYPE_I8 1
#define WTYPE_BF16 2
#define WTYPE_Q4 3
#define WTYPE_Q8G 4 /* int8 [ceil(n / 16), k, 16] with a group scale and min (fp32 qparams, as int4's) */
#define WTYPE_I8A8 5 /* int8 [ceil(n / 16), ceil(k / 4), 16, 4], rows quantized per call (see "W8A8 int8") */
#define WTYPE_I8Q 6  /* int8 per channel as WTYPE_I8, stored as k quads + 128 for the int8 rows (see appl_int8_quads) */
#define WTYPE_Q8GQ 7 /* grouped int8 as WTYPE_Q8G (the same qparams), stored as k quads + 128 (see appl_int8_quads) */
#define WTYPE_Q4Q 8  /* int4 as WTYPE_Q4 (the same qparams), stored as pairs of k quads (see appl_int8_quads) */
#define Q4_ROWS_MAX 6 /* rows of one pass of the int4 row kernels */
/* int4 GEMMs up to this many rows read the 4-bit panels directly, in passes (AVX-512F, AVX2); more widen them */
#define Q4_DIRECT_MAX 15
#define Q4_DIRECT_MAX_AVX2 12

typedef struct {
    const void *w;      /* [ceil(n / 16), k, 16] panels, fp32, int8 or bf16 (uint16); int4: [ceil(n / 16), k / 2, 16] bytes */
    /* grouped weights (int4, grouped int8) carry qparams and group; int8 per channel carries scale */
    const float *scale; /* [n] per output channel (int8), else NULL */
    const float *bias;  /* [n] or NULL */
    const void *qparams; /* int4: [ceil(n / 16), k / group, 2, 16] fp16 or fp32, each group's scales then mins;
                          * W8A8: int32 [ceil(n / 16) * 16], each channel's sum of weights */
    const int32_t *perm; /* [k] or NULL: stored input j is x[perm[j]] (a GPTQ act-order checkpoint) */
    int32_t n, k, wtype, group; /* group: int4 weights per scale along k (even, divides k), else 0 */
    int32_t qparams_f32;        /* int4: qparams are fp32 (else fp16) */
    int32_t float_rows;         /* 1: the rows stay floating point where int8 rows would run (the LM head, q/k/v) */
} Linear;

/* Whether L's panels carry a scale and min per group of k (int4, grouped int8). */
static inline int grouped_panels(const Linear *L) { return L->wtype == WTYPE_Q4 || L->wtype == WTYPE_Q8G; }

/* Whether L's panels are stored as the int8 rows' k quads: int8 [k / 4][16][4] bytes + 128; int4
 * [k / 8][16][4] bytes, byte i of channel c holding k = 8j + i in its low nibble and 8j + 4 + i in its high. */
static inline int quad_panels(const Linear *L) {
    return L->wtype == WTYPE_I8Q || L->wtype == WTYPE_Q8GQ || L->wtype == WTYPE_Q4Q;
}

/* A sparse (mixture-of-experts) layer's MLP: the router, then experts
 * first .. first + n_local - 1 of n_experts, each a SiLU-gated MLP. */
typedef struct {
    int32_t n_experts, top_k, inter, first, n_local, _pad;
    Linear router;      /* [n_experts, hidden] fp32 */
    const Linear *w13;  /* [n_local]: gate | up rows (n = 2 inter) */
    const Linear *w2;   /* [n_local]: down (n = hidden) */
} Moe;

typedef struct {
    const float *ln1, *ln2, *q_norm, *k_norm; /* q_norm/k_norm NULL unless qk_norm */
    Linear qkv, o, gate_up, down;             /* gate_up/down unused in a sparse layer */
    void *k_cache, *v_cache; /* [num_slots, kv_heads, head_dim], fp32, bf16 or fp8 */
    float k_scale, v_scale;  /* an fp8 cache holds k / k_scale and v / v_scale; ignored for wider caches */
    const Moe *moe;          /* a sparse layer's, else NULL */
    int32_t group, _pad3;    /* its KV-cache group: the Step's group_tables / group_slots / group_windows entry */
} Layer;

/* Routing: from router logits [T, n_experts] write each token's top_k
 * expert ids and weights ([T, top_k] each). The caller supplies it
 * (kernels/cpu_native.py runs torch.topk there, so ties fall as in the
 * reference models). */
typedef void (*RouteFn)(const float *logits, int64_t T, int32_t n_experts, int32_t top_k, int32_t *ids,
                        float *weights);

/* Tensor parallelism: sum data[0 .. n) over the ranks, in place, the same bits on every rank; nonzero on
 * failure (a rank that did not arrive). kernels/shm_comm.c's appl_shm_reduce_f32, or a callback into torch. */
typedef int (*ReduceFn)(void *ctx, float *data, int64_t n);

typedef struct {
    int32_t n_layers, hidden, inter, n_heads, n_kv_heads, head_dim, vocab, max_pos;
    float eps, attn_scale;
    int32_t kv_type;         /* KV cache elements: KV_F32, KV_BF16 (uint16), KV_FP8_E4M3 or KV_FP8_E5M2 (uint8) */
    int32_t embed_bf16;      /* embedding rows: fp32, or bf16 (uint16) when set */
    const void *embed;       /* [vocab, hidden] */
    const float *final_norm; /* [hidden] */
    const float *rope_cos, *rope_sin; /* [max_pos, rope_dim] */
    Linear lm_head;
    Layer *layers;
    RouteFn route;                             /* sparse layers' routing, NULL for a dense model */
    int32_t moe_experts, moe_top_k, moe_inter; /* the sparse layers' sizes (scratch), 0 for a dense model */
    int32_t rope_dim; /* the channels of each head rope turns, the first ones (a partial rotary factor: fewer) */
    /* A tensor-parallel rank's part (reduce NULL: one rank): its heads, MLP rows (each expert's) and vocabulary
     * rows vocab_start .. vocab_start + vocab - 1 of the embedding and LM head; the embedding's rows (zero for
     * ids held elsewhere), o_proj's and down's partial sums are reduced; the logits are this rank's columns. */
    ReduceFn reduce;
    void *reduce_ctx;
    int64_t vocab_start;
} Model;

typedef struct {
    int32_t n_tokens, n_reqs, n_logits, block_size, bt_stride;
    int32_t failed; /* out: a reduce failed, the step stopped there (its outputs are not valid) */
    const int64_t *input_ids, *positions, *slot_mapping, *logits_indices;
    const int32_t *qsl, *seq_lens, *block_table; /* block_table [n_reqs, bt_stride] */
    float *scratch; /* see scratch_floats() */
    float *logits;  /* [n_logits, vocab] */
    /* A pipeline stage's: hidden_in, its rows from the stage before ([n_tokens, hidden]; NULL: embed the ids, as
     * the first stage does); hidden_out, where its rows go after its layers ([n_tokens, hidden]; NULL: the final
     * norm and LM head make the logits, as the last stage does). */
    const float *hidden_in;
    float *hidden_out;
    /* Per KV-cache group (NULL: one group of full attention, block_table and slot_mapping above): each group's
     * block table ([n_reqs, bt_stride]) and slots, and its sliding window (0: full attention). */
    const int32_t *const *group_tables;
    const int64_t *const *group_slots;
    const int32_t *group_windows;
} Step;

/* ---------------------------------------------------------------- helpers */

static inline float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

static inline float hsum8(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* exp for float lanes (Cephes polynomial, about 1 ulp on the clamped range): exp8 on AVX2, exp16 (the same
 * steps, so the same bits per lane) on AVX-512F. P: the intrinsics' prefix; FLOOR, CAST: the width's floor
 * and integer-to-float bit cast. */
#define DEFINE_EXP(NAME, ATTR, V, VI, P, FLOOR, CAST)                                                      \
    ATTR static inline V NAME(V x) {                                                                       \
        x = P##_min_ps(x, P##_set1_ps(88.3762626647949f));                                                 \
        x = P##_max_ps(x, P##_set1_ps(-87.3365447504f));                                                   \
        V fx = FLOOR(P##_fmadd_ps(x, P##_set1_ps(1.44269504088896341f), P##_set1_ps(0.5f)));               \
        x = P##_fnmadd_ps(fx, P##_set1_ps(0.693359375f), x);                                               \
        x = P##_fnmadd_ps(fx, P##_set1_ps(-2.12194440e-4f), x);                                            \
        V z = P##_mul_ps(x, x);                                                                            \
        V y = P##_set1_ps(1.9875691500e-4f);                                                               \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.3981999507e-3f));                                             \
        y = P##_fmadd_ps(y, x, P##_set1_ps(8.3334519073e-3f));                                             \
        y = P##_fmadd_ps(y, x, P##_set1_ps(4.1665795894e-2f));                                             \
        y = P##_fmadd_ps(y, x, P##_set1_ps(1.6666665459e-1f));                                             \
        y = P##_fmadd_ps(y, x, P##_set1_ps(5.0000001201e-1f));                                             \
        y = P##_fmadd_ps(y, z, P##_add_ps(x, P##_set1_ps(1.0f)));                                          \
        VI e = P##_slli_epi32(P##_add_epi32(P##_cvttps_epi32(fx), P##_set1_epi32(127)), 23);               \
        return P##_mul_ps(y, CAST(e));                                                                     \
    }
#define FLOOR512(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)

DEFINE_EXP(exp8, , __m256, __m256i, _mm256, _mm256_floor_ps, _mm256_castsi256_ps)
DEFINE_EXP(exp16, __attribute__((target("avx512f,avx512bw"))), __m512, __m512i, _mm512, FLOOR512, _mm512_castsi512_ps)

static inline __m256 load_w_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* bf16 -> fp32 is a 16-bit shift */
static inline __m256 load_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* ------------------------------------------------------- packed GEMM */
/*
 * Weights packed in panels of PW output channels: panel[k][PW] (the
 * channels of one k contiguous), zero rows past n. An outer-product tile
 * broadcasts one activation per row and multiplies it into PW channels, so
 * there are no horizontal sums and every weight load feeds up to six rows.
 */
#define PW 16

static inline __attribute__((always_inline)) void pload_f32(const float *p, __m256 *a, __m256 *b) {
    *a = _mm256_loadu_ps(p);
    *b = _mm256_loadu_ps(p + 8);
}
static inline __attribute__((always_inline)) void pload_i8(const int8_t *p, __m256 *a, __m256 *b) {
    *a = load_w_i8(p);
    *b = load_w_i8(p + 8);
}
static inline __attribute__((always_inline)) void pload_bf16(const uint16_t *p, __m256 *a, __m256 *b) {
    *a = load_bf16(p);
    *b = load_bf16(p + 8);
}

/* mr rows (<= 6) by one panel; mr rows (<= 2) by two panels. */
#define DEFINE_PTILE(SUFFIX, WT, LOAD2)                                                                   \
    static inline __attribute__((always_inline)) void ptile1_##SUFFIX(                                   \
        const float *x, int64_t ldx, const WT *p, int64_t k, const int mr, const int pf, float c[6][2 * PW]) { \
        __m256 a0[6], a1[6];                                                                             \
        for (int i = 0; i < 6; i++) a0[i] = a1[i] = _mm256_setzero_ps();                                 \
        /* pf: the next panel follows this one in memory (not a widened copy): stream it in */            \
        const char *next = pf ? (const char *)p + k * PW * (int64_t)sizeof(WT) : (const char *)p;        \
        for (int64_t kk = 0; kk < k; kk++) {                                                             \
            __m256 w0, w1;                                                                               \
            if (pf) _mm_prefetch(next + kk * PW * (int64_t)sizeof(WT), _MM_HINT_T0);                     \
            LOAD2(p + kk * PW, &w0, &w1);                                                                \
            for (int i = 0; i < 6; i++)                                                                  \
                if (i < mr) {                                                                            \
                    const __m256 xb = _mm256_broadcast_ss(x + i * ldx + kk);                             \
                    a0[i] = _mm256_fmadd_ps(xb, w0, a0[i]);                                              \
                    a1[i] = _mm256_fmadd_ps(xb, w1, a1[i]);                                              \
                }                                                                                        \
        }                                                                                                \
        for (int i = 0; i < mr; i++) {                                                                   \
            _mm256_storeu_ps(&c[i][0], a0[i]);                                                           \
            _mm256_storeu_ps(&c[i][8], a1[i]);                                                           \
        }                                                                                                \
    }                                                                                                    \
    static inline __attribute__((always_inline)) void ptile2_##SUFFIX(                                   \
        const float *x, int64_t ldx, const WT *p, int64_t pstride, int64_t k, const int mr,              \
        float c[6][2 * PW]) {                                                                            \
        __m256 a0[2], a1[2], a2[2], a3[2];                                                               \
        for (int i = 0; i < 2; i++) a0[i] = a1[i] = a2[i] = a3[i] = _mm256_setzero_ps();                 \
        const char *next = (const char *)(p + 2 * pstride);                                              \
        for (int64_t kk = 0; kk < k; kk++) {                                                             \
            __m256 w0, w1, w2, w3;                                                                       \
            _mm_prefetch(next + kk * PW * (int64_t)sizeof(WT), _MM_HINT_T0);                             \
            _mm_prefetch(next + pstride * (int64_t)sizeof(WT) + kk * PW * (int64_t)sizeof(WT), _MM_HINT_T0); \
            LOAD2(p + kk * PW, &w0, &w1);                                                                \
            LOAD2(p + pstride + kk * PW, &w2, &w3);                                                      \
            for (int i = 0; i < 2; i++)                                                                  \
                if (i < mr) {                                                                            \
                    const __m256 xb = _mm256_broadcast_ss(x + i * ldx + kk);                             \
                    a0[i] = _mm256_fmadd_ps(xb, w0, a0[i]);                                              \
                    a1[i] = _mm256_fmadd_ps(xb, w1, a1[i]);                                              \
                    a2[i] = _mm256_fmadd_ps(xb, w2, a2[i]);                                              \
                    a3[i] = _mm256_fmadd_ps(xb, w3, a3[i]);                                              \
                }                                                                                        \
        }                                                                                                \
        for (int i = 0; i < mr; i++) {                                                                   \
            _mm256_storeu_ps(&c[i][0], a0[i]);                                                           \
            _mm256_storeu_ps(&c[i][8], a1[i]);                                                           \
            _mm256_storeu_ps(&c[i][16], a2[i]);                                                          \
            _mm256_storeu_ps(&c[i][24], a3[i]);                                                          \
        }                                                                                                \
    }

DEFINE_PTILE(f32, float, pload_f32)
DEFINE_PTILE(i8, int8_t, pload_i8)
DEFINE_PTILE(bf16, uint16_t, pload_bf16)

/* One row by four panels (eight FMA chains): the decode GEMV. */
#define DEFINE_PGEMV(SUFFIX, WT, LOAD2)                                                                   \
    static void pgemv4_##SUFFIX(const float *x, const WT *p, int64_t pstride, int64_t k, int np,         \
                                float c[4 * PW]) {                                                       \
        __m256 a[8];                                                                                     \
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();                                          \
        if (np == 4) {                                                                                   \
            /* the next group of panels follows this one in memory: stream it in, as many lines per k   \
             * as one k of this group spans (4 panels x 16 channels: sizeof(WT) lines) */                \
            const char *next = (const char *)(p + 4 * pstride);                                          \
            for (int64_t kk = 0; kk < k; kk++) {                                                         \
                for (int l = 0; l < (int)sizeof(WT); l++)                                                \
                    _mm_prefetch(next + kk * 4 * PW * (int64_t)sizeof(WT) + l * 64, _MM_HINT_T0);        \
                const __m256 xb = _mm256_broadcast_ss(x + kk);                                           \
                __m256 w[8];                                                                             \
                for (int q = 0; q < 4; q++) LOAD2(p + q * pstride + kk * PW, &w[2 * q], &w[2 * q + 1]);   \
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(xb, w[j], a[j]);                      \
            }                                                                                            \
        } else {                                                                                         \
            for (int64_t kk = 0; kk < k; kk++) {                                                         \
                const __m256 xb = _mm256_broadcast_ss(x + kk);                                           \
                for (int q = 0; q < np; q++) {                                                           \
                    __m256 w0, w1;                                                                       \
                    LOAD2(p + q * pstride + kk * PW, &w0, &w1);                                          \
                    a[2 * q] = _mm256_fmadd_ps(xb, w0, a[2 * q]);                                        \
                    a[2 * q + 1] = _mm256_fmadd_ps(xb, w1, a[2 * q + 1]);                                \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        for (int j = 0; j < 2 * np; j++) _mm256_storeu_ps(c + 8 * j, a[j]);                              \
    }

DEFINE_PGEMV(f32, float, pload_f32)
DEFINE_PGEMV(i8, int8_t, pload_i8)
DEFINE_PGEMV(bf16, uint16_t, pload_bf16)

/* This OpenMP thread's share [p0, p1) of panels [0, panels): contiguous, in thread order (empty past the end). */
static inline void thread_panels(int64_t panels, int64_t *p0, int64_t *p1) {
    const int nt = omp_get_num_threads(), id = omp_get_thread_num();
    const int64_t per = (panels + nt - 1) / nt;
    *p0 = id * per < panels ? id * per : panels;
    *p1 = *p0 + per < panels ? *p0 + per : panels;
}

static inline void store_out(const Linear *L, float *o, int64_t n0, const float *c, int nv, int accumulate) {
    int j = 0;
    for (; j + 8 <= nv; j += 8) {
        __m256 v = _mm256_loadu_ps(c + j);
        if (L->scale) v = _mm256_mul_ps(v, _mm256_loadu_ps(L->scale + n0 + j));
        if (L->bias) v = _mm256_add_ps(v, _mm256_loadu_ps(L->bias + n0 + j));
        if (accumulate) v = _mm256_add_ps(v, _mm256_loadu_ps(o + j));
        _mm256_storeu_ps(o + j, v);
    }
    for (; j < nv; j++) {
        float v = c[j];
        if (L->scale) v *= L->scale[n0 + j];
        if (L->bias) v += L->bias[n0 + j];
        o[j] = accumulate ? o[j] + v : v;
    }
}

#define DISPATCH_PTILE(SUFFIX, WT)                                                                        \
    static void run_ptile_##SUFFIX(const float *x, int64_t ldx, const WT *p, int64_t pstride, int64_t k,  \
                                   int mr, int np, int pf, float c[6][2 * PW]) {                          \
        if (np == 2) {                                                                                    \
            if (mr == 2) ptile2_##SUFFIX(x, ldx, p, pstride, k, 2, c);                                    \
            else ptile2_##SUFFIX(x, ldx, p, pstride, k, 1, c);                                            \
            return;                                                                                       \
        }                                                                                                 \
        switch (mr) {                                                                                     \
        case 6: ptile1_##SUFFIX(x, ldx, p, k, 6, pf, c); break;                                           \
        case 5: ptile1_##SUFFIX(x, ldx, p, k, 5, pf, c); break;                                           \
        case 4: ptile1_##SUFFIX(x, ldx, p, k, 4, pf, c); break;                                           \
        case 3: ptile1_##SUFFIX(x, ldx, p, k, 3, pf, c); break;                                           \
        case 2: ptile1_##SUFFIX(x, ldx, p, k, 2, pf, c); break;                                           \
        default: ptile1_##SUFFIX(x, ldx, p, k, 1, pf, c); break;                                          \
        }                                                                                                 \
    }

DISPATCH_PTILE(f32, float)
DISPATCH_PTILE(i8, int8_t)
DISPATCH_PTILE(bf16, uint16_t)

/* ------------------------------------------------------------ int4 panels */
/*
 * 4-bit weights w = d * q + m (q in 0..15; d, m one pair per output channel
 * per group of `group` k). A panel holds 16 channels as k pairs:
 * byte c of pair j is channel c, its low nibble k = 2j and its high nibble
 * k = 2j + 1; each group's 16 scales then 16 mins follow in qparams, fp16
 * (llama.cpp's Q4_0/Q4_1 and the int4_wo quantizer) or fp32 (a scale times an
 * integer zero point or sub-block scale, as AWQ, GPTQ and Q4_K make them). This is
 * llama.cpp's Q4_1 (and, with m = -8d, Q4_0) at 5 bits a weight.
 *
 * Up to Q4_DIRECT_MAX rows (AVX2: Q4_DIRECT_MAX_AVX2) read the 4-bit panels directly: the nibbles widen
 * in registers, x * q sums per group, and the group's scale and min apply
 * once: sum_k x_k (d q_k + m) = d sum_k x_k q_k + m sum_k x_k, each row's
 * group sums (xs) computed once per call. AVX2 runs one row over four
 * panels, or up to four rows over one; AVX-512F, where the CPU has it, up
 * to four rows over four panels, or five or six over two (see "AVX-512 int4
 * rows"); more rows go in passes of those, each unpacking the panels again,
 * which up to these counts costs less than widening them. More rows widen
 * each panel once, to fp32 (exactly d * q + m) for the fp32 tiles or to bf16
 * pairs for AMX tiles. Where the CPU has AVX512-BF16, every row count runs
 * on vdpbf16ps instead (see gtile).
 */
static inline __m256 load_f16(const uint16_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* Eight group parameters from element i of L's qparams, fp16 or fp32. */
static inline __m256 load_qp(const Linear *L, int64_t i) {
    return L->qparams_f32 ? _mm256_loadu_ps((const float *)L->qparams + i) : load_f16((const uint16_t *)L->qparams + i);
}

/* 16 bytes of a pair row: channels 0-7 and 8-15 of k = 2j (lo) and k = 2j + 1 (hi), as floats. */
static inline __attribute__((always_inline)) void q4_unpack(const uint8_t *p, __m256 *lo0, __m256 *lo1, __m256 *hi0,
                                                            __m256 *hi1) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p), mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    *lo0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
    *lo1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
    *hi0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
    *hi1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
}

/* Group g's part of four panels' outputs: c += d * a + m * xsg (a: the group's x * q sums, eight
 * channels a register; dm: the first panel's group parameters; qstride: a panel's parameters). */
static inline void apply_group(const Linear *L, const __m256 a[8], float xsg, int64_t dm, int64_t qstride, int np,
                               float c[4 * PW]) {
    const __m256 s = _mm256_set1_ps(xsg);
    for (int q = 0; q < np; q++)
        for (int h = 0; h < 2; h++) {
            float *o = c + q * PW + 8 * h;
            const int64_t i = dm + q * qstride + 8 * h;
            const __m256 base = _mm256_fmadd_ps(load_qp(L, i + PW), s, _mm256_loadu_ps(o));
            _mm256_storeu_ps(o, _mm256_fmadd_ps(load_qp(L, i), a[2 * q + h], base));
        }
}

/* x's sum over each group of k */
static void q4_group_sums(const float *x, int64_t k, int group, float *xs) {
    for (int64_t g = 0; g < k / group; g++) {
        __m256 s = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= group; i += 8) s = _mm256_add_ps(s, _mm256_loadu_ps(x + g * group + i));
        float t = hsum8(s);
        for (; i < group; i++) t += x[g * group + i];
        xs[g] = t;
    }
}

/* One row by up to four int4 panels starting at panel pn. */
static void pgemv4_q4(const Linear *L, const float *x, const float *xs, int64_t pn, int np, float c[4 * PW]) {
    const int64_t k = L->k, pstride = k * PW / 2, groups = k / L->group, qstride = groups * 2 * PW;
    const int pairs = L->group / 2;
    const uint8_t *p = (const uint8_t *)L->w + pn * pstride;
    const int64_t qp = pn * qstride; /* this panel's first group parameter */
    const char *next = (const char *)(p + 4 * pstride); /* the next four panels, streamed in alongside */
    for (int j = 0; j < 4 * PW; j++) c[j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        const float *xg = x + g * L->group;
        const uint8_t *pg = p + g * pairs * PW;
        if (np == 4) {
            for (int j = 0; j < pairs; j++) {
                _mm_prefetch(next + (g * pairs + j) * 4 * PW, _MM_HINT_T0); /* 64 bytes: as much as a pair of four panels */
                const __m256 x0 = _mm256_broadcast_ss(xg + 2 * j), x1 = _mm256_broadcast_ss(xg + 2 * j + 1);
                for (int q = 0; q < 4; q++) {
                    __m256 l0, l1, h0, h1;
                    q4_unpack(pg + q * pstride + j * PW, &l0, &l1, &h0, &h1);
                    a[2 * q] = _mm256_fmadd_ps(x1, h0, _mm256_fmadd_ps(x0, l0, a[2 * q]));
                    a[2 * q + 1] = _mm256_fmadd_ps(x1, h1, _mm256_fmadd_ps(x0, l1, a[2 * q + 1]));
                }
            }
        } else {
            for (int j = 0; j < pairs; j++) {
                const __m256 x0 = _mm256_broadcast_ss(xg + 2 * j), x1 = _mm256_broadcast_ss(xg + 2 * j + 1);
                for (int q = 0; q < np; q++) {
                    __m256 l0, l1, h0, h1;
                    q4_unpack(pg + q * pstride + j * PW, &l0, &l1, &h0, &h1);
                    a[2 * q] = _mm256_fmadd_ps(x1, h0, _mm256_fmadd_ps(x0, l0, a[2 * q]));
                    a[2 * q + 1] = _mm256_fmadd_ps(x1, h1, _mm256_fmadd_ps(x0, l1, a[2 * q + 1]));
                }
            }
        }
        apply_group(L, a, xs[g], qp + g * 2 * PW, qstride, np, c);
    }
}

/* R rows (1-4) by one int4 panel: each pair row widened once for all R. c: [R][PW]. */
static inline __attribute__((always_inline)) void q4_rows_avx2_tile(const Linear *L, const float *x, int64_t ldx,
                                                                    const float *xs, int64_t pn, const int R,
                                                                    float *c) {
    const int64_t k = L->k, groups = k / L->group;
    const int pairs = L->group / 2;
    const uint8_t *p = (const uint8_t *)L->w + pn * (k * PW / 2);
    const int64_t qp = pn * groups * 2 * PW;
    __m256 o[4][2];
    for (int r = 0; r < R; r++) o[r][0] = o[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m256 a[4][2];
        for (int r = 0; r < R; r++) a[r][0] = a[r][1] = _mm256_setzero_ps();
        const float *xg = x + g * L->group;
        for (int j = 0; j < pairs; j++) {
            __m256 l0, l1, h0, h1;
            q4_unpack(p + (g * pairs + j) * PW, &l0, &l1, &h0, &h1);
            for (int r = 0; r < R; r++) {
                const __m256 x0 = _mm256_broadcast_ss(xg + r * ldx + 2 * j);
                const __m256 x1 = _mm256_broadcast_ss(xg + r * ldx + 2 * j + 1);
                a[r][0] = _mm256_fmadd_ps(x1, h0, _mm256_fmadd_ps(x0, l0, a[r][0]));
                a[r][1] = _mm256_fmadd_ps(x1, h1, _mm256_fmadd_ps(x0, l1, a[r][1]));
            }
        }
        const int64_t dm = qp + g * 2 * PW;
        for (int h = 0; h < 2; h++) {
            const __m256 d = load_qp(L, dm + 8 * h), m = load_qp(L, dm + PW + 8 * h);
            for (int r = 0; r < R; r++)
                o[r][h] = _mm256_fmadd_ps(d, a[r][h], _mm256_fmadd_ps(m, _mm256_set1_ps(xs[r * groups + g]), o[r][h]));
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(c + r * PW, o[r][0]);
        _mm256_storeu_ps(c + r * PW + 8, o[r][1]);
    }
}

/* Rows for the next of the passes of at most `most` rows that cover `left` rows as evenly as they go. */
static inline int64_t even_pass(int64_t left, int64_t most) {
    const int64_t passes = (left + most - 1) / most;
    return (left + passes - 1) / passes;
}

/* Rows [0, m) (m <= Q4_DIRECT_MAX_AVX2) against int4 panels [p0, p1) on AVX2, in passes of up to four rows as even
 * as they go (5: 3 + 2, 6: 3 + 3, 7: 4 + 3, 9: 3 + 3 + 3). */
static void q4_rows_avx2(const Linear *L, const float *x, int64_t ldx, const float *xs, float *out, int64_t ldo,
                         int64_t m, int64_t p0, int64_t p1, int accumulate) {
    const int64_t n = L->n, groups = L->k / L->group;
    float c[4 * PW];
    for (int64_t pn = p0; pn < p1; pn++) {
        const int64_t n0 = pn * PW;
        const int nv = (int)(n - n0 < PW ? n - n0 : PW);
        for (int64_t r0 = 0, R; r0 < m; r0 += R) {
            R = even_pass(m - r0, 4);
            const float *xr = x + r0 * ldx, *sr = xs + r0 * groups;
            if (R == 4) q4_rows_avx2_tile(L, xr, ldx, sr, pn, 4, c);
            else if (R == 3) q4_rows_avx2_tile(L, xr, ldx, sr, pn, 3, c);
            else if (R == 2) q4_rows_avx2_tile(L, xr, ldx, sr, pn, 2, c);
            else q4_rows_avx2_tile(L, xr, ldx, sr, pn, 1, c);
            for (int r = 0; r < (int)R; r++) store_out(L, out + (r0 + r) * ldo + n0, n0, c + r * PW, nv, accumulate);
        }
    }
}

/* Panel pn widened to fp32 ([k][PW]): d * q + m, rounded after the product and after the sum (as
 * dequantize_int4 computes it; the product is exact with fp16 scales). */
static void q4_widen(const Linear *L, int64_t pn, int64_t g0, int64_t g1, float *wf) {
    const int64_t k = L->k, pstride = k * PW / 2, groups = k / L->group, k0 = g0 * L->group;
    const int pairs = L->group / 2;
    const uint8_t *p = (const uint8_t *)L->w + pn * pstride;
    const int64_t qp = pn * groups * 2 * PW;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t dm = qp + g * 2 * PW;
        const __m256 d0 = load_qp(L, dm), d1 = load_qp(L, dm + 8), m0 = load_qp(L, dm + PW), m1 = load_qp(L, dm + PW + 8);
        for (int j = 0; j < pairs; j++) {
            const int64_t kk = g * L->group + 2 * j;
            float *o = wf + (kk - k0) * PW;
            __m256 l0, l1, h0, h1;
            q4_unpack(p + (kk / 2) * PW, &l0, &l1, &h0, &h1);
            _mm256_storeu_ps(o, _mm256_add_ps(_mm256_mul_ps(d0, l0), m0));
            _mm256_storeu_ps(o + 8, _mm256_add_ps(_mm256_mul_ps(d1, l1), m1));
            _mm256_storeu_ps(o + PW, _mm256_add_ps(_mm256_mul_ps(d0, h0), m0));
            _mm256_storeu_ps(o + PW + 8, _mm256_add_ps(_mm256_mul_ps(d1, h1), m1));
        }
    }
}

/* ------------------------------------------------------ grouped int8 */
/*
 * int8 weights with a scale and min per output channel per group of k
 * (fp32 qparams, laid out as int4's): GGUF's Q8_0 (m = 0, groups of 32),
 * Q5_K (q 0..31 with min, 32) and Q6_K (q - 32, groups of 16), and int4
 * parts fused beside them. One row runs a GEMV that applies d and m per
 * group, as int4's; more rows widen each panel once.
 */
static void q8g_widen(const Linear *L, int64_t pn, int64_t g0, int64_t g1, float *wf) {
    const int64_t k = L->k, groups = k / L->group, k0 = g0 * L->group;
    const int8_t *p = (const int8_t *)L->w + pn * k * PW;
    const int64_t qp = pn * groups * 2 * PW;
    for (int64_t g = g0; g < g1; g++) {
        const int64_t dm = qp + g * 2 * PW;
        const __m256 d0 = load_qp(L, dm), d1 = load_qp(L, dm + 8), m0 = load_qp(L, dm + PW), m1 = load_qp(L, dm + PW + 8);
        for (int64_t kk = g * L->group; kk < (g + 1) * L->group; kk++) {
            _mm256_storeu_ps(wf + (kk - k0) * PW, _mm256_add_ps(_mm256_mul_ps(d0, load_w_i8(p + kk * PW)), m0));
            _mm256_storeu_ps(wf + (kk - k0) * PW + 8, _mm256_add_ps(_mm256_mul_ps(d1, load_w_i8(p + kk * PW + 8)), m1));
        }
    }
}

/* One row by up to four grouped-int8 panels starting at panel pn. */
static void pgemv4_q8g(const Linear *L, const float *x, const float *xs, int64_t pn, int np, float c[4 * PW]) {
    const int64_t k = L->k, pstride = k * PW, groups = k / L->group, qstride = groups * 2 * PW;
    const int8_t *p = (const int8_t *)L->w + pn * pstride;
    const int64_t qp = pn * qstride;
    for (int j = 0; j < 4 * PW; j++) c[j] = 0.0f;
    for (int64_t g = 0; g < groups; g++) {
        __m256 a[8];
        for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
        for (int64_t kk = g * L->group; kk < (g + 1) * L->group; kk++) {
            const __m256 xb = _mm256_broadcast_ss(x + kk);
            for (int q = 0; q < np; q++) {
                a[2 * q] = _mm256_fmadd_ps(xb, load_w_i8(p + q * pstride + kk * PW), a[2 * q]);
                a[2 * q + 1] = _mm256_fmadd_ps(xb, load_w_i8(p + q * pstride + kk * PW + 8), a[2 * q + 1]);
            }
        }
        apply_group(L, a, xs[g], qp + g * 2 * PW, qstride, np, c);
    }
}

/* Groups [g0, g1) of a grouped panel (int4 or int8) widened to fp32 ([k][PW] from the first group's k, d * q + m). */
static void grouped_widen(const Linear *L, int64_t pn, int64_t g0, int64_t g1, float *wf) {
    if (L->wtype == WTYPE_Q4) q4_widen(L, pn, g0, g1, wf);
    else q8g_widen(L, pn, g0, g1, wf);
}

/* Rows [m0, m1) against panels [p0, p1). wbuf (PW * k floats): with more
 * than one row tile, an int8 or bf16 panel is widened into it once and every
 * tile runs the fp32 kernel against it; an int4 panel always is. */
static void packed_rows(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m0,
                        int64_t m1, int64_t p0, int64_t p1, int accumulate, float *wbuf) {
    const int64_t k = L->k, n = L->n, pstride = k * PW;
    const int grouped = grouped_panels(L);
    const int widen = grouped || (L->wtype != WTYPE_F32 && m1 - m0 > 6);
    const int np = m1 - m0 <= 2 && !widen ? 2 : 1;
    float c[6][2 * PW];
    for (int64_t pn = p0; pn < p1; pn += np) {
        const int64_t n0 = pn * PW;
        const int npu = (int)(p1 - pn < np ? p1 - pn : np);
        const int nv = (int)(n - n0 < npu * PW ? n - n0 : npu * PW);
        const int8_t *pq = L->wtype == WTYPE_I8 ? (const int8_t *)L->w + pn * pstride : NULL;
        const uint16_t *pb = L->wtype == WTYPE_BF16 ? (const uint16_t *)L->w + pn * pstride : NULL;
        const float *pf = L->wtype == WTYPE_F32 ? (const float *)L->w + pn * pstride : NULL;
        if (widen) {
            if (grouped)
                grouped_widen(L, pn, 0, L->k / L->group, wbuf);
            else if (L->wtype == WTYPE_I8)
                for (int64_t i = 0; i < pstride; i += 8) _mm256_storeu_ps(wbuf + i, load_w_i8(pq + i));
            else
                for (int64_t i = 0; i < pstride; i += 8) _mm256_storeu_ps(wbuf + i, load_bf16(pb + i));
            pf = wbuf;
        }
        for (int64_t m = m0, mr; m < m1; m += mr) {
            /* six-row tiles; a short remainder shares the last twelve rows or fewer evenly
             * (32 rows: 6 6 6 6 4 4), since a 1-2 row tile leaves the FMA units idle */
            const int64_t left = m1 - m;
            mr = left >= 12 || left <= 6 ? (left < 6 ? (int)left : 6) : (int)((left + 1) / 2);
            if (L->wtype == WTYPE_I8 && !widen)
                run_ptile_i8(x + m * ldx, ldx, pq, pstride, k, mr, npu, 1, c);
            else if (L->wtype == WTYPE_BF16 && !widen)
                run_ptile_bf16(x + m * ldx, ldx, pb, pstride, k, mr, npu, 1, c);
            else
                run_ptile_f32(x + m * ldx, ldx, pf, pstride, k, mr, npu, !widen, c); /* a widened copy: no next panel */
            for (int i = 0; i < (int)mr; i++) store_out(L, out + (m + i) * ldo + n0, n0, c[i], nv, accumulate);
        }
    }
}

/* ------------------------------------------------ AVX512-BF16 batched GEMM */
/*
 * Where the CPU has AVX512-BF16, a bf16-weight GEMM (an int8 weight-only,
 * int4 or grouped-int8 one too, those that do not take int8 rows: their
 * integers are exact in bf16, and a group's scale and min apply to its
 * sums, see gtile) runs on vdpbf16ps at every row count: one
 * instruction multiplies 16 channels by two k (four times the
 * multiply-adds of an AVX2 FMA); 2.5-3x the widen path at 8-32 rows on an
 * AVX512-BF16 EPYC (Intel's issue it at half the rate of zmm FMAs: there
 * bf16 and int8 weights take "bf16 weights in AVX-512 FMAs" below).
 * vdpbf16ps takes bf16 on both sides, so the rows are
 * rounded to bf16 (nearest even) once per call: products are exact and
 * sums fp32, so the result is the fp32 kernel's on the rounded rows up to
 * summation order. Up to DR rows read the stored panels, each k pair made
 * in registers (dtile_direct); more re-lay each panel once (panel_pairs,
 * grouped_pairs), bf16 and int8 ones four at a time for tiles of six rows
 * by 64 channels (dtile: 24 chains, vdpbf16ps's one a cycle on Zen 4; 1.6x
 * the tiles of twelve rows by one panel at 256 rows, 400-420 GFLOP/s of
 * the 469 its loop reaches on a 2-vCPU EPYC, as torch's oneDNN does):
 * the same bf16 values summed in the same order, so a
 * row's result is the same bits whatever else the call holds (a decode
 * alone, beside others, a prompt's chunk), as int8 rows' are, and the
 * load on a server does not change what these GEMMs give a request (on
 * AMX, the tiles take the larger row counts and sum in their own order). A
 * one-stream decode of a 135M GGUF (q/k/v and the LM head here) runs 2-3%
 * slower than on the fp32 GEMVs; eight streams 12% faster. These functions
 * are compiled for the feature by attribute and chosen at run time from CPUID,
 * so the library builds with the AVX2 flags and loads on AVX2-only CPUs.
 */
#define DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512bf16")))
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw")))

AVX512_TARGET static inline __m512 load_qp512(const Linear *L, int64_t i) {
    return L->qparams_f32 ? _mm512_loadu_ps((const float *)L->qparams + i)
                          : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)L->qparams + i)));
}

#define DR 12 /* rows per vdpbf16ps tile: 12 zmm accumulators */
#ifndef DOT_PREFETCH
#define DOT_PREFETCH 8192 /* bytes ahead of a stored panel's stream (weights come from memory, not a cache) */
#endif

static int g_has_avx512, g_avx512, g_has_bf16_dot, g_bf16_dot, g_has_bf16_att, g_bf16_att, g_has_fma_rows, g_fma_rows;

/* AVX512F and AVX512BW in CPUID with the OS saving zmm and mask state (XCR0): 1; with AVX512-BF16 too: 2. */
static int cpu_avx512_level(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(1, 0, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* OSXSAVE */
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & 0xe6) != 0xe6) return 0; /* SSE, AVX, opmask, ZMM_Hi256, Hi16_ZMM */
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b & (1u << 16)) || !(b & (1u << 30))) return 0;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5)) ? 2 : 1;
}

/* CPUID's vendor is AMD ("AuthenticAMD"). */
static int cpu_is_amd(void) {
    unsigned a, b, c, d;
    return __get_cpuid(0, &a, &b, &c, &d) && b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;
}

static void __attribute__((constructor(101))) probe_avx512(void) { /* before probe_amx */
    const int level = cpu_avx512_level();
    g_has_avx512 = g_avx512 = level >= 1;
    g_has_bf16_dot = g_bf16_dot = level >= 2;
    /* The prefill attention tiles on vdpbf16ps (see "The same tile on AVX512-BF16") by default where it does
     * twice the multiply-adds a cycle of fp32 FMAs: AMD's (Zen 4 on). Intel's AVX512-BF16 CPUs issue it once
     * every two cycles where zmm FMAs issue twice a cycle, half the multiply-adds, and there the fp32 tiles
     * ran faster, except on AMX tiles (probe_amx). */
    g_has_bf16_att = level >= 2;
    g_bf16_att = g_has_bf16_att && cpu_is_amd();
    /* bf16 and int8 GEMMs of float rows in AVX-512 FMAs (see "bf16 weights in AVX-512 FMAs") by default
     * where vdpbf16ps does fewer multiply-adds a cycle than the FMAs (Intel's CPUs) or is absent; on AMX
     * CPUs for the row counts below the tiles' (1.1-1.25x vdpbf16ps at 1-12 rows on a Sapphire Rapids
     * class Xeon). */
    g_has_fma_rows = level >= 1;
    g_fma_rows = g_has_fma_rows && !(level >= 2 && cpu_is_amd());
}

/* The vdpbf16ps path: set < 0 asks, 0 turns it off, 1 on (where the CPU has it). Returns the state. */
int appl_bf16_dot(int set) {
    if (set >= 0) g_bf16_dot = set && g_has_bf16_dot;
    return g_bf16_dot;
}

/* bf16- and int8-weight GEMMs of float rows in AVX-512 FMAs (ahead of vdpbf16ps, while avx512 is on), the same way. */
int appl_fma_rows(int set) {
    if (set >= 0) g_fma_rows = set && g_has_fma_rows;
    return g_fma_rows;
}

/* Prefill attention tiles on vdpbf16ps over a bf16 or fp8 cache, the same way. */
int appl_bf16_attention(int set) {
    if (set >= 0) g_bf16_att = set && g_has_bf16_att;
    return g_bf16_att;
}

/* The AVX-512F int4 GEMV (see "AVX-512 int4 rows") and prefill attention tiles, the same way. */
int appl_avx512(int set) {
    if (set >= 0) g_avx512 = set && g_has_avx512;
    return g_avx512;
}

/* One row to bf16, zero-padded to kp >= k (vdpbf16ps takes k in pairs, AMX in blocks of 32). */
DOT_TARGET static void row_to_bf16(const float *x, uint16_t *o, int64_t k, int64_t kp) {
    int64_t i = 0;
    for (; i + 16 <= k; i += 16) _mm256_storeu_si256((__m256i *)(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + i)));
    if (i < k) {
        uint16_t tail[16];
        const __mmask16 mask = (__mmask16)((1u << (k - i)) - 1);
        _mm256_storeu_si256((__m256i *)tail, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i)));
        memcpy(o + i, tail, sizeof(uint16_t) * (size_t)(kp - i < 16 ? kp - i : 16));
        i += 16;
    }
    if (i < kp) memset(o + i, 0, sizeof(uint16_t) * (size_t)(kp - i));
}

/* One row to bf16 in AMX row tiles: its k-block j (32 values, zero past k) at o + 512 j, o its place in the first
 * block of its tile (the tile's 16 rows of 32 values each block, the blocks one after another). */
DOT_TARGET static void row_to_bf16_tiles(const float *x, uint16_t *o, int64_t k, int64_t kx) {
    for (int64_t i = 0; i < kx; i += 32) {
        const int64_t lo = k - i < 0 ? 0 : k - i > 16 ? 16 : k - i, hi = k - i - 16 < 0 ? 0 : k - i - 16 > 16 ? 16 : k - i - 16;
        const __m512 a = _mm512_maskz_loadu_ps((__mmask16)((1u << lo) - 1), x + i);
        const __m512 b = _mm512_maskz_loadu_ps((__mmask16)((1u << hi) - 1), x + i + 16);
        _mm512_storeu_si512(o + 16 * i, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
}

/* mr rows (bf16, row stride kp) by one re-laid panel ([kp / 2][PW][2]: channel c of k pair j at j * 2PW + 2c). */
/* a[i] += row i's k pair j (bf16 rows, stride kp) times w's pairs, for rows i < mr. */
DOT_TARGET static inline __attribute__((always_inline)) void dot_pair(__m512 a[DR], const uint16_t *xb, int64_t kp,
                                                                      int64_t j, __m512bh w, const int mr) {
    for (int i = 0; i < DR; i++)
        if (i < mr) {
            int32_t pair;
            memcpy(&pair, xb + i * kp + 2 * j, sizeof(pair));
            a[i] = _mm512_dpbf16_ps(a[i], (__m512bh)_mm512_set1_epi32(pair), w);
        }
}

/* mr rows (<= MR_LAID) by np (<= NP_LAID) panels re-laid by panel_pairs, one after the other (PW * kp halves
 * apart): each k pair of the panels loaded once for every row, each row's pair broadcast once for every panel
 * (np * mr chains of vdpbf16ps, 24 at most: one instruction a cycle on Zen 4). A chain is dot_pair's, from
 * zero over k in order, so a row's sums are the stored panels' (dtile_stored, dtile_i8) bit for bit. Asks
 * pf_lines cache lines from pf into the cache on the way, pf_step a k pair (the next panels' share). c:
 * [np][DR][PW]. */
#define MR_LAID 6
#define NP_LAID 4
DOT_TARGET static inline __attribute__((always_inline)) void dtile(const uint16_t *xb, int64_t kp, const uint16_t *pp,
                                                                   const int np, const int mr, const char *pf,
                                                                   int64_t pf_lines, int64_t pf_step,
                                                                   float c[][DR][PW]) {
    __m512 a[NP_LAID][MR_LAID];
    for (int q = 0; q < np; q++)
        for (int i = 0; i < mr; i++) a[q][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < kp / 2; j++) {
        for (int64_t l = j * pf_step; l < (j + 1) * pf_step && l < pf_lines; l++) /* pf_step lines a k pair */
            _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
        __m512bh w[NP_LAID];
        for (int q = 0; q < np; q++) w[q] = (__m512bh)_mm512_loadu_si512(pp + q * PW * kp + j * 2 * PW);
        for (int i = 0; i < mr; i++) {
            int32_t pair;
            memcpy(&pair, xb + i * kp + 2 * j, sizeof(pair));
            const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            for (int q = 0; q < np; q++) a[q][i] = _mm512_dpbf16_ps(a[q][i], x, w[q]);
        }
    }
    for (int q = 0; q < np; q++)
        for (int i = 0; i < mr; i++) _mm512_storeu_ps(c[q][i], a[q][i]);
}

/* Lane order of a bf16 panel's two k rows ([k even | k odd] x 16 channels) as vdpbf16ps pairs them:
 * channel c's two values side by side. */
DOT_TARGET static inline __m512i pair_lanes(void) {
    return _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
                            19, 3, 18, 2, 17, 1, 16, 0);
}

/* mr rows (bf16, row stride kp) by one bf16 panel as stored ([k][PW]), each k pair interleaved on the way
 * (one vpermw per pair): the same sums as dtile over panel_pairs' copy, with no copy. For a single row
 * tile the copy would be written and read once, against the stored panel streamed once here, prefetched
 * ahead as it comes from memory. */
DOT_TARGET static inline __attribute__((always_inline)) void dtile_stored(const uint16_t *xb, int64_t kp,
                                                                          const uint16_t *pb, int64_t k,
                                                                          const int mr, float c[DR][PW]) {
    const __m512i lanes = pair_lanes();
    __m512 a[DR];
    for (int i = 0; i < DR; i++) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; 2 * j < k; j++) {
        const __mmask32 rows = 2 * j + 1 < k ? 0xffffffffu : 0xffffu; /* an odd k pairs its last row with zeros */
        _mm_prefetch((const char *)(pb + j * 2 * PW) + DOT_PREFETCH, _MM_HINT_T0); /* this panel, then the next */
        const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(lanes, _mm512_maskz_loadu_epi16(rows, pb + j * 2 * PW));
        dot_pair(a, xb, kp, j, w, mr);
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(c[i], a[i]);
}

#define DTILE_CASE(R, NP) case R: dtile(xr, kp, pbuf, NP, R, pf, pf_lines, pf_step, c4); break;
#define DTILE_ROWS(NP) \
    switch (mr) { DTILE_CASE(6, NP) DTILE_CASE(5, NP) DTILE_CASE(4, NP) DTILE_CASE(3, NP) DTILE_CASE(2, NP) default: dtile(xr, kp, pbuf, NP, 1, pf, pf_lines, pf_step, c4); }
#define GTILE_CASE(R) case R: gtile(L, pn, 1, pbuf, xr, kp, xsr, R, (float(*)[DR][PW])c); break;
#define DTILE_STORED_CASE(R) case R: dtile_stored(xr, kp, pb, L->k, R, c); break;

/* bf16 of 0 .. 15 (words 0-15; 16-31 unused): int4 weights as vdpbf16ps operands. */
DOT_TARGET static inline __m512i bf16_of_nibbles(void) {
    return _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0x4170, 0x4160, 0x4150, 0x4140, 0x4130,
                            0x4120, 0x4110, 0x4100, 0x40e0, 0x40c0, 0x40a0, 0x4080, 0x4040, 0x4000, 0x3f80, 0x0000);
}

/* One k pair of an int4 panel (16 bytes: channel c's k even in the low nibble, k odd in the high one) as
 * vdpbf16ps pairs, exactly: each dword is a channel's (low nibble, high nibble), looked up in bf16_of_nibbles. */
DOT_TARGET static inline __attribute__((always_inline)) __m512bh q4_pairs(const uint8_t *p, __m512i nibbles) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    /* (v | v << 12) & 0x000f000f: 0xa8 is (a | b) & c */
    const __m512i idx = _mm512_ternarylogic_epi32(v, _mm512_slli_epi32(v, 12), _mm512_set1_epi32(0x000f000f), 0xa8);
    return (__m512bh)_mm512_permutexvar_epi16(idx, nibbles);
}

/* One k pair of an int8 panel (16 channels' k even bytes e, k odd bytes o) as vdpbf16ps pairs, exactly
 * (|q| <= 128 has 8 significant bits): interleaved (e0 o0 e1 o1 ..), so vcvtne2ps2bf16 lays them out pairwise. */
DOT_TARGET static inline __attribute__((always_inline)) __m512bh i8_pairs(__m128i e, __m128i o) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi8(e, o)));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi8(e, o)));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* A grouped (int4 or grouped int8) panel re-laid as vdpbf16ps pairs of its integers q, exactly. */
DOT_TARGET static void grouped_pairs(const Linear *L, int64_t pn, uint16_t *pbuf) {
    const int64_t k = L->k;
    if (L->wtype == WTYPE_Q4) {
        const __m512i nibbles = bf16_of_nibbles();
        const uint8_t *p = (const uint8_t *)L->w + pn * (k * PW / 2);
        for (int64_t j = 0; j < k / 2; j++) _mm512_storeu_si512(pbuf + j * 2 * PW, (__m512i)q4_pairs(p + j * PW, nibbles));
    } else {
        const int8_t *p = (const int8_t *)L->w + pn * k * PW;
        for (int64_t j = 0; j < k / 2; j++)
            _mm512_storeu_si512(pbuf + j * 2 * PW, (__m512i)i8_pairs(_mm_loadu_si128((const __m128i *)(p + 2 * j * PW)),
                                                                      _mm_loadu_si128((const __m128i *)(p + (2 * j + 1) * PW))));
    }
}

/* Each row's sums over each group of k of its bf16 values (xs [m][k / group]), in one order for every call. */
DOT_TARGET static void bf16_group_sums(const uint16_t *xb, int64_t kp, int64_t m, int64_t k, int group, float *xs) {
    const int64_t groups = k / group;
    for (int64_t r = 0; r < m; r++)
        for (int64_t g = 0; g < groups; g++) {
            const uint16_t *xg = xb + r * kp + g * group;
            __m512 s = _mm512_setzero_ps();
            for (int i = 0; i < group; i += 16) {
                const __mmask32 in = group - i >= 16 ? (__mmask32)0xffff : (__mmask32)((1u << (group - i)) - 1);
                const __m512i v = _mm512_cvtepu16_epi32(_mm512_castsi512_si256(_mm512_maskz_loadu_epi16(in, xg + i)));
                s = _mm512_add_ps(s, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
            }
            xs[r * groups + g] = _mm512_reduce_add_ps(s);
        }
}

/* mr rows (bf16, row stride kp; xs their group sums) by np grouped panels from pn: per group, the rows' k
 * pairs against the weights' integers (from pbuf, re-laid by grouped_pairs, np 1; or made from the stored
 * panels in registers: the same bf16) summed from zero, then c = d * sum + (m * xs + c), group after group.
 * Sums of exact products (a bf16 by an integer of at most 8 bits), so they are those of
 * sum_k x_k (d q_k + m) with no weight rounded; the same bits for a row whatever rows share the call. More
 * panels give a row or two independent chains of vdpbf16ps. c: [np][DR][PW]. */
DOT_TARGET static inline __attribute__((always_inline)) void gtile(const Linear *L, int64_t pn, const int np,
                                                                   const uint16_t *pbuf, const uint16_t *xb,
                                                                   int64_t kp, const float *xs, const int mr,
                                                                   float c[][DR][PW]) {
    const int64_t groups = L->k / L->group, qstride = groups * 2 * PW, qp = pn * qstride;
    const int pairs = L->group / 2, q4 = L->wtype == WTYPE_Q4;
    const int64_t pstride = q4 ? L->k * PW / 2 : L->k * PW; /* bytes */
    const uint8_t *base = (const uint8_t *)L->w + pn * pstride;
    const __m512i nibbles = bf16_of_nibbles();
    __m512 o[4][DR];
    for (int q = 0; q < np; q++)
        for (int i = 0; i < DR; i++) o[q][i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 a[4][DR];
        for (int q = 0; q < np; q++)
            for (int i = 0; i < DR; i++) a[q][i] = _mm512_setzero_ps();
        for (int jj = 0; jj < pairs; jj++) {
            const int64_t j = g * pairs + jj;
            __m512bh xj[4]; /* a row or few's k pair, broadcast once for every panel */
            for (int i = 0; i < 4; i++)
                if (np > 1 && i < mr) {
                    int32_t pair;
                    memcpy(&pair, xb + i * kp + 2 * j, sizeof(pair));
                    xj[i] = (__m512bh)_mm512_set1_epi32(pair);
                }
            for (int q = 0; q < np; q++) {
                __m512bh w;
                if (pbuf) {
                    w = (__m512bh)_mm512_loadu_si512(pbuf + j * 2 * PW);
                } else if (q4) {
                    const uint8_t *pj = base + q * pstride + j * PW;
                    _mm_prefetch((const char *)pj + DOT_PREFETCH, _MM_HINT_T0);
                    w = q4_pairs(pj, nibbles);
                } else {
                    const int8_t *pj = (const int8_t *)(base + q * pstride) + 2 * j * PW;
                    _mm_prefetch((const char *)pj + DOT_PREFETCH, _MM_HINT_T0);
                    w = i8_pairs(_mm_loadu_si128((const __m128i *)pj), _mm_loadu_si128((const __m128i *)(pj + PW)));
                }
                if (np > 1)
                    for (int i = 0; i < 4; i++) {
                        if (i < mr) a[q][i] = _mm512_dpbf16_ps(a[q][i], xj[i], w);
                    }
                else
                    dot_pair(a[q], xb, kp, j, w, mr);
            }
        }
        for (int q = 0; q < np; q++) {
            const __m512 d = load_qp512(L, qp + q * qstride + g * 2 * PW);
            const __m512 mn = load_qp512(L, qp + q * qstride + g * 2 * PW + PW);
            for (int i = 0; i < DR; i++)
                if (i < mr)
                    o[q][i] = _mm512_fmadd_ps(d, a[q][i], _mm512_fmadd_ps(mn, _mm512_set1_ps(xs[i * groups + g]), o[q][i]));
        }
    }
    for (int q = 0; q < np; q++)
        for (int i = 0; i < mr; i++) _mm512_storeu_ps(c[q][i], o[q][i]);
}

/* mr rows (bf16, row stride kp) by an int8 (per channel) panel as stored: each k pair made in registers
 * as panel_pairs makes it in memory, so the sums are dtile's over the re-laid panel, bit for bit. */
DOT_TARGET static inline __attribute__((always_inline)) void dtile_i8(const int8_t *pq, int64_t k, const uint16_t *xb,
                                                                      int64_t kp, const int mr, float c[DR][PW]) {
    __m512 a[DR];
    for (int i = 0; i < DR; i++) a[i] = _mm512_setzero_ps();
    for (int64_t j = 0; 2 * j < k; j++) {
        const int8_t *pj = pq + 2 * j * PW;
        _mm_prefetch((const char *)pj + DOT_PREFETCH, _MM_HINT_T0);
        const __m128i o = 2 * j + 1 < k ? _mm_loadu_si128((const __m128i *)(pj + PW)) /* an odd k pairs its */
                                        : _mm_setzero_si128();                      /* last row with zeros */
        dot_pair(a, xb, kp, j, i8_pairs(_mm_loadu_si128((const __m128i *)pj), o), mr);
    }
    for (int i = 0; i < mr; i++) _mm512_storeu_ps(c[i], a[i]);
}

/* mr rows by np panels from pn as stored, whatever their weights (bf16, int8, grouped). c: [np][DR][PW]. */
DOT_TARGET static inline __attribute__((always_inline)) void dtile_direct(const Linear *L, int64_t pn, const int np,
                                                                          const uint16_t *xb, int64_t kp,
                                                                          const float *xs, const int mr,
                                                                          float c[][DR][PW]) {
    if (grouped_panels(L)) {
        gtile(L, pn, np, NULL, xb, kp, xs, mr, c);
        return;
    }
    for (int q = 0; q < np; q++) {
        if (L->wtype == WTYPE_BF16) dtile_stored(xb, kp, (const uint16_t *)L->w + (pn + q) * L->k * PW, L->k, mr, c[q]);
        else dtile_i8((const int8_t *)L->w + (pn + q) * L->k * PW, L->k, xb, kp, mr, c[q]);
    }
}

#define DTILE_DIRECT_CASE(R, NP) case R: dtile_direct(L, pn, NP, xb, kp, xs, R, c); break;

/* The most rows one tile takes against a panel as stored (more: two tiles, the second finding the panel in
 * the cache; on Zen 4 tiles of twelve rows ran 10-25% slower than of six to eight). */
#define DIRECT_TILE_ROWS 8

/* Rows [0, m) (m <= DR) of xb (bf16, row stride kp; xs their group sums, grouped weights) against panels
 * [p0, p1) as stored: four panels at a time for up to two rows, two for up to four. */
DOT_TARGET static void packed_rows_direct(const Linear *L, const uint16_t *xb, int64_t kp, const float *xs,
                                          float *out, int64_t ldo, int64_t m, int64_t p0, int64_t p1, int accumulate) {
    float c[4][DR][PW];
    const int64_t most = m <= 2 ? 4 : m <= 4 ? 2 : 1;
    const int64_t h = (m + 1) / 2; /* past DIRECT_TILE_ROWS, one panel: the first tile's rows, the rest in c[1] */
    for (int64_t pn = p0; pn < p1;) {
        const int np = (int)(p1 - pn < most ? p1 - pn : most);
        if (np == 4) {
            switch (m) { DTILE_DIRECT_CASE(2, 4) default: dtile_direct(L, pn, 4, xb, kp, xs, 1, c); }
        } else if (np >= 2) { /* a remainder of two or three panels: two */
            switch (m) {
                DTILE_DIRECT_CASE(4, 2) DTILE_DIRECT_CASE(3, 2) DTILE_DIRECT_CASE(2, 2)
                default: dtile_direct(L, pn, 2, xb, kp, xs, 1, c);
            }
        } else if (m <= DIRECT_TILE_ROWS) {
            switch (m) {
                DTILE_DIRECT_CASE(8, 1) DTILE_DIRECT_CASE(7, 1) DTILE_DIRECT_CASE(6, 1) DTILE_DIRECT_CASE(5, 1)
                DTILE_DIRECT_CASE(4, 1) DTILE_DIRECT_CASE(3, 1) DTILE_DIRECT_CASE(2, 1)
                default: dtile_direct(L, pn, 1, xb, kp, xs, 1, c);
            }
        } else { /* two tiles against the panel, the second finding it in the cache: c[0] and c[1] */
            const int64_t groups = grouped_panels(L) ? L->k / L->group : 0;
            switch (h) { DTILE_DIRECT_CASE(6, 1) default: dtile_direct(L, pn, 1, xb, kp, xs, 5, c); }
            const uint16_t *xb2 = xb + h * kp;
            const float *xs2 = xs ? xs + h * groups : NULL;
            switch (m - h) {
                case 6: dtile_direct(L, pn, 1, xb2, kp, xs2, 6, c + 1); break;
                case 5: dtile_direct(L, pn, 1, xb2, kp, xs2, 5, c + 1); break;
                default: dtile_direct(L, pn, 1, xb2, kp, xs2, 4, c + 1);
            }
        }
        const int done = np >= 4 ? 4 : np >= 2 ? 2 : 1;
        const int split = np == 1 && m > DIRECT_TILE_ROWS ? (int)h : DR; /* rows from split in c[1] */
        for (int q = 0; q < done; q++) {
            const int64_t n0 = (pn + q) * PW;
            const int nv = (int)(L->n - n0 < PW ? L->n - n0 : PW);
            for (int i = 0; i < (int)m; i++)
                store_out(L, out + i * ldo + n0, n0, i < split ? c[q][i] : c[1][i - split], nv, accumulate);
        }
        pn += done;
    }
}

/* Two halves of eight lanes as one of 16. */
DOT_TARGET static inline __m512 join8(__m256 lo, __m256 hi) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)), _mm256_castps_pd(hi), 1));
}

/* Int4 panel pn's whole groups for k [k0, k0 + k) as panel_pairs lays them, in one pass: each weight d * q + m
 * in fp32 (the product rounded, then the sum: q4_widen's values), rounded to bf16. */
DOT_TARGET static void q4_panel_pairs(const Linear *L, int64_t pn, int64_t k0, int64_t k, uint16_t *pbuf) {
    const int64_t groups = L->k / L->group, qp = pn * groups * 2 * PW;
    const uint8_t *p = (const uint8_t *)L->w + pn * (L->k * PW / 2);
    const __m512i pairs = pair_lanes(), nib = _mm512_set1_epi32(0x0f);
    for (int64_t g = k0 / L->group; g < (k0 + k) / L->group; g++) {
        const int64_t dm = qp + g * 2 * PW;
        const __m512 d = join8(load_qp(L, dm), load_qp(L, dm + 8)), mn = join8(load_qp(L, dm + PW), load_qp(L, dm + PW + 8));
        for (int64_t kk = g * L->group; kk < (g + 1) * L->group; kk += 2) {
            const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + kk / 2 * PW)));
            const __m512 lo = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(w, nib))), mn);
            const __m512 hi = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4))), mn);
            _mm512_storeu_si512(pbuf + (kk - k0) * PW, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
        }
    }
}

/* Rows [k0, k0 + kp) of panel pn re-laid as k pairs ([kp / 2][PW][2] bf16: channel c of pair j at j * 2PW + 2c,
 * the operand order of vdpbf16ps and of an AMX B tile), zero past k (k0 even): a bf16 panel as it is; an int8
 * one (weight-only, its scale applied to the sums) converted, exactly (|q| <= 128 has 8 significant bits); for
 * AMX tiles, a grouped (int4 or grouped int8) one widened to fp32 in wf ([kp][PW]; k0 and kp whole groups) and
 * rounded to bf16 (nearest even), an int4 one in one pass where kp holds no padding (q4_panel_pairs)
 * (vdpbf16ps takes a grouped panel's integers: grouped_pairs). */
DOT_TARGET static void panel_pairs(const Linear *L, int64_t pn, int64_t k0, int64_t kp, uint16_t *pbuf, float *wf) {
    const int64_t k = L->k - k0 < kp ? L->k - k0 : kp; /* rows laid */
    const __m512i pairs = pair_lanes(); /* [k even | k odd] x 16 channels -> channel-major pairs */
    int64_t j = 0;
    if (L->wtype == WTYPE_Q4 && k == kp) {
        q4_panel_pairs(L, pn, k0, k, pbuf); /* k0 and k whole groups */
        return;
    }
    if (grouped_panels(L)) {
        grouped_widen(L, pn, k0 / L->group, (k0 + k) / L->group, wf); /* k0 and k whole groups */
        for (; j < k / 2; j++) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(wf + (2 * j + 1) * PW), _mm512_loadu_ps(wf + 2 * j * PW));
            _mm512_storeu_si512(pbuf + j * 2 * PW, _mm512_permutexvar_epi16(pairs, (__m512i)v));
        }
    } else if (L->wtype == WTYPE_I8) {
        const int8_t *pq = (const int8_t *)L->w + (pn * L->k + k0) * PW;
        for (; 2 * j < k; j++) {
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pq + 2 * j * PW))));
            const __m512 hi = 2 * j + 1 < k /* an odd k pairs its last row with zeros */
                                  ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pq + (2 * j + 1) * PW))))
                                  : _mm512_setzero_ps();
            _mm512_storeu_si512(pbuf + j * 2 * PW, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
        }
    } else {
        const uint16_t *pb = (const uint16_t *)L->w + (pn * L->k + k0) * PW;
        for (; 2 * j < k; j++) {
            const __mmask32 rows = 2 * j + 1 < k ? 0xffffffffu : 0xffffu; /* an odd k pairs its last row with zeros */
            _mm512_storeu_si512(pbuf + j * 2 * PW, _mm512_permutexvar_epi16(pairs, _mm512_maskz_loadu_epi16(rows, pb + j * 2 * PW)));
        }
    }
    if (2 * j < kp) memset(pbuf + j * 2 * PW, 0, sizeof(uint16_t) * (size_t)(kp - 2 * j) * PW);
}

/* Up to this many rows read a bf16 panel as stored (row tiles of at most DIRECT_TILE_ROWS, the later ones
 * finding it in the cache); more re-lay NP_LAID panels at a time once for all their row tiles (dtile). */
#define DOT_STORED_ROWS (2 * DR)

/* Rows [m0, m1) (m1 - m0 > DOT_STORED_ROWS, or int8 panels) of xb (bf16, row stride kp) against bf16 or
 * int8 panels [p0, p1), NP_LAID at a time re-laid into pbuf (NP_LAID * PW * kp bf16), in tiles of MR_LAID
 * rows by those panels. */
DOT_TARGET static void laid_rows_dot(const Linear *L, const uint16_t *xb, int64_t kp, float *out, int64_t ldo,
                                     int64_t m0, int64_t m1, int64_t p0, int64_t p1, int accumulate, uint16_t *pbuf) {
    float c4[NP_LAID][DR][PW];
    const int64_t elt = L->wtype == WTYPE_BF16 ? 2 : 1, tiles = (m1 - m0 + MR_LAID - 1) / MR_LAID;
    for (int64_t pn = p0; pn < p1; pn += NP_LAID) {
        const int np = p1 - pn < NP_LAID ? (int)(p1 - pn) : NP_LAID;
        for (int q = 0; q < np; q++) panel_pairs(L, pn + q, 0, kp, pbuf + q * PW * kp, NULL);
        /* the next panels' stored bytes asked into the cache while these run, a share for each row tile,
         * so that re-laying them reads the cache, not memory */
        const int64_t next = p1 - pn - np < NP_LAID ? p1 - pn - np : NP_LAID;
        const char *pf0 = (const char *)L->w + (pn + np) * L->k * PW * elt;
        const int64_t total = next * L->k * PW * elt / 64, share = (total + tiles - 1) / tiles;
        for (int64_t m = m0, mr, t = 0; m < m1; m += mr, t++) {
            const int64_t left = m1 - m; /* six-row tiles; a short remainder shares the last 12 rows evenly */
            mr = left >= 2 * MR_LAID || left <= MR_LAID ? (left < MR_LAID ? left : MR_LAID) : (left + 1) / 2;
            const uint16_t *xr = xb + m * kp;
            const int64_t first = t * share;
            const int64_t pf_lines = first < total ? (total - first < share ? total - first : share) : 0;
            const char *pf = pf0 + 64 * first;
            const int64_t pf_step = (pf_lines + kp / 2 - 1) / (kp / 2);
            switch (np) {
                case 4: DTILE_ROWS(4) break;
                case 3: DTILE_ROWS(3) break;
                case 2: DTILE_ROWS(2) break;
                default: DTILE_ROWS(1)
            }
            for (int q = 0; q < np; q++) {
                const int64_t n0 = (pn + q) * PW;
                const int nv = (int)(L->n - n0 < PW ? L->n - n0 : PW);
                for (int i = 0; i < (int)mr; i++) store_out(L, out + (m + i) * ldo + n0, n0, c4[q][i], nv, accumulate);
            }
        }
    }
}

/* Rows [m0, m1) of xb (bf16, row stride kp; xs their group sums, grouped weights) against bf16, int8 or
 * grouped panels [p0, p1): up to DOT_STORED_ROWS rows against bf16 panels as stored, grouped panels one at a
 * time re-laid as their integers (see gtile) into pbuf, the rest by laid_rows_dot. */
DOT_TARGET static void packed_rows_dot(const Linear *L, const uint16_t *xb, int64_t kp, const float *xs, float *out,
                                       int64_t ldo, int64_t m0, int64_t m1, int64_t p0, int64_t p1, int accumulate,
                                       uint16_t *pbuf) {
    const int grouped = grouped_panels(L); /* as their integers, by group */
    if (!grouped && !(L->wtype == WTYPE_BF16 && m1 - m0 <= DOT_STORED_ROWS)) {
        laid_rows_dot(L, xb, kp, out, ldo, m0, m1, p0, p1, accumulate, pbuf);
        return;
    }
    float c[DR][PW];
    for (int64_t pn = p0; pn < p1; pn++) {
        const int64_t n0 = pn * PW;
        const int nv = (int)(L->n - n0 < PW ? L->n - n0 : PW);
        const uint16_t *pb = (const uint16_t *)L->w + pn * L->k * PW;
        if (grouped) grouped_pairs(L, pn, pbuf);
        for (int64_t m = m0, mr; m < m1; m += mr) {
            const int64_t left = m1 - m, most = grouped ? DR : DIRECT_TILE_ROWS; /* a short remainder shares the */
            mr = left >= 2 * most || left <= most ? (left < most ? left : most) : (left + 1) / 2; /* last tiles */
            const uint16_t *xr = xb + m * kp;
            if (grouped) {
                const float *xsr = xs + m * (L->k / L->group);
                switch (mr) {
                    GTILE_CASE(12) GTILE_CASE(11) GTILE_CASE(10) GTILE_CASE(9) GTILE_CASE(8) GTILE_CASE(7)
                    GTILE_CASE(6) GTILE_CASE(5) GTILE_CASE(4) GTILE_CASE(3) GTILE_CASE(2)
                    default: gtile(L, pn, 1, pbuf, xr, kp, xsr, 1, (float(*)[DR][PW])c);
                }
            } else {
                switch (mr) {
                    DTILE_STORED_CASE(8) DTILE_STORED_CASE(7) DTILE_STORED_CASE(6) DTILE_STORED_CASE(5)
                    DTILE_STORED_CASE(4) DTILE_STORED_CASE(3) DTILE_STORED_CASE(2) default: dtile_stored(xr, kp, pb, L->k, 1, c);
                }
            }
            for (int i = 0; i < (int)mr; i++) store_out(L, out + (m + i) * ldo + n0, n0, c[i], nv, accumulate);
        }
    }
}

/* ------------------------------------------- bf16 weights in AVX-512 FMAs */
/*
 * On Intel's AVX512-BF16 CPUs vdpbf16ps issues once every two cycles where zmm FMAs issue
 * twice a cycle: half the multiply-adds a cycle (a 2-vCPU Emerald Rapids: 92 against 187 GFLOP/s a core;
 * AMD's Zen 4 issues it as often as its FMAs, twice their multiply-adds). There a bf16-weight GEMM (and
 * an int8 per-channel one that keeps float rows: the q/k/v projection and LM head of int8_wo) runs in
 * fp32 FMAs over the rows as they come, fp32 (not rounded), each panel's k row widened in registers,
 * exactly: a masked vpermw puts 16 bf16 weights in the high halves of 16 fp32 lanes (int8: vpmovsxbd,
 * vcvtdq2ps). Every (row, channel) sums in one chain, k in order, whatever the tile it falls in (FR rows
 * by one panel; fewer rows by more panels, for chains enough to cover the FMA latency): a row's result
 * is the same bits whatever else the call holds, as on vdpbf16ps (on AMX CPUs, up to the row count the
 * tiles take from: AMX_MIN_ROWS). Rows are blocked so a block's fp32
 * rows stay in L2 while the panels pass over them; a panel comes from memory once a block, prefetched
 * ahead.
 */
#define FR 12 /* rows per fp32 tile: 12 zmm accumulators */

/* vpermw indices (with mask 0xaaaaaaaa) putting word c of 16 in the high half of dword c. */
AVX512_TARGET static inline __m512i bf16_high_lanes(void) {
    return _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0, 5, 0, 4, 0, 3, 0, 2,
                            0, 1, 0, 0, 0);
}

/* One k row of a panel (16 channels at p: bf16, or int8 where i8) widened to fp32, exactly: a masked vpermw
 * (lanes: bf16_high_lanes) puts each bf16 weight in the high half of its lane; int8 is sign-extended and
 * converted. */
AVX512_TARGET static inline __attribute__((always_inline)) __m512 widen16(const void *p, const int i8, __m512i lanes) {
    return i8 ? _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)))
              : _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(
                    0xaaaaaaaau, lanes, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p))));
}

/* mr rows (fp32, stride ldx) by np panels as stored from pb ([k][PW] each, panel stride pstride elements),
 * bf16 (i8 0: each k row widened in registers by a masked vpermw) or int8 (i8 1: sign-extended and
 * converted, exact): c[q][i] = sum_k x[i][k] * w_q[k], one fp32 FMA chain per row and channel, k in order
 * (an int8 panel's channel scale is applied on the way out). */
AVX512_TARGET static inline __attribute__((always_inline)) void ftile(const float *x, int64_t ldx, const void *pb,
                                                                      int64_t pstride, int64_t k, const int mr,
                                                                      const int np, const int i8,
                                                                      float c[][FR][PW]) {
    const __m512i lanes = bf16_high_lanes();
    const int64_t line = i8 ? 3 : 1; /* a cache line holds four int8 k rows, two bf16 ones */
    __m512 a[8][FR];
    for (int q = 0; q < np; q++)
        for (int i = 0; i < FR; i++) a[q][i] = _mm512_setzero_ps();
    for (int64_t j = 0; j < k; j++) {
        __m512 w[8];
        for (int q = 0; q < np; q++) {
            const char *pj = (const char *)pb + (q * pstride + j * PW) * (i8 ? 1 : 2);
            if (!(j & line)) _mm_prefetch(pj + DOT_PREFETCH, _MM_HINT_T0);
            w[q] = widen16(pj, i8, lanes);
        }
        for (int i = 0; i < FR; i++)
            if (i < mr) {
                const __m512 xi = _mm512_set1_ps(x[i * ldx + j]);
                for (int q = 0; q < np; q++) a[q][i] = _mm512_fmadd_ps(xi, w[q], a[q][i]);
            }
    }
    for (int q = 0; q < np; q++)
        for (int i = 0; i < mr; i++) _mm512_storeu_ps(c[q][i], a[q][i]);
}

#define FTILE_CASE(R, NP) case R: ftile(xr, ldx, pb, pstride, k, R, NP, I8, c); break;

/* Rows [0, m) of x (fp32, stride ldx) against bf16 or int8 panels [p0, p1), in blocks of rows that stay in L2
 * while the panels pass over them: FR-row tiles by one panel (a short remainder shares the last 2 FR rows
 * evenly); a call of up to six rows takes its rows by two panels at a time, up to three by four, one by
 * eight (chains enough to cover the FMA latency). */
AVX512_TARGET static inline __attribute__((always_inline)) void rows_fma(const Linear *L, const float *x, int64_t ldx,
                                                                         float *out, int64_t ldo, int64_t m,
                                                                         int64_t p0, int64_t p1, int accumulate,
                                                                         const int I8) {
    float c[8][FR][PW];
    const int64_t k = L->k, pstride = k * PW;
    int64_t mc = (1024 * 1024 / 4) / (k > 0 ? k : 1); /* a MiB of fp32 rows */
    mc = mc < 2 * FR ? 2 * FR : (mc / FR) * FR;
    const int most = m <= 1 ? 8 : m <= 3 ? 4 : m <= 6 ? 2 : 1;
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        for (int64_t pn = p0; pn < p1;) {
            const int np = p1 - pn >= most ? most : p1 - pn >= 4 && most >= 4 ? 4 : p1 - pn >= 2 && most >= 2 ? 2 : 1;
            const char *pb = (const char *)L->w + pn * pstride * (I8 ? 1 : 2);
            for (int64_t r = m0, mr; r < m1; r += mr) {
                const int64_t left = m1 - r;
                mr = left >= 2 * FR || left <= FR ? (left < FR ? left : FR) : (left + 1) / 2;
                const float *xr = x + r * ldx;
                if (np == 8) {
                    ftile(xr, ldx, pb, pstride, k, 1, 8, I8, c);
                } else if (np == 4) {
                    switch (mr) { FTILE_CASE(3, 4) FTILE_CASE(2, 4) default: ftile(xr, ldx, pb, pstride, k, 1, 4, I8, c); }
                } else if (np == 2) {
                    switch (mr) {
                        FTILE_CASE(6, 2) FTILE_CASE(5, 2) FTILE_CASE(4, 2) FTILE_CASE(3, 2) FTILE_CASE(2, 2)
                        default: ftile(xr, ldx, pb, pstride, k, 1, 2, I8, c);
                    }
                } else {
                    switch (mr) {
                        FTILE_CASE(12, 1) FTILE_CASE(11, 1) FTILE_CASE(10, 1) FTILE_CASE(9, 1) FTILE_CASE(8, 1)
                        FTILE_CASE(7, 1) FTILE_CASE(6, 1) FTILE_CASE(5, 1) FTILE_CASE(4, 1) FTILE_CASE(3, 1)
                        FTILE_CASE(2, 1) default: ftile(xr, ldx, pb, pstride, k, 1, 1, I8, c);
                    }
                }
                for (int q = 0; q < np; q++) {
                    const int64_t n0 = (pn + q) * PW;
                    const int nv = (int)(L->n - n0 < PW ? L->n - n0 : PW);
                    for (int i = 0; i < (int)mr; i++) store_out(L, out + (r + i) * ldo + n0, n0, c[q][i], nv, accumulate);
                }
            }
            pn += np;
        }
    }
}

#define FKC 256 /* k a widened chunk holds: two panels' in 32 KiB of fp32 */
#define FMA_CHUNK_ROWS 96 /* from this many rows a GEMM widens chunks of its panels (rows_fma_chunked) */

/* Rows k0 .. k0 + kc - 1 of panels pn and pn + 1 (a zero panel past p1) widened to fp32 in wf ([2][kc][PW]),
 * exactly: the same values the tiles above widen in registers. */
AVX512_TARGET static void chunk_widen(const Linear *L, int64_t pn, int64_t p1, int64_t k0, int64_t kc, float *wf) {
    const __m512i lanes = bf16_high_lanes();
    for (int q = 0; q < 2; q++) {
        float *o = wf + q * kc * PW;
        if (pn + q >= p1) {
            memset(o, 0, sizeof(float) * (size_t)(kc * PW));
            continue;
        }
        const int i8 = L->wtype == WTYPE_I8;
        const char *pb = (const char *)L->w + ((pn + q) * L->k + k0) * PW * (i8 ? 1 : 2);
        for (int64_t j = 0; j < kc; j++) _mm512_storeu_ps(o + j * PW, widen16(pb + j * PW * (i8 ? 1 : 2), i8, lanes));
    }
}

/* mr rows (fp32, stride ldx, from k0) by two widened panels' chunk (wf, kc k): each row and channel's chain
 * goes on from its sums in acc ([6][2][PW]; zeros where first), k in order, and back to acc. */
AVX512_TARGET static inline __attribute__((always_inline)) void wtile(const float *x, int64_t ldx, const float *wf,
                                                                      int64_t kc, const int mr, float *acc,
                                                                      int first) {
    __m512 a[2][6];
    for (int i = 0; i < 6; i++)
        for (int q = 0; q < 2; q++)
            if (i < mr) a[q][i] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc + (i * 2 + q) * PW);
    for (int64_t j = 0; j < kc; j++) {
        const __m512 w0 = _mm512_loadu_ps(wf + j * PW), w1 = _mm512_loadu_ps(wf + (kc + j) * PW);
        for (int i = 0; i < 6; i++)
            if (i < mr) {
                const __m512 xi = _mm512_set1_ps(x[i * ldx + j]);
                a[0][i] = _mm512_fmadd_ps(xi, w0, a[0][i]);
                a[1][i] = _mm512_fmadd_ps(xi, w1, a[1][i]);
            }
    }
    for (int i = 0; i < 6; i++)
        for (int q = 0; q < 2; q++)
            if (i < mr) _mm512_storeu_ps(acc + (i * 2 + q) * PW, a[q][i]);
}

#define WTILE_CASE(R) case R: wtile(xr, ldx, wf, kc, R, ar, k0 == 0); break;

/* FMA_CHUNK_ROWS rows or more: in blocks of rows, two panels at a time, FKC k at a time widened once into
 * wf (in L1) for every six-row tile of the block, each tile's sums carried in acc ([block rows][2][PW])
 * from chunk to chunk: the chains of ftile, the same bits; the tiles read no weight from L2 and convert
 * none (1.1-1.2x the stored panels' tiles at 512 rows of a 1B model's projections). */
AVX512_TARGET static void rows_fma_chunked(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo,
                                           int64_t m, int64_t p0, int64_t p1, int accumulate, float *wf, float *acc,
                                           int64_t mc) {
    const int64_t k = L->k;
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        for (int64_t pn = p0; pn < p1; pn += 2) {
            for (int64_t k0 = 0; k0 < k; k0 += FKC) {
                const int64_t kc = k - k0 < FKC ? k - k0 : FKC;
                chunk_widen(L, pn, p1, k0, kc, wf);
                for (int64_t r = m0; r < m1; r += 6) {
                    const int mr = m1 - r < 6 ? (int)(m1 - r) : 6;
                    const float *xr = x + r * ldx + k0;
                    float *ar = acc + (r - m0) * 2 * PW;
                    switch (mr) {
                        WTILE_CASE(6) WTILE_CASE(5) WTILE_CASE(4) WTILE_CASE(3) WTILE_CASE(2)
                        default: wtile(xr, ldx, wf, kc, 1, ar, k0 == 0);
                    }
                }
            }
            for (int q = 0; q < 2 && pn + q < p1; q++) {
                const int64_t n0 = (pn + q) * PW;
                const int nv = (int)(L->n - n0 < PW ? L->n - n0 : PW);
                for (int64_t r = m0; r < m1; r++)
                    store_out(L, out + r * ldo + n0, n0, acc + ((r - m0) * 2 + q) * PW, nv, accumulate);
            }
        }
    }
}

/* Rows per block of rows_fma_chunked: 2 MiB of fp32 rows (read once per two panels, a six-row tile at a
 * time), a multiple of six. */
static inline int64_t fma_block_rows(int64_t k) {
    const int64_t mc = (2 * 1024 * 1024 / 4) / (k > 0 ? k : 1);
    return mc < 6 ? 6 : (mc / 6) * 6;
}

AVX512_TARGET static void packed_rows_fma(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo,
                                          int64_t m, int64_t p0, int64_t p1, int accumulate) {
    if (L->wtype == WTYPE_I8) rows_fma(L, x, ldx, out, ldo, m, p0, p1, accumulate, 1);
    else rows_fma(L, x, ldx, out, ldo, m, p0, p1, accumulate, 0);
}

/* ------------------------------------------------------------- AMX tiles */
/*
 * Where the CPU has AMX (Sapphire Rapids and later), GEMMs of at least AMX_MIN_ROWS rows run on its tile
 * registers, eight of 16 rows by 64 bytes. One tdpbf16ps multiplies 16 rows by 32 k in bf16 (a row tile)
 * into 16 by 16 fp32 sums against a weight tile of 16 k pairs by 16 channels, laid out as panel_pairs
 * lays a panel (the vdpbf16ps operand order): 512 times one vdpbf16ps' work. One tdpbssd does the same
 * for 64 k of int8 rows and a W8A8 panel's 16 quads as they are stored, summing in int32. A block is 32
 * rows by two panels: sums in tiles 0-3, rows in 4 and 5, weights in 6 and 7. The rows are padded with
 * zero rows to a multiple of 16 and with zero columns to the tiles' k (32 bf16, 64 int8); bf16 weights
 * with zero pairs (panel_pairs), int8 ones through a zero-padded copy of the last quads, so the padding
 * adds exact zeros. Sums: fp32 from products of the rounded rows (the vdpbf16ps path's, up to summation
 * order; on only where it is, see appl_bf16_dot), exact int32 (the same bits as every W8A8 path).
 * Linux hands out the tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM, asked once at load); each
 * thread loads the tile configuration for a call and releases it after.
 */
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512bf16")))
/* From how many rows the tiles run: bf16 and int8 per-channel panels from 7 (below, the FMAs reach memory's
 * bandwidth; from 7 they fall to 19-25 GB/s of bf16 weights at 1B shapes on a 2-vCPU AMX Xeon, the tiles keep
 * 28-31), grouped ones from 24 (each widened and rounded per call; below, int8 rows on VNNI are faster), W8A8
 * from 16. */
#define AMX_MIN_ROWS 7
#define AMX_MIN_ROWS_GROUPED 24
#define AMX_INT8_MIN_ROWS 16

static int g_has_amx_bf16, g_has_amx_int8, g_amx;

/* Whether a GEMM of m rows against L's panels runs on AMX-BF16 tiles (on only with vdpbf16ps, whose
 * rounding of the rows the tiles share). */
static int amx_bf16_takes(const Linear *L, int64_t m) {
    const int grouped = grouped_panels(L);
    return g_amx && g_has_amx_bf16 && g_bf16_dot && (grouped || L->wtype == WTYPE_BF16 || L->wtype == WTYPE_I8) &&
           m >= (grouped ? AMX_MIN_ROWS_GROUPED : AMX_MIN_ROWS);
}

/* AMX-TILE (CPUID 7.0 EDX bit 24) with AMX-BF16 (bit 22) and/or AMX-INT8 (bit 25), the OS saving the tile
 * state (XCR0 bits 17 and 18), and Linux granting this process the tile data. */
static void __attribute__((constructor(102))) probe_amx(void) {
    unsigned a, b, c, d;
    if (cpu_avx512_level() < 2 || !__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24))) return;
    unsigned xlo, xhi;
    __asm__ volatile("xgetbv" : "=a"(xlo), "=d"(xhi) : "c"(0));
    if ((xlo & (3u << 17)) != (3u << 17)) return;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return;
    g_has_amx_bf16 = (d >> 22) & 1;
    g_has_amx_int8 = (d >> 25) & 1;
    g_amx = g_has_amx_bf16 || g_has_amx_int8;
    /* the prefill attention tiles on bf16 products by default where they run on AMX tiles (2.5x the fp32
     * tiles on a 2-vCPU AMX Xeon, 1B shapes) */
    if (g_has_amx_bf16) g_bf16_att = g_has_bf16_att;
}

/* The row count from which AMX tiles take a GEMM: W8A8 (int8), or AMX-BF16 over grouped or other panels. */
int appl_amx_min_rows(int int8, int grouped) {
    return int8 ? AMX_INT8_MIN_ROWS : grouped ? AMX_MIN_ROWS_GROUPED : AMX_MIN_ROWS;
}

/* The AMX paths: set < 0 asks, 0 turns them off, 1 on (where the CPU has them). Returns the state. */
int appl_amx(int set) {
    if (set >= 0) g_amx = set && (g_has_amx_bf16 || g_has_amx_int8);
    return g_amx;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} TileConfig;

/* Every tile 16 rows by 64 bytes (palette 1). */
AMX_TARGET static void amx_begin(void) {
    TileConfig t;
    memset(&t, 0, sizeof(t));
    t.palette = 1;
    for (int i = 0; i < 8; i++) {
        t.rows[i] = 16;
        t.colsb[i] = 64;
    }
    /* gcc's _tile_loadconfig names only a pointer's worth of the configuration as its operand, so the stores
     * filling the rest could be dropped as dead: the whole struct is the operand here */
    __asm__ volatile("ldtilecfg %0" ::"m"(t));
}

AMX_TARGET static void amx_end(void) { _tile_release(); }

/* 16 nr rows (nr 1 or 2; row stride lda bytes) by np panels (1 or 2): nblocks k-blocks, block j's rows at
 * xa + ajs j (the second 16 rows a2 bytes on; row-major rows: ajs 64, a2 16 lda; rows in tiles: ajs 1024, lda
 * 64) and its weight tiles (16 rows of 64 bytes) at w0 + 1024 j and w1 + 1024 j, except the last block's at
 * t0, t1 where given; the sums (fp32 or int32) into c, rows ldc bytes apart, added to the sums c holds where
 * load is set (stored and loaded whole, so a sum split over calls is the same bits). */
#define DEFINE_AMX_BLOCK(NAME, DP)                                                                          \
    AMX_TARGET static void NAME(const char *xa, int64_t lda, const char *w0, const char *w1, int64_t nblocks,  \
                                const char *t0, const char *t1, const int nr, const int np, void *c,        \
                                int64_t ldc, int load, int64_t ajs, int64_t a2) {                          \
        __asm__ volatile("" ::: "memory"); /* the tile loads read what C code wrote: no asm says so */     \
        char *cc = (char *)c; /* rows of four-byte sums, ldc bytes apart */                                 \
        if (load) {                                                                                        \
            _tile_loadd(0, cc, ldc);                                                                       \
            if (np > 1) _tile_loadd(1, cc + 64, ldc);                                                      \
            if (nr > 1) {                                                                                  \
                _tile_loadd(2, cc + 16 * ldc, ldc);                                                        \
                if (np > 1) _tile_loadd(3, cc + 16 * ldc + 64, ldc);                                       \
            }                                                                                              \
        } else {                                                                                           \
            _tile_zero(0);                                                                                 \
            _tile_zero(1);                                                                                 \
            _tile_zero(2);                                                                                 \
            _tile_zero(3);                                                                                 \
        }                                                                                                  \
        for (int64_t j = 0; j < nblocks; j++) {                                                            \
            const int last = j == nblocks - 1;                                                             \
            const char *b0 = last && t0 ? t0 : w0 + 1024 * j, *b1 = last && t1 ? t1 : w1 + 1024 * j;       \
            _tile_loadd(4, xa + ajs * j, lda);                                                             \
            _tile_loadd(6, b0, 64);                                                                        \
            DP(0, 4, 6);                                                                                   \
            if (np > 1) {                                                                                  \
                _tile_loadd(7, b1, 64);                                                                    \
                DP(1, 4, 7);                                                                               \
            }                                                                                              \
            if (nr > 1) {                                                                                  \
                _tile_loadd(5, xa + a2 + ajs * j, lda);                                                    \
                DP(2, 5, 6);                                                                               \
                if (np > 1) DP(3, 5, 7);                                                                   \
            }                                                                                              \
        }                                                                                                  \
        _tile_stored(0, cc, ldc);                                                                          \
        if (np > 1) _tile_stored(1, cc + 64, ldc);                                                         \
        if (nr > 1) {                                                                                      \
            _tile_stored(2, cc + 16 * ldc, ldc);                                                           \
            if (np > 1) _tile_stored(3, cc + 16 * ldc + 64, ldc);                                          \
        }                                                                                                  \
        __asm__ volatile("" ::: "memory"); /* and C code reads what the tile stores wrote */               \
    }

DEFINE_AMX_BLOCK(amx_block_bf16, _tile_dpbf16ps)
DEFINE_AMX_BLOCK(amx_block_int8, _tile_dpbssd)

/* Blocking of blocked_rows_amx (one thread's share): chunks of about AMX_KC k, so a panel pair's chunk (32 KiB
 * of bf16 pairs) stays in L1 while every 32-row block of the rows passes over it; as many rows a block as
 * AMX_A_BYTES of the rows' chunk holds; as many panel pairs a group as AMX_C_BYTES of fp32 sums (the block's
 * rows by the group's channels) holds. The rows' chunk and the group's sums share the L2, the weights come
 * from memory once a block of rows. */
#define AMX_KC 512
#define AMX_A_BYTES (512 * 1024)
#define AMX_C_BYTES (768 * 1024)
/* From how many bytes an output goes to memory in non-temporal stores (an output this large leaves the caches
 * before the next step reads it; a store that misses first reads the line). */
#define AMX_STREAM_BYTES (16 * 1024 * 1024)

/* The k a chunk is made of: a multiple of both the tiles' 32 and, grouped, the group. */
static inline int64_t amx_unit(const Linear *L) {
    const int grouped = grouped_panels(L);
    const int64_t g = grouped ? L->group : 32;
    return g % 32 == 0 ? g : 32 % g == 0 ? 32 : 32 * g;
}

/* k a chunk: kx split into about kx / AMX_KC chunks of whole units (amx_unit), all but the last the same size. */
static inline int64_t amx_chunk(const Linear *L, int64_t kx) {
    const int64_t unit = amx_unit(L);
    const int64_t chunks = (kx + AMX_KC / 2) / AMX_KC;
    if (chunks <= 1) return kx;
    const int64_t kc = ((kx + chunks - 1) / chunks + unit - 1) / unit * unit;
    return kc < kx ? kc : kx;
}

/* Rows [0, m) of xb (bf16 in row tiles, row_to_bf16_tiles; k padded to kx, a multiple of 32; zero rows up to a
 * multiple of 16 past m) against bf16, int8 per-channel or grouped panels [p0, p1), blocked in chunks of kc
 * (amx_chunk; see AMX_KC): pbuf takes a panel pair's chunk (2 PW kc halves), cs the sums of a group
 * (AMX_C_BYTES), wf a grouped panel's chunk widened (PW kc floats). A sum runs k in order through the chunks,
 * stored and loaded whole between them: the same bits as unblocked tiles. */
AMX_TARGET static void blocked_rows_amx(const Linear *L, const uint16_t *xb, int64_t kx, int64_t kc, float *out,
                                        int64_t ldo, int64_t m, int64_t p0, int64_t p1, int accumulate, int stream,
                                        uint16_t *pbuf, float *cs, float *wf) {
    /* rows a block: at most AMX_A_BYTES of a chunk and a pair's sums in cs, the blocks the same size in tiles */
    int64_t mc = AMX_A_BYTES / (2 * kc);
    if (mc > AMX_C_BYTES / (int64_t)(sizeof(float) * 2 * PW)) mc = AMX_C_BYTES / (sizeof(float) * 2 * PW);
    mc = mc < 32 ? 32 : (mc / 32) * 32;
    const int64_t blocks = (m + mc - 1) / mc;
    mc = ((m + blocks - 1) / blocks + 31) / 32 * 32;
    int64_t group = AMX_C_BYTES / (sizeof(float) * mc * 2 * PW) * 2; /* panels a group, even */
    group = group < 2 ? 2 : group;
    for (int64_t m0 = 0; m0 < m; m0 += mc) {
        const int64_t m1 = m0 + mc < m ? m0 + mc : m;
        for (int64_t g0 = p0; g0 < p1; g0 += group) {
            const int64_t g1 = g0 + group < p1 ? g0 + group : p1, ldc = (g1 - g0) * PW; /* floats */
            for (int64_t k0 = 0; k0 < kx; k0 += kc) {
                const int64_t kl = kx - k0 < kc ? kx - k0 : kc;
                for (int64_t pn = g0; pn < g1; pn += 2) {
                    const int np = g1 - pn < 2 ? 1 : 2;
                    for (int q = 0; q < np; q++) panel_pairs(L, pn + q, k0, kl, pbuf + q * PW * kl, wf);
                    float *cp = cs + (pn - g0) * PW;
                    for (int64_t r = m0; r < m1; r += 32)
                        amx_block_bf16((const char *)(xb + (r / 16 * (kx / 32) + k0 / 32) * 512), 64, (const char *)pbuf,
                                       (const char *)(pbuf + PW * kl), kl / 32, NULL, NULL, m1 - r > 16 ? 2 : 1, np,
                                       cp + (r - m0) * ldc, sizeof(float) * ldc, k0 > 0, 1024, kx * 32);
                }
            }
            const int64_t n0 = g0 * PW, nv = (L->n < g1 * PW ? L->n : g1 * PW) - n0;
            if (stream && nv == ldc) /* past the caches: straight to memory, not read first */
                for (int64_t r = m0; r < m1; r++)
                    for (int64_t j = 0; j < nv; j += 16)
                        _mm512_stream_ps(out + r * ldo + n0 + j, _mm512_load_ps(cs + (r - m0) * ldc + j));
            else
                for (int64_t r = m0; r < m1; r++)
                    store_out(L, out + r * ldo + n0, n0, cs + (r - m0) * ldc, (int)nv, accumulate);
        }
    }
}

/* Up to 32 rows, or as many as AMX_FEW_BYTES of bf16 rows hold (kept in L2 with a panel pair's whole k while
 * every pair passes), run few_rows_amx, more blocked_rows_amx; few_rows_amx asks for a panel's units of k
 * AMX_AHEAD_UNITS units before the tiles take them (1.1x at 32 rows, 1B shapes, 2-vCPU AMX Xeon). */
#define AMX_FEW_BYTES (1024 * 1024)
#define AMX_AHEAD_UNITS 4
static inline int amx_few_rows(int64_t m, int64_t kx) { return m <= 32 || m * kx * 2 <= AMX_FEW_BYTES; }
/* k of a panel pair few_rows_amx keeps re-laid at once: two units up to 32 rows (the one the tiles read and
 * the next), past 32 the whole k (the next 32 rows take it from there). */
static inline int few_rows_whole_k(int64_t m) { return m > 32; }
static inline int64_t few_rows_laid_k(const Linear *L, int64_t m, int64_t kx) {
    return few_rows_whole_k(m) ? kx : 2 * amx_unit(L);
}

/* Where bf16, int8 or grouped panel pn's stored weights for k [k0, k0 + kl) start, and (bytes) how many bytes
 * they take (none past k). */
static inline const char *panel_span(const Linear *L, int64_t pn, int64_t k0, int64_t kl, int64_t *bytes) {
    const int64_t k = L->k, k1 = k0 + kl < k ? k0 + kl : k;
    const int64_t num = L->wtype == WTYPE_Q4 ? 1 : L->wtype == WTYPE_BF16 ? 4 : 2; /* half-bytes a weight */
    *bytes = k1 > k0 ? (k1 - k0) * PW * num / 2 : 0;
    return (const char *)L->w + (pn * k + k0) * PW * num / 2;
}

/* n32 blocks of 32 k into tiles 0-3: up to 32 rows (nr row tiles, the second rt bytes after the first; block j
 * of a row tile at a + 1024 j) by np panels (block j at w0 + 1024 j, w1 + 1024 j); tiles 0 and 1 the first 16
 * rows by the two panels, 2 and 3 the next 16. */
AMX_TARGET static inline __attribute__((always_inline)) void pair_tiles(const char *a, int64_t rt, const char *w0,
                                                                       const char *w1, int64_t n32, int np, int nr) {
    for (int64_t j = 0; j < n32; j++) {
        _tile_loadd(4, a + 1024 * j, 64);
        _tile_loadd(6, w0 + 1024 * j, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (np > 1) {
            _tile_loadd(7, w1 + 1024 * j, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (nr > 1) {
            _tile_loadd(5, a + rt + 1024 * j, 64);
            _tile_dpbf16ps(2, 5, 6);
            if (np > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
}

/* Tiles 0-3 (pair_tiles' sums) into c, rows of 2 PW floats. */
AMX_TARGET static inline void pair_sums(float *c) {
    _tile_stored(0, c, sizeof(float) * 2 * PW);
    _tile_stored(1, c + PW, sizeof(float) * 2 * PW);
    _tile_stored(2, c + 32 * PW, sizeof(float) * 2 * PW);
    _tile_stored(3, c + 32 * PW + PW, sizeof(float) * 2 * PW);
}

/* Rows [0, m) of xb (as blocked_rows_amx takes them; amx_few_rows) against panels [p0, p1), two at a time, 32
 * rows at a time, their sums kept in the tiles through the whole k. Each unit of k (amx_unit) of the pair is
 * re-laid into sbuf just before the first 32 rows' tiles take it, asked for from memory AMX_AHEAD_UNITS units
 * before that, so the weights stream in while the tiles run, not in turns with them: up to 32 rows sbuf holds
 * two units (the one the tiles read and the next); past 32 it holds the pair's whole k, which the next 32 rows
 * take from there once the first 32 are done, and so on. The sums run k in order: the same bits as
 * blocked_rows_amx. */
AMX_TARGET static void few_rows_amx(const Linear *L, const uint16_t *xb, int64_t kx, float *out, int64_t ldo,
                                    int64_t m, int64_t p0, int64_t p1, int accumulate, uint16_t *sbuf, float *wf) {
    float c[32 * 2 * PW];
    const int64_t unit = amx_unit(L), rt = kx / 32 * 1024; /* rt: bytes of a row tile's k */
    const int whole = few_rows_whole_k(m);
    for (int64_t pn = p0; pn < p1; pn += 2) {
        const int np = p1 - pn < 2 ? 1 : 2;
        const int64_t n0 = pn * PW, nv = (L->n < (pn + np) * PW ? L->n : (pn + np) * PW) - n0;
        for (int64_t r0 = 0; r0 < m; r0 += 32) {
            const char *a = (const char *)xb + r0 / 16 * rt;
            const int nr = m - r0 > 16 ? 2 : 1;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int64_t k0 = 0, u = 0; k0 < kx; k0 += unit, u++) {
                const int64_t kl = kx - k0 < unit ? kx - k0 : unit;
                uint16_t *b = sbuf + (whole ? k0 : (u & 1) * unit) * 2 * PW;
                if (r0 == 0) {
                    for (int q = 0; q < np; q++) {
                        int64_t bytes;
                        const char *ahead = panel_span(L, pn + q, k0 + AMX_AHEAD_UNITS * unit, unit, &bytes);
                        for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(ahead + i, _MM_HINT_T0);
                        panel_pairs(L, pn + q, k0, kl, b + q * PW * kl, wf);
                    }
                    __asm__ volatile("" ::: "memory"); /* the tile loads read what C code wrote */
                }
                pair_tiles(a + k0 / 32 * 1024, rt, (const char *)b, (const char *)(b + PW * kl), kl / 32, np, nr);
            }
            pair_sums(c);
            __asm__ volatile("" ::: "memory"); /* and C code reads what the tile stores wrote */
            const int64_t r1 = r0 + 32 < m ? r0 + 32 : m;
            for (int64_t r = r0; r < r1; r++)
                store_out(L, out + r * ldo + n0, n0, c + (r - r0) * 2 * PW, (int)nv, accumulate);
        }
    }
}

/* A GEMM of m rows on AMX-BF16 tiles (amx_bf16_takes): the rows rounded to bf16 into row tiles (k padded to 32,
 * zero rows up to a multiple of 16), each thread's panels against rows that fit L2 (amx_few_rows) with the sums
 * kept in the tiles through the whole k (few_rows_amx), against more blocked (blocked_rows_amx). */
static void amx_linear(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                       int accumulate) {
    const int64_t kx = (L->k + 31) & ~(int64_t)31, mx = (m + 15) & ~(int64_t)15;
    const int64_t panels = (L->n + PW - 1) / PW;
    /* a blocked GEMM's output of AMX_STREAM_BYTES or more, written as it is (no scale, bias or sum to add),
     * aligned: in non-temporal stores */
    const int stream = !amx_few_rows(m, kx) && !accumulate && !L->scale && !L->bias && m * L->n * (int64_t)sizeof(float) >= AMX_STREAM_BYTES &&
                       ((uintptr_t)out & 63) == 0 && (ldo & 15) == 0;
    uint16_t *xb = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * (size_t)(mx * kx));
    if (!xb) abort();
    if (mx > m) memset(xb + (m / 16) * 16 * kx, 0, sizeof(uint16_t) * (size_t)(16 * kx)); /* the last tile's */
#pragma omp parallel
    {
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++) row_to_bf16_tiles(x + r * ldx, xb + (r / 16 * (kx / 32)) * 512 + r % 16 * 32, L->k, kx);
        int64_t p0, p1;
        thread_panels(panels, &p0, &p1);
        if (p0 < p1) {
            const int few = amx_few_rows(m, kx), grouped = grouped_panels(L);
            /* k re-laid at once: two units, or past 32 few rows the whole k (few_rows_amx), or a chunk */
            const int64_t kc = few ? 0 : amx_chunk(L, kx), kb = few ? few_rows_laid_k(L, m, kx) : kc;
            uint16_t *pbuf = (uint16_t *)aligned_alloc(64, sizeof(uint16_t) * 2 * PW * kb);
            float *cs = few ? NULL : (float *)aligned_alloc(64, AMX_C_BYTES);
            float *wf = grouped ? (float *)aligned_alloc(64, sizeof(float) * PW * (few ? amx_unit(L) : kc)) : NULL;
            if (!pbuf || (!few && !cs) || (grouped && !wf)) abort();
            amx_begin();
            if (few) few_rows_amx(L, xb, kx, out, ldo, m, p0, p1, accumulate, pbuf, wf);
            else blocked_rows_amx(L, xb, kx, kc, out, ldo, m, p0, p1, accumulate, stream, pbuf, cs, wf);
            amx_end();
            if (stream) _mm_sfence(); /* the non-temporal stores seen by every thread after the call */
            free(pbuf);
            free(cs);
            free(wf);
        }
    }
    free(xb);
}

/* ------------------------------------------------- W8A8 int8 (AVX512-VNNI) */
/*
 * quantization=w8a8_int8: int8 weights with one fp32 scale per output channel
 * and the rows quantized per call, one symmetric scale per row (dynamic, per
 * token): amax = max |x|, q = rint(x * (127 / amax)) in -127..127, s = amax /
 * 127 (a zero row: q = 0, s = 0). The products sum exactly in int32 and
 * out = ((float)sum * s) * scale[n] + bias, so every path gives the same bits
 * at every batch size (a row's scale depends on that row alone). Panels hold
 * 16 channels as k quads ([kq / 4][16][4] bytes, kq = k rounded up to 4, the
 * tail zero), the operand order of vpdpbusd: one instruction sums 16 channels
 * by four k, unsigned by signed bytes into int32, so the rows enter as q + 128
 * and each channel's 128 * sum_k w (qparams: int32, one per channel of every
 * panel) is subtracted. Where the CPU lacks AVX512-VNNI, AVX2 sums the same
 * products with vpmaddwd (signed 16-bit pairs). A GEMV reads a quarter of the
 * fp32 bytes; a GEMM multiplies 64 pairs per instruction (vpdpbusd) against
 * the fp32 tiles' 8 (vfmadd ymm).
 */
#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define A8_ROWS 6 /* rows per VNNI tile (by four panels: 24 zmm accumulators) */

static int g_has_vnni, g_vnni, g_int8_rows;

/* acc + vpdpbusd(a unsigned bytes, b signed bytes): _mm512_dpbusd_epi32 as one instruction on the accumulator's
 * register. GCC 12 copies the intrinsic's accumulators to other registers and back on every pass of a tile's
 * loop (24 moves beside 12 vpdpbusd in the 6-by-2 int8 rows tile), which held the tiles to about 60% of the
 * instruction's rate on Zen 4. */
VNNI_TARGET static inline __attribute__((always_inline)) __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* The vpdpbusd path: set < 0 asks, 0 turns it off, 1 on (where the CPU has it). Returns the state. */
int appl_vnni(int set) {
    if (set >= 0) g_vnni = set && g_has_vnni;
    return g_vnni;
}

/* AVX512-VNNI (CPUID 7.0 ECX bit 11) on top of AVX512F/BW with the OS saving the zmm state. */
static void __attribute__((constructor)) probe_vnni(void) {
    unsigned a, b, c, d;
    g_has_vnni = g_vnni = g_int8_rows =
        cpu_avx512_level() >= 1 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (c & (1u << 11));
}

/* Rows [0, m) of x quantized into q ([m][kq], the tail past k zero) with their scales s; offset: store q + 128
 * (as unsigned bytes, for vpdpbusd) rather than q. */
static void a8_quantize(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kq, int8_t *q, float *s,
                        int offset) {
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7), flip = _mm256_set1_epi8((char)(offset ? 0x80 : 0));
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        int8_t *qr = q + r * kq;
        __m256 mx = _mm256_setzero_ps();
        int64_t i = 0;
        for (; i + 8 <= k; i += 8) mx = _mm256_max_ps(mx, _mm256_and_ps(_mm256_loadu_ps(xr + i), absmask));
        float amax = hmax8(mx);
        for (; i < k; i++) amax = fmaxf(amax, fabsf(xr[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        s[r] = amax / 127.0f;
        const __m256 vi = _mm256_set1_ps(inv);
        for (i = 0; i + 32 <= k; i += 32) { /* 32 floats -> 32 bytes: packs interleave the 128-bit lanes, the permute restores the order */
            const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vi));
            const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 8), vi));
            const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 16), vi));
            const __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xr + i + 24), vi));
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
            _mm256_storeu_si256((__m256i *)(qr + i), _mm256_xor_si256(_mm256_permutevar8x32_epi32(bytes, order), flip));
        }
        for (; i < k; i++) qr[i] = (int8_t)((int)lrintf(xr[i] * inv) ^ (offset ? 0x80 : 0));
        for (; i < kq; i++) qr[i] = (int8_t)(offset ? 0x80 : 0);
    }
}

/* R rows (q + 128, row stride kq) by NP VNNI panels from p: int32 sums minus 128 * the channels' weight sums. */
VNNI_TARGET static inline __attribute__((always_inline)) void a8_tile_vnni(const int8_t *xq, int64_t kq,
                                                                          const int8_t *p, const int32_t *wsum,
                                                                          const int R, const int NP,
                                                                          int32_t c[A8_ROWS][4 * PW]) {
    const int64_t pstride = kq * PW;
    __m512i a[A8_ROWS][4];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++) a[r][q] = _mm512_setzero_si512();
    const char *next = (const char *)(p + NP * pstride); /* the next panels follow these */
    for (int64_t j = 0; j < kq / 4; j++) {
        __m512i w[4];
        for (int q = 0; q < NP; q++) {
            _mm_prefetch(next + q * pstride + j * 4 * PW, _MM_HINT_T0);
            w[q] = _mm512_loadu_si512(p + q * pstride + j * 4 * PW);
        }
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, xq + r * kq + 4 * j, sizeof(quad));
            const __m512i xb = _mm512_set1_epi32(quad);
            for (int q = 0; q < NP; q++) a[r][q] = dpbusd(a[r][q], xb, w[q]);
        }
    }
    for (int q = 0; q < NP; q++) {
        const __m512i off = _mm512_slli_epi32(_mm512_loadu_si512(wsum + q * PW), 7);
        for (int r = 0; r < R; r++) _mm512_storeu_si512(&c[r][q * PW], _mm512_sub_epi32(a[r][q], off));
    }
}

#define A8_VNNI_CASE(R)                                                              \
    case R:                                                                          \
        if (np == 4)                                                                 \
            a8_tile_vnni(xr, kq, p, wsum, R, 4, c);                                  \
        else                                                                         \
            for (int q = 0; q < np; q++) a8_tile_vnni(xr, kq, p + q * kq * PW, wsum + q * PW, R, 1, (int32_t(*)[4 * PW])&c[0][q * PW]); \
        break;

VNNI_TARGET static void a8_rows_vnni(const int8_t *xq, int64_t kq, const int8_t *p, const int32_t *wsum, int mr,
                                     int np, int32_t c[A8_ROWS][4 * PW]) {
    const int8_t *xr = xq;
    switch (mr) {
        A8_VNNI_CASE(6) A8_VNNI_CASE(5) A8_VNNI_CASE(4) A8_VNNI_CASE(3) A8_VNNI_CASE(2) default: A8_VNNI_CASE(1)
    }
}

/* R rows (q, row stride kq) by one VNNI panel on AVX2: vpmaddwd sums the products in signed 16-bit pairs. */
static inline __attribute__((always_inline)) void a8_tile_avx2(const int8_t *xq, int64_t kq, const int8_t *p,
                                                               const int R, int32_t c[A8_ROWS][4 * PW]) {
    __m256i a[4][4]; /* [row][channels 4h .. 4h + 3], each channel's two pair sums */
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 4; h++) a[r][h] = _mm256_setzero_si256();
    for (int64_t j = 0; j < kq / 4; j++) {
        __m256i w[4];
        for (int h = 0; h < 4; h++) w[h] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(p + j * 4 * PW + 16 * h)));
        for (int r = 0; r < R; r++) {
            int32_t quad;
            memcpy(&quad, xq + r * kq + 4 * j, sizeof(quad));
            const __m256i xb = _mm256_broadcastq_epi64(_mm_cvtepi8_epi16(_mm_cvtsi32_si128(quad)));
            for (int h = 0; h < 4; h++) a[r][h] = _mm256_add_epi32(a[r][h], _mm256_madd_epi16(xb, w[h]));
        }
    }
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7);
    for (int r = 0; r < R; r++) {
        _mm256_storeu_si256((__m256i *)&c[r][0], _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a[r][0], a[r][1]), order));
        _mm256_storeu_si256((__m256i *)&c[r][8], _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(a[r][2], a[r][3]), order));
    }
}

static void a8_rows_avx2(const int8_t *xq, int64_t kq, const int8_t *p, int mr, int32_t c[A8_ROWS][4 * PW]) {
    switch (mr) {
    case 4: a8_tile_avx2(xq, kq, p, 4, c); break;
    case 3: a8_tile_avx2(xq, kq, p, 3, c); break;
    case 2: a8_tile_avx2(xq, kq, p, 2, c); break;
    default: a8_tile_avx2(xq, kq, p, 1, c); break;
    }
}

/* appl_linear for W8A8 weights: the rows quantized once, threads split the panels, each panel group's
 * sums over a block of rows at a time (rows kept in L2 while the panels pass). */
static void a8_linear(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                      int accumulate) {
    const int64_t k = L->k, n = L->n, kq = (k + 3) & ~(int64_t)3, panels = (n + PW - 1) / PW;
    if (m <= 0) return;
    const int amx = g_amx && g_has_amx_int8 && m >= AMX_INT8_MIN_ROWS;
    const int vnni = g_vnni && !amx, tile_rows = amx ? 32 : vnni ? A8_ROWS : 4, step = amx ? 2 : vnni ? 4 : 1;
    /* the quantized rows, row stride kx; on AMX, k padded to its tiles' 64 and zero rows up to a multiple of 16 */
    const int64_t kx = amx ? (k + 63) & ~(int64_t)63 : kq, mx = amx ? (m + 15) & ~(int64_t)15 : m;
    int8_t *xq = (int8_t *)malloc((size_t)(mx * kx));
    float *xs = (float *)malloc(sizeof(float) * (size_t)m);
    if (!xq || !xs) abort();
    a8_quantize(x, ldx, m, k, kx, xq, xs, vnni);
    memset(xq + m * kx, 0, (size_t)((mx - m) * kx));
    int64_t mc = (256 * 1024) / kx;
    mc = mc < tile_rows ? tile_rows : (mc / tile_rows) * tile_rows;
    const int8_t *w = (const int8_t *)L->w;
    const int32_t *wsum = (const int32_t *)L->qparams;
#pragma omp parallel
    {
        int64_t p0, p1;
        thread_panels(panels, &p0, &p1);
        int32_t c[32][4 * PW]; /* A8_ROWS by four panels, or 32 rows by two (AMX) */
        float f[4 * PW];
        /* AMX: each panel's last quads (past the whole 64-k blocks) copied into zero-padded tiles */
        const int64_t full = kq / 64, tail = (kq / 4) % 16;
        int8_t tails[2][1024];
        if (amx && p0 < p1) {
            memset(tails, 0, sizeof(tails));
            amx_begin();
        }
        for (int64_t m0 = 0; m0 < m; m0 += mc) {
            const int64_t m1 = m0 + mc < m ? m0 + mc : m;
            for (int64_t pn = p0; pn < p1; pn += step) {
                const int64_t n0 = pn * PW;
                const int np = (int)(p1 - pn < step ? p1 - pn : step);
                const int nv = (int)(n - n0 < np * PW ? n - n0 : np * PW);
                if (amx && tail)
                    for (int q = 0; q < np; q++) memcpy(tails[q], w + (pn + q) * kq * PW + full * 1024, (size_t)(tail * 64));
                for (int64_t r = m0, mr; r < m1; r += mr) {
                    mr = m1 - r < tile_rows ? (int)(m1 - r) : tile_rows;
                    if (amx)
                        amx_block_int8((const char *)(xq + r * kx), kx, (const char *)(w + pn * kq * PW),
                                       (const char *)(w + (pn + 1) * kq * PW), kx / 64, tail ? (const char *)tails[0] : NULL,
                                       tail ? (const char *)tails[1] : NULL, mr > 16 ? 2 : 1, np, c, sizeof(c[0]), 0, 64, 16 * kx);
                    else if (vnni)
                        a8_rows_vnni(xq + r * kx, kx, w + pn * kq * PW, wsum + n0, (int)mr, np, c);
                    else
                        a8_rows_avx2(xq + r * kx, kx, w + pn * kq * PW, (int)mr, c);
                    for (int i = 0; i < (int)mr; i++) {
                        const __m256 sr = _mm256_set1_ps(xs[r + i]);
                        for (int j = 0; j < np * PW; j += 8)
                            _mm256_storeu_ps(f + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)&c[i][j])), sr));
                        store_out(L, out + (r + i) * ldo + n0, n0, f, nv, accumulate);
                    }
                }
            }
        }
        if (amx && p0 < p1) amx_end();
    }
    free(xq);
    free(xs);
}

/* ------------------------------------------------------ AVX-512 int4 rows */
/*
 * Up to four rows by four int4 panels in zmm registers: a pair row's 16
 * bytes widen to 16 int32 lanes at once (low nibble: k = 2j, the byte shifted
 * right by four: k = 2j + 1), so a pair of 16 channels costs one widen, two
 * converts and two FMAs per row, and each widened panel feeds every row.
 * One row keeps the two k of a pair in separate accumulators (eight chains).
 * Sums are fp32 as on the AVX2 path; only their order differs. Decode
 * batches of up to Q4_ROWS_MAX rows run here: up to four rows over four
 * panels, five or six rows (a speculative step's verification) over two
 * panels, each weight widened once for every row.
 */
AVX512_TARGET static inline __attribute__((always_inline)) void q4_rows512(const Linear *L, const float *x,
                                                                            int64_t ldx, const float *xs, int64_t pn,
                                                                            const int np, const int R, float *c) {
    const int64_t k = L->k, pstride = k * PW / 2, groups = k / L->group, qstride = groups * 2 * PW;
    const int pairs = L->group / 2, split = R <= 2;
    const uint8_t *p = (const uint8_t *)L->w + pn * pstride;
    const int64_t qp = pn * qstride;
    const char *next = (const char *)(p + np * pstride); /* the next np panels follow these */
    const __m512i mask = _mm512_set1_epi32(0x0f);
    for (int r = 0; r < R; r++)
        for (int q = 0; q < np; q++) _mm512_storeu_ps(c + r * 4 * PW + q * PW, _mm512_setzero_ps());
    for (int64_t g = 0; g < groups; g++) {
        __m512 a[Q4_ROWS_MAX][4], h[Q4_ROWS_MAX][4];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < np; q++) a[r][q] = h[r][q] = _mm512_setzero_ps();
        const uint8_t *pg = p + g * pairs * PW;
        const float *xg = x + g * L->group;
        for (int j = 0; j < pairs; j++) {
            if (np >= 2) _mm_prefetch(next + (g * pairs + j) * np * PW, _MM_HINT_T0);
            __m512 wl[4], wh[4];
            for (int q = 0; q < np; q++) {
                const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(pg + q * pstride + j * PW)));
                wl[q] = _mm512_cvtepi32_ps(_mm512_and_si512(w, mask));
                wh[q] = _mm512_cvtepi32_ps(_mm512_srli_epi32(w, 4));
            }
            for (int r = 0; r < R; r++) {
                const __m512 x0 = _mm512_set1_ps(xg[r * ldx + 2 * j]), x1 = _mm512_set1_ps(xg[r * ldx + 2 * j + 1]);
                for (int q = 0; q < np; q++) {
                    if (split) {
                        a[r][q] = _mm512_fmadd_ps(x0, wl[q], a[r][q]);
                        h[r][q] = _mm512_fmadd_ps(x1, wh[q], h[r][q]);
                    } else {
                        a[r][q] = _mm512_fmadd_ps(x1, wh[q], _mm512_fmadd_ps(x0, wl[q], a[r][q]));
                    }
                }
            }
        }
        for (int q = 0; q < np; q++) {
            const int64_t dm = qp + q * qstride + g * 2 * PW;
            const __m512 d = load_qp512(L, dm), m = load_qp512(L, dm + PW);
            for (int r = 0; r < R; r++) {
                float *o = c + r * 4 * PW + q * PW;
                const __m512 sum = split ? _mm512_add_ps(a[r][q], h[r][q]) : a[r][q];
                const __m512 base = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * groups + g]), _mm512_loadu_ps(o));
                _mm512_storeu_ps(o, _mm512_fmadd_ps(d, sum, base));
            }
        }
    }
}

#define Q4_ROWS_CASE(R)                                                                        \
    case R:                                                                                    \
        if (np == 4)                                                                           \
            q4_rows512(L, xr, ldx, sr, pn, 4, R, c);                                           \
        else /* the last panels, one at a time, each at its column of c */                    \
            for (int q = 0; q < np; q++) q4_rows512(L, xr, ldx, sr, pn + q, 1, R, c + q * PW); \
        break;

/* Five or six rows: two panels at a time, every row in one pass (24 accumulators for four
 * panels would not fit the 32 zmm registers; two passes of three rows unpack every weight twice). */
#define Q4_ROWS_CASE2(R)                                                                     \
    case R:                                                                                  \
        if (np == 2)                                                                         \
            q4_rows512(L, xr, ldx, sr, pn, 2, R, c);                                         \
        else                                                                                 \
            q4_rows512(L, xr, ldx, sr, pn, 1, R, c);                                         \
        break;

/* Rows [0, m) (m <= Q4_ROWS_MAX) against int4 panels [p0, p1); xs: each row's group sums. Up to
 * Q4_DIRECT_MAX rows go through q4_rows_passes. */
AVX512_TARGET static void q4_rows(const Linear *L, const float *x, int64_t ldx, const float *xs, float *out,
                                  int64_t ldo, int64_t m, int64_t p0, int64_t p1, int accumulate) {
    const int64_t n = L->n;
    const int step = m > 4 ? 2 : 4; /* panels per pass */
    float c[Q4_ROWS_MAX * 4 * PW]; /* [R][4 PW] */
    for (int64_t pn = p0; pn < p1; pn += step) {
        const int64_t n0 = pn * PW;
        const int np = (int)(p1 - pn < step ? p1 - pn : step);
        const int nv = (int)(n - n0 < np * PW ? n - n0 : np * PW);
        const float *xr = x, *sr = xs;
        switch (m) {
            Q4_ROWS_CASE2(6) Q4_ROWS_CASE2(5) Q4_ROWS_CASE(4) Q4_ROWS_CASE(3) Q4_ROWS_CASE(2) Q4_ROWS_CASE(1)
        }
        for (int r = 0; r < (int)m; r++) store_out(L, out + r * ldo + n0, n0, c + r * 4 * PW, nv, accumulate);
    }
}

/* Up to Q4_DIRECT_MAX rows on AVX-512F: passes of up to Q4_ROWS_MAX rows, as even as they go (7: 4 + 3,
 * 12: 6 + 6, 13: 5 + 4 + 4); each pass unpacks the panels again, which costs less than widening them. */
AVX512_TARGET static void q4_rows_passes(const Linear *L, const float *x, int64_t ldx, const float *xs, float *out,
                                         int64_t ldo, int64_t m, int64_t p0, int64_t p1, int accumulate) {
    const int64_t groups = L->k / L->group;
    for (int64_t r0 = 0, R; r0 < m; r0 += R) {
        R = even_pass(m - r0, Q4_ROWS_MAX);
        q4_rows(L, x + r0 * ldx, ldx, xs + r0 * groups, out + r0 * ldo, ldo, R, p0, p1, accumulate);
    }
}

/* ---------------------------------------- 4- and 8-bit weights on integer dot products */
/*
 * GEMMs of any number of rows over int4, grouped-int8 or per-channel
 * int8 weights (GGUF's Q4_0/Q4_1/Q8_0/Q5_K/Q6_K, int4_wo, AWQ, GPTQ,
 * int8_wo) on AVX512-VNNI where the CPU has it (appl_int8_rows): each row
 * is quantized per group of the weights' k (128 inputs against int8 per
 * channel, see g8_group), one symmetric scale a row a group (s = amax / 127,
 * q = rint(x / s) in -127..127, llama.cpp's Q8_0 activations), and each
 * group's products sum exactly in int32 on vpdpbusd before its scales
 * apply: sum_k x_k (d w_k + m) ~= d s sum_k w_k q_k + m sum_k x_k, the
 * mins against the rows' exact fp32 group sums (int8 per channel: d = 1,
 * m = 0, the channel's scale on the way out). vpdpbusd multiplies unsigned
 * by signed bytes, so the weights enter unsigned: int4 as stored (0..15),
 * int8 offset by 128, each group then subtracting 128 sum_k q_k (int8 per
 * channel: the row's sum over groups of 128 q s, once a row). Up to
 * G8_DIRECT_ROWS rows read the stored panels, each k quad put in
 * vpdpbusd's operand order in registers (1.15x the fp32 GEMV at one row);
 * more rows re-lay each panel once a block of rows into k quads
 * ([k / 4][16][4] bytes): a quarter of the bytes of the vdpbf16ps path's
 * bf16 re-lay, and one instruction does 64 multiply-adds against
 * vdpbf16ps's 32. Weights packed for these rows (WTYPE_I8Q, WTYPE_Q8GQ,
 * WTYPE_Q4Q: appl_int8_quads) are those quads already (int4 two a byte,
 * one mask or one shift apart): int8 ones are read as stored at every row
 * count (1.25-1.47x the re-laid panels at 8 rows, 1.06-1.13x at 32 and 256
 * on Zen 4); int4 ones up to G8_RELAY_Q4_ROWS rows, more re-lay each panel
 * pair's nibbles into bytes once a block of rows, so that no row tile
 * unpacks a quad (a mask and a shift a quad a panel, on the vector pipes
 * vpdpbusd needs: at 512 rows on Zen 5 gate|up 1.1x, a 4,500-token
 * prefill's GEMMs 1.1x; even at 16 rows, 0.9x at 8). Every row is
 * quantized alike whatever the batch, so a request's results do not
 * depend on what shares its step. Where AMX-BF16
 * tiles take the rows (from AMX_MIN_ROWS; grouped panels from
 * AMX_MIN_ROWS_GROUPED), they stay there.
 */
#define G8_ROWS 6     /* rows per tile, by two panels: 12 fp32 and 12 int32 zmm accumulators */
#define G8_DIRECT_ROWS 6 /* up to this many rows read the stored panels, each quad re-laid in registers */
#define G8_RELAY_Q4_ROWS 24 /* from this many rows int4 quads (WTYPE_Q4Q) are unpacked to bytes once a block */

/* The int8 rows path: set < 0 asks, 0 turns it off, 1 on (where the CPU has AVX512-VNNI). Returns whether
 * it runs: it needs the vpdpbusd path (appl_vnni) on too. */
int appl_int8_rows(int set) {
    if (set >= 0) g_int8_rows = set && g_has_vnni;
    return g_int8_rows && g_vnni;
}

/* Rows [0, m) of x quantized per group of G (a multiple of 4 dividing k): q [m][k] int8; per row per
 * group ([m][k / G] each) the scale s, the exact fp32 sum xsum and the sum of q, qsum; per row, corr =
 * sum over groups of 128 * qsum * s (what weights offset by 128 add to the row's products, rounded once). */
static void g8_quantize(const float *x, int64_t ldx, int64_t m, int64_t k, int G, int8_t *q, float *s, float *xsum,
                        int32_t *qsum, float *corr) {
    const int64_t groups = k / G;
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
#pragma omp parallel for schedule(static) if (m * k >= 65536)
    for (int64_t r = 0; r < m; r++) {
        double offset = 0.0;
        for (int64_t g = 0; g < groups; g++) {
            const float *xg = x + r * ldx + g * G;
            int8_t *qg = q + r * k + g * G;
            const int64_t o = r * groups + g;
            __m256 mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
            int i = 0;
            for (; i + 8 <= G; i += 8) {
                const __m256 v = _mm256_loadu_ps(xg + i);
                mx = _mm256_max_ps(mx, _mm256_and_ps(v, absmask));
                sm = _mm256_add_ps(sm, v);
            }
            float amax = hmax8(mx), t = hsum8(sm);
            for (int j = i; j < G; j++) {
                amax = fmaxf(amax, fabsf(xg[j]));
                t += xg[j];
            }
            const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
            s[o] = amax / 127.0f;
            xsum[o] = t;
            const __m256 vi = _mm256_set1_ps(inv);
            __m256i qs = _mm256_setzero_si256();
            for (i = 0; i + 8 <= G; i += 8) {
                const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(xg + i), vi));
                qs = _mm256_add_epi32(qs, a);
                const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
                _mm_storel_epi64((__m128i *)(qg + i), _mm_packs_epi16(w, w));
            }
            __m128i h = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
            h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xb1));
            int32_t qt = _mm_cvtsi128_si32(h);
            for (; i < G; i++) {
                qg[i] = (int8_t)lrintf(xg[i] * inv);
                qt += qg[i];
            }
            qsum[o] = qt;
            offset += 128.0 * qt * (double)s[o];
        }
        corr[r] = (float)offset;
    }
}

/* Quad j (k = 4j .. 4j + 3) of panel pn of int4 or int8 weights as 16 channels of four unsigned bytes, vpdpbusd's
 * operand: int4 as stored (pair rows 2j and 2j + 1 hold them as lo, hi, lo, hi), int8 + 128 (quad_panels: as
 * stored). */
VNNI_TARGET static inline __attribute__((always_inline)) __m512i g8_quad(const Linear *L, int64_t pn, int64_t j) {
    const int64_t k = L->k;
    if (L->wtype == WTYPE_Q4Q) { /* quad j: the low or the high nibbles of its pair's 64 bytes */
        const __m512i v = _mm512_loadu_si512((const uint8_t *)L->w + pn * (k * PW / 2) + (j / 2) * 4 * PW);
        return _mm512_and_si512(j & 1 ? _mm512_srli_epi16(v, 4) : v, _mm512_set1_epi8(0x0f));
    }
    if (quad_panels(L)) return _mm512_loadu_si512((const uint8_t *)L->w + pn * k * PW + j * 4 * PW);
    if (L->wtype == WTYPE_Q4) {
        const uint8_t *p = (const uint8_t *)L->w + pn * (k * PW / 2) + 2 * j * PW;
        const __m512i lo = _mm512_set1_epi32(0x0f), hi = _mm512_set1_epi32(0xf0);
        const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
        const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + PW)));
        const __m512i v0 = _mm512_or_si512(_mm512_and_si512(b0, lo), _mm512_slli_epi32(_mm512_and_si512(b0, hi), 4));
        const __m512i v1 = _mm512_or_si512(_mm512_and_si512(b1, lo), _mm512_slli_epi32(_mm512_and_si512(b1, hi), 4));
        return _mm512_or_si512(v0, _mm512_slli_epi32(v1, 16));
    }
    const int8_t *p = (const int8_t *)L->w + pn * k * PW + 4 * j * PW;
    __m512i v = _mm512_setzero_si512();
    for (int i = 0; i < 4; i++)
        v = _mm512_or_si512(v, _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(p + i * PW))),
                                                 8 * i));
    return _mm512_xor_si512(v, _mm512_set1_epi32((int)0x80808080u));
}

/* Panel pn re-laid as its k quads at u ([k / 4][16][4] bytes). */
VNNI_TARGET static void g8_relay(const Linear *L, int64_t pn, uint8_t *u) {
    for (int64_t j = 0; j < L->k / 4; j++) _mm512_storeu_si512(u + j * 4 * PW, g8_quad(L, pn, j));
}

#define G8_INT4 0    /* int4 weights (0..15), each group's scale and min */
#define G8_GROUPED 1 /* grouped int8 (+ 128), each group's scale and min */
#define G8_CHANNEL 2 /* int8 per output channel (+ 128): the channel's scale applies on the way out */

/* R rows of quantized x (row stride k; s, xsum, qsum row stride k / G; corr one a row) by NP panels from pn:
 * re-laid at u, or (DIRECT) read from the stored panels (g8_quad); c[r][q * PW + j] = channel j of panel pn + q
 * for row r. Asks pf_lines cache lines from pf into the cache on the way, pf_step a quad. */
VNNI_TARGET static inline __attribute__((always_inline)) void g8_tile(const Linear *L, const int64_t G,
                                                                     const int8_t *xq, const float *s,
                                                                     const float *xsum, const int32_t *qsum,
                                                                     const float *corr, const uint8_t *u,
                                                                     int64_t pn, const int R,
                                                                     const int NP, const int MODE, const int DIRECT,
                                                                     const char *pf, int64_t pf_lines, int64_t pf_step,
                                                                     float c[G8_ROWS][2 * PW]) {
    const int64_t k = L->k, groups = k / G, qstride = groups * 2 * PW, qp = pn * qstride;
    __m512 acc[G8_ROWS][2];
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++) acc[r][q] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512i ia[G8_ROWS][2];
        for (int r = 0; r < R; r++)
            for (int q = 0; q < NP; q++) ia[r][q] = _mm512_setzero_si512();
        const uint8_t *ug = u + g * G * PW;
        const int8_t *xg = xq + g * G;
        for (int64_t j = 0; j < G / 4; j++) {
            const int64_t l0 = (g * G / 4 + j) * pf_step; /* pf_step lines of the next panels a quad */
            for (int64_t l = l0; l < l0 + pf_step && l < pf_lines; l++) _mm_prefetch(pf + 64 * l, _MM_HINT_T0);
            __m512i w[2];
            for (int q = 0; q < NP; q++)
                w[q] = DIRECT ? g8_quad(L, pn + q, g * G / 4 + j) : _mm512_loadu_si512(ug + q * k * PW + j * 4 * PW);
            for (int r = 0; r < R; r++) {
                int32_t quad;
                memcpy(&quad, xg + r * k + 4 * j, sizeof(quad));
                const __m512i xb = _mm512_set1_epi32(quad);
                for (int q = 0; q < NP; q++) ia[r][q] = dpbusd(ia[r][q], w[q], xb);
            }
        }
        for (int q = 0; q < NP; q++) {
            const int64_t dm = qp + q * qstride + g * 2 * PW;
            const __m512 d = MODE == G8_CHANNEL ? _mm512_setzero_ps() : load_qp512(L, dm);
            const __m512 mn = MODE == G8_CHANNEL ? _mm512_setzero_ps() : load_qp512(L, dm + PW);
            for (int r = 0; r < R; r++) {
                const int64_t o = r * groups + g;
                if (MODE == G8_CHANNEL) { /* the offset's products leave with corr, once a row */
                    acc[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][q]), _mm512_set1_ps(s[o]), acc[r][q]);
                } else {
                    const __m512i t = MODE == G8_INT4 ? ia[r][q] : _mm512_sub_epi32(ia[r][q], _mm512_set1_epi32(128 * qsum[o]));
                    const __m512 base = _mm512_fmadd_ps(mn, _mm512_set1_ps(xsum[o]), acc[r][q]);
                    acc[r][q] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(t), _mm512_mul_ps(d, _mm512_set1_ps(s[o])), base);
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int q = 0; q < NP; q++)
            _mm512_storeu_ps(&c[r][q * PW], MODE == G8_CHANNEL ? _mm512_sub_ps(acc[r][q], _mm512_set1_ps(corr[r])) : acc[r][q]);
}

#define G8_MODES(R, NP, DIRECT)                                                                      \
    if (mode == G8_INT4)                                                                             \
        g8_tile(L, G, xq, s, xsum, qsum, corr, u, pn, R, NP, G8_INT4, DIRECT, pf, pf_lines, pf_step, c);                          \
    else if (mode == G8_GROUPED)                                                                     \
        g8_tile(L, G, xq, s, xsum, qsum, corr, u, pn, R, NP, G8_GROUPED, DIRECT, pf, pf_lines, pf_step, c);                       \
    else                                                                                             \
        g8_tile(L, G, xq, s, xsum, qsum, corr, u, pn, R, NP, G8_CHANNEL, DIRECT, pf, pf_lines, pf_step, c);

#define G8_CASE(R, DIRECT)          \
    case R:                         \
        if (np == 2) {              \
            G8_MODES(R, 2, DIRECT)  \
        } else {                    \
            G8_MODES(R, 1, DIRECT)  \
        }                           \
        break;

VNNI_TARGET static void g8_rows(const Linear *L, int64_t G, const int8_t *xq, const float *s, const float *xsum,
                                const int32_t *qsum, const float *corr, const uint8_t *u, int64_t pn, int mr,
                                int np, int mode,
                                const char *pf, int64_t pf_lines, int64_t pf_step, float c[G8_ROWS][2 * PW]) {
    if (!u) { /* a few rows: the stored panels directly */
        switch (mr) {
            G8_CASE(6, 1) G8_CASE(5, 1) G8_CASE(4, 1) G8_CASE(3, 1) G8_CASE(2, 1) default: G8_CASE(1, 1)
        }
        return;
    }
    switch (mr) {
        G8_CASE(6, 0) G8_CASE(5, 0) G8_CASE(4, 0) G8_CASE(3, 0) G8_CASE(2, 0) default: G8_CASE(1, 0)
    }
}

/* The group the rows quantize in: the weights' for grouped ones; 128 inputs (or the most of 64, 32, ... 4
 * that divide k) against int8 per channel, whose weights have no groups: each group's int32 sums are
 * converted and scaled once, so groups of 128 spend a quarter of 32's on that (the GEMMs 1.1-1.15x at 256
 * rows at a 1B model's shapes on Zen 5; llama.cpp's K-quant activations are blocks of 256); 0: k has no
 * such group (the path does not apply). */
static int64_t g8_group(const Linear *L) {
    if (L->wtype != WTYPE_I8 && L->wtype != WTYPE_I8Q) return L->group % 4 == 0 ? L->group : 0;
    for (int64_t G = 128; G >= 4; G /= 2)
        if (L->k % G == 0) return G;
    return 0;
}

/* appl_linear for int4 or int8 weights on the integer-dot path, the rows quantized in groups of G
 * (g8_group): the rows quantized once, threads split the panels, each block of rows (kept in L2 as int8)
 * passing every panel pair re-laid once; up to G8_DIRECT_ROWS rows read the stored panels directly, as do
 * stored quads (but int4's from G8_RELAY_Q4_ROWS rows). */
static void g8_linear(const Linear *L, int64_t G, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                      int accumulate) {
    const int64_t k = L->k, n = L->n, groups = k / G, panels = (n + PW - 1) / PW;
    const int mode = L->wtype == WTYPE_Q4 || L->wtype == WTYPE_Q4Q        ? G8_INT4
                     : L->wtype == WTYPE_Q8G || L->wtype == WTYPE_Q8GQ ? G8_GROUPED
                                                                       : G8_CHANNEL;
    /* stored quads: no re-lay, but for int4's nibbles under many rows */
    const int direct = m <= G8_DIRECT_ROWS || (quad_panels(L) && !(L->wtype == WTYPE_Q4Q && m >= G8_RELAY_Q4_ROWS));
    int8_t *xq = (int8_t *)malloc((size_t)(m * k));
    float *s = (float *)malloc(sizeof(float) * (size_t)(2 * m * groups));
    int32_t *qsum = (int32_t *)malloc(sizeof(int32_t) * (size_t)(m * groups));
    float *corr = (float *)malloc(sizeof(float) * (size_t)m);
    if (!xq || !s || !qsum || !corr) abort();
    float *xsum = s + m * groups;
    g8_quantize(x, ldx, m, k, (int)G, xq, s, xsum, qsum, corr);
    int64_t mc = (512 * 1024) / k;
    mc = mc < 2 * G8_ROWS ? 2 * G8_ROWS : (mc / G8_ROWS) * G8_ROWS;
#pragma omp parallel
    {
        int64_t p0, p1;
        thread_panels(panels, &p0, &p1);
        uint8_t *u = p0 < p1 && !direct ? (uint8_t *)malloc((size_t)(2 * k * PW)) : NULL;
        float c[G8_ROWS][2 * PW];
        for (int64_t m0 = 0; p0 < p1 && m0 < m; m0 += mc) {
            const int64_t m1 = m0 + mc < m ? m0 + mc : m;
            for (int64_t pn = p0; pn < p1; pn += 2) {
                const int64_t n0 = pn * PW;
                const int np = p1 - pn < 2 ? 1 : 2;
                const int nv = (int)(n - n0 < np * PW ? n - n0 : np * PW);
                for (int q = 0; u && q < np; q++) g8_relay(L, pn + q, u + q * k * PW);
                /* the next panels' stored bytes asked into the cache while these run, a share for each row
                 * tile, so that they come from the cache, not memory */
                const int64_t next = p1 - pn - np < 2 ? p1 - pn - np : 2, tiles = (m1 - m0 + 5) / 6;
                const int64_t pbytes = mode == G8_INT4 ? k * PW / 2 : k * PW;
                const int64_t total = next * pbytes / 64, share = (total + tiles - 1) / tiles;
                for (int64_t r = m0, mr, t = 0; r < m1; r += mr, t++) {
                    /* six-row tiles, a short remainder shared evenly (as packed_rows) */
                    const int64_t left = m1 - r;
                    mr = left >= 12 || left <= 6 ? (left < 6 ? (int)left : 6) : (int)((left + 1) / 2);
                    const int64_t first = t * share;
                    const int64_t pf_lines = first < total ? (total - first < share ? total - first : share) : 0;
                    const char *pf = (const char *)L->w + (pn + np) * pbytes + 64 * first;
                    g8_rows(L, G, xq + r * k, s + r * groups, xsum + r * groups, qsum + r * groups, corr + r, u, pn, (int)mr,
                            np, mode, pf, pf_lines, (pf_lines + k / 4 - 1) / (k / 4), c);
                    for (int i = 0; i < (int)mr; i++) store_out(L, out + (r + i) * ldo + n0, n0, c[i], nv, accumulate);
                }
            }
        }
        free(u);
    }
    free(xq);
    free(s);
    free(qsum);
    free(corr);
}

/* One row: groups of four panels. xs: the row's group sums (int4 weights). */
static void packed_gemv(const Linear *L, const float *x, const float *xs, float *out, int64_t p0, int64_t p1,
                        int accumulate) {
    const int64_t k = L->k, n = L->n, pstride = k * PW;
    float c[4 * PW];
    for (int64_t pn = p0; pn < p1; pn += 4) {
        const int64_t n0 = pn * PW;
        const int np = (int)(p1 - pn < 4 ? p1 - pn : 4);
        const int nv = (int)(n - n0 < np * PW ? n - n0 : np * PW);
        if (L->wtype == WTYPE_Q4)
            pgemv4_q4(L, x, xs, pn, np, c);
        else if (L->wtype == WTYPE_Q8G)
            pgemv4_q8g(L, x, xs, pn, np, c);
        else if (L->wtype == WTYPE_I8)
            pgemv4_i8(x, (const int8_t *)L->w + pn * pstride, pstride, k, np, c);
        else if (L->wtype == WTYPE_BF16)
            pgemv4_bf16(x, (const uint16_t *)L->w + pn * pstride, pstride, k, np, c);
        else
            pgemv4_f32(x, (const float *)L->w + pn * pstride, pstride, k, np, c);
        store_out(L, out + n0, n0, c, nv, accumulate);
    }
}

/* Whether 4- and 8-bit weights packed now are packed for the int8 rows (WTYPE_I8Q, WTYPE_Q8GQ, WTYPE_Q4Q, see
 * quad_panels): what vpdpbusd reads, so that no GEMM re-lays a panel. So while the int8 rows run (int8_rows and
 * vnni on) and AMX-BF16 tiles do not take the larger GEMMs (they read the plain panels). A layer whose rows stay
 * floating point (float_rows) is packed plainly whatever this says. */
int appl_int8_quads(void) { return g_int8_rows && g_vnni && !(g_amx && g_has_amx_bf16 && g_bf16_dot); }

void appl_linear(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m, int accumulate);

/* appl_linear for quad_panels weights where the int8 rows do not take them (int8_rows or vnni turned off since
 * they were packed, or float_rows set): the whole weight re-laid into the plain panels (WTYPE_I8, WTYPE_Q8G,
 * WTYPE_Q4) for the call, the same sums as weights packed that way. A switch for comparisons, not a path a
 * deployment runs. */
static void quads_linear_relaid(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m,
                                int accumulate) {
    const int64_t k = L->k, panels = (L->n + PW - 1) / PW, q4 = L->wtype == WTYPE_Q4Q;
    const int64_t pstride = q4 ? k * PW / 2 : k * PW;
    uint8_t *w = (uint8_t *)malloc((size_t)(panels * pstride));
    if (!w) abort();
    const uint8_t *q = (const uint8_t *)L->w;
#pragma omp parallel for schedule(static)
    for (int64_t pn = 0; pn < panels; pn++) {
        const uint8_t *p = q + pn * pstride;
        uint8_t *o = w + pn * pstride;
        if (q4) /* k kk and kk + 1 (one quad, one nibble half) of channel c into pair row kk / 2 */
            for (int64_t kk = 0; kk < k; kk += 2)
                for (int c = 0; c < PW; c++) {
                    const uint8_t *b = p + (kk / 8) * 4 * PW + c * 4 + kk % 4;
                    const int shift = 4 * (int)((kk / 4) % 2);
                    o[(kk / 2) * PW + c] = (uint8_t)(((b[0] >> shift) & 0x0f) | (((b[1] >> shift) & 0x0f) << 4));
                }
        else
            for (int64_t kk = 0; kk < k; kk++)
                for (int c = 0; c < PW; c++) o[kk * PW + c] = (uint8_t)(p[(kk / 4) * 4 * PW + c * 4 + kk % 4] ^ 0x80);
    }
    Linear stored = *L;
    stored.w = w;
    stored.wtype = L->wtype == WTYPE_I8Q ? WTYPE_I8 : q4 ? WTYPE_Q4 : WTYPE_Q8G;
    appl_linear(&stored, x, ldx, out, ldo, m, accumulate);
    free(w);
}

/* out[m, n] = (accumulate ? out : 0) + scale[n] * <x[m, :], w[n, :]> + bias[n],
 * w packed in panels (see PW); threads split the panels. Rows are blocked so
 * a block of activations stays in L2 while the panels pass over it. */
void appl_linear(const Linear *L, const float *x, int64_t ldx, float *out, int64_t ldo, int64_t m, int accumulate) {
    if (L->wtype == WTYPE_I8A8) {
        a8_linear(L, x, ldx, out, ldo, m, accumulate);
        return;
    }
    if (quad_panels(L) && !(g_int8_rows && g_vnni && !L->float_rows && g8_group(L))) {
        quads_linear_relaid(L, x, ldx, out, ldo, m, accumulate);
        return;
    }
    if (L->perm) { /* gather the inputs into the stored order, then the plain product, PERM_ROWS rows at a time */
        enum { PERM_ROWS = 256 };
        const int64_t k = L->k, rows = m < PERM_ROWS ? m : PERM_ROWS;
        float *xp = (float *)malloc(sizeof(float) * (size_t)(rows * k));
        if (!xp) abort();
        Linear stored = *L;
        stored.perm = NULL;
        for (int64_t r0 = 0; r0 < m; r0 += rows) {
            const int64_t mr = m - r0 < rows ? m - r0 : rows;
#pragma omp parallel for schedule(static) if (mr * k >= 65536)
            for (int64_t r = 0; r < mr; r++)
                for (int64_t j = 0; j < k; j++) xp[r * k + j] = x[(r0 + r) * ldx + L->perm[j]];
            appl_linear(&stored, xp, k, out + r0 * ldo, ldo, mr, accumulate);
        }
        free(xp);
        return;
    }
    const int64_t panels = (L->n + PW - 1) / PW, kp = L->k + (L->k & 1);
    int64_t mc = (192 * 1024 / 4) / (L->k > 0 ? L->k : 1);
    mc = mc < 6 ? 6 : (mc / 6) * 6;
    const int q4 = L->wtype == WTYPE_Q4, grouped = q4 || L->wtype == WTYPE_Q8G;
    const int64_t g8 =
        (grouped || L->wtype == WTYPE_I8 || quad_panels(L)) && g_int8_rows && g_vnni && !L->float_rows ? g8_group(L) : 0;
    if (g8 && !amx_bf16_takes(L, m)) {
        g8_linear(L, g8, x, ldx, out, ldo, m, accumulate);
        return;
    }
    /* every row count below AMX's, one order */
    if ((L->wtype == WTYPE_BF16 || L->wtype == WTYPE_I8) && g_fma_rows && g_avx512 && !amx_bf16_takes(L, m)) {
#pragma omp parallel
        {
            int64_t p0, p1;
            thread_panels(panels, &p0, &p1);
            if (p0 < p1 && m >= FMA_CHUNK_ROWS) {
                const int64_t mc = fma_block_rows(L->k);
                float *wf = (float *)malloc(sizeof(float) * (size_t)(2 * FKC * PW + (m < mc ? m : mc) * 2 * PW));
                if (!wf) abort();
                rows_fma_chunked(L, x, ldx, out, ldo, m, p0, p1, accumulate, wf, wf + 2 * FKC * PW, mc);
                free(wf);
            } else if (p0 < p1) {
                packed_rows_fma(L, x, ldx, out, ldo, m, p0, p1, accumulate);
            }
        }
        return;
    }
    if (amx_bf16_takes(L, m)) {
        amx_linear(L, x, ldx, out, ldo, m, accumulate);
        return;
    }
    /* on vdpbf16ps at every row count: up to DR rows read the stored panels, more re-lay them, the same sums */
    const int dot_rows = (L->wtype == WTYPE_BF16 || L->wtype == WTYPE_I8 || grouped) && g_bf16_dot;
    if (dot_rows && m <= DR) {
        uint16_t *xb = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(m * kp));
        if (!xb) abort();
        for (int64_t r = 0; r < m; r++) row_to_bf16(x + r * ldx, xb + r * kp, L->k, kp);
        float *xsb = NULL; /* grouped weights: the rows' group sums */
        if (grouped) {
            xsb = (float *)malloc(sizeof(float) * (size_t)(m * (L->k / L->group)));
            if (!xsb) abort();
            bf16_group_sums(xb, kp, m, L->k, L->group, xsb);
        }
#pragma omp parallel
        {
            int64_t p0, p1;
            thread_panels(panels, &p0, &p1);
            if (p0 < p1) packed_rows_direct(L, xb, kp, xsb, out, ldo, m, p0, p1, accumulate);
        }
        free(xb);
        free(xsb);
        return;
    }
    const int q4_rows_here = q4 && !dot_rows && m <= (g_avx512 ? Q4_DIRECT_MAX : Q4_DIRECT_MAX_AVX2); /* else widened panels */
    const int dot = dot_rows && m > DR;
    /* the rows in bf16 (row stride kp) */
    uint16_t *xb = dot ? (uint16_t *)malloc(sizeof(uint16_t) * (size_t)(m * kp)) : NULL;
    if (dot) mc = m; /* one block: each panel re-laid once (the row tiles stream the rows past it) */
    float *xs = NULL; /* the rows' group sums (on vdpbf16ps, of the rows in bf16) */
    if (grouped && dot) {
        xs = (float *)malloc(sizeof(float) * (size_t)(m * (L->k / L->group)));
        if (!xs) abort();
    } else if (q4_rows_here || (grouped && m == 1)) {
        const int64_t groups = L->k / L->group;
        xs = (float *)malloc(sizeof(float) * (size_t)(m * groups));
        for (int64_t r = 0; r < m; r++) q4_group_sums(x + r * ldx, L->k, L->group, xs + r * groups);
    }
#pragma omp parallel
    {
        int64_t p0, p1;
        thread_panels(panels, &p0, &p1);
        if (q4_rows_here && g_avx512) {
            if (p0 < p1) q4_rows_passes(L, x, ldx, xs, out, ldo, m, p0, p1, accumulate);
        } else if (q4_rows_here && m > 1) {
            if (p0 < p1) q4_rows_avx2(L, x, ldx, xs, out, ldo, m, p0, p1, accumulate);
        } else if (m == 1) {
            if (p0 < p1) packed_gemv(L, x, xs, out, p0, p1, accumulate);
        } else {
            if (dot) {
#pragma omp for schedule(static)
                for (int64_t r = 0; r < m; r++) row_to_bf16(x + r * ldx, xb + r * kp, L->k, kp);
                if (grouped) {
#pragma omp for schedule(static)
                    for (int64_t r = 0; r < m; r++)
                        bf16_group_sums(xb + r * kp, kp, 1, L->k, L->group, xs + r * (L->k / L->group));
                }
            }
            /* a widened panel (PW * k floats), or NP_LAID re-laid bf16 ones (PW * kp halves each) */
            const int widen = grouped || (L->wtype != WTYPE_F32 && m > 6);
            float *wbuf = widen ? (float *)malloc(sizeof(float) * (size_t)(dot ? NP_LAID * PW * kp / 2 : PW * L->k)) : NULL;
            for (int64_t m0 = 0; m0 < m; m0 += mc) {
                const int64_t m1 = m0 + mc < m ? m0 + mc : m;
                if (p0 >= p1) continue;
                if (dot) /* every row of the call, so all are rounded alike */
                    packed_rows_dot(L, xb, kp, xs, out, ldo, m0, m1, p0, p1, accumulate, (uint16_t *)wbuf);
                else
                    packed_rows(L, x, ldx, out, ldo, m0, m1, p0, p1, accumulate, wbuf);
            }
            free(wbuf);
        }
    }
    free(xb);
    free(xs);
}

/* ----------------------------------------------------------- MXFP4 */
/* gpt-oss's experts as stored: 4-bit e2m1 codes (sign, two exponent bits, one mantissa bit), two a byte, and an
 * e8m0 scale (2^(s - 127)) per group of 32 inputs. A row of w is blocks[g][16] per group g, byte j holding input
 * 32g + 2j in its low nibble and 32g + 2j + 1 in its high one; scales[g] its groups' scales. Each group's values
 * are the magnitude table times the scale (exact: a power of two), picked by the code's low three bits, the sign
 * bit flipped by its fourth, then multiplied into fp32 sums (8 lanes, in k order within a lane). */
static const float FP4_MAGNITUDES[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

static inline float e8m0_scale(uint8_t s) {
    const uint32_t bits = s == 0 ? 0x00400000u : s == 255 ? 0x7fc00000u : (uint32_t)s << 23; /* 2^-127, NaN */
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* One group's 32 values, in k order, as four vectors of 8. */
static inline void mxfp4_group(const uint8_t *b, uint8_t scale, __m256 w[4]) {
    const __m256 lut = _mm256_mul_ps(_mm256_loadu_ps(FP4_MAGNITUDES), _mm256_set1_ps(e8m0_scale(scale)));
    const __m128i bytes = _mm_loadu_si128((const __m128i *)b), nib = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(bytes, nib), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), nib);
    const __m128i c0 = _mm_unpacklo_epi8(lo, hi), c1 = _mm_unpackhi_epi8(lo, hi); /* k = 0..15, 16..31 */
    const __m128i codes[4] = {c0, _mm_srli_si128(c0, 8), c1, _mm_srli_si128(c1, 8)};
    for (int q = 0; q < 4; q++) {
        const __m256i c = _mm256_cvtepu8_epi32(codes[q]);
        const __m256i sign = _mm256_slli_epi32(_mm256_srli_epi32(c, 3), 31);
        w[q] = _mm256_xor_ps(_mm256_permutevar8x32_ps(lut, c), _mm256_castsi256_ps(sign));
    }
}

/* out[r][j] = sum_k x[r][k] w[j][k] (+ bias[j]) for m rows of x and n rows of w (k a multiple of 32): each row of
 * w decoded once per 8 rows of x. */
void appl_mxfp4_linear(const float *x, int64_t ldx, const uint8_t *blocks, const uint8_t *scales, const float *bias,
                       float *out, int64_t ldo, int64_t m, int64_t n, int64_t k) {
    const int64_t groups = k / 32;
#pragma omp parallel for schedule(static) if (n >= 64)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *bj = blocks + j * groups * 16, *sj = scales + j * groups;
        for (int64_t r0 = 0; r0 < m; r0 += 8) {
            const int rows = (int)(m - r0 < 8 ? m - r0 : 8);
            __m256 acc[8];
            for (int r = 0; r < 8; r++) acc[r] = _mm256_setzero_ps();
            for (int64_t g = 0; g < groups; g++) {
                __m256 w[4];
                mxfp4_group(bj + g * 16, sj[g], w);
                for (int r = 0; r < rows; r++) {
                    const float *xr = x + (r0 + r) * ldx + g * 32;
                    __m256 a = _mm256_fmadd_ps(_mm256_loadu_ps(xr), w[0], acc[r]);
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 8), w[1], a);
                    a = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 16), w[2], a);
                    acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xr + 24), w[3], a);
                }
            }
            for (int r = 0; r < rows; r++) out[(r0 + r) * ldo + j] = hsum8(acc[r]) + (bias != NULL ? bias[j] : 0.0f);
        }
    }
}

/* The weights of rows x groups MXFP4 blocks as bf16 [rows][32 * groups] (exact: an e2m1 value times a power of
 * two has bf16's range and at most two significant bits), for a bf16 GEMM of many rows. */
void appl_mxfp4_to_bf16(const uint8_t *blocks, const uint8_t *scales, int64_t rows, int64_t groups, uint16_t *out) {
#pragma omp parallel for schedule(static) if (rows >= 64)
    for (int64_t j = 0; j < rows; j++) {
        for (int64_t g = 0; g < groups; g++) {
            __m256 w[4];
            mxfp4_group(blocks + (j * groups + g) * 16, scales[j * groups + g], w);
            uint16_t *o = out + (j * groups + g) * 32;
            for (int h = 0; h < 2; h++) { /* the high halves of fp32 are the bf16 values, exactly */
                const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(w[2 * h]), 16);
                const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(w[2 * h + 1]), 16);
                const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
                _mm256_storeu_si256((__m256i *)(o + 16 * h), packed);
            }
        }
    }
}

/* ----------------------------------------------------------- elementwise */

static void rmsnorm_row(const float *x, const float *w, float *out, int n, float eps) {
    __m256 ss = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        ss = _mm256_fmadd_ps(v, v, ss);
    }
    float s = hsum8(ss);
    for (; i < n; i++) s += x[i] * x[i];
    const float r = 1.0f / sqrtf(s / (float)n + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * r);
}

void appl_rmsnorm(const float *x, int64_t ldx, const float *w, float *out, int64_t ldo, int64_t rows, int n,
                  float eps) {
#pragma omp parallel for schedule(static) if (rows >= 32)
    for (int64_t t = 0; t < rows; t++) rmsnorm_row(x + t * ldx, w, out + t * ldo, n, eps);
}

/* rotate_half rope on the first rd channels of `heads` vectors of size d at p (consecutive); cos, sin: rd. */
static void rope_heads(float *p, int heads, int d, int rd, const float *cos, const float *sin) {
    const int half = rd / 2;
    for (int h = 0; h < heads; h++) {
        float *v = p + h * d;
        for (int i = 0; i < half; i++) {
            const float a = v[i], b = v[i + half];
            v[i] = a * cos[i] - b * sin[i];
            v[i + half] = b * cos[i + half] + a * sin[i + half];
        }
    }
}

static void silu_mul_row(const float *gu, float *out, int inter) {
    int i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= inter; i += 8) {
        __m256 g = _mm256_loadu_ps(gu + i), u = _mm256_loadu_ps(gu + inter + i);
        __m256 e = exp8(_mm256_sub_ps(zero, g));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, u));
    }
    for (; i < inter; i++) {
        const float g = gu[i];
        out[i] = g / (1.0f + expf(-g)) * gu[inter + i];
    }
}

/* ------------------------------------------------------------- attention */

/* Four 8-lane sums in one vector: [sum a, sum b, sum c, sum d]. */
static inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
    const __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/*
 * Decode attention (flash-decoding): one item is the query heads of one token attending positions [p0, p1) of
 * its sequence (a split of its context, or all of it). Positions go by chunks of DEC_CH, read in place from
 * the block pool (block table bt; a position's row holds every kv head's d elements, kv_stride = n_kv_heads *
 * d elements apart, at k_base / v_base; fp32, bf16 or fp8), a quad of positions' rows at a time, every kv
 * head's part of them in turn (the rows are read in order). Per chunk and kv head, its grp query heads: the
 * scores (each K row loaded once for all of them), an online softmax (per head a running max m and sum l, the
 * output accumulated so far rescaled when the max grows), then P V with each V row loaded once for all of
 * them. Leaves acc [nh][d] (not divided by l), m [nh] and l [nh]; s [nh][DEC_CH] and corr [nh] are
 * scratch. scale includes an fp8 cache's k_scale. d % 8 == 0.
 */
#define DEC_CH 64          /* key positions per chunk */
#define DEC_SPLIT 256      /* positions a split of one context takes (a multiple of DEC_CH) */

/* F(args..., n) with n a constant from 1 to 2, and from 1 to 4 (the register tiles' row or head counts unroll). */
#define UPTO2_CASE(n, F, ...)                 \
    switch (n) {                              \
    case 2: F(__VA_ARGS__, 2); break;         \
    default: F(__VA_ARGS__, 1); break;        \
    }
#define UPTO4_CASE(n, F, ...)                 \
    switch (n) {                              \
    case 4: F(__VA_ARGS__, 4); break;         \
    case 3: F(__VA_ARGS__, 3); break;         \
    case 2: F(__VA_ARGS__, 2); break;         \
    default: F(__VA_ARGS__, 1); break;        \
    }
#define UPTO8_CASE(n, F, ...)                 \
    switch (n) {                              \
    case 8: F(__VA_ARGS__, 8); break;         \
    case 7: F(__VA_ARGS__, 7); break;         \
    case 6: F(__VA_ARGS__, 6); break;         \
    case 5: F(__VA_ARGS__, 5); break;         \
    default: UPTO4_CASE(n, F, __VA_ARGS__)    \
    }

/* Where position pos's row starts (kv head 0), in elements from the cache's start. */
static inline int64_t dec_row(const int32_t *bt, int bs, int64_t kv_stride, int pos) {
    return ((int64_t)bt[pos / bs] * bs + pos % bs) * kv_stride;
}

static inline void dec_start(float *acc, float *m, float *l, int nh, int d) {
    for (int h = 0; h < nh; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)nh * d);
}

/* The online softmax of one chunk for grp heads: s [grp][DEC_CH] (cnt scores each) becomes the chunk's
 * numerators, m and l the running max and sum, corr [grp] what the output so far must be scaled by. */
static void dec_softmax(float *s, int cnt, int grp, float *m, float *l, float *corr, float softcap) {
    for (int h = 0; h < grp; h++) {
        float *sh = s + h * DEC_CH, mx = m[h];
        if (softcap > 0.0f) /* soft-capped scores (Gemma 2): softcap * tanh(s / softcap) */
            for (int o = 0; o < cnt; o++) sh[o] = softcap * tanhf(sh[o] / softcap);
        __m256 mx8 = _mm256_set1_ps(mx);
        int o = 0;
        for (; o + 8 <= cnt; o += 8) mx8 = _mm256_max_ps(mx8, _mm256_loadu_ps(sh + o));
        for (; o < cnt; o++) mx = sh[o] > mx ? sh[o] : mx;
        mx = fmaxf(mx, hmax8(mx8));
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        for (o = 0; o + 8 <= cnt; o += 8) {
            const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sh + o), mv));
            _mm256_storeu_ps(sh + o, e);
            sum8 = _mm256_add_ps(sum8, e);
        }
        float sum = hsum8(sum8);
        for (; o < cnt; o++) {
            sh[o] = expf(sh[o] - mx);
            sum += sh[o];
        }
        corr[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
        l[h] = l[h] * corr[h] + sum;
        m[h] = mx;
    }
}

/* Positions [p0, p1) of a context's K and V rows (every kv head; elt bytes an element) asked into L2 at once before
 * an item reads them: the first rows of a split (the AVX2 and AVX-512 items then ask as they go, dec_ask), or a
 * whole split of at most DEC_SPLIT positions (the AMX items: 512 KiB of K and V in a bf16 cache with 1 KiB of K a
 * position; 1.2-1.6x on a cache read from memory where the item's own loads would wait for one chunk's rows after
 * another). */
static void dec_prefetch(const void *k_base, const void *v_base, int64_t elt, const int32_t *bt, int bs,
                         int64_t kv_stride, int p0, int p1) {
    const int64_t row = kv_stride * elt;
    for (int pos = p0; pos < p1;) {
        const int n = bs - pos % bs < p1 - pos ? bs - pos % bs : p1 - pos; /* the run in this block */
        const int64_t off = dec_row(bt, bs, kv_stride, pos) * elt;
        const char *kp = (const char *)k_base + off, *vp = (const char *)v_base + off;
        for (int64_t b = 0; b < n * row; b += 64) {
            _mm_prefetch(kp + b, _MM_HINT_T1);
            _mm_prefetch(vp + b, _MM_HINT_T1);
        }
        pos += n;
    }
}

/* The rows DEC_AHEAD positions past a chunk's (n of them: those inside the split), asked into L1 four at a time
 * as the chunk's quads of keys are read (dec_ask): the loads of a quad then find their lines arriving, where the
 * hardware's prefetchers start over at each block of the pool (1.4-1.8x on a cache read from memory, against
 * asking for the split's rows all at once). */
#define DEC_AHEAD 8
typedef struct {
    const char *k[DEC_CH], *v[DEC_CH];
    int n;
    int64_t row_bytes; /* a position's K (or V) row, every kv head */
} DecAhead;

static inline __attribute__((always_inline)) void dec_ask(const DecAhead *ah, int o) {
    for (int x = o; x < o + 4 && x < ah->n; x++)
        for (int64_t b = 0; b < ah->row_bytes; b += 64) {
            _mm_prefetch(ah->k[x] + b, _MM_HINT_T0);
            _mm_prefetch(ah->v[x] + b, _MM_HINT_T0);
        }
}

/* A split's body: its first rows asked for (dec_prefetch), then chunk after chunk, every kv head's part of a
 * quad of keys in turn, so the rows are read in order (CHUNK: a dec_chunk function; QV: the query as it reads
 * it; the names of decode_split's parameters). */
#define DEC_SPLIT_CHUNKS(KT, CHUNK, QV)                                                                               \
    const KT *kr[DEC_CH], *vr[DEC_CH];                                                                                \
    DecAhead ahead;                                                                                                   \
    ahead.row_bytes = kv_stride * (int64_t)sizeof(KT);                                                                \
    dec_prefetch(k_base, v_base, sizeof(KT), bt, bs, kv_stride, p0, p1 - p0 < DEC_AHEAD ? p1 : p0 + DEC_AHEAD);       \
    for (int c0 = p0; c0 < p1; c0 += DEC_CH) {                                                                        \
        const int cnt = p1 - c0 < DEC_CH ? p1 - c0 : DEC_CH;                                                          \
        for (int o = 0; o < cnt; o++) {                                                                               \
            const int64_t off = dec_row(bt, bs, kv_stride, c0 + o);                                                   \
            kr[o] = k_base + off;                                                                                     \
            vr[o] = v_base + off;                                                                                     \
        }                                                                                                             \
        for (ahead.n = 0; ahead.n < cnt && c0 + DEC_AHEAD + ahead.n < p1; ahead.n++) {                                \
            const int64_t off = dec_row(bt, bs, kv_stride, c0 + DEC_AHEAD + ahead.n) * (int64_t)sizeof(KT);           \
            ahead.k[ahead.n] = (const char *)k_base + off;                                                            \
            ahead.v[ahead.n] = (const char *)v_base + off;                                                            \
        }                                                                                                             \
        CHUNK((QV), kr, vr, cnt, nkv, grp, d, scale, softcap, acc, m, l, s, corr, &ahead);                            \
    }

/* The body of a dec_chunk function (its parameters' names): per quad of keys, every kv head's part of their rows
 * in turn (read in order, the rows ahead asked for as it goes), scores by QK (a dec_qk4 of up to HQ heads; QCASE
 * unrolls their count); the online softmax of every head; then P V a kv head at a time by PV (a dec_pv of up to
 * four heads over two slices of CW / 2 columns, one at a ragged end). s [n_heads][DEC_CH], corr [n_heads]. */
#define DEC_CHUNK_BODY(KT, QK, QCASE, HQ, PV, CW)                                                                     \
    for (int o = 0; o < cnt; o += 4) {                                                                                \
        dec_ask(ahead, o);                                                                                            \
        for (int g = 0; g < nkv; g++) {                                                                               \
            const KT *quad[4];                                                                                        \
            for (int x = 0; x < 4; x++) /* a ragged end repeats a key */                                              \
                quad[x] = kr[o + x < cnt ? o + x : cnt - 1] + (int64_t)g * d;                                         \
            for (int h = g * grp; h < (g + 1) * grp; h += HQ) {                                                       \
                const int nh = (g + 1) * grp - h < HQ ? (g + 1) * grp - h : HQ;                                       \
                QCASE(nh, QK, qv + (int64_t)h * d, quad, d, scale, s + h * DEC_CH + o)                                \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
    dec_softmax(s, cnt, nkv * grp, m, l, corr, softcap);                                                              \
    for (int g = 0; g < nkv; g++)                                                                                     \
        for (int h = g * grp; h < (g + 1) * grp; h += 4) {                                                            \
            const int nh = (g + 1) * grp - h < 4 ? (g + 1) * grp - h : 4;                                             \
            float *ah = acc + (int64_t)h * d;                                                                         \
            const float *sh = s + h * DEC_CH, *ch = corr + h;                                                         \
            for (int c = 0; c < d; c += CW) {                                                                         \
                if (d - c >= CW) {                                                                                    \
                    UPTO4_CASE(nh, PV, vr, (int64_t)g * d, cnt, sh, ch, ah, d, c, 2)                                  \
                } else {                                                                                              \
                    UPTO4_CASE(nh, PV, vr, (int64_t)g * d, cnt, sh, ch, ah, d, c, 1)                                  \
                }                                                                                                     \
            }                                                                                                         \
        }

/* acc[h][c0 .. c0 + 8 w) = acc * corr[h] + sum_o s[h][o] V[o][voff + c0 ..] for heads h < nh (<= 4), w 1 or 2
 * vectors (voff: the kv head's first element in a row). */
#define DEFINE_DEC_PV(SUFFIX, KT, LOADKV)                                                                             \
static inline __attribute__((always_inline)) void dec_pv_##SUFFIX(const KT *const *vr, int64_t voff, int cnt,        \
                                                                  const float *s, const float *corr, float *acc,      \
                                                                  int d, int c0, const int w, const int nh) {         \
    __m256 a0[4], a1[4];                                                                                              \
    for (int h = 0; h < nh; h++) {                                                                                    \
        const __m256 cv = _mm256_set1_ps(corr[h]);                                                                    \
        a0[h] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c0), cv);                                                 \
        a1[h] = w > 1 ? _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c0 + 8), cv) : a0[h];                             \
    }                                                                                                                 \
    for (int o = 0; o < cnt; o++) {                                                                                   \
        const __m256 v0 = LOADKV(vr[o] + voff + c0), v1 = w > 1 ? LOADKV(vr[o] + voff + c0 + 8) : v0;                 \
        for (int h = 0; h < nh; h++) {                                                                                \
            const __m256 pb = _mm256_broadcast_ss(s + h * DEC_CH + o);                                                \
            a0[h] = _mm256_fmadd_ps(pb, v0, a0[h]);                                                                   \
            if (w > 1) a1[h] = _mm256_fmadd_ps(pb, v1, a1[h]);                                                        \
        }                                                                                                             \
    }                                                                                                                 \
    for (int h = 0; h < nh; h++) {                                                                                    \
        _mm256_storeu_ps(acc + h * d + c0, a0[h]);                                                                    \
        if (w > 1) _mm256_storeu_ps(acc + h * d + c0 + 8, a1[h]);                                                     \
    }                                                                                                                 \
}                                                                                                                     \
                                                                                                                      \
/* s[h][o .. o + 4) = q_h . K[o ..] * scale for heads h < nh (<= 2): four keys a pass, each K vector loaded once. */ \
static inline __attribute__((always_inline)) void dec_qk4_##SUFFIX(const float *qg, const KT *const *kr, int d,     \
                                                                   float scale, float *s, const int nh) {             \
    __m256 a[2][4];                                                                                                   \
    for (int h = 0; h < nh; h++)                                                                                      \
        for (int x = 0; x < 4; x++) a[h][x] = _mm256_setzero_ps();                                                    \
    for (int i = 0; i < d; i += 8) {                                                                                  \
        const __m256 k0 = LOADKV(kr[0] + i), k1 = LOADKV(kr[1] + i), k2 = LOADKV(kr[2] + i), k3 = LOADKV(kr[3] + i);  \
        for (int h = 0; h < nh; h++) {                                                                                \
            const __m256 qv = _mm256_loadu_ps(qg + h * d + i);                                                        \
            a[h][0] = _mm256_fmadd_ps(qv, k0, a[h][0]);                                                               \
            a[h][1] = _mm256_fmadd_ps(qv, k1, a[h][1]);                                                               \
            a[h][2] = _mm256_fmadd_ps(qv, k2, a[h][2]);                                                               \
            a[h][3] = _mm256_fmadd_ps(qv, k3, a[h][3]);                                                               \
        }                                                                                                             \
    }                                                                                                                 \
    for (int h = 0; h < nh; h++)                                                                                      \
        _mm_storeu_ps(s + h * DEC_CH, _mm_mul_ps(hsum4(a[h][0], a[h][1], a[h][2], a[h][3]), _mm_set1_ps(scale)));     \
}                                                                                                                     \
                                                                                                                      \
/* One chunk of cnt keys (rows kr, vr) for every kv head and the grp query heads that share it (DEC_CHUNK_BODY). */ \
static void dec_chunk_##SUFFIX(const float *qv, const KT *const *kr, const KT *const *vr, int cnt, int nkv, int grp,  \
                               int d, float scale, float softcap, float *acc, float *m, float *l, float *s,           \
                               float *corr, const DecAhead *ahead) {                                                  \
    DEC_CHUNK_BODY(KT, dec_qk4_##SUFFIX, UPTO2_CASE, 2, dec_pv_##SUFFIX, 16)                                          \
}                                                                                                                     \
                                                                                                                      \
static void decode_split_##SUFFIX(const float *q, const KT *k_base, const KT *v_base, const int32_t *bt, int bs,      \
                                  int64_t kv_stride, int p0, int p1, int nkv, int grp, int d, float scale,            \
                                  float softcap, float *acc, float *m, float *l, float *s, float *corr) {             \
    dec_start(acc, m, l, nkv * grp, d);                                                                               \
    DEC_SPLIT_CHUNKS(KT, dec_chunk_##SUFFIX, q)                                                                       \
}

/* fp8 -> fp32 through fp16. e5m2 is an fp16's top byte. An e4m3 byte's seven bits below the sign, put seven
 * bits up in an fp16 (sign to bit 15), make the fp16 of its value / 256, subnormals included (e4m3's exponent
 * bias is 7, fp16's 15); its NaN (all seven bits set) gets an fp16 NaN's exponent and mantissa bits. */
static inline __m256 load_kv_f32(const float *p) { return _mm256_loadu_ps(p); }
static inline __m256 load_e4m3(const uint8_t *p) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7f));
    __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    h = _mm_or_si128(h, _mm_and_si128(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7e00)));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0f));
}
static inline __m256 load_e5m2(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
}
DEFINE_DEC_PV(f32, float, load_kv_f32)
DEFINE_DEC_PV(bf16, uint16_t, load_bf16)
DEFINE_DEC_PV(e4m3, uint8_t, load_e4m3)
DEFINE_DEC_PV(e5m2, uint8_t, load_e5m2)

/*
 * Decode items on AVX-512F (head size a multiple of 32): the same items, chunks and online softmax as above,
 * 16 lanes wide. A 32-element slice of a K or V row widens to two fp32 vectors; a bf16 slice with one load
 * and two integer operations, its even elements (x << 16) in the first vector and its odd ones (x with the
 * low half cleared) in the second. The query is laid in that order once per item (qp) and the output sums
 * stay in it until the split ends (dec512_unlay), so no lane is moved per key; an e4m3 slice is looked up as
 * bf16 words and widened the same way. fp32 and e5m2 slices keep their order (elements 0-15, 16-31). Scores: four keys by up to four heads a pass, each K slice loaded once
 * for all of them; P V: up to four heads by 64 lanes of d, each V slice loaded once.
 */
AVX512_TARGET static inline __attribute__((always_inline)) void dwiden_bf16(const uint16_t *p, __m512 *a, __m512 *b) {
    const __m512i x = _mm512_loadu_si512((const void *)p);
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *b = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xffff0000u)));
}
AVX512_TARGET static inline __attribute__((always_inline)) void dwiden_f32(const float *p, __m512 *a, __m512 *b) {
    *a = _mm512_loadu_ps(p);
    *b = _mm512_loadu_ps(p + 16);
}
/* The bf16 bits of e4m3's 128 magnitudes, code 8 e + m: m 2^-9 for e = 0, (1 + m / 8) 2^(e - 7) after, code 127 NaN
 * (every value exact in bf16), as four tables of 32 words for vpermi2w (dwiden_e4m3). */
static const uint16_t E4M3_BF16[128] __attribute__((aligned(64))) = {
    0x0000, 0x3b00, 0x3b80, 0x3bc0, 0x3c00, 0x3c20, 0x3c40, 0x3c60,
    0x3c80, 0x3c90, 0x3ca0, 0x3cb0, 0x3cc0, 0x3cd0, 0x3ce0, 0x3cf0,
    0x3d00, 0x3d10, 0x3d20, 0x3d30, 0x3d40, 0x3d50, 0x3d60, 0x3d70,
    0x3d80, 0x3d90, 0x3da0, 0x3db0, 0x3dc0, 0x3dd0, 0x3de0, 0x3df0,
    0x3e00, 0x3e10, 0x3e20, 0x3e30, 0x3e40, 0x3e50, 0x3e60, 0x3e70,
    0x3e80, 0x3e90, 0x3ea0, 0x3eb0, 0x3ec0, 0x3ed0, 0x3ee0, 0x3ef0,
    0x3f00, 0x3f10, 0x3f20, 0x3f30, 0x3f40, 0x3f50, 0x3f60, 0x3f70,
    0x3f80, 0x3f90, 0x3fa0, 0x3fb0, 0x3fc0, 0x3fd0, 0x3fe0, 0x3ff0,
    0x4000, 0x4010, 0x4020, 0x4030, 0x4040, 0x4050, 0x4060, 0x4070,
    0x4080, 0x4090, 0x40a0, 0x40b0, 0x40c0, 0x40d0, 0x40e0, 0x40f0,
    0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
    0x4180, 0x4190, 0x41a0, 0x41b0, 0x41c0, 0x41d0, 0x41e0, 0x41f0,
    0x4200, 0x4210, 0x4220, 0x4230, 0x4240, 0x4250, 0x4260, 0x4270,
    0x4280, 0x4290, 0x42a0, 0x42b0, 0x42c0, 0x42d0, 0x42e0, 0x42f0,
    0x4300, 0x4310, 0x4320, 0x4330, 0x4340, 0x4350, 0x4360, 0x4370,
    0x4380, 0x4390, 0x43a0, 0x43b0, 0x43c0, 0x43d0, 0x43e0, 0x7fc0,
};

/* 32 e4m3 bytes widened as a bf16 slice is (dwiden_bf16: even elements, then odd): each magnitude's bf16 looked up
 * (two vpermi2w over 64 words, bit 6 choosing), the sign moved to bit 15; e5m2 as in load_e5m2, elements in order. */
AVX512_TARGET static inline __attribute__((always_inline)) void dwiden_e4m3(const uint8_t *p, __m512 *a, __m512 *b) {
    const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p));
    const __m512i *t = (const __m512i *)E4M3_BF16;
    const __m512i lo = _mm512_permutex2var_epi16(_mm512_load_si512(t), x, _mm512_load_si512(t + 1));
    const __m512i hi = _mm512_permutex2var_epi16(_mm512_load_si512(t + 2), x, _mm512_load_si512(t + 3));
    __m512i w = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40)), lo, hi);
    w = _mm512_ternarylogic_epi32(w, _mm512_slli_epi16(x, 8), _mm512_set1_epi16((short)0x8000), 0xf8); /* w | sign */
    *a = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    *b = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32((int)0xffff0000u)));
}
AVX512_TARGET static inline __attribute__((always_inline)) void dwiden_e5m2(const uint8_t *p, __m512 *a, __m512 *b) {
    const __m512i h = _mm512_slli_epi16(_mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)), 8);
    *a = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
    *b = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

/* The lanes of a bf16 slice's two vectors: even elements, then odd (permutex2var indices over q[0..16), q[16..32)),
 * and back. */
AVX512_TARGET static inline void dec512_lay(const float *q, float *qp, int n) {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int i = 0; i < n; i += 32) {
        const __m512 lo = _mm512_loadu_ps(q + i), hi = _mm512_loadu_ps(q + i + 16);
        _mm512_storeu_ps(qp + i, _mm512_permutex2var_ps(lo, ev, hi));
        _mm512_storeu_ps(qp + i + 16, _mm512_permutex2var_ps(lo, od, hi));
    }
}
AVX512_TARGET static inline void dec512_unlay(float *acc, int n) {
    const __m512i lo = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i hi = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    for (int i = 0; i < n; i += 32) {
        const __m512 e = _mm512_loadu_ps(acc + i), o = _mm512_loadu_ps(acc + i + 16);
        _mm512_storeu_ps(acc + i, _mm512_permutex2var_ps(e, lo, o));
        _mm512_storeu_ps(acc + i + 16, _mm512_permutex2var_ps(e, hi, o));
    }
}

/* A 16-lane vector's sum folded to 8 lanes (hsum4 then takes four of them). */
AVX512_TARGET static inline __m256 fold8(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

#define DEFINE_DEC512(SUFFIX, KT, WIDEN, EVENODD)                                                                     \
/* s[h][o .. o + 4) = q_h . K[o ..] * scale for heads h < nh (<= 4); qp laid as the slices widen. */                 \
AVX512_TARGET static inline __attribute__((always_inline)) void dec512_qk4_##SUFFIX(                                 \
    const float *qp, const KT *const *kr, int d, float scale, float *s, const int nh) {                               \
    __m512 a[4][4];                                                                                                   \
    for (int h = 0; h < nh; h++)                                                                                      \
        for (int x = 0; x < 4; x++) a[h][x] = _mm512_setzero_ps();                                                    \
    for (int i = 0; i < d; i += 32) {                                                                                 \
        __m512 ke[4], ko[4];                                                                                          \
        for (int x = 0; x < 4; x++) WIDEN(kr[x] + i, &ke[x], &ko[x]);                                                 \
        for (int h = 0; h < nh; h++) {                                                                                \
            const __m512 qe = _mm512_loadu_ps(qp + h * d + i), qo = _mm512_loadu_ps(qp + h * d + i + 16);             \
            for (int x = 0; x < 4; x++) a[h][x] = _mm512_fmadd_ps(qo, ko[x], _mm512_fmadd_ps(qe, ke[x], a[h][x]));   \
        }                                                                                                             \
    }                                                                                                                 \
    for (int h = 0; h < nh; h++)                                                                                      \
        _mm_storeu_ps(s + h * DEC_CH, _mm_mul_ps(hsum4(fold8(a[h][0]), fold8(a[h][1]), fold8(a[h][2]),                \
                                                       fold8(a[h][3])), _mm_set1_ps(scale)));                         \
}                                                                                                                     \
                                                                                                                      \
/* acc[h][c0 .. c0 + 32 w) = acc * corr[h] + sum_o s[h][o] V[o][voff + c0 ..] for heads h < nh (<= 4), w 1 or 2    \
 * slices. */                                                                                                         \
AVX512_TARGET static inline __attribute__((always_inline)) void dec512_pv_##SUFFIX(                                  \
    const KT *const *vr, int64_t voff, int cnt, const float *s, const float *corr, float *acc, int d, int c0,         \
    const int w, const int nh) {                                                                                      \
    __m512 a[4][4];                                                                                                   \
    for (int h = 0; h < nh; h++) {                                                                                    \
        const __m512 cv = _mm512_set1_ps(corr[h]);                                                                    \
        for (int x = 0; x < 2 * w; x++) a[h][x] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * d + c0 + 16 * x), cv);     \
    }                                                                                                                 \
    for (int o = 0; o < cnt; o++) {                                                                                   \
        __m512 v[4];                                                                                                  \
        for (int x = 0; x < w; x++) WIDEN(vr[o] + voff + c0 + 32 * x, &v[2 * x], &v[2 * x + 1]);                      \
        for (int h = 0; h < nh; h++) {                                                                                \
            const __m512 pb = _mm512_set1_ps(s[h * DEC_CH + o]);                                                      \
            for (int x = 0; x < 2 * w; x++) a[h][x] = _mm512_fmadd_ps(pb, v[x], a[h][x]);                             \
        }                                                                                                             \
    }                                                                                                                 \
    for (int h = 0; h < nh; h++)                                                                                      \
        for (int x = 0; x < 2 * w; x++) _mm512_storeu_ps(acc + h * d + c0 + 16 * x, a[h][x]);                         \
}                                                                                                                     \
                                                                                                                      \
/* dec_chunk_<type>'s chunk on AVX-512F. */                                                                          \
AVX512_TARGET static void dec512_chunk_##SUFFIX(const float *qv, const KT *const *kr, const KT *const *vr, int cnt,  \
                                                int nkv, int grp, int d, float scale, float softcap, float *acc,      \
                                                float *m, float *l, float *s, float *corr, const DecAhead *ahead) {   \
    DEC_CHUNK_BODY(KT, dec512_qk4_##SUFFIX, UPTO4_CASE, 4, dec512_pv_##SUFFIX, 64)                                    \
}                                                                                                                     \
                                                                                                                      \
/* decode_split_<type>'s item on AVX-512F; qp: n_heads * d floats of scratch (the query laid for a bf16 cache; other \
 * caches read q as it is). */                                                                                        \
AVX512_TARGET static void decode_split512_##SUFFIX(const float *q, const KT *k_base, const KT *v_base,                \
                                                   const int32_t *bt, int bs, int64_t kv_stride, int p0, int p1,      \
                                                   int nkv, int grp, int d, float scale, float softcap, float *acc,   \
                                                   float *m, float *l, float *s, float *corr, float *qp) {            \
    dec_start(acc, m, l, nkv * grp, d);                                                                               \
    if (EVENODD) dec512_lay(q, qp, nkv * grp * d);                                                                    \
    DEC_SPLIT_CHUNKS(KT, dec512_chunk_##SUFFIX, (EVENODD ? qp : q))                                                   \
    if (EVENODD) dec512_unlay(acc, nkv * grp * d);                                                                    \
}

DEFINE_DEC512(f32, float, dwiden_f32, 0)
DEFINE_DEC512(bf16, uint16_t, dwiden_bf16, 1)
DEFINE_DEC512(e4m3, uint8_t, dwiden_e4m3, 1)
DEFINE_DEC512(e5m2, uint8_t, dwiden_e5m2, 0)

/*
 * Prefill tiles: a run of ATT_QT consecutive query tokens of one request, with the grp query heads that share
 * one kv head, attend together, so each key and value feeds up to ATT_QT * grp query rows per read. A
 * request's K and V for one kv head are widened to fp32 once per call, for all its tiles (att_widen: K as
 * chunks of 16 positions transposed, [chunk][d][16]; V as rows, [pos][d]); a group of kv heads at a time, as
 * many as give every thread ATT_HEAD_ITEMS tiles (a short chunk beside decodes has few tiles a head), their
 * tiles shared out together. Per chunk of keys: S = Q K^T over
 * register tiles of four rows by 16 keys; an online softmax per row (running max and sum, the output rescaled
 * when the max grows); O += P V over four rows by 16 (or 8) lanes of d. Row i is token t0 + i / grp, head
 * i % grp; token t sees the positions below its n_vis (the causal mask within the run). The sums run in
 * another order than attend_item's, so the two agree to rounding, not bit for bit.
 */
#define ATT_QT 16       /* query tokens per tile */
#define ATT_KC 16       /* key positions per chunk */
#define ATT_MIN_QUERY 8 /* a request's tokens in a step from which its queries go by tiles */
#define ATT_HEAD_ITEMS 8 /* tiles a thread from a group of kv heads widened together, at least (or all heads) */
#define ATT_LAID_BYTES (32 * 1024 * 1024) /* widened K and V of a group of kv heads, at most (or one head) */

/* S[i][0..16) = q_i . k_j over d for rows i < nr (<= 4); kt [d][16]. */
static inline __attribute__((always_inline)) void att_scores4(const float *qs, int d, const float *kt, float *s,
                                                              const int nr) {
    __m256 a0[4], a1[4];
    for (int i = 0; i < 4; i++) a0[i] = a1[i] = _mm256_setzero_ps();
    for (int c = 0; c < d; c++) {
        const __m256 k0 = _mm256_loadu_ps(kt + c * ATT_KC), k1 = _mm256_loadu_ps(kt + c * ATT_KC + 8);
        for (int i = 0; i < 4; i++)
            if (i < nr) {
                const __m256 qb = _mm256_broadcast_ss(qs + i * d + c);
                a0[i] = _mm256_fmadd_ps(qb, k0, a0[i]);
                a1[i] = _mm256_fmadd_ps(qb, k1, a1[i]);
            }
    }
    for (int i = 0; i < nr; i++) {
        _mm256_storeu_ps(s + i * ATT_KC, a0[i]);
        _mm256_storeu_ps(s + i * ATT_KC + 8, a1[i]);
    }
}

/* O[i][c0 .. c0 + 8 w) += sum_j P[i][j] V[j][c0 ..] for rows i < nr (<= 4), w 1 or 2 vectors; o rows d apart. */
static inline __attribute__((always_inline)) void att_pv4(const float *p, const float *vb, int d, int c0, float *o,
                                                          const int w, int cnt, const int nr) {
    __m256 a0[4], a1[4];
    for (int i = 0; i < nr; i++) {
        a0[i] = _mm256_loadu_ps(o + i * d + c0);
        a1[i] = w > 1 ? _mm256_loadu_ps(o + i * d + c0 + 8) : _mm256_setzero_ps();
    }
    for (int j = 0; j < cnt; j++) {
        const __m256 v0 = _mm256_loadu_ps(vb + j * d + c0), v1 = w > 1 ? _mm256_loadu_ps(vb + j * d + c0 + 8) : v0;
        for (int i = 0; i < 4; i++)
            if (i < nr) {
                const __m256 pb = _mm256_broadcast_ss(p + i * ATT_KC + j);
                a0[i] = _mm256_fmadd_ps(pb, v0, a0[i]);
                if (w > 1) a1[i] = _mm256_fmadd_ps(pb, v1, a1[i]);
            }
    }
    for (int i = 0; i < nr; i++) {
        _mm256_storeu_ps(o + i * d + c0, a0[i]);
        if (w > 1) _mm256_storeu_ps(o + i * d + c0 + 8, a1[i]);
    }
}

/* Positions [0, n) of one kv head (k_base, v_base at that head; rows kv_stride apart, slots through bt) widened to
 * fp32: kt [ceil(n / 16)][d][16] (zero past n), vb [n][d]. Threads split the chunks. */
#define DEFINE_ATT_WIDEN(SUFFIX, KT, LOADKV)                                                                          \
static void att_widen_##SUFFIX(const KT *k_base, const KT *v_base, const int32_t *bt, int bs, int64_t kv_stride,     \
                               int n, int d, float *kt, float *vb) {                                                  \
    const int chunks = (n + ATT_KC - 1) / ATT_KC;                                                                     \
    _Pragma("omp for schedule(static)")                                                                               \
    for (int ch = 0; ch < chunks; ch++) {                                                                             \
        float *kc = kt + (int64_t)ch * d * ATT_KC;                                                                    \
        for (int j = 0; j < ATT_KC; j++) {                                                                            \
            const int pos = ch * ATT_KC + j;                                                                          \
            if (pos >= n) {                                                                                           \
                for (int c = 0; c < d; c++) kc[c * ATT_KC + j] = 0.0f;                                                \
                continue;                                                                                             \
            }                                                                                                         \
            const int64_t slot = (int64_t)bt[pos / bs] * bs + pos % bs;                                               \
            const KT *kr = k_base + slot * kv_stride, *vr = v_base + slot * kv_stride;                                \
            for (int c = 0; c < d; c += 8) {                                                                          \
                float tmp[8];                                                                                         \
                _mm256_storeu_ps(tmp, LOADKV(kr + c));                                                                \
                for (int l = 0; l < 8; l++) kc[(c + l) * ATT_KC + j] = tmp[l];                                        \
                _mm256_storeu_ps(vb + (int64_t)pos * d + c, LOADKV(vr + c));                                          \
            }                                                                                                         \
        }                                                                                                             \
    }                                                                                                                 \
}

DEFINE_ATT_WIDEN(f32, float, load_kv_f32)
DEFINE_ATT_WIDEN(bf16, uint16_t, load_bf16)
DEFINE_ATT_WIDEN(e4m3, uint8_t, load_e4m3)
DEFINE_ATT_WIDEN(e5m2, uint8_t, load_e5m2)

/* Scratch floats for a tile of `rows` query rows of head size d. */
static inline int64_t att_tile_floats(int rows, int d) { return (int64_t)rows * (2 * d + ATT_KC + 3); }

/* A tile's O rows normalised into out: row i (token i / grp, head i % grp) times v_scale / sum[i]. */
static void att_tile_finish(const float *o, const float *sum, float *out, int64_t ldo, int rows, int grp, int d,
                            float v_scale) {
    for (int i = 0; i < rows; i++) {
        const __m256 fv = _mm256_set1_ps(v_scale / sum[i]);
        float *oi = out + (int64_t)(i / grp) * ldo + (i % grp) * d;
        for (int c = 0; c < d; c += 8) _mm256_storeu_ps(oi + c, _mm256_mul_ps(_mm256_loadu_ps(o + i * d + c), fv));
    }
}

/* One tile: ntok tokens (q, out rows ldq / ldo apart, at the group's first head) of a request whose first token
 * here sees n_vis0 positions; kt, vb: that kv head's widened K and V. */
static void attend_tile(const float *q, int64_t ldq, float *out, int64_t ldo, const float *kt, const float *vb,
                        int ntok, int n_vis0, int grp, int d, float scale, float v_scale, float *scr) {
    const int rows = ntok * grp;
    float *qs = scr, *o = qs + rows * d, *sc = o + rows * d, *mx = sc + rows * ATT_KC, *sum = mx + rows;
    int *vis = (int *)(sum + rows);
    for (int i = 0; i < rows; i++) {
        memcpy(qs + i * d, q + (int64_t)(i / grp) * ldq + (i % grp) * d, sizeof(float) * (size_t)d);
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
        vis[i] = n_vis0 + i / grp;
    }
    memset(o, 0, sizeof(float) * (size_t)(rows * d));
    const __m256 lane0 = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), lane1 = _mm256_add_ps(lane0, _mm256_set1_ps(8.0f));
    const __m256 ninf = _mm256_set1_ps(-INFINITY), sv = _mm256_set1_ps(scale);
    const int n_max = n_vis0 + ntok - 1;
    for (int j0 = 0; j0 < n_max; j0 += ATT_KC) {
        const int cnt = n_max - j0 < ATT_KC ? n_max - j0 : ATT_KC;
        const float *kc = kt + (int64_t)(j0 / ATT_KC) * d * ATT_KC, *vc = vb + (int64_t)j0 * d;
        for (int i0 = 0; i0 < rows; i0 += 4) {
            const int nr = rows - i0 < 4 ? rows - i0 : 4;
            UPTO4_CASE(nr, att_scores4, qs + i0 * d, d, kc, sc + i0 * ATT_KC)
        }
        for (int i = 0; i < rows; i++) { /* scale, mask, online softmax */
            float *si = sc + i * ATT_KC;
            const int lim = vis[i] - j0 < cnt ? vis[i] - j0 : cnt; /* keys of this chunk row i sees */
            if (lim <= 0) { /* none: weights 0 */
                memset(si, 0, sizeof(float) * ATT_KC);
                continue;
            }
            const __m256 lv = _mm256_set1_ps((float)lim);
            const __m256 m0 = _mm256_cmp_ps(lane0, lv, _CMP_LT_OQ), m1 = _mm256_cmp_ps(lane1, lv, _CMP_LT_OQ);
            const __m256 s0 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(si), sv), m0);
            const __m256 s1 = _mm256_blendv_ps(ninf, _mm256_mul_ps(_mm256_loadu_ps(si + 8), sv), m1);
            const float bm = hmax8(_mm256_max_ps(s0, s1));
            if (bm > mx[i]) {
                if (mx[i] != -INFINITY) {
                    const float corr = expf(mx[i] - bm);
                    sum[i] *= corr;
                    const __m256 cv = _mm256_set1_ps(corr);
                    for (int c = 0; c < d; c += 8) _mm256_storeu_ps(o + i * d + c, _mm256_mul_ps(_mm256_loadu_ps(o + i * d + c), cv));
                }
                mx[i] = bm;
            }
            const __m256 mv = _mm256_set1_ps(mx[i]);
            /* exp8 clamps its argument, so masked keys are zeroed after it */
            const __m256 e0 = _mm256_and_ps(exp8(_mm256_sub_ps(s0, mv)), m0), e1 = _mm256_and_ps(exp8(_mm256_sub_ps(s1, mv)), m1);
            _mm256_storeu_ps(si, e0);
            _mm256_storeu_ps(si + 8, e1);
            sum[i] += hsum8(_mm256_add_ps(e0, e1));
        }
        for (int i0 = 0; i0 < rows; i0 += 4) {
            const int nr = rows - i0 < 4 ? rows - i0 : 4;
            for (int c0 = 0; c0 < d; c0 += 16) {
                if (d - c0 >= 16) {
                    UPTO4_CASE(nr, att_pv4, sc + i0 * ATT_KC, vc, d, c0, o + i0 * d, 2, cnt)
                } else {
                    UPTO4_CASE(nr, att_pv4, sc + i0 * ATT_KC, vc, d, c0, o + i0 * d, 1, cnt)
                }
            }
        }
    }
    att_tile_finish(o, sum, out, ldo, rows, grp, d, v_scale);
}

/*
 * The same tile on AVX-512F, where the CPU has it (appl_avx512): a chunk's 16 keys are one zmm, so S takes
 * eight rows a pass (one K load feeds eight FMAs), the softmax a row a register (masked, exp16), and P V four
 * rows by up to 64 lanes of d (an 8-lane tail masked).
 */
AVX512_TARGET static inline __attribute__((always_inline)) void att_scores8_512(const float *qs, int d, const float *kt,
                                                                               float *s, const int nr) {
    __m512 a[8];
    for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
    for (int c = 0; c < d; c++) {
        const __m512 k = _mm512_loadu_ps(kt + c * ATT_KC);
        for (int i = 0; i < 8; i++)
            if (i < nr) a[i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[i * d + c]), k, a[i]);
    }
    for (int i = 0; i < nr; i++) _mm512_storeu_ps(s + i * ATT_KC, a[i]);
}

/* O[i][c0 .. c0 + 16 nv) += sum_j P[i][j] V[j][c0 ..] for rows i < nr (<= 4); the last vector's lanes by tail. */
AVX512_TARGET static inline __attribute__((always_inline)) void att_pv4_512(const float *p, const float *vb, int d,
                                                                           int c0, float *o, int cnt,
                                                                           __mmask16 tail, const int nv,
                                                                           const int nr) {
    __m512 a[4][4];
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < nv; v++)
            a[i][v] = _mm512_maskz_loadu_ps(v == nv - 1 ? tail : 0xffff, o + i * d + c0 + 16 * v);
    for (int j = 0; j < cnt; j++) {
        __m512 vv[4];
        for (int v = 0; v < nv; v++) vv[v] = _mm512_maskz_loadu_ps(v == nv - 1 ? tail : 0xffff, vb + j * d + c0 + 16 * v);
        for (int i = 0; i < 4; i++)
            if (i < nr) {
                const __m512 pb = _mm512_set1_ps(p[i * ATT_KC + j]);
                for (int v = 0; v < nv; v++) a[i][v] = _mm512_fmadd_ps(pb, vv[v], a[i][v]);
            }
    }
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(o + i * d + c0 + 16 * v, v == nv - 1 ? tail : 0xffff, a[i][v]);
}

/* P V over the columns of d on AVX-512, up to 64 lanes (NV vectors) at a time, a masked 8-lane tail (d is a
 * multiple of 8); ROWS(NV) runs one block of rows. */
#define ATT_PV512_COLUMNS(ROWS)                                                                     \
    for (int c0 = 0; c0 < d; c0 += 64) {                                                            \
        const int left = d - c0, nv = left >= 64 ? 4 : (left + 15) / 16;                            \
        const __mmask16 tail = left >= 64 || left % 16 == 0 ? 0xffff : 0x00ff;                      \
        switch (nv) {                                                                               \
        case 4: ROWS(4) break;                                                                      \
        case 3: ROWS(3) break;                                                                      \
        case 2: ROWS(2) break;                                                                      \
        default: ROWS(1) break;                                                                     \
        }                                                                                           \
    }

/* A row's running max raised to the largest lane of mv where that is larger, its O scaled to match, on AVX-512;
 * returns the factor the row's sum so far takes (1 where the max stays). The lanes are compared first, so a
 * chunk that does not raise the max takes no reduction across them. */
AVX512_TARGET static inline float att_raise_max512(float *o, int d, float *mx, __m512 mv) {
    if (!_mm512_cmp_ps_mask(mv, _mm512_set1_ps(*mx), _CMP_GT_OQ)) return 1.0f;
    const float bm = _mm512_reduce_max_ps(mv);
    float corr = 0.0f; /* a first max: nothing summed yet */
    if (*mx != -INFINITY) {
        corr = expf(*mx - bm);
        const __m512 cv = _mm512_set1_ps(corr);
        int c = 0;
        for (; c + 16 <= d; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), cv));
        if (c < d) _mm256_storeu_ps(o + c, _mm256_mul_ps(_mm256_loadu_ps(o + c), _mm256_set1_ps(corr)));
    }
    *mx = bm;
    return corr;
}

#define ATT_PV512_ROWS(NV)                                                                          \
    switch (nr) {                                                                                   \
    case 4: att_pv4_512(sc + i0 * ATT_KC, vc, d, c0, o + i0 * d, cnt, tail, NV, 4); break;          \
    case 3: att_pv4_512(sc + i0 * ATT_KC, vc, d, c0, o + i0 * d, cnt, tail, NV, 3); break;          \
    case 2: att_pv4_512(sc + i0 * ATT_KC, vc, d, c0, o + i0 * d, cnt, tail, NV, 2); break;          \
    default: att_pv4_512(sc + i0 * ATT_KC, vc, d, c0, o + i0 * d, cnt, tail, NV, 1); break;         \
    }

AVX512_TARGET static void attend_tile512(const float *q, int64_t ldq, float *out, int64_t ldo, const float *kt,
                                         const float *vb, int ntok, int n_vis0, int grp, int d, float scale,
                                         float v_scale, float *scr) {
    const int rows = ntok * grp;
    float *qs = scr, *o = qs + rows * d, *sc = o + rows * d, *mx = sc + rows * ATT_KC, *sum = mx + rows;
    int *vis = (int *)(sum + rows);
    for (int i = 0; i < rows; i++) {
        memcpy(qs + i * d, q + (int64_t)(i / grp) * ldq + (i % grp) * d, sizeof(float) * (size_t)d);
        mx[i] = -INFINITY;
        sum[i] = 0.0f;
        vis[i] = n_vis0 + i / grp;
    }
    memset(o, 0, sizeof(float) * (size_t)(rows * d));
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sv = _mm512_set1_ps(scale);
    const int n_max = n_vis0 + ntok - 1;
    for (int j0 = 0; j0 < n_max; j0 += ATT_KC) {
        const int cnt = n_max - j0 < ATT_KC ? n_max - j0 : ATT_KC;
        const float *kc = kt + (int64_t)(j0 / ATT_KC) * d * ATT_KC, *vc = vb + (int64_t)j0 * d;
        for (int i0 = 0; i0 < rows; i0 += 8) {
            const int nr = rows - i0 < 8 ? rows - i0 : 8;
            UPTO8_CASE(nr, att_scores8_512, qs + i0 * d, d, kc, sc + i0 * ATT_KC)
        }
        for (int i = 0; i < rows; i++) { /* scale, mask, online softmax */
            float *si = sc + i * ATT_KC;
            const int lim = vis[i] - j0 < cnt ? vis[i] - j0 : cnt;
            if (lim <= 0) {
                _mm512_storeu_ps(si, _mm512_setzero_ps());
                continue;
            }
            const __mmask16 m = _mm512_cmp_ps_mask(lanes, _mm512_set1_ps((float)lim), _CMP_LT_OQ);
            const __m512 sm = _mm512_mask_blend_ps(m, ninf, _mm512_mul_ps(_mm512_loadu_ps(si), sv));
            sum[i] *= att_raise_max512(o + i * d, d, mx + i, sm);
            const __m512 e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(sm, _mm512_set1_ps(mx[i]))));
            _mm512_storeu_ps(si, e);
            sum[i] += _mm512_reduce_add_ps(e);
        }
        for (int i0 = 0; i0 < rows; i0 += 4) {
            const int nr = rows - i0 < 4 ? rows - i0 : 4;
            ATT_PV512_COLUMNS(ATT_PV512_ROWS)
        }
    }
    att_tile_finish(o, sum, out, ldo, rows, grp, d, v_scale);
}

/*
 * The same tile on AVX512-BF16 (the bf16_attention switch) over a bf16 or fp8 cache, whose K and V are
 * bf16 values exactly: S and P V on vdpbf16ps, two products a lane an instruction. The query rows and the
 * softmax weights P are rounded to bf16 (nearest even) on the way in; sums, the running max and the
 * normaliser stay fp32 (the normaliser sums the unrounded weights). K and V go in pairs, as vdpbf16ps takes
 * them: K per chunk of 32 keys as [d / 2][32] words (a word: channels 2p and 2p + 1 of one key, as the cache
 * row holds them), V as [pos / 2][d] words (a word: one channel of keys 2jp and 2jp + 1), so a 32-key chunk
 * is d / 2 zmm of K for eight score rows a pass, and 16 key pairs for P V over four rows by up to 64 lanes.
 */
#define ATB_KC 32 /* key positions per chunk */

/* Positions [0, n) of one kv head as bf16 pairs: kt [ceil(n / 32)][d / 2][32], vb [ceil(n / 32) * 16][d]
 * (zero past n). The cache's values are bf16 values exactly (bf16, or fp8 widened), so nothing rounds. */
#define DEFINE_ATT_PAIRS(SUFFIX, KT, LOADKV)                                                                          \
static void att_pairs_##SUFFIX(const KT *k_base, const KT *v_base, const int32_t *bt, int bs, int64_t kv_stride,     \
                               int n, int d, uint32_t *kt, uint32_t *vb) {                                            \
    const int chunks = (n + ATB_KC - 1) / ATB_KC, dp = d / 2;                                                         \
    uint16_t k16[d], v16[d];                                                                                          \
    _Pragma("omp for schedule(static)")                                                                               \
    for (int ch = 0; ch < chunks; ch++) {                                                                             \
        uint32_t *kc = kt + (int64_t)ch * dp * ATB_KC, *vc = vb + (int64_t)ch * (ATB_KC / 2) * d;                     \
        for (int j = 0; j < ATB_KC; j++) {                                                                            \
            const int pos = ch * ATB_KC + j;                                                                          \
            if (pos < n) {                                                                                            \
                const int64_t slot = (int64_t)bt[pos / bs] * bs + pos % bs;                                           \
                const KT *kr = k_base + slot * kv_stride, *vr = v_base + slot * kv_stride;                            \
                for (int c = 0; c < d; c += 8) {                                                                      \
                    uint32_t tk[8], tv[8];                                                                            \
                    _mm256_storeu_si256((__m256i *)tk, _mm256_castps_si256(LOADKV(kr + c)));                          \
                    _mm256_storeu_si256((__m256i *)tv, _mm256_castps_si256(LOADKV(vr + c)));                          \
                    for (int l = 0; l < 8; l++) k16[c + l] = (uint16_t)(tk[l] >> 16), v16[c + l] = (uint16_t)(tv[l] >> 16); \
                }                                                                                                     \
            } else {                                                                                                  \
                memset(k16, 0, sizeof(uint16_t) * (size_t)d);                                                         \
                memset(v16, 0, sizeof(uint16_t) * (size_t)d);                                                         \
            }                                                                                                         \
            for (int p = 0; p < dp; p++) kc[p * ATB_KC + j] = (uint32_t)k16[2 * p] | (uint32_t)k16[2 * p + 1] << 16;   \
            uint32_t *vp = vc + (int64_t)(j / 2) * d;                                                                 \
            if (j % 2 == 0)                                                                                           \
                for (int c = 0; c < d; c++) vp[c] = v16[c];                                                           \
            else                                                                                                      \
                for (int c = 0; c < d; c++) vp[c] |= (uint32_t)v16[c] << 16;                                          \
        }                                                                                                             \
    }                                                                                                                 \
}

DEFINE_ATT_PAIRS(bf16, uint16_t, load_bf16)
DEFINE_ATT_PAIRS(e4m3, uint8_t, load_e4m3)
DEFINE_ATT_PAIRS(e5m2, uint8_t, load_e5m2)

/* att_pairs_bf16 in vectors (d a multiple of 16): a bf16 cache's rows are the pairs' words already, so a chunk's
 * K rows are copied into rows (32 keys by d / 2 words) and gathered a word column at a time into [d / 2][32];
 * V's rows go two keys at a time, each channel's two values widened into one word (the first key's in the low
 * half). The same words as att_pairs_bf16 (tested). */
AVX512_TARGET static void att_pairs_bf16_words(const uint16_t *k_base, const uint16_t *v_base, const int32_t *bt, int bs,
                                         int64_t kv_stride, int n, int d, uint32_t *kt, uint32_t *vb) {
    const int chunks = (n + ATB_KC - 1) / ATB_KC, dp = d / 2;
    uint32_t rows[ATB_KC * dp];
    const __m512i lo = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(dp));
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(16 * dp));
    _Pragma("omp for schedule(static)")
    for (int ch = 0; ch < chunks; ch++) {
        uint32_t *kc = kt + (int64_t)ch * dp * ATB_KC, *vc = vb + (int64_t)ch * (ATB_KC / 2) * d;
        const uint16_t *vr[ATB_KC];
        for (int j = 0; j < ATB_KC; j++) {
            const int pos = ch * ATB_KC + j;
            uint32_t *row = rows + j * dp;
            if (pos < n) {
                const int64_t slot = (int64_t)bt[pos / bs] * bs + pos % bs;
                memcpy(row, k_base + slot * kv_stride, sizeof(uint16_t) * (size_t)d);
                vr[j] = v_base + slot * kv_stride;
            } else {
                memset(row, 0, sizeof(uint32_t) * (size_t)dp);
                vr[j] = NULL;
            }
        }
        for (int p = 0; p < dp; p++) {
            _mm512_storeu_si512(kc + p * ATB_KC, _mm512_i32gather_epi32(lo, (const int *)(rows + p), 4));
            _mm512_storeu_si512(kc + p * ATB_KC + 16, _mm512_i32gather_epi32(hi, (const int *)(rows + p), 4));
        }
        for (int j = 0; j < ATB_KC; j += 2) {
            uint32_t *vp = vc + (int64_t)(j / 2) * d;
            for (int c = 0; c < d; c += 16) {
                const __m512i a = vr[j] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[j] + c)))
                                        : _mm512_setzero_si512();
                const __m512i b = vr[j + 1] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vr[j + 1] + c)))
                                            : _mm512_setzero_si512();
                _mm512_storeu_si512(vp + c, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
            }
        }
    }
}

/* S[i][0..32) = q_i . k_j over d / 2 channel pairs for rows i < nr (<= 8); q rows dp words apart. */
DOT_TARGET static inline __attribute__((always_inline)) void atb_scores8(const uint32_t *qs, int dp, const uint32_t *kt,
                                                                         float *s, const int nr) {
    __m512 a0[8], a1[8];
    for (int i = 0; i < 8; i++) a0[i] = a1[i] = _mm512_setzero_ps();
    for (int p = 0; p < dp; p++) {
        const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + p * ATB_KC);
        const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + p * ATB_KC + 16);
        for (int i = 0; i < 8; i++)
            if (i < nr) {
                const __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qs[i * dp + p]);
                a0[i] = _mm512_dpbf16_ps(a0[i], qb, k0);
                a1[i] = _mm512_dpbf16_ps(a1[i], qb, k1);
            }
    }
    for (int i = 0; i < nr; i++) {
        _mm512_storeu_ps(s + i * ATB_KC, a0[i]);
        _mm512_storeu_ps(s + i * ATB_KC + 16, a1[i]);
    }
}

/* O[i][c0 .. c0 + 16 nv) += sum over key pairs of P[i] V for rows i < nr (<= 4); P rows 16 words apart; the last
 * vector's lanes by tail. */
DOT_TARGET static inline __attribute__((always_inline)) void atb_pv4(const uint32_t *p, const uint32_t *vb, int d,
                                                                     int c0, float *o, int npairs, __mmask16 tail,
                                                                     const int nv, const int nr) {
    __m512 a[4][4];
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < nv; v++)
            a[i][v] = _mm512_maskz_loadu_ps(v == nv - 1 ? tail : 0xffff, o + i * d + c0 + 16 * v);
    for (int jp = 0; jp < npairs; jp++) {
        __m512bh vv[4];
        for (int v = 0; v < nv; v++)
            vv[v] = (__m512bh)_mm512_maskz_loadu_epi32(v == nv - 1 ? tail : 0xffff, vb + (int64_t)jp * d + c0 + 16 * v);
        for (int i = 0; i < 4; i++)
            if (i < nr) {
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p[i * (ATB_KC / 2) + jp]);
                for (int v = 0; v < nv; v++) a[i][v] = _mm512_dpbf16_ps(a[i][v], pb, vv[v]);
            }
    }
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < nv; v++) _mm512_mask_storeu_ps(o + i * d + c0 + 16 * v, v == nv - 1 ? tail : 0xffff, a[i][v]);
}

#define ATB_PV_ROWS(NV)                                                                             \
    switch (nr) {                                                                                   \
    case 4: atb_pv4(pp + i0 * (ATB_KC / 2), vc, d, c0, o + i0 * d, npairs, tail, NV, 4); break;     \
    case 3: atb_pv4(pp + i0 * (ATB_KC / 2), vc, d, c0, o + i0 * d, npairs, tail, NV, 3); break;     \
    case 2: atb_pv4(pp + i0 * (ATB_KC / 2), vc, d, c0, o + i0 * d, npairs, tail, NV, 2); break;     \
    default: atb_pv4(pp + i0 * (ATB_KC / 2), vc, d, c0, o + i0 * d, npairs, tail, NV, 1); break;    \
    }

#define ATA_KC 128 /* key positions per chunk of the AMX tile: four of the pairs' 32-key chunks */

/* Scratch floats for a bf16 tile of `rows` query rows of head size d, chunks of kc keys: q pairs, O, S, P pairs,
 * max, sum, n_vis, the sums' 16 lanes. */
static inline int64_t atb_tile_floats(int rows, int d, int kc) { return (int64_t)rows * (d / 2 + d + kc + kc / 2 + 19); }

/* One chunk's scores (sc, nk a row: 32 or 128; keys j0 .. j0 + cnt) of rows [0, rows): scaled, masked past each
 * row's n_vis, the online softmax (running max and sum, O rescaled when the max grows), P rounded to bf16 pairs
 * (nk / 2 words a row, keys in order). */
/* exp for float lanes whose results are rounded to bf16 (the bf16 tiles' softmax weights): 2^n (vscalefps) times
 * 2^f by its Taylor polynomial to degree 5, x log2(e) = n + f, |f| <= 1/2: relative error under 1e-5 down to
 * exp(-100) (where x is clamped; the rounding of x log2(e) dominates), against bf16's 2^-9; half of exp16's
 * operations. */
AVX512_TARGET static inline __m512 exp16_bf16(__m512 x) {
    const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), _mm512_set1_ps(1.44269504088896341f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), f = _mm512_sub_ps(t, n);
    __m512 y = _mm512_set1_ps(1.5403530393381609e-4f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3333558146428443e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6181291076284772e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5504108664821580e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022650695910071e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718055994531e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, n);
}

DOT_TARGET static inline __attribute__((always_inline)) void atb_softmax(const float *sc, uint32_t *pp, float *o,
                                                                         float *mx, float *sumv, const int *vis,
                                                                         int rows, int d, int j0, int cnt, float scale,
                                                                         const int nk) {
    const __m512 lanes = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sv = _mm512_set1_ps(scale);
    for (int i = 0; i < rows; i++) { /* scale, mask, online softmax; P rounded to bf16 pairs */
        const float *si = sc + i * nk;
        uint32_t *pi = pp + i * (nk / 2);
        const int lim = vis[i] - j0 < cnt ? vis[i] - j0 : cnt;
        if (lim <= 0) {
            for (int u = 0; u < nk / 32; u++) _mm512_storeu_si512(pi + 16 * u, _mm512_setzero_si512());
            continue;
        }
        __m512 sx[ATA_KC / 16], mxv = ninf;
        __mmask16 mk[ATA_KC / 16];
        for (int v = 0; v < nk / 16; v++) {
            mk[v] = lim >= nk ? (__mmask16)0xffff /* every key of the chunk seen */
                              : _mm512_cmp_ps_mask(_mm512_add_ps(lanes, _mm512_set1_ps((float)(16 * v))),
                                                   _mm512_set1_ps((float)lim), _CMP_LT_OQ);
            sx[v] = _mm512_mask_blend_ps(mk[v], ninf, _mm512_mul_ps(_mm512_loadu_ps(si + 16 * v), sv));
            mxv = _mm512_max_ps(mxv, sx[v]);
        }
        const float f = att_raise_max512(o + i * d, d, mx + i, mxv);
        const __m512 mv = _mm512_set1_ps(mx[i]);
        __m512 acc = _mm512_loadu_ps(sumv + 16 * i); /* the sum in lanes, added across only at the end */
        if (f != 1.0f) acc = _mm512_mul_ps(acc, _mm512_set1_ps(f));
        for (int v = 0; v < nk / 16; v++) {
            sx[v] = _mm512_maskz_mov_ps(mk[v], exp16_bf16(_mm512_sub_ps(sx[v], mv)));
            acc = _mm512_add_ps(acc, sx[v]);
        }
        _mm512_storeu_ps(sumv + 16 * i, acc);
        for (int u = 0; u < nk / 32; u++) /* keys 32u .. 32u + 15 low, 32u + 16 .. 32u + 31 high */
            _mm512_storeu_si512(pi + 16 * u, (__m512i)_mm512_cvtne2ps_pbh(sx[2 * u + 1], sx[2 * u]));
    }
}

/* A bf16 tile's scratch (scr) for `rows` query rows with room for `cap` >= rows: q pairs, O, S, P pairs,
 * running max, sum, n_vis and the sum in 16 lanes (sumv, what the softmax adds to a chunk at a time; sum is
 * its lanes added, atb_sums); the rows past `rows` zero (q, P, O). Row i is token i / grp, head i % grp. */
typedef struct {
    uint32_t *qs, *pp;
    float *o, *sc, *mx, *sum, *sumv;
    int *vis;
} AtbScratch;

DOT_TARGET static AtbScratch atb_begin(const float *q, int64_t ldq, int rows, int cap, int n_vis0, int grp, int d,
                                       int kc, float *scr) {
    const int dp = d / 2;
    AtbScratch t;
    t.qs = (uint32_t *)scr;
    t.o = scr + (int64_t)cap * dp;
    t.sc = t.o + cap * d;
    t.pp = (uint32_t *)(t.sc + cap * kc);
    t.mx = (float *)(t.pp + cap * (kc / 2));
    t.sum = t.mx + cap;
    t.vis = (int *)(t.sum + cap);
    t.sumv = (float *)(t.vis + cap);
    for (int i = 0; i < rows; i++) {
        row_to_bf16(q + (int64_t)(i / grp) * ldq + (i % grp) * d, (uint16_t *)(t.qs + i * dp), d, d);
        t.mx[i] = -INFINITY;
        t.vis[i] = n_vis0 + i / grp;
    }
    memset(t.sumv, 0, sizeof(float) * (size_t)(16 * rows));
    memset(t.qs + rows * dp, 0, sizeof(uint32_t) * (size_t)((cap - rows) * dp));
    memset(t.pp + rows * (kc / 2), 0, sizeof(uint32_t) * (size_t)((cap - rows) * (kc / 2)));
    memset(t.o, 0, sizeof(float) * (size_t)(cap * d));
    return t;
}

/* Each row's sum: its 16 lanes added. */
AVX512_TARGET static void atb_sums(const AtbScratch *t, int rows) {
    for (int i = 0; i < rows; i++) t->sum[i] = _mm512_reduce_add_ps(_mm512_loadu_ps(t->sumv + 16 * i));
}

DOT_TARGET static void attend_tile_bf16(const float *q, int64_t ldq, float *out, int64_t ldo, const uint32_t *kt,
                                        const uint32_t *vb, int ntok, int n_vis0, int grp, int d, float scale,
                                        float v_scale, float *scr) {
    const int rows = ntok * grp, dp = d / 2;
    const AtbScratch t = atb_begin(q, ldq, rows, rows, n_vis0, grp, d, ATB_KC, scr);
    uint32_t *qs = t.qs, *pp = t.pp;
    float *o = t.o, *sc = t.sc, *mx = t.mx, *sum = t.sum;
    const int *vis = t.vis;
    const int n_max = n_vis0 + ntok - 1;
    for (int j0 = 0; j0 < n_max; j0 += ATB_KC) {
        const int cnt = n_max - j0 < ATB_KC ? n_max - j0 : ATB_KC, npairs = (cnt + 1) / 2;
        const uint32_t *kc = kt + (int64_t)(j0 / ATB_KC) * dp * ATB_KC, *vc = vb + (int64_t)(j0 / 2) * d;
        for (int i0 = 0; i0 < rows; i0 += 8) {
            const int nr = rows - i0 < 8 ? rows - i0 : 8;
            UPTO8_CASE(nr, atb_scores8, qs + i0 * dp, dp, kc, sc + i0 * ATB_KC)
        }
        atb_softmax(sc, pp, o, mx, t.sumv, vis, rows, d, j0, cnt, scale, ATB_KC);
        for (int i0 = 0; i0 < rows; i0 += 4) {
            const int nr = rows - i0 < 4 ? rows - i0 : 4;
            ATT_PV512_COLUMNS(ATB_PV_ROWS)
        }
    }
    atb_sums(&t, rows);
    att_tile_finish(o, sum, out, ldo, rows, grp, d, v_scale);
}

/*
 * The same tile on AMX-BF16 tiles (head sizes a multiple of 32), over the same pairs, a softmax step per
 * chunk of ATA_KC keys (four of the pairs' 32-key chunks): S = Q K^T as one row tile of 16 query rows (bf16,
 * d / 2 words) by a K tile of 16 channel pairs by 16 keys, read in place from a 32-key chunk's [d / 2][32]
 * words (rows 128 bytes apart), two S tiles a 32-key chunk; P V as P tiles (16 rows by 16 key pairs, the
 * softmax's own words) by V tiles of 16 key pairs by 16 channels of [pos / 2][d], accumulated into O in
 * memory 16 channels at a time (the online softmax rescales O between chunks). The
 * query rows are padded with zero rows to a multiple of 16 (their P rows zero). Sums in the tiles' order:
 * within the vdpbf16ps tile's bound, not its bits.
 */
AMX_TARGET static void attend_tile_amx(const float *q, int64_t ldq, float *out, int64_t ldo, const uint32_t *kt,
                                       const uint32_t *vb, int ntok, int n_vis0, int grp, int d, float scale,
                                       float v_scale, float *scr) {
    const int rows = ntok * grp, rows16 = (rows + 15) & ~15, dp = d / 2;
    const AtbScratch t = atb_begin(q, ldq, rows, rows16, n_vis0, grp, d, ATA_KC, scr);
    uint32_t *qs = t.qs, *pp = t.pp;
    float *o = t.o, *sc = t.sc, *mx = t.mx, *sum = t.sum;
    const int *vis = t.vis;
    amx_begin();
    const int n_max = n_vis0 + ntok - 1;
    for (int j0 = 0; j0 < n_max; j0 += ATA_KC) {
        const int cnt = n_max - j0 < ATA_KC ? n_max - j0 : ATA_KC, nsub = (cnt + ATB_KC - 1) / ATB_KC;
        const uint32_t *vc = vb + (int64_t)(j0 / 2) * d;
        __asm__ volatile("" ::: "memory"); /* the tile loads read what C code wrote: no asm says so */
        for (int i0 = 0; i0 < rows16; i0 += 16)
            for (int u = 0; u < nsub; u++) { /* S of the chunk's 32-key sub-chunks (past nsub: masked) */
                const uint32_t *kc = kt + (int64_t)(j0 / ATB_KC + u) * dp * ATB_KC;
                _tile_zero(0);
                _tile_zero(1);
                for (int p0 = 0; p0 < dp; p0 += 16) {
                    _tile_loadd(4, qs + i0 * dp + p0, dp * 4);
                    _tile_loadd(6, kc + p0 * ATB_KC, ATB_KC * 4);
                    _tile_loadd(7, kc + p0 * ATB_KC + 16, ATB_KC * 4);
                    _tile_dpbf16ps(0, 4, 6);
                    _tile_dpbf16ps(1, 4, 7);
                }
                _tile_stored(0, sc + i0 * ATA_KC + ATB_KC * u, ATA_KC * 4);
                _tile_stored(1, sc + i0 * ATA_KC + ATB_KC * u + 16, ATA_KC * 4);
            }
        __asm__ volatile("" ::: "memory"); /* and C code reads what the tile stores wrote */
        atb_softmax(sc, pp, o, mx, t.sumv, vis, rows, d, j0, cnt, scale, ATA_KC);
        __asm__ volatile("" ::: "memory");
        for (int i0 = 0; i0 < rows16; i0 += 16)
            for (int c0 = 0; c0 < d; c0 += 16) {
                _tile_loadd(0, o + i0 * d + c0, d * 4);
                for (int u = 0; u < nsub; u++) { /* P's 16 key pairs of sub-chunk u by V's */
                    _tile_loadd(4, pp + i0 * (ATA_KC / 2) + 16 * u, (ATA_KC / 2) * 4);
                    _tile_loadd(6, vc + (int64_t)16 * u * d + c0, d * 4);
                    _tile_dpbf16ps(0, 4, 6);
                }
                _tile_stored(0, o + i0 * d + c0, d * 4);
            }
        __asm__ volatile("" ::: "memory");
    }
    amx_end();
    atb_sums(&t, rows);
    att_tile_finish(o, sum, out, ldo, rows, grp, d, v_scale);
}

/* fp32 -> fp8 with `ebits` exponent and `mbits` mantissa bits, round to nearest even, saturating at the
 * largest finite code (max_code); NaN stays NaN. */
static uint8_t f32_to_fp8(float f, int ebits, int mbits, int max_code) {
    const uint8_t sign = signbit(f) ? 0x80 : 0;
    if (isnan(f)) return sign | 0x7f; /* a NaN in both formats, as torch writes it */
    const int bias = (1 << (ebits - 1)) - 1;
    const int max_e = max_code >> mbits, max_m = max_code & ((1 << mbits) - 1);
    const float a = fabsf(f), max_finite = ldexpf((float)((1 << mbits) + max_m), max_e - bias - mbits);
    if (a >= max_finite) return sign | (uint8_t)max_code;
    if (a == 0.0f) return sign;
    int e;
    frexpf(a, &e); /* a = 1.x * 2^(e - 1) */
    int E = e - 1 + bias;
    if (E < 1) /* subnormal steps of 2^(1 - bias - mbits); rounding up to 2^mbits is the smallest normal's code */
        return sign | (uint8_t)(int)nearbyintf(ldexpf(a, bias - 1 + mbits));
    int q = (int)nearbyintf(ldexpf(a, mbits - (e - 1))); /* 2^mbits .. 2^(mbits + 1) */
    if (q == 2 << mbits) q = 1 << mbits, E++;
    return sign | (uint8_t)((E << mbits) | (q - (1 << mbits))); /* below max_finite, so at most max_code */
}

uint8_t appl_f32_to_fp8(float f, int kv_type) {
    return kv_type == KV_FP8_E4M3 ? f32_to_fp8(f, 4, 3, 0x7e) : f32_to_fp8(f, 5, 2, 0x7b);
}

/* fp32 -> bf16, round to nearest even (NaN kept quiet) */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

void appl_kv_write(void *k_cache, void *v_cache, const float *k, const float *v, int64_t slot, int64_t n,
                   int kv_type, float k_scale, float v_scale) {
    if (kv_type == KV_F32) {
        memcpy((float *)k_cache + slot * n, k, sizeof(float) * n);
        memcpy((float *)v_cache + slot * n, v, sizeof(float) * n);
    } else if (kv_type == KV_BF16) {
        uint16_t *kc = (uint16_t *)k_cache + slot * n, *vc = (uint16_t *)v_cache + slot * n;
        for (int64_t i = 0; i < n; i++) {
            kc[i] = f32_to_bf16(k[i]);
            vc[i] = f32_to_bf16(v[i]);
        }
    } else {
        uint8_t *kc = (uint8_t *)k_cache + slot * n, *vc = (uint8_t *)v_cache + slot * n;
        for (int64_t i = 0; i < n; i++) {
            kc[i] = appl_f32_to_fp8(k[i] / k_scale, kv_type);
            vc[i] = appl_f32_to_fp8(v[i] / v_scale, kv_type);
        }
    }
}

/* out[h] = acc[h] / l[h] * v_scale for the nh heads of one decode item (sums relative to the max m[h]); with
 * attention sinks (a learned logit per head, NULL: none) each head's sink joins the softmax's denominator:
 * out = acc e^(m - M) / (l e^(m - M) + e^(sink - M)), M the larger of m and the sink. */
static void dec_finish(const float *acc, const float *l, const float *m, const float *sinks, float *out, int nh,
                       int d, float v_scale) {
    for (int h = 0; h < nh; h++) {
        float f = 1.0f / l[h];
        if (sinks) {
            const float big = m[h] > sinks[h] ? m[h] : sinks[h], e = expf(m[h] - big);
            f = e / (l[h] * e + expf(sinks[h] - big));
        }
        const __m256 sv = _mm256_set1_ps(v_scale * f);
        for (int c = 0; c < d; c += 8)
            _mm256_storeu_ps(out + h * d + c, _mm256_mul_ps(_mm256_loadu_ps(acc + h * d + c), sv));
    }
}

/* n splits' partial sums (each acc [nh][d], m [nh], l [nh], stride floats apart) merged into out: each split
 * scaled by exp(its max - the largest), the sums likewise. scr: nh * (d + 2) floats. */
static void dec_merge(const float *part, int n, int64_t stride, float *scr, int nh, int d, float *out, float v_scale,
                      const float *sinks) {
    float *acc = scr, *l = acc + (int64_t)nh * d, *m = l + nh;
    for (int h = 0; h < nh; h++) {
        float mx = -INFINITY;
        for (int k = 0; k < n; k++) {
            const float mk = part[k * stride + (int64_t)nh * d + h];
            mx = mk > mx ? mk : mx;
        }
        l[h] = 0.0f;
        memset(acc + h * d, 0, sizeof(float) * (size_t)d);
        for (int k = 0; k < n; k++) {
            const float *pk = part + k * stride;
            const float f = expf(pk[(int64_t)nh * d + h] - mx);
            l[h] += pk[(int64_t)nh * d + nh + h] * f;
            const __m256 fv = _mm256_set1_ps(f);
            for (int c = 0; c < d; c += 8)
                _mm256_storeu_ps(acc + h * d + c, _mm256_fmadd_ps(_mm256_loadu_ps(pk + h * d + c), fv,
                                                                  _mm256_loadu_ps(acc + h * d + c)));
        }
        m[h] = mx;
    }
    dec_finish(acc, l, m, sinks, out, nh, d, v_scale);
}

/*
 * Decode items on AMX-BF16 tiles (a bf16 cache, head sizes a multiple of 32, up to 16 query heads a kv head,
 * where the bf16 products are switched on: bf16_attention): the items, splits and chunks of the ones above, per
 * kv head and chunk of DEC_CH positions:
 *   S^T = K Q^T, tiles of 16 positions by the group's heads: K's rows read in place where one block holds the 16
 *       (else copied to kb), the queries laid once an item as B tiles of channel pairs (dec_amx_lay_q);
 *   the scores gathered back to a head's row, scaled, soft-capped, the online softmax 16 lanes wide, P rounded to
 *       bf16 into the A tile's rows (a head's positions in order are its pairs);
 *   P V over V's rows interleaved in pairs of positions (B tiles of 16 pairs by 16 channels: dec_amx_lay_v), its
 *       fp32 sums added to the item's, scaled by the softmax's correction.
 * q and P rounded to bf16, every sum fp32: the prefill tiles' bound (bf16_attention). The scratch: dec_amx_floats.
 */
#define DEC_AMX_MIN_GRP 4 /* below, the AVX-512 items run as fast (three heads a kv head: 0.9-1.0x on AMX tiles) */
#define DEC_AMX_MAX_GRP 16
static inline int64_t dec_amx_floats(int d, int nkv) { /* st, pp, vp, co, kb, qb (decode_split_amx) */
    return 16 * DEC_CH + 8 * DEC_CH + DEC_CH / 2 * (int64_t)d + 16 * (int64_t)d + 8 * (int64_t)d + 8 * (int64_t)d * nkv;
}

/* The grp queries of a kv head (rows d apart) as B tiles: tile ks holds word (q[h][32 ks + 2 r], q[h][32 ks + 2 r +
 * 1]) at row r, column h (columns past grp zero, from the caller). */
AMX_TARGET static void dec_amx_lay_q(const float *qg, int grp, int d, uint32_t *qb) {
    const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(16));
    for (int h = 0; h < grp; h++)
        for (int ks = 0; ks < d / 32; ks++) {
            const __m512bh w = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(qg + (int64_t)h * d + 32 * ks + 16),
                                                   _mm512_loadu_ps(qg + (int64_t)h * d + 32 * ks));
            _mm512_i32scatter_epi32(qb + 256 * ks + h, col, (__m512i)w, 4);
        }
}

/* V's rows of positions [c0, c0 + 2 np) at the kv head (offset g0 elements) as np rows of pairs, positions from p1
 * on zero: row r's words are (V[c0 + 2 r][c], V[c0 + 2 r + 1][c]) with the channels c of each 32 in the order
 * vpunpcklwd and vpunpckhwd leave them (0-3, 8-11, 16-19, 24-27, then 4-7, 12-15, 20-23, 28-31; dec_amx_unlay). */
AMX_TARGET static void dec_amx_lay_v(const uint16_t *v_base, const int32_t *bt, int bs, int64_t kv_stride, int64_t g0,
                                     int c0, int p1, int np, int d, uint32_t *vp) {
    for (int r = 0; r < np; r++) {
        const int pa = c0 + 2 * r, pb = pa + 1;
        const uint16_t *va = pa < p1 ? v_base + dec_row(bt, bs, kv_stride, pa) + g0 : NULL;
        const uint16_t *vb = pb < p1 ? v_base + dec_row(bt, bs, kv_stride, pb) + g0 : NULL;
        for (int c = 0; c < d; c += 32) {
            const __m512i a = va ? _mm512_loadu_si512((const void *)(va + c)) : _mm512_setzero_si512();
            const __m512i b = vb ? _mm512_loadu_si512((const void *)(vb + c)) : _mm512_setzero_si512();
            _mm512_storeu_si512((void *)(vp + (int64_t)r * d + c), _mm512_unpacklo_epi16(a, b));
            _mm512_storeu_si512((void *)(vp + (int64_t)r * d + c + 16), _mm512_unpackhi_epi16(a, b));
        }
    }
}

/* n floats (a multiple of 32) from the channel order of dec_amx_lay_v back to 0 .. 31. */
AMX_TARGET static void dec_amx_unlay(float *x, int64_t n) {
    const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
    for (int64_t i = 0; i < n; i += 32) {
        const __m512 a = _mm512_loadu_ps(x + i), b = _mm512_loadu_ps(x + i + 16);
        _mm512_storeu_ps(x + i, _mm512_permutex2var_ps(a, lo, b));
        _mm512_storeu_ps(x + i + 16, _mm512_permutex2var_ps(a, hi, b));
    }
}

/* One chunk's softmax for the grp heads: the scores of cnt positions from st ([pos][16 heads], as the S^T tiles
 * store them), scaled and soft-capped, the running max m and sum l moved on, corr what the sums so far are
 * scaled by, P rounded to bf16 into pp's rows (DEC_CH a row, zero past cnt). */
AMX_TARGET static void dec_amx_softmax(const float *st, int cnt, int grp, float scale, float softcap, float *m,
                                       float *l, float *corr, uint16_t *pp) {
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i rows = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(16));
    const __m512 ninf = _mm512_set1_ps(-INFINITY), sv = _mm512_set1_ps(scale);
    for (int h = 0; h < grp; h++) {
        __m512 sx[DEC_CH / 16], mxv = ninf;
        for (int v = 0; v < DEC_CH / 16; v++) {
            const __mmask16 mk = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(16 * v)),
                                                         _mm512_set1_epi32(cnt));
            sx[v] = _mm512_mul_ps(_mm512_mask_i32gather_ps(ninf, mk, rows, st + 256 * v + h, 4), sv);
            if (softcap > 0.0f) { /* soft-capped scores (Gemma 2): softcap * tanh(s / softcap) */
                float t[16];
                _mm512_storeu_ps(t, sx[v]);
                for (int i = 0; i < 16; i++) t[i] = softcap * tanhf(t[i] / softcap);
                sx[v] = _mm512_mask_blend_ps(mk, ninf, _mm512_loadu_ps(t));
            }
            mxv = _mm512_max_ps(mxv, sx[v]);
        }
        const float mx = fmaxf(m[h], _mm512_reduce_max_ps(mxv));
        const __m512 mv = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        for (int v = 0; v < DEC_CH / 16; v++) {
            const __mmask16 mk = _mm512_cmplt_epi32_mask(_mm512_add_epi32(lanes, _mm512_set1_epi32(16 * v)),
                                                         _mm512_set1_epi32(cnt));
            sx[v] = _mm512_maskz_mov_ps(mk, exp16_bf16(_mm512_sub_ps(sx[v], mv)));
            sum = _mm512_add_ps(sum, sx[v]);
        }
        for (int v = 0; v < DEC_CH / 16; v += 2)
            _mm512_storeu_si512((void *)(pp + h * DEC_CH + 16 * v), (__m512i)_mm512_cvtne2ps_pbh(sx[v + 1], sx[v]));
        corr[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
        l[h] = l[h] * corr[h] + _mm512_reduce_add_ps(sum);
        m[h] = mx;
    }
}

/* Whether decode items of these shapes over a cache of kv_type run on AMX tiles (decode_split_amx), the run-time
 * switches as they stand. */
int appl_decode_tiles(int n_heads, int n_kv_heads, int d, int kv_type) {
    const int grp = n_kv_heads > 0 ? n_heads / n_kv_heads : 0;
    return g_avx512 && d % 32 == 0 && g_bf16_att && g_amx && g_has_amx_bf16 && kv_type == KV_BF16 &&
           grp >= DEC_AMX_MIN_GRP && grp <= DEC_AMX_MAX_GRP;
}

/* decode_split_<type>'s item on AMX tiles over a bf16 cache (appl_decode_tiles); scr:
 * dec_amx_floats(d, nkv). */
AMX_TARGET static void decode_split_amx(const float *q, const uint16_t *k_base, const uint16_t *v_base,
                                        const int32_t *bt, int bs, int64_t kv_stride, int p0, int p1, int nkv, int grp,
                                        int d, float scale, float softcap, float *acc, float *m, float *l, float *scr) {
    float *st = scr;                             /* S^T: [DEC_CH][16] */
    uint16_t *pp = (uint16_t *)(st + 16 * DEC_CH); /* P: [16][DEC_CH] bf16, the rows past grp zero */
    uint32_t *vp = (uint32_t *)(pp + 16 * DEC_CH); /* V in pairs: [DEC_CH / 2][d] words */
    float *co = (float *)(vp + DEC_CH / 2 * d);   /* a chunk's P V: [16][d] */
    uint16_t *kb = (uint16_t *)(co + 16 * d);     /* 16 K rows across blocks: [16][d] */
    uint32_t *qb = (uint32_t *)(kb + 16 * d);     /* the queries' B tiles: nkv by d / 32 of 256 words */
    float corr[DEC_AMX_MAX_GRP];
    dec_start(acc, m, l, nkv * grp, d);
    memset(qb, 0, sizeof(uint32_t) * 8 * (size_t)d * nkv);
    memset(pp, 0, sizeof(uint16_t) * 16 * DEC_CH);
    for (int g = 0; g < nkv; g++) dec_amx_lay_q(q + (int64_t)g * d * grp, grp, d, qb + (int64_t)g * 8 * d);
    dec_prefetch(k_base, v_base, sizeof(uint16_t), bt, bs, kv_stride, p0, p1);
    amx_begin();
    for (int c0 = p0; c0 < p1; c0 += DEC_CH) {
        const int cnt = p1 - c0 < DEC_CH ? p1 - c0 : DEC_CH, nk = (cnt + 31) / 32;
        for (int g = 0; g < nkv; g++) {
            const int64_t g0 = (int64_t)g * d;
            float *ag = acc + g0 * grp, *mg = m + g * grp, *lg = l + g * grp;
            const uint32_t *qg = qb + (int64_t)g * 8 * d;
            for (int u = 0; u < (cnt + 15) / 16; u++) { /* S^T of 16 positions (past cnt: rows not read) */
                const int pos = c0 + 16 * u;
                const uint16_t *ka = k_base + dec_row(bt, bs, kv_stride, pos) + g0;
                int64_t lda = kv_stride * 2;
                if (pos % bs + 16 > bs) { /* the 16 rows span blocks: copied */
                    for (int o = 0; o < 16 && pos + o < p1; o++)
                        memcpy(kb + (int64_t)o * d, k_base + dec_row(bt, bs, kv_stride, pos + o) + g0, 2 * (size_t)d);
                    ka = kb;
                    lda = 2 * d;
                }
                __asm__ volatile("" ::: "memory"); /* the tile loads read what C code wrote: no asm says so */
                _tile_zero(0);
                for (int ks = 0; ks < d / 32; ks++) {
                    _tile_loadd(2, ka + 32 * ks, lda);
                    _tile_loadd(3, qg + 256 * ks, 64);
                    _tile_dpbf16ps(0, 2, 3);
                }
                _tile_stored(0, st + 256 * u, 64);
            }
            __asm__ volatile("" ::: "memory"); /* and C code reads what the tile stores wrote */
            dec_amx_softmax(st, cnt, grp, scale, softcap, mg, lg, corr, pp);
            dec_amx_lay_v(v_base, bt, bs, kv_stride, g0, c0, p1, 16 * nk, d, vp);
            __asm__ volatile("" ::: "memory");
            for (int cb = 0; cb < d; cb += 16) {
                _tile_zero(1);
                for (int kk = 0; kk < nk; kk++) {
                    _tile_loadd(4, pp + 32 * kk, 2 * DEC_CH);
                    _tile_loadd(5, vp + (int64_t)16 * kk * d + cb, 4 * d);
                    _tile_dpbf16ps(1, 4, 5);
                }
                _tile_stored(1, co + cb, 4 * d);
            }
            __asm__ volatile("" ::: "memory");
            for (int h = 0; h < grp; h++) {
                const __m512 cv = _mm512_set1_ps(corr[h]);
                for (int c = 0; c < d; c += 16)
                    _mm512_storeu_ps(ag + h * d + c, _mm512_fmadd_ps(_mm512_loadu_ps(ag + h * d + c), cv,
                                                                     _mm512_loadu_ps(co + h * d + c)));
            }
        }
    }
    amx_end();
    dec_amx_unlay(acc, (int64_t)nkv * grp * d);
}

/* Kv head `off` (its first channel) of a request's positions [0, n), widened for the prefill tiles into kt and vb:
 * bf16 pairs (pairs: a bf16 or fp8 cache on bf16 products) or fp32. Each thread takes its share of the chunks. */
static void att_lay_head(const void *k_cache, const void *v_cache, int kv_type, int pairs, int64_t off,
                         const int32_t *bt, int bs, int64_t kv_stride, int n, int d, float *kt, float *vb) {
    const uint16_t *k16 = (const uint16_t *)k_cache + off, *v16 = (const uint16_t *)v_cache + off;
    const uint8_t *k8 = (const uint8_t *)k_cache + off, *v8 = (const uint8_t *)v_cache + off;
    uint32_t *kw = (uint32_t *)kt, *vw = (uint32_t *)vb;
    if (pairs && kv_type == KV_BF16 && d % 16 == 0) att_pairs_bf16_words(k16, v16, bt, bs, kv_stride, n, d, kw, vw);
    else if (pairs && kv_type == KV_BF16) att_pairs_bf16(k16, v16, bt, bs, kv_stride, n, d, kw, vw);
    else if (pairs && kv_type == KV_FP8_E4M3) att_pairs_e4m3(k8, v8, bt, bs, kv_stride, n, d, kw, vw);
    else if (pairs) att_pairs_e5m2(k8, v8, bt, bs, kv_stride, n, d, kw, vw);
    else if (kv_type == KV_BF16) att_widen_bf16(k16, v16, bt, bs, kv_stride, n, d, kt, vb);
    else if (kv_type == KV_FP8_E4M3) att_widen_e4m3(k8, v8, bt, bs, kv_stride, n, d, kt, vb);
    else if (kv_type == KV_FP8_E5M2) att_widen_e5m2(k8, v8, bt, bs, kv_stride, n, d, kt, vb);
    else att_widen_f32((const float *)k_cache + off, (const float *)v_cache + off, bt, bs, kv_stride, n, d, kt, vb);
}

/* The first position a token that sees positions [0, n_vis) attends: the start of its sliding window
 * (window > 0) or of its chunk (chunk > 0, chunked local attention), else 0. */
static inline int att_first_pos(int n_vis, int window, int chunk) {
    const int lo = window && n_vis > window ? n_vis - window : 0;
    const int c = chunk > 0 ? (n_vis - 1) / chunk * chunk : 0;
    return c > lo ? c : lo;
}

/*
 * Paged attention read in place: token t of request r (query row t) attends
 * positions [0, seq_lens[r] - (qsl[r+1] - 1 - t)) of its sequence, whose
 * K/V sit at slot block_table[r][pos / bs] * bs + pos % bs; with a sliding
 * window (window > 0) only the last window of them, with chunked local
 * attention (chunk > 0) only those of its own chunk (from the multiple of
 * chunk at or before its position, Llama 4's), its blocks before those
 * never read (they may be the null block or another request's); with
 * softcap > 0 the scores are soft-capped, softcap * tanh(score / softcap);
 * with sinks (n_heads floats, NULL: none) each head's learned logit joins the
 * softmax's denominator (gpt-oss). A request's run of ATT_MIN_QUERY tokens or
 * more goes by prefill tiles (full attention, no cap or sinks only); the
 * other tokens (decodes, and every token under a window, chunks, a cap or
 * sinks) by
 * flash-decoding items of one token (all its heads)
 * and a split of its visible positions, merged after, so that a single long
 * decode still keeps every thread reading. Needs head_dim % 8 == 0.
 */
void appl_attention(const float *q, int64_t ldq, float *out, int64_t ldo, const void *k_cache,
                    const void *v_cache, int n_tokens, int n_reqs, const int32_t *qsl, const int32_t *seq_lens,
                    const int32_t *block_table, int bt_stride, int bs, int n_heads, int n_kv_heads, int d,
                    float scale, int kv_type, float k_scale, float v_scale, int window, int chunk, float softcap,
                    const float *sinks) {
    const int grp = n_heads / n_kv_heads;
    const int fp8 = kv_type == KV_FP8_E4M3 || kv_type == KV_FP8_E5M2;
    const float qk_scale = fp8 ? scale * k_scale : scale, out_scale = fp8 ? v_scale : 1.0f;
    /* prefill runs (a request with ATT_MIN_QUERY tokens or more here) by tiles of ATT_QT tokens and one kv
     * head (see "Prefill tiles"); the other tokens by decode items below */
    int64_t n_tiles = 0, tiled_tokens = 0;
    for (int r = 0; r < n_reqs && !window && chunk <= 0 && !(softcap > 0.0f) && !sinks; r++)
        if (qsl[r + 1] - qsl[r] >= ATT_MIN_QUERY) {
            n_tiles++;
            tiled_tokens += qsl[r + 1] - qsl[r];
        }
    if (n_tiles) {
        int max_keys = 0; /* a request's last token sees all its positions */
        for (int r = 0; r < n_reqs; r++)
            if (qsl[r + 1] - qsl[r] >= ATT_MIN_QUERY && seq_lens[r] > max_keys) max_keys = seq_lens[r];
        const int64_t kv_stride = (int64_t)n_kv_heads * d, key_chunks = (max_keys + ATB_KC - 1) / ATB_KC;
        /* a bf16 or fp8 cache holds bf16 values exactly: its tiles run on bf16 products where the switch is
         * on, AMX tiles where amx is on too and the head size a multiple of 32, else vdpbf16ps */
        const int pairs = g_bf16_att && kv_type != KV_F32, tiles = pairs && g_amx && g_has_amx_bf16 && d % 32 == 0;
        /* widened K and V: fp32 [chunks of 16][d][16] and [pos][d], or bf16 pairs (as many words), a group of
         * kv heads at a time: enough heads that their tiles keep every thread busy (a short chunk has few
         * tiles a head), within ATT_LAID_BYTES */
        const int64_t head_floats = key_chunks * ATB_KC * d;
        int64_t max_tiles = 0;
        for (int r = 0; r < n_reqs; r++) {
            const int64_t nt = (qsl[r + 1] - qsl[r] + ATT_QT - 1) / ATT_QT;
            max_tiles = nt > max_tiles ? nt : max_tiles;
        }
        int64_t hg = (ATT_HEAD_ITEMS * omp_get_max_threads() + max_tiles - 1) / max_tiles;
        const int64_t fit = ATT_LAID_BYTES / (2 * sizeof(float) * head_floats);
        hg = hg > fit ? fit : hg;
        hg = hg > n_kv_heads ? n_kv_heads : hg < 1 ? 1 : hg;
        float *kt = (float *)malloc(sizeof(float) * (size_t)(hg * head_floats));
        float *vb = (float *)malloc(sizeof(float) * (size_t)(hg * head_floats));
        if (!kt || !vb) abort();
#pragma omp parallel
        {
            const int64_t scr_floats = tiles ? atb_tile_floats((ATT_QT * grp + 15) & ~15, d, ATA_KC) /* rows by 16 */
                                       : pairs ? atb_tile_floats(ATT_QT * grp, d, ATB_KC)
                                               : att_tile_floats(ATT_QT * grp, d);
            float *scr = (float *)malloc(sizeof(float) * (size_t)scr_floats);
            if (!scr) abort();
            for (int r = 0; r < n_reqs; r++) {
                const int qlen = qsl[r + 1] - qsl[r], nt = (qlen + ATT_QT - 1) / ATT_QT;
                if (qlen < ATT_MIN_QUERY) continue;
                const int32_t *bt = block_table + (int64_t)r * bt_stride;
                for (int g0 = 0; g0 < n_kv_heads; g0 += (int)hg) { /* widen a group's K and V, then run its tiles */
                    const int ng = n_kv_heads - g0 < hg ? n_kv_heads - g0 : (int)hg;
                    for (int g = g0; g < g0 + ng; g++)
                        att_lay_head(k_cache, v_cache, kv_type, pairs, (int64_t)g * d, bt, bs, kv_stride, seq_lens[r],
                                     d, kt + (g - g0) * head_floats, vb + (g - g0) * head_floats);
#pragma omp for schedule(dynamic, 1)
                    for (int it = 0; it < nt * ng; it++) { /* the longest tiles first */
                        const int ti = nt - 1 - it / ng, gi = it % ng;
                        const int64_t off = (int64_t)(g0 + gi) * d;
                        const float *kh = kt + gi * head_floats, *vh = vb + gi * head_floats;
                        const int t0 = qsl[r] + ti * ATT_QT, ntok = qsl[r + 1] - t0 < ATT_QT ? qsl[r + 1] - t0 : ATT_QT;
                        const int n_vis0 = seq_lens[r] - (qsl[r + 1] - 1 - t0);
                        const float *qt = q + (int64_t)t0 * ldq + off * grp;
                        float *ot = out + (int64_t)t0 * ldo + off * grp;
                        if (pairs)
                            (tiles ? attend_tile_amx : attend_tile_bf16)(qt, ldq, ot, ldo, (const uint32_t *)kh,
                                                                         (const uint32_t *)vh, ntok, n_vis0, grp, d,
                                                                         qk_scale, out_scale, scr);
                        else
                            (g_avx512 ? attend_tile512 : attend_tile)(qt, ldq, ot, ldo, kh, vh, ntok, n_vis0, grp, d,
                                                                      qk_scale, out_scale, scr);
                    }
                }
            }
            free(scr);
        }
        free(kt);
        free(vb);
        if (tiled_tokens == n_tokens) return;
    }
    /* the other tokens (decodes, short chunks) by items of one token and a split of its context: splits of
     * DEC_SPLIT positions whatever else the step holds (a context split by the step's size would sum
     * differently alone and beside others: the load would change a greedy answer) */
    int64_t n_items = 0, n_partial = 0;
    for (int r = 0; r < n_reqs; r++) {
        const int qlen = qsl[r + 1] - qsl[r];
        if (n_tiles && qlen >= ATT_MIN_QUERY) continue;
        for (int t = qsl[r]; t < qsl[r + 1]; t++) {
            const int n_vis = seq_lens[r] - (qsl[r + 1] - 1 - t), lo = att_first_pos(n_vis, window, chunk);
            const int splits = (n_vis - lo + DEC_SPLIT - 1) / DEC_SPLIT;
            n_items += splits;
            if (splits > 1) n_partial += splits;
        }
    }
    /* item i: its request, token, first position, end, and where a split leaves its partial sums (-1: none) */
    int32_t *items = (int32_t *)malloc(sizeof(int32_t) * 5 * (size_t)(n_items ? n_items : 1));
    const int64_t part_floats = (int64_t)n_heads * (d + 2); /* acc [n_heads][d], m [n_heads], l [n_heads] */
    float *partial = (float *)malloc(sizeof(float) * (size_t)(n_partial ? n_partial * part_floats : 1));
    if (!items || !partial) abort();
    for (int64_t r = 0, i = 0, slot = 0; r < n_reqs; r++) {
        const int qlen = qsl[r + 1] - qsl[r];
        if (n_tiles && qlen >= ATT_MIN_QUERY) continue;
        for (int t = qsl[r]; t < qsl[r + 1]; t++) {
            const int n_vis = seq_lens[r] - (qsl[r + 1] - 1 - t), lo = att_first_pos(n_vis, window, chunk);
            const int splits = (n_vis - lo + DEC_SPLIT - 1) / DEC_SPLIT;
            for (int sp = 0; sp < splits; sp++, i++) {
                int32_t *it = items + 5 * i;
                it[0] = (int32_t)r;
                it[1] = t;
                it[2] = lo + sp * DEC_SPLIT;
                it[3] = sp + 1 < splits ? lo + (sp + 1) * DEC_SPLIT : n_vis;
                it[4] = splits > 1 ? (int32_t)slot++ : -1;
            }
        }
    }
    const int64_t kv_stride = (int64_t)n_kv_heads * d;
    /* items 16 lanes wide where the CPU has AVX-512F and the head size is a multiple of 32; on AMX tiles over a
     * bf16 cache where the bf16 products are on too and 4 to 16 query heads share a kv head (appl_decode_tiles) */
    const int wide = g_avx512 && d % 32 == 0;
    const int dec_tiles = appl_decode_tiles(n_heads, n_kv_heads, d, kv_type);
    /* acc, m, l; s [grp][DEC_CH]; corr; the laid query of a wide item, or an AMX item's scratch */
    const int64_t item_floats = dec_tiles ? dec_amx_floats(d, n_kv_heads) : (int64_t)n_heads * (DEC_CH + 1) + (wide ? (int64_t)n_heads * d : 0);
    const int64_t scr_floats = part_floats + item_floats;
#pragma omp parallel if (n_items > 1)
    {
        float *scr = (float *)malloc(sizeof(float) * (size_t)scr_floats);
        if (!scr) abort();
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            const int32_t *it = items + 5 * i;
            const int32_t *bt = block_table + (int64_t)it[0] * bt_stride;
            const float *qt = q + (int64_t)it[1] * ldq;
            /* a split's sums in its partial slot, a whole context's in the scratch */
            float *acc = it[4] >= 0 ? partial + it[4] * part_floats : scr, *m = acc + (int64_t)n_heads * d;
            float *l = m + n_heads, *s = scr + part_floats, *corr = s + n_heads * DEC_CH, *qp = corr + n_heads;
            if (dec_tiles)
                decode_split_amx(qt, (const uint16_t *)k_cache, (const uint16_t *)v_cache, bt, bs, kv_stride, it[2],
                                 it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, scr + part_floats);
            else if (wide && kv_type == KV_BF16)
                decode_split512_bf16(qt, (const uint16_t *)k_cache, (const uint16_t *)v_cache, bt, bs, kv_stride,
                                     it[2], it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr, qp);
            else if (wide && kv_type == KV_FP8_E4M3)
                decode_split512_e4m3(qt, (const uint8_t *)k_cache, (const uint8_t *)v_cache, bt, bs, kv_stride,
                                     it[2], it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr, qp);
            else if (wide && kv_type == KV_FP8_E5M2)
                decode_split512_e5m2(qt, (const uint8_t *)k_cache, (const uint8_t *)v_cache, bt, bs, kv_stride,
                                     it[2], it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr, qp);
            else if (wide)
                decode_split512_f32(qt, (const float *)k_cache, (const float *)v_cache, bt, bs, kv_stride, it[2],
                                    it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr, qp);
            else if (kv_type == KV_BF16)
                decode_split_bf16(qt, (const uint16_t *)k_cache, (const uint16_t *)v_cache, bt, bs, kv_stride, it[2],
                                  it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr);
            else if (kv_type == KV_FP8_E4M3)
                decode_split_e4m3(qt, (const uint8_t *)k_cache, (const uint8_t *)v_cache, bt, bs, kv_stride, it[2],
                                  it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr);
            else if (kv_type == KV_FP8_E5M2)
                decode_split_e5m2(qt, (const uint8_t *)k_cache, (const uint8_t *)v_cache, bt, bs, kv_stride, it[2],
                                  it[3], n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr);
            else
                decode_split_f32(qt, (const float *)k_cache, (const float *)v_cache, bt, bs, kv_stride, it[2], it[3],
                                 n_kv_heads, grp, d, qk_scale, softcap, acc, m, l, s, corr);
            if (it[4] < 0) dec_finish(acc, l, m, sinks, out + (int64_t)it[1] * ldo, n_heads, d, out_scale);
        }
        /* the splits of one token merged: each rescaled to the largest max */
#pragma omp for schedule(static)
        for (int64_t i = 0; i < n_items; i++) {
            const int32_t *it = items + 5 * i;
            if (it[4] < 0 || (i > 0 && items[5 * (i - 1) + 1] == it[1])) continue; /* a token's first split gathers its others */
            int n = 1;
            while (i + n < n_items && items[5 * (i + n) + 1] == it[1]) n++;
            dec_merge(partial + it[4] * part_floats, n, part_floats, scr, n_heads, d, out + (int64_t)it[1] * ldo,
                      out_scale, sinks);
        }
        free(scr);
    }
    free(items);
    free(partial);
}

/* --------------------------------------------------------------- forward */

/* Seconds spent per phase of appl_forward since the last reset (read by
 * `appliance bench latency` to say where a step's time goes). */
enum { PH_NORM, PH_QKV, PH_ROPE_KV, PH_ATTN, PH_O, PH_GATE_UP, PH_ACT, PH_DOWN, PH_LM_HEAD, PH_ROUTER, PH_REDUCE, PH_N };
static double g_phase[PH_N];

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

int appl_phase_times(double *out, int reset) {
    for (int i = 0; i < PH_N; i++) {
        out[i] = g_phase[i];
        if (reset) g_phase[i] = 0.0;
    }
    return PH_N;
}

#define PHASE(id, stmt)                      \
    do {                                     \
        const double t0_ = now_s();          \
        stmt;                                \
        g_phase[id] += now_s() - t0_;        \
    } while (0)

int64_t appl_scratch_floats(const Model *M, int64_t n_tokens) {
    const int64_t qkv = (int64_t)(M->n_heads + 2 * M->n_kv_heads) * M->head_dim;
    const int64_t pairs = n_tokens * M->moe_top_k; /* (token, expert) pairs of a sparse layer */
    /* a sparse layer's partial sums [T, hid], then its routing, rows and outputs */
    const int64_t moe = M->moe_experts ? n_tokens * (int64_t)M->hidden + n_tokens * M->moe_experts + 2 * pairs +
                                             pairs * (2 * (int64_t)M->hidden + 3 * M->moe_inter)
                                       : 0;
    return n_tokens * (2 * (int64_t)M->hidden + qkv + (int64_t)M->n_heads * M->head_dim + 3 * (int64_t)M->inter) +
           moe + 64;
}

/* A sparse layer: x[t] += sum over t's routed experts held here, in expert
 * order, of weight x expert(h[t]). The (token, expert) pairs are sorted by
 * expert (stable: each expert's tokens in token order), gathered into
 * contiguous rows, and each active expert runs its two GEMMs over its rows. */
static void moe_forward(const Model *M, const Moe *E, const float *h, float *x, int64_t T, float *scr) {
    const int64_t hid = M->hidden, inter = E->inter, k = E->top_k, ne = E->n_experts, P = T * k;
    float *logits = scr;                    /* [T, ne] */
    float *w = logits + T * ne;             /* [T, k] */
    int32_t *ids = (int32_t *)(w + P);      /* [T, k] */
    float *rows = (float *)(ids + P);       /* [P, hid]: inputs in expert order */
    float *gu = rows + P * hid;             /* [P, 2 inter] */
    float *act = gu + P * 2 * inter;        /* [P, inter] */
    float *y = act + P * inter;             /* [P, hid]: expert outputs in expert order */
    PHASE(PH_ROUTER, appl_linear(&E->router, h, hid, logits, ne, T, 0));
    PHASE(PH_ROUTER, M->route(logits, T, (int32_t)ne, (int32_t)k, ids, w));
    const double t0 = now_s();
    int64_t *count = (int64_t *)calloc((size_t)E->n_local + 1, sizeof(int64_t));
    int64_t *slot = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1)); /* pair -> sorted row, or -1 */
    int64_t *src = (int64_t *)malloc(sizeof(int64_t) * (size_t)(P > 0 ? P : 1));  /* sorted row -> token */
    if (!count || !slot || !src) abort();
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = (int64_t)ids[p] - E->first;
        if (e >= 0 && e < E->n_local) count[e + 1]++;
    }
    for (int64_t e = 0; e < E->n_local; e++) count[e + 1] += count[e]; /* count[e]: expert e's first row */
    int64_t *fill = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E->n_local > 0 ? E->n_local : 1));
    if (!fill) abort();
    memcpy(fill, count, sizeof(int64_t) * (size_t)E->n_local);
    for (int64_t p = 0; p < P; p++) {
        const int64_t e = (int64_t)ids[p] - E->first;
        if (e >= 0 && e < E->n_local) {
            slot[p] = fill[e]++;
            src[slot[p]] = p / k;
        } else {
            slot[p] = -1;
        }
    }
    free(fill);
    const int64_t n_rows = count[E->n_local];
#pragma omp parallel for schedule(static) if (n_rows * hid >= 65536)
    for (int64_t r = 0; r < n_rows; r++) memcpy(rows + r * hid, h + src[r] * hid, sizeof(float) * hid);
    g_phase[PH_ROUTER] += now_s() - t0;
    for (int64_t e = 0; e < E->n_local; e++) {
        const int64_t r0 = count[e], n = count[e + 1] - r0;
        if (!n) continue;
        PHASE(PH_GATE_UP, appl_linear(&E->w13[e], rows + r0 * hid, hid, gu + r0 * 2 * inter, 2 * inter, n, 0));
        const double t_act = now_s();
#pragma omp parallel for schedule(static) if (n >= 8)
        for (int64_t r = r0; r < r0 + n; r++) silu_mul_row(gu + r * 2 * inter, act + r * inter, (int)inter);
        g_phase[PH_ACT] += now_s() - t_act;
        PHASE(PH_DOWN, appl_linear(&E->w2[e], act + r0 * inter, inter, y + r0 * hid, hid, n, 0));
    }
    const double t1 = now_s();
#pragma omp parallel for schedule(static) if (T * hid >= 65536)
    for (int64_t t = 0; t < T; t++) {
        int64_t order[64]; /* t's pairs held here, by expert id (insertion sort; top_k is small) */
        int n = 0;
        for (int64_t j = 0; j < k && n < 64; j++) {
            const int64_t p = t * k + j;
            if (slot[p] < 0) continue;
            int i = n++;
            while (i > 0 && ids[order[i - 1]] > ids[p]) {
                order[i] = order[i - 1];
                i--;
            }
            order[i] = p;
        }
        float *xt = x + t * hid;
        for (int64_t c = 0; c < hid; c++) {
            float acc = 0.0f;
            for (int i = 0; i < n; i++) acc += y[slot[order[i]] * hid + c] * w[order[i]];
            xt[c] += acc;
        }
    }
    g_phase[PH_ROUTER] += now_s() - t1;
    free(count);
    free(slot);
    free(src);
}

/* x[T, hid] += P in (T rows of stride ld_in), phase `phase`. A tensor-parallel rank's P is row-parallel:
 * its partial sums go to tmp, are reduced over the ranks, then added, x + (sum over ranks), as the torch
 * path adds its all-reduced output. Nonzero when the reduce failed. */
/* A tensor-parallel rank's partial sums part[n] all-reduced, then added to x; -1 if the reduce failed. */
static int reduce_add(const Model *M, float *part, float *x, int64_t n) {
    int rc;
    PHASE(PH_REDUCE, rc = M->reduce(M->reduce_ctx, part, n));
    if (rc) return -1;
#pragma omp parallel for schedule(static) if (n >= 65536)
    for (int64_t i = 0; i < n; i++) x[i] += part[i];
    return 0;
}

static int residual_linear(const Model *M, const Linear *P, const float *in, int64_t ld_in, float *tmp, float *x,
                           int64_t T, int phase) {
    const int64_t hid = M->hidden;
    if (!M->reduce) {
        PHASE(phase, appl_linear(P, in, ld_in, x, hid, T, 1));
        return 0;
    }
    PHASE(phase, appl_linear(P, in, ld_in, tmp, hid, T, 0));
    return reduce_add(M, tmp, x, T * hid);
}

void appl_forward(const Model *M, Step *S) {
    const int64_t T = S->n_tokens, hid = M->hidden, d = M->head_dim;
    const int H = M->n_heads, KVH = M->n_kv_heads;
    const int64_t qkv_w = (int64_t)(H + 2 * KVH) * d, attn_w = (int64_t)H * d, inter = M->inter;
    float *x = S->scratch;           /* residual stream [T, hid] */
    float *h = x + T * hid;          /* normed input [T, hid] */
    float *qkv = h + T * hid;        /* [T, (H + 2 KVH) d] */
    float *att = qkv + T * qkv_w;    /* [T, H d] */
    float *gu = att + T * attn_w;    /* [T, 2 inter] */
    float *act = gu + T * 2 * inter; /* [T, inter] */

    S->failed = 0;
    if (S->hidden_in) /* a later pipeline stage: the rows its stage before made, whole on every rank */
        memcpy(x, S->hidden_in, sizeof(float) * (size_t)(T * hid));
    for (int64_t t = 0; t < T && !S->hidden_in; t++) {
        const int64_t row = S->input_ids[t] - M->vocab_start; /* this rank's row (a tensor-parallel rank's shard) */
        if (row < 0 || row >= M->vocab) {
            memset(x + t * hid, 0, sizeof(float) * hid);
        } else if (M->embed_bf16) {
            const uint16_t *e = (const uint16_t *)M->embed + row * hid;
            float *xt = x + t * hid;
            int64_t i = 0;
            for (; i + 8 <= hid; i += 8) _mm256_storeu_ps(xt + i, load_bf16(e + i));
            for (; i < hid; i++) {
                const uint32_t u = (uint32_t)e[i] << 16;
                memcpy(xt + i, &u, 4);
            }
        } else {
            memcpy(x + t * hid, (const float *)M->embed + row * hid, sizeof(float) * hid);
        }
    }
    if (M->reduce && !S->hidden_in) {
        int rc;
        PHASE(PH_REDUCE, rc = M->reduce(M->reduce_ctx, x, T * hid));
        if (rc) {
            S->failed = 1;
            return;
        }
    }

    for (int l = 0; l < M->n_layers; l++) {
        const Layer *L = &M->layers[l];
        const int grouped = S->group_tables != NULL;
        const int32_t *block_table = grouped ? S->group_tables[L->group] : S->block_table;
        const int64_t *slot_mapping = grouped ? S->group_slots[L->group] : S->slot_mapping;
        const int window = grouped ? S->group_windows[L->group] : 0;
        PHASE(PH_NORM, appl_rmsnorm(x, hid, L->ln1, h, hid, T, (int)hid, M->eps));
        PHASE(PH_QKV, appl_linear(&L->qkv, h, hid, qkv, qkv_w, T, 0));
        const double t_rope = now_s();
#pragma omp parallel for schedule(static) if (T >= 16)
        for (int64_t t = 0; t < T; t++) {
            float *qt = qkv + t * qkv_w, *kt = qt + H * d, *vt = kt + KVH * d;
            if (L->q_norm) {
                for (int i = 0; i < H; i++) rmsnorm_row(qt + i * d, L->q_norm, qt + i * d, (int)d, M->eps);
                for (int i = 0; i < KVH; i++) rmsnorm_row(kt + i * d, L->k_norm, kt + i * d, (int)d, M->eps);
            }
            const int64_t pos = S->positions[t];
            const float *c = M->rope_cos + pos * M->rope_dim, *s = M->rope_sin + pos * M->rope_dim;
            rope_heads(qt, H, (int)d, M->rope_dim, c, s);
            rope_heads(kt, KVH, (int)d, M->rope_dim, c, s);
            appl_kv_write(L->k_cache, L->v_cache, kt, vt, slot_mapping[t], KVH * d, M->kv_type, L->k_scale,
                          L->v_scale);
        }
        g_phase[PH_ROPE_KV] += now_s() - t_rope;
        PHASE(PH_ATTN, appl_attention(qkv, qkv_w, att, attn_w, L->k_cache, L->v_cache, (int)T, S->n_reqs, S->qsl,
                                      S->seq_lens, block_table, S->bt_stride, S->block_size, H, KVH, (int)d,
                                      M->attn_scale, M->kv_type, L->k_scale, L->v_scale, window, 0, 0.0f, NULL));
        if (residual_linear(M, &L->o, att, attn_w, h, x, T, PH_O)) { /* h: scratch here, normed again below */
            S->failed = 1;
            return;
        }
        PHASE(PH_NORM, appl_rmsnorm(x, hid, L->ln2, h, hid, T, (int)hid, M->eps));
        if (L->moe) {
            float *part = act + T * inter; /* [T, hid]: a tensor-parallel rank's share, reduced before the add */
            if (!M->reduce) {
                moe_forward(M, L->moe, h, x, T, part + T * hid);
                continue;
            }
            memset(part, 0, sizeof(float) * (size_t)(T * hid));
            moe_forward(M, L->moe, h, part, T, part + T * hid); /* this rank's rows of every expert */
            if (reduce_add(M, part, x, T * hid)) {
                S->failed = 1;
                return;
            }
            continue;
        }
        PHASE(PH_GATE_UP, appl_linear(&L->gate_up, h, hid, gu, 2 * inter, T, 0));
        const double t_act = now_s();
#pragma omp parallel for schedule(static) if (T >= 8)
        for (int64_t t = 0; t < T; t++) silu_mul_row(gu + t * 2 * inter, act + t * inter, (int)inter);
        g_phase[PH_ACT] += now_s() - t_act;
        if (residual_linear(M, &L->down, act, inter, h, x, T, PH_DOWN)) {
            S->failed = 1;
            return;
        }
    }
    if (S->hidden_out) { /* a pipeline stage before the last: its rows go on */
        memcpy(S->hidden_out, x, sizeof(float) * (size_t)(T * hid));
        return;
    }
    const double t_lm = now_s();
    for (int i = 0; i < S->n_logits; i++)
        rmsnorm_row(x + S->logits_indices[i] * hid, M->final_norm, h + i * hid, (int)hid, M->eps);
    appl_linear(&M->lm_head, h, hid, S->logits, M->vocab, S->n_logits, 0);
    g_phase[PH_LM_HEAD] += now_s() - t_lm;
}

/* ---- grammar bitmask ----
 * Structured outputs mask each constrained logits row to the tokens its
 * grammar allows: bit b of word w of a packed int32 bitmask row (xgrammar's
 * layout) allows token 32 w + b. rows[i] = (logits row, bitmask row); only
 * the first `vocab` logits of a row are read. A word that allows all 32
 * tokens is skipped; the others are written eight lanes at a time (each
 * lane's bit tested in a vector, -inf blended in where it is clear). */
void appl_apply_token_bitmask(float *logits, int64_t ld_logits, const int32_t *bitmask, int64_t ld_bitmask,
                              const int32_t *rows, int n_rows, int64_t vocab) {
    const __m256 neg_inf = _mm256_set1_ps(-INFINITY);
    const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
    const __m256i zero = _mm256_setzero_si256();
    for (int i = 0; i < n_rows; i++) {
        float *row = logits + (int64_t)rows[2 * i] * ld_logits;
        const int32_t *bits = bitmask + (int64_t)rows[2 * i + 1] * ld_bitmask;
        const int64_t full_words = vocab / 32;
        for (int64_t w = 0; w < full_words; w++) {
            const uint32_t word = (uint32_t)bits[w];
            if (word == 0xFFFFFFFFu) continue;
            float *out = row + w * 32;
            for (int q = 0; q < 4; q++) {
                const __m256i lanes = _mm256_and_si256(_mm256_set1_epi32((int32_t)(word >> (8 * q))), lane_bit);
                const __m256 clear = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lanes, zero));
                _mm256_storeu_ps(out + 8 * q, _mm256_blendv_ps(_mm256_loadu_ps(out + 8 * q), neg_inf, clear));
            }
        }
        for (int64_t t = full_words * 32; t < vocab; t++) /* a vocabulary that is not a multiple of 32 */
            if (!(((uint32_t)bits[t / 32] >> (t % 32)) & 1u)) row[t] = -INFINITY;
    }
}
