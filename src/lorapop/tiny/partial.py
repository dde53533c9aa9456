"""A pretraining build's state between runs of it, so a build longer than the time a machine
is held can stop in time and go on in the next (`lorapop pretrain-tiny --stop-after`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch


class Partial:
    """A build's training state between runs of it: weights and optimizer (`state.pt`), steps
    done, their losses and the settings they were made with (`state.json`)."""

    def __init__(self, path: Path, settings: str, corpus_fingerprint: str) -> None:
        self.dir, self.settings, self.corpus = path, settings, corpus_fingerprint
        self.old = path.with_name(path.name + ".old")  # the last state while a new one moves in
        self.resumed_at: list[int] = []

    def load(self, model: torch.nn.Module, opt: torch.optim.Optimizer,
             log: Callable[[str], None] | None) -> tuple[int, list[float], float]:  # fmt: skip
        """(steps done, their losses, training seconds so far); (0, [], 0.0) without a state."""
        if not self.dir.exists() and self.old.exists():  # killed between `save`'s two renames
            self.old.rename(self.dir)
        if not (self.dir / "state.json").is_file():
            return 0, [], 0.0
        meta = json.loads((self.dir / "state.json").read_text())
        if (meta.get("settings"), meta.get("corpus")) != (self.settings, self.corpus):
            raise ValueError(f"{self.dir} holds a partial build of other settings; remove it "
                             "or build into another directory")  # fmt: skip
        state = torch.load(self.dir / "state.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        self.resumed_at = [*meta.get("resumed_at", []), meta["step"]]
        if log:
            log(f"resuming at step {meta['step']} ({self.dir})")
        return meta["step"], list(meta["losses"]), float(meta["train_s"])

    def save(self, model: torch.nn.Module, opt: torch.optim.Optimizer, losses: list[float],
             train_s: float) -> None:  # fmt: skip
        """Written to a temporary directory, then moved in: a build killed while saving keeps
        its previous state."""
        tmp = self.dir.with_name(self.dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        torch.save({"model": {k: v.cpu() for k, v in model.state_dict().items()},
                    "optimizer": opt.state_dict()}, tmp / "state.pt")  # fmt: skip
        (tmp / "state.json").write_text(json.dumps({
            "step": len(losses), "losses": losses, "train_s": train_s, "settings": self.settings,
            "corpus": self.corpus, "resumed_at": self.resumed_at}) + "\n")  # fmt: skip
        if self.dir.exists():
            self.dir.rename(self.old)
        tmp.rename(self.dir)
        shutil.rmtree(self.old, ignore_errors=True)

    def remove(self) -> None:
        for d in (self.dir, self.old):
            shutil.rmtree(d, ignore_errors=True)
