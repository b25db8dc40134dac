"""Why a checkpoint does not restore: the errors main.py reports plainly."""

import re


class RestoreError(ValueError):
  """A workdir's checkpoints cannot be resumed as asked (main: no traceback)."""


class CorruptCheckpointError(RestoreError):
  """A checkpoint's content differs from what was saved, or is unreadable."""

  def __init__(self, message: str, step: int):
    super().__init__(message)
    self.step = step


class TreeMismatchError(RestoreError):
  """The saved tree differs from the target (paths, shapes or dtypes)."""


class NoRestorableCheckpointError(RestoreError):
  """A directory holds checkpoints, but none of them restores."""


def unreadable(
  directory: str, step: int, what: str, error: Exception
) -> CorruptCheckpointError:
  """CorruptCheckpointError for an Orbax/tensorstore read failure."""
  text = str(error).strip()
  # tensorstore appends its whole spec; the cause comes before it.
  text = text.split(' [tensorstore_spec=')[0].splitlines()
  detail = text[0][:400] if text else ''
  # tensorstore names the zarr array it was opening ("params.a.b/.zarray").
  arrays = sorted(
    set(re.findall(r'"([^"/]+)/\.z', str(error)))
    | set(re.findall(r"'path': '([^'/]+)/'", str(error)))
  )
  where = (
    f' (array {", ".join(a.replace(".", "/") for a in arrays)})'
    if arrays
    else ''
  )
  return CorruptCheckpointError(
    f'Checkpoint step {step} in {directory} is unreadable: {what}'
    f'{where} could not be read: {type(error).__name__}: {detail}',
    step,
  )
