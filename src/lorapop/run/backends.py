"""Logging backends fed from the metrics row: TensorBoard and Weights & Biases.

Both log the same numbers, `flat_metrics(row)`: one metrics.jsonl row as
`{"member/T0/valid_rate": 0.5, "role/student/solve_rate": 0.25, "programs/code_o/loc": 4.0,
"phase/proposal": 1.5, "tokens_per_s": 120.0, ...}`. Identifiers (slot, role, individual) are
not metrics and are left out; the run's config goes in as hyperparameters.
"""

from __future__ import annotations

import json
import secrets
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path
from statistics import fmean
from typing import Any

#: Member keys that name things rather than measure them.
NOT_METRICS = frozenset({"slot", "role", "individual"})


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def flat_metrics(row: Mapping[str, Any]) -> dict[str, float]:
    """Every number of a metrics row under a slash-separated tag, plus means per role."""
    out: dict[str, float] = {}
    by_role: dict[tuple[str, str], list[float]] = defaultdict(list)
    for name, m in row.get("members", {}).items():
        for k, v in m.items():
            if k not in NOT_METRICS and _number(v):
                out[f"member/{name}/{k}"] = float(v)
                by_role[(m.get("role", "member"), k)].append(float(v))
    for (role, k), vals in sorted(by_role.items()):
        out[f"role/{role}/{k}"] = fmean(vals)
    for t, m in row.get("programs", {}).items():
        out.update({f"programs/{t}/{k}": float(v) for k, v in m.items() if _number(v)})
    for m in row.get("matchups", []):
        if _number(m.get("solve_rate")):
            out[f"matchup/{m['teacher']}-{m['student']}/solve_rate"] = float(m["solve_rate"])
    out.update({f"phase/{k}": float(v) for k, v in row.get("phase_s", {}).items()})
    for ph, t in row.get("generation", {}).items():
        out.update({f"generation/{ph}/{k}": float(v) for k, v in t.items() if _number(v)})
    for k in ("tokens_per_s", "generated_tokens"):
        if _number(row.get(k)):
            out[k] = float(row[k])
    out["replacements"] = float(len(row.get("replacements", [])))
    d = row.get("difficulty") or {}  # the fixed solver's solve rate (`cfg.difficulty`)
    if _number(d.get("solve_rate")):
        out["difficulty/solve_rate"] = float(d["solve_rate"])
    for group in ("by_teacher", "by_type"):
        out.update({f"difficulty/{k}/solve_rate": float(v)
                    for k, v in (d.get(group) or {}).items() if _number(v)})
    return out


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config as `{"lora.rank": 8, ...}`; lists and None become text (hparam values
    must be numbers, booleans or strings)."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flat_config(v, key + "."))
        elif isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = json.dumps(v)
    return out


class TensorBoardLog:
    """Scalars of each row (`flat_metrics`), and the config as hyperparameters with the
    per-role means as their metrics (written with the first row, when their names are known)."""

    def __init__(self, log_dir: str | Path, config: Mapping[str, Any] | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise RuntimeError(
                "run.tensorboard needs the tensorboard package: pip install 'lorapop[tensorboard]'"
            ) from e
        self.writer = SummaryWriter(str(log_dir))
        self.hparams = flat_config(config or {})
        self._hparams_written = not self.hparams

    def __call__(self, row: Mapping[str, Any]) -> None:
        step = row["step"]
        flat = flat_metrics(row)
        if not self._hparams_written:
            self._write_hparams([k for k in flat if k.startswith("role/")])
        for tag, v in flat.items():
            self.writer.add_scalar(tag, v, step)
        self.writer.flush()

    def _write_hparams(self, metric_tags: list[str]) -> None:
        from torch.utils.tensorboard.summary import hparams

        # the metric values come from the scalars of the same tags, as TensorBoard's HParams
        # dashboard reads them; no placeholder values are written
        for summary in hparams(self.hparams, dict.fromkeys(metric_tags, 0.0)):
            self.writer.file_writer.add_summary(summary)
        self._hparams_written = True

    def close(self) -> None:
        self.writer.close()


class WandbLog:
    """Weights & Biases: the config, and each row's `flat_metrics` at its step.

    The run's id is kept in RUN_DIR/wandb_id, so `--resume` continues the same W&B run.
    `WANDB_MODE=offline` logs to RUN_DIR/wandb without a network (`wandb sync` uploads later).
    """

    def __init__(self, run_dir: str | Path, config: Mapping[str, Any], project: str,
                 entity: str | None = None, group: str | None = None, name: str | None = None,
                 job_type: str | None = None) -> None:
        """`group` holds a population and its baseline together (`job_type` tells them
        apart); `name` defaults to the run directory's name."""
        try:
            import wandb
        except ImportError as e:
            raise RuntimeError(
                "run.wandb needs the wandb package: pip install 'lorapop[wandb]'"
            ) from e
        run_dir = Path(run_dir)
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
        id_file.write_text(run_id)
        self.wandb = wandb
        self.run = wandb.init(project=project, entity=entity, group=group, job_type=job_type,
                              name=name or run_dir.name, id=run_id, resume="allow",
                              dir=str(run_dir), config=dict(config))

    def __call__(self, row: Mapping[str, Any]) -> None:
        self.run.log(flat_metrics(row), step=row["step"])

    def close(self) -> None:
        self.run.finish()
