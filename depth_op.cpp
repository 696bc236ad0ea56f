// The depth read of depth_op.py on CPU, forward and backward, one pass over the candidates per token
// (depth_op.py has the equations), and DAR's write, one pass over its tensors. Plain C++ with
// OpenMP and no torch headers: it compiles in a fraction of a second; depth_op.py builds it once
// and calls it through ctypes.
// S streams of R candidates each: stream s's candidate r is cand[s * R + r] (N, C), its rms
// rms (S, R, N), taken in forward. T targets: target t has the query row w[t] (C), reads the keys
// of stream ks[t] and the values of stream vs[t], and is scaled by *gate[t] (1 if gate is null);
// g (C) is the key norm's weight, u_t = g * w_t. Weights a and scores sc: (T, R, N). x (N, C) =
// scale sum_t gate_t h_t (scale: a number, taken into each target's gate).
#include <cmath>
#include <cstdint>
#include <vector>
#include <omp.h>

// u_t = g * w_t, (T, C)
template <typename T>
static std::vector<T> queries(int64_t Tn, int64_t C, const T* g, const T* const* w) {
    std::vector<T> u(Tn * C);
    for (int64_t t = 0; t < Tn; t++)
        for (int64_t c = 0; c < C; c++) u[t * C + c] = g[c] * w[t][c];
    return u;
}

template <typename T>
static void forward(int64_t S, int64_t R, int64_t Tn, int64_t N, int64_t C, const T* const* cand,
                    const T* g, const T* const* w, const int64_t* ks, const int64_t* vs,
                    const T* const* gate, T scale, T eps, T* x, T* a, T* sc, T* rms, int threads) {
    const std::vector<T> u = queries(Tn, C, g, w);
    #pragma omp parallel for num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        // rms_r = sqrt(mean(k_r^2) + eps)
        for (int64_t i = 0; i < S * R; i++) {
            const T* k = cand[i] + n * C;
            T sq = 0;
            #pragma omp simd reduction(+:sq)
            for (int64_t c = 0; c < C; c++) sq += k[c] * k[c];
            rms[i * N + n] = std::sqrt(sq / C + eps);
        }
        T* xn = x + n * C;
        for (int64_t c = 0; c < C; c++) xn[c] = 0;
        for (int64_t t = 0; t < Tn; t++) {
            const T* ut = u.data() + t * C;
            T* at = a + t * R * N;
            T* st = sc + t * R * N;
            // s_r = (k_r . u) / rms_r
            T m = -INFINITY;
            for (int64_t r = 0; r < R; r++) {
                const T* k = cand[ks[t] * R + r] + n * C;
                T dot = 0;
                #pragma omp simd reduction(+:dot)
                for (int64_t c = 0; c < C; c++) dot += k[c] * ut[c];
                st[r * N + n] = dot / rms[(ks[t] * R + r) * N + n];
                m = st[r * N + n] > m ? st[r * N + n] : m;
            }
            // a = softmax_r(s)
            T z = 0;
            for (int64_t r = 0; r < R; r++) {
                at[r * N + n] = std::exp(st[r * N + n] - m);
                z += at[r * N + n];
            }
            // x += gate_t sum_r a_r v_r
            for (int64_t r = 0; r < R; r++) {
                at[r * N + n] /= z;
                const T wr = scale * (gate ? *gate[t] : T(1)) * at[r * N + n];
                const T* v = cand[vs[t] * R + r] + n * C;
                #pragma omp simd
                for (int64_t c = 0; c < C; c++) xn[c] += wr * v[c];
            }
        }
    }
}

// The gradient of stream s's candidate r goes to gout[s * R + r]: the incoming gradient gin[s * R +
// r] (none where null) plus this read's part, the key part of every target that reads its keys
// there and the value part of every target that reads its values there. A candidate i given as
// terms (c1[i] not null) is made here, token by token, not read: c1[i] * cand[i] + c2[i] * y2[i]
// (c1, c2 rows of C; y2 null: no second term).
template <typename T>
static void backward(int64_t S, int64_t R, int64_t Tn, int64_t N, int64_t C, const T* dx,
                     const T* const* cand, const T* const* c1, const T* const* y2,
                     const T* const* c2, const T* g, const T* const* w, const int64_t* ks,
                     const int64_t* vs, const T* const* gate, T scale, const T* a, const T* sc,
                     const T* rms, T* const* gout, const T* const* gin, T* dw, T* dg, T* dgate,
                     int threads) {
    const std::vector<T> u = queries(Tn, C, g, w);
    std::vector<T> du_t(threads * Tn * C, T(0)), dgate_t(threads * Tn, T(0));
    #pragma omp parallel num_threads(threads)
    {
        const int th = omp_get_thread_num();
        T* du_l = du_t.data() + th * Tn * C;
        T* dgate_l = dgate_t.data() + th * Tn;
        // per target and candidate: c = ds / rms, kk = -c s / (C rms), w = gate a
        std::vector<T> cr(Tn * R), kk(Tn * R), w(Tn * R);
        std::vector<T> made(S * R * C); // this token's rows of the candidates given as terms
        std::vector<const T*> row(S * R);
        #pragma omp for
        for (int64_t n = 0; n < N; n++) {
            const T* dxn = dx + n * C;
            for (int64_t i = 0; i < S * R; i++) {
                row[i] = cand[i] + n * C;
                if (!c1[i]) continue;
                T* m = made.data() + i * C;
                const T* y = row[i];
                #pragma omp simd
                for (int64_t c = 0; c < C; c++) m[c] = c1[i][c] * y[c];
                if (y2[i]) {
                    const T* y_ = y2[i] + n * C;
                    #pragma omp simd
                    for (int64_t c = 0; c < C; c++) m[c] += c2[i][c] * y_[c];
                }
                row[i] = m;
            }
            for (int64_t t = 0; t < Tn; t++) {
                const T gt = scale * (gate ? *gate[t] : T(1)); // the gate and the scale
                const T* at = a + t * R * N;
                // q_r = dx . v_r ; dgate_t = scale sum_r a_r q_r ; da_r = scale gate_t q_r
                T sum_ad = 0;
                for (int64_t r = 0; r < R; r++) {
                    const T* v = row[vs[t] * R + r];
                    T q = 0;
                    #pragma omp simd reduction(+:q)
                    for (int64_t c = 0; c < C; c++) q += dxn[c] * v[c];
                    dgate_l[t] += scale * at[r * N + n] * q;
                    cr[t * R + r] = gt * q;
                    sum_ad += at[r * N + n] * gt * q;
                }
                for (int64_t r = 0; r < R; r++) {
                    // ds_r = a_r (da_r - sum_p a_p da_p) ; c_r = ds_r / rms_r
                    const T rh = rms[(ks[t] * R + r) * N + n];
                    const T c = at[r * N + n] * (cr[t * R + r] - sum_ad) / rh;
                    cr[t * R + r] = c;
                    kk[t * R + r] = -c * sc[t * R * N + r * N + n] / (C * rh);
                    w[t * R + r] = gt * at[r * N + n];
                }
            }
            for (int64_t s = 0; s < S; s++) {
                for (int64_t r = 0; r < R; r++) {
                    // dk_r = c_r (u - s_r k_r / (C rms_r)) for the targets keyed here ; dv_r = gate a_r dx
                    const T* k = row[s * R + r];
                    const T* in = gin[s * R + r] ? gin[s * R + r] + n * C : nullptr;
                    T* out = gout[s * R + r] + n * C;
                    T kc = 0, vc = 0;
                    for (int64_t t = 0; t < Tn; t++) {
                        if (ks[t] == s) kc += kk[t * R + r];
                        if (vs[t] == s) vc += w[t * R + r];
                    }
                    if (in) {
                        #pragma omp simd
                        for (int64_t c = 0; c < C; c++) out[c] = in[c] + kc * k[c] + vc * dxn[c];
                    } else {
                        #pragma omp simd
                        for (int64_t c = 0; c < C; c++) out[c] = kc * k[c] + vc * dxn[c];
                    }
                    for (int64_t t = 0; t < Tn; t++) {
                        if (ks[t] != s) continue;
                        // + c_r u_t ; du_t += c_r k_r
                        const T c_ = cr[t * R + r];
                        const T* ut = u.data() + t * C;
                        T* dut = du_l + t * C;
                        #pragma omp simd
                        for (int64_t c = 0; c < C; c++) {
                            out[c] += c_ * ut[c];
                            dut[c] += c_ * k[c];
                        }
                    }
                }
            }
        }
    }
    // du_t summed over the threads ; dw_t = du_t * g ; dg = sum_t du_t * w_t
    std::vector<T> du(Tn * C, T(0));
    for (int64_t t = 0; t < Tn; t++) dgate[t] = 0;
    for (int th = 0; th < threads; th++) {
        for (int64_t i = 0; i < Tn * C; i++) du[i] += du_t[th * Tn * C + i];
        for (int64_t t = 0; t < Tn; t++) dgate[t] += dgate_t[th * Tn + t];
    }
    for (int64_t c = 0; c < C; c++) dg[c] = 0;
    for (int64_t t = 0; t < Tn; t++) {
        for (int64_t c = 0; c < C; c++) {
            dw[t * C + c] = du[t * C + c] * g[c];
            dg[c] += du[t * C + c] * w[t][c];
        }
    }
}

// DAR's write of y into the two partials, with beta^0, beta^1 (C) and rho, each P (N, C):
// P^0' = rho P^0 + (1-rho) P^1 + beta^0 y ; P^1' = (1-rho) P^0 + rho P^1 + beta^1 y ; without
// partials (P0 null: a block starts) P^j' = beta^j y.
template <typename T>
static void write_forward(int64_t N, int64_t C, const T* P0, const T* P1, const T* y, const T* b0,
                          const T* b1, const T* rho, T* o0, T* o1, int threads) {
    const T r = P0 ? *rho : T(0);
    #pragma omp parallel for num_threads(threads)
    for (int64_t n = 0; n < N; n++) {
        const T* yn = y + n * C;
        T* o0n = o0 + n * C;
        T* o1n = o1 + n * C;
        if (P0) {
            const T* p0 = P0 + n * C;
            const T* p1 = P1 + n * C;
            #pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                o0n[c] = r * p0[c] + (1 - r) * p1[c] + b0[c] * yn[c];
                o1n[c] = (1 - r) * p0[c] + r * p1[c] + b1[c] * yn[c];
            }
        } else {
            #pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                o0n[c] = b0[c] * yn[c];
                o1n[c] = b1[c] * yn[c];
            }
        }
    }
}

// Its backward from d0, d1 (the gradients of P^0', P^1'):
// dP^0 = rho d0 + (1-rho) d1 ; dP^1 = (1-rho) d0 + rho d1 ; dy = beta^0 d0 + beta^1 d1 ;
// dbeta^j = sum_n y d_j ; drho = sum (P^0 - P^1) . (d0 - d1). Without partials dP0, dP1 and drho
// are unused.
template <typename T>
static void write_backward(int64_t N, int64_t C, const T* P0, const T* P1, const T* y, const T* b0,
                           const T* b1, const T* rho, const T* d0, const T* d1, T* dP0, T* dP1,
                           T* dy, T* db0, T* db1, T* drho, int threads) {
    const T r = P0 ? *rho : T(0);
    std::vector<T> db_t(threads * 2 * C, T(0)), drho_t(threads, T(0));
    #pragma omp parallel num_threads(threads)
    {
        const int th = omp_get_thread_num();
        T* db0_l = db_t.data() + th * 2 * C;
        T* db1_l = db0_l + C;
        T dr = 0;
        #pragma omp for
        for (int64_t n = 0; n < N; n++) {
            const T* yn = y + n * C;
            const T* d0n = d0 + n * C;
            const T* d1n = d1 + n * C;
            T* dyn = dy + n * C;
            #pragma omp simd
            for (int64_t c = 0; c < C; c++) {
                dyn[c] = b0[c] * d0n[c] + b1[c] * d1n[c];
                db0_l[c] += yn[c] * d0n[c];
                db1_l[c] += yn[c] * d1n[c];
            }
            if (!P0) continue;
            const T* p0 = P0 + n * C;
            const T* p1 = P1 + n * C;
            T* dp0 = dP0 + n * C;
            T* dp1 = dP1 + n * C;
            #pragma omp simd reduction(+:dr)
            for (int64_t c = 0; c < C; c++) {
                dp0[c] = r * d0n[c] + (1 - r) * d1n[c];
                dp1[c] = (1 - r) * d0n[c] + r * d1n[c];
                dr += (p0[c] - p1[c]) * (d0n[c] - d1n[c]);
            }
        }
        drho_t[th] = dr;
    }
    T dr = 0;
    for (int64_t c = 0; c < C; c++) db0[c] = db1[c] = 0;
    for (int th = 0; th < threads; th++) {
        for (int64_t c = 0; c < C; c++) {
            db0[c] += db_t[th * 2 * C + c];
            db1[c] += db_t[th * 2 * C + C + c];
        }
        dr += drho_t[th];
    }
    if (P0) *drho = dr;
}

#define EXPORT(T, name)                                                                           \
    extern "C" void forward_##name(int64_t S, int64_t R, int64_t Tn, int64_t N, int64_t C,         \
                                   const T* const* cand, const T* g, const T* const* w,            \
                                   const int64_t* ks, const int64_t* vs, const T* const* gate,     \
                                   double scale, double eps, T* x, T* a, T* sc, T* rms,            \
                                   int threads) {                                                  \
        forward<T>(S, R, Tn, N, C, cand, g, w, ks, vs, gate, T(scale), T(eps), x, a, sc, rms,      \
                   threads);                                                                       \
    }                                                                                              \
    extern "C" void backward_##name(int64_t S, int64_t R, int64_t Tn, int64_t N, int64_t C,        \
                                    const T* dx, const T* const* cand, const T* const* c1,         \
                                    const T* const* y2, const T* const* c2, const T* g,            \
                                    const T* const* w, const int64_t* ks, const int64_t* vs,       \
                                    const T* const* gate, double scale, const T* a, const T* sc,   \
                                    const T* rms, T* const* gout, const T* const* gin, T* dw,      \
                                    T* dg, T* dgate, int threads) {                                \
        backward<T>(S, R, Tn, N, C, dx, cand, c1, y2, c2, g, w, ks, vs, gate, T(scale), a, sc, rms,  \
                    gout, gin, dw, dg, dgate, threads);                                            \
    }                                                                                              \
    extern "C" void write_forward_##name(int64_t N, int64_t C, const T* P0, const T* P1,           \
                                         const T* y, const T* b0, const T* b1, const T* rho,       \
                                         T* o0, T* o1, int threads) {                              \
        write_forward<T>(N, C, P0, P1, y, b0, b1, rho, o0, o1, threads);                           \
    }                                                                                              \
    extern "C" void write_backward_##name(int64_t N, int64_t C, const T* P0, const T* P1,          \
                                          const T* y, const T* b0, const T* b1, const T* rho,      \
                                          const T* d0, const T* d1, T* dP0, T* dP1, T* dy,         \
                                          T* db0, T* db1, T* drho, int threads) {                  \
        write_backward<T>(N, C, P0, P1, y, b0, b1, rho, d0, d1, dP0, dP1, dy, db0, db1, drho,      \
                          threads);                                                                \
    }
EXPORT(float, float)
EXPORT(double, double)
