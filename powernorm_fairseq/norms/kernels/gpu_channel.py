"""The Triton kernels of the channel-statistics norms (BN, PN-V, PN); the
helpers every kernel shares are in ``gpu_helpers.py``, their plans in ``plans.py``, their passes
in ``csrc/gpu_passes.h``.

Rows are tokens (N = T * B), columns channels (C). Each program of a channel
kernel walks its rows once: it reads x (and dy), writes y (or dx), and keeps
per-channel sums of its rows, which it writes as one row of partial sums
(over at most ``MAX_ROWS`` rows, in float32 for float32 and half inputs). A
small finishing kernel, on a grid over the channels, adds the partial sums
in float64 in a fixed order and does the per-channel rest (statistics,
running buffers, nu, parameter gradients); its last program to arrive
commits the running buffers for every channel or for none. Arrivals are
counted in a ticket of the launch's own: the first element of the partial
sums' last row, which one extra program of the pass before, past the last
row, writes as 0 with the rest of its (empty) sums. Two launches in flight,
or one aborted, share nothing. Nothing is read back to the host. Half
inputs are read as they are and computed in float32; float64 inputs in
float64 (the tests compare them with float64 references). The kernels read
fairseq's (B, T) padding mask.
"""

from .contract import Mode, Update
from .gpu_helpers import triton

if triton is not None:
    import triton.language as tl

    from .gpu_helpers import _cast, _f, _inv_rms, _last_to_arrive, _row_tile

# Integer arguments that change with every batch (row counts, per-program
# rows) are not specialised on (value 1, multiple of 16): each new value would
# otherwise compile another variant during training. Channel counts are.
if triton is not None:
    # the contract's enumerations as the kernels' compile-time constants
    BN, PN_V, PN_WARM, PN = (tl.constexpr(int(u)) for u in (Update.BN, Update.PN_V, Update.PN_WARM, Update.PN))
    REFERENCE_RUN, EXACT, REFERENCE = (tl.constexpr(int(Update.REFERENCE)), tl.constexpr(int(Mode.EXACT)),
                                       tl.constexpr(int(Mode.REFERENCE)))


    @triton.jit
    def _keep(MASK, rows, rmask, nb, nt, HAS_MASK: tl.constexpr, F64: tl.constexpr):
        """1 at the real rows, 0 at padding and past the end: row r = t * B + b
        is token t of sentence b, padding where the (B, T) mask says so."""
        keep = _f(rmask.to(tl.float32), F64)
        if HAS_MASK:
            pad = tl.load(MASK + (rows % nb).to(tl.int64) * nt + rows // nb, mask=rmask, other=1)
            keep = tl.where(pad != 0, 0.0, keep)
        return keep

    @triton.jit
    def _part_rows(PART, p0, P, stride, cols, cm, BLOCK_R: tl.constexpr):
        """(pointers, mask) of rows p0 .. p0 + BLOCK_R of a part's programs (``stride`` apart), at ``cols``."""
        rows = p0 + tl.arange(0, BLOCK_R)
        return (PART + rows[:, None].to(tl.int64) * stride + cols[None, :],
                (rows < P)[:, None] & cm[None, :])

    @triton.jit
    def _column_block(C, BLOCK: tl.constexpr):
        """A finishing program's block of columns, their mask, and float64 zeros of its size."""
        cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        return cols, cols < C, tl.zeros([BLOCK], dtype=tl.float64)

    @triton.jit
    def _part_sum(base, m, k, C):
        """The programs' rows of a part's k-th block of C columns, added in float64."""
        return tl.sum(tl.load(base + k * C, mask=m, other=0.0).to(tl.float64), axis=0)

    @triton.jit
    def _all_set(FLAGS, n):
        ok = tl.load(FLAGS) != 0
        for i in range(1, n):
            ok = ok & (tl.load(FLAGS + i) != 0)
        return ok

    # A channel kernel's program holds one chunk of columns of a row tile; a
    # group wider than a block (WIDE, gpu.WIDEST_GROUP) is walked in blocks:
    # a first pass writes each row's group scale (forward) or the dot product
    # its backward needs (backward) to a per-row buffer, the main pass reads it.

    @triton.jit
    def _at_group(P, rows, chunk):
        """Where rows' values for group ``chunk`` lie in a per-row, per-group (N, groups) buffer."""
        return P + rows.to(tl.int64) * tl.num_programs(1) + chunk

    @triton.jit
    def _row_block(first, N, F64: tl.constexpr, BLOCK_N: tl.constexpr):
        """Rows first .. first + BLOCK_N, their mask, and zeros of their size in the accumulation dtype."""
        rows = first + tl.arange(0, BLOCK_N)
        return rows, rows < N, _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)

    @triton.jit
    def _group_scales(X, XB, XST, XSB, SCALE, start, per_prog, N, C, chunk, gs_eps, width,
                      F64: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr):
        """SCALE[row, chunk] = 1 / sqrt(mean(x^2) + eps) over the chunk's ``width`` columns, block by block."""
        offs = tl.arange(0, BLOCK_C)
        for r0 in range(0, per_prog, BLOCK_N):
            rows, rmask, ss = _row_block(start + r0, N, F64, BLOCK_N)
            for s0 in range(0, width, BLOCK_C):
                cols, cmask = _chunk_cols(chunk, width, s0, offs, C)
                x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cmask, BLOCK_N, F64)[4]
                ss += tl.sum(x * x, axis=1)
            tl.store(_at_group(SCALE, rows, chunk), _inv_rms(ss, width, gs_eps), mask=rmask)

    @triton.jit
    def _chunk_cols(chunk, width, s0, offs, C):
        """Block s0 of the chunk's columns and their mask (inside the chunk and the tensor)."""
        cols = chunk * width + s0 + offs
        return cols, (s0 + offs < width) & (cols < C)

    @triton.jit
    def _group_scale(SCALE, rows, rmask, x, chunk, gs_eps, F64: tl.constexpr, WIDE: tl.constexpr,
                     CW: tl.constexpr):
        """The rows' group scales: from the tile x (the whole group), or as the first pass wrote them (WIDE)."""
        if WIDE:
            return _f(tl.load(_at_group(SCALE, rows, chunk), mask=rmask, other=0.0), F64)
        else:
            return _inv_rms(tl.sum(x * x, axis=1), CW, gs_eps)

    @triton.jit(do_not_specialize=["N", "nb", "nt", "per_prog"])
    def _channel_forward(X, MASK, MEAN, INV, W, Bias, Y, SCALE, PART,
                         N, C, XB, XST, XSB, nb, nt, per_prog, cw, gs_eps, inv_eps, w_offset,
                         HAS_MASK: tl.constexpr, HAS_MEAN: tl.constexpr, INV_RUNNING: tl.constexpr,
                         GROUPED: tl.constexpr, WANT_Y: tl.constexpr, WANT_STATS: tl.constexpr,
                         CENTER: tl.constexpr, F64: tl.constexpr, WIDE: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, CW: tl.constexpr):
        pid_n, chunk = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK_C)
        start = pid_n * per_prog
        width = cw if WIDE else CW  # the chunk's width: run-time for a wide group, else the constexpr (_layout)
        if WIDE:
            _group_scales(X, XB, XST, XSB, SCALE, start, per_prog, N, C, chunk, gs_eps, width, F64, BLOCK_N, BLOCK_C)
        for s0 in range(0, width, BLOCK_C):  # one block unless WIDE
            cols, cmask = _chunk_cols(chunk, width, s0, offs, C)
            zero = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
            mul = zero
            add = zero
            sub = zero
            if WANT_Y:  # y = (xs - mean) * mul + add: centred first, which no FMA contraction can cancel
                if INV_RUNNING:  # a running second moment (PN after warmup, Algorithm 2's psi_{t-1}),
                    # its scale in float64 and rounded as finish_stats returns it
                    run = tl.load(INV + cols, mask=cmask, other=1.0).to(tl.float64)
                    inv = _f((1.0 / tl.sqrt(run + inv_eps)).to(INV.dtype.element_ty), F64)
                else:
                    inv = _f(tl.load(INV + cols, mask=cmask, other=0.0), F64)
                mul = inv * (_f(tl.load(W + cols, mask=cmask, other=0.0), F64) + w_offset)  # the gain as read
                add = _f(tl.load(Bias + cols, mask=cmask, other=0.0), F64)
                if HAS_MEAN:
                    sub = _f(tl.load(MEAN + cols, mask=cmask, other=0.0), F64)
            count = tl.sum(zero, axis=0)
            s1 = zero
            s2 = zero
            shift = zero
            if WANT_STATS and CENTER:  # shifted data: the masked mean of the program's first tile
                rows, rmask, m2, at, x = _row_tile(X, XB, XST, XSB, start, N, C, cols, cmask, BLOCK_N, F64)
                if GROUPED:
                    x = x * _group_scale(SCALE, rows, rmask, x, chunk, gs_eps, F64, WIDE, CW)[:, None]
                keep = _keep(MASK, rows, rmask, nb, nt, HAS_MASK, F64)
                shift = tl.sum(x * keep[:, None], axis=0) / tl.maximum(tl.sum(keep, axis=0), 1.0)
            for r0 in range(0, per_prog, BLOCK_N):
                rows, rmask, m2, at, x = _row_tile(X, XB, XST, XSB, start + r0, N, C, cols, cmask, BLOCK_N, F64)
                if GROUPED:  # the original code's layer scale: this chunk is one group
                    r = _group_scale(SCALE, rows, rmask, x, chunk, gs_eps, F64, WIDE, CW)
                    if WANT_Y and not WIDE:
                        tl.store(_at_group(SCALE, rows, chunk), r, mask=rmask)
                    x = x * r[:, None]
                if WANT_STATS:
                    keep = _keep(MASK, rows, rmask, nb, nt, HAS_MASK, F64)
                    d = tl.where(m2, x - shift[None, :], 0.0)
                    dk = d * keep[:, None]
                    count += tl.sum(keep, axis=0)
                    s1 += tl.sum(dk, axis=0)
                    s2 += tl.sum(dk * d, axis=0)
                if WANT_Y:
                    y = (x - sub[None, :]) * mul[None, :] + add[None, :]
                    tl.store(Y + at, y.to(Y.dtype.element_ty), mask=m2)
            if WANT_STATS:
                base = PART + pid_n.to(tl.int64) * 3 * C
                tl.store(base + cols, zero + count, mask=cmask)
                if CENTER:  # this program's mean and sum of squared deviations from it
                    s1n = s1 / tl.maximum(count, 1.0)
                    tl.store(base + C + cols, shift + s1n, mask=cmask)
                    tl.store(base + 2 * C + cols, s2 - s1 * s1n, mask=cmask)
                else:
                    tl.store(base + C + cols, zero, mask=cmask)
                    tl.store(base + 2 * C + cols, s2, mask=cmask)

    @triton.jit(do_not_specialize=["P", "warmup"])
    def _finish_stats(PART, RA, RB, STEPS, MEAN, INV, INVB, NOUT, SCRATCH, FLAGS, TICKET,
                      P, C, momentum, eps, warmup,
                      UPDATE: tl.constexpr, HAS_STEPS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
        """UPDATE: an Update (contract.py). The programs' rows of the part are
        added BLOCK_R at a time, in a fixed order: the same result every run."""
        cols, cm, z = _column_block(C, BLOCK)
        n = z
        s1 = z
        s2 = z
        for p0 in range(0, P, BLOCK_R):
            base, m = _part_rows(PART, p0, P, 3 * C, cols, cm, BLOCK_R)
            cnt = tl.load(base, mask=m, other=0.0).to(tl.float64)
            n += tl.sum(cnt, axis=0)
            s1 += tl.sum(cnt * tl.load(base + C, mask=m, other=0.0).to(tl.float64), axis=0)
            s2 += _part_sum(base, m, 2, C)
        ns = tl.maximum(n, 1.0)
        mean = s1 / ns
        if UPDATE == BN:  # Chan et al.'s pairwise formula: each program's M2 plus its mean's spread
            m2 = z
            for p0 in range(0, P, BLOCK_R):
                base, m = _part_rows(PART, p0, P, 3 * C, cols, cm, BLOCK_R)
                cnt = tl.load(base, mask=m, other=0.0).to(tl.float64)
                dm = tl.load(base + C, mask=m, other=0.0).to(tl.float64) - mean[None, :]
                m2 += tl.sum(tl.load(base + 2 * C, mask=m, other=0.0).to(tl.float64) + cnt * dm * dm, axis=0)
            second = tl.maximum(m2 / ns, 0.0)
        else:
            second = s2 / ns
        real = n > 0.0
        old_b = tl.load(RB + cols, mask=cm, other=1.0).to(tl.float64)
        inv_batch = 1.0 / tl.sqrt(second + eps)
        inv_run = 1.0 / tl.sqrt(old_b + eps)
        k = z + 1.0
        if HAS_STEPS:
            k = z + (tl.load(STEPS).to(tl.float64) + 1.0)
        if UPDATE == BN:
            old_a = tl.load(RA + cols, mask=cm, other=0.0).to(tl.float64)
            tl.store(MEAN + cols, tl.where(real, mean, old_a).to(MEAN.dtype.element_ty), mask=cm)
            tl.store(SCRATCH + cols, (old_a + momentum * (mean - old_a)).to(SCRATCH.dtype.element_ty), mask=cm)
            unbiased = second * n / tl.maximum(n - 1.0, 1.0)
            new_b = tl.where(n > 1.0, old_b + momentum * (unbiased - old_b), old_b)
        elif UPDATE == PN_V:
            new_b = old_b + momentum * (second - old_b)
        elif UPDATE == PN_WARM:  # cumulative mean
            new_b = old_b * ((k - 1.0) / k) + second / k
        elif UPDATE == PN:  # Algorithm 2: psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) psi_B^2
            new_b = old_b + momentum * (second - old_b)
        else:
            new_b = tl.where(k < warmup, old_b * ((k - 1.0) / k) + second / k, old_b)
            new_b = new_b + momentum * (second - new_b)
        if UPDATE == PN or UPDATE == REFERENCE_RUN:  # the forward normalised with the running psi^2_{t-1}
            inv = inv_run
        else:
            inv = tl.where(real, inv_batch, inv_run)
        tl.store(INV + cols, inv.to(INV.dtype.element_ty), mask=cm)
        # the batch's own scale (the released backward's), the running one for a batch of padding
        tl.store(INVB + cols, tl.where(real, inv_batch, inv_run).to(INVB.dtype.element_ty), mask=cm)
        tl.store(SCRATCH + C + cols, new_b.to(SCRATCH.dtype.element_ty), mask=cm)
        finite = (second == second) & (second < float("inf"))
        if UPDATE == BN:
            finite = finite & (mean == mean) & (tl.abs(mean) < float("inf"))
        ok = tl.sum(tl.where(cm & ~finite, 1, 0), axis=0) == 0
        tl.store(FLAGS + tl.program_id(0), ok.to(tl.int32))
        n0 = tl.sum(tl.where(cols == tl.program_id(0) * BLOCK, n, 0.0), axis=0)
        if _last_to_arrive(TICKET):
            # every program's candidates in, or none: a non-finite statistic
            # (overflowed half activations) or a batch of padding leaves them all
            if _all_set(FLAGS, tl.num_programs(0)) & (n0 > 0.0):
                for c0 in range(0, C, BLOCK):
                    cc = c0 + tl.arange(0, BLOCK)
                    if UPDATE == BN:
                        tl.store(RA + cc, tl.load(SCRATCH + cc, mask=cc < C), mask=cc < C)
                    tl.store(RB + cc, tl.load(SCRATCH + C + cc, mask=cc < C), mask=cc < C)
            if HAS_STEPS:
                tl.store(STEPS, tl.load(STEPS) + (n0 > 0.0).to(tl.int64))
            tl.store(NOUT, n0)

    @triton.jit
    def _backward_vectors(INVF, MEAN, W, INVB, A, Bc, cols, cmask, b_scale, w_offset, HAS_MEAN: tl.constexpr,
                          HAS_A: tl.constexpr, HAS_B: tl.constexpr, WANT_GX: tl.constexpr, F64: tl.constexpr,
                          BLOCK_C: tl.constexpr):
        """The per-channel factors of the backward at ``cols``: (inv_fwd, mean, w, inv_bwd, A, b_scale B)."""
        zero = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
        invf = _f(tl.load(INVF + cols, mask=cmask, other=0.0), F64)
        shift = zero  # xh = (xs - shift) * invf: centred first, which no FMA contraction can cancel
        if HAS_MEAN:
            shift = _f(tl.load(MEAN + cols, mask=cmask, other=0.0), F64)
        w = _f(tl.load(W + cols, mask=cmask, other=0.0), F64) + w_offset
        invb = zero
        a = zero
        b = zero
        if WANT_GX:
            invb = _f(tl.load(INVB + cols, mask=cmask, other=0.0), F64)
            if HAS_A:
                a = _f(tl.load(A + cols, mask=cmask, other=0.0), F64)
            if HAS_B:
                b = _f(tl.load(Bc + cols, mask=cmask, other=0.0), F64) * b_scale
        return invf, shift, w, invb, a, b

    @triton.jit
    def _backward_tile(X, XB, XST, XSB, SCALE, GY, MASK, first, N, C, nb, nt, cols, cmask, chunk, invf, shift,
                       HAS_MASK: tl.constexpr, GROUPED: tl.constexpr, F64: tl.constexpr, BLOCK_N: tl.constexpr):
        """A row tile for the backward: (rows, rmask, m2, at, xs, xh, dy, keep, group scale r)."""
        rows, rmask, m2, at, xs = _row_tile(X, XB, XST, XSB, first, N, C, cols, cmask, BLOCK_N, F64)
        r = _f(tl.zeros([BLOCK_N], dtype=tl.float32), F64)
        if GROUPED:
            r = _f(tl.load(_at_group(SCALE, rows, chunk), mask=rmask, other=0.0), F64)
            xs = xs * r[:, None]
        xh = tl.where(m2, (xs - shift[None, :]) * invf[None, :], 0.0)
        gy = _f(tl.load(GY + at, mask=m2, other=0.0), F64)
        keep = _keep(MASK, rows, rmask, nb, nt, HAS_MASK, F64)
        return rows, rmask, m2, at, xs, xh, gy, keep, r

    @triton.jit
    def _gxs(gy, w, keep, rmask, a, b, xh, invb, CORRECT_PADS: tl.constexpr, F64: tl.constexpr):
        """dL/dxs, the gradient before the group scaling (Eq. 3 / Eq. 6 with PN's A and B)."""
        m = keep
        if CORRECT_PADS:
            m = _f(rmask.to(tl.float32), F64)
        return (gy * w[None, :] - m[:, None] * (a[None, :] + b[None, :] * xh)) * invb[None, :]

    @triton.jit(do_not_specialize=["N", "nb", "nt", "per_prog"])
    def _channel_backward(X, MASK, SCALE, GY, W, MEAN, INVF, INVB, A, Bc, GX, PART, DOTS,
                          N, C, XB, XST, XSB, nb, nt, per_prog, cw, b_scale, w_offset,
                          HAS_MASK: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_A: tl.constexpr,
                          HAS_B: tl.constexpr, GROUPED: tl.constexpr, CORRECT_PADS: tl.constexpr,
                          WANT_GX: tl.constexpr, WANT_SUMS: tl.constexpr, F64: tl.constexpr, WIDE: tl.constexpr,
                          BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, CW: tl.constexpr):
        pid_n, chunk = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, BLOCK_C)
        start = pid_n * per_prog
        width = cw if WIDE else CW  # the chunk's width: run-time for a wide group, else the constexpr (_layout)
        if WIDE and WANT_GX:  # first pass: each row's mean(dxs * xs) over its group, block by block
            for r0 in range(0, per_prog, BLOCK_N):
                rows, rmask, dot = _row_block(start + r0, N, F64, BLOCK_N)
                for s0 in range(0, width, BLOCK_C):
                    cols, cmask = _chunk_cols(chunk, width, s0, offs, C)
                    invf, shift, w, invb, a, b = _backward_vectors(INVF, MEAN, W, INVB, A, Bc, cols, cmask, b_scale,
                                                                   w_offset, HAS_MEAN, HAS_A, HAS_B, WANT_GX, F64,
                                                                   BLOCK_C)
                    _, _, m2, at, xs, xh, gy, keep, r = _backward_tile(
                        X, XB, XST, XSB, SCALE, GY, MASK, start + r0, N, C, nb, nt, cols, cmask, chunk, invf, shift,
                        HAS_MASK, GROUPED, F64, BLOCK_N)
                    dot += tl.sum(_gxs(gy, w, keep, rmask, a, b, xh, invb, CORRECT_PADS, F64) * xs, axis=1)
                tl.store(_at_group(DOTS, rows, chunk), dot / width, mask=rmask)
        for s0 in range(0, width, BLOCK_C):  # one block unless WIDE
            cols, cmask = _chunk_cols(chunk, width, s0, offs, C)
            invf, shift, w, invb, a, b = _backward_vectors(INVF, MEAN, W, INVB, A, Bc, cols, cmask, b_scale, w_offset,
                                                           HAS_MEAN, HAS_A, HAS_B, WANT_GX, F64, BLOCK_C)
            zero = _f(tl.zeros([BLOCK_C], dtype=tl.float32), F64)
            s0_ = zero  # dy * xh, every row
            s1 = zero  # dy, every row
            s2 = zero  # dy * xh, real rows
            s3 = zero  # xh^2, real rows
            s4 = zero  # xh^2, every row
            for r0 in range(0, per_prog, BLOCK_N):
                rows, rmask, m2, at, xs, xh, gy, keep, r = _backward_tile(
                    X, XB, XST, XSB, SCALE, GY, MASK, start + r0, N, C, nb, nt, cols, cmask, chunk, invf, shift,
                    HAS_MASK, GROUPED, F64, BLOCK_N)
                if WANT_SUMS:
                    gxh = gy * xh
                    xh2 = xh * xh
                    s0_ += tl.sum(gxh, axis=0)
                    s1 += tl.sum(gy, axis=0)
                    s2 += tl.sum(gxh * keep[:, None], axis=0)
                    s3 += tl.sum(xh2 * keep[:, None], axis=0)
                    s4 += tl.sum(xh2, axis=0)
                if WANT_GX:
                    gxs = _gxs(gy, w, keep, rmask, a, b, xh, invb, CORRECT_PADS, F64)
                    if GROUPED:  # back through the group's scale: r (d - xs mean(d xs))
                        if WIDE:
                            dot = _f(tl.load(_at_group(DOTS, rows, chunk), mask=rmask, other=0.0), F64)
                        else:
                            dot = tl.sum(gxs * xs, axis=1) / CW
                        gxs = r[:, None] * (gxs - xs * dot[:, None])
                    tl.store(GX + at, gxs.to(GX.dtype.element_ty), mask=m2)
            if WANT_SUMS:
                base = PART + pid_n.to(tl.int64) * 5 * C
                tl.store(base + cols, s0_, mask=cmask)
                tl.store(base + C + cols, s1, mask=cmask)
                tl.store(base + 2 * C + cols, s2, mask=cmask)
                tl.store(base + 3 * C + cols, s3, mask=cmask)
                tl.store(base + 4 * C + cols, s4, mask=cmask)

    @triton.jit(do_not_specialize=["P", "rows"])
    def _finish_backward(PART, W, NIN, NU, GW, GB, A, Bc, SCRATCH, FLAGS, TICKET, P, C, rate, rows, w_offset,
                         MODE: tl.constexpr, CENTER: tl.constexpr, HAS_NU: tl.constexpr, BLOCK_R: tl.constexpr,
                         BLOCK: tl.constexpr):
        """MODE: a Mode (contract.py): EXACT, the exact gradient's A and B (Eq. 3
        / Eq. 6); REFERENCE, the released code's nu update; else Algorithm 2's.
        The part's rows are added as _finish_stats adds them."""
        cols, cm, z = _column_block(C, BLOCK)
        s0 = z
        s1 = z
        s2 = z
        s3 = z
        s4 = z
        for p0 in range(0, P, BLOCK_R):
            base, m = _part_rows(PART, p0, P, 5 * C, cols, cm, BLOCK_R)
            s0 += _part_sum(base, m, 0, C)
            s1 += _part_sum(base, m, 1, C)
            s2 += _part_sum(base, m, 2, C)
            s3 += _part_sum(base, m, 3, C)
            s4 += _part_sum(base, m, 4, C)
        w = tl.load(W + cols, mask=cm, other=0.0).to(tl.float64) + w_offset  # the gain as read
        tl.store(GW + cols, _cast(s0, GW), mask=cm)
        tl.store(GB + cols, _cast(s1, GB), mask=cm)
        n = tl.load(NIN).to(tl.float64)
        ns = tl.maximum(n, 1.0)
        if MODE == EXACT:  # means over the real tokens of sums over every position
            tl.store(Bc + cols, (w * s0 / ns).to(Bc.dtype.element_ty), mask=cm)
            if CENTER:
                tl.store(A + cols, (w * s1 / ns).to(A.dtype.element_ty), mask=cm)
        if HAS_NU:
            nu = tl.load(NU + cols, mask=cm, other=0.0).to(tl.float64)
            if MODE == REFERENCE:  # the released update: mean over every position of g' * xh, g' = g - (1 - a) nu xh
                new = tl.where(n > 0.0, nu + (w * s0 - rate * nu * s4) / rows, nu)
                tl.store(NU + cols, new.to(NU.dtype.element_ty), mask=cm)
            else:  # Algorithm 2: Lambda_t = mean(g xh), Gamma_t = mean(xh^2) over the real tokens
                lam = w * s2 / ns
                gam = s3 / ns
                new = nu * (1.0 - rate * gam) + rate * lam
                tl.store(SCRATCH + cols, new.to(SCRATCH.dtype.element_ty), mask=cm)
                finite = (lam == lam) & (tl.abs(lam) < float("inf")) & (gam == gam) & (gam < float("inf"))
                ok = tl.sum(tl.where(cm & ~finite, 1, 0), axis=0) == 0
                tl.store(FLAGS + tl.program_id(0), ok.to(tl.int32))
                if _last_to_arrive(TICKET):
                    # a gradient that overflowed (a float16 loss-scale overflow, whose
                    # step the optimizer skips) or a batch of padding leaves nu alone
                    if _all_set(FLAGS, tl.num_programs(0)) & (n > 0.0):
                        for c0 in range(0, C, BLOCK):
                            cc = c0 + tl.arange(0, BLOCK)
                            tl.store(NU + cc, tl.load(SCRATCH + cc, mask=cc < C), mask=cc < C)

    #: the kernels the passes launch (gpu.py binds them by name)
    KERNELS = (_channel_forward, _finish_stats, _channel_backward, _finish_backward)
