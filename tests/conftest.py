import os
import sys

import torch

# Triton kernels run on CPU tensors under the interpreter where no GPU is present; this must be set before
# any @triton.jit kernel is defined (the launchers are imported lazily, after this).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
