"""Logit softcapping (Gemma 2, Grok): every score s becomes c * tanh(s / c) before the softmax.

The softmax still normalizes what it is given, so a tile's (out, lse) over capped scores merges with
the other tiles' exactly as without a cap: the ring's online softmax, the lse merge, sinks and every
strategy stay as they are. Only a kernel's inner step changes, and its backward gains the tanh's
derivative, 1 - tanh^2(s / c). Kernels that take `softcap=` set SOFTCAP = True: the reference
(explicit scores, the CPU's path: aten's CPU flash op has no softcap), FlexAttention (a score_mod)
and flash_attn (its own argument). `Softcapped` binds c to one of them so that strategies call it as
any kernel.
"""

from __future__ import annotations


class Softcapped:
    """A kernel module with `softcap` bound: forward(q, k, v, scale, causal, mask) and backward(dout,
    q, k, v, out, lse, scale, causal, mask) as every kernel's; its planning attributes (MAX_ROWS,
    BANDS, RULES...) are the module's."""

    def __init__(self, kernel, softcap: float):
        if not getattr(kernel, "SOFTCAP", False):
            raise ValueError(f"{kernel.__name__} takes no softcap")
        self.kernel, self.softcap = kernel, float(softcap)
        self.__name__ = kernel.__name__

    def forward(self, q, k, v, scale: float, causal: bool, mask=None):
        return self.kernel.forward(q, k, v, scale, causal, mask, softcap=self.softcap)

    def backward(self, dout, q, k, v, out, lse, scale: float, causal: bool, mask=None):
        return self.kernel.backward(dout, q, k, v, out, lse, scale, causal, mask, softcap=self.softcap)

    def __getattr__(self, name: str):
        return getattr(self.kernel, name)

    def __repr__(self) -> str:
        return f"Softcapped({self.kernel.__name__}, softcap={self.softcap})"
