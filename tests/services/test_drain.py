"""The joint policy's "starting to stop" for decode (`drain_before_scale_down`): the replica
Serve will stop is marked draining first and the scale-down waits for its streams to move."""

from __future__ import annotations

from flashpd.services.autoscaling.policy import WorkerLoad
from flashpd.services.drain import drain_before_scale_down

BUSY = WorkerLoad(running=5.0, draining=True)
DRAINED = WorkerLoad(running=0.0, waiting=0.0, draining=True)


class Marks:
    def __init__(self, ok: bool = True) -> None:
        self.marked: list[str] = []
        self.unmarked: list[str] = []
        self.ok = ok

    def mark(self, w: str) -> bool:
        self.marked.append(w)
        return self.ok

    def unmark(self, w: str) -> bool:
        self.unmarked.append(w)
        return True


def step(marks: Marks, want, target, replicas, loads, state, now):
    return drain_before_scale_down(
        want, target, replicas, loads, state, now, mark=marks.mark, unmark=marks.unmark, timeout_s=60.0
    )


def test_scale_down_marks_the_newest_replica_and_waits_until_it_drained():
    marks, state = Marks(), {}
    _, state, _ = step(marks, 3, 3, ["a", "b"], {}, state, now=0.0)  # a and b seen at 0
    target, state, note = step(marks, 2, 3, ["a", "b", "c"], {}, state, now=10.0)
    assert target == 3 and marks.marked == ["c"] and "waits for c" in note  # c: newest
    target, state, _ = step(marks, 2, 3, ["a", "b", "c"], {"c": BUSY}, state, now=20.0)
    assert target == 3 and marks.marked == ["c"]  # marked once, still moving streams
    target, state, note = step(marks, 2, 3, ["a", "b", "c"], {"c": DRAINED}, state, now=30.0)
    assert target == 2 and "c drained" in note


def test_a_drain_that_does_not_finish_lowers_the_target_at_the_timeout():
    marks, state = Marks(), {}
    _, state, _ = step(marks, 1, 2, ["a", "b"], {}, state, now=0.0)
    target, state, _ = step(marks, 1, 2, ["a", "b"], {"b": BUSY}, state, now=59.0)
    assert target == 2
    target, state, _ = step(marks, 1, 2, ["a", "b"], {"b": BUSY}, state, now=60.0)
    assert target == 1


def test_a_failed_mark_holds_the_scale_down_and_is_retried():
    marks, state = Marks(ok=False), {}
    target, state, note = step(marks, 1, 2, ["a", "b"], {}, state, now=0.0)
    assert target == 2 and "failed" in note
    marks.ok = True
    target, state, _ = step(marks, 1, 2, ["a", "b"], {}, state, now=1.0)
    assert target == 2 and marks.marked == ["b", "b"] and state["victim"] == "b"


def test_a_victim_serve_did_not_stop_is_unmarked_and_serves_again():
    marks, state = Marks(), {}
    _, state, _ = step(marks, 1, 2, ["a", "b"], {}, state, now=0.0)
    target, state, _ = step(marks, 1, 2, ["a", "b"], {"b": DRAINED}, state, now=5.0)
    assert target == 1
    _, state, _ = step(marks, 1, 1, ["b"], {"b": DRAINED}, state, now=30.0)  # Serve stopped a
    assert marks.unmarked == []
    _, state, _ = step(marks, 1, 1, ["b"], {"b": DRAINED}, state, now=65.0)
    assert marks.unmarked == ["b"]


def test_no_scale_down_leaves_the_target_alone():
    marks = Marks()
    assert step(marks, 3, 2, ["a", "b"], {}, {}, now=0.0)[0] == 3
    assert step(marks, 1, 1, ["a"], {}, {}, now=0.0)[0] == 1
    assert marks.marked == []
