"""One run's command: a built-in launcher's argv, or a rendered template.

A --launcher template names placeholders ({name}, {job}, {workdir},
{command}, {args}); each value is shell-quoted for where it stands in the
template (unquoted, inside '...' or inside "..."), so paths with spaces or
quotes reach the run intact. pretrain_lm/sweep/__init__.py documents them.
"""

import hashlib
import os
import re
import shlex
import sys
from typing import Any

from pretrain_lm.sweep.spec import SweepError

# The checkout, whose launch/ scripts the built-in launchers run.
REPO = os.path.dirname(
  os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
LAUNCHERS = ('local', 'tpu_pod', 'slurm')
# What a --launcher template may name; see the package docstring.
PLACEHOLDERS = ('name', 'job', 'workdir', 'command', 'args')

Command = list[str] | str  # an argv, or a line for the shell


def load_template(launcher: str) -> str | None:
  """The command template --launcher names, or None for a built-in launcher.

  Raises SweepError for a value that is neither, or a template that names an
  unknown placeholder, has unbalanced quotes or passes no flags to the run.
  """
  if launcher in LAUNCHERS:
    return None
  if os.path.isfile(launcher):
    with open(launcher) as f:
      lines = [ln for ln in f.read().splitlines() if not ln.startswith('#')]
    template = '\n'.join(lines).strip()
  elif '{' in launcher:
    template = launcher
  else:
    raise SweepError(
      f'--launcher={launcher!r}: not one of {list(LAUNCHERS)}, a file, or a '
      f'command template with placeholders {{{"}, {".join(PLACEHOLDERS)}}}.'
    )
  fields = _template_fields(template)
  if not {'command', 'args'} & set(fields):
    raise SweepError(
      f'--launcher template {template!r} passes no flags to the run: it '
      'needs {command} or {args}.'
    )
  return template


def job_name(name: str) -> str:
  """A run name as Kubernetes names jobs: [a-z0-9-], a letter first, <= 39."""
  slug = re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')
  if not slug[:1].isalpha():
    slug = f'r-{slug}'.rstrip('-')
  digest = hashlib.sha1(name.encode()).hexdigest()[:6]
  return f'{slug[:32].rstrip("-")}-{digest}'


def _template_parts(template: str):
  """Yields (literal text, None) and (field, quote context) pieces.

  The context is '' outside quotes, "'" or '"' inside them, as a POSIX shell
  reads the template.
  """
  quote, i, text = '', 0, []
  while i < len(template):
    c = template[i]
    pair = template[i : i + 2]
    if pair in ('{{', '}}'):
      text.append(c)
      i += 2
      continue
    if c == '{':
      end = template.find('}', i)
      if end < 0:
        raise SweepError(f'--launcher template: unclosed {{ in {template!r}.')
      yield ''.join(text), None
      text = []
      yield template[i + 1 : end], quote
      i = end + 1
      continue
    if c == '}':
      raise SweepError(
        f"--launcher template: single '}}' in {template!r} (write '}}}}')."
      )
    if c == '\\' and quote != "'":
      text.append(template[i : i + 2])
      i += 2
      continue
    if c in '\'"' and quote in ('', c):
      quote = '' if quote else c
    text.append(c)
    i += 1
  if quote:
    raise SweepError(f'--launcher template: unclosed {quote} in {template!r}.')
  yield ''.join(text), None


def _template_fields(template: str) -> list[str]:
  fields = [f for f, q in _template_parts(template) if q is not None]
  unknown = sorted(set(fields) - set(PLACEHOLDERS))
  if unknown:
    raise SweepError(
      f'--launcher template names {unknown}; placeholders: '
      f'{", ".join("{" + p + "}" for p in PLACEHOLDERS)}.'
    )
  return fields


def render_template(template: str, values: dict[str, Any]) -> str:
  """The template with each placeholder quoted for where it stands.

  `values` maps a placeholder to a string (one word) or, for 'command' and
  'args', to an argv list. Outside quotes a value becomes shell words;
  inside quotes, the text a shell given the quoted string will read back as
  those words.
  """
  out = []
  for part, quote in _template_parts(template):
    if quote is None:
      out.append(part)
      continue
    value = values[part]
    if part == 'command':
      line = shlex.join(value)
      words = shlex.quote(line)  # one word: the whole command line
    elif part == 'args':
      line = words = shlex.join(value)
    else:
      line = words = shlex.quote(value)
    if quote == "'":
      out.append(line.replace("'", "'\\''"))
    elif quote == '"':
      out.append(re.sub(r'([\\"$`])', r'\\\1', line))
    else:
      out.append(words)
  return ''.join(out)


def launch_command(
  launcher: str,
  argv: list[str],
  name: str,
  launcher_args: list[str],
  template: str | None = None,
) -> Command:
  """The argv (built-in launchers) or shell line (a template) of one run."""
  if template is not None:
    workdir = next(a for a in argv if a.startswith('--workdir='))
    return render_template(
      template,
      dict(
        name=name,
        job=job_name(name),
        workdir=workdir.split('=', 1)[1],
        command=['python', '-m', 'pretrain_lm.main', *argv],
        args=argv,
      ),
    )
  if launcher == 'local':
    return [sys.executable, '-m', 'pretrain_lm.main', *argv]
  if launcher == 'tpu_pod':
    script = os.path.join(REPO, 'launch', 'tpu_pod.sh')
    return [script, 'run', *launcher_args, *argv]
  script = os.path.join(REPO, 'launch', 'slurm.sbatch')
  return ['sbatch', f'--job-name={name}', *launcher_args, script, *argv]


def show(cmd: Command) -> str:
  """A command as one line, as a shell would read it."""
  return cmd if isinstance(cmd, str) else shlex.join(cmd)
