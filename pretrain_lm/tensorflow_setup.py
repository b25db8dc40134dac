"""TensorFlow as a quiet, CPU-only input library.

TensorFlow is only the input pipeline here: JAX owns the accelerators and their
memory. `install()` (run by `import pretrain_lm`) arranges that whenever
TensorFlow is first imported in the process, by this package or by
tensorflow_text / tensorflow_datasets:

- GPUs are hidden from it, so it never allocates accelerator memory;
- its C++ log level is WARNING-and-above filtered (`TF_CPP_MIN_LOG_LEVEL=2`),
  and its oneDNN graph rewrites, which serve model ops rather than tf.data's
  string and integer ops, are off (`TF_ENABLE_ONEDNN_OPTS=0`); both are
  defaults that the environment overrides;
- the notices its shared libraries print while loading, before TensorFlow's
  log level applies (no CUDA driver, CPU instruction sets, the failed `cuInit`
  when GPUs are hidden), are dropped. Every other line written to stderr during
  the import is passed on, so real errors and Python warnings still show.
"""

import contextlib
import importlib.abc
import importlib.util
import os
import re
import sys
import tempfile

# Start-up notices of TensorFlow's shared libraries on machines without a
# CUDA driver, or with GPUs hidden from TensorFlow. Each says what is expected.
_NOTICES = re.compile(
  r'All log messages before absl::InitializeLog\(\) is called'
  r'|cudart_stub\.cc.*Could not find cuda drivers'
  r'|cuda_platform\.cc.*failed call to cuInit'
  r'|cuda_executor\.cc.*(?:no NVIDIA GPU|CUDA_ERROR_NO_DEVICE)'
  r'|cpu_feature_guard\.cc'
  r'|^To enable the following instructions:'
  r'|port\.cc.*oneDNN custom operations are on'
)


def filter_notices(text: str) -> str:
  """`text` without the lines that are TensorFlow's start-up notices."""
  lines = text.splitlines(keepends=True)
  return ''.join(line for line in lines if not _NOTICES.search(line))


@contextlib.contextmanager
def _stderr_filtered():
  """Captures file descriptor 2 (C++ and Python), then replays it filtered."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode='w+b') as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      text = captured.read().decode('utf-8', errors='replace')
      sys.stderr.write(filter_notices(text))
      sys.stderr.flush()


class _QuietLoader(importlib.abc.Loader):
  """Runs TensorFlow's own loader with stderr filtered, then hides GPUs."""

  def __init__(self, loader):
    self._loader = loader

  def __getattr__(self, name):  # resources, get_data, ...: TF's own loader
    return getattr(self._loader, name)

  def create_module(self, spec):
    return self._loader.create_module(spec)

  def exec_module(self, module):
    with _stderr_filtered():
      self._loader.exec_module(module)
      with contextlib.suppress(RuntimeError):  # raised if TF already started
        module.config.set_visible_devices([], 'GPU')


class _TensorFlowFinder(importlib.abc.MetaPathFinder):
  """Wraps the first import of `tensorflow` in `_QuietLoader`, once."""

  def find_spec(self, name, path=None, target=None):
    if name != 'tensorflow':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.loader is not None:
      spec.loader = _QuietLoader(spec.loader)
    return spec


def install() -> None:
  """Sets TensorFlow's defaults; idempotent, and a no-op once TF is loaded."""
  os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
  os.environ.setdefault('TF_ENABLE_ONEDNN_OPTS', '0')
  if 'tensorflow' in sys.modules:
    with contextlib.suppress(RuntimeError):
      sys.modules['tensorflow'].config.set_visible_devices([], 'GPU')
    return
  if not any(isinstance(f, _TensorFlowFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _TensorFlowFinder())
