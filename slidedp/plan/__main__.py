"""`python -m slidedp.plan CONFIG [--section.key=value ...]` (slidedp/plan/cli.py)."""

import sys

from slidedp.plan.cli import plan_main

if __name__ == "__main__":
    sys.exit(plan_main(sys.argv[1:]))
