"""Loads an exported module and calls it: `export_loader.py BLOB import|no-import`.

Run by tests/test_export.py in a fresh process, to show what the loading side
needs: with "import" it imports jax_tiled first, which registers the FFI
targets that the exported module (a (b, k) @ (k, n) matmul) calls; with
"no-import" it does not, and the call fails.
"""

import sys

import numpy as np
from jax import export

if sys.argv[2] == "import":
    import jax_tiled  # noqa: F401  (registers the FFI targets the exported module calls)

loaded = export.deserialize(bytearray(open(sys.argv[1], "rb").read()))
x = np.arange(15, dtype=np.float32).reshape(5, 3) / 7
w = np.arange(6, dtype=np.float32).reshape(3, 2) - 2
out = loaded.call(x, w)
np.testing.assert_allclose(out, x @ w, rtol=1e-6)
print("loaded and called:", out.shape)
