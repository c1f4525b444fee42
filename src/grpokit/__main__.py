"""``python -m grpokit`` (and ``torchrun -m grpokit``) runs the command line."""

import sys

from grpokit.cli import main

sys.exit(main())
