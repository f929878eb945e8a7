"""A tile's mask as kernel arguments (`Bands`): for a kernel that takes causal, window and document
masks itself (flash_attn's window and varlen interfaces), so that no dense mask is built.

The planner (planner.py) derives a pair's bands from its positions; kernels read them (kernels/
cuda_flash_attn.py as arguments, kernels/flex.py as a mask_mod, kernels/masking.py as a dense mask
for a kernel that takes neither).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rules import attends_within, window_bounds


@dataclass(frozen=True)
class Bands:
    """A tile's mask as kernel arguments: sequences of queries against keys, each a diagonal band.

    Sequence n is query rows cu_q[n]:cu_q[n+1] against key rows cu_k[n]:cu_k[n+1] of the tile; no
    query sees a key of another sequence. Within a sequence of sq queries and sk keys, query i sees
    keys i + (sk - sq) - left .. i + (sk - sq) + right: flash_attn's window_size, aligned at the
    bottom-right corner, -1 = unbounded. One sequence runs on flash_attn's plain interface, several
    on its varlen one. The planner trims every sequence to the rows and keys it attends, so no row is
    empty and the window always holds the corner's diagonal (left, right >= 0 or -1). FlashAttention-2
    reads some windows otherwise where a sequence has more queries than keys (flash_misreads): such
    bands then run as calls it reads as meant (flash_parts: a call per sequence, in row pieces).
    """

    cu_q: tuple[int, ...]
    cu_k: tuple[int, ...]
    left: int
    right: int

    def __post_init__(self):
        if len(self.cu_q) != len(self.cu_k) or len(self.cu_q) < 2 or self.cu_q[0] != 0 or self.cu_k[0] != 0:
            raise ValueError(f"cu_q and cu_k must both run from 0, one bound per sequence: {self}")
        if min(self.left, self.right) < -1:
            raise ValueError(f"window bounds must be >= 0 or -1 (unbounded): {self}")

    @property
    def sequences(self) -> int:
        return len(self.cu_q) - 1

    @property
    def is_reversed_triangle(self) -> bool:
        """One square sequence whose query i sees keys i.. (the causal triangle mirrored: what a causal
        kernel computes on both runs reversed)."""
        return self.sequences == 1 and self.cu_q == self.cu_k and (self.left, self.right) == (0, -1)

    @property
    def max_rows(self) -> tuple[int, int]:
        """The longest sequence's queries and keys (flash_attn's max_seqlen_q, max_seqlen_k)."""
        return (
            max(b - a for a, b in zip(self.cu_q, self.cu_q[1:])),
            max(b - a for a, b in zip(self.cu_k, self.cu_k[1:])),
        )

    def flash_windows(self) -> tuple[int, int]:
        """The window FlashAttention-2 applies for these arguments (mha_fwd, then set_params): a size of
        at least max_seqlen_k becomes -1, then one -1 beside a bound becomes max_seqlen_k."""
        _, max_k = self.max_rows
        left, right = (-1 if w >= max_k else w for w in (self.left, self.right))
        if left < 0 <= right:
            left = max_k
        elif right < 0 <= left:
            right = max_k
        return left, right

    def flash_misreads(self) -> bool:
        """True when FlashAttention-2 would attend other pairs than these bands: its windows
        (flash_windows) differ from ours in some sequence. An unbounded right is only as wide as
        max_seqlen_k there, which bounds the first rows of a sequence with more queries than keys
        (row i sees up to key i + sk - sq + right): burst's served key chunks make such tiles."""
        applied = self.flash_windows()
        for q0, q1, k0, k1 in zip(self.cu_q, self.cu_q[1:], self.cu_k, self.cu_k[1:]):
            sq, sk = q1 - q0, k1 - k0
            if sq and sk and _reach(applied, sq, sk) != _reach((self.left, self.right), sq, sk):
                return True
        return False

    def row_pieces(self) -> list[tuple[int, int, "Bands"]]:
        """One sequence's query rows cut into pieces of at most sk + 1 rows, each with the bands that
        hold for it: (first row, end row, bands). With no more queries than keys + 1, an unbounded
        side reads as meant (flash_misreads is False for every piece); the planner's tiles have no
        empty row, so every piece's bounds stay >= 0."""
        assert self.sequences == 1, "pieces of one sequence"
        sq, sk = self.cu_q[1], self.cu_k[1]
        step, pieces = sk + 1, []
        for a in range(0, sq, step):
            b = min(sq, a + step)
            below = sq - b  # rows under the piece: its corner sits that much above the tile's
            left = self.left + below if self.left >= 0 else -1
            right = self.right - below if self.right >= 0 else -1
            pieces.append((a, b, Bands((0, b - a), (0, sk), left, right)))
        return pieces

    def flash_parts(self) -> list[tuple[int, int, int, int, "Bands"]]:
        """Calls FlashAttention-2 reads as meant, covering these bands: (q rows a:b, k rows c:d, bands
        of one sequence). One call for bands it reads right; else one call per sequence, each cut
        into row pieces where it would still misread one."""
        if not self.flash_misreads():
            return [(0, self.cu_q[-1], 0, self.cu_k[-1], self)]
        parts = []
        for q0, q1, k0, k1 in zip(self.cu_q, self.cu_q[1:], self.cu_k, self.cu_k[1:]):
            if q1 == q0:
                continue
            one = Bands((0, q1 - q0), (0, k1 - k0), self.left, self.right)
            pieces = one.row_pieces() if one.flash_misreads() else [(0, q1 - q0, one)]
            parts += [(q0 + a, q0 + b, k0, k1, piece) for a, b, piece in pieces]
        return parts

    def pairs(self) -> int:
        """(query, key) pairs the bands attend (work accounting, without building the mask)."""
        total = 0
        for q0, q1, k0, k1 in zip(self.cu_q, self.cu_q[1:], self.cu_k, self.cu_k[1:]):
            sq, sk = q1 - q0, k1 - k0
            i = torch.arange(sq) + (sk - sq)  # each row's diagonal key
            first = (i - self.left).clamp(min=0) if self.left >= 0 else torch.zeros_like(i)
            last = (i + self.right).clamp(max=sk - 1) if self.right >= 0 else torch.full_like(i, sk - 1)
            total += int((last - first + 1).clamp(min=0).sum())
        return total

    def allowed(self, device=None) -> torch.Tensor:
        """Dense bool (cu_q[-1], cu_k[-1]), True = attend: for kernels that take no band arguments."""
        rows = self.rows(device)
        q, k = torch.arange(self.cu_q[-1], device=device), torch.arange(self.cu_k[-1], device=device)
        return self.attends(q[:, None], k[None, :], rows)

    def rows(self, device=None) -> tuple[torch.Tensor, ...]:
        """Per-row lookups for `attends`: each query row's and key row's position, counted from its
        sequence's first key with the sequence's bottom-right corner on the diagonal (query i of sq at
        i + sk - sq), then each query row's and key row's sequence (as its document)."""
        cu_q, cu_k = (torch.tensor(cu, device=device) for cu in (self.cu_q, self.cu_k))
        q_row, k_row = torch.arange(self.cu_q[-1], device=device), torch.arange(self.cu_k[-1], device=device)
        q_seq = torch.bucketize(q_row, cu_q, right=True) - 1
        k_seq = torch.bucketize(k_row, cu_k, right=True) - 1
        corner = (cu_k[1:] - cu_k[:-1]) - (cu_q[1:] - cu_q[:-1])  # keys minus queries, per sequence
        return q_row - cu_q[q_seq] + corner[q_seq], k_row - cu_k[k_seq], q_seq, k_seq

    def attends(self, q_row: torch.Tensor, k_row: torch.Tensor, rows: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Elementwise, broadcasting: does query row q_row see key row k_row (rows: `rows()`)."""
        q_pos, k_pos, q_seq, k_seq = rows
        bounds = window_bounds(False, (self.left, self.right))
        return attends_within(q_pos[q_row], k_pos[k_row], *bounds, q_seq[q_row], k_seq[k_row])


def _reach(window: tuple[int, int], sq: int, sk: int) -> tuple[int, int]:
    """A window's bounds in a sequence of sq queries and sk keys, each unbounded side (or one no
    row reaches past: left >= sk - 1, right >= sq - 1) as the same value: equal reach, equal mask."""
    left, right = window
    return (sk - 1 if left < 0 or left >= sk - 1 else left, sq - 1 if right < 0 or right >= sq - 1 else right)
