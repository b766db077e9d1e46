"""The typed async hand-off (issue 24.4): a request's finalize steps are ``Finalization``s
(``finalize(error)``, ``abort()``) or plain callables, as Megatron-Core's requests hold."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from shardstore import CheckpointingException
from shardstore.execution.save import SaveFinalization
from shardstore.strategies.async_utils import AsyncCallsQueue, AsyncRequest, Finalization


@dataclass
class Recorded:
    """A Finalization that records what it was given."""

    checkpoint: str = "/ckpt/recorded"
    calls: list = field(default_factory=list)

    def finalize(self, error: BaseException | None) -> None:
        self.calls.append(("finalize", error))

    def abort(self) -> None:
        self.calls.append(("abort",))


def test_shardstores_finalization_is_typed_and_a_plain_callable_is_not() -> None:
    staged = SimpleNamespace(location=SimpleNamespace(describe=lambda: "/ckpt/a"))
    assert isinstance(SaveFinalization(staged), Finalization)
    assert isinstance(Recorded(), Finalization)
    assert not isinstance(lambda: None, Finalization)


def test_a_finalization_gets_the_background_error_and_a_plain_callable_is_refused_it() -> None:
    step, plain_calls = Recorded(), []
    failing = AsyncRequest(async_fn=lambda: 1 / 0, finalize_fns=[step])
    failing.execute_sync()
    assert step.calls[0][0] == "finalize" and isinstance(step.calls[0][1], ZeroDivisionError)
    with pytest.raises(CheckpointingException, match="Async checkpoint save failed"):
        AsyncRequest(async_fn=lambda: 1 / 0, finalize_fns=[lambda: plain_calls.append(1)]).execute_sync()
    assert plain_calls == []


def test_closing_a_queue_with_abort_aborts_typed_steps_only() -> None:
    step, plain_calls = Recorded(), []
    queue = AsyncCallsQueue()
    queue.schedule_async_request(AsyncRequest(async_fn=None, finalize_fns=[step, lambda: plain_calls.append(1)]))
    queue.close(abort=True)
    assert step.calls == [("abort",)] and plain_calls == []
