"""The Triton kernels of the per-row and per-entry norms (ScaleNorm, RMSNorm,
DyT, Derf): a program holds a row tile in registers; each backward's last program
to arrive (counted in a ticket one element past the forward's per-row
statistic, set to 0 by its first program) adds the programs' parameter sums.
"""

from .gpu_helpers import triton

if triton is not None:
    import triton.language as tl

    from .gpu_helpers import _cast, _f, _inv_rms, _last_to_arrive, _row_tile

    # The per-row kernels hold a row tile in registers; with WIDE, a row wider
    # than that (gpu.WIDEST_ROW) is walked twice in blocks of columns: once for
    # the row's sums, once to write (the second read finds the rows in cache).

    @triton.jit
    def _row_sum(X, XB, XST, XSB, Y, W, w_offset, first, N, C, cols, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
                 F64: tl.constexpr, HAS_W: tl.constexpr, SQUARE: tl.constexpr):
        """Per row of rows first .. first + BLOCK_N: the sum over every column
        of x * y (* (w + w_offset)), y the (N, C) ``Y`` or, with SQUARE, x itself."""
        total = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + cols
            rows, rmask, m2, at, x = _row_tile(X, XB, XST, XSB, first, N, C, cc, cc < C, BLOCK_N, F64)
            y = x
            if not SQUARE:
                y = _f(tl.load(Y + at, mask=m2, other=0.0), F64)
            if HAS_W:
                y = y * (_f(tl.load(W + cc, mask=cc < C, other=0.0), F64) + w_offset)[None, :]
            total += tl.sum(x * y, axis=1)
        return total

    @triton.jit
    def _sum_parts(PART, OUT, C, cols, BLOCK_C: tl.constexpr):
        """OUT[c] = the programs' partial sums PART[p, c], added in a fixed order in float64."""
        for c0 in range(0, C, BLOCK_C):
            cc = c0 + cols
            acc = tl.load(PART + cc, mask=cc < C, other=0.0).to(tl.float64)
            for p in range(1, tl.num_programs(0)):
                acc += tl.load(PART + p * C + cc, mask=cc < C, other=0.0).to(tl.float64)
            tl.store(OUT + cc, _cast(acc, OUT), mask=cc < C)

    @triton.jit
    def _scaled_rows(X, P, Y, STAT, N, C, XB, XST, XSB, per_prog, eps, w_offset, F64: tl.constexpr,
                     WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, RMS: tl.constexpr):
        """Each row scaled by a statistic of its own, kept in STAT (its element N is the backward's
        arrival ticket, set to 0 by program 0): ScaleNorm's y = g x / max(||x||, eps) (Nguyen &
        Salazar, 2019, Eq. 8; STAT the norms) or, with RMS, RMSNorm's y = w x r, r = 1 / sqrt(mean(x^2)
        + eps) (Zhang & Sennrich, 2019, Eq. 4; STAT the r); the gain read as P + w_offset."""
        cols = tl.arange(0, BLOCK_C)
        if RMS:
            p = _f(tl.load(P + cols, mask=cols < C, other=0.0), F64) + w_offset
        else:
            p = _f(tl.load(P), F64) + w_offset
        if tl.program_id(0) == 0:
            tl.store(STAT + N, 0.0)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            if WIDE:
                ss = _row_sum(X, XB, XST, XSB, X, X, 0.0, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64, False, True)
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                ss = tl.sum(x * x, axis=1)
            if RMS:
                stat = _inv_rms(ss, C, eps)
            else:
                stat = tl.maximum(tl.sqrt(ss), eps)
            tl.store(STAT + rows, stat, mask=rows < N)
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, c0 + cols, c0 + cols < C,
                                                BLOCK_N, F64)
                    if RMS:
                        p = _f(tl.load(P + c0 + cols, mask=c0 + cols < C, other=0.0), F64) + w_offset
                if RMS:
                    y = x * stat[:, None] * p[None, :]
                else:
                    y = x * (p / stat)[:, None]
                tl.store(Y + at, y.to(Y.dtype.element_ty), mask=m2)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _scalenorm_forward(X, S, Y, NORMS, N, C, XB, XST, XSB, per_prog, eps, w_offset, F64: tl.constexpr,
                           WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        _scaled_rows(X, S, Y, NORMS, N, C, XB, XST, XSB, per_prog, eps, w_offset, F64, WIDE, BLOCK_N, BLOCK_C, False)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _scalenorm_backward(X, NORMS, GY, S, GX, PART, GS, TICKET, N, C, XB, XST, XSB, per_prog, eps, w_offset,
                            F64: tl.constexpr, WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        cols = tl.arange(0, BLOCK_C)
        g = _f(tl.load(S), F64) + w_offset
        total = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            rmask = rows < N
            norm = _f(tl.load(NORMS + rows, mask=rmask, other=1.0), F64)
            if WIDE:
                dot = _row_sum(X, XB, XST, XSB, GY, X, 0.0, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64, False,
                               False)
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                dot = tl.sum(gy * x, axis=1)
            total += tl.where(rmask, dot / norm, 0.0)
            k = tl.where(norm > eps, dot / (norm * norm), 0.0)
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, c0 + cols, c0 + cols < C,
                                                BLOCK_N, F64)
                    gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                gx = (g / norm)[:, None] * (gy - x * k[:, None])
                tl.store(GX + at, gx.to(GX.dtype.element_ty), mask=m2)
        tl.store(PART + tl.program_id(0), tl.sum(total, axis=0))
        if _last_to_arrive(TICKET):  # dL/dg: the programs' sums, in a fixed order
            _sum_parts(PART, GS, 1, tl.arange(0, 1), 1)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _rmsnorm_forward(X, W, Y, RSTD, N, C, XB, XST, XSB, per_prog, eps, w_offset, F64: tl.constexpr,
                         WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        _scaled_rows(X, W, Y, RSTD, N, C, XB, XST, XSB, per_prog, eps, w_offset, F64, WIDE, BLOCK_N, BLOCK_C, True)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _rmsnorm_backward(X, RSTD, GY, W, GX, PART, GW, TICKET, N, C, XB, XST, XSB, per_prog, w_offset,
                          F64: tl.constexpr, WIDE: tl.constexpr, SUM_HERE: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """dL/dw's per-program sums stay in registers, or with WIDE in the
        program's row of PART, added to block by block; the rows are added by
        the last program to arrive (SUM_HERE: few programs) or by _sum_columns."""
        cols = tl.arange(0, BLOCK_C)
        part = PART + tl.program_id(0).to(tl.int64) * C
        w = _f(tl.load(W + cols, mask=cols < C, other=0.0), F64) + w_offset
        gw = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
        if WIDE:
            for c0 in range(0, C, BLOCK_C):
                tl.store(part + c0 + cols, gw, mask=c0 + cols < C)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            rows = start + r0 + tl.arange(0, BLOCK_N)
            r = _f(tl.load(RSTD + rows, mask=rows < N, other=0.0), F64)
            if WIDE:
                dot = _row_sum(X, XB, XST, XSB, GY, W, w_offset, start + r0, N, C, cols, BLOCK_N, BLOCK_C, F64,
                               True, False) * r / C
            else:
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cols < C, BLOCK_N, F64)
                gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                dot = tl.sum(gy * w[None, :] * x * r[:, None], axis=1) / C
            for c0 in range(0, C if WIDE else 1, BLOCK_C):
                if WIDE:
                    cc = c0 + cols
                    _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cc, cc < C, BLOCK_N, F64)
                    gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                    w = _f(tl.load(W + cc, mask=cc < C, other=0.0), F64) + w_offset
                xr = x * r[:, None]
                g = gy * w[None, :]
                gx = r[:, None] * (g - xr * dot[:, None])
                tl.store(GX + at, gx.to(GX.dtype.element_ty), mask=m2)
                if WIDE:  # one program reads back what it wrote: a barrier orders it
                    tl.store(part + cc, tl.load(part + cc, mask=cc < C, other=0.0) + tl.sum(gy * xr, axis=0),
                             mask=cc < C)
                    tl.debug_barrier()
                else:
                    gw += tl.sum(gy * xr, axis=0)
        if not WIDE:
            tl.store(part + cols, gw, mask=cols < C)
        if SUM_HERE:
            if _last_to_arrive(TICKET):  # dL/dw: the programs' sums, in a fixed order
                _sum_parts(PART, GW, C, cols, BLOCK_C)

    @triton.jit
    def _tanh(u):
        """tanh(u) from exp alone (the interpreter has no libdevice): sign(u) (1 - e) / (1 + e), e = exp(-2|u|),
        which cannot overflow; below |u| = 1/16, where 1 - e would cancel, its odd series to u^9 (within a
        float64 rounding there), its coefficients as integer ratios that round in u's own dtype."""
        au = tl.abs(u)
        e = tl.exp(-2.0 * au)
        u2 = u * u
        near = au * (1 - u2 / 3 * (1 - u2 * 2 / 5 * (1 - u2 * 17 / 42 * (1 - u2 * 62 / 153))))
        t = tl.where(au < 0.0625, near, (1.0 - e) / (1.0 + e))
        return tl.where(u < 0, -t, t)

    @triton.jit
    def _entry_forward(X, ALPHA, SHIFT, W, B, Y, TICKET, N, C, XB, XST, XSB, per_prog, w_offset, F64: tl.constexpr,
                       WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, ERF: tl.constexpr):
        """The per-entry kinds' y = w f(u) + b, a wide row in blocks of columns: DyT's f = tanh, u = alpha x
        (Zhu et al., 2025, Eq. 1), or with ERF Derf's f = erf, u = alpha x + s; program 0 sets the
        backward's arrival ticket to 0."""
        cols = tl.arange(0, BLOCK_C)
        a = _f(tl.load(ALPHA), F64)
        if tl.program_id(0) == 0:
            tl.store(TICKET, 0.0)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            for c0 in range(0, C, BLOCK_C):
                cc = c0 + cols
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cc, cc < C, BLOCK_N, F64)
                w = _f(tl.load(W + cc, mask=cc < C, other=0.0), F64) + w_offset
                b = _f(tl.load(B + cc, mask=cc < C, other=0.0), F64)
                if ERF:
                    fu = tl.math.erf(a * x + _f(tl.load(SHIFT), F64))
                else:
                    fu = _tanh(a * x)
                tl.store(Y + at, (fu * w[None, :] + b[None, :]).to(Y.dtype.element_ty), mask=m2)

    @triton.jit
    def _entry_backward(X, GY, ALPHA, SHIFT, W, GX, GA, GS, GW, GB, PART, TICKET, N, C, XB, XST, XSB, per_prog,
                        w_offset, F64: tl.constexpr, WIDE: tl.constexpr, SUM_HERE: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_C: tl.constexpr, ERF: tl.constexpr):
        """dL/dx = alpha d with d = dy w f'(u) (DyT: 1 - tanh(u)^2; ERF, Derf: (2 / sqrt(pi)) exp(-u^2)).
        Each program's sums go to PART: dy f(u) (dL/dw) in its row of a (P, C) block, dy (dL/db) in a
        second, d x (dL/dalpha) in a (P,) one, and with ERF d (dL/ds) in another; in registers, or with
        WIDE in PART itself, added to block by block (as _rmsnorm_backward's). The last program adds the
        scalars' P sums, and the two blocks' (SUM_HERE) or leaves them to _sum_columns."""
        cols = tl.arange(0, BLOCK_C)
        P = tl.num_programs(0)
        pid = tl.program_id(0).to(tl.int64)
        pw, pb = PART + pid * C, PART + (P + pid) * C
        a = _f(tl.load(ALPHA), F64)
        gw = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
        gb = gw
        ga = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        gs = ga
        if WIDE:
            for c0 in range(0, C, BLOCK_C):
                tl.store(pw + c0 + cols, gw, mask=c0 + cols < C)
                tl.store(pb + c0 + cols, gw, mask=c0 + cols < C)
        start = tl.program_id(0) * per_prog
        for r0 in range(0, per_prog, BLOCK_N):
            for c0 in range(0, C, BLOCK_C):
                cc = c0 + cols
                _, _, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cc, cc < C, BLOCK_N, F64)
                gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
                w = _f(tl.load(W + cc, mask=cc < C, other=0.0), F64) + w_offset
                if ERF:
                    u = a * x + _f(tl.load(SHIFT), F64)
                    fu = tl.math.erf(u)
                    d = gy * w[None, :] * (1.1283791670955126 * tl.exp(-u * u))
                    gs += tl.sum(d, axis=1)
                else:
                    fu = _tanh(a * x)
                    d = gy * w[None, :] * (1 - fu * fu)
                tl.store(GX + at, (a * d).to(GX.dtype.element_ty), mask=m2)
                ga += tl.sum(d * x, axis=1)
                if WIDE:  # one program reads back what it wrote: a barrier orders it
                    tl.store(pw + cc, tl.load(pw + cc, mask=cc < C, other=0.0) + tl.sum(gy * fu, axis=0), mask=cc < C)
                    tl.store(pb + cc, tl.load(pb + cc, mask=cc < C, other=0.0) + tl.sum(gy, axis=0), mask=cc < C)
                    tl.debug_barrier()
                else:
                    gw += tl.sum(gy * fu, axis=0)
                    gb += tl.sum(gy, axis=0)
        if not WIDE:
            tl.store(pw + cols, gw, mask=cols < C)
            tl.store(pb + cols, gb, mask=cols < C)
        tl.store(PART + 2 * P * C + pid, tl.sum(ga, axis=0))
        if ERF:
            tl.store(PART + 2 * P * C + P + pid, tl.sum(gs, axis=0))
        if _last_to_arrive(TICKET):  # the programs' sums, in a fixed order
            if SUM_HERE:
                _sum_parts(PART, GW, C, cols, BLOCK_C)
                _sum_parts(PART + P * C, GB, C, cols, BLOCK_C)
            _sum_parts(PART + 2 * P * C, GA, 1, tl.arange(0, 1), 1)
            if ERF:
                _sum_parts(PART + 2 * P * C + P, GS, 1, tl.arange(0, 1), 1)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _dyt_forward(X, ALPHA, W, B, Y, TICKET, N, C, XB, XST, XSB, per_prog, w_offset, F64: tl.constexpr,
                     WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        _entry_forward(X, ALPHA, ALPHA, W, B, Y, TICKET, N, C, XB, XST, XSB, per_prog, w_offset, F64, WIDE, BLOCK_N,
                       BLOCK_C, False)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _dyt_backward(X, GY, ALPHA, W, GX, GA, GW, GB, PART, TICKET, N, C, XB, XST, XSB, per_prog, w_offset,
                      F64: tl.constexpr, WIDE: tl.constexpr, SUM_HERE: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_C: tl.constexpr):
        _entry_backward(X, GY, ALPHA, ALPHA, W, GX, GA, GA, GW, GB, PART, TICKET, N, C, XB, XST, XSB, per_prog,
                        w_offset, F64, WIDE, SUM_HERE, BLOCK_N, BLOCK_C, False)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _derf_forward(X, ALPHA, SHIFT, W, B, Y, TICKET, N, C, XB, XST, XSB, per_prog, w_offset, F64: tl.constexpr,
                      WIDE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        _entry_forward(X, ALPHA, SHIFT, W, B, Y, TICKET, N, C, XB, XST, XSB, per_prog, w_offset, F64, WIDE, BLOCK_N,
                       BLOCK_C, True)

    @triton.jit(do_not_specialize=["N", "per_prog"])
    def _derf_backward(X, GY, ALPHA, SHIFT, W, GX, GA, GS, GW, GB, PART, TICKET, N, C, XB, XST, XSB, per_prog,
                       w_offset, F64: tl.constexpr, WIDE: tl.constexpr, SUM_HERE: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        _entry_backward(X, GY, ALPHA, SHIFT, W, GX, GA, GS, GW, GB, PART, TICKET, N, C, XB, XST, XSB, per_prog,
                        w_offset, F64, WIDE, SUM_HERE, BLOCK_N, BLOCK_C, True)

    @triton.jit(do_not_specialize=["P"])
    def _sum_columns(PART, OUT, OUT2, P, C, TWO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        """OUT[c] = the sum over p < P of PART[p, c] (a (P, C) block of per-program sums), and with TWO
        OUT2[c] of the (P, C) block after it: each program adds a block of columns, BLOCK_R rows at a time,
        in float64 and in a fixed order (the same result every run), so that no program reads more than
        another; a row kernel's backward leaves its parameters' sums to this launch."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        cm = cols < C
        rows = tl.arange(0, BLOCK_R)
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        acc2 = acc
        for p0 in range(0, P, BLOCK_R):
            at = (p0 + rows)[:, None].to(tl.int64) * C + cols[None, :]
            m = ((p0 + rows) < P)[:, None] & cm[None, :]
            acc += tl.sum(tl.load(PART + at, mask=m, other=0.0).to(tl.float64), axis=0)
            if TWO:
                acc2 += tl.sum(tl.load(PART + P * C + at, mask=m, other=0.0).to(tl.float64), axis=0)
        tl.store(OUT + cols, _cast(acc, OUT), mask=cm)
        if TWO:
            tl.store(OUT2 + cols, _cast(acc2, OUT2), mask=cm)

    #: the kernels the passes launch (gpu.py binds them by name); the backwards whose last program adds
    #: scalar parameters' sums (measure/sm90.py's model of the bytes each program moves)
    KERNELS = (_scalenorm_forward, _scalenorm_backward, _rmsnorm_forward, _rmsnorm_backward, _dyt_forward,
               _dyt_backward, _derf_forward, _derf_backward, _sum_columns)
    SCALAR_SUMS = ("_scalenorm_backward", "_dyt_backward", "_derf_backward")
