"""Weight-normalised time-major convolutions: a centred one for the encoder and a causal one that
also decodes step by step from an ``input_buffer``."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from fairseq.incremental_decoding_utils import FairseqIncrementalState
from torch import Tensor, nn

from beamplugin.modules.weight_norm import FoldedWeightNorm

IncrementalState = dict[str, dict[str, Tensor | None]]


class TBCConvolution(FoldedWeightNorm):
    """1-D convolution over ``time x batch x channels`` input whose output keeps the input length.

    The weight is ``kernel_size x in_channels x out_channels`` (torch.conv_tbc's layout, the one
    fconv checkpoints hold), normalised per output channel.
    """

    def __init__(
        self, in_channels: int, out_channels: int, kernel_size: int, dropout: float = 0.0
    ) -> None:
        weight = torch.empty(kernel_size, in_channels, out_channels)
        std = math.sqrt(4.0 * (1.0 - dropout) / (kernel_size * in_channels))
        nn.init.normal_(weight, mean=0.0, std=std)
        super().__init__(weight, torch.zeros(out_channels), norm_dim=2)
        self.in_channels = in_channels
        self.out_channels = out_channels
        self.kernel_size = kernel_size

    def convolve(self, x: Tensor, frames_before: int) -> Tensor:
        """Output frame t sees input frames t - frames_before ... t - frames_before + width - 1.

        In inference, one product of every output frame's window of input frames (time, batch,
        (frame, channel)) with the linearized weight: on a packed weight (our kernel's or
        oneDNN's, about twice as fast as conv_tbc's MKL products on the CPUs measured) each frame
        gets the same bits whatever sentences share the batch, and in int8 each window is
        quantized on its own (torch has no int8 conv_tbc). Training keeps conv_tbc (autograd)."""
        if torch.is_grad_enabled():
            padding = max(frames_before, self.kernel_size - 1 - frames_before)
            out = torch.conv_tbc(x.contiguous(), self.weight, self.bias, padding)
            start = padding - frames_before
            return out[start : start + x.size(0)]
        steps, bsz = x.shape[:2]
        frames_after = self.kernel_size - 1 - frames_before
        padded = F.pad(x, (0, 0, 0, 0, frames_before, frames_after))
        windows = padded.unfold(0, self.kernel_size, 1).transpose(2, 3)
        weight = self.derived_weight("linearized", self._linearize)
        out = self.product(windows.reshape(steps * bsz, -1), weight, self.bias, "linearized")
        return out.view(steps, bsz, -1)

    def _linearize(self, weight: Tensor) -> Tensor:
        """out_channels x (frame, in_channel): a window of frames times this is the convolution."""
        return weight.permute(2, 0, 1).contiguous().view(self.out_channels, -1)

    def forward(self, x: Tensor) -> Tensor:
        # centred window; for even widths one more frame after than before (as fconv)
        return self.convolve(x, (self.kernel_size - 1) // 2)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}"


class CausalConvolution(FairseqIncrementalState, TBCConvolution):
    """Convolution over the current and previous ``kernel_size - 1`` frames.

    Incremental decoding keeps each row's previous ``kernel_size - 1`` inputs as
    ``input_buffer`` in the incremental state (zeros before the first step) and takes one matrix
    product of its window (those and the new frame) with the linearized weight, out_channels x
    (frame, in_channel), cached with the folded weight (fconv's layout: its checkpoints load as
    they are). A beam reorder only notes the rows' order: the next step gathers them straight
    into its window, whose last frames are the next step's buffer (a view), so a step copies its
    rows' frames once.
    """

    def forward(self, x: Tensor, incremental_state: IncrementalState | None = None) -> Tensor:
        """Full pass: x is time x batch x channels. Incremental: x is the newest frame,
        batch x 1 x channels, and so is the result."""
        if incremental_state is None:
            return self.convolve(x, self.kernel_size - 1)
        bsz = x.size(0)
        if self.kernel_size > 1:
            x = self._window(incremental_state, x)
            self.set_incremental_state(incremental_state, "input_buffer", x[:, 1:])
        x = x.reshape(bsz, -1)
        weight = self.derived_weight("linearized", self._linearize)
        return self.product(x, weight, self.bias, "linearized").view(bsz, 1, -1)

    def _window(self, incremental_state: IncrementalState, x: Tensor) -> Tensor:
        """Each row's previous inputs (in the order a reorder noted) then ``x``, ``[rows,
        kernel_size, channels]``."""
        buffer = self.get_incremental_state(incremental_state, "input_buffer")
        if buffer is None:
            buffer = x.new_zeros(x.size(0), self.kernel_size - 1, self.in_channels)
        order = self.get_incremental_state(incremental_state, "order")
        if order is None:
            return torch.cat((buffer, x), dim=1)
        self.set_incremental_state(incremental_state, "order", None)
        window = x.new_empty(x.size(0), self.kernel_size, self.in_channels)
        torch.index_select(buffer, 0, order, out=window[:, :-1])
        window[:, -1:] = x
        return window

    def reorder_buffer(
        self, incremental_state: IncrementalState, new_order: Tensor, fresh_rows: int = 0
    ) -> None:
        """Keep the rows of ``new_order`` (a permutation, repetition or subset of the batch);
        the last ``fresh_rows`` of the result are zeroed, as a new row starts.

        Not named reorder_incremental_state: fairseq calls that on every submodule, and the
        decoder already reorders its convolutions.
        """
        buffer = self.get_incremental_state(incremental_state, "input_buffer")
        if buffer is None:
            return
        order = self.get_incremental_state(incremental_state, "order")
        if order is not None:  # a reorder not yet taken: the two in one
            new_order = order.index_select(0, new_order)
        if not fresh_rows:  # gathered by the next step, into its window
            self.set_incremental_state(incremental_state, "order", new_order)
            return
        buffer = buffer.index_select(0, new_order)
        buffer[-fresh_rows:] = 0
        self.set_incremental_state(incremental_state, "input_buffer", buffer)
        self.set_incremental_state(incremental_state, "order", None)
