"""SlideDP: host-resident layer streaming with synchronous data parallelism.

  config.py       the [slidedp] TOML section
  layout.py       units, flat offsets and per-rank shards of the host state
  host_state.py   the shared-memory FP32 master + Adam moments (FP32, BF16 or 8-bit; + BF16 shadow)
  delivery.py     host->GPU parameter routes (replicated | sharded)
  update.py       GPU->host gradient routes (gpu | cpu reduction) and the CPU AdamW
  update_order.py which returned gradient's update runs next (one place decides the order)
  collectives.py  the routes' all-gather / reduce-scatter under this torch's names
  cpu_adam.py     the C++ fused AdamW and gradient-sum kernels (csrc/), torch fallback
  native_build.py compiling csrc/ once per machine into a shared cache
  affinity.py     pinning a rank's threads to its share of the cores (slidedp.pin_threads)
  speculative.py  updates that run before the step's norm is known, redone if it clips
  schedule.py     the plan as plain data: which unit uses which GPU buffer, which deliveries,
                  which activation offloads and prefetches
  activations/    per-block activation policies (keep, recompute, segment masks, op-level saves,
                  offload fractions), their measured costs, the offload to host memory
  streams.py      CUDA streams/events that are no-ops on the CPU
  traffic.py      per-step byte counters of each route
  state_file.py   per-rank shards of master + moments as stored, for resuming
  holds.py        where a step's returned gradients wait for their updates, one object per hold
  gradient_flow.py the update thread's gradient returns, holds, updates and their settling
  block_runner.py the compute walk of a micro-batch through the GPU window, fed by deliveries
  step_metrics.py the build's phases, the threads' host times and the update tail, per step
  state_io.py     the host state's weights in and out (first fill, by name, saved shards)
  rank_groups.py  a backend's process groups, made and ended in the same order on every rank
  host_memory.py  the refusal to start without the host memory a run needs
  engine.py       the streamed training step (TrainBackend): its parts built and driven
"""

# Imported before any process group exists (every entry point imports this package first):
# torch.distributed.nn.functional binds the default group as its functions' default argument on
# first import, and torch imports it lazily (torch._dynamo, e.g. for a meta-device module's init).
# After init_process_group that keeps the default group alive past destroy_process_group(), so
# its gloo threads run into interpreter exit, where one that drops a finished collective's
# tensors needs the GIL and aborts the process ("terminate called without an active exception").
import torch.distributed.nn.functional  # noqa: E402, F401
