"""The job's trained-token count on the syncer: what each learner process has been credited by
merges, and what its accepted pushes report beyond that.

Each push carries its process's cumulative trained tokens, so a token is credited by the first
merge of any fragment that follows it, exactly once: the token budget and every learner's
learning-rate position (core/schedule.py JobProgress) read these numbers. No arrays here: the
global model (syncer/global_model.py) keeps Θ, this keeps the count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from diloco.checkpoint import process_key
from diloco.core.rounds import Contribution


@dataclass
class TokenCredits:
    # Trained tokens already credited per learner process ("learner/session"); their sum over
    # the job is the global model's `tokens_merged`.
    credited: dict[str, int] = field(default_factory=dict)
    # Per learner process, its newest accepted push's cumulative trained tokens (not
    # checkpointed: a restarted syncer learns them again from the next pushes), and the sum of
    # what they carry beyond `credited`, kept up to date instead of summed over every process
    # the job ever had on each publish.
    reported: dict[str, int] = field(default_factory=dict, compare=False, repr=False)
    _unmerged: int = field(default=0, init=False, compare=False, repr=False)

    def report(self, key: str, session_tokens: int) -> None:
        """An accepted push of process `key` ("learner/session") says it has trained this many."""
        if session_tokens > self.reported.get(key, 0):
            before = self._beyond_credit(key, self.reported.get(key, 0))
            self._unmerged += self._beyond_credit(key, session_tokens) - before
            self.reported[key] = session_tokens

    def known(self, key: str) -> int:
        """A learner process's trained tokens as far as this syncer has taken them (credited in a
        merge, or reported by an accepted push)."""
        return max(self.credited.get(key, 0), self.reported.get(key, 0))

    def unmerged(self) -> int:
        """What accepted pushes carry beyond their process's credit: the job's trained tokens
        are those merged plus these."""
        return self._unmerged

    def _beyond_credit(self, key: str, tokens: int) -> int:
        return max(0, tokens - self.credited.get(key, 0))

    def reported_by(self, learner: str) -> int:
        """Trained tokens every process that was `learner` reported in its newest accepted push."""
        return sum(v for k, v in self.reported.items() if k.rpartition("/")[0] == learner)

    def credited_to(self, learner: str) -> int:
        """Tokens credited to every process that was `learner` (where its data resumes)."""
        return sum(v for k, v in list(self.credited.items()) if k.rpartition("/")[0] == learner)

    def credit(self, contributions: Iterable[Contribution[Any]]) -> dict[str, int]:
        """A merged round's contributions: each process's new tokens credited once; by learner."""
        credits: dict[str, int] = {}
        for c in contributions:
            key = process_key(c.learner, c.session)
            credit = max(0, c.session_tokens - self.credited.get(key, 0))
            if credit:
                before = self._beyond_credit(key, self.reported.get(key, 0))
                self.credited[key] = c.session_tokens
                self._unmerged += self._beyond_credit(key, self.reported.get(key, 0)) - before
                credits[c.learner] = credits.get(c.learner, 0) + credit
        return credits

    @classmethod
    def from_meta(cls, meta: Mapping[str, object]) -> TokenCredits:
        """The credits a checkpoint kept (its `credited`), refusing malformed values."""
        credited = meta.get("credited", {})
        if not isinstance(credited, dict) or any(
                not isinstance(k, str) or not isinstance(v, int) or v < 0 for k, v in credited.items()):
            raise ValueError("checkpoint credited is malformed")
        return cls(credited=dict(credited))
