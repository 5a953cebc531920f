"""Router top-k, routing metadata and the weighted combine, all deterministic (no atomics).

* ``_router_topk_kernel``: per token, the K largest entries of a choice key, or of the key plus an
  expert bias added in fp32 as torch adds it (ties to the lower index, NaN above everything, as
  torch's stable descending sort orders them) and the scores at those experts, renormalized over the
  K if asked.
* ``_route_histogram_kernel``: per block of routed entries, how many go to each expert.
* ``_route_scan_kernel``: per-expert ``counts`` and each block's first row among its expert's rows (an
  exclusive scan down the blocks, one program per few experts).
* ``_route_scatter_kernel``: ``offs``, and each entry's row in the expert-sorted order, i.e. the
  position a stable argsort of the flattened expert ids would give it, and the token of every sorted
  row.
* ``_combine_kernel``: out[t] = sum_k w[t, k] * y[row_of[t, k]] in fp32 (gather-reduce).
* ``_combine_bwd_kernel``: dy[row_of[t, k]] = w[t, k] * dout[t], and dw[t, k] = <dout[t], y[row_of[t, k]]>;
  without w (a plain sum) it copies dout[t] to the K rows and reads no y.
* ``_topk_weights_grad_kernel``: the router scores' gradient (T, E) from the chosen weights' (T, K),
  through the renormalization if any: zero but at each token's K experts.
* ``_scatter_weights_kernel``: out[row_of[i]] = w[i] in fp32 (the routing weights in sorted-row order).
* ``_gather_weights_kernel``: out[i] = g[row_of[i]], zero where row_of[i] < 0 (its backward).
* ``_gather_rows_ones_kernel``: out[r] = x[token_idx[r]] followed by a column of ones (the
  permute-free backward's copy of x for dW_up, whose ones column makes that GEMM yield db_up too;
  a plain gather is the plain combine's backward kernel).
"""

import triton
import triton.language as tl


@triton.jit
def _one_hot(ids, BLOCK_E: tl.constexpr):
    return (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)


INT32_MIN = tl.constexpr(-(2**31))


@triton.jit
def _router_topk_kernel(
    key, bias, scores, weights, experts, T, E, stride_key, stride_scores,  # key, scores (T, E), bias (E,) fp32
    K: tl.constexpr, RENORM: tl.constexpr, BIAS: tl.constexpr,  # weights (T, K) fp32, experts (T, K) int32
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    ok = row_ok[:, None] & (cols[None, :] < E)
    v = tl.load(key + rows[:, None].to(tl.int64) * stride_key + cols[None, :], mask=ok, other=0.0)
    if BIAS:  # (one fp32 add, rounded as torch's `scores + bias`)
        v = v + tl.load(bias + cols, mask=cols < E, other=0.0)[None, :]
    # the choice runs on an order-preserving int32 key: -0 counts as +0, every NaN above +inf, and the
    # padding columns (and each chosen column) below every float
    bits = tl.where(v == 0.0, 0.0, v).to(tl.int32, bitcast=True)
    order = tl.where(v == v, bits ^ ((bits >> 31) & 0x7FFFFFFF), 0x7FFFFFFF)
    order = tl.where(ok, order, INT32_MIN)
    kcols = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for k in tl.static_range(K):
        best = tl.max(order, 1)
        idx = tl.min(tl.where(order == best[:, None], cols[None, :], BLOCK_E), 1)
        ids = tl.where(kcols[None, :] == k, idx[:, None], ids)
        order = tl.where(cols[None, :] == idx[:, None], INT32_MIN, order)
    mask = row_ok[:, None] & (kcols[None, :] < K)
    w = tl.load(scores + rows[:, None].to(tl.int64) * stride_scores + ids, mask=mask, other=0.0)
    if RENORM:  # (a NaN sum stays NaN, as in torch's clamp_min; tl.maximum would drop it)
        total = tl.sum(w, 1)
        w = w / tl.where(total < 1e-20, 1e-20, total)[:, None]
    out = rows[:, None] * K + kcols[None, :]
    tl.store(weights + out, w, mask=mask)
    tl.store(experts + out, ids, mask=mask)


@triton.jit
def _topk_weights_grad_kernel(
    dw, scores, experts, ds, T, E, stride_scores,  # dw (T, K) fp32, experts (T, K) int; scores, ds (T, E) fp32
    K: tl.constexpr, RENORM: tl.constexpr, SCORES: tl.constexpr,  # SCORES: 0 the scores' grad, 1 / 2 the logits'
    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,  # through a softmax / sigmoid
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    kcols = tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (kcols[None, :] < K)
    at = rows[:, None] * K + kcols[None, :]
    g = tl.load(dw + at, mask=mask, other=0.0)
    ids = tl.load(experts + at, mask=mask, other=-1).to(tl.int32)
    if RENORM:  # w = p / max(sum p, 1e-20); below the clamp the divisor is a constant
        p = tl.load(scores + rows[:, None].to(tl.int64) * stride_scores + ids, mask=mask, other=0.0)
        total = tl.sum(p, 1)
        div = tl.where(total < 1e-20, 1e-20, total)[:, None]
        kept = (total >= 1e-20).to(tl.float32)[:, None]
        g = (g - kept * tl.sum((p / div) * g, 1)[:, None]) / div
    cols = tl.arange(0, BLOCK_E)
    hit = ids[:, :, None] == cols[None, None, :]  # (BLOCK_T, BLOCK_K, BLOCK_E); padding ids are -1
    out = tl.sum(tl.where(hit, g[:, :, None], 0.0), 1)
    inside = row_ok[:, None] & (cols[None, :] < E)
    if SCORES != 0:  # torch's softmax / sigmoid backward on the scores' gradient (zero off the chosen columns)
        s = tl.load(scores + rows[:, None].to(tl.int64) * stride_scores + cols[None, :], mask=inside, other=0.0)
        if SCORES == 1:
            out = s * (out - tl.sum(out * s, 1)[:, None])
        else:
            out = out * (1.0 - s) * s
    tl.store(ds + rows[:, None].to(tl.int64) * E + cols[None, :], out, mask=inside)


@triton.jit
def _scatter_weights_kernel(w, row_of, out, R, BLOCK: tl.constexpr):  # w, row_of (R,) = (T*K,); out (R,) fp32
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < R
    rows = tl.load(row_of + idx, mask=ok, other=0)
    v = tl.load(w + idx, mask=ok, other=0.0).to(tl.float32)
    tl.store(out + rows, v, mask=ok & (rows >= 0))


@triton.jit
def _gather_weights_kernel(g, row_of, out, N, BLOCK: tl.constexpr):  # g (R,) fp32; row_of, out (N,) = (T*K,)
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < N
    rows = tl.load(row_of + idx, mask=ok, other=-1)
    v = tl.load(g + rows, mask=ok & (rows >= 0), other=0.0)
    tl.store(out + idx, v, mask=ok)


@triton.jit
def _route_histogram_kernel(
    experts, block_counts, R, E,  # experts (R,) int32 flattened (T, K) ids; block_counts (num_blocks, E)
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):
    b = tl.program_id(0)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(experts + idx, mask=idx < R, other=-1)
    counts = tl.sum(_one_hot(ids, BLOCK_E), 0)
    cols = tl.arange(0, BLOCK_E)
    tl.store(block_counts + b * E + cols, counts, mask=cols < E)


@triton.jit
def _route_scan_kernel(
    block_counts, counts, block_base, NB, E,  # block_counts, block_base (NB, E); counts (E,)
    BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr,
):
    # One program per BLOCK_C experts (the experts' columns scan independently): each block's first
    # row among its expert's rows, an exclusive scan down the blocks, and the expert's row count.
    # The experts' own first rows (a scan across the columns) are added by the scatter kernel.
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < E
    run = tl.zeros((BLOCK_C,), dtype=tl.int32)
    for b0 in range(0, NB, BLOCK_B):
        rows = b0 + tl.arange(0, BLOCK_B)
        mask = (rows[:, None] < NB) & col_ok[None, :]
        ptrs = rows[:, None] * E + cols[None, :]
        c = tl.load(block_counts + ptrs, mask=mask, other=0)
        tl.store(block_base + ptrs, run[None, :] + tl.cumsum(c, 0) - c, mask=mask)
        run += tl.sum(c, 0)
    tl.store(counts + cols, run, mask=col_ok)


@triton.jit
def _route_scatter_kernel(
    experts, counts, offs, block_base, row_of, token_idx, R, E, K,  # block_base (num_blocks, E): each
    BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,                    # block's first row within its expert
):
    b = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    per_expert = tl.load(counts + cols, mask=cols < E, other=0)
    ends = tl.cumsum(per_expert, 0)
    if b == 0:
        tl.store(offs + cols, ends, mask=cols < E)
    idx = b * BLOCK + tl.arange(0, BLOCK)
    valid = idx < R
    ids = tl.load(experts + idx, mask=valid, other=-1)
    hot = _one_hot(ids, BLOCK_E)
    rank = tl.sum(tl.cumsum(hot, 0) * hot, 1) - 1  # entries of the same expert before this one, in order
    base = tl.load(block_base + b * E + cols, mask=cols < E, other=0) + ends - per_expert
    row = tl.sum(hot * base[None, :], 1) + rank
    tl.store(row_of + idx, row, mask=valid)
    tl.store(token_idx + row, idx // K, mask=valid)


@triton.jit
def _combine_kernel(
    y, w, row_of, out, T, D, stride_y, stride_out,  # y (R, D); w (T, K) fp32 or None; row_of (T, K); out (T, D)
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (tok[:, None] < T) & (cols[None, :] < D)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for k in tl.static_range(K):  # a fixed order over k: deterministic
        rows = tl.load(row_of + tok * K + k, mask=tok < T, other=-1)  # negative: an absent choice
        here = mask & (rows[:, None] >= 0)
        vals = tl.load(y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], mask=here, other=0.0)
        if w is not None:
            vals = vals.to(tl.float32) * tl.load(w + tok * K + k, mask=tok < T, other=0.0)[:, None]
        acc += vals.to(tl.float32)
    tl.store(out + tok[:, None].to(tl.int64) * stride_out + cols[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _combine_bwd_kernel(
    dout, y, w, row_of, dy, dw, T, D, stride_dout, stride_y, stride_dy,  # dw (T, K) fp32 or None
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    if w is None:  # a plain sum's backward: each dout row is read once and copied to its K rows
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            mask = tok_ok[:, None] & (cols[None, :] < D)
            g = tl.load(dout + tok[:, None].to(tl.int64) * stride_dout + cols[None, :], mask=mask, other=0.0)
            for k in tl.static_range(K):
                rows = tl.load(row_of + tok * K + k, mask=tok_ok, other=-1)  # negative: an absent choice
                tl.store(dy + rows[:, None].to(tl.int64) * stride_dy + cols[None, :], g.to(dy.dtype.element_ty),
                         mask=mask & (rows[:, None] >= 0))
    else:
        for k in tl.static_range(K):
            rows = tl.load(row_of + tok * K + k, mask=tok_ok, other=-1)  # negative: an absent choice (dw 0)
            scale = tl.load(w + tok * K + k, mask=tok_ok, other=0.0)
            dot = tl.zeros((BLOCK_T,), dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = tok_ok[:, None] & (cols[None, :] < D) & (rows[:, None] >= 0)
                g = tl.load(dout + tok[:, None].to(tl.int64) * stride_dout + cols[None, :], mask=mask, other=0.0)
                g = g.to(tl.float32)
                tl.store(dy + rows[:, None].to(tl.int64) * stride_dy + cols[None, :],
                         (g * scale[:, None]).to(dy.dtype.element_ty), mask=mask)
                if dw is not None:
                    yv = tl.load(y + rows[:, None].to(tl.int64) * stride_y + cols[None, :], mask=mask, other=0.0)
                    dot += tl.sum(g * yv.to(tl.float32), 1)
            if dw is not None:
                tl.store(dw + tok * K + k, dot, mask=tok_ok)


@triton.jit
def _gather_rows_ones_kernel(
    x, token_idx, out, R, D, OUT_COLS, stride_x, stride_out,  # x (T, D); token_idx (R,); out (R, OUT_COLS)
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # out[r, :D] = x[token_idx[r]], out[r, D] = 1, out[r, D + 1:OUT_COLS] = 0. OUT_COLS is a multiple
    # of 64, so the store mask stays uniform over vector widths and the stores stay vectorized.
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    src = tl.load(token_idx + r, mask=r < R, other=0).to(tl.int64)
    vals = tl.load(x + src[:, None] * stride_x + cols[None, :], mask=(r[:, None] < R) & (cols[None, :] < D), other=0.0)
    vals = tl.where(cols[None, :] == D, 1.0, vals.to(tl.float32))  # (exact: x is bf16/fp16)
    mask = (r[:, None] < R) & (cols[None, :] < OUT_COLS)
    tl.store(out + r[:, None].to(tl.int64) * stride_out + cols[None, :], vals.to(out.dtype.element_ty), mask=mask)
