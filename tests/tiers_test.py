"""The test tiers: the integration tier's list names files that exist."""

import pathlib

import conftest


def test_integration_tier_names_existing_test_files():
  here = pathlib.Path(__file__).parent
  missing = sorted(n for n in conftest.INTEGRATION if not (here / n).is_file())
  assert not missing, f'tests/conftest.py INTEGRATION names {missing}'
  # Both tiers have files: the unit tier is every other *_test.py.
  unit = {p.name for p in here.glob('*_test.py')} - conftest.INTEGRATION
  assert unit and conftest.INTEGRATION
