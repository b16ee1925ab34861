"""The order a loader of a policy phase draws its items in (RL's prompts, DPO's pairs): a seeded
permutation an epoch, each epoch its own (epoch-aware seeds, as AReaL's), resumed exactly from
its state, the items a rollback blamed left out for good."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import numpy as np

from trimtab.errors import DataError


def fingerprint(items: Iterable[Any]) -> str:
    """The items' content, in order, as a digest: a checkpoint's order resumes only over the items
    it was drawn from (an index means another item in an edited file, and the items a rollback
    left out would be others)."""
    digest = hashlib.sha256()
    for item in items:
        digest.update(repr(item).encode())
    return digest.hexdigest()[:16]


class EpochOrder:
    """Draws indices 0 .. n-1; `what` names the items and `key` their config key in errors;
    `items` (their content) is checked on resume; `seeded`: the items themselves are drawn from
    the seed (train.seed: the built-in arithmetic task's problems and pairs); `split`: the key that
    holds some of a file's items out (rl.held_out, dpo.held_out), so changes the count trained on."""

    def __init__(
        self, n: int, seed: int, what: str, key: str, items: str = "", seeded: bool = False, split: str = ""
    ) -> None:
        self.n, self.seed, self.what, self.key, self.items, self.seeded = n, seed, what, key, items, seeded
        self.split = split
        self.epoch, self.cursor = 0, 0
        self.skipped: set[int] = set()
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n)

    def next(self) -> int:
        while True:
            if self.cursor == len(self._order):
                self.epoch, self.cursor = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
            self.cursor += 1
            index = int(self._order[self.cursor - 1])
            if index not in self.skipped:
                return index

    def skip(self, rows: list[int]) -> int:
        """Never draw these again (after a rollback that blamed them); how many are new."""
        keep = self.skipped | {int(r) for r in rows}
        if len(keep) >= self.n:
            raise DataError(
                f"skipping these {self.what} would leave none to train on; the {self.what} themselves are bad"
            )
        added, self.skipped = len(keep) - len(self.skipped), keep
        return added

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "seed": self.seed,
            "n_rows": self.n,
            "items": self.items,
            "skipped": sorted(self.skipped),
        }

    def load_state_dict(self, state: dict[str, Any], run: str) -> None:
        """Continue exactly where `state` was taken (`run`: the checkpoint's kind, for the error)."""
        other = state.get("n_rows") != self.n or (state.get("items") and self.items and state["items"] != self.items)
        saved = state["seed"]
        if other and self.seeded and saved != self.seed:  # the items differ because the seed does
            raise DataError(
                f"the checkpoint's {run} run drew its built-in {self.what} ({self.key}) from train.seed={saved}, "
                f"and train.seed is {self.seed} now: other {self.what}; resume with train.seed={saved} (a "
                "resumed run's order and random state are the checkpoint's whatever train.seed says)"
            )
        if state.get("n_rows") != self.n:
            # a file's count trained on is what its held-out key leaves: an edit of either changes it
            source = f"{self.key}, less the {self.split} held out," if self.split else self.key
            same = f"{self.key} and {self.split}" if self.split else self.what
            raise DataError(
                f"the checkpoint's {run} run had {state.get('n_rows')} {self.what} but {source} now has "
                f"{self.n}; resume with the same {same}"
            )
        if state.get("items") and self.items and state["items"] != self.items:  # older checkpoints: none
            raise DataError(
                f"the checkpoint's {run} run drew from other {self.what} than {self.key} holds now (as many, "
                f"but their text, order or tokenization differs); resume with the {self.what} it was trained "
                "on, or start a new run (train.init_from) from its weights"
            )
        self.seed, self.epoch, self.cursor = state["seed"], state["epoch"], state["cursor"]
        self.skipped = set(state["skipped"])
        self._order = self._permutation(self.epoch)


class Ordered:
    """A loader drawing through an EpochOrder (`order`): the loop's view of its position (epoch)
    and of the items a rollback left out (skipped, skip_rows: the loader protocol of
    data/batches.py)."""

    order: EpochOrder

    @property
    def epoch(self) -> int:
        return self.order.epoch

    @property
    def skipped(self) -> set[int]:
        return self.order.skipped

    @skipped.setter
    def skipped(self, rows: set[int]) -> None:
        self.order.skipped = rows

    def skip_rows(self, rows: list[int]) -> int:
        """Never draw these again (after a rollback that blamed them)."""
        return self.order.skip(rows)
