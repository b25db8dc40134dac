"""Speed against the hardware limit and a peer: python -m pretrain_lm.bench.

PEER_PACKAGES is what `make` installs into `<venv>/peer` for the peer
(bench/peer.py): transformers dropped Flax in version 5, so the peer needs
the last 4.x release and the tokenizers and huggingface-hub it pins, kept
out of the venv's own site-packages.
"""

PEER_PACKAGES = (
  'transformers==4.46.3',
  'tokenizers==0.20.3',
  'huggingface-hub==0.26.5',
)
