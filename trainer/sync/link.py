"""What the learner loop needs of its syncer, declared once (docs/ALGORITHM.md, "The learner loop").

Three classes provide it: `SyncerClient` (trainer/sync/client.py) talks to one syncer, `ShardedClient`
(trainer/sync/sharded_client.py) routes over the shards of a sharded syncer, and `MirroredClient`
(trainer/sync/mirrored.py) wraps either so that every host of a multi-host learner sees what host 0
heard. The loop never waits on the network: it queues outer gradients (`submit`) and picks up,
at step boundaries, what arrived since (`take_updates`). mypy checks each class against these
protocols (an assignment beside each class), so a method that drifts fails scripts/typecheck.sh.
This module imports none of them: each imports it, so no import runs in a loop.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from diloco.core.ledger import Push
    from diloco.core.seed import InitialModel
    from diloco.trainer.sync.messages import JoinState, Updates


class SyncerLink(Protocol):
    """A learner's connection to the syncer: join, then a background sender and subscriber."""

    stopping: threading.Event  # the syncer refused this learner for good (a fatal answer)
    resync: threading.Event  # a push was refused as malformed: the loop starts over from the global model

    def join_with_retry(self, shapes: dict[str, tuple[int, ...]], initial: InitialModel | None = None) -> JoinState:
        """Pull the whole current global model (re-admission on a restart), retrying until admitted.
        `initial`: our Θ₀, for an unseeded syncer; None (a re-join) keeps the one given before."""
        ...

    def start(self) -> None:
        """Start the background sender and subscriber."""
        ...

    def submit(self, item: Push) -> None:
        """Queue one push (the ledger's record of it) for the sender; never blocks on the network."""
        ...

    def take_updates(self) -> Updates:
        """Everything that arrived since the last step boundary."""
        ...

    def wait_for_news(self, timeout: float) -> None:
        """Block until something arrives for the loop, or `timeout` seconds pass."""
        ...

    def flush(self, timeout: float) -> bool:
        """Wait until every queued push is answered; False if `timeout` passed first."""
        ...

    def close(self) -> None: ...

    @property
    def bytes_sent(self) -> int: ...

    @property
    def bytes_received(self) -> int: ...

    @property
    def acked_train_seconds(self) -> float:
        """The training time whose progress the syncer has accepted."""
        ...


class LearnerLink(SyncerLink, Protocol):
    """The link as the loop reads it at a step boundary: the same answer on every host of the
    learner (`MirroredClient`), so all of them break out of the loop at the same step."""

    stop_requested: bool  # host 0's SIGTERM, as of the last `take_updates`

    def clear_resync(self) -> None: ...

    def until(self, deadline: float) -> bool:
        """Whether host 0 is still before `deadline` (monotonic) and not refused."""
        ...

