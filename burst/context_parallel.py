"""burst.context_parallel: sequence parallelism for a model that calls scaled_dot_product_attention.

    with burst.context_parallel(buffers=[tokens, labels, model.freqs_cis], buffer_seq_dims=[1, 1, 0],
                                no_restore_buffers={tokens, labels}, layout="zigzag"):
        loss = loss_fn(model(tokens), labels)
        loss.backward()

The buffers are cut in place along their sequence dims by the layout (burst.shard's rules), so the
model sees only this rank's tokens; inside, every `F.scaled_dot_product_attention` call (direct, or
inside nn.MultiheadAttention / nn.TransformerEncoderLayer) runs burst.attention over the group.
On exit SDPA is torch's again and the buffers are whole again, except those in no_restore_buffers.

What cannot be honoured raises ValueError on every rank, never a silently local attention: an
explicit attn_mask (masks are options: is_causal, window=, cu_seqlens=, block_sparse=), dropout,
a sequence length other than the shards', need_weights=True (nn.MultiheadAttention then builds the
attention matrix itself). nn.MultiheadAttention's fused inference kernel is switched off inside,
as it would attend the local tokens only.

Beside torch's own `torch.distributed.tensor.experimental.context_parallel`: that one runs on CUDA
only, with full or causal masks and one load balancer; this one runs every burst strategy and
layout, on CPU and GPU, with windows, documents and block-sparse masks, and GQA (enable_gqa).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import warnings

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.overrides import TorchFunctionMode

from . import api, custom_op, sdpa_names
from .agreement import agree
from .call import AttentionRequest
from .comm.membership import group_size
from .layout import _check_divisible, check_layout, resolve_layout, shard
from .shard_positions import counts_from_shard_start, held_positions, position_lookup

ENTRY = "burst.context_parallel"


@contextlib.contextmanager
def context_parallel(
    mesh=None,
    *,
    buffers=None,
    buffer_seq_dims=None,
    no_restore_buffers=None,
    group=None,
    layout: str = "zigzag",
    strategy: str = "burst",
    **options,
):
    """Shard `buffers` along `buffer_seq_dims` and run every SDPA call inside through burst.attention.

    mesh / group: a 1-D DeviceMesh, first and positional as torch's context_parallel takes it, or the process group.

    buffers: tensors holding the whole sequence (token ids, labels, fixed position tables), the same
        on every rank, cut in place (their `.data` becomes this rank's shard; one listed twice is cut
        once); all share one sequence length along their seq dim. Not a tensor that requires grad (a
        learned table would get a gradient of its shard's shape): refused. buffer_seq_dims: one dim
        per buffer.
    no_restore_buffers: those buffers left as shards on exit (inputs you do not need whole again). None for
        any of the three, as torch's defaults: none.
    layout, strategy, **options: as burst.attention (window=, cu_seqlens=, block_sparse=, chunk_rows=...);
        layout="doc_zigzag" / "doc_contiguous" with cu_seqlens= cuts each packed document on its own.
    """
    if mesh is not None:
        if not hasattr(mesh, "get_group"):
            raise TypeError(
                f"{ENTRY}: the first argument is the DeviceMesh, as in torch's context_parallel; got "
                f"{type(mesh).__name__}: pass the tensors as buffers=[...], buffer_seq_dims=[...] (a process "
                "group as group=)"
            )
        if group is not None:
            raise ValueError(f"{ENTRY}: pass group or mesh, not both")
        if mesh.ndim != 1:
            raise ValueError(f"{ENTRY}: mesh must be 1-D (the sequence dimension), got {mesh.ndim}-D")
        group = mesh.get_group()
    if _open[0] is not None:  # a context is open (every rank's)
        raise ValueError(f"{ENTRY}: a context is already open; nested, it would cut the buffers' shards again")
    layout = resolve_layout(layout, options.get("cu_seqlens"))  # "doc_zigzag" + the documents' cu_seqlens
    for name, value in (("buffers", buffers), ("no_restore_buffers", no_restore_buffers)):
        if isinstance(value, torch.Tensor):  # the same mistake on every rank: refused before any collective
            raise TypeError(f"{ENTRY}: {name} takes a list (or set) of tensors, got one tensor: wrap it, {name}=[t]")
    buffers, seq_dims = (
        list(() if buffers is None else buffers),
        list(() if buffer_seq_dims is None else buffer_seq_dims),
    )
    keep = {id(t) for t in (() if no_restore_buffers is None else no_restore_buffers)}
    local_len = _shard_buffers_check(buffers, seq_dims, keep, group, layout, strategy, options)
    once: dict = {}  # a tensor listed twice (`labels = tokens`) is cut once
    for t, dim in zip(buffers, seq_dims):
        once.setdefault(id(t), (t, dim))
    buffers, seq_dims = [t for t, _ in once.values()], [dim for _, dim in once.values()]
    originals = [t.data for t in buffers]
    try:
        for t, dim in zip(buffers, seq_dims):
            t.data = shard(t.data, group=group, layout=layout, dim=dim)
    except BaseException:  # every rank agreed on the buffers: a failure here leaves none cut
        _restore(buffers, originals, keep=set())
        raise
    router = _SDPARouter(group, layout, strategy, options, local_len, held_positions(layout, group, local_len))
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # the fused MHA kernel would attend local tokens only
    try:
        with router, sdpa_names.routed(router.route):
            _open[0] = router
            try:
                yield
            finally:
                _open[0] = None
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
        _restore(buffers, originals, keep)


def _restore(buffers, originals, keep: set) -> None:
    for t, whole in zip(buffers, originals):
        if id(t) not in keep:
            t.data = whole


# burst.attention's keywords each SDPA call sets (from is_causal, scale) or that would change what it returns
_PER_CALL_KEYWORDS = ("q", "k", "v", "causal", "softmax_scale", "return_lse")


def _shard_buffers_check(buffers, seq_dims, keep, group, layout, strategy, options) -> int | None:
    """Validate the buffers and options on every rank before anything is cut; the local length. Options
    of burst.attention (window=, cu_seqlens=...) are checked by its first call, as every call's."""
    world = group_size(group)
    problem, lengths, seen = None, set(), {}
    try:
        check_layout(layout)
        why = "set by each scaled_dot_product_attention call (is_causal=, scale=), not by the context"
        api.check_fixed_options(ENTRY, strategy, options, _PER_CALL_KEYWORDS, why)
        if len(buffers) != len(seq_dims):
            raise ValueError(f"{len(buffers)} buffers but {len(seq_dims)} buffer_seq_dims: give one dim per buffer")
        for i, (t, dim) in enumerate(zip(buffers, seq_dims)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"buffers[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if not -t.dim() <= dim < t.dim():
                raise ValueError(f"buffer_seq_dims[{i}]={dim} is out of range for a {t.dim()}-D buffer")
            if t.requires_grad:
                raise ValueError(
                    f"buffers[{i}] requires grad (a Parameter?): cut in place, it would get a gradient of its "
                    "shard's shape; leave it out and cut what it feeds (a position table: the rows the "
                    "sequence uses, taken inside the block), or pass it detached"
                )
            first, first_dim = seen.setdefault(id(t), (i, dim % t.dim()))
            if first_dim != dim % t.dim():
                raise ValueError(
                    f"buffers[{i}] is buffers[{first}] again, with another seq dim ({dim} and {first_dim})"
                )
            lengths.add(t.shape[dim])
        if keep - {id(t) for t in buffers}:
            raise ValueError("no_restore_buffers holds a tensor that is not in buffers (it must be a subset)")
        if len(lengths) > 1:
            raise ValueError(
                f"the buffers have sequence lengths {sorted(lengths)} along their seq dims; they must "
                "share one (a position table longer than the sequence: slice it to the sequence first)"
            )
        for n in lengths:
            _check_divisible(layout, world, n)
    except (TypeError, ValueError) as err:
        problem = err
    # each buffer's rank and seq dim too: one that differs would fail in the middle of the cutting
    shapes = tuple((t.dim(), dim % t.dim()) for t, dim in zip(buffers, seq_dims)) if problem is None else ()
    facts = {"layout": layout, "strategy": strategy, "lengths": tuple(sorted(lengths)), "buffers": shapes}
    agree(ENTRY, facts if problem is None else None, problem, group, world)
    return next(iter(lengths)) // world if lengths else None


_REENTRANT = torch.utils.checkpoint.CheckpointFunction  # checkpoint(..., use_reentrant=True)'s autograd Function


def _refuse_after_close(router, grad_outputs) -> None:
    if _open[0] is not router:
        raise RuntimeError(
            f"{ENTRY}: the backward of an activation checkpoint (use_reentrant=True) whose attention ran inside "
            "the context is running after it closed: its recomputation would run torch's own attention on this "
            "rank's tokens alone (wrong gradients). Call loss.backward() inside the context"
        )


def _frame_of(function):
    """The frame of `function` (a plain function: its code object) on the calling stack, or None."""
    frame, code = sys._getframe(2), function.__code__
    while frame is not None and frame.f_code is not code:
        frame = frame.f_back
    return frame


# torch's SDPA itself: code that holds it where burst does not replace it (sdpa_names) reaches the mode with it
_TORCH_SDPA = sdpa_names.TORCH_SDPA
_open: list = [None]  # the router of the context open now (contexts do not nest)


@functools.lru_cache(maxsize=1)
def _warn_unchecked_positions() -> None:
    warnings.warn(
        f"{ENTRY} under torch.compile: whether an embedding numbers this shard's tokens from 0 (learned absolute "
        "positions looked up with arange(seq_len), which burst refuses eagerly) cannot be checked while "
        "tracing; run the model once eagerly in the context to check it",
        stacklevel=3,
    )


@functools.lru_cache(maxsize=1)
def _warn_another_name() -> None:
    warnings.warn(
        f"{ENTRY}: scaled_dot_product_attention held where burst does not replace it (a closure, an attribute, "
        "a functools.partial, torch._C._nn's): routed here, but not inside an activation checkpoint, whose "
        "recomputation torch runs with the context's mode off (there torch's SDPA would attend this rank's tokens "
        "only); call it as torch.nn.functional.scaled_dot_product_attention, or by a module-level name",
        stacklevel=3,
    )


class _SDPARouter(TorchFunctionMode):
    """Routes F.scaled_dot_product_attention to burst.attention while the context is open.

    Two routes, both open for the whole context. The mode catches SDPA under any name; but its
    handler runs with the mode popped, so calls nested in another overridable function
    (nn.MultiheadAttention's functional path; backward, where activation checkpointing re-runs the
    forward) pass it by, and torch.compile's tracing of a checkpointed block does not apply it
    (torch's SDPA on the local tokens: silently wrong). For those, the names SDPA is called by are
    burst.attention while the context is open: torch.nn.functional's and every module-level alias of it
    (sdpa_names). So only SDPA held elsewhere (a closure, an attribute, a partial, torch._C._nn's) is not
    routed in a checkpointed block: routing a call made so warns once (docs/context-parallel.md says so).
    A route captured while open (the name read inside the context, kept) follows whichever context is
    open when it is called, and is torch's SDPA outside any.
    """

    def __init__(self, group, layout, strategy, options, local_len, held_positions=None):
        super().__init__()
        self.group, self.layout, self.strategy, self.options = group, layout, strategy, options
        self.local_len = local_len
        self.held_positions = held_positions
        self.shard_counted_positions = False  # set by an embedding; refused at the next SDPA call, on every rank
        self.attending = False
        self.world = group_size(group)
        # Eagerly, behind a graph break under torch.compile when burst's custom op cannot carry the call:
        # the agreement collective and the ring's messages are not for dynamo to trace.
        self.eager_attention = custom_op.run_eagerly(functools.partial(self.attention))  # a bound method takes no marks
        self.traceable = custom_op.takes(AttentionRequest.of(strategy=strategy, layout=layout, **options))

    def route(self, *args, **kwargs):
        """What SDPA is while the context is open: burst.attention's custom op under torch.compile (no
        graph break, burst/custom_op.py), when it can carry the call; else burst.attention eagerly."""
        if _open[0] is not self:  # captured in a context now closed: the open one's SDPA, or torch's
            return _TORCH_SDPA(*args, **kwargs) if _open[0] is None else _open[0].route(*args, **kwargs)
        if torch.compiler.is_compiling() and self.traceable:
            return self.traced_attention(*args, **kwargs)
        self._guard_checkpoint()
        self.attending = True  # burst's own lookups inside are not the model's positions
        try:
            return self.eager_attention(*args, **kwargs)
        finally:
            self.attending = False

    def _guard_checkpoint(self) -> None:
        """A call in a reentrant checkpoint's forward (no graph kept, a backward to come: its ctx's
        needs_input_grad) is run again by the checkpoint's backward, and only while this context is open is
        that burst's attention: a pre-hook on the checkpoint's node refuses its backward once the context has
        closed (torch's SDPA would attend this rank's tokens alone, silently wrong; a non-reentrant checkpoint
        raises torch's CheckpointError there)."""
        forward = None if torch.is_grad_enabled() else _frame_of(_REENTRANT.forward)
        node = forward.f_locals.get("ctx") if forward is not None else None
        if node is None or not any(node.needs_input_grad) or getattr(node, "_burst_guarded", False):
            return
        node._burst_guarded = True
        node.register_prehook(functools.partial(_refuse_after_close, self))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _TORCH_SDPA or func is F.scaled_dot_product_attention:  # under any name: torch's function itself
            if not torch.compiler.is_compiling():
                _warn_another_name()
            return self.route(*args, **kwargs)
        if func is F.multi_head_attention_forward:
            return self._multi_head_attention(func, args, kwargs)
        if func is F.embedding or func is torch.index_select or func is torch.Tensor.index_select:
            self._noteposition_lookup(func, args, kwargs)  # only these: anything more, dynamo mistraces MHA
        elif func is torch.Tensor.__getitem__ and not torch.compiler.is_compiling():
            self._noteposition_lookup(func, args, kwargs)  # eagerly only: every indexing passes here
        return func(*args, **kwargs)

    def _noteposition_lookup(self, func, args, kwargs) -> None:
        """Mark a table lookup that numbered this shard's tokens from 0 (refused at the next SDPA call, on every
        rank). Under torch.compile the indices have no values to read: a warning says the check did not run."""
        if self.held_positions is None or self.attending:
            return
        if torch.compiler.is_compiling():
            _warn_unchecked_positions()
            return
        indices = position_lookup(func, args, kwargs)
        if indices is not None:
            self.shard_counted_positions |= counts_from_shard_start(indices, self.held_positions)

    def _multi_head_attention(self, func, args, kwargs):
        problem = None
        if kwargs.get("need_weights", True):
            problem = ValueError(
                f"{ENTRY}: nn.MultiheadAttention with need_weights=True builds the attention matrix itself, over "
                "this rank's tokens only; call it with need_weights=False (then it runs scaled_dot_product_attention)"
            )
        elif kwargs.get("key_padding_mask") is not None:
            problem = ValueError(
                f"{ENTRY}: nn.MultiheadAttention's key_padding_mask is a mask burst cannot apply; "
                "pack the sequences and pass cu_seqlens= to context_parallel instead"
            )
        if torch.compiler.is_compiling():  # no agreement to trace: each rank raises the same from its own call
            if problem is not None:
                raise problem
        else:
            agree(f"{ENTRY} (nn.MultiheadAttention)", {} if problem is None else None, problem, self.group, self.world)
        return func(*args, **kwargs)

    def attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        """SDPA's signature on burst.attention. query: (batch, heads, seq_local, head_dim); key, value:
        (batch, kv_heads, seq_local, head_dim). Returns (batch, heads, seq_local, head_dim)."""
        problem = self._refusal(query, key, attn_mask, dropout_p, enable_gqa)
        agree(
            f"{ENTRY} (scaled_dot_product_attention)", {} if problem is None else None, problem, self.group, self.world
        )
        return self._burst(query, key, value, is_causal, scale)

    def traced_attention(
        self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        """`attention` as torch.compile traces it: the refusals are checked on each rank as it traces (the
        op's first run agrees on the call's settings across the ranks, as burst.attention does)."""
        problem = self._refusal(query, key, attn_mask, dropout_p, enable_gqa)
        if problem is not None:
            raise problem
        return self._burst(query, key, value, is_causal, scale)

    def _burst(self, query, key, value, is_causal, scale):
        """burst.attention on SDPA's (batch, heads, seq_local, head_dim) layout."""
        out = api.attention(
            query.transpose(-3, -2),
            key.transpose(-3, -2),
            value.transpose(-3, -2),
            group=self.group,
            strategy=self.strategy,
            layout=self.layout,
            causal=bool(is_causal),
            softmax_scale=scale,
            **self.options,
        )
        return out.transpose(-3, -2)

    def _refusal(self, query, key, attn_mask, dropout_p, enable_gqa) -> ValueError | None:
        """What this call asks that sharded attention cannot give, as the error every rank raises."""
        if self.shard_counted_positions:
            return ValueError(
                f"{ENTRY}: a table was looked up at rows p..p+{self.local_len - 1} (an embedding, or a Parameter's "
                "rows indexed) on a rank that holds other tokens: the model numbers each shard's tokens from its own "
                "length (learned positions: arange(seq_len) + offset), so every rank would embed its shard at the "
                "first rank's positions. Look positions up from a positions buffer listed in buffers= (a "
                "transformers model: use burst.integrations.transformers). Token ids that run p, p+1, ... look "
                "the same: test with other ids"
            )
        if attn_mask is not None:
            return ValueError(
                f"{ENTRY}: scaled_dot_product_attention got an explicit attn_mask (shape {tuple(attn_mask.shape)}), "
                "which covers this rank's tokens only; express the mask as options instead: is_causal=True, and "
                "window=, cu_seqlens= or block_sparse= given to context_parallel"
            )
        if dropout_p:
            return ValueError(f"{ENTRY}: attention dropout (dropout_p={dropout_p}) is not supported; set it to 0")
        if query.dim() != 4:
            return ValueError(
                f"{ENTRY}: scaled_dot_product_attention got a {query.dim()}-D query; burst takes "
                "(batch, heads, seq, head_dim)"
            )
        if self.local_len is not None and query.shape[-2] != self.local_len:
            return ValueError(
                f"{ENTRY}: scaled_dot_product_attention got {query.shape[-2]} tokens but the buffers were cut into "
                f"{self.local_len} per rank; every tensor that carries the sequence must be in `buffers` (or be "
                "computed from them)"
            )
        if query.shape[-3] != key.shape[-3] and not enable_gqa:
            return ValueError(
                f"{ENTRY}: query has {query.shape[-3]} heads but key has {key.shape[-3]}; pass "
                "enable_gqa=True, as scaled_dot_product_attention requires"
            )
        return None
