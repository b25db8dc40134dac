"""Sampling and beam search against plain-Python reference decoders."""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pretrain_lm.models import decoding


class Toy:
  """A toy LM whose logits depend on the last token and on the cache.

  logits(prefix) = a[last token] + b[sum(prefix) % V]. The sum comes from a
  [N, L] cache of every token fed so far, written at `index` like a real
  key/value cache, so beam search matches the references only if it repeats
  and reorders the cache rows correctly. A 0-d leaf counts the calls.
  """

  def __init__(self, vocab, seed, eos_id=None, eos_bias=0.0, max_len=16):
    rng = np.random.default_rng(seed)
    self.vocab, self.max_len = vocab, max_len
    self.a_VV = 1.5 * rng.normal(size=(vocab, vocab)).astype(np.float32)
    self.b_VV = 1.5 * rng.normal(size=(vocab, vocab)).astype(np.float32)
    if eos_id is not None:
      self.a_VV[:, eos_id] += eos_bias

  def ref_logits(self, prefix):
    """The next token's logits after `prefix`, in float64 numpy."""
    a, b = self.a_VV.astype(np.float64), self.b_VV.astype(np.float64)
    return a[prefix[-1]] + b[sum(prefix) % self.vocab]

  def ref_logp(self, prefix):
    z = self.ref_logits(prefix)
    return z - np.log(np.exp(z - z.max()).sum()) - z.max()

  def cache(self, prompts_BP):
    hist_BL = np.zeros((len(prompts_BP), self.max_len), np.int32)
    hist_BL[:, : prompts_BP.shape[1]] = prompts_BP
    return {'hist': jnp.asarray(hist_BL), 'calls': jnp.int32(0)}

  def step_fn(self, ids_N, cache, index):
    assert cache['calls'].shape == ()  # The shared leaf is never repeated.
    hist_NL = cache['hist'].at[:, index].set(ids_N)
    sum_N = hist_NL.sum(axis=-1) % self.vocab
    logits_NV = jnp.asarray(self.a_VV)[ids_N] + jnp.asarray(self.b_VV)[sum_N]
    return logits_NV, {'hist': hist_NL, 'calls': cache['calls'] + 1}


# The arrays are arguments, not constants: XLA would spend seconds constant
# folding a loop over closed-over inputs. Traced alpha, eos_id and pad_id
# share one compilation across the parametrised cases.
jit_sample = jax.jit(
  decoding.sample,
  static_argnames=(
    'step_fn',
    'num_steps',
    'temperature',
    'top_k',
    'top_p',
    'eos_id',
  ),
)
jit_beam_search = jax.jit(
  decoding.beam_search, static_argnames=('step_fn', 'num_steps', 'beam_size')
)


@functools.cache
def toy(**kw) -> Toy:
  """One instance per setting, so jit caches keyed on its step_fn hit."""
  return Toy(**kw)


def prompts(batch, vocab, length=2, seed=0):
  """Distinct prompts (prompt_BP, first_ids_B) for `batch` rows."""
  ids = np.random.default_rng(seed).integers(0, vocab, (batch, length + 1))
  return ids[:, :length].astype(np.int32), ids[:, length].astype(np.int32)


def ref_greedy(model, prefix, num_steps, eos_id=None, pad_id=0):
  prefix, out = list(prefix), []
  for _ in range(num_steps):
    if eos_id is not None and eos_id in out:
      out.append(pad_id)
    else:
      out.append(int(np.argmax(model.ref_logits(prefix))))
      prefix.append(out[-1])
  return out


def ref_probs(logits, temperature, top_k, top_p):
  """The renormalised top-k / nucleus distribution, built by counting up."""
  z = np.asarray(logits, np.float64) / temperature
  order = np.argsort(-z, kind='stable')
  if top_k:
    order = order[:top_k]
  p = np.exp(z[order] - z[order].max())
  p /= p.sum()
  # The smallest head of the sorted list whose mass reaches top_p.
  size = next(m for m in range(1, len(p) + 1) if p[:m].sum() >= top_p - 1e-12)
  probs = np.zeros_like(z)
  probs[order[:size]] = p[:size] / p[:size].sum()
  return probs


def penalty(length, alpha):
  return ((5.0 + length) / 6.0) ** alpha


def score(model, prefix, seq, alpha):
  lp = sum(
    model.ref_logp(list(prefix) + list(seq[:t]))[v] for t, v in enumerate(seq)
  )
  return lp / penalty(len(seq), alpha)


def ref_beam_exhaustive(model, prefix, num_steps, eos_id, alpha, width):
  """The `width` best of all hypotheses: cut at the first EOS, or full."""
  hyps = set()
  for seq in itertools.product(range(model.vocab), repeat=num_steps):
    hyps.add(seq[: seq.index(eos_id) + 1] if eos_id in seq else seq)
  scored = sorted(
    ((score(model, prefix, s, alpha), s) for s in hyps), reverse=True
  )
  # The test is only well posed if no near-ties decide membership or order.
  gaps = -np.diff([s for s, _ in scored[: width + 1]])
  assert gaps.min() > 1e-4
  return scored[:width]


def ref_beam(model, prefix, num_steps, eos_id, alpha, width):
  """Textbook beam search with T5X's rule: EOS candidates among the 2W best."""
  live, finished = [((), 0.0)], []
  for t in range(num_steps):
    cands = []
    for seq, lp in live:
      logp = model.ref_logp(list(prefix) + list(seq))
      cands += [(seq + (v,), lp + logp[v]) for v in range(model.vocab)]
    cands = sorted(cands, key=lambda c: -c[1])[: 2 * width]
    finished += [
      (lp / penalty(t + 1, alpha), s) for s, lp in cands if s[-1] == eos_id
    ]
    live = [(s, lp) for s, lp in cands if s[-1] != eos_id][:width]
  finished += [(lp / penalty(num_steps, alpha), s) for s, lp in live]
  return sorted(finished, reverse=True)[:width]


def pad(seq, num_steps, pad_id):
  return list(seq) + [pad_id] * (num_steps - len(seq))


def check_beams(ids_BWT, scores_BW, refs, num_steps, pad_id):
  for b, ref in enumerate(refs):
    want_ids = [pad(s, num_steps, pad_id) for _, s in ref]
    np.testing.assert_array_equal(ids_BWT[b], want_ids)
    np.testing.assert_allclose(
      scores_BW[b], [s for s, _ in ref], rtol=1e-5, atol=1e-5
    )


def test_greedy_and_top_k_1_match_argmax_loop():
  vocab, batch, steps, eos, pad_id = 7, 6, 8, 4, -1
  model = toy(vocab=vocab, seed=1, eos_id=eos, eos_bias=0.5)
  prompt_BP, first_B = prompts(batch, vocab, length=3)
  run = functools.partial(
    decoding.sample,
    model.step_fn,
    model.cache(prompt_BP),
    first_B,
    3,
    num_steps=steps,
    eos_id=eos,
    pad_id=pad_id,
  )
  want = [
    ref_greedy(model, [*prompt_BP[b], first_B[b]], steps, eos, pad_id)
    for b in range(batch)
  ]
  assert run(rng=None, temperature=0.0).tolist() == want
  # The only token left after top-k=1 is the argmax, whatever the key.
  sampled_BT = run(rng=jax.random.key(3), temperature=1.3, top_k=1)
  assert sampled_BT.tolist() == want
  # Rows that end early and rows that do not are both covered.
  assert 0 < sum(eos in row for row in want) < batch


@pytest.mark.parametrize(
  'temperature, top_k, top_p',
  [(1.0, 3, 1.0), (0.7, 0, 0.5), (1.5, 5, 0.7), (1.0, 0, 0.0)],
)
def test_one_step_distribution_matches_filtered(temperature, top_k, top_p):
  vocab, batch, copies, num_keys = 12, 16, 64, 16
  model = toy(vocab=vocab, seed=7)
  prompt_BP, first_B = prompts(batch, vocab, seed=5)
  # Each prompt sits in `copies` rows, which draw independently, under each
  # of `num_keys` keys (tiling rows compiles faster than vmapping keys).
  cache = model.cache(np.tile(prompt_BP, (copies, 1)))
  tokens = [
    jit_sample(
      model.step_fn,
      cache,
      np.tile(first_B, copies),
      2,
      num_steps=1,
      rng=key,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
    )
    for key in jax.random.split(jax.random.key(8), num_keys)
  ]
  tokens_SB = np.stack(tokens).reshape(num_keys * copies, batch)
  num_draws = len(tokens_SB)
  for b in range(batch):
    logits = model.ref_logits([*prompt_BP[b], first_B[b]])
    probs = ref_probs(logits, temperature, top_k, top_p)
    counts = np.bincount(tokens_SB[:, b], minlength=vocab)
    # Every sample lies in the top-k / nucleus set.
    assert counts[probs == 0].sum() == 0
    # Chi-square over the kept tokens, pooling those expected < 5 times.
    want, got = num_draws * probs[probs > 0], counts[probs > 0]
    small = want < 5
    want = np.append(want[~small], want[small].sum())
    got = np.append(got[~small], got[small].sum())
    want, got = want[want > 0], got[want > 0]
    chi2 = ((got - want) ** 2 / want).sum()
    dof = max(len(want) - 1, 1)
    # About 6 standard deviations of a chi-square with `dof` degrees.
    assert chi2 < dof + 6 * np.sqrt(2 * dof), (b, chi2, dof)


def test_sampled_eos_pads_the_rest_and_stops_early():
  vocab, batch, steps, eos, pad_id = 8, 16, 30, 2, -1
  model = toy(vocab=vocab, seed=9, eos_id=eos, eos_bias=4.0)
  prompt_BP, first_B = prompts(batch, vocab, seed=10)
  calls = []

  def counting_step_fn(ids_N, cache, index):
    jax.debug.callback(lambda: calls.append(1))
    return model.step_fn(ids_N, cache, index)

  out_BT = jit_sample(
    counting_step_fn,
    model.cache(prompt_BP),
    first_B,
    2,
    num_steps=steps,
    rng=jax.random.key(11),
    eos_id=eos,
    pad_id=pad_id,
  )
  ends = []
  for row in np.asarray(out_BT):
    assert eos in row
    end = row.tolist().index(eos)
    assert (row[end + 1 :] == pad_id).all()
    assert (row[:end] != pad_id).all() and (row[:end] != eos).all()
    ends.append(end)
  assert len(set(ends)) > 1  # Rows finish at different steps.
  # The loop stops at the step where the last row finishes.
  assert len(calls) == max(ends) + 1 < steps


@pytest.mark.parametrize('alpha', [0.0, 0.6, 2.0])
@pytest.mark.parametrize('width', [9, 16])
def test_beam_search_equals_exhaustive_search(alpha, width):
  # With W >= 9 = 3^2 live prefixes nothing is ever pruned from 4 tokens
  # with one EOS in 3 steps, so the W best hypotheses are exact.
  vocab, batch, steps, eos = 4, 3, 3, 1
  model = toy(vocab=vocab, seed=12, eos_id=eos, eos_bias=1.0)
  prompt_BP, first_B = prompts(batch, vocab, seed=13)
  ids_BWT, scores_BW = jit_beam_search(
    model.step_fn,
    model.cache(prompt_BP),
    first_B,
    2,
    num_steps=steps,
    beam_size=width,
    eos_id=eos,
    alpha=alpha,
    pad_id=0,
  )
  assert ids_BWT.shape == (batch, width, steps)
  assert ids_BWT.dtype == jnp.int32 and scores_BW.dtype == jnp.float32
  refs = [
    ref_beam_exhaustive(
      model, [*prompt_BP[b], first_B[b]], steps, eos, alpha, width
    )
    for b in range(batch)
  ]
  check_beams(ids_BWT, scores_BW, refs, steps, pad_id=0)
  # Both EOS-terminated and truncated hypotheses are among the answers.
  lengths = {len(s) for ref in refs for _, s in ref}
  assert len(lengths) > 1 and steps in lengths


def test_beam_search_needs_the_cache_reorder(monkeypatch):
  vocab, batch, steps, eos, width = 4, 3, 3, 1, 9
  model = toy(vocab=vocab, seed=12, eos_id=eos, eos_bias=1.0)
  prompt_BP, first_B = prompts(batch, vocab, seed=13)
  # Skip the reorder: beams then read their siblings' token history.
  monkeypatch.setattr(decoding, 'gather_rows', lambda tree, rows_N: tree)
  ids_BWT, _ = decoding.beam_search(
    model.step_fn,
    model.cache(prompt_BP),
    first_B,
    2,
    num_steps=steps,
    beam_size=width,
    eos_id=eos,
    alpha=0.6,
  )
  refs = [
    ref_beam_exhaustive(model, [*prompt_BP[b], first_B[b]], steps, eos, 0.6, 9)
    for b in range(batch)
  ]
  want_BWT = [[pad(s, steps, 0) for _, s in ref] for ref in refs]
  assert not np.array_equal(ids_BWT, want_BWT)


@pytest.mark.parametrize('alpha', [0.0, 0.6, 1.5])
@pytest.mark.parametrize('width', [2, 3])
def test_small_beams_match_reference_beam_search(alpha, width):
  vocab, batch, steps, eos = 6, 4, 5, 0
  model = toy(vocab=vocab, seed=14, eos_id=eos, eos_bias=0.5)
  prompt_BP, first_B = prompts(batch, vocab, seed=15)
  ids_BWT, scores_BW = jit_beam_search(
    model.step_fn,
    model.cache(prompt_BP),
    first_B,
    2,
    num_steps=steps,
    beam_size=width,
    eos_id=eos,
    alpha=alpha,
    pad_id=vocab,
  )
  refs = [
    ref_beam(model, [*prompt_BP[b], first_B[b]], steps, eos, alpha, width)
    for b in range(batch)
  ]
  check_beams(ids_BWT, scores_BW, refs, steps, pad_id=vocab)


def test_beam_search_stops_early_when_finished_beat_live():
  vocab, batch, steps, eos, width = 6, 2, 10, 3, 2
  # EOS is 30 nats more likely than anything else: after two steps W
  # finished hypotheses exist and every live beam is hopeless.
  model = toy(vocab=vocab, seed=16, eos_id=eos, eos_bias=30.0)
  prompt_BP, first_B = prompts(batch, vocab, seed=17)
  calls = []

  def counting_step_fn(ids_N, cache, index):
    jax.debug.callback(lambda: calls.append(1))
    return model.step_fn(ids_N, cache, index)

  ids_BWT, scores_BW = jit_beam_search(
    counting_step_fn,
    model.cache(prompt_BP),
    first_B,
    2,
    num_steps=steps,
    beam_size=width,
    eos_id=eos,
  )
  assert len(calls) == 2
  refs = [
    ref_beam(model, [*prompt_BP[b], first_B[b]], steps, eos, 0.6, width)
    for b in range(batch)
  ]
  check_beams(ids_BWT, scores_BW, refs, steps, pad_id=0)


def test_unreachable_slots_are_padded():
  # One step over 3 tokens gives 3 hypotheses; the 4th slot stays empty.
  model = toy(vocab=3, seed=18, eos_id=0)
  prompt_BP, first_B = prompts(2, 3, seed=19)
  ids_BWT, scores_BW = jit_beam_search(
    model.step_fn,
    model.cache(prompt_BP),
    first_B,
    2,
    num_steps=1,
    beam_size=4,
    eos_id=0,
    pad_id=7,
  )
  assert np.isfinite(scores_BW[:, :3]).all()
  assert np.isneginf(scores_BW[:, 3]).all()
  assert (ids_BWT[:, 3] == 7).all()


def test_decoding_under_jit():
  vocab, batch, steps, eos = 6, 3, 5, 0
  model = toy(vocab=vocab, seed=20, eos_id=eos, eos_bias=0.5)
  prompt_BP, first_B = prompts(batch, vocab, seed=21)
  # Everything but the options is traced, start_index included.
  sample_fn = jax.jit(
    lambda cache, first, start: decoding.sample(
      model.step_fn,
      cache,
      first,
      start,
      num_steps=steps,
      rng=None,
      temperature=0.0,
      eos_id=eos,
    )
  )
  beam_fn = jax.jit(
    lambda cache, first, start: decoding.beam_search(
      model.step_fn,
      cache,
      first,
      start,
      num_steps=steps,
      beam_size=3,
      eos_id=eos,
      alpha=0.6,
    )
  )
  args = (model.cache(prompt_BP), jnp.asarray(first_B), jnp.int32(2))
  prefixes = [[*prompt_BP[b], first_B[b]] for b in range(batch)]
  assert sample_fn(*args).tolist() == [
    ref_greedy(model, prefix, steps, eos) for prefix in prefixes
  ]
  ids_BWT, scores_BW = beam_fn(*args)
  refs = [ref_beam(model, prefix, steps, eos, 0.6, 3) for prefix in prefixes]
  check_beams(ids_BWT, scores_BW, refs, steps, pad_id=0)


class RestrictedToy:
  """The reference for a Toy under decoding.restrict_vocab: -inf logits."""

  def __init__(self, model, allowed_V):
    self.model, self.allowed_V, self.vocab = model, allowed_V, model.vocab

  def ref_logits(self, prefix):
    return np.where(self.allowed_V, self.model.ref_logits(prefix), -np.inf)

  def ref_logp(self, prefix):
    z = self.ref_logits(prefix)
    return z - z.max() - np.log(np.exp(z - z.max()).sum())


def test_restrict_vocab_keeps_every_rule_off_banned_ids():
  vocab, batch, steps, eos = 10, 4, 5, 0
  model = toy(vocab=vocab, seed=22, eos_id=eos, eos_bias=0.5)
  prompt_BP, first_B = prompts(batch, vocab, seed=23)
  prefixes = [[*prompt_BP[b], first_B[b]] for b in range(batch)]
  # The ids the unrestricted greedy search picks first are banned.
  first_picks = {ref_greedy(model, p, 1)[0] for p in prefixes} - {eos}
  allowed_V = np.ones(vocab, bool)
  allowed_V[sorted(first_picks)[:3]] = False
  banned = np.flatnonzero(~allowed_V)
  ref = RestrictedToy(model, allowed_V)
  step_fn = decoding.restrict_vocab(model.step_fn, allowed_V)
  cache = model.cache(prompt_BP)

  greedy_BT = decoding.sample(
    step_fn, cache, first_B, 2, num_steps=steps, rng=None, temperature=0.0
  )
  assert greedy_BT.tolist() == [ref_greedy(ref, p, steps) for p in prefixes]
  for top_k, top_p in [(0, 1.0), (vocab, 0.95)]:
    sampled_BT = decoding.sample(
      step_fn,
      model.cache(np.tile(prompt_BP, (16, 1))),
      np.tile(first_B, 16),
      2,
      num_steps=steps,
      rng=jax.random.key(24),
      temperature=2.0,
      top_k=top_k,
      top_p=top_p,
    )
    assert not np.isin(sampled_BT, banned).any()
  ids_BWT, scores_BW = decoding.beam_search(
    step_fn, cache, first_B, 2, num_steps=steps, beam_size=3, eos_id=eos
  )
  refs = [ref_beam(ref, p, steps, eos, 0.6, 3) for p in prefixes]
  check_beams(ids_BWT, scores_BW, refs, steps, pad_id=0)
  assert not np.isin(ids_BWT, banned).any()
