"""A step's proposals and answers in one continuous batch (`sampling.overlap`).

Run one after the other, the proposal phase ends in a tail: a few long proposals decode at a
small batch while every answer waits for the last of them. Here the proposals decode in one
`generate` call whose `Feed` is an `AnswerFeed`: each proposal that finishes is verified on
the sandbox's workers in a thread of its own (the sandbox runs jobs in worker processes, so
the GPU keeps decoding), and the answers to each valid one join the batch as soon as its
verdict is in. Once every proposal is verified the valid tasks enter the buffers, the
answers filled from the buffer are added, and the decoder re-sizes its cache to the answers'
(`Decoder.run`). An answer's key is its (pair, task, n) alone (`answer_key`), the same
whichever way the phases run, so each row's samples are those of the phases in turn.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

from lorapop.engine.generate import Generation, Prompt
from lorapop.tasks.task import Task, Validity


@dataclass(frozen=True)
class AnswerAsk:
    """One answer to write: who asks whom, the task and its prompt, the row's key."""

    teacher: str
    student: str
    task: Task
    own: bool  # the teacher's own task of this step (False: filled from the buffer)
    prompt: str
    key: int


def answer_key(pair: int, task: int, n: int, proposals: int, answers: int) -> int:
    """The sample key of answer `n` of pair `pair` to task `task`: a proposal's index for the
    step's own tasks, `proposals` + j for the j-th filled from the buffer."""
    return (pair * 2 * proposals + task) * answers + n


class AnswerFeed:
    """`generate`'s feed for the proposals' call: verifies proposals as they finish and adds
    the answers to their valid tasks; `times` records when the last proposal finished
    (`proposals`) and when the last verdict was in (`verified`), `verdicts` the verdicts.

    `verify(proposals by index)` gives their verdicts (run in a worker thread, one batch at a
    time); `answers_of(index, verdict)` the answers to one proposal's task, in the step's
    order; `all_answers(verdicts)`, called once with every verdict, admits the tasks and gives
    the step's answers in order (own and filled); `slot(student)` a member's adapter slot.
    """

    def __init__(self, proposals: int, verify: Callable[[dict[int, Generation]], dict[int, Validity]],
                 answers_of: Callable[[int, Validity], list[AnswerAsk]],
                 all_answers: Callable[[dict[int, Validity]], list[AnswerAsk]],
                 slot: Callable[[str], int], seed: int, max_new_tokens: int) -> None:
        self.proposals, self.verify, self.answers_of = proposals, verify, answers_of
        self.all_answers, self.slot, self.seed = all_answers, slot, seed
        self.max_new_tokens = max_new_tokens
        self.finished = 0
        self.verdicts: dict[int, Validity] = {}
        self.asks: list[AnswerAsk] | None = None  # the step's answers, once all are verified
        self.fed: list[int] = []  # keys of the answers added, in order
        self.times: dict[str, float] = {}
        self._pending: list[Future[dict[int, Validity]]] = []
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="verify")

    def __call__(self, done: dict[int, Generation], block: bool) -> list[Prompt] | None:
        if self.asks is not None:
            return None
        mine = {i: g for i, g in done.items() if i < self.proposals}
        if mine:
            self.finished += len(mine)
            self._pending.append(self._pool.submit(self.verify, mine))
            if self.finished == self.proposals:
                self.times["proposals"] = time.perf_counter()
        new: list[AnswerAsk] = []
        while True:
            for f in [f for f in self._pending if f.done()]:
                self._pending.remove(f)
                for i, v in sorted(f.result().items()):
                    self.verdicts[i] = v
                    new += self.answers_of(i, v)
            if len(self.verdicts) == self.proposals:
                self.times["verified"] = time.perf_counter()
                self._pool.shutdown()
                self.asks = self.all_answers(self.verdicts)
                have = set(self.fed) | {a.key for a in new}
                new += [a for a in self.asks if a.key not in have]
                break
            if new or not block:
                break
            if not self._pending:
                raise RuntimeError("the answer feed was asked to wait with no proposal left "
                                   "to verify")
            wait(self._pending, return_when=FIRST_COMPLETED)
        self.fed += [a.key for a in new]
        return [Prompt(a.prompt, self.slot(a.student), self.max_new_tokens, self.seed, a.key)
                for a in new]

    def close(self) -> None:
        """Stop the verification thread (after an error: pending verdicts are dropped)."""
        self._pool.shutdown(cancel_futures=True)
