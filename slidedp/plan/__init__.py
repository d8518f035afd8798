"""The planner beside the runtime: what a SlideDP run needs and how fast it goes, before anything
is allocated, and the configuration it should run with (docs/DESIGN.md §9).

  memory.py       device bytes per mode (the start-up check, recipes/preflight.py, uses it)
  rates.py        a machine's rates (one JSON file; rates/*.json ship some), the probe's cache
  probe.py        measures them on this machine; stream.py: the STREAM triad it uses
  workload.py     GPU seconds and activation bytes of a step's uses, by policy
  simulate.py     tasks on lanes and shared capacities (a fluid discrete-event simulation)
  steptime.py     the step as the engine runs it, simulated: time, busy, exposed, demands, verdict
  predict.py      a run's plan: memory by part and the predicted step; report.py prints it
  ilp.py          AutoPolicy's integer program (pulp)
  autopolicy.py   AutoPolicy: live (staged, measured) and offline (--search)
  policy_file.py  its choice as a TOML file that slidedp.policy_file loads
"""
