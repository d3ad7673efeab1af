"""The mixture of experts' feed-forward: one GeGLU per expert, token copies sorted by expert, and the
products each device computes fastest (``gather_mm`` / ``gather_qmm`` on Metal and CUDA, one BLAS product
per expert on a CPU: kernels.py), also for a rank holding some experts under mx.distributed."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import kernels as device_kernels
from .config import ModelConfig


def gather_operand(x: mx.array) -> mx.array:
    """x [N, in] (row-contiguous: a gather's or an elementwise op's output) as [N, 1, in] with the strides
    of its shape. CUDA's sorted gather_mm (Metal's before mlx 0.32.1) takes the second-to-last stride for
    the rows' leading dimension, which ``x[:, None]`` sets to 1; a reshape sets it to ``in``."""
    return x.reshape(x.shape[0], 1, x.shape[-1])


class ExpertLinear(nn.Module):
    """One linear map per expert, weight [E, out, in]; tokens arrive sorted by expert."""

    def __init__(self, inputs: int, outputs: int, experts: int):
        super().__init__()
        self.weight = mx.zeros((experts, outputs, inputs))

    def __call__(self, x: mx.array, idx: mx.array) -> mx.array:
        """x [N, in] through expert ``idx[n]`` each, with gather_mm (fast on Metal/CUDA)."""
        y = mx.gather_mm(gather_operand(x), self.weight.swapaxes(-1, -2), rhs_indices=idx, sorted_indices=True)
        return y.reshape(x.shape[0], -1)

    def segments(self, x: mx.array, counts: list[int]) -> mx.array:
        """x [N, in] in runs of ``counts[e]`` rows for expert e: one BLAS product per expert."""
        w = self.weight
        if w.dtype != mx.float32:  # MLX's CPU matmuls are fast in float32 only
            x, w = x.astype(mx.float32), w.astype(mx.float32)
        return _per_segment(x, counts, lambda rows, e: rows @ w[e].T)

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_) -> "QuantizedExpertLinear":
        return QuantizedExpertLinear(
            *mx.quantize(self.weight, group_size, bits, mode=mode), group_size=group_size, bits=bits, mode=mode
        )


class QuantizedExpertLinear(nn.Module):
    def __init__(self, weight, scales, biases=None, *, group_size: int, bits: int, mode: str):
        super().__init__()
        self.weight, self.scales = weight, scales
        if biases is not None:
            self.biases = biases
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.kernels = device_kernels.for_device()
        self.freeze()

    def __call__(self, x: mx.array, idx: mx.array) -> mx.array:
        y = mx.gather_qmm(
            gather_operand(x),
            self.weight,
            self.scales,
            self.get("biases"),
            rhs_indices=idx,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=True,
        )
        return y.reshape(x.shape[0], -1)

    def segments(self, x: mx.array, counts: list[int]) -> mx.array:
        biases = self.get("biases")

        def product(rows, e):
            return self.kernels.quantized_matmul(
                rows,
                self.weight[e],
                self.scales[e],
                None if biases is None else biases[e],
                True,
                self.group_size,
                self.bits,
                self.mode,
            )

        return _per_segment(x, counts, product)


def _per_segment(x: mx.array, counts: list[int], product) -> mx.array:
    outputs, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            outputs.append(product(x[start : start + count], expert))
        start += count
    return mx.concatenate(outputs)


class Experts(nn.Module):
    """``num_experts`` GeGLU FFNs; fused ``gate_up_proj`` [E, 2I, H] (gate rows first), ``down_proj`` [E, H, I]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = ExpertLinear(cfg.hidden_size, 2 * cfg.moe_intermediate_size, cfg.num_experts)
        self.down_proj = ExpertLinear(cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_experts)
        self.inner = cfg.moe_intermediate_size
        self.num_experts = cfg.num_experts
        self.kernels = device_kernels.MLX
        # Under mx.distributed (distributed.py): this rank's contiguous range of experts, whose
        # weights alone it holds, and the group its share of the output is summed over.
        self.shard = None

    def __call__(self, x: mx.array, idx: mx.array, weights: mx.array) -> mx.array:
        shape, k = x.shape, idx.shape[-1]
        # Copies routed per row of the batch: the GELU's path is chosen by them (see _gelu).
        row_copies = k * (shape[-2] if len(shape) >= 3 else shape[0])
        x = x.reshape(-1, shape[-1])
        flat = idx.reshape(-1)
        # Token copies sorted by expert, so that each expert's weights are walked once.
        order = mx.argsort(flat)
        sorted_idx = flat[order]
        xs = x[order // k]
        # gather_mm takes float32 weights only on the CPU, where the kernels then never choose it
        gather_ok = isinstance(self.gate_up_proj, ExpertLinear) and self.gate_up_proj.weight.dtype == mx.float32
        counts = self.kernels.expert_counts(sorted_idx, self.num_experts, gather_ok)
        if self.shard is not None:
            # Each copy's output comes from the one rank that holds its expert (the others add
            # zeros): the very numbers of a single process, so sharded text equals unsharded text.
            y = self.shard.all_sum(self._local_outputs(xs, sorted_idx, counts, row_copies).astype(x.dtype))
        elif counts is not None:
            y = self._ffn_segments(xs, counts, row_copies).astype(x.dtype)
        else:
            y = self._ffn_gather(xs, sorted_idx, row_copies)
        y = y[mx.argsort(order)].reshape(-1, k, shape[-1])
        out = (y.astype(mx.float32) * weights.reshape(-1, k, 1)).sum(axis=1)
        return out.astype(x.dtype).reshape(shape)

    def _gelu(self, gate: mx.array, row_copies: int) -> mx.array:
        # The kernel is chosen by the copies one row of the batch routes in this forward, not by the
        # copies at hand: a rank holding some experts then computes them as a single process would,
        # and a row in a batch as it would alone.
        return self.kernels.gelu(gate, row_copies * self.inner)

    def _ffn_segments(self, xs: mx.array, counts: list[int], row_copies: int) -> mx.array:
        gate_up = self.gate_up_proj.segments(xs, counts)
        return self.down_proj.segments(
            self._gelu(gate_up[..., : self.inner], row_copies) * gate_up[..., self.inner :], counts
        )

    def _ffn_gather(self, xs: mx.array, sorted_idx: mx.array, row_copies: int) -> mx.array:
        gate_up = self.gate_up_proj(xs, sorted_idx)
        h = self._gelu(gate_up[..., : self.inner], row_copies) * gate_up[..., self.inner :]
        return self.down_proj(h, sorted_idx)

    def _local_outputs(self, xs: mx.array, sorted_idx: mx.array, counts: list[int] | None, row_copies: int) -> mx.array:
        """The outputs [N, H] of the copies routed to this rank's experts, zero for the others."""
        start, stop = self.shard.start, self.shard.stop
        n = stop - start
        if counts is not None:  # this rank's copies are one run of the sorted ones
            first = sum(counts[:start])
            last = first + sum(counts[start:stop])
            parts = [mx.zeros((first, xs.shape[-1]), xs.dtype)]
            if last > first:
                parts.append(self._ffn_segments(xs[first:last], counts[start:stop], row_copies).astype(xs.dtype))
            parts.append(mx.zeros((xs.shape[0] - last, xs.shape[-1]), xs.dtype))
            return mx.concatenate(parts)
        local = sorted_idx.astype(mx.int32) - start
        mine = (local >= 0) & (local < n)
        # Other ranks' copies borrow the lowest / highest local expert in use (no other weights
        # read, the indices stay sorted); their outputs are zeroed.
        lowest = mx.where(mine, local, n).min()
        highest = mx.where(mine, local, -1).max()
        below = mx.where(lowest < n, lowest, 0)
        above = mx.where(highest >= 0, highest, 0)
        local = mx.where(local < 0, below, mx.where(local >= n, above, local))
        return mx.where(mine[:, None], self._ffn_gather(xs, local, row_copies), 0)
