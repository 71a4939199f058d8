"""A variant module that declares an installed package (pyyaml) as its peer
(tests/framework/test_requirements.py)."""

from impl.kernels.gdn.torch_ops import gated_rmsnorm  # noqa: F401  (the variant's function)

REQUIRES = ("yaml",)
