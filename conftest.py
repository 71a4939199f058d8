"""Root pytest wiring: the certification plugins (cells, gates) and the hypothesis profiles.

`HYPOTHESIS_PROFILE=thorough pytest ...` runs the property tests with many more examples; the default
`ci` profile is fast, deterministic (derandomized) and has no deadline (two shared CPU cores jitter).
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=25,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

pytest_plugins = ["certify.pytest_plugin", "certify.gating.plugin"]
