import sys

from jax_tiled.bench.cli import main

sys.exit(main())
