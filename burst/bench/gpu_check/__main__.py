"""`python -m burst.bench.gpu_check DIR [--budget SECONDS]` (what scripts/gpu_check.sh runs)."""

import sys

from .launch import main

sys.exit(main())
