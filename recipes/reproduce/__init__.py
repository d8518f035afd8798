"""One script per experiment of the paper, each writing <name>.csv, <name>.md and <name>.png
into docs/results/<name>/ (or --out-dir), with the paper's corresponding figure beside ours:

    batch_sweep        throughput, GPU and host memory against the batch, per system
    head_to_head       SlideDP's ratio over each peer at matched batch, and their geometric mean
    routes             the four datapaths (delivery x reduction) against the batch
    scaling            GPU-count scaling, strong (fixed global batch) and weak (fixed per GPU)
    chunk_sweep        SlideDP's pipeline chunk size
    cpu_adam_scaling   the CPU Adam update against cores, beside a STREAM triad of the host
    long_context       one long sequence per step against its length
    activation_policy  activation policies against GPU memory and throughput
    moments_curve      200-step loss curves with BF16 and 8-bit host moments against FP32 ones

    python -m recipes.reproduce.<name> [--help]     # on every GPU found
    python -m recipes.reproduce.<name> --tiny       # the CPU-sized run the tests make
"""
