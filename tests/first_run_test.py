"""A quiet first run: TensorFlow's start-up notices go, real errors stay."""

import os
import subprocess
import sys

from conftest import COMPILE_FLAGS, REPO

from pretrain_lm import tensorflow_setup

# Lines TensorFlow 2.21's shared libraries print while loading on a machine
# without a CUDA driver (copied from such a run).
NOTICES = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1796191878.498497    4139 port.cc:153] oneDNN custom operations are on. You may see slightly different numerical results due to floating-point round-off errors from different computation orders. To turn them off, set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.
I0000 00:00:1796191878.499550    4139 cudart_stub.cc:31] Could not find cuda drivers on your machine, GPU will not be used.
E0000 00:00:1796191879.430704    4139 cuda_platform.cc:52] failed call to cuInit: INTERNAL: CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)
I0000 00:00:1796191909.177050    4529 cpu_feature_guard.cc:227] This TensorFlow binary is optimized to use available CPU instructions in performance-critical operations.
To enable the following instructions: AVX2 AVX512F FMA, in other operations, rebuild TensorFlow with the appropriate compiler flags.
"""  # noqa: E501
REAL = (
  'E0000 00:00:1796191882.960585    4139 kernel.cc:7] Op failed: bad shape\n'
  'UserWarning: a warning of the project\n'
)


def clean_env(**extra):
  """The environment of a newcomer's shell: no TF or JAX settings."""
  env = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(('TF_', 'JAX_', 'XLA_'))
  }
  return {**env, 'XLA_FLAGS': COMPILE_FLAGS, **extra}


def run_python(code: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, '-c', code],
    cwd=REPO,
    env=clean_env(),
    capture_output=True,
    text=True,
    timeout=300,
    check=True,
  )


def test_filter_drops_notices_and_keeps_the_rest():
  assert tensorflow_setup.filter_notices(NOTICES) == ''
  assert tensorflow_setup.filter_notices(NOTICES + REAL) == REAL


def test_importing_tensorflow_prints_nothing_and_hides_gpus():
  result = run_python(
    'import pretrain_lm.data.pipeline\n'
    'import tensorflow as tf, tensorflow_text\n'
    "print(tf.config.get_visible_devices('GPU'))"
  )
  assert result.stderr == ''
  assert result.stdout.strip() == '[]'


def test_other_lines_written_while_importing_still_show():
  # What a library writes to file descriptor 2 during the wrapped import,
  # C++ (os.write) or Python, is replayed unless it is a known notice.
  result = run_python(
    'import os, sys\n'
    'from pretrain_lm import tensorflow_setup\n'
    'with tensorflow_setup._stderr_filtered():\n'
    f'  os.write(2, {NOTICES.encode()!r})\n'
    f'  os.write(2, {REAL.splitlines(keepends=True)[0].encode()!r})\n'
    f'  print({REAL.splitlines()[1]!r}, file=sys.stderr)\n'
  )
  assert result.stderr == REAL


def test_training_and_loading_print_no_library_lines(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      '-m',
      'pretrain_lm.main',
      '--config=configs/bert.py:size=tiny',
      f'--workdir={tmp_path}',
      '--config.train.num_steps=2',
      '--config.train.log_every=1',
    ],
    cwd=REPO,
    env=clean_env(),
    capture_output=True,
    text=True,
    timeout=600,
    check=True,
  )
  assert result.stderr == '', result.stderr
  assert result.stdout.startswith('step 1: '), result.stdout
  # In a notebook: no TensorFlow, Orbax or absl lines either.
  loaded = run_python(
    f'import pretrain_lm\nprint(pretrain_lm.load({str(tmp_path)!r}).step)'
  )
  assert loaded.stderr == '', loaded.stderr
  assert loaded.stdout.strip() == '2'
