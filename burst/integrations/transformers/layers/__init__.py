"""The layers of a transformers model that need more than burst's attention to run split across
ranks: rotary embeddings whose frequencies depend on the sequence's length (rope.py), DeepSeek
sparse attention's indexer (indexer.py), MiniMax-M3's block indexer (block_indexer.py), and the
recurrent and convolutional sequence mixers of hybrid models (mixers/). backend/preparations.py
prepares each (the mixers: backend/features.py), beside MLA's latent (latent.py), Doge's dynamic
mask (dynamic_mask.py) and the positions some layers keep (positions.py).

Below the backend: these modules import ../keywords.py and burst's own state passing, never the
backend, generation or the training loops.
"""
