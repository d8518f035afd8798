"""The planner beside the runtime: what a SlideDP run needs and how fast it goes, before anything
is allocated, and the configuration it should run with (docs/DESIGN.md §9).

  memory.py       SlideDP's device bytes, and the activation model every mode's estimate uses
                  (the start-up check, recipes/preflight.py; the baselines' part:
                  recipes/baselines/memory.py)
  rates.py        a machine's rates (one JSON file; rates/*.json ship some), the probe's cache
  link.py         an inter-node link's rates (rates/links/*.json ship some): several nodes
  probe.py        measures them on this machine; triad.py: the STREAM triad it uses
  workload.py     GPU seconds and activation bytes of a step's uses, by policy
  simulate.py     tasks on lanes and shared capacities (a fluid discrete-event simulation)
  steptime.py     the step as the engine runs it, simulated: time, busy, exposed, demands, verdict
  predict.py      a run's plan: memory by part and the predicted step; report.py prints it
  ilp.py          AutoPolicy's integer program (pulp)
  search.py       AutoPolicy's search: the model, screen, program, calibration
  live.py         AutoPolicy live: the staged, measured run of the search on the engine (the
                  offline one, --search, from the model alone: report.py)
  policy_file.py  its choice as a TOML file that slidedp.policy_file loads
"""
