"""The Triton helpers every kernel shares (``gpu_channel.py``'s and ``gpu_rows.py``'s): a row tile's
load, the accumulation dtype, a cast to a pointer's element type, the inverse root mean square, and
the arrival ticket of a finishing program."""

try:
    import triton
    import triton.language as tl
except ImportError:  # the plain path or the CPU kernels serve instead
    triton = None

if triton is not None:
    @triton.jit
    def _f(v, F64: tl.constexpr):
        """``v`` in the accumulation dtype."""
        if F64:
            return v.to(tl.float64)
        else:
            return v.to(tl.float32)

    @triton.jit
    def _row_tile(X, XB, XST, XSB, first, N, C, cols, cmask, BLOCK_N: tl.constexpr, F64: tl.constexpr):
        """Rows first .. first + BLOCK_N of ``X`` at columns ``cols``: (rows,
        their mask, the tile's mask, its offsets in a contiguous (N, C) tensor,
        the tile in the accumulation dtype, 0 outside). Row r = t * XB + b of X
        starts at t * XST + b * XSB (_rows: a (T, B, C) view read where it lies)."""
        rows = first + tl.arange(0, BLOCK_N)
        rmask = rows < N
        m2 = rmask[:, None] & cmask[None, :]
        at = rows[:, None].to(tl.int64) * C + cols[None, :]
        xrow = (rows // XB).to(tl.int64) * XST + (rows % XB).to(tl.int64) * XSB
        return rows, rmask, m2, at, _f(tl.load(X + xrow[:, None] + cols[None, :], mask=m2, other=0.0), F64)

    @triton.jit
    def _cast(v, PTR):
        """float64 ``v`` in the dtype of what ``PTR`` points to (half by way of float32)."""
        if PTR.dtype.element_ty == tl.float64:
            return v
        else:
            return v.to(tl.float32).to(PTR.dtype.element_ty)

    @triton.jit
    def _last_to_arrive(TICKET):
        """Whether this program is the grid's last to get here, counted in the
        launch's own ticket (a float the pass before set to 0; counts stay
        exact); the last one sets it back to 0, for a second backward of the
        same graph. Everything a program stored before is visible to the last
        one (acquire-release)."""
        total = tl.num_programs(0) * tl.num_programs(1)
        arrived = tl.atomic_add(TICKET, 1.0, sem="acq_rel")
        last = arrived == total - 1
        if last:
            tl.store(TICKET, 0.0)
        return last

    @triton.jit
    def _inv_rms(sum_sq, n, eps):
        """1 / sqrt(mean(x^2) + eps) from a sum of n squares: a row's and the group scaling's factor."""
        return 1.0 / tl.sqrt(sum_sq / n + eps)
