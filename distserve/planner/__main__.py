"""`python -m distserve.planner ...`: the same as `distserve plan ...`."""

import sys

from distserve.planner.plan_cli import main

sys.exit(main())
