"""The launch of several ranks on this host (run_train.sh runs it for NGPU >= 2 or NNODES >= 2):

    python -m recipes.launch NPROC [--section.key=value ...]

With NNODES >= 2 in the environment this host is one node of several (torchrun's node group):
NODE_RANK, MASTER_ADDR and MASTER_PORT name it and the rendezvous (torchrun's static
rendezvous), or RDZV_ENDPOINT=host:port does (c10d rendezvous, which numbers the nodes itself).

It checks the whole configuration once (recipes/preflight.py, data records included), so a
mistake is one `error:` line before any rank starts, then runs torchrun's launcher in this
process (torch.distributed.run), where it sees how the ranks ended. Ranks that refused an input
(exit code 2) or stopped at a Ctrl-C (130, recipes/interrupt.py) printed their line already: the
launch exits with their code and adds nothing. Any other failure gets torchrun's summary (which
rank, its exit code or signal) and exit code 1. torchrun's own log lines (the signals it
forwards, each rank's exit) are not shown: those outcomes say it all.
"""

import logging
import os
import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from recipes.config import ConfigError
from recipes.interrupt import EXIT_CODE
from recipes.preflight import MULTI_RANK_MODE, check_launch

RANK_SAID_WHY = (2, EXIT_CODE)
"""Exit codes of ranks that printed their own one line (rank 0)."""

SHUTDOWN_TIMEOUT_S = "1800"
"""How long torchrun lets the ranks take to end after it forwards a Ctrl-C, before it kills them:
its default, 30 s, can be shorter than the step or two they still make and a save of a large
model. They end as soon as their save is complete, and a second Ctrl-C ends them at once.
TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets another; torch releases that do not read it keep 30 s."""


def rendezvous_args(env: dict[str, str]) -> list[str]:
    """torchrun's rendezvous flags for the nodes `env` describes (NNODES, NODE_RANK,
    MASTER_ADDR, MASTER_PORT or RDZV_ENDPOINT); one node: --standalone."""
    nnodes = int(env.get("NNODES", "1"))
    if nnodes == 1:
        return ["--standalone"]
    if env.get("RDZV_ENDPOINT"):
        return [f"--nnodes={nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={env['RDZV_ENDPOINT']}",
                f"--rdzv-id={env.get('RDZV_ID', 'slidedp')}"]
    missing = [k for k in ("NODE_RANK", "MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(f"NNODES={nnodes} needs {', '.join(missing)} (or RDZV_ENDPOINT=host:port)")
    node_rank = env["NODE_RANK"]
    if not node_rank.isdigit() or int(node_rank) >= nnodes:
        raise ConfigError(f"NODE_RANK must be 0 to {nnodes - 1} for NNODES={nnodes}, got {node_rank!r}")
    return [f"--nnodes={nnodes}", f"--node-rank={node_rank}",
            f"--master-addr={env['MASTER_ADDR']}", f"--master-port={env['MASTER_PORT']}"]


def launch(nproc: int, flags: list[str]) -> int:
    """Start `nproc` ranks of recipes.train with `flags` on this node (torchrun); returns the
    launch's exit code."""
    try:
        rendezvous = rendezvous_args(dict(os.environ))
        nodes = int(os.environ.get("NNODES", "1"))
        added = check_launch(flags, nproc=nproc, nodes=nodes)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if added:
        print(f'notice: parallelism.mode = "single" runs one process; {nproc * nodes} ranks run '
              f'"{MULTI_RANK_MODE}" (set --parallelism.mode to choose)', file=sys.stderr)
    # torchrun's loggers set their own levels, so the threshold is the process's: this process
    # logs nothing else.
    logging.disable(logging.ERROR)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    try:
        run(parse_args([*rendezvous, f"--nproc_per_node={nproc}", "-m", "recipes.train",
                        *flags, *added]))
    except ChildFailedError as e:
        _, first = e.get_first_failure()
        if first.exitcode in RANK_SAID_WHY:
            return first.exitcode
        print(e.format_msg(), file=sys.stderr)
        return 1
    except SignalException as e:  # torchrun forwarded it to the ranks, and they have ended
        return 128 + e.sigval
    return 0


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit():
        print("usage: python -m recipes.launch NPROC [--section.key=value ...]", file=sys.stderr)
        return 2
    try:
        return launch(int(argv[0]), argv[1:])
    except KeyboardInterrupt:  # before torchrun handles SIGINT: no rank has started
        return EXIT_CODE


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
