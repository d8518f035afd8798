"""The refusal to start without the host memory a run needs: the shared state and the offload
pools of the node's ranks."""

from dataclasses import replace

from protocols.model_spec import ModelArgs
from slidedp.config import SlideDPConfig
from slidedp.host_state import HostStatePlan, available_host_bytes, host_state_bytes
from slidedp.layout import StateLayout


class HostMemoryCheck:
    """Compares what a node's ranks need with what the kernel reports as available."""

    def __init__(self, layout: StateLayout, args: ModelArgs, cfg: SlideDPConfig, *,
                 grad_accum_steps: int, max_norm: float, nonfinite: str, leader: bool):
        """`cfg`: the run's [slidedp] (after its runtime style); `leader` prints the report."""
        self.layout, self.args, self.leader = layout, args, leader
        self.enforce = cfg.check_host_memory
        needs = dict(grad_accum_steps=grad_accum_steps, max_norm=max_norm, nonfinite=nonfinite)
        self.plan = HostStatePlan.for_run(cfg, **needs)
        # Whether turning the shadow off saves host memory (not when a deferred step's gradients
        # would then need a buffer of the same size).
        self._shadow_off_saves = host_state_bytes(layout, self.plan) > host_state_bytes(
            layout, HostStatePlan.for_run(replace(cfg, bf16_shadow=False), **needs))

    def check(self, *, offload_pool: int | None) -> None:
        """Refuse to start without host memory for the state and each rank's offload pool
        (None: the state alone, checked before the policies are measured on one block), and
        report both."""
        plan, ranks = self.plan, self.layout.world
        state = host_state_bytes(self.layout, plan)
        need = state + (offload_pool or 0) * ranks
        have = available_host_bytes()
        if self.leader and offload_pool is not None:
            n = self.args.num_params()
            pool = (f" + activation offload pool {offload_pool / 2**30:.2f} GiB x "
                    f"{ranks} ranks" if offload_pool else "")
            print(f"[slidedp] host state: {state / 2**30:.2f} GiB shared for {n / 1e6:,.1f}M "
                  f"params ({state / n:.1f} B/param: {plan.describe()}){pool}; "
                  f"available {have / 2**30:.2f} GiB", flush=True)
        if need > have and self.enforce:
            shadow = "turn off slidedp.bf16_shadow, " if self._shadow_off_saves else ""
            raise MemoryError(f"SlideDP needs {need / 2**30:.2f} GiB of host memory but only "
                              f"{have / 2**30:.2f} GiB is available (offload fewer activations, "
                              f"{shadow}use a smaller model, or set slidedp.check_host_memory = "
                              f"false on machines whose memory grows on demand)")
