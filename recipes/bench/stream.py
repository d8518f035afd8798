"""STREAM triad on the host (slidedp/plan/triad.py), the attainable memory bandwidth a CPU
update is measured against.

    python -m recipes.bench.stream --threads 1,2,4,8,16
"""

import argparse

from slidedp.plan.triad import default_elements, triad_gbs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", default="1", help="comma-separated thread counts")
    parser.add_argument("--elements", type=int, default=0,
                        help="elements per array (0: 4x the last-level caches)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    elements = args.elements or default_elements()
    print(f"STREAM triad, 3 x {elements * 8 / 2**20:.0f} MiB FP64 arrays")
    for threads in (int(t) for t in args.threads.split(",")):
        gbs = triad_gbs(elements=elements, threads=threads, repeats=args.repeats)
        print(f"{threads:3d} threads: {gbs:7.1f} GB/s")


if __name__ == "__main__":
    main()
