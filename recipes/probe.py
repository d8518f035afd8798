"""`python -m recipes.probe CONFIG [--section.key=value ...] [--refresh] [--out FILE]`: this
machine's rates for the planner, measured and cached (slidedp/plan/probe.py); run it under
torchrun with every GPU of the host."""

import sys

from recipes.plan import probe_main

if __name__ == "__main__":
    sys.exit(probe_main(sys.argv[1:]))
