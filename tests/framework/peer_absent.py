"""A variant module that declares a peer package no machine has (tests/framework/test_requirements.py)."""

from impl.kernels.gdn.torch_ops import gated_rmsnorm  # noqa: F401  (the variant's function)

REQUIRES = ("no_such_package_for_certify_tests",)
