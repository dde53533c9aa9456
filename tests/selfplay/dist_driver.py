"""Train a few steps and save what each step sampled and decided (run by the dist tests, under
torchrun or alone): `python dist_driver.py OUT_DIR STEPS key=value...`. With STOP_RANK1_AT=N
in the environment, rank 1 alone asks for a stop after step N (as a signal to one rank does)."""

import os
import sys
from pathlib import Path

import torch

from lorapop import dist
from lorapop.config import load_config
from lorapop.selfplay.loop import SelfPlay, Stopped

CONFIG = Path(__file__).parents[2] / "configs" / "tiny.yaml"


def outcomes(sp: SelfPlay, steps: int) -> dict:
    """Train `steps` steps; per step every proposal and answer (tokens, text, verdict,
    reward), the ratings and the replacements; at the end the adapter weights."""
    seen = []
    update = sp.update

    def spy(pairs, proposals, validities, attempts):
        done = update(pairs, proposals, validities, attempts)
        seen.append({
            "pairs": list(pairs),
            "proposals": [(p.teacher, p.type, p.rollout.token_ids, p.rollout.text, v.valid,
                           v.reason, reward)
                          for p, v, reward in zip(proposals, validities, done.teacher_rewards,
                                                  strict=True)],
            "answers": [(a.teacher, a.student, a.task.key, a.own, a.rollout.token_ids,
                         a.grade.outcome.value, reward)
                        for a, reward in zip(attempts, done.student_rewards, strict=True)],
        })
        return done

    def logged(row):
        seen[-1]["ratings"] = {m: (v.get("mu"), v.get("sigma")) for m, v in row["members"].items()}
        seen[-1]["replacements"] = row["replacements"]
        if sp.world.rank == 1 and str(sp.step_done) == os.environ.get("STOP_RANK1_AT"):
            sp.request_stop("a signal to rank 1")

    sp.update = spy
    stopped = None
    try:
        sp.run(steps, on_step=logged)  # checkpoints as `lorapop train` does
    except Stopped:
        stopped = sp.step_done
    return {"steps": seen, "weights": sp.parts.bank.weights.detach().cpu().clone(),
            "stopped_after": stopped}


def main() -> None:
    out, steps, overrides = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
    cfg = load_config(CONFIG, overrides)
    world = dist.init(cfg.model.device)
    sp = SelfPlay(cfg, out, world=world)
    try:
        result = outcomes(sp, steps)
        if world.distributed:  # the fingerprint check must catch one drifted weight
            if world.rank == 1:
                sp.parts.bank.weights[2, 7] += 1e-3
            try:
                sp.check_ranks("after a drift")
            except dist.DivergenceError as e:
                result["divergence"] = str(e)
    finally:
        sp.close()
        dist.close(world)
    if world.main:
        torch.save(result, out / "outcomes.pt")


if __name__ == "__main__":
    main()
