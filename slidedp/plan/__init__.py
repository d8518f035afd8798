"""The planner beside the runtime: what a SlideDP run needs and how fast it goes, before anything
is allocated, and the configuration it should run with.

  memory.py       device bytes per mode (the start-up check, recipes/preflight.py, uses it)
"""
