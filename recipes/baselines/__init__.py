"""The peers SlideDP is compared with, run the way their users run them on our model code and
data: `single` and torch FSDP2 (eager.py; activation checkpointing none / full / selective in
activation_checkpoint.py; FSDP2 optionally with CPUOffloadPolicy) and DeepSpeed ZeRO-Offload
(zero_offload.py)."""
