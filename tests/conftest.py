"""Test setup: 8 fake CPU devices so sharding is exercised without hardware."""

import os

# Must happen before JAX is imported anywhere.
os.environ['XLA_FLAGS'] = (
  os.environ.get('XLA_FLAGS', '') + ' --xla_force_host_platform_device_count=8'
)
os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
os.environ['JAX_PLATFORMS'] = 'cpu'
