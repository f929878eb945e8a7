"""burst as a transformers attention implementation, split by concern; the names are gathered by
the package's face (burst/integrations/transformers/__init__.py):

    registry.py      the registered names (BACKENDS), the ShardedCache whose decode step is running, and
                     whether generate() is running (inside_generate)
    checks.py        the whole-model refusals (check_config, check_backend_compatible, check_model)
    documents.py     packed documents from position_ids (cu_seqlens)
    kept_logits.py   logits_to_keep refused across ranks (the batch's, and the model's call: a pre-hook)
    preparations.py  what the features do to a model before any call (the prepares and detects)
    features.py      the model features, one entry each (FEATURES): what each prepares on a model,
                     refuses, and hands burst; prepare_features
    attention.py     register, the attention function and the mask function
    batches.py       shard_batch, check_same_batch, reduce_loss
    gradients.py     reduce_gradients, fully_shard, fsdp_reduction (FSDP2)

Each imports only the ones above it, ../keywords.py and ../layers/.
"""
