/* The kernels' outputs as bits, for comparing builds: compiled with nanoserve/kernels' sources for each
 * instruction set a machine or a cross compiler offers (x86-64 native, AVX2, plain C; aarch64 plain and NEON,
 * run under qemu-user), it prints one line per case, the case's name and a hash of every output float's bits.
 * Every build must print the same lines (tests/test_kernel_isas.py). The inputs are fixed pseudo-random blocks
 * with valid scales (a NaN scale would make every build agree on NaN). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int32_t ns_kq_types(void);
const char *ns_kq_name(int32_t type);
int64_t ns_kq_block_bytes(int32_t type);
int64_t ns_kq_inputs(int32_t type);
const char *ns_kq_isa(void);
const char *ns_q4_isa(void);
const char *ns_q4x8_isa(void);
int ns_kq_matmul(int32_t type, const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, int64_t ldy,
                 const float *bias, float *y, int32_t threads, int32_t accumulate);
int64_t ns_q4x8_packed_bytes(int64_t out, int64_t in);
void ns_q4x8_pack_gguf(const uint8_t *raw, int64_t out, int64_t in, uint8_t *dst, int32_t threads);
int ns_q4x8_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                   float *y, int32_t threads, int32_t accumulate);
int32_t ns_kx16_types(void);
const char *ns_kx16_name(int32_t type);
int64_t ns_kx16_packed_bytes(int32_t type, int64_t out, int64_t in);
int ns_kx16_pack(int32_t type, const uint8_t *raw, int64_t out, int64_t in, uint8_t *dst, int32_t threads);
int ns_kx16_matmul(int32_t type, const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out,
                   int64_t ldy, const float *bias, float *y, int32_t threads, int32_t accumulate);
const char *ns_kx16_isa(void);
int64_t ns_q4_packed_bytes(int64_t out, int64_t in);
void ns_q4_pack_gguf(const uint8_t *raw, int32_t q4_1, int64_t out, int64_t in, uint8_t *dst, int32_t threads);
int ns_q4_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                 float *y, int32_t threads, int32_t accumulate);
int64_t ns_q8_packed_bytes(int64_t out, int64_t in);
void ns_q8_pack(const int8_t *codes, const float *scales, int64_t out, int64_t in, uint8_t *dst);
int ns_q8_matmul(const uint8_t *w, const float *x, int64_t rows, int64_t in, int64_t out, const float *bias,
                 float *y, int32_t threads, int32_t accumulate);
void ns_add_rms_norm(float *x, int64_t rows, int64_t n, const void *delta, int32_t delta_kind, const float *w,
                     float eps, void *out, int32_t out_kind);
void ns_silu_mul(const void *gate_up, int32_t kind, int64_t rows, int64_t n, void *out);
int64_t ns_attention_scratch(int32_t group, int64_t max_keys, int32_t dim);
void ns_attention(const float *q, int64_t tokens, int32_t heads, int32_t kv_heads, int32_t dim, const float *k_cache,
                  const float *v_cache, int64_t num_blocks, int32_t block_size, const int64_t *tables, int64_t width,
                  const int64_t *row_of, const int64_t *keys_of, float scale, float *scratch, int64_t max_keys,
                  void *out, int32_t out_kind, int32_t threads);

#define OUT 48
#define IN 512
#define MAX_ROWS 11
static const int ROW_COUNTS[] = {1, 3, 8, 11};

static uint64_t state = 0x9e3779b97f4a7c15u;
static uint32_t next(void) {
    state ^= state << 13, state ^= state >> 7, state ^= state << 17;
    return (uint32_t)(state >> 16);
}

static void random_bytes(uint8_t *p, int64_t n) {
    for (int64_t i = 0; i < n; i++) p[i] = (uint8_t)next();
}

/* an f16 of size 2^-7 .. 2^-3, either sign (bf16: the same range) */
static uint16_t half_bits(int bf16) {
    uint32_t r = next();
    return (uint16_t)((r & 1) << 15 | (bf16 ? 0x3c00 + (r >> 1) % 0x200 : 0x2000 + (r >> 1) % 0x1000));
}

static void put_half(uint8_t *p, int bf16) {
    uint16_t h = half_bits(bf16);
    memcpy(p, &h, 2);
}

static float random_float(void) { return ((float)(next() % 20001) - 10000.0f) / 2500.0f; }

/* Random blocks of a GGUF type, each scale field a valid half */
static void gguf_blocks(const char *name, uint8_t *w, int64_t units, int64_t unit_bytes) {
    random_bytes(w, units * unit_bytes);
    for (int64_t u = 0; u < units; u++) {
        uint8_t *b = w + u * unit_bytes;
        if (!strcmp(name, "Q4_K") || !strcmp(name, "Q5_K")) put_half(b, 0), put_half(b + 2, 0);
        else if (!strcmp(name, "Q6_K")) put_half(b + 208, 0);
        else if (!strcmp(name, "Q2_K")) put_half(b + 80, 0), put_half(b + 82, 0);
        else if (!strcmp(name, "Q3_K")) put_half(b + 108, 0);
        else if (!strcmp(name, "IQ4_XS")) put_half(b, 0);
        else if (!strcmp(name, "Q5_0") || !strcmp(name, "IQ4_NL") || !strcmp(name, "Q5_1")) {
            int64_t each = unit_bytes / 8; /* eight blocks of 32 a unit */
            for (int k = 0; k < 8; k++) {
                put_half(b + k * each, 0);
                if (!strcmp(name, "Q5_1")) put_half(b + k * each + 2, 0);
            }
        } else if (!strcmp(name, "F16") || !strcmp(name, "BF16"))
            for (int64_t i = 0; i < unit_bytes; i += 2) put_half(b + i, !strcmp(name, "BF16"));
        else if (!strcmp(name, "Q4_0") || !strcmp(name, "Q4_1")) {
            put_half(b, 0);
            if (!strcmp(name, "Q4_1")) put_half(b + 2, 0);
        }
    }
}

static void report(const char *what, int rows, const float *y, int64_t n) {
    uint64_t h = 1469598103934665603u; /* FNV-1a over the bits */
    for (int64_t i = 0; i < n; i++) {
        uint32_t bits;
        memcpy(&bits, y + i, 4);
        for (int k = 0; k < 4; k++) h = (h ^ ((bits >> (8 * k)) & 255)) * 1099511628211u;
    }
    printf("%s rows=%d %016llx\n", what, rows, (unsigned long long)h);
}

static void activations(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = random_float();
}

static void kquant_cases(const float *x, float *y) {
    for (int32_t t = 0; t < ns_kq_types(); t++) {
        const char *name = ns_kq_name(t);
        int64_t units = IN / ns_kq_inputs(t), bytes = ns_kq_block_bytes(t);
        uint8_t *w = malloc((size_t)(OUT * units * bytes));
        gguf_blocks(name, w, OUT * units, bytes);
        for (size_t c = 0; c < sizeof ROW_COUNTS / sizeof ROW_COUNTS[0]; c++) {
            memset(y, 0, sizeof(float) * MAX_ROWS * OUT);
            if (ns_kq_matmul(t, w, x, ROW_COUNTS[c], IN, OUT, OUT, NULL, y, 2, 0)) printf("%s failed\n", name);
            report(name, ROW_COUNTS[c], y, (int64_t)ROW_COUNTS[c] * OUT);
        }
        free(w);
    }
}

/* Q4_K, Q5_K and Q6_K interleaved 16 outputs a super-block (kx16), as the loader packs a file's rows of these types */
static void kx16_cases(const float *x, float *y) {
    for (int32_t t = 0; t < ns_kx16_types(); t++) {
        const char *name = ns_kx16_name(t);
        int64_t units = OUT * (IN / 256), bytes = !strcmp(name, "Q4_K") ? 144 : !strcmp(name, "Q5_K") ? 176 : 210;
        uint8_t *raw = malloc((size_t)(units * bytes)), *w = malloc((size_t)ns_kx16_packed_bytes(t, OUT, IN));
        char what[32];
        snprintf(what, sizeof what, "%s/x16", name);
        gguf_blocks(name, raw, units, bytes);
        if (ns_kx16_pack(t, raw, OUT, IN, w, 2)) printf("%s failed\n", what);
        for (size_t c = 0; c < sizeof ROW_COUNTS / sizeof ROW_COUNTS[0]; c++) {
            if (ns_kx16_matmul(t, w, x, ROW_COUNTS[c], IN, OUT, OUT, NULL, y, 2, 0)) printf("%s failed\n", what);
            report(what, ROW_COUNTS[c], y, (int64_t)ROW_COUNTS[c] * OUT);
        }
        free(raw), free(w);
    }
}

/* Q4_0 (q4x8), Q4_1 (the 4-bit kernel) and Q8_0 (the 8-bit kernel), packed as the loader packs them */
static void packed_cases(const float *x, float *y) {
    int64_t blocks = OUT * (IN / 32);
    uint8_t *raw = malloc((size_t)(blocks * 20));
    for (int q4_1 = 0; q4_1 < 2; q4_1++) {
        const char *name = q4_1 ? "Q4_1" : "Q4_0";
        gguf_blocks(name, raw, blocks, q4_1 ? 20 : 18);
        int64_t packed = q4_1 ? ns_q4_packed_bytes(OUT, IN) : ns_q4x8_packed_bytes(OUT, IN);
        uint8_t *w = malloc((size_t)packed);
        if (q4_1) ns_q4_pack_gguf(raw, 1, OUT, IN, w, 2);
        else ns_q4x8_pack_gguf(raw, OUT, IN, w, 2);
        for (size_t c = 0; c < sizeof ROW_COUNTS / sizeof ROW_COUNTS[0]; c++) {
            int rows = ROW_COUNTS[c];
            if ((q4_1 ? ns_q4_matmul : ns_q4x8_matmul)(w, x, rows, IN, OUT, NULL, y, 2, 0)) printf("%s failed\n", name);
            report(name, rows, y, (int64_t)rows * OUT);
        }
        free(w);
    }
    free(raw);
    int8_t *codes = malloc(OUT * IN);
    float scales[OUT * (IN / 32)];
    random_bytes((uint8_t *)codes, OUT * IN);
    for (int i = 0; i < OUT * (IN / 32); i++) scales[i] = (float)(next() % 1000 + 1) / 65536.0f;
    uint8_t *w = malloc((size_t)ns_q8_packed_bytes(OUT, IN));
    ns_q8_pack(codes, scales, OUT, IN, w);
    for (size_t c = 0; c < sizeof ROW_COUNTS / sizeof ROW_COUNTS[0]; c++) {
        if (ns_q8_matmul(w, x, ROW_COUNTS[c], IN, OUT, NULL, y, 2, 0)) printf("Q8_0 failed\n");
        report("Q8_0", ROW_COUNTS[c], y, (int64_t)ROW_COUNTS[c] * OUT);
    }
    free(w), free(codes);
}

/* The ops around the linears: residual add and RMS norm, silu times up */
static void elementwise_cases(const float *x) {
    float h[MAX_ROWS * IN], delta[MAX_ROWS * IN], w[IN], out[MAX_ROWS * IN];
    memcpy(h, x, sizeof h);
    activations(delta, MAX_ROWS * IN);
    activations(w, IN);
    ns_add_rms_norm(h, MAX_ROWS, IN, delta, 1, w, 1e-5f, out, 1);
    report("add_rms_norm", MAX_ROWS, out, MAX_ROWS * IN);
    report("add_rms_norm residual", MAX_ROWS, h, MAX_ROWS * IN);
    ns_silu_mul(x, 1, MAX_ROWS, IN / 2, out);
    report("silu_mul", MAX_ROWS, out, MAX_ROWS * IN / 2);
}

/* The paged attention: two sequences' queries (a prefill of 5 tokens, then one decode token at 37 keys) over
 * blocks of 16 keys in a scattered table, 4 query heads on 2 key-value heads of 64 dims */
#define HEADS 4
#define KV_HEADS 2
#define DIM 64
#define BLOCK 16
#define BLOCKS 8
static void attention_case(void) {
    static float k[KV_HEADS * BLOCKS * DIM * BLOCK], v[KV_HEADS * BLOCKS * BLOCK * DIM], q[6 * HEADS * DIM],
        out[6 * HEADS * DIM];
    activations(k, sizeof k / sizeof k[0]);
    activations(v, sizeof v / sizeof v[0]);
    activations(q, sizeof q / sizeof q[0]);
    const int64_t tables[2 * 3] = {5, 2, 7, 0, 3, 6}, row_of[6] = {0, 0, 0, 0, 0, 1}, keys_of[6] = {1, 2, 3, 4, 5, 37};
    int64_t max_keys = 48;
    float *scratch = malloc(sizeof(float) * 2 * (size_t)ns_attention_scratch(HEADS / KV_HEADS, max_keys, DIM));
    ns_attention(q, 6, HEADS, KV_HEADS, DIM, k, v, BLOCKS, BLOCK, tables, 3, row_of, keys_of, 0.125f, scratch,
                 max_keys, out, 1, 2);
    report("attention", 6, out, 6 * HEADS * DIM);
    free(scratch);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--isa")) { /* which paths this build took */
        printf("kquant %s, q4 %s, q4x8 %s, kx16 %s\n", ns_kq_isa(), ns_q4_isa(), ns_q4x8_isa(), ns_kx16_isa());
        return 0;
    }
    float *x = malloc(sizeof(float) * MAX_ROWS * IN), *y = malloc(sizeof(float) * MAX_ROWS * OUT);
    activations(x, MAX_ROWS * IN);
    /* the codes' extremes: an all-zero group, a group of -1 (16-bit codes of -32767: hi bytes of -128), +-1 alternating */
    for (int i = 0; i < 32; i++)
        x[IN + i] = 0.0f, x[32 + i] = -1.0f, x[(MAX_ROWS - 1) * IN + IN - 32 + i] = i % 2 ? -1.0f : 1.0f;
    kquant_cases(x, y);
    kx16_cases(x, y);
    packed_cases(x, y);
    elementwise_cases(x);
    attention_case();
    free(x), free(y);
    return 0;
}
