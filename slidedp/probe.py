"""`python -m slidedp.probe CONFIG [--section.key=value ...]`: this machine's rates for the
planner, measured and cached (slidedp/plan/probe.py; run it under torchrun with every GPU)."""

import sys

from slidedp.plan.cli import probe_main

if __name__ == "__main__":
    sys.exit(probe_main(sys.argv[1:]))
