import sys

from bole_jax.serving.cli import main

sys.exit(main())
