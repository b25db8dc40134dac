"""Ahead-of-time compile check: every `base` preset's train step partitions
for a 4-way fsdp x 2-way tensor mesh, from shapes alone.

Nothing is allocated or run (`train.lower_train_step` on ShapeDtypeStructs),
so a sharding rule, a logical constraint or an optimizer state that does
not fit the mesh fails here in seconds rather than on a pod. Layers are
scanned and the batch is 8 rows at the preset's own sequence length, to
keep the compiles short; experiments/memory/ compiles the full batches.
"""

import jax
import numpy as np
import pytest
from conftest import load_config

from pretrain_lm import sharding, train
from pretrain_lm.convert import hf
from pretrain_lm.data import tokenizer as tokenizer_lib

# The base-sized preset of every family that has one (GPT-2 small is its
# BERT-base-sized model).
PRESETS = [
  ('bert', 'size=base'),
  ('roberta', 'size=base'),
  ('albert', 'size=base'),
  ('electra', 'size=base'),
  ('gpt', 'size=small'),
  ('t5', 'size=base'),
  ('bart', 'size=base'),
]
# Partitioning is done before the backend compiles; skipping LLVM's costly
# optimisations halves the CPU compile time and checks the same thing.
FAST_COMPILE = {
  'xla_backend_optimization_level': 0,
  'xla_llvm_disable_expensive_passes': True,
}


@pytest.fixture(scope='module')
def tokenizer(tmp_path_factory):
  """Feature shapes do not depend on the tokenizer: any small one will do."""
  return tokenizer_lib.train_tokenizer(
    ['The quick brown fox jumps over the lazy dog.\n'],
    str(tmp_path_factory.mktemp('tok') / 'chars.json'),
    vocab_size=64,
    model_type='char',
  )


@pytest.mark.parametrize('name, arg', PRESETS, ids=[n for n, _ in PRESETS])
def test_base_preset_compiles_for_fsdp_x_tensor_mesh(name, arg, tokenizer):
  c = load_config(name, arg)
  c.data.batch_size = 8
  c.model.scan_layers = True
  mesh = sharding.make_mesh({'data': 1, 'fsdp': 4, 'tensor': 2})
  spec = hf.batch_spec(c, tokenizer)
  batch = {
    k: jax.ShapeDtypeStruct((c.data.batch_size, *shape), np.dtype(dtype))
    for k, (shape, dtype) in spec.items()
  }
  lowered = train.lower_train_step(c, mesh, batch)
  compiled = lowered.compile(FAST_COMPILE)
  memory = compiled.memory_analysis()
  # The state really is split: each device holds about 1/8 of the params
  # and AdamW moments (3 x 4 bytes per parameter), not all of them.
  state_bytes = sum(
    int(np.prod(s.shape)) * s.dtype.itemsize
    for s in jax.tree.leaves(lowered.args_info[0][0])
  )
  assert memory.argument_size_in_bytes < state_bytes / 4
