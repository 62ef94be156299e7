"""torchdata's StatefulDataLoader with DataLoader workers: each worker saves a state of its own share.

The loader asks every worker's dataset copy for ``state_dict()`` after each batch it yields (and when
it starts), keeps per worker the state of the last batch the loop received, and hands each worker its
own back on resume. A resumed loader must continue the uninterrupted stream exactly: every sample of
the epoch once, in the same batches and order, whatever the number of workers, persistent or not,
snapshot interval, rank, order, and however often the run was interrupted; and what cannot be resumed
(another number of workers, another batch layout, a worker's state loaded where a loop's belongs) is one
StateError, never a silent replay or skip. Real worker processes, a real cache.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import multiprocessing

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import datapipe
from datapipe.errors import StateError
from datapipe.testing import build_index_cache

B = 4
N = 50
pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning"),
              pytest.mark.filterwarnings("ignore:'set_vital' is deprecated:UserWarning")]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return build_index_cache(tmp_path_factory.mktemp("stateful"), N, shard_size=7)


def dataset(cache, **kwargs) -> datapipe.StreamingDataset:
    kwargs.setdefault("batch_size", B)
    return datapipe.StreamingDataset(cache, seed=3, return_index=True, **kwargs)


def loader(ds, workers: int, **kwargs) -> StatefulDataLoader:
    return StatefulDataLoader(ds, batch_size=None, num_workers=workers, **kwargs)


@contextlib.contextmanager
def refused(message: str):
    """The first batch raises StateError matching ``message`` (from a worker). A loader whose workers failed to
    start waits 5 s for each to stop when collected (torchdata's shutdown): they are stopped here instead."""
    before = set(multiprocessing.active_children())
    with pytest.raises(StateError, match=message):
        yield
    # only the workers started meanwhile (this process may have other children: a cluster of another test); torch's
    # SIGCHLD handler, still watching them for the loader's iterator, would take their ending for a crash and raise
    # in this thread: it is set aside while they are stopped
    import signal

    watching = signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    try:
        for worker in set(multiprocessing.active_children()) - before:
            worker.terminate()
            worker.join(30)
        gc.collect()
    finally:
        signal.signal(signal.SIGCHLD, watching)


def indices(batches) -> list[list[int]]:
    return [batch[-1].tolist() for batch in batches]


def uninterrupted(cache, epoch: int, **kwargs) -> list[list[int]]:
    ds = dataset(cache, **kwargs)
    ds.set_epoch(epoch)
    return indices(ds)


def read_then_save(cache, k: int, epoch: int, workers: int, state: dict | None = None, set_epoch: bool = True,
                   **kwargs) -> tuple[list[list[int]], dict]:
    """Read k batches of ``epoch`` (from ``state`` if given) with a fresh dataset and loader; their indices and the
    loader's state then. The dataset and loader are dropped after it, as a killed run's are."""
    layout = {k: kwargs.pop(k) for k in ("rank", "world_size", "order", "batch_size") if k in kwargs}
    ds = dataset(cache, **layout)
    if set_epoch:
        ds.set_epoch(epoch)
    stateful = loader(ds, workers, **kwargs)
    if state is not None:
        stateful.load_state_dict(state)
    it = iter(stateful)
    got = [next(it)[-1].tolist() for _ in range(k)]
    saved = stateful.state_dict()
    del it, stateful
    # torchdata's iterator holds a reference cycle: collected later, in a worker forked by then, it would try to
    # stop its workers from there (and wait for them)
    gc.collect()
    return got, saved


def resume(cache, state: dict, epoch: int, workers: int, **kwargs) -> tuple[list[list[int]], list[list[int]]]:
    """The rest of ``epoch`` from ``state``, then the next epoch, read by one resumed loader."""
    layout = {k: kwargs.pop(k) for k in ("rank", "world_size", "order", "batch_size") if k in kwargs}
    ds = dataset(cache, **layout)
    ds.set_epoch(epoch)
    stateful = loader(ds, workers, **kwargs)
    stateful.load_state_dict(state)
    rest = indices(stateful)
    ds.set_epoch(epoch + 1)
    return rest, indices(stateful)


@pytest.mark.parametrize(("workers", "persistent", "every"), [
    (1, False, 1), (2, False, 1), (3, False, 1), (2, True, 1), (3, True, 3), (2, False, 4)])
def test_a_resumed_stateful_dataloader_continues_the_stream_exactly(cache, workers, persistent, every):
    """Interrupted after k batches, at the start, in the middle, before and after the last batch: the batches read
    before, then those of the resumed loader, are the uninterrupted epoch's, and the next epoch is whole."""
    epoch = 1
    full = uninterrupted(cache, epoch)
    following = uninterrupted(cache, epoch + 1)
    assert len(full) == -(-N // B)
    ks = (0, 1, 5, len(full) - 1, len(full)) if (workers, persistent, every) == (2, False, 1) else (5, len(full) - 1)
    for k in ks:
        options = {"persistent_workers": persistent, "snapshot_every_n_steps": every}
        before, state = read_then_save(cache, k, epoch, workers, **options)
        rest, after = resume(cache, state, epoch, workers, **options)
        assert before + rest == full, (k, before, rest)
        assert after == following, k


def test_a_resumed_run_is_resumed_again(cache):
    """Saved, resumed, saved again in the resumed part of the epoch and resumed once more: still every sample
    once, in order."""
    full = uninterrupted(cache, 2)
    first, state = read_then_save(cache, 3, 2, 2)
    second, state = read_then_save(cache, 4, 2, 2, state=state)
    third, _ = read_then_save(cache, 1, 2, 2, state=state)
    rest, _ = resume(cache, state, 2, 2)
    assert first + second + rest == full
    assert third == rest[:1]


def test_each_rank_resumes_its_own_part(cache):
    """Two ranks, each with its own StatefulDataLoader of two workers: the resumed ranks read the rest of their
    own parts, together every sample of the epoch once, in equal numbers of batches (rank 0's state serves rank 1
    too: the ranks advance alike, so their workers' states are the same)."""
    full = {rank: uninterrupted(cache, 0, rank=rank, world_size=2) for rank in (0, 1)}
    parts = {}
    state0 = None
    for rank in (0, 1):
        before, state = read_then_save(cache, 3, 0, 2, rank=rank, world_size=2)
        state0 = state0 or state
        rest, _ = resume(cache, state0, 0, 2, rank=rank, world_size=2)
        assert before + rest == full[rank]
        parts[rank] = before + rest
    assert len(parts[0]) == len(parts[1])
    samples = sorted(i for rank in (0, 1) for batch in parts[rank] for i in batch)
    assert samples == list(range(N))


def test_the_shards_order_resumes_too(cache):
    full = uninterrupted(cache, 1, order="shards", window=2)
    ds = dataset(cache, order="shards", window=2)
    ds.set_epoch(1)
    stateful = loader(ds, 2)
    it = iter(stateful)
    before = [next(it)[-1].tolist() for _ in range(6)]
    state = stateful.state_dict()
    del it, stateful
    gc.collect()
    ds = dataset(cache, order="shards", window=2)
    ds.set_epoch(1)
    resumed = loader(ds, 2)
    resumed.load_state_dict(state)
    assert before + indices(resumed) == full


@pytest.mark.parametrize("workers", [1, 3])
def test_another_number_of_workers_is_refused(cache, workers):
    """torchdata hands a worker it has no state for none (it would read its share from the start again) and drops
    the states of workers it no longer has (their unread batches lost): refused, naming both numbers."""
    _, state = read_then_save(cache, 5, 0, 2)
    ds = dataset(cache)
    stateful = loader(ds, workers)
    stateful.load_state_dict(state)
    with refused(rf"saved with num_workers=2, and this DataLoader has num_workers={workers}"):
        next(iter(stateful))


def test_another_batch_layout_is_refused(cache):
    _, state = read_then_save(cache, 5, 0, 2)
    stateful = loader(dataset(cache, batch_size=2 * B), 2)
    stateful.load_state_dict(state)
    with refused(rf"saved with batch_size={B} \(now {2 * B}\)"):
        next(iter(stateful))
    stateful = loader(dataset(cache, rank=0, world_size=2), 2)
    stateful.load_state_dict(state)
    with refused(r"saved with world_size=1 \(now 2\)"):
        next(iter(stateful))


def worker_state(state: dict, worker: int = 0) -> dict:
    return state["_snapshot"]["_worker_snapshots"][f"worker_{worker}"]["dataset_state"]


def test_a_worker_state_is_refused_where_a_loops_belongs(cache):
    """A worker's state says how far that worker read its share: loaded into the dataset itself it would resume the
    whole loop there (half the epoch's remaining samples skipped, the other half read twice)."""
    _, state = read_then_save(cache, 5, 0, 2)
    one = worker_state(state, 1)
    assert one["worker"]["id"] == 1 and one["worker"]["batches"] == 2
    with pytest.raises(StateError, match=r"this is the state of DataLoader worker 1 of 2 .* load the "
                                         r"StatefulDataLoader's own state with its load_state_dict\(\)"):
        dataset(cache).load_state_dict(one)


@pytest.mark.parametrize(("change", "message"), [
    ({"id": 1}, r"worker 0 was handed the state of worker 1"),
    ({"batches": 8}, r"the worker state's batches must be 0 <= batches <= 7, got 8"),
    ({"batches": -1}, r"the worker state's batches must be"),
    ({"num_workers": "2"}, r"the worker state's num_workers must be"),
    ({"extra": 1}, r"holds \"worker\": a dict of exactly id, num_workers, batches"),
])
def test_an_edited_worker_state_is_refused(cache, change, message):
    """Worker 0 of two has 7 batches of the 13 (50 samples by 4): a count beyond its share, another worker's
    state or an odd field is one StateError from the worker, not a skip or a replay."""
    _, state = read_then_save(cache, 5, 0, 2)
    worker_state(state)["worker"].update(change)
    stateful = loader(dataset(cache), 2)
    stateful.load_state_dict(state)
    with refused(message):
        next(iter(stateful))


def test_a_workers_share_read_to_its_end_resumes_to_nothing_of_it(cache):
    """Worker 0 of two holds the epoch's 7 even-numbered batches: a state whose worker 0 says all 7 are read (edited
    to say so) resumes with worker 0 yielding none, and the resumed loop reads worker 1's rest only."""
    _, state = read_then_save(cache, 4, 0, 2)
    worker_state(state)["worker"]["batches"] = 7
    full = uninterrupted(cache, 0)
    rest, _ = resume(cache, state, 0, 2)
    assert rest == full[5::2]


def in_a_worker(call):
    def init(_: int) -> None:
        call(torch.utils.data.get_worker_info().dataset)
    return init


def test_a_loops_count_or_state_is_refused_in_a_worker(cache):
    """A worker reads its share only: the loop's count (batches_consumed=k) or a loop's state means nothing there."""
    ds = dataset(cache)
    state = ds.state_dict()
    for call, message in ((lambda d: d.state_dict(batches_consumed=2), r"state_dict\(batches_consumed=k\) was called "
                           r"in a DataLoader worker process"),
                          (lambda d: d.load_state_dict(state), r"load_state_dict\(\) was called in a DataLoader worker "
                           r"process with the state of a training loop")):
        stateful = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1, worker_init_fn=in_a_worker(call))
        with refused(message):
            next(iter(stateful))


def test_a_workers_state_before_any_batch_is_where_its_share_begins(cache):
    """Asked right after a resume, before the loop received anything, the loader's state is the loaded one: saved
    again and resumed, nothing is skipped or read twice."""
    full = uninterrupted(cache, 0)
    before, state = read_then_save(cache, 5, 0, 3)
    again, state = read_then_save(cache, 0, 0, 3, state=state)
    assert again == []
    for w in range(3):
        assert worker_state(state, w)["worker"]["batches"] == [2, 2, 1][w]
    rest, _ = resume(cache, state, 0, 3)
    assert before + rest == full


def test_workers_states_count_their_own_batches(cache):
    """After k batches received in order from two workers, worker w has yielded ceil((k - w) / 2) of them."""
    for k in itertools.chain(range(4), (12, 13)):
        _, state = read_then_save(cache, k, 0, 2)
        assert [worker_state(state, w)["worker"]["batches"] for w in (0, 1)] == [(k + 1) // 2, k // 2], k


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("k", [5, 13])
def test_a_state_saved_after_set_epoch_resumes_the_new_epoch(cache, persistent, k):
    """A step-based loop reads k batches of epoch 1 (all 13, or 5 and breaks), calls set_epoch(2) and saves before its
    next iter(): torchdata saves its last iteration as unfinished, which no worker saw moved on. Resumed with
    set_epoch(2) as the saved run was, the loader reads epoch 2 whole, every batch once (it read nothing, or epoch
    1's rest). Not in the uninterrupted order: torchdata asks the worker after the last one that yielded first."""
    ds = dataset(cache)
    ds.set_epoch(1)
    stateful = loader(ds, 2, persistent_workers=persistent)
    it = iter(stateful)
    for _ in range(k):
        next(it)
    ds.set_epoch(2)
    state = stateful.state_dict()
    del it, stateful
    gc.collect()
    rest, following = resume(cache, state, 2, 2, persistent_workers=persistent)
    assert sorted(rest) == sorted(uninterrupted(cache, 2))
    assert following == uninterrupted(cache, 3)


ROLLBACK = """
import sys
import datapipe
from torchdata.stateful_dataloader import StatefulDataLoader
ds = datapipe.StreamingDataset(sys.argv[1], batch_size=4, seed=3, return_index=True)
def indices(loader):
    return [b[-1].tolist() for b in loader]
ds.set_epoch(1)
loader = StatefulDataLoader(ds, batch_size=None, num_workers=2)
it = iter(loader)
for _ in range(int(sys.argv[2])):
    next(it)
saved = loader.state_dict()
del it
ds.set_epoch(2)
whole = indices(loader)
print("whole", len(whole), flush=True)
loader.load_state_dict(saved)  # back to epoch 1, without set_epoch(1)
assert sorted(indices(loader)) == sorted(whole)
print("rolled back", flush=True)
loader.load_state_dict(saved)
ds.set_epoch(1)
print("resumed", len(indices(loader)), flush=True)
"""


@pytest.mark.parametrize("k", [5, 13])
def test_a_rollback_to_an_earlier_epoch_without_its_set_epoch_is_said(cache, tmp_path, k):
    """A loop keeps a state after k batches of epoch 1, reads on into epoch 2 and loads the state back without
    set_epoch(1) (or saved after set_epoch(2), before its iter()): with num_workers=0 the state sets the epoch; a
    worker cannot, and reads the dataset's epoch 2 whole, with a ResumeWarning naming epoch 1 and the call that
    resumes it; none when epoch 1 was read whole (k=13). With set_epoch(1), epoch 1's rest. Run as a script: a
    worker's warning goes to its own standard error (under pytest a forked worker records it instead)."""
    import subprocess
    import sys

    script = tmp_path / "rollback.py"
    script.write_text(ROLLBACK)
    run = subprocess.run([sys.executable, str(script), str(cache), str(k)], capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["whole", "13", "rolled", "back", "resumed", str(13 - k)], run.stdout
    warned = "ResumeWarning: datapipe: the loader state resumes epoch 1" in run.stderr
    assert warned == (k < 13), run.stderr
    if warned:
        assert "call dataset.set_epoch(1) before iterating the resumed loader" in run.stderr


def test_a_state_of_a_later_epoch_than_the_dataset_is_refused(cache):
    """A resumed run that does not set the saved epoch (set_epoch missing, or a smaller one) would read another
    epoch's order from the start: refused in one line, naming both epochs and the call to make."""
    _, state = read_then_save(cache, 5, 3, 2)
    stateful = loader(dataset(cache), 2)
    stateful.load_state_dict(state)
    with refused(r"this loader state resumes epoch 3 \(DataLoader worker [01] had read [23] of its [67] batches\), "
                 r"but the dataset is set to epoch 0: call dataset.set_epoch\(3\)"):
        next(iter(stateful))


def test_a_rollback_in_the_same_run_is_no_repeated_epoch(cache, tmp_path):
    """A loop that keeps a state, reads the epoch to its end and goes back to the state (a rollback after a loss
    spike) reads the resumed part as meant: no RepeatedEpochWarning from the workers (as with num_workers=0).
    Run as a script: a worker's warning goes to its own standard error."""
    import subprocess
    import sys

    script = tmp_path / "rollback.py"
    script.write_text(
        "import datapipe\n"
        "from torchdata.stateful_dataloader import StatefulDataLoader\n"
        f"ds = datapipe.StreamingDataset({str(cache)!r}, batch_size={B}, seed=3)\n"
        "for persistent in (False, True):\n"
        "    ds.set_epoch(0)  # the second round's repeat of epoch 0 is meant\n"
        "    loader = StatefulDataLoader(ds, batch_size=None, num_workers=2, persistent_workers=persistent)\n"
        "    it = iter(loader)\n"
        "    for _ in range(5):\n"
        "        next(it)\n"
        "    saved = loader.state_dict()\n"
        "    rest = sum(1 for _ in it)\n"
        "    loader.load_state_dict(saved)\n"
        "    again = sum(1 for _ in loader)\n"
        "    assert rest == again == 8, (rest, again)\n"
        "    del it, loader\n"
        "print('read')\n")
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0 and "read" in run.stdout, run.stderr
    assert "RepeatedEpochWarning" not in run.stderr, run.stderr
