"""The markdown table of bench rows (recipes/bench/throughput.py's JSONL), with each row's
throughput against the compute-only reference and FSDP2's peak.

    python -m recipes.bench.report RUNS.jsonl [RUNS.jsonl ...]
"""

from recipes.bench.rows import read_rows, row_files


def system_name(row: dict) -> str:
    """The system a row measured, as tables name it: the mode with its variant and label."""
    name = row["mode"]
    if row.get("runtime") not in (None, "slidedp"):  # a peer re-implemented on SlideDP
        name = f"{row['runtime']}-style"
    if row.get("fsdp_cpu_offload"):
        name += " cpu-offload"
    if row.get("zero_stage"):
        name += f" ZeRO-{row['zero_stage']}"
    if row.get("update_order") == "next_use":  # not the default slidedp.update_order
        name += " next_use"
    if row.get("embedding_update") in ("gpu", "resident"):  # not the default
        name += f" {row['embedding_update']}-embedding"
    if row.get("gpu_state_blocks"):
        name += f" gpu-state-{row['gpu_state_blocks']}"
    if row.get("pin_threads"):  # not the default
        name += " pinned"
    if row.get("speculative_update"):
        name += " speculative"
    if row.get("moments_dtype") in ("bfloat16", "8bit"):  # not the default
        name += f" {'bf16' if row['moments_dtype'] == 'bfloat16' else '8bit'}-moments"
    return name + (f" {row['label']}" if row.get("label") else "")


def report(paths: list[str]) -> str:
    """Markdown table; ratios against the compute-only reference at the same batch, seq and
    kernels (same checkpointing where both exist; an unlabelled reference row) and against the
    best FSDP2 throughput on the same kernels. Files with rows whose steps did not train are
    refused (rows.read_rows)."""
    rows = [r for path in paths for r in read_rows(path)]
    refs = {(r["flavor"], r["kernels"], r["local_batch"], r["seq"], r["ac"]): r["tokens_per_s"]
            for r in rows if r["mode"] == "reference" and not r["label"]}  # labelled: variants
    best_fsdp2: dict[tuple[str, str], float] = {}
    for r in rows:
        if r["mode"] == "fsdp2" and not r.get("fsdp_cpu_offload"):  # GPU-resident only
            key = (r["flavor"], r["kernels"])
            best_fsdp2[key] = max(best_fsdp2.get(key, 0.0), r["tokens_per_s"])
    lines = ["| model | kernels | system | route | activations | seq/GPU | tokens/s | TFLOP/s/GPU | MFU | peak GPU GiB (alloc/reserved) | host RSS GiB | vs reference | vs FSDP2 peak |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ac = (r["ac"] + (f"+keep{r['keep_blocks']}" if r.get("keep_blocks") else "")
              + (f" [{r['activation_blocks']}]" if r.get("activation_blocks") else ""))
        ref_ac = "full" if r["ac"] == "recompute" else ("none" if r["ac"] == "keep" else r["ac"])
        ref = refs.get((r["flavor"], r["kernels"], r["local_batch"], r["seq"], ref_ac))
        vs_ref = f"{r['tokens_per_s'] / ref:.1%}" if ref else "–"
        peak = best_fsdp2.get((r["flavor"], r["kernels"]))
        vs_fsdp = f"{r['tokens_per_s'] / peak:.3f}x" if peak else "–"
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "–"
        tflops = f"{r['tflops_per_gpu']:.0f}" if "tflops_per_gpu" in r else "–"  # CPU rows: none
        mem = (f"{r['peak_mem_alloc_gib']:.1f}/{r['peak_mem_reserved_gib']:.1f}"
               if r.get("peak_mem_alloc_gib") is not None else "–")
        accum = r.get("accum", 1)
        batch = f"{r['local_batch']} ({accum}x{r['local_batch'] // accum})" if accum > 1 else r["local_batch"]
        lines.append(f"| {r['flavor']} | {r['kernels']} | {system_name(r)} | "
                     f"{r['route']} | {ac} | {batch} | {r['tokens_per_s']:,.0f} | {tflops} | "
                     f"{mfu} | {mem} | {r['peak_rss_gib']:.1f} | {vs_ref} | {vs_fsdp} |")
    return "\n".join(lines)


def main() -> None:
    print(report(row_files(__doc__)))


if __name__ == "__main__":
    main()
