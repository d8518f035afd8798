"""recipes/reproduce/moments_curve.py end to end on the CPU (--tiny): the same tiny fine-tune with
FP32 and BF16 host moments and with FP32 ones updated speculatively, its report's numbers present
and finite, the BF16 curve close to the FP32 one and the speculative one equal to it, with the
share of its steps redone."""

import csv
import json
import math

from recipes.reproduce.moments_curve import COLUMNS
from tests.test_reproduce import run_script

# The tiny run's loss falls by about 1.0 over its 20 steps and swings from one batch to the next
# (other documents). BF16 moments (2^-9 relative rounding per moment and step) move it by a few
# 1e-4 on average and about 1e-3 at most; a broken moment path (moments lost, misscaled) makes it
# diverge. The bounds leave wide room for other CPUs' kernel paths.
MEAN_ABS_DIFF, MAX_ABS_DIFF, FINAL_REL_DIFF = 0.01, 0.05, 0.01


def test_bfloat16_moments_follow_the_float32_curve(tmp_path):
    out = tmp_path / "out"
    run_script("moments_curve", "--tiny", "--dtypes", "float32,bfloat16,float32+speculative",
               "--out-dir", str(out))
    with open(out / "moments_curve.csv") as f:
        fp32, bf16, speculative = list(csv.DictReader(f))
    assert list(fp32) == [c.key for c in COLUMNS]
    assert (fp32["moments_dtype"], bf16["moments_dtype"]) == ("float32", "bfloat16")
    numbers = ["steps", "final_loss", "nonfinite_steps", "skipped_updates", "tokens_per_s",
               "host_bytes_per_param"]
    diffs = ["final_rel_diff", "mean_abs_diff", "mean_abs_diff_last", "max_abs_diff",
             "grad_norm_rel_diff"]
    for row in fp32, bf16, speculative:
        assert all(math.isfinite(float(row[k])) for k in numbers), row
        counts = (row["steps"], row["nonfinite_steps"], row["skipped_updates"])
        assert tuple(map(int, counts)) == (20, 0, 0)
    assert all(math.isfinite(float(bf16[k])) for k in diffs), bf16
    assert float(bf16["host_bytes_per_param"]) < float(fp32["host_bytes_per_param"])
    assert 0 < float(bf16["mean_abs_diff"]) < MEAN_ABS_DIFF  # not the same run twice
    assert float(bf16["max_abs_diff"]) < MAX_ABS_DIFF
    assert abs(float(bf16["final_rel_diff"])) < FINAL_REL_DIFF
    # Speculative updates are exact: the FP32 curve step for step, whatever share was redone.
    assert float(speculative["max_abs_diff"]) == 0.0 and float(speculative["final_rel_diff"]) == 0.0
    assert 0.0 <= float(speculative["redone"]) <= 1.0 and fp32["redone"] == ""
    # Every step of both runs in runs.jsonl, the same data in both (same target tokens).
    rows = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    by_run = {run: [r for r in rows if r["run"] == run] for run in ("float32", "bfloat16")}
    assert [r["step"] for r in by_run["bfloat16"]] == list(range(1, 21))
    assert ([r["target_tokens"] for r in by_run["float32"]]
            == [r["target_tokens"] for r in by_run["bfloat16"]])
    md = (out / "moments_curve.md").read_text()
    assert "random initialisation" in md and "| bfloat16 | bfloat16 | 20 |" in md
    assert "| float32+speculative | float32 | 20 |" in md
    assert (out / "moments_curve.png").read_bytes().startswith(b"\x89PNG")
