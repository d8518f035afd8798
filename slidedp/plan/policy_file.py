"""AutoPolicy's choice as a TOML file: one [slidedp] table that `slidedp.policy_file` loads
into a later run (recipes/config.py puts its keys in place of the configuration's), with what
was measured in comments. The per-block policies are written as `activation` +
`activation_blocks` (slidedp/activations/policy.py's format_blocks), so they read back into the
same policies."""

import json
from collections import Counter
from pathlib import Path

from slidedp.activations import ActivationPolicy, format_blocks, parse_policy

POLICY_FILE_NAME = "slidedp_policy.toml"
"""What AutoPolicy writes into job.dump_folder."""

KEYS = ("delivery", "reduction", "window_slots", "chunk_mib", "bf16_shadow", "gpu_state_blocks",
        "embedding_update", "activation", "activation_blocks", "keep_blocks")
"""The [slidedp] keys a policy file sets."""


def activation_keys(policies: list[ActivationPolicy]) -> dict:
    """The [slidedp] keys of per-block policies: the most common one as `activation`, the
    others as `activation_blocks` over it."""
    default = Counter(policies).most_common(1)[0][0]
    return {"activation": default.name, "activation_blocks": format_blocks(policies, default),
            "keep_blocks": 0}


def policy_settings(*, delivery: str, reduction: str, window_slots: int, chunk_mib: float,
                    bf16_shadow: bool, gpu_state_blocks: int, embedding_update: str,
                    policies: list[ActivationPolicy]) -> dict:
    """The [slidedp] keys for a choice."""
    return {"delivery": delivery, "reduction": reduction, "window_slots": window_slots,
            "chunk_mib": float(chunk_mib), "bf16_shadow": bf16_shadow,
            "gpu_state_blocks": gpu_state_blocks, "embedding_update": embedding_update,
            **activation_keys(policies)}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's


def write_policy_file(path: str | Path, settings: dict, *, comments: list[str]) -> None:
    """Write `settings` (policy_settings' keys) as a [slidedp] table, atomically."""
    unknown = set(settings) - set(KEYS)
    if unknown:
        raise ValueError(f"not policy keys: {sorted(unknown)}")
    lines = [f"# {c}" for c in comments] + ["[slidedp]"]
    lines += [f"{key} = {_toml_value(settings[key])}" for key in KEYS if key in settings]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(path)


def parse_candidates(text: str, *, key: str = "slidedp.autopolicy_candidates") -> list[ActivationPolicy]:
    """Comma-separated policies (one line naming `key` if one is not a policy)."""
    return [parse_policy(t, key=key) for t in (p.strip() for p in text.split(",")) if t]
