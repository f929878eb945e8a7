"""What sparse attention adds to a layer's traffic (the numbers every rank gathers per token), and which
of a transformers config's layers have a sliding window (windowed_layers, for windows.py).

DeepSeek sparse attention's indexer keys (index_head_dim numbers per token, V3.2 and the families
that reuse it) and DeepSeek-V4's compressed entries (head_dim / rate per token for its CSA and HCA
entries, index_head_dim / rate for the CSA indexer's) are gathered once per layer to every rank
(burst/integrations/transformers/layers/indexer.py and compressed.py), outside the ring, so the
cost model adds them as collectives that compute does not hide. The entries' gradients come back by
an all-reduce of the gathered entries in the backward; the indexers' selections carry none.
"""

from __future__ import annotations


def _text_config(config):
    """A transformers config's decoder text config (the config itself for a text-only model)."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def gathered_numbers(config) -> tuple[float, float]:
    """(numbers per token gathered without gradient, with gradient), averaged over the layers, for a
    transformers config (its text config where it has one); (0, 0) for a model without an indexer."""
    text = _text_config(config)
    if not getattr(text, "index_topk", None):
        return 0.0, 0.0
    index_dim = next((getattr(text, a) for a in ("index_head_dim", "indexer_head_dim") if getattr(text, a, None)), 0)
    rates = getattr(text, "compress_rates", None)
    if not rates:  # an indexer on every layer, over the raw tokens
        return float(index_dim), 0.0
    kinds = list(getattr(text, "layer_types", None) or [])
    plain = sum(index_dim / rates[k] for k in kinds if k == "compressed_sparse_attention")
    with_gradient = sum(text.head_dim / rates[k] for k in kinds if k in rates)
    return plain / max(1, len(kinds)), with_gradient / max(1, len(kinds))


def entries_per_query(config, seq_len: int) -> float:
    """Compressed entries a query attends on average, over the layers (DeepSeek-V4: a CSA query its
    top-k of the (i + 1) // rate ended entries, an HCA query all of them); 0 without compressors."""
    text = _text_config(config)
    rates = getattr(text, "compress_rates", None)
    kinds = list(getattr(text, "layer_types", None) or [])
    if not rates or not kinds:
        return 0.0
    total = 0.0
    for kind in kinds:
        if kind in rates:
            ended = seq_len / rates[kind] / 2  # the mean over queries of (i + 1) // rate
            total += min(text.index_topk, ended) if kind == "compressed_sparse_attention" else ended
    return total / len(kinds)


def add_gathers(est, cluster, w, sizes, collective_time) -> None:
    """Add one layer's indexer keys and compressed entries to `est` (cost.py's Estimate for Workload `w`
    on `cluster`, its block sizes `sizes`): collectives compute does not hide, timed by
    `collective_time(cluster, nbytes, share_inter)`, and the whole sequence's entries held for the backward."""
    if not (w.gathered or w.gathered_with_gradient):
        return
    g = cluster.gpus
    share = 0.0 if cluster.nodes == 1 else (g - cluster.gpus_per_node) / (g - 1) if g > 1 else 0.0
    for nbytes in gather_bytes(
        g, sizes.n, w.batch, w.gathered, w.gathered_with_gradient, sizes.dtype_bytes, w.forward_only
    ):
        t, inter, intra = collective_time(cluster, nbytes, share)
        est.comm_s, est.exposed_comm_s, est.wall_s = est.comm_s + t, est.exposed_comm_s + t, est.wall_s + t
        est.inter_node_bytes_per_device += inter
        est.intra_node_bytes_per_device += intra
    held = w.layers * w.seq_len * w.batch * (w.gathered + w.gathered_with_gradient)  # numbers, every layer
    est.mem_bytes_per_device += held * sizes.dtype_bytes


def indexer_macs(config, seq_len: int) -> float:
    """Multiply-adds of the indexers' scoring per query, averaged over the layers: index heads x
    index_head_dim per scored key; DeepSeek-V3.2's indexer scores the (on average N / 2) earlier
    tokens on every layer, DeepSeek-V4's CSA indexer the (N / 8) ended entries on its CSA layers."""
    text = _text_config(config)
    if not getattr(text, "index_topk", None):
        return 0.0
    per_key = getattr(text, "index_n_heads", 0) * getattr(text, "index_head_dim", 0)
    rates = getattr(text, "compress_rates", None)
    if not rates:
        return per_key * seq_len / 2
    kinds = list(getattr(text, "layer_types", None) or [])
    csa = sum(k == "compressed_sparse_attention" for k in kinds) / max(1, len(kinds))
    return csa * per_key * seq_len / rates["compressed_sparse_attention"] / 2


def gather_bytes(
    world: int,
    local_tokens: float,
    batch: int,
    plain: float,
    with_gradient: float,
    dtype_bytes: int,
    forward_only: bool,
) -> tuple[float, float]:
    """(forward, backward) bytes one rank sends per layer: its share of the gathered numbers to each
    of world - 1 peers, and in the backward an all-reduce of the gathered entries' gradients
    (2 (world - 1) / world of the whole gathered tensor)."""
    if world == 1:
        return 0.0, 0.0
    per_rank = local_tokens * batch * dtype_bytes
    forward = (world - 1) * per_rank * (plain + with_gradient)
    backward = 0.0 if forward_only else 2 * (world - 1) * per_rank * with_gradient
    return forward, backward


WINDOWED_KINDS = ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention")


def windowed_layers(config) -> tuple[int | None, float]:
    """(sliding window in keys per query, share of the layers that have it) of a transformers text
    config: every layer when the config lists no layer kinds (Mistral), the sliding ones otherwise
    (DeepSeek-V4's compressed layers keep a window too); (None, 1.0) without a window."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None, 1.0
    kinds = list(getattr(config, "layer_types", None) or [])
    if not kinds:
        return int(window), 1.0
    share = sum(k in WINDOWED_KINDS for k in kinds) / len(kinds)
    return (int(window), share) if share else (None, 1.0)
