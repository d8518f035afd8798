"""The refusal to start without the host memory a run needs: the shared state and the offload
pools of the node's ranks."""

from dataclasses import replace

from protocols.model_spec import ModelArgs
from slidedp.config import SlideDPConfig
from slidedp.host_state import HostStatePlan, available_host_bytes, host_state_bytes
from slidedp.layout import NodeShards, StateLayout


class HostMemoryCheck:
    """Compares what a node's ranks need with what the kernel reports as available."""

    def __init__(self, layout: StateLayout, args: ModelArgs, cfg: SlideDPConfig, *,
                 grad_accum_steps: int, max_norm: float, nonfinite: str, leader: bool,
                 shards: NodeShards | None = None):
        """`cfg`: the run's [slidedp] (after its runtime style); `leader` prints the report;
        `shards`: the part of the state this node holds and its ranks (default: all of it,
        every owner a local rank)."""
        self.layout, self.args, self.leader = layout, args, leader
        self.shards = shards or NodeShards(first=0, count=layout.world, world=layout.world)
        self.enforce = cfg.check_host_memory
        needs = dict(grad_accum_steps=grad_accum_steps, max_norm=max_norm, nonfinite=nonfinite)
        self.plan = HostStatePlan.for_run(cfg, **needs)
        # Whether turning the shadow off saves host memory (not when a deferred step's gradients
        # would then need a buffer of the same size).
        self._shadow_off_saves = host_state_bytes(layout, self.plan) > host_state_bytes(
            layout, HostStatePlan.for_run(replace(cfg, bf16_shadow=False), **needs))
        self._share = ("" if self.shards.whole else
                       f" (this node's {self.shards.count}/{self.shards.world} of it)")

    def check(self, *, offload_pool: int | None) -> None:
        """Refuse to start without host memory for the state and each rank's offload pool
        (None: the state alone, checked before the policies are measured on one block), and
        report both."""
        plan, ranks = self.plan, self.shards.count
        state = host_state_bytes(self.layout, plan, self.shards)
        need = state + (offload_pool or 0) * ranks
        have = available_host_bytes()
        if self.leader and offload_pool is not None:
            n = self.args.num_params()
            pool = (f" + activation offload pool {offload_pool / 2**30:.2f} GiB x "
                    f"{ranks} ranks" if offload_pool else "")
            print(f"[slidedp] host state: {state / 2**30:.2f} GiB shared{self._share} for "
                  f"{n / 1e6:,.1f}M params ({state / n:.1f} B/param: {plan.describe()}){pool}; "
                  f"available {have / 2**30:.2f} GiB", flush=True)
        if need > have and self.enforce:
            shadow = "turn off slidedp.bf16_shadow, " if self._shadow_off_saves else ""
            raise MemoryError(f"SlideDP needs {need / 2**30:.2f} GiB of host memory but only "
                              f"{have / 2**30:.2f} GiB is available (offload fewer activations, "
                              f"{shadow}use a smaller model, or set slidedp.check_host_memory = "
                              f"false on machines whose memory grows on demand)")
