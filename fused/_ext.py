"""Loads the compiled extension fused._C, which registers the schemas and C++ kernels of every op."""

import torch  # noqa: F401  (libtorch must be loaded first)

try:
    from fused import _C  # noqa: F401
except ImportError as e:  # pragma: no cover - a broken install
    raise ImportError(
        "fused._C is not built. Install with `pip install --no-build-isolation -e .` "
        f"(or `python setup.py build_ext --inplace`): {e}"
    ) from e
